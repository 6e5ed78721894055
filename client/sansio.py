"""Sans-IO cores and their two drivers: a loop written once runs on the SDK's plain methods or its ``*_async`` twins.

A core is a generator that yields the calls it needs and is sent their results:

    def save(training: TrainingClient) -> Program[Version]:
        version = yield from call(training.save_snapshot, training.save_snapshot_async, metrics={})
        return version

    run(save(training))               # training.save_snapshot(metrics={})
    await run_async(save(training))   # await training.save_snapshot_async(metrics={})

`gather` runs several cores: in turn under `run`, concurrently (asyncio.gather) under `run_async`. A failed
call is thrown into the core at its yield, so the core sees the exception where plain code calling the method
would (and its ``with`` blocks exit then, not when the generator is collected).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Generator, Iterable
from dataclasses import dataclass
from typing import Any, ParamSpec, TypeAlias, TypeVar

__all__ = ["Program", "call", "gather", "run", "run_async"]

P = ParamSpec("P")
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class _Call:
    """``plain(*args, **kwargs)`` under `run`, ``await twin(*args, **kwargs)`` under `run_async`."""

    plain: Callable[..., Any]
    twin: Callable[..., Awaitable[Any]]
    args: tuple[Any, ...]
    kwargs: dict[str, Any]


@dataclass(frozen=True, slots=True)
class _Gather:
    programs: tuple[Program[Any], ...]


Program: TypeAlias = Generator[_Call | _Gather, Any, T]
"""A core returning T."""


def call(plain: Callable[P, T], twin: Callable[P, Awaitable[T]], *args: P.args, **kwargs: P.kwargs) -> Program[T]:
    """One call, as ``plain`` or as its async ``twin`` (same parameters)."""
    result: T = yield _Call(plain, twin, args, kwargs)
    return result


def gather(programs: Iterable[Program[T]]) -> Program[list[T]]:
    """Every program's result, in order."""
    results: list[T] = yield _Gather(tuple(programs))
    return results


def run(program: Program[T]) -> T:
    """Runs ``program`` with the plain calls."""
    try:
        effect = next(program)
        while True:
            try:
                if isinstance(effect, _Gather):
                    result: Any = [run(p) for p in effect.programs]
                else:
                    result = effect.plain(*effect.args, **effect.kwargs)
            except BaseException as error:
                effect = program.throw(error)
            else:
                effect = program.send(result)
    except StopIteration as stop:
        value: T = stop.value
        return value


async def run_async(program: Program[T]) -> T:
    """Runs ``program`` with the async twins; the programs of a `gather` run concurrently."""
    try:
        effect = next(program)
        while True:
            try:
                if isinstance(effect, _Gather):
                    result: Any = list(await asyncio.gather(*(run_async(p) for p in effect.programs)))
                else:
                    result = await effect.twin(*effect.args, **effect.kwargs)
            except BaseException as error:
                effect = program.throw(error)
            else:
                effect = program.send(result)
    except StopIteration as stop:
        value: T = stop.value
        return value
