"""Tinker training runs: the record of every model a tenant created here (a run id is its model_id), kept after its
session ends so that ``RestClient.get_training_run`` and the cookbook's resume checks still find it.

A run outlives its `TrainingModel` (models.py, the live lane that runs requests): the model goes when its session
expires, the run record stays (the adapter stays in the trainer and the registry too).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from google.protobuf.json_format import MessageToDict, ParseDict

from opentinker.gateway.errors import bad_request, not_found
from opentinker.v1 import common_pb2

MAX_METADATA_ENTRIES = 64
MAX_METADATA_KEY = 256  # characters of a user_metadata key (values are bounded by --max-string-length)


@dataclass(slots=True)
class TrainingRun:
    model_id: str
    tenant: str
    session_id: str
    adapter: str
    lora: common_pb2.LoraConfig
    base_model: str
    user_metadata: dict[str, str] | None = None
    created: float = field(default_factory=time.time)  # unix seconds
    last_request: float = field(default_factory=time.time)

    def to_json(self) -> dict[str, object]:
        return {
            "model_id": self.model_id,
            "tenant": self.tenant,
            "session_id": self.session_id,
            "adapter": self.adapter,
            "lora": MessageToDict(self.lora),
            "base_model": self.base_model,
            "user_metadata": self.user_metadata,
            "created": self.created,
            "last_request": self.last_request,
        }

    @classmethod
    def from_json(cls, data: dict[str, object]) -> TrainingRun:
        lora = data["lora"]
        metadata = data.get("user_metadata")
        return cls(
            model_id=str(data["model_id"]),
            tenant=str(data["tenant"]),
            session_id=str(data["session_id"]),
            adapter=str(data["adapter"]),
            lora=ParseDict(lora if isinstance(lora, dict) else {}, common_pb2.LoraConfig()),
            base_model=str(data["base_model"]),
            user_metadata={str(k): str(v) for k, v in metadata.items()} if isinstance(metadata, dict) else None,
            created=float(str(data["created"])),
            last_request=float(str(data["last_request"])),
        )


def user_metadata(value: object) -> dict[str, str] | None:
    """A request's ``user_metadata``: a flat object of at most 64 entries; numbers and booleans become strings (the
    SDK's TrainingRun reads them back as strings). 400 INVALID_FIELD otherwise."""
    if value is None:
        return None
    if not isinstance(value, dict) or len(value) > MAX_METADATA_ENTRIES:
        raise bad_request(f"user_metadata must be an object of at most {MAX_METADATA_ENTRIES} entries", "INVALID_FIELD")
    out: dict[str, str] = {}
    for key, item in value.items():
        if len(key) > MAX_METADATA_KEY:
            raise bad_request(f"user_metadata keys are at most {MAX_METADATA_KEY} characters", "INVALID_FIELD")
        if isinstance(item, bool):
            out[key] = "true" if item else "false"
        elif isinstance(item, str | int | float):
            out[key] = str(item)
        else:
            raise bad_request(f"user_metadata[{key[:64]!r}] must be a string, number or boolean", "INVALID_FIELD")
    return out


class RunTable:
    def __init__(self) -> None:
        self._runs: dict[str, TrainingRun] = {}

    def add(self, run: TrainingRun) -> None:
        self._runs[run.model_id] = run

    def get(self, model_id: str, tenant: str) -> TrainingRun:
        run = self._runs.get(model_id)
        if run is None or run.tenant != tenant:  # another tenant's run reads as unknown
            raise not_found(f"unknown training run {model_id!r}", "UNKNOWN_TRAINING_RUN")
        return run

    def find(self, model_id: str) -> TrainingRun | None:
        return self._runs.get(model_id)

    def of_tenant(self, tenant: str) -> list[TrainingRun]:
        """The tenant's runs, newest first."""
        return sorted((r for r in self._runs.values() if r.tenant == tenant), key=lambda r: -r.created)

    def __len__(self) -> int:
        return len(self._runs)
