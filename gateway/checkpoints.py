"""``tinker://`` checkpoint paths and what they stand for here.

    tinker://<model_id>/weights/<name>          a trainer saved state (weights + AdamW state + step + RNG)
    tinker://<model_id>/sampler_weights/<name>  an exact registry version "tenant/adapter@N"

The table lives in the gateway's memory: paths stay valid while the gateway runs (the states and versions
themselves are durable in the trainer's store and the registry).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

from opentinker.gateway.errors import RequestFailed
from opentinker.v1 import common_pb2

Kind = Literal["state", "sampler"]
_SEGMENT = {"state": "weights", "sampler": "sampler_weights"}
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


@dataclass(frozen=True, slots=True)
class Checkpoint:
    path: str
    tenant: str
    kind: Kind
    target: str  # state: "sha256:<digest>" state id; sampler: "tenant/adapter@N"
    lora: common_pb2.LoraConfig
    model_id: str


def checkpoint_path(model_id: str, kind: Kind, name: str) -> str:
    if not _NAME_RE.match(name):
        raise RequestFailed(f"invalid checkpoint name {name!r}: letters, digits, '.', '_', '-' (at most 128)")
    return f"tinker://{model_id}/{_SEGMENT[kind]}/{name}"


class CheckpointTable:
    def __init__(self) -> None:
        self._paths: dict[str, Checkpoint] = {}

    def add(self, checkpoint: Checkpoint) -> None:
        self._paths[checkpoint.path] = checkpoint

    def exists(self, path: str) -> bool:
        return path in self._paths

    def get(self, path: str, tenant: str) -> Checkpoint:
        if not path.startswith("tinker://"):
            raise RequestFailed(f"checkpoint path must start with tinker://, got {path!r}")
        checkpoint = self._paths.get(path)
        if checkpoint is None or checkpoint.tenant != tenant:  # another tenant's path reads as unknown
            raise RequestFailed(f"unknown checkpoint {path!r}")
        return checkpoint
