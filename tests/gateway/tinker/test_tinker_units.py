"""Tinker-surface pieces without servers: tinker protobuf conversion, zstd limits, per-model ordering, sessions,
per-tenant request caps, the expiry sweep."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import zstandard
from tinker.proto import tinker_public_pb2 as tpb

from opentinker.gateway.errors import GatewayError, RequestFailed
from opentinker.gateway.tinker import convert
from opentinker.gateway.tinker.futures import Future, Job, Outcome
from opentinker.gateway.tinker.models import Lane
from opentinker.v1 import common_pb2, trainer_pb2


def _datum_message() -> tpb.ForwardBackwardRequest:
    message = tpb.ForwardBackwardRequest(model_id="m", seq_id=1, loss_fn="cross_entropy")
    datum = message.data.add()
    datum.model_input.add().encoded_text.tokens = np.array([1, 2], dtype=np.int32).tobytes()
    datum.model_input.add().encoded_text.tokens = np.array([3], dtype=np.int32).tobytes()
    targets = datum.loss_fn_inputs["target_tokens"]
    targets.dtype, targets.dense = tpb.DTYPE_INT64, np.array([2, 3, 4], dtype=np.int64).tobytes()
    targets.shape.append(3)
    weights = datum.loss_fn_inputs["weights"]  # sparse CSR [1, 3]: only the last cell set
    weights.dtype = tpb.DTYPE_FLOAT32
    weights.shape.extend([1, 3])
    weights.sparse_csr.values = np.array([0.5], dtype=np.float32).tobytes()
    weights.sparse_csr.crow_indices = np.array([0, 1], dtype=np.int64).tobytes()
    weights.sparse_csr.col_indices = np.array([2], dtype=np.int64).tobytes()
    message.loss_fn_config_v2["clip_low_threshold"].number = 0.7
    return message


def test_forward_backward_request_converts_to_datums() -> None:
    message = convert.parse_forward_backward(_datum_message().SerializeToString())
    (datum,) = convert.datums(message)
    assert [t for c in datum.model_input.chunks for t in c.encoded_text.tokens] == [1, 2, 3]
    assert list(datum.loss_fn_inputs["target_tokens"].int64_values) == [2, 3, 4]
    assert list(datum.loss_fn_inputs["weights"].float32_values) == [0.0, 0.0, 0.5]
    assert convert.loss_fn_config(message) == pytest.approx({"clip_low_threshold": 0.7})
    bad = _datum_message()
    bad.data[0].loss_fn_inputs["weights"].shape[:] = [2, 3]
    with pytest.raises(RequestFailed, match="sparse"):
        convert.datums(bad)
    image = _datum_message()
    image.data[0].model_input.add().image.data = b"png"
    with pytest.raises(RequestFailed, match="image chunks are not supported"):
        convert.datums(image)
    with pytest.raises(GatewayError) as caught:
        convert.parse_forward_backward(b"\x0a\xff")
    assert caught.value.status == 400


def test_zstd_bodies_are_decoded_and_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    body = _datum_message().SerializeToString()
    assert convert.decompress(zstandard.ZstdCompressor().compress(body), "zstd") == body
    monkeypatch.setattr(convert, "MAX_BODY_BYTES", 16)
    with pytest.raises(GatewayError, match="exceeds"):
        convert.decompress(zstandard.ZstdCompressor().compress(body), "zstd")
    with pytest.raises(GatewayError, match="Content-Encoding"):
        convert.decompress(body, "br")


def test_forward_backward_output_reads_back_in_the_sdk() -> None:
    from tinker.proto.response_conv import deserialize_forward_backward_output

    outputs = [
        trainer_pb2.LossFnOutput(tensors={"logprobs": common_pb2.TensorData(float32_values=row)})
        for row in ([-1.0, -2.0], [-0.5], [-3.0, -0.25, -1.5])
    ]
    result = deserialize_forward_backward_output(convert.forward_backward_output(outputs, {"loss:sum": 2.5}))
    assert [o["logprobs"].data for o in result.loss_fn_outputs] == [[-1.0, -2.0], [-0.5], [-3.0, -0.25, -1.5]]
    assert result.metrics == {"loss:sum": 2.5}


def test_lane_runs_in_seq_order_and_a_failure_poisons_later_requests() -> None:
    async def scenario() -> tuple[list[int], list[Outcome | None]]:
        lane, ran = Lane("m"), []
        futures = [Future(request_id=str(i), tenant="t") for i in range(4)]

        def job(seq: int) -> Job:
            async def run() -> Outcome:
                ran.append(seq)
                if seq == 2:
                    raise RequestFailed("boom")
                return Outcome(json={"seq": seq})

            return run

        for seq in (3, 1, 4, 2):  # chunks arrive out of order
            lane.submit(seq, futures[seq - 1], job(seq))
        assert lane.resent(3) == "2"
        with pytest.raises(GatewayError):
            lane.submit(2, futures[0], job(2))
        await asyncio.gather(*(f.done.wait() for f in futures))
        return ran, [f.outcome for f in futures]

    ran, outcomes = asyncio.run(scenario())
    assert ran == [1, 2]  # 3 and 4 never ran: poisoned by 2
    assert outcomes[0] is not None and outcomes[0].json == {"seq": 1}
    assert outcomes[1] is not None and outcomes[1].failure is not None and outcomes[1].failure.message == "boom"
    for later in outcomes[2:]:
        assert later is not None and later.failure is not None and "seq_id 2) failed: boom" in later.failure.message


def test_lane_bounds_its_window_and_pending_bytes_and_expires_a_stalled_gap() -> None:
    async def scenario() -> None:
        lane = Lane("m", window=4, max_pending_bytes=10)

        async def run() -> Outcome:
            return Outcome(json={})

        futures = [Future(request_id=str(i), tenant="t") for i in range(4)]
        lane.submit(2, futures[0], run, 6)  # seq_id 1 never comes
        with pytest.raises(GatewayError) as too_much:
            lane.submit(3, futures[1], run, 6)
        with pytest.raises(GatewayError) as too_far:
            lane.submit(5, futures[1], run, 1)
        assert (too_much.value.status, too_much.value.code) == (429, "TOO_MUCH_PENDING")
        assert (too_far.value.status, too_far.value.code) == (400, "SEQ_ID_TOO_FAR_AHEAD")
        lane.submit(4, futures[2], run, 4)
        await asyncio.sleep(0)  # the drain finds seq_id 1 missing: the lane is stalled
        assert lane.pending_bytes == 10 and lane.stalled_since is not None
        assert lane.expire(lane.stalled_since, "gone") == 0  # not stalled long enough
        assert lane.expire(lane.stalled_since + 1, "gone") == 10
        assert lane.pending == {} and lane.pending_bytes == 0
        lane.submit(1, futures[3], run, 1)  # the gap's own request fails at once: nothing is kept
        for future in (futures[0], futures[2], futures[3]):
            assert future.outcome is not None and future.outcome.failure is not None
            assert future.outcome.failure.message == "model m: gone"

    asyncio.run(scenario())


def test_sessions_are_capped_per_tenant_and_expire_without_heartbeats() -> None:
    from opentinker.gateway.tinker.sessions import SessionTable

    table = SessionTable()
    first = table.create("a", "0.38.0", limit=2)
    table.create("a", "0.38.0", limit=2)
    with pytest.raises(GatewayError) as caught:
        table.create("a", "0.38.0", limit=2)
    assert (caught.value.status, caught.value.code) == (429, "TOO_MANY_SESSIONS")
    table.create("b", "0.38.0", limit=2)  # another tenant is not held back
    now = first.last_heartbeat + 100
    assert len(table.expire(now, now - 1000)) == 3  # no heartbeats: all expire ...
    with pytest.raises(GatewayError) as gone:
        table.heartbeat(first.session_id, "a")
    assert gone.value.status == 410  # ... a heartbeat is told so (the SDK stops its loop) ...
    fresh = table.create("a", "0.38.0", limit=2)  # ... and they no longer count
    fresh.last_heartbeat = now + 500
    assert table.expire(now + 1, now + 1) == set() and len(table) == 1  # forgotten later


def test_unfinished_requests_are_capped_per_tenant_and_refusals_release_their_place() -> None:
    from opentinker.gateway.tinker.futures import FutureStore

    async def scenario() -> None:
        store = FutureStore(max_inflight=2)
        first, _ = store.create("a"), store.create("a")
        with pytest.raises(GatewayError) as caught:
            store.create("a")
        assert (caught.value.status, caught.value.code, caught.value.retry) == (429, "TOO_MANY_REQUESTS", True)
        store.create("b")  # another tenant is not held back
        first.finish(Outcome(json={}))
        refused = store.create("a")  # a finished request frees its place ...
        store.discard(refused)  # ... and so does one refused before it was queued
        assert store.inflight("a") == 1
        with pytest.raises(GatewayError):
            store.get(refused.request_id, "a")

    asyncio.run(scenario())


def test_a_sweep_fails_stalled_lanes_expires_silent_sessions_and_prunes_old_futures() -> None:
    from opentinker.gateway.config import GatewayConfig
    from opentinker.gateway.tinker.expiry import sweep
    from opentinker.gateway.tinker.models import TrainingModel
    from opentinker.gateway.tinker.state import TinkerState

    async def scenario() -> None:
        gw = TinkerState(GatewayConfig())
        session = gw.sessions.create("a", "0.38.0")
        lane = gw.lane(f"{session.session_id}:train:0")
        gw.models.add(TrainingModel(lane.model_id, "a", session.session_id, "a/x", common_pb2.LoraConfig(), "m", lane))

        async def run() -> Outcome:
            return Outcome(json={})

        parked = gw.futures.create("a")
        lane.submit(2, parked, run, 100)
        old = gw.futures.create("a")
        old.finish(Outcome(json={}))
        await asyncio.sleep(0)
        assert lane.stalled_since is not None
        swept = sweep(gw, lane.stalled_since + gw.config.pending_ttl_seconds + 1)
        assert (swept.stalled_models, swept.freed_bytes, swept.expired_sessions) == (1, 100, 0)
        assert parked.outcome is not None and parked.outcome.failure is not None
        later = session.last_heartbeat + gw.config.session_ttl_seconds + 1
        assert sweep(gw, later).expired_sessions == 1
        assert gw.models.find(lane.model_id) is None
        gw.futures.ttl_seconds = 0
        gw.futures.prune()
        with pytest.raises(GatewayError):
            gw.futures.get(old.request_id, "a")

    asyncio.run(scenario())


def test_tinker_top_p_zero_is_greedy() -> None:
    """The sampler reads top_p 0 as "off" (proto3 has no unset float): the tinker surface sends greedy instead,
    the limit of a shrinking nucleus, for 0 and for a top_p too small for float32 alike."""
    for tiny in (0, 0.0, 1e-50):
        params = convert.sampling_params({"temperature": 0.8, "top_p": tiny, "seed": 3}, 16)
        assert params.HasField("temperature") and params.temperature == 0.0, tiny
    kept = convert.sampling_params({"temperature": 0.5, "top_p": 0.25}, 16)
    assert kept.temperature == 0.5 and kept.top_p == 0.25
    default = convert.sampling_params({"temperature": 0.5}, 16)
    assert default.temperature == 0.5 and default.top_p == 1.0
