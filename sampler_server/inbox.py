"""The engine's inbox: what other threads send the engine thread (submit, abort, finish), taken in between two
steps, and the wait for the rest of a burst of requests.

An idle engine woken by a request first waits for the rest of its burst (`burst_wait`): concurrent clients (an
RL group, a batch of prompts) reach it spread over milliseconds, and a prefill step costs about as much for
one short prompt as for thirty (each step reads every weight), so starting on the first one alone costs a
whole extra step before the others get their first token.
"""

from __future__ import annotations

import queue
import time
from collections.abc import Callable
from dataclasses import dataclass

from opentinker.sampler_server.sequence import Sequence
from opentinker.sampler_server.updates import UpdateCallback


@dataclass(slots=True)
class Submit:
    sequences: list[Sequence]
    on_update: UpdateCallback
    error: str = ""  # set: the request ends with it, never queued (its grammar failed, or it was aborted meanwhile)


@dataclass(slots=True)
class Abort:
    request_id: str


@dataclass(slots=True)
class Finish:
    request_id: str
    sample_index: int


Message = Submit | Abort | Finish
Handler = Callable[[Message], None]


class Inbox:
    def __init__(self, messages: queue.SimpleQueue[Message | None] | None = None) -> None:
        """messages: the queue underneath (a test's scripted one); None: a new SimpleQueue."""
        self._queue: queue.SimpleQueue[Message | None] = queue.SimpleQueue() if messages is None else messages

    def put(self, message: Message | None) -> None:
        """Any thread; None wakes the engine thread to stop."""
        self._queue.put(message)

    def qsize(self) -> int:
        return self._queue.qsize()

    def drain(self, handle: Handler, *, block: bool) -> None:
        """Hands every message queued to `handle`; `block`: waits up to half a second for the first one."""
        try:
            message = self._queue.get(timeout=0.5) if block else self._queue.get_nowait()
        except queue.Empty:
            return
        while message is not None:
            handle(message)
            try:
                message = self._queue.get_nowait()
            except queue.Empty:
                return

    def await_burst(self, handle: Handler, burst_wait: float) -> None:
        """Takes in requests until none has come for `burst_wait`, for at most 10x that. Blocking here (not
        spinning) leaves the GIL to the threads that are still receiving the burst."""
        deadline = time.monotonic() + 10 * burst_wait
        while (left := deadline - time.monotonic()) > 0:
            try:
                message = self._queue.get(timeout=min(burst_wait, left))
            except queue.Empty:
                return
            if message is None:
                return
            handle(message)
