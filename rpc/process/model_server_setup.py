"""What a model server (the trainer or the sampler) loads and answers to: its base model and how it is loaded, the
registry it reports to, the store its artifacts live in. Both take these flags (`cli_options.model_server_flags`)
and both configs carry this one record, so the rule for each is written once."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

Dtype = Literal["auto", "float32", "bfloat16"]


@dataclass(frozen=True, slots=True)
class ModelServerSetup:
    model: str  # a local HF directory or a cached HF id
    registry: str  # host:port
    store: str | Path  # a folder, or a bucket URL (artifact_bucket.py)
    registry_token: str | None = None
    registry_ca: Path | None = None
    revision: str | None = None  # of a hub id: the cached snapshot to use (None: main)
    served_model_name: str | None = None  # the public name of a model given as a directory (served_name.py)
    device: str = "auto"  # auto, cpu or cuda
    dtype: Dtype = "auto"  # auto: bfloat16 on CUDA, float32 on the CPU
    cache_dir: Path | None = None  # with a bucket store: the verified local copies
    cache_max_bytes: int = 0  # 0: unbounded
    advertise: str = ""  # host:port registered with the fleet; "": the bound address
    zone: str = ""
    heartbeat_s: float = 1.0  # fleet lease renewal; the lease is heartbeat_s x lease_beats
    lease_beats: int = 3
