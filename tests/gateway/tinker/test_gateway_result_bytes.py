"""Gateway bounds without servers: the bytes of finished results a tenant holds (--max-tenant-result-bytes), big
JSON bodies parsed off the event loop with the same answers, and failures that leave a model unchanged."""

from __future__ import annotations

import asyncio
import gc
import json
import threading

import grpc
import pytest

from opentinker.client.errors import OpenTinkerError
from opentinker.gateway.errors import GatewayError, RequestFailed, from_backend
from opentinker.gateway.tinker.futures import RESULT_OVERHEAD_BYTES, FutureStore, Outcome, result_size
from opentinker.gateway.tinker.models import Lane

KiB = 1024


def _finish(store: FutureStore, tenant: str, size: int) -> str:
    future = store.create(tenant)
    future.finish(Outcome(proto=bytes(size)))
    return future.request_id


def test_a_tenant_over_its_result_bytes_loses_its_own_oldest_results_only() -> None:
    async def scenario() -> None:
        store = FutureStore(max_result_bytes=10 * (KiB + RESULT_OVERHEAD_BYTES))
        team_b = [_finish(store, "b", KiB) for _ in range(3)]
        team_a = [_finish(store, "a", KiB) for _ in range(25)]
        # team-a keeps its 10 newest results; the 15 older ones are dropped, team-b's are all there.
        assert store.results.held("a") == 10 * (KiB + RESULT_OVERHEAD_BYTES)
        assert store.results.dropped_total["a"] == 15 and store.results.dropped_total["b"] == 0
        for request_id in team_a[15:]:
            assert (await store.wait(request_id, "a")).outcome == Outcome(proto=bytes(KiB))
        for request_id in team_b:
            assert (await store.wait(request_id, "b")).outcome == Outcome(proto=bytes(KiB))
        with pytest.raises(GatewayError) as caught:
            await store.wait(team_a[0], "a")
        assert (caught.value.status, caught.value.code) == (404, "RESULT_DROPPED")
        assert "--max-tenant-result-bytes" in caught.value.message
        with pytest.raises(GatewayError) as other:  # another tenant's dropped id reads as unknown
            await store.wait(team_a[0], "b")
        assert other.value.code == "UNKNOWN_REQUEST"

    asyncio.run(scenario())


def test_results_already_retrieved_go_first_and_the_newest_stays() -> None:
    async def scenario() -> None:
        store = FutureStore(max_result_bytes=3 * (KiB + RESULT_OVERHEAD_BYTES))
        first, second, third = (_finish(store, "a", KiB) for _ in range(3))
        await store.wait(second, "a")  # retrieved once: dropped before the unretrieved older one
        fourth = _finish(store, "a", KiB)
        assert store.results.was_dropped("a", second) and not store.results.was_dropped("a", first)
        for request_id in (first, third, fourth):
            await store.wait(request_id, "a")
        huge = _finish(store, "a", 100 * KiB)  # alone above the bound: kept, everything older dropped
        assert (await store.wait(huge, "a")).outcome == Outcome(proto=bytes(100 * KiB))
        assert store.results.held("a") == 100 * KiB + RESULT_OVERHEAD_BYTES

    asyncio.run(scenario())


def test_expired_and_refused_results_stop_counting_and_zero_means_no_bound() -> None:
    async def scenario() -> None:
        store = FutureStore(max_result_bytes=5 * (KiB + RESULT_OVERHEAD_BYTES))
        _finish(store, "a", KiB)
        store.discard(store.create("a"))  # refused before it was queued: holds nothing
        assert store.results.held("a") == KiB + RESULT_OVERHEAD_BYTES
        store.ttl_seconds = 0
        store.prune()
        assert store.results.held("a") == 0
        unbounded = FutureStore()
        ids = [_finish(unbounded, "a", 64 * KiB) for _ in range(50)]
        assert unbounded.results.dropped_total["a"] == 0
        assert (await unbounded.wait(ids[0], "a")).outcome is not None

    asyncio.run(scenario())


def test_result_sizes_count_every_kind_of_result() -> None:
    assert result_size(Outcome(proto=bytes(500))) == 500 + RESULT_OVERHEAD_BYTES
    assert result_size(Outcome(json={"metrics": {"loss": 1.5}})) == len('{"metrics": {"loss": 1.5}}') + 1024
    assert result_size(Outcome(failure=RequestFailed("x" * 10))) == 10 + RESULT_OVERHEAD_BYTES


def test_the_flag_reaches_the_future_store_and_zero_disables_it() -> None:
    from opentinker.gateway.config import GatewayConfig
    from opentinker.gateway.tinker.state import TinkerState

    def gateway(limit: int) -> TinkerState:
        return TinkerState(GatewayConfig(max_tenant_result_bytes=limit))

    assert gateway(5000).futures.results.max_bytes == 5000
    assert gateway(0).futures.results.max_bytes is None
    assert GatewayConfig().max_tenant_result_bytes == 1 << 30
    assert "max_tenant_result_bytes" not in GatewayConfig().limits()  # 0 is allowed


# --- JSON bodies above the inline threshold are parsed on a worker thread ------------------------------------


class _Request:
    """The two things json_body reads from an aiohttp request."""

    def __init__(self, gw: object, raw: bytes) -> None:
        from opentinker.gateway.state import GATEWAY

        self.app = {GATEWAY: gw}
        self._raw = raw

    async def read(self) -> bytes:
        return self._raw


def _answer(gw: object, raw: bytes) -> tuple[str, object]:
    """("ok", body) or (error code, message) of json_body, and the threads that parsed it."""
    from opentinker.gateway.bodies import json_body

    async def parse() -> tuple[str, object]:
        try:
            return "ok", await json_body(_Request(gw, raw))  # type: ignore[arg-type]
        except GatewayError as exc:
            return exc.code, exc.message

    return asyncio.run(parse())


def test_big_json_bodies_are_parsed_on_a_thread_with_the_same_answers(monkeypatch: pytest.MonkeyPatch) -> None:
    from opentinker.gateway import bodies, state
    from opentinker.gateway.auth import KeyStore
    from opentinker.gateway.backend import Backends

    gw = state.Gateway(KeyStore([]), Backends("x:1", "x:2", "x:3"))
    threads: list[str] = []
    parse = bodies.parse_json

    def spy(raw: bytes, *, max_bytes: int, max_string: int, yielding: bool = False) -> dict[str, object]:
        on_loop = threading.current_thread() is threading.main_thread()
        assert yielding is not on_loop  # the slower parse that gives the GIL away: on the worker thread only
        threads.append(threading.current_thread().name)
        return parse(raw, max_bytes=max_bytes, max_string=max_string, yielding=yielding)

    monkeypatch.setattr(bodies, "parse_json", spy)
    pad = " " * bodies.JSON_INLINE_BYTES  # the same documents, made big by whitespace
    documents = [
        b'{"tokens": ' + json.dumps(list(range(20_000))).encode() + b"}",
        b"[" * 100_000 + b"]" * 100_000,
        b'{"a": NaN}',
        b'{"s": "' + b"x" * 5000 + b'"}',
        b"[1, 2]",
        b"\xff{}",
        b"{" + b'"a":{' * 40 + b"}" * 41,
        b'{"n": ' + b"7" * 5000 + b"}",  # beyond Python's digits limit for int()
        b'{"f": [1.5, -2e300, 1e400, 0.1], "o": {"k": {"k": [true, null, "s"]}}, "k": 1, "k": 2}',
    ]
    for document in documents:
        threads.clear()
        small, big = _answer(gw, document), _answer(gw, document + pad.encode())
        assert small == big, document[:40]
        assert threads[-1] != threading.main_thread().name  # the padded one: off the event loop's thread
        if len(document) <= bodies.JSON_INLINE_BYTES:
            assert threads[0] == threading.main_thread().name
    assert _answer(gw, b"[" * 100_000 + b"]" * 100_000)[0] == "JSON_TOO_DEEP"
    assert gc.isenabled()  # the collector, paused during the threaded parses, runs again
    too_big = b" " * (gw.config.max_json_bytes + 1)
    threads.clear()
    assert _answer(gw, too_big)[0] == "BODY_TOO_LARGE" and threads == [threading.main_thread().name]


# --- a failed OptimStep the trainer undid does not poison the model's later requests --------------------------


def test_an_undone_optim_step_fails_alone_and_other_failures_still_poison() -> None:
    undone = from_backend(
        OpenTinkerError(grpc.StatusCode.FAILED_PRECONDITION, "weight too big", "WEIGHTS_OUT_OF_RANGE")
    )
    assert (undone.category, undone.poisons) == ("user", False)
    assert "FAILED_PRECONDITION/WEIGHTS_OUT_OF_RANGE" in undone.message
    other = from_backend(OpenTinkerError(grpc.StatusCode.FAILED_PRECONDITION, "x", "SOMETHING_ELSE"))
    assert other.poisons

    async def scenario(failure: RequestFailed) -> list[Outcome | None]:
        from opentinker.gateway.tinker.futures import Future

        lane = Lane("m")
        futures = [Future(request_id=str(i), tenant="t") for i in range(3)]

        def job(seq: int) -> object:
            async def run() -> Outcome:
                if seq == 2:
                    raise failure
                return Outcome(json={"seq": seq})

            return run

        for seq in (1, 2, 3):
            lane.submit(seq, futures[seq - 1], job(seq))  # type: ignore[arg-type]
        await asyncio.gather(*(f.done.wait() for f in futures))
        return [f.outcome for f in futures]

    after_undone = asyncio.run(scenario(undone))
    assert after_undone[2] == Outcome(json={"seq": 3})
    after_other = asyncio.run(scenario(other))
    assert after_other[2] is not None and after_other[2].failure is not None
    assert "seq_id 2" in after_other[2].failure.message
