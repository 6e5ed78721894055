"""Tinker sessions (one per ServiceClient, kept alive by heartbeats) and sampling sessions.

A sampling session is pinned to one exact thing to sample from: "base" or an exact registry version
"tenant/adapter@N", so a SamplingClient keeps sampling the weights it was created for whatever happens
to the adapter's aliases afterwards.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field

from opentinker.gateway.errors import GatewayError, not_found


@dataclass(slots=True)
class Session:
    session_id: str
    tenant: str
    sdk_version: str
    last_heartbeat: float = field(default_factory=time.monotonic)
    finished: str | None = None  # the finish reason, first one wins

    def to_json(self) -> dict[str, object]:
        return {
            "session_id": self.session_id,
            "tenant": self.tenant,
            "sdk_version": self.sdk_version,
            "finished": self.finished,
        }

    @classmethod
    def from_json(cls, data: dict[str, object]) -> Session:
        """A session read back after a restart: its heartbeat clock starts again now."""
        finished = data.get("finished")
        return cls(
            str(data["session_id"]),
            str(data["tenant"]),
            str(data.get("sdk_version") or ""),
            finished=None if finished is None else str(finished),
        )


@dataclass(frozen=True, slots=True)
class SamplingSession:
    sampling_session_id: str
    tenant: str
    session_id: str
    reference: str  # "base" or "tenant/adapter@N"
    base_model: str
    model_path: str | None

    def to_json(self) -> dict[str, object]:
        return {
            "sampling_session_id": self.sampling_session_id,
            "tenant": self.tenant,
            "session_id": self.session_id,
            "reference": self.reference,
            "base_model": self.base_model,
            "model_path": self.model_path,
        }

    @classmethod
    def from_json(cls, data: dict[str, object]) -> SamplingSession:
        path = data.get("model_path")
        return cls(
            str(data["sampling_session_id"]),
            str(data["tenant"]),
            str(data["session_id"]),
            str(data["reference"]),
            str(data["base_model"]),
            None if path is None else str(path),
        )


def new_id() -> str:
    """Short, lowercase and digits only: it becomes part of adapter names."""
    return uuid.uuid4().hex[:12]


class SessionTable:
    def __init__(self) -> None:
        self._sessions: dict[str, Session] = {}
        self._samplers: dict[str, SamplingSession] = {}
        # What `expire` changed since the state store last heard of it (expiry.py drains these).
        self.forgotten: list[str] = []
        self.forgotten_samplers: list[str] = []

    def restore(self, sessions: list[Session], samplers: list[SamplingSession]) -> None:
        """Sessions and sampling sessions read back from the state store after a restart."""
        self._sessions.update((s.session_id, s) for s in sessions)
        self._samplers.update((s.sampling_session_id, s) for s in samplers)

    def find(self, session_id: str) -> Session | None:
        return self._sessions.get(session_id)

    def create(self, tenant: str, sdk_version: str, limit: int | None = None) -> Session:
        """A new session of ``tenant``; 429 TOO_MANY_SESSIONS when it holds ``limit`` (expired ones aside)."""
        if limit is not None:
            held = sum(1 for s in self._sessions.values() if s.tenant == tenant and s.finished != "expired")
            if held >= limit:
                raise GatewayError(
                    429, "TOO_MANY_SESSIONS", f"tenant {tenant} holds {held} sessions; at most {limit} (finish some)"
                )
        session = Session(session_id=new_id(), tenant=tenant, sdk_version=sdk_version)
        self._sessions[session.session_id] = session
        return session

    def get(self, session_id: str, tenant: str) -> Session:
        session = self._sessions.get(session_id)
        if session is None or session.tenant != tenant:
            raise not_found(f"unknown session_id {session_id!r}", "UNKNOWN_SESSION")
        return session

    def active(self, session_id: str, tenant: str) -> Session:
        """A session that may still create clients: finished ones answer 410 (the SDK stops there)."""
        session = self.get(session_id, tenant)
        if session.finished is not None:
            raise GatewayError(410, "SESSION_FINISHED", f"session {session_id} has finished ({session.finished})")
        return session

    def heartbeat(self, session_id: str, tenant: str) -> None:
        self.active(session_id, tenant).last_heartbeat = time.monotonic()

    def expire(self, idle_before: float, forget_before: float) -> set[str]:
        """Sessions whose last heartbeat is older than ``idle_before`` end as "expired" (their sampling sessions
        go; a heartbeat then answers 410, which stops the SDK's heartbeat loop); expired ones idle since before
        ``forget_before`` are forgotten. The ids that expired now."""
        expired = set()
        for session_id, session in list(self._sessions.items()):
            if session.last_heartbeat >= idle_before:
                continue
            if session.finished == "expired":
                if session.last_heartbeat < forget_before:
                    del self._sessions[session_id]
                    self.forgotten.append(session_id)
                continue
            session.finished, session.sdk_version = "expired", ""
            expired.add(session_id)
        for sampler_id in [s for s, sampler in self._samplers.items() if sampler.session_id in expired]:
            del self._samplers[sampler_id]
            self.forgotten_samplers.append(sampler_id)
        return expired

    def __len__(self) -> int:
        return len(self._sessions)

    def add_sampler(self, sampler: SamplingSession) -> None:
        self._samplers[sampler.sampling_session_id] = sampler

    def sampler(self, sampling_session_id: str, tenant: str) -> SamplingSession:
        sampler = self._samplers.get(sampling_session_id)
        if sampler is None or sampler.tenant != tenant:
            raise not_found(f"unknown sampling_session_id {sampling_session_id!r}", "UNKNOWN_SAMPLING_SESSION")
        return sampler
