"""What an adapter was trained on: a record per batch, the running totals, and their JSON form in a saved state
(the proto JSON form of BatchRecord: camelCase keys, uint64 as strings, RFC 3339 times, zero fields left out)."""

from __future__ import annotations

import calendar
import json
import time
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True, slots=True)
class BatchRecord:
    digest: str  # batch.py Batch.digest
    trace_ids: tuple[str, ...]
    step: int  # the optimizer step that consumes it
    num_datums: int
    num_tokens: int
    loss_fn: str
    time_ns: int  # when its ForwardBackward ran, ns since the epoch


@dataclass(slots=True)
class Ledger:
    """Every batch since the last snapshot plus running totals."""

    batches: list[BatchRecord] = field(default_factory=list)
    tokens_trained: int = 0
    datums_trained: int = 0
    pending: list[BatchRecord] = field(default_factory=list)  # awaiting the next optim step

    def to_json(self) -> str:
        return json.dumps(
            {
                "batches": [_record_dict(b) for b in self.batches],
                "pending": [_record_dict(b) for b in self.pending],
                "tokens_trained": self.tokens_trained,
                "datums_trained": self.datums_trained,
            },
            sort_keys=True,
        )

    @classmethod
    def from_json(cls, text: str) -> Ledger:
        data = json.loads(text)
        return cls(
            batches=[_record_of(b) for b in data["batches"]],
            pending=[_record_of(b) for b in data["pending"]],
            tokens_trained=int(data["tokens_trained"]),
            datums_trained=int(data["datums_trained"]),
        )


def _rfc3339(time_ns: int) -> str:
    seconds, nanos = divmod(time_ns, 1_000_000_000)
    text = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(seconds))
    if nanos == 0:
        return text + "Z"
    if nanos % 1_000_000 == 0:
        return f"{text}.{nanos // 1_000_000:03d}Z"
    if nanos % 1_000 == 0:
        return f"{text}.{nanos // 1_000:06d}Z"
    return f"{text}.{nanos:09d}Z"


def _parse_rfc3339(text: str) -> int:
    stamp = text.rstrip("Z")
    whole, _, fraction = stamp.partition(".")
    seconds = calendar.timegm(time.strptime(whole, "%Y-%m-%dT%H:%M:%S"))
    return seconds * 1_000_000_000 + int((fraction + "000000000")[:9])


def _record_dict(record: BatchRecord) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if record.digest:
        out["digest"] = record.digest
    if record.trace_ids:
        out["traceIds"] = list(record.trace_ids)
    for key, value in (("step", record.step), ("numDatums", record.num_datums), ("numTokens", record.num_tokens)):
        if value:
            out[key] = str(value)
    if record.loss_fn:
        out["lossFn"] = record.loss_fn
    out["time"] = _rfc3339(record.time_ns)
    return out


def _record_of(data: dict[str, Any]) -> BatchRecord:
    return BatchRecord(
        digest=str(data.get("digest", "")),
        trace_ids=tuple(data.get("traceIds", ())),
        step=int(data.get("step", 0)),
        num_datums=int(data.get("numDatums", 0)),
        num_tokens=int(data.get("numTokens", 0)),
        loss_fn=str(data.get("lossFn", "")),
        time_ns=_parse_rfc3339(data["time"]) if "time" in data else 0,
    )
