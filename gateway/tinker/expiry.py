"""What the gateway forgets on its own: requests stalled behind a seq_id that never came, sessions whose SDK
stopped sending heartbeats (the SDK sends one every 10 s), and old finished futures. A sweep runs a few times per
the shorter TTL (at least every 30 s)."""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import logging
import time
from dataclasses import dataclass, field

from opentinker.gateway.tinker.state import TinkerState

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Swept:
    stalled_models: int
    freed_bytes: int
    expired_sessions: int
    expired: set[str] = field(default_factory=set)  # their ids


def sweep(gw: TinkerState, now: float | None = None) -> Swept:
    now = time.monotonic() if now is None else now
    config = gw.config
    pending_ttl, session_ttl = config.pending_ttl_seconds, config.session_ttl_seconds
    freed, stalled = 0, 0
    for lane in gw.models.lanes():
        bytes_ = lane.expire(
            now - pending_ttl,
            f"seq_id {lane.next_seq} did not arrive within {pending_ttl:g} s; the requests after it failed",
        )
        stalled += 1 if bytes_ else 0
        freed += bytes_
    gw.futures.prune()  # here, not on every request: it walks every future
    expired = gw.sessions.expire(now - session_ttl, now - 2 * session_ttl)
    if expired:
        freed += gw.models.drop_sessions(expired, f"its session expired (no heartbeat for {session_ttl:g} s)")
    gw.stability.expire(now, expired)
    if freed:
        _give_back_memory()
    return Swept(stalled, freed, len(expired), expired)


def _give_back_memory() -> None:
    """Freed bodies go back to the system at once (glibc keeps freed heap pages otherwise)."""
    name = ctypes.util.find_library("c")
    if name is None:
        return
    try:
        ctypes.CDLL(name).malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        return


def interval(gw: TinkerState) -> float:
    return min(max(min(gw.config.pending_ttl_seconds, gw.config.session_ttl_seconds) / 4, 0.25), 30.0)


async def store_expired(gw: TinkerState, expired: set[str]) -> None:
    """Tells the state store what the last sweep changed: expired sessions, forgotten ones and their samplers."""
    for session_id in expired:
        session = gw.sessions.find(session_id)
        if session is not None:
            await gw.durable.put_session(session)
    forgotten, samplers = gw.sessions.forgotten, gw.sessions.forgotten_samplers
    gw.sessions.forgotten, gw.sessions.forgotten_samplers = [], []
    await gw.durable.forget_sessions(forgotten, samplers)


async def run_sweeps(gw: TinkerState) -> None:
    """Sweeps until cancelled; a sweep that fails is logged and the next one runs."""
    while True:
        await asyncio.sleep(interval(gw))
        try:
            swept = sweep(gw)
            await store_expired(gw, swept.expired)
        except Exception:
            log.exception("sweep failed")
            continue
        if swept.freed_bytes or swept.expired_sessions:
            log.info(
                "expired %d stalled models and %d sessions; freed %d bytes",
                swept.stalled_models,
                swept.expired_sessions,
                swept.freed_bytes,
            )
