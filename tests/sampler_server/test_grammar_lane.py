"""The engine's grammar compiles (grammar_lane.py): a request whose grammar is not cached is handed to the engine
only once compiled, on the lane's threads, never on the submitting thread; a cached one at once; one aborted
while waiting for its turn never compiles, one aborted while compiling is dropped after; a failed compile ends
the request with the compiler's message. Its pins end on the engine thread in every case (a Submit with an
error)."""

from __future__ import annotations

import queue
import threading
from typing import Any, cast

from opentinker.sampler_server.constraint import Constraint, Grammars
from opentinker.sampler_server.grammar_lane import ABORTED, GrammarLane
from opentinker.sampler_server.inbox import Submit
from opentinker.sampler_server.sequence import SamplingParams, Sequence


class SlowGrammars:
    """Compiles block until released; the cache holds what compiled; "bad" fails."""

    def __init__(self) -> None:
        self.compiled: list[str] = []
        self.threads: set[str] = set()
        self.cache: set[str] = set()
        self._release = threading.Semaphore(0)

    def cached_matcher(self, constraint: Constraint) -> object | None:
        return object() if constraint.source in self.cache else None

    def matcher(self, constraint: Constraint) -> object:
        if constraint.source in self.cache:
            return object()
        self.threads.add(threading.current_thread().name)
        if not self._release.acquire(timeout=30):
            raise TimeoutError(constraint.source)
        if constraint.source == "bad":
            raise ValueError("no such grammar")
        self.compiled.append(constraint.source)
        self.cache.add(constraint.source)
        return object()

    def release(self, n: int = 1) -> None:
        for _ in range(n):
            self._release.release()


def _request(request_id: str, tenant: str, source: str, samples: int = 2) -> Submit:
    params = SamplingParams(max_tokens=4, constraint=Constraint("regex", source))
    sequences = [Sequence(i, request_id, i, [1, 2], params, lora_slot=0, tenant=tenant) for i in range(samples)]
    return Submit(sequences, lambda update: None)


def _lane() -> tuple[SlowGrammars, GrammarLane, queue.SimpleQueue[Submit]]:
    grammars, ready = SlowGrammars(), queue.SimpleQueue[Submit]()
    return grammars, GrammarLane(cast(Grammars, grammars), ready.put), ready


def test_a_request_enters_the_engine_once_compiled_and_never_compiles_on_the_caller() -> None:
    grammars, lane, ready = _lane()
    first = _request("r1", "team-a", "a+")
    assert not lane.take(first) and lane.num_waiting == 2
    grammars.release()
    handed: Submit = ready.get(timeout=30)
    assert handed is first and not handed.error and all(s.matcher is not None for s in handed.sequences)
    assert grammars.compiled == ["a+"] and threading.current_thread().name not in grammars.threads
    assert lane.take(_request("r2", "team-b", "a+"))  # cached: at once, nothing compiled
    assert grammars.compiled == ["a+"] and lane.num_waiting == 0
    lane.stop()


def test_aborted_requests_are_dropped_and_failed_compiles_end_with_the_message() -> None:
    grammars, lane, ready = _lane()
    running, queued = _request("run", "team-a", "b+"), _request("queued", "team-a", "c+")
    assert not lane.take(running) and not lane.take(queued)  # one tenant: one compile at a time
    lane.abort("queued")  # not started: handed back at once, never compiled
    dropped: Submit = ready.get(timeout=30)
    assert dropped.sequences is queued.sequences and dropped.error == ABORTED
    lane.abort("run")  # compiling: dropped when it ends
    grammars.release()
    ended: Submit = ready.get(timeout=30)
    assert ended.sequences is running.sequences and ended.error == ABORTED
    assert grammars.compiled == ["b+"] and lane.num_waiting == 0
    bad = _request("bad", "team-b", "bad")
    assert not lane.take(bad)
    grammars.release()
    failed: Any = ready.get(timeout=30)
    assert failed.sequences is bad.sequences and "no such grammar" in failed.error
    lane.stop()
