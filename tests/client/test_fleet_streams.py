"""How a broken stream is continued (client/fleet_sampling.py), without servers: the legs built from what was
delivered, the cases that cannot be continued exactly, and the @latest floor."""

from __future__ import annotations

import time

import grpc
import pytest

from opentinker.client import RegistryClient
from opentinker.client.errors import OpenTinkerError
from opentinker.client.fleet_sampling import FLOOR_TTL_S, FleetConnection, _Leg, _Stream, adapter_of
from opentinker.v1 import common_pb2, sampler_pb2

BROKEN = OpenTinkerError(grpc.StatusCode.UNAVAILABLE, "the replica went away")


def _request(**fields: object) -> sampler_pb2.SampleRequest:
    values: dict[str, object] = {"model": "team/agent@latest", "num_samples": 2, "prompt_logprobs": True}
    values.update(fields)
    request = sampler_pb2.SampleRequest(
        sampling_params=sampler_pb2.SamplingParams(max_tokens=10, stop_token_ids=[2], logprobs=True),
        **values,  # type: ignore[arg-type]
    )
    if not request.prompt_text:
        request.prompt.chunks.add().encoded_text.tokens.extend([5, 6, 7])
    return request


def _message(index: int, tokens: list[int], *, stop: bool = False) -> sampler_pb2.SampleResponse:
    return sampler_pb2.SampleResponse(
        sample_index=index,
        tokens=tokens,
        stop_reason=sampler_pb2.STOP_REASON_STOP_TOKEN if stop else sampler_pb2.STOP_REASON_UNSPECIFIED,
        version=common_pb2.ResolvedVersion(adapter="team/agent", version=4),
    )


def test_unfinished_samples_continue_from_what_was_delivered_on_the_exact_version() -> None:
    original = _request()
    stream, leg = _Stream(original), _Leg(original, [0, 1])
    stream.received(leg, _message(0, [11, 12]))
    stream.received(leg, _message(1, [21, 2], stop=True))  # sample 1 is done
    stream.received(leg, _message(0, [13]))
    (rest,) = stream.continuations(leg, BROKEN)
    assert rest.indexes == [0]
    request = rest.request
    assert request.model == "team/agent@4" and request.num_samples == 1 and not request.prompt_logprobs
    assert [t for c in request.prompt.chunks for t in c.encoded_text.tokens] == [5, 6, 7, 11, 12, 13]
    assert request.sampling_params.max_tokens == 7 and list(request.sampling_params.stop_token_ids) == [2]
    assert request.sampling_params.logprobs
    # A continued leg's messages come back under the caller's index.
    assert stream.received(rest, _message(0, [14])).sample_index == 0
    assert original.model == "team/agent@latest"  # the caller's request is untouched


def test_nothing_delivered_is_the_same_request_and_a_text_prompt_is_not_extended() -> None:
    original = _request()
    leg = _Leg(original, [0, 1])
    assert _Stream(original).continuations(leg, BROKEN) == [leg]
    text = _request(prompt_text="hello")
    stream, leg = _Stream(text), _Leg(text, [0, 1])
    assert stream.continuations(leg, BROKEN) == [leg]  # before the first token: retried as it is
    stream.received(leg, _message(0, [11]))
    with pytest.raises(OpenTinkerError) as raised:
        stream.continuations(leg, BROKEN)
    assert raised.value is BROKEN


def test_latest_never_goes_backwards_across_replicas() -> None:
    with RegistryClient("127.0.0.1:9") as registry:  # never called: the floor is the client's own memory
        fleet = FleetConnection(registry)
        leg = _Leg(_request(), [0, 1])
        assert fleet._pinned(leg, _message(0, [1])) is None  # version 4 seen: the floor is 4
        older = _message(0, [1])
        older.version.version = 3
        again = fleet._pinned(leg, older)
        assert again is not None and again.request.model == "team/agent@4" and again.indexes == [0, 1]
        exact = _Leg(_request(model="team/agent@3"), [0])
        assert fleet._pinned(exact, older) is None  # name@N stays exact
        for rolled_back in ("team/agent@stable", "team/agent"):  # a rollback of these must take effect
            assert fleet._pinned(_Leg(_request(model=rolled_back), [0]), older) is None
        fleet._floor["team/agent"] = (4, time.monotonic() - FLOOR_TTL_S - 1)  # long ago: a rollback of latest
        assert fleet._pinned(leg, older) is None and fleet._floor["team/agent"][0] == 3
        fleet.close()
    assert adapter_of("base") is None and adapter_of("team/agent@7") == "team/agent" and adapter_of("a") == "a"
