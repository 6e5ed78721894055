"""Helpers for gateway tests: start the gateway as its own process (as users do), tinker datums."""

from __future__ import annotations

import json
import os
from pathlib import Path

from serverproc import ServerProcess, opentinker_command
from tinker import types

# The SDK reads these when its clients are built: no telemetry, nothing from a model hub.
os.environ["TINKER_TELEMETRY"] = "0"
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

KEY_A = "tml-gateway-test-team-a"
KEY_B = "tml-gateway-test-team-b"


def start_gateway(
    workdir: Path, trainer: ServerProcess, sampler: ServerProcess, registry: ServerProcess, *extra: str
) -> ServerProcess:
    """A gateway process with two API keys: KEY_A -> tenant gw-a, KEY_B -> tenant gw-b."""
    workdir.mkdir(parents=True, exist_ok=True)
    keys = workdir / "keys.json"
    keys.write_text(json.dumps({"keys": [{"key": KEY_A, "tenant": "gw-a"}, {"key": KEY_B, "tenant": "gw-b"}]}))
    args = opentinker_command(
        "gateway",
        "serve",
        "--trainer",
        trainer.address,
        "--sampler",
        sampler.address,
        "--registry",
        registry.address,
        "--keys-file",
        str(keys),
        "--port",
        "0",
        *extra,
    )
    return ServerProcess(args, workdir)


def base_url(gateway: ServerProcess) -> str:
    return f"http://{gateway.address}"


def ints(values: list[int]) -> types.TensorData:
    return types.TensorData(data=list(values), dtype="int64", shape=[len(values)])


def floats(values: list[float]) -> types.TensorData:
    return types.TensorData(data=[float(v) for v in values], dtype="float32", shape=[len(values)])
