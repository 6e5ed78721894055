"""Sample streams: updates that queued while a client read slowly become one message per sample."""

from __future__ import annotations

from opentinker.sampler_server.sequence import StopReason
from opentinker.sampler_server.update_stream import coalesce
from opentinker.sampler_server.updates import SequenceUpdate


def test_coalesce_merges_each_samples_backlog_in_order() -> None:
    s0, s1 = 0, 1
    backlog = [
        SequenceUpdate("r", s0, [5], [-0.5], finished=False),
        SequenceUpdate("r", s1, [7], [-0.7], finished=False),
        SequenceUpdate("r", s0, [6], [-0.6], finished=False),
        SequenceUpdate("r", s1, [8, 9], [-0.8, -0.9], finished=True),
        SequenceUpdate("r", s0, [4], [-0.4], finished=True),
    ]
    merged = coalesce(backlog)
    assert [(u.sample_index, u.tokens, u.logprobs, u.finished) for u in merged] == [
        (0, [5, 6, 4], [-0.5, -0.6, -0.4], True),
        (1, [7, 8, 9], [-0.7, -0.8, -0.9], True),
    ]
    one = SequenceUpdate("r", s0, [3], [-0.3], finished=False)
    assert coalesce([one]) == [one]  # nothing queued behind it: sent as it came


def test_coalesce_keeps_an_engine_error() -> None:
    s0 = 0
    merged = coalesce(
        [SequenceUpdate("r", s0, [5], [-0.5], False), SequenceUpdate("r", s0, [], [], True, error="boom")]
    )
    assert len(merged) == 1 and merged[0].error == "boom" and merged[0].finished and merged[0].tokens == [5]


def test_coalesce_keeps_the_first_prompt_logprobs_and_the_last_stop_reason() -> None:
    first = SequenceUpdate("r", 0, [5], [-0.5], False, prompt_logprobs=[-1.0, -2.0])
    last = SequenceUpdate("r", 0, [6], [-0.6], True, stop_reason=StopReason.STOP_STRING)
    (merged,) = coalesce([first, last])
    assert (
        merged.prompt_logprobs == [-1.0, -2.0]
        and merged.stop_reason is StopReason.STOP_STRING
        and merged.tokens == [5, 6]
    )
