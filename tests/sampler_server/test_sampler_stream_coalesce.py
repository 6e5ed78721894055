"""Sample streams: updates that queued while a client read slowly become one message per sample."""

from __future__ import annotations

from opentinker.sampler_server.engine import SequenceUpdate
from opentinker.sampler_server.sequence import SamplingParams, Sequence
from opentinker.sampler_server.service import coalesce


def _seq(index: int) -> Sequence:
    return Sequence(seq_id=index, request_id="r", sample_index=index, prompt=[1], params=SamplingParams(), lora_slot=0)


def test_coalesce_merges_each_samples_backlog_in_order() -> None:
    s0, s1 = _seq(0), _seq(1)
    backlog = [
        SequenceUpdate(s0, [5], [-0.5], "a", finished=False),
        SequenceUpdate(s1, [7], [-0.7], "x", finished=False),
        SequenceUpdate(s0, [6], [-0.6], "b", finished=False),
        SequenceUpdate(s1, [8, 9], [-0.8, -0.9], "yz", finished=True),
        SequenceUpdate(s0, [4], [-0.4], "", finished=True),
    ]
    merged = coalesce(backlog)
    assert [(u.seq.sample_index, u.tokens, u.logprobs, u.text, u.finished) for u in merged] == [
        (0, [5, 6, 4], [-0.5, -0.6, -0.4], "ab", True),
        (1, [7, 8, 9], [-0.7, -0.8, -0.9], "xyz", True),
    ]
    one = SequenceUpdate(s0, [3], [-0.3], "c", finished=False)
    assert coalesce([one]) == [one]  # nothing queued behind it: sent as it came


def test_coalesce_keeps_an_engine_error() -> None:
    s0 = _seq(0)
    merged = coalesce([SequenceUpdate(s0, [5], [-0.5], "a", False), SequenceUpdate(s0, [], [], "", True, error="boom")])
    assert len(merged) == 1 and merged[0].error == "boom" and merged[0].finished and merged[0].tokens == [5]
