"""The engine in a process of its own (the sampler's default on the CPU).

The server process keeps gRPC, the registry, the adapter slot books and the loads; the engine process keeps the
model, the KV cache and the step loop. Each has its own GIL, so the server's Python per streamed message
(grpc.aio, protobuf, the request coroutines) no longer holds the engine up between two of its tensor ops: in
one process, 42 us of Python on another thread per streamed token slowed the engine's 32-stream run by 1.9 %,
and the real server spends more than that per message.

    server process                                      engine process (forked before any thread starts)
    submit / abort / score  ---- pipe ---->  reader thread -> Engine inbox -> engine thread: step()
    reader thread: callbacks, slot releases  <---- pipe ----  one message per engine iteration

The adapters' weights are in shared memory (`SlotPool(shared=True)`, made before the fork): the server writes a
version into a slot no sequence holds, and the engine reads it once a request naming that slot arrives through
the pipe, which orders the two. A slot's pin ends when the engine says the sequence let go of it.

The engine process dies with the server process (PR_SET_PDEATHSIG) and ignores the signals a terminal or a
process-group kill sends, so that a draining server still has its engine; if the engine process dies, every
request in flight ends with INTERNAL and the server shuts down (a supervisor restarts it). This file is the
server process's handle; engine_worker.py is the engine process's side.
"""

from __future__ import annotations

import concurrent.futures
import functools
import itertools
import logging
import multiprocessing
import os
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from opentinker.sampler_server.engine_stats import EngineStats
from opentinker.sampler_server.engine_worker import EngineBuilder, EngineReport, engine_main
from opentinker.sampler_server.kernels import Kernel
from opentinker.sampler_server.scoring import settle_score
from opentinker.sampler_server.sequence import Sequence
from opentinker.sampler_server.slot_pool import SlotPool
from opentinker.sampler_server.updates import SequenceUpdate, UpdateCallback

log = logging.getLogger("opentinker.sampler")


class EngineProcess:
    """The server process's handle on an engine in its own process; what the service calls on an `Engine`."""

    def __init__(
        self,
        build: EngineBuilder,
        pool: SlotPool,
        *,
        max_len: int,
        max_seqs: int,
        max_batch_tokens: int,
        device: torch.device,
        mirror_slots: bool | None = None,
    ) -> None:
        """Forks the engine process, which builds its engine (call before this process starts any thread: a fork
        copies only the calling thread, and a lock another thread held would stay locked in the child); then
        call wait_ready(). On CUDA this process must not have touched CUDA (a forked child of a process that did
        cannot use it): the pool is on the CPU, and the engine process copies the slots to its device
        (mirror_slots, default: when device is not the CPU; on the CPU only to test that path)."""
        self.pool = pool
        self.max_len = max_len
        self.max_seqs = max_seqs
        self.max_batch_tokens = max_batch_tokens
        self.device = device
        self.stats = EngineStats()
        if not pool.shared:
            raise ValueError("the engine process needs a SlotPool made with shared=True")
        threads = threading.active_count()
        if threads > 1:
            log.warning("forking the engine process while %d threads run", threads)
        ours, theirs = multiprocessing.Pipe()
        server_pid = os.getpid()
        self.pid = os.fork()
        if self.pid == 0:  # the engine process
            ours.close()
            code = 0
            try:
                mirror = mirror_slots if mirror_slots is not None else device.type != "cpu"
                engine_main(theirs, build, server_pid, pool, device if mirror else None)
            except BaseException:
                log.exception("the sampler engine process failed")
                code = 1
            finally:
                logging.shutdown()
                os._exit(code)  # never the server's atexit handlers or finally blocks
        theirs.close()
        self._conn = ours
        self._send_lock = threading.Lock()
        self._callbacks: dict[str, tuple[UpdateCallback, set[int]]] = {}  # request -> (callback, open samples)
        self._scores: dict[int, concurrent.futures.Future[list[float]]] = {}
        self._jobs = itertools.count()
        self._lock = threading.Lock()
        self._sent = 0  # sequences sent to the engine process
        self._report: EngineReport | None = None
        self._reader: threading.Thread | None = None
        self._stopping = False
        self.died = False  # the engine process exited while the server still served
        self._exit_code: int | None = None
        self.on_exit: Callable[[], None] | None = None  # called (reader thread) if the engine process dies
        self._kernel: Kernel | None = None  # the engine's, sent when it is ready

    def wait_ready(self) -> None:
        """Until the engine process has built its engine (model, KV cache); raises if it could not."""
        try:
            status = self._conn.recv()
        except EOFError:
            status = ("failed", "it exited")
        if status[0] != "ready":
            os.waitpid(self.pid, 0)
            raise SystemExit(f"opentinker sampler: the engine process failed to start: {status[1]}")
        self._kernel = status[1]

    @property
    def kernel(self) -> Kernel:
        """The LoRA kernel the engine process runs (known once wait_ready() returned)."""
        if self._kernel is None:
            raise RuntimeError("the engine process is not ready yet: call wait_ready()")
        return self._kernel

    # The Engine interface the service uses

    def submit(self, sequences: list[Sequence], on_update: UpdateCallback) -> None:
        with self._lock:
            self._callbacks[sequences[0].request_id] = (on_update, {seq.sample_index for seq in sequences})
            self._sent += len(sequences)
        if not self._send(("submit", sequences)):
            self._fail(sequences)

    def abort(self, request_id: str) -> None:
        with self._lock:
            self._callbacks.pop(request_id, None)
        self._send(("abort", request_id))

    def finish(self, request_id: str, sample_index: int) -> None:
        with self._lock:
            self._close(request_id, sample_index)
        self._send(("finish", request_id, sample_index))

    def _close(self, request_id: str, sample_index: int) -> None:
        """Marks one sample of a request ended (under the lock); nothing if it was not open."""
        entry = self._callbacks.get(request_id)
        if entry is None or sample_index not in entry[1]:
            return
        entry[1].discard(sample_index)
        if not entry[1]:
            del self._callbacks[request_id]

    def score(
        self, tokens: list[int], lora_slot: int, cache_key: str = "", tenant: str = ""
    ) -> concurrent.futures.Future[list[float]]:
        future: concurrent.futures.Future[list[float]] = concurrent.futures.Future()
        job = next(self._jobs)
        with self._lock:
            self._scores[job] = future
        if not self._send(("score", job, tokens, lora_slot, cache_key, tenant)):
            with self._lock:
                self._scores.pop(job, None)
            self.pool.release(lora_slot)
            future.set_exception(RuntimeError("the sampler engine process has exited"))
            return future
        future.add_done_callback(functools.partial(self._cancel_score, job))
        return future

    def _cancel_score(self, job: int, future: concurrent.futures.Future[list[float]]) -> None:
        if future.cancelled():  # the client went away: the engine process drops the score, and its pin ends there
            with self._lock:
                self._scores.pop(job, None)
            self._send(("cancel_score", job))

    @property
    def num_waiting(self) -> int:
        report = self._report
        if report is None:
            return self._sent
        return self._sent - report.received + report.waiting

    @property
    def num_running(self) -> int:
        report = self._report
        return 0 if report is None else report.running

    def start(self) -> None:
        self._reader = threading.Thread(target=self._read, name="sampler-engine-reader", daemon=True)
        self._reader.start()

    def stop(self) -> None:
        self._stopping = True
        self._send(("stop",))
        if self._reader is not None:
            self._reader.join(30)  # ends when the engine process closes its end, i.e. exits
        if self._reap(5.0) is None:  # still there: a hung step
            log.error("the sampler engine process did not stop; killing it")
            os.kill(self.pid, signal.SIGKILL)
            self._reap(5.0)
        self._conn.close()

    def _reap(self, timeout: float) -> int | None:
        """The engine process's exit code once it has exited (negative: killed by that signal), else None."""
        deadline = time.monotonic() + timeout
        while self._exit_code is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self._exit_code = os.waitstatus_to_exitcode(status)
            elif time.monotonic() >= deadline:
                break
            else:
                time.sleep(0.01)
        return self._exit_code

    # Server process side of the pipe

    def _send(self, message: tuple[Any, ...]) -> bool:
        try:
            with self._send_lock:
                self._conn.send(message)
        except (OSError, ValueError):  # the engine process is gone (or we closed the pipe)
            return False
        return True

    def _read(self) -> None:
        while True:
            try:
                report = self._conn.recv()
            except (EOFError, OSError):
                break
            try:
                self._deliver(report)
            except Exception:  # a failing callback must not end the delivery of everyone else's tokens
                log.exception("delivering an engine report failed")
        if not self._stopping:
            self._engine_died()

    def _deliver(self, report: EngineReport) -> None:
        self._report = report
        self.stats = report.stats
        for slot in report.released:
            self.pool.release(slot)
        for update in report.updates:
            with self._lock:
                entry = self._callbacks.get(update.request_id)
                if entry is not None and update.sample_index not in entry[1]:
                    entry = None  # the server ended this sample already (finish): what the engine made since goes
                elif entry is not None and update.finished:
                    self._close(update.request_id, update.sample_index)
            if entry is not None:
                entry[0](update)
        for job, logprobs, error in report.scored:
            with self._lock:
                future = self._scores.pop(job, None)
            if future is not None:  # the engine released the slot either way
                settle_score(future, RuntimeError(error) if logprobs is None else logprobs)

    def _engine_died(self) -> None:
        self.died = True
        code = self._reap(5.0)
        log.critical("the sampler engine process exited (code %s); failing the requests in flight", code)
        with self._lock:
            callbacks, self._callbacks = self._callbacks, {}
            scores, self._scores = self._scores, {}
        error = "the sampler engine process exited; see the server log"
        for request_id, (callback, open_samples) in callbacks.items():
            for index in sorted(open_samples):
                callback(SequenceUpdate(request_id, index, [], [], finished=True, error=error))
        for future in scores.values():
            settle_score(future, RuntimeError(error))
        if self.on_exit is not None:
            self.on_exit()

    def _fail(self, sequences: list[Sequence]) -> None:
        """Sequences that never reached the engine process: their pins end here."""
        with self._lock:
            entry = self._callbacks.pop(sequences[0].request_id, None)
        for seq in sequences:
            self.pool.release(seq.lora_slot)
            if entry is not None:
                entry[0](
                    SequenceUpdate(
                        seq.request_id,
                        seq.sample_index,
                        [],
                        [],
                        finished=True,
                        error="the sampler engine process has exited",
                    )
                )
