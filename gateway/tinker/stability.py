"""Stability info for ``stable_reinforce``: what a sample with ``record_stability_info=True`` records, and how a
training datum's provenance is checked against it.

Recorded per sampled sequence (by its ``sequence_id``): the request's prompt tokens, the sampled tokens and the
sampler's logprob of each (float32, as the sampler computed them). A ``stable_reinforce`` datum names, through
its provenance spans (``Datum.with_provenance``), the recorded sequence behind every position; the gateway
checks each claim (the tokens must be the recorded ones) and hands the trainer the recorded sampler logprobs
as the datum's ``logprobs``, so the loss's ratio is formed against what the sampler really computed, never
against the client's copy. Prompt positions carry no sampler logprob: their advantages must be 0.

Records belong to the session that sampled them (only its training requests may name them; they go when it
expires) and to its tenant, which holds at most ``max_tenant_tokens`` tokens of them (its least recently used
records are dropped beyond). A record is kept ``ttl_seconds`` (a day, as Tinker documents) after its last use:
sampling it, or a training request naming it.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from opentinker.gateway.config import DEFAULT_MAX_TENANT_STABILITY_TOKENS, DEFAULT_STABILITY_TTL_SECONDS
from opentinker.gateway.errors import RequestFailed
from opentinker.v1 import common_pb2

LOSS_FN = "stable_reinforce"


@dataclass(slots=True)
class Record:
    session_id: str
    prompt: npt.NDArray[np.int64]  # [P]; shared by the n samples of one request
    tokens: npt.NDArray[np.int64]  # [T] sampled
    logprobs: npt.NDArray[np.float32]  # [T] the sampler's logprob of each sampled token
    last_used: float

    @property
    def size(self) -> int:
        return len(self.prompt) + len(self.tokens)


class StabilityRecords:
    def __init__(
        self,
        ttl_seconds: float = DEFAULT_STABILITY_TTL_SECONDS,
        max_tenant_tokens: int = DEFAULT_MAX_TENANT_STABILITY_TOKENS,
    ) -> None:
        self.ttl_seconds = ttl_seconds
        self.max_tenant_tokens = max_tenant_tokens
        self._by_tenant: dict[str, OrderedDict[str, Record]] = {}  # least recently used first
        self._held: dict[str, int] = {}

    def record(
        self,
        tenant: str,
        session_id: str,
        prompt: Sequence[int],
        sequences: Mapping[str, tuple[Sequence[int], Sequence[float]]],
        now: float | None = None,
    ) -> None:
        """The sequences of one sampling request: sequence_id -> (sampled tokens, their logprobs)."""
        now = time.monotonic() if now is None else now
        shared = np.asarray(prompt, dtype=np.int64)
        records = self._by_tenant.setdefault(tenant, OrderedDict())
        for sequence_id, (tokens, logprobs) in sequences.items():
            if len(tokens) != len(logprobs):
                raise RequestFailed(f"the sampler answered {len(logprobs)} logprobs for {len(tokens)} tokens", "server")
            self._drop(tenant, sequence_id)
            record = Record(
                session_id, shared, np.asarray(tokens, dtype=np.int64), np.asarray(logprobs, dtype=np.float32), now
            )
            records[sequence_id] = record
            self._held[tenant] = self._held.get(tenant, 0) + record.size
        while self._held.get(tenant, 0) > self.max_tenant_tokens and records:
            self._drop(tenant, next(iter(records)))

    def lookup(
        self, tenant: str, session_id: str, sequence_ids: Iterable[str], now: float | None = None
    ) -> dict[str, Record]:
        """The records of ``session_id`` among ``sequence_ids`` (unknown, expired or other sessions' ids are left
        out), each touched: its day starts again."""
        now = time.monotonic() if now is None else now
        records = self._by_tenant.get(tenant)
        found: dict[str, Record] = {}
        if records is None:
            return found
        for sequence_id in sequence_ids:
            record = records.get(sequence_id)
            if record is None or record.session_id != session_id or record.last_used < now - self.ttl_seconds:
                continue
            record.last_used = now
            records.move_to_end(sequence_id)
            found[sequence_id] = record
        return found

    def expire(self, now: float | None = None, sessions: Iterable[str] = ()) -> int:
        """Drops records unused for ``ttl_seconds`` and those of the given (expired) sessions; how many went."""
        now = time.monotonic() if now is None else now
        gone_sessions = set(sessions)
        dropped = 0
        for tenant, records in list(self._by_tenant.items()):
            stale = [
                sid
                for sid, record in records.items()
                if record.last_used < now - self.ttl_seconds or record.session_id in gone_sessions
            ]
            for sequence_id in stale:
                self._drop(tenant, sequence_id)
            dropped += len(stale)
        return dropped

    def held(self, tenant: str) -> int:
        return self._held.get(tenant, 0)

    def __len__(self) -> int:
        return sum(len(records) for records in self._by_tenant.values())

    def _drop(self, tenant: str, sequence_id: str) -> None:
        records = self._by_tenant.get(tenant)
        record = records.pop(sequence_id, None) if records is not None else None
        if record is None:
            return
        self._held[tenant] -= record.size
        if records is not None and not records:
            del self._by_tenant[tenant]
            del self._held[tenant]


# Resolving a forward_backward request's provenance


def sequence_ids(message: Any) -> set[str]:
    """Every sequence_id the request's provenance spans name."""
    named = set()
    for datum in message.data:
        for span in (*datum.model_input_spans, *datum.loss_fn_input_spans):
            arm = span.WhichOneof("span")
            if arm is not None:
                named.add(getattr(span, arm).sequence_id)
    return named


_HINT = (
    "stable_reinforce datums need provenance (Datum.with_provenance) naming sequences this session sampled with "
    "record_stability_info=True"
)


def _claimed(
    spans: Sequence[Any], records: Mapping[str, Record], length: int, where: str
) -> list[tuple[int, str, Record, int, int]]:
    """The spans of one field as (position, kind, record, offset, length), each within its record; they must
    tile the field's ``length`` positions."""
    if not spans:
        raise RequestFailed(f"{where}: no provenance; {_HINT}")
    runs = []
    position = 0
    for span in spans:
        kind = span.WhichOneof("span")
        if kind is None:
            raise RequestFailed(f"{where}: a provenance span names neither prompt nor sampled tokens")
        run = getattr(span, kind)
        record = records.get(run.sequence_id)
        if record is None:
            raise RequestFailed(
                f"{where}: sequence_id {run.sequence_id[:128]!r} has no stability record in this session (sampled "
                "without record_stability_info=True, by another session, or unused for longer than a day)"
            )
        source = record.prompt if kind == "prompt_tokens" else record.tokens
        if run.offset < 0 or run.length < 0 or run.offset + run.length > len(source):
            name = "prompt" if kind == "prompt_tokens" else "sampled tokens"
            raise RequestFailed(
                f"{where}: span [{run.offset}, {run.offset + run.length}) is outside the {len(source)} {name} of "
                f"sequence {run.sequence_id[:128]!r}"
            )
        runs.append((position, kind, record, int(run.offset), int(run.length)))
        position += int(run.length)
    if position != length:
        raise RequestFailed(f"{where}: provenance spans cover {position} positions; the field has {length}")
    return runs


def _check_tokens(tokens: npt.NDArray[np.int64], runs: list[tuple[int, str, Record, int, int]], where: str) -> None:
    for position, kind, record, offset, length in runs:
        source = record.prompt if kind == "prompt_tokens" else record.tokens
        claimed = tokens[position : position + length]
        if not np.array_equal(claimed, source[offset : offset + length]):
            bad = position + int(np.argmax(claimed != source[offset : offset + length]))
            raise RequestFailed(f"{where}: token at position {bad} is not the recorded token its provenance names")


def apply(message: Any, datums: list[common_pb2.Datum], records: Mapping[str, Record]) -> None:
    """Checks every datum's provenance against ``records`` and sets its ``logprobs`` to the recorded sampler
    logprobs (0 at prompt positions, whose advantages must be 0). RequestFailed on the first bad claim."""
    for i, (datum, converted) in enumerate(zip(message.data, datums, strict=True)):
        where = f"datum {i}"
        inputs = converted.loss_fn_inputs
        if "target_tokens" not in inputs or "advantages" not in inputs:
            raise RequestFailed(f"{where}: stable_reinforce needs loss_fn_inputs target_tokens and advantages")
        targets = np.asarray(inputs["target_tokens"].int64_values, dtype=np.int64)  # [N]
        advantages = np.asarray(inputs["advantages"].float32_values, dtype=np.float32)  # [N]
        if len(advantages) != len(targets):
            raise RequestFailed(f"{where}: advantages has {len(advantages)} values, target_tokens {len(targets)}")
        input_tokens = np.asarray(
            [t for chunk in converted.model_input.chunks for t in chunk.encoded_text.tokens], dtype=np.int64
        )
        _check_tokens(
            input_tokens,
            _claimed(datum.model_input_spans, records, len(input_tokens), f"{where} model_input"),
            f"{where} model_input",
        )
        runs = _claimed(datum.loss_fn_input_spans, records, len(targets), f"{where} loss_fn_inputs")
        _check_tokens(targets, runs, f"{where} target_tokens")
        sampler_logprobs = np.zeros(len(targets), dtype=np.float32)  # [N]
        for position, kind, record, offset, length in runs:
            if kind == "prompt_tokens":
                if np.any(advantages[position : position + length] != 0):
                    raise RequestFailed(
                        f"{where}: advantages must be 0 on prompt positions (stable_reinforce trains sampled tokens "
                        f"only); positions {position}..{position + length - 1} come from a prompt"
                    )
            else:
                sampler_logprobs[position : position + length] = record.logprobs[offset : offset + length]
        inputs["logprobs"].CopyFrom(
            common_pb2.TensorData(
                dtype=common_pb2.D_TYPE_FLOAT32, shape=[len(targets)], float32_values=sampler_logprobs.tolist()
            )
        )
        if "weights" not in inputs:
            # The provenance says which positions were sampled: those are the tokens the loss and its KL
            # penalty cover, whatever their advantage (without weights the trainer could only take A != 0).
            sampled = np.zeros(len(targets), dtype=np.float32)  # [N]
            for position, kind, _record, _offset, length in runs:
                if kind != "prompt_tokens":
                    sampled[position : position + length] = 1.0
            inputs["weights"].CopyFrom(
                common_pb2.TensorData(
                    dtype=common_pb2.D_TYPE_FLOAT32, shape=[len(targets)], float32_values=sampled.tolist()
                )
            )
