"""The engine's side of grammar compiles: a constrained request whose grammar is not in this process's cache (the
engine process has a cache of its own: a matcher cannot cross the pipe) compiles here, on two threads that the
tenants take in turns, one thread per tenant at most (opentinker.rpc.serving.fair_executor), and never on the
thread that submitted it: the server's event loop, or the engine process's reader, on which every other tenant's
submits, aborts and scores wait. A request whose grammar is cached gets its matchers at once; one that compiles
enters the engine's inbox when its matchers are made (after later requests that needed no compile), ends with
the compiler's message if its grammar fails, and is dropped if it is aborted meanwhile; either way its pins end
on the engine thread (engine.py handles a Submit that carries an error)."""

from __future__ import annotations

import concurrent.futures
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass

from opentinker.rpc.serving.fair_executor import FairExecutor
from opentinker.sampler_server.constraint import Grammars
from opentinker.sampler_server.inbox import Submit

log = logging.getLogger("opentinker.sampler")

ABORTED = "aborted while its grammar compiled"


@dataclass(slots=True)
class _Pending:
    message: Submit
    compile: concurrent.futures.Future[None] | None = None
    aborted: bool = False


class GrammarLane:
    def __init__(self, grammars: Grammars, ready: Callable[[Submit], None], workers: int = 2) -> None:
        """ready: hands a request to the engine thread (its inbox), from any thread."""
        self.grammars = grammars
        self._ready = ready
        self._threads = FairExecutor(0, thread_name="sampler-engine-grammar", workers=workers)  # bounded upstream
        self._lock = threading.Lock()
        self._pending: dict[str, _Pending] = {}  # request id -> its request, while its grammar compiles

    @property
    def num_waiting(self) -> int:
        """Samples waiting for their grammar."""
        with self._lock:
            return sum(len(p.message.sequences) for p in self._pending.values())

    def take(self, message: Submit) -> bool:
        """Gives each constrained sample of the request its matcher from the cache and returns True; if a grammar
        is not cached, returns False: the request compiles on the lane and goes to `ready` when it is done."""
        for seq in message.sequences:
            constraint = seq.params.constraint
            if constraint is not None and seq.matcher is None:
                seq.matcher = self.grammars.cached_matcher(constraint)
                if seq.matcher is None:
                    break
        else:
            return True
        request_id, tenant = message.sequences[0].request_id, message.sequences[0].tenant
        with self._lock:  # held until the entry is in: the compile's end takes it too
            pending = self._pending[request_id] = _Pending(message)
            pending.compile = self._threads.submit(tenant, lambda: self._compile(request_id, message))
        return False

    def abort(self, request_id: str) -> None:
        """A request that is still waiting for its grammar is dropped (its compile too, if not started yet)."""
        with self._lock:
            pending = self._pending.get(request_id)
            if pending is None:
                return
            pending.aborted = True
            if pending.compile is None or not pending.compile.cancel():
                return  # compiling: it is dropped when the compile ends
            del self._pending[request_id]
        self._ready(_failed(pending.message, ABORTED))

    def _compile(self, request_id: str, message: Submit) -> None:
        """On a lane thread: every constrained sample's matcher (one compile, then the cache)."""
        error = ""
        try:
            for seq in message.sequences:
                if seq.params.constraint is not None and seq.matcher is None:
                    seq.matcher = self.grammars.matcher(seq.params.constraint)
        except Exception as exc:  # the edge compiled it already: a broken library, or a bound crossed since
            log.warning("request %s: its constraint did not compile: %s", request_id, exc)
            error = f"the constraint did not compile: {exc}"[:2000]
        with self._lock:  # handed over under the lock: an abort after this finds it in the inbox, before its Abort
            pending = self._pending.pop(request_id, None)
            if pending is not None and pending.aborted:
                error = error or ABORTED
            self._ready(_failed(message, error) if error else message)

    def stop(self) -> None:
        self._threads.close()


def _failed(message: Submit, error: str) -> Submit:
    return Submit(message.sequences, message.on_update, error=error)
