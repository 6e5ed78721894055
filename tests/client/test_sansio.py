"""Tests for opentinker.client.sansio: one core, run on plain calls or on their async twins."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from opentinker.client.sansio import Program, call, gather, run, run_async


class Counter:
    def __init__(self) -> None:
        self.calls: list[str] = []

    def add(self, a: int, b: int = 0) -> int:
        self.calls.append("plain")
        return a + b

    async def add_async(self, a: int, b: int = 0) -> int:
        self.calls.append("twin")
        return a + b

    def fail(self) -> int:
        raise KeyError("plain")

    async def fail_async(self) -> int:
        raise KeyError("twin")


def _sum(counter: Counter) -> Program[int]:
    first = yield from call(counter.add, counter.add_async, 1, b=2)
    rest = yield from gather(call(counter.add, counter.add_async, first, b=i) for i in range(3))
    return first + sum(rest)


def test_one_core_runs_on_plain_calls_or_on_their_twins() -> None:
    plain, twin = Counter(), Counter()
    assert run(_sum(plain)) == asyncio.run(run_async(_sum(twin))) == 3 + 3 + 4 + 5
    assert plain.calls == ["plain"] * 4 and twin.calls == ["twin"] * 4


def test_gather_runs_the_twins_concurrently() -> None:
    async def main() -> list[str]:
        a_ready, b_ready = asyncio.Event(), asyncio.Event()

        def never(_: asyncio.Event, __: asyncio.Event) -> str:
            raise AssertionError("the plain call under run_async")

        async def meet(mine: asyncio.Event, other: asyncio.Event) -> str:
            mine.set()
            await other.wait()  # in turn, the first would wait for ever
            return "met"

        core = gather([call(never, meet, a_ready, b_ready), call(never, meet, b_ready, a_ready)])
        return await asyncio.wait_for(run_async(core), timeout=5)

    assert asyncio.run(main()) == ["met", "met"]


def test_a_failed_call_is_raised_in_the_core_at_its_yield() -> None:
    exits: list[str] = []

    @contextmanager
    def scope() -> Iterator[None]:
        try:
            yield
        finally:
            exits.append("exit")

    def recovering(counter: Counter) -> Program[str]:
        try:
            yield from call(counter.fail, counter.fail_async)
        except KeyError as error:
            return f"caught {error}"
        return "not raised"

    def failing(counter: Counter) -> Program[int]:
        with scope():
            value = yield from call(counter.fail, counter.fail_async)
        return value

    assert run(recovering(Counter())) == "caught 'plain'"
    assert asyncio.run(run_async(recovering(Counter()))) == "caught 'twin'"
    with pytest.raises(KeyError, match="plain"):
        run(failing(Counter()))
    assert exits == ["exit"]  # the core's with block exited before the error left run
    with pytest.raises(KeyError, match="twin"):
        asyncio.run(run_async(failing(Counter())))
    assert exits == ["exit", "exit"]
