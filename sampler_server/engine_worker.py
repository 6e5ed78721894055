"""The engine process's side of the pipe (engine_process.py): build the engine, feed it what the server sends,
and send back one report per engine iteration that changed anything."""

from __future__ import annotations

import concurrent.futures
import functools
import logging
import os
import signal
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection

import torch

from opentinker.rpc.process.children import die_with_parent
from opentinker.sampler_server.engine import Engine
from opentinker.sampler_server.engine_stats import EngineStats
from opentinker.sampler_server.slot_mirror import SlotMirror
from opentinker.sampler_server.slot_pool import SlotPool, SlotTensors
from opentinker.sampler_server.updates import SequenceUpdate

log = logging.getLogger("opentinker.sampler")

# Builds the engine inside the engine process, given its slot-release and end-of-iteration callbacks and the
# adapter slots it reads (the shared pool's tensors on the CPU, the engine process's device copy on CUDA).
EngineBuilder = Callable[[Callable[[int], None], Callable[[], None] | None, SlotTensors], Engine]


@dataclass(frozen=True, slots=True)
class EngineReport:
    """What the engine process sends after an iteration that changed anything."""

    updates: list[SequenceUpdate]
    released: list[int]  # adapter slots whose pin ended (one entry per pin)
    scored: list[tuple[int, list[float] | None, str]]  # (job, logprobs, error)
    received: int  # sequences taken from the pipe so far
    waiting: int
    running: int
    stats: EngineStats


class Outbox:
    """The engine process's side: collects what an iteration produced and sends it as one report."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self.engine: Engine | None = None
        self.updates: list[SequenceUpdate] = []
        self.released: list[int] = []
        self.scored: list[tuple[int, list[float] | None, str]] = []
        self.received = 0
        self._sent_counts = (0, 0, 0)
        self.scores: dict[int, concurrent.futures.Future[list[float]]] = {}

    def post(self, update: SequenceUpdate) -> None:  # engine thread
        self.updates.append(update)

    def release(self, slot: int) -> None:  # engine thread
        self.released.append(slot)

    def score_done(self, job: int, future: concurrent.futures.Future[list[float]]) -> None:  # engine thread
        self.scores.pop(job, None)
        if future.cancelled():
            return  # the server cancelled it: nobody waits for an answer
        error = future.exception()
        self.scored.append((job, None, f"{type(error).__name__}: {error}") if error else (job, future.result(), ""))

    def flush(self) -> None:  # engine thread, after each iteration
        engine = self.engine
        assert engine is not None
        counts = (self.received, engine.num_waiting, engine.num_running)
        if not (self.updates or self.released or self.scored) and counts == self._sent_counts:
            return
        report = EngineReport(self.updates, self.released, self.scored, *counts, engine.stats)
        self.updates, self.released, self.scored, self._sent_counts = [], [], [], counts
        self.conn.send(report)


def engine_main(
    conn: Connection, build: EngineBuilder, server_pid: int, pool: SlotPool, mirror_on: torch.device | None
) -> None:
    """The engine process: build the engine, then feed it what the server sends until "stop" or the pipe closes.
    mirror_on: the device its copy of the adapter slots lives on; None: it reads the shared pool itself."""
    die_with_parent(signal.SIGKILL)
    if os.getppid() != server_pid:
        return  # the server died before the line above took effect
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)  # the server process decides when its engine stops
    outbox = Outbox(conn)
    try:
        mirror = None if mirror_on is None else SlotMirror(pool, mirror_on)
        engine = build(outbox.release, outbox.flush, pool.tensors if mirror is None else mirror.tensors)
    except Exception as exc:
        log.exception("the sampler engine could not be built")
        conn.send(("failed", f"{type(exc).__name__}: {exc}"))
        return
    outbox.engine = engine
    conn.send(("ready", engine.kernel))  # the LoRA kernel it runs, which the server reports
    scores: dict[int, concurrent.futures.Future[list[float]]] = {}  # job -> the engine's score, until it ends
    outbox.scores = scores
    engine.start()
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            break  # the server process is gone
        kind = message[0]
        if kind == "submit":
            if mirror is not None:
                for slot in {seq.lora_slot for seq in message[1]}:
                    mirror.sync(slot)
            engine.submit(message[1], outbox.post)
            outbox.received += len(message[1])  # after the inbox has them: a waiting count may be high, never low
        elif kind == "abort":
            engine.abort(message[1])
        elif kind == "finish":
            engine.finish(message[1], message[2])
        elif kind == "score":
            job = message[1]
            if mirror is not None:
                mirror.sync(message[3])
            future = engine.score(message[2], message[3], message[4], message[5])
            scores[job] = future
            future.add_done_callback(functools.partial(outbox.score_done, job))
        elif kind == "cancel_score":
            cancelled = scores.get(message[1])
            if cancelled is not None:
                cancelled.cancel()  # aborts the score in the engine; its pin ends there
        else:
            break
    engine.stop()
