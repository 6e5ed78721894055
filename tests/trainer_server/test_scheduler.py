"""The trainer's compute scheduler: FIFO per adapter, round-robin across adapters, one compute thread."""

from __future__ import annotations

import asyncio
import functools
import threading
import time

import pytest

from opentinker.trainer_server.scheduler import AdapterScheduler


def run(coro: object) -> object:
    return asyncio.run(coro)  # type: ignore[arg-type]


def test_fifo_per_adapter_and_round_robin_across_adapters() -> None:
    order: list[str] = []
    counts: list[tuple[int, int]] = []  # (running, queued): what the opentinker_trainer_jobs gauge reports

    async def main() -> None:
        scheduler = AdapterScheduler()
        scheduler.start()
        gate = threading.Event()

        # The first job blocks the compute thread until every other request is queued.
        def record(label: str, wait: bool = False) -> None:
            if wait:
                gate.wait(5)
            order.append(label)

        first = asyncio.ensure_future(scheduler.run("a", functools.partial(record, "a0", wait=True)))
        await asyncio.sleep(0.05)
        jobs = [asyncio.ensure_future(scheduler.run("a", functools.partial(record, f"a{i}"))) for i in range(1, 4)]
        jobs += [asyncio.ensure_future(scheduler.run("b", functools.partial(record, f"b{i}"))) for i in range(2)]
        jobs += [asyncio.ensure_future(scheduler.run("c", functools.partial(record, "c0")))]
        await asyncio.sleep(0.05)
        counts.append((scheduler.running, scheduler.queued))
        gate.set()
        await asyncio.gather(first, *jobs)
        counts.append((scheduler.running, scheduler.queued))
        await scheduler.stop()

    run(main())
    assert counts == [(1, 6), (0, 0)]
    assert order[0] == "a0"
    # Each adapter's own requests keep their arrival order...
    for adapter in "abc":
        mine = [x for x in order if x[0] == adapter]
        assert mine == sorted(mine)
    # ...and a long queue for "a" does not make "b" and "c" wait behind all of it.
    assert order.index("b0") < order.index("a3") and order.index("c0") < order.index("a3")


def test_jobs_parts_and_undos_all_run_on_the_one_compute_thread_and_errors_reach_their_caller() -> None:
    """Every adapter's work, a request in parts, the undo of a failed part: all on the scheduler's one compute
    thread (the base model routes one adapter's LoRA weights at a time, so two jobs at once would mix them),
    none on the event loop's thread, none overlapping."""
    ran: list[tuple[int, str]] = []  # (thread id, what ran) in order
    active = 0
    peak = 0
    lock = threading.Lock()

    def mark(what: str) -> None:
        ran.append((threading.get_ident(), what))

    def work() -> int:
        nonlocal active, peak
        with lock:
            active += 1
            peak = max(peak, active)
        mark("work")
        time.sleep(0.002)  # long enough for a second thread, if there were one, to overlap
        with lock:
            active -= 1
        return 1

    def fail() -> int:
        mark("fail")
        raise ValueError("bad batch")

    def undo(done: list[int]) -> None:
        mark(f"undo {len(done)}")

    async def main() -> tuple[list[object], int]:
        scheduler = AdapterScheduler()
        scheduler.start()
        results = await asyncio.gather(
            *(scheduler.run(name, work) for name in ("a", "b", "c", "d") for _ in range(3)),
            scheduler.run_parts("p", [work, work, fail], undo=undo),
            scheduler.run("e", fail),
            return_exceptions=True,
        )
        await scheduler.stop()
        return list(results), threading.get_ident()

    outcome = run(main())
    assert isinstance(outcome, tuple)
    results, loop_thread = outcome
    assert results[:12] == [1] * 12
    assert isinstance(results[12], ValueError) and isinstance(results[13], ValueError)
    assert sorted(what for _, what in ran) == sorted(["work"] * 14 + ["fail", "fail", "undo 2"])
    threads = {thread for thread, _ in ran}
    assert len(threads) == 1 and loop_thread not in threads, threads
    assert peak == 1


def test_cancelled_request_is_skipped() -> None:
    ran: list[str] = []

    async def main() -> None:
        scheduler = AdapterScheduler()
        scheduler.start()
        gate = threading.Event()
        blocker = asyncio.ensure_future(scheduler.run("a", lambda: gate.wait(5)))
        await asyncio.sleep(0.05)
        doomed = asyncio.ensure_future(scheduler.run("a", lambda: ran.append("doomed")))
        await asyncio.sleep(0.01)
        doomed.cancel()  # the client gave up (deadline) while queued
        gate.set()
        await blocker
        await scheduler.run("a", lambda: ran.append("after"))
        await scheduler.stop()
        with pytest.raises(asyncio.CancelledError):
            await doomed

    run(main())
    assert ran == ["after"]


def test_a_job_in_parts_lets_other_adapters_run_between_its_parts() -> None:
    order: list[str] = []

    async def main() -> list[str]:
        scheduler = AdapterScheduler()
        scheduler.start()
        gate = threading.Event()

        def record(label: str, wait: bool = False) -> str:
            if wait:
                gate.wait(5)
            order.append(label)
            return label

        blocker = asyncio.ensure_future(scheduler.run("z", functools.partial(record, "z0", wait=True)))
        await asyncio.sleep(0.05)
        big = asyncio.ensure_future(scheduler.run_parts("a", [functools.partial(record, f"a.{i}") for i in range(3)]))
        later = asyncio.ensure_future(scheduler.run("a", functools.partial(record, "a-next")))
        others = [asyncio.ensure_future(scheduler.run("b", functools.partial(record, f"b{i}"))) for i in range(3)]
        await asyncio.sleep(0.05)
        gate.set()
        parts = await big
        await asyncio.gather(blocker, later, *others)
        await scheduler.stop()
        return parts

    assert run(main()) == ["a.0", "a.1", "a.2"]
    assert order == ["z0", "a.0", "b0", "a.1", "b1", "a.2", "b2", "a-next"]


def test_a_job_in_parts_whose_caller_gave_up_is_undone() -> None:
    undone: list[list[str]] = []

    async def main() -> None:
        scheduler = AdapterScheduler()
        scheduler.start()
        gate = threading.Event()

        def part(label: str) -> str:
            gate.wait(5)
            return label

        big = asyncio.ensure_future(
            scheduler.run_parts("a", [functools.partial(part, f"a.{i}") for i in range(3)], undo=undone.append)
        )
        await asyncio.sleep(0.05)  # a.0 is running
        big.cancel()
        gate.set()
        for _ in range(500):
            if undone:
                break
            await asyncio.sleep(0.01)
        await scheduler.stop()

    run(main())
    assert undone == [["a.0"]]  # the part that ran is reverted; the others never run
