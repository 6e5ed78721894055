"""An offloaded adapter's weights, gradients and AdamW moments, and their spill file on disk.

On a GPU the offloaded tensors stay in CPU memory; on the CPU they go to `--spill-dir`. Whoever can write that
directory must not be able to run code in the trainer or swap one adapter's training for another's, so the file
holds no pickle: tensors in safetensors, everything else as plain JSON in its header, which also records the
adapter's name and a sha256 over the whole content. The trainer keeps that digest in memory when it writes the
file, and a restore reads the file once, then checks format, name and both digests before it touches the adapter:
a file that is not a spill, another adapter's spill, or an older spill of the same adapter is refused
(DATA_LOSS) and the adapter stays as it was, offloaded, until its own file is back.

Layout: tensors `param.<i>` (every parameter, in the adapter's parameter order), `grad.<i>` (those with a
gradient) and `optim.<i>.<key>` (AdamW's tensors: exp_avg, exp_avg_sq, step); header metadata `opentinker.spill`:
{"format", "adapter", "params", "optimizer": {index: [AdamW's keys, in order]}, "scalars": {index: {key: number}},
"sha256"}. The key order is kept so that a state saved after a round trip is byte for byte the one before.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from opentinker.rpc.serving.errors import DataLoss

log = logging.getLogger("opentinker.trainer")

SPILL_FORMAT = 1
SUFFIX = ".safetensors"
META_KEY = "opentinker.spill"
# Far above any real header (a few KB per hundred tensors), far below what json.loads should be handed.
MAX_HEADER_BYTES = 64 << 20

Moments = dict[str, Any]


@dataclass(slots=True)
class Offloaded:
    params: list[torch.Tensor]  # in the adapter's parameter order
    grads: list[torch.Tensor | None]
    moments: list[Moments | None]  # AdamW's per-parameter state, None where it has none yet


def spill_path(directory: Path, name: str) -> Path:
    # '+' is in no adapter name (weights/names.py), so 'team/x' and 'team__x' get different files.
    return directory / f"{name.replace('/', '+')}{SUFFIX}"


def write_spill(directory: Path, name: str, offloaded: Offloaded) -> str:
    """Writes the adapter's spill file (atomically: a reader sees the old file or the new one); its digest."""
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, dict[str, float | int | bool]] = {}
    key_order: dict[str, list[str]] = {}
    for index, (param, grad, moments) in enumerate(
        zip(offloaded.params, offloaded.grads, offloaded.moments, strict=True)
    ):
        tensors[f"param.{index}"] = param.contiguous()
        if grad is not None:
            tensors[f"grad.{index}"] = grad.contiguous()
        if moments is None:
            continue
        key_order[str(index)] = list(moments)
        for key, value in moments.items():
            if isinstance(value, torch.Tensor):
                tensors[f"optim.{index}.{key}"] = value.contiguous()
            elif isinstance(value, bool | int | float):
                scalars.setdefault(str(index), {})[key] = value
            else:  # nothing AdamW keeps; refusing beats writing what could not be read back
                raise TypeError(f"AdamW state {key!r} of parameter {index} is a {type(value).__name__}")
    meta: dict[str, Any] = {
        "format": SPILL_FORMAT,
        "adapter": name,
        "params": len(offloaded.params),
        "optimizer": key_order,
        "scalars": scalars,
    }
    meta["sha256"] = _digest(meta, tensors)
    data = save_safetensors(tensors, metadata={META_KEY: json.dumps(meta, sort_keys=True)})
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    path = spill_path(directory, name)
    partial = path.with_name(path.name + ".partial")
    partial.write_bytes(data)
    os.replace(partial, path)
    digest: str = meta["sha256"]
    return digest


def read_spill(directory: Path, name: str, expected_digest: str) -> Offloaded:
    """The tensors the trainer spilled for `name` with digest `expected_digest`, or DataLoss (SPILL_MISSING,
    SPILL_CORRUPT, SPILL_MISMATCH); reads the file once and leaves it in place."""
    path = spill_path(directory, name)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        log.warning("spill file %s of offloaded adapter %r is gone", path, name)
        raise DataLoss(
            f"adapter {name!r} is offloaded and its spill file is gone", reason="SPILL_MISSING", adapter=name
        ) from None
    meta, tensors = _parse(data, path, name)
    if meta["adapter"] != name:
        # The other adapter may be another tenant's: its name goes to the server log, not to the client.
        log.warning("spill file %s of adapter %r holds adapter %r's state: refused", path, name, meta["adapter"])
        raise DataLoss(
            f"the spill file of adapter {name!r} holds another adapter's state: refused",
            reason="SPILL_MISMATCH",
            adapter=name,
        )
    recorded = meta.pop("sha256")
    if _digest(meta, tensors) != recorded:
        raise _corrupt(path, name, "its content does not match the digest it records")
    if recorded != expected_digest:
        log.warning(
            "spill file %s of adapter %r has digest %s, this trainer wrote %s: refused",
            path,
            name,
            recorded,
            expected_digest,
        )
        raise DataLoss(
            f"the spill file of adapter {name!r} is not the one this trainer wrote for it (an older or "
            "replaced file): refused",
            reason="SPILL_MISMATCH",
            adapter=name,
        )
    count = meta["params"]
    moments: list[Moments | None] = [None] * count
    for index, keys in meta["optimizer"].items():
        scalars = meta["scalars"].get(index, {})
        # The digest matched: every key is a tensor or a scalar, as write_spill laid them out. Interned keys are
        # the very strings AdamW uses, so pickling the state (SaveState's optimizer.pt) gives the same bytes.
        moments[int(index)] = {
            sys.intern(key): scalars[key] if key in scalars else tensors[f"optim.{index}.{key}"] for key in keys
        }
    return Offloaded(
        params=[tensors[f"param.{i}"] for i in range(count)],
        grads=[tensors.get(f"grad.{i}") for i in range(count)],
        moments=moments,
    )


def _corrupt(path: Path, name: str, why: str) -> DataLoss:
    log.warning("spill file %s of adapter %r refused: %s", path, name, why)
    return DataLoss(f"the spill file of adapter {name!r} is refused: {why}", reason="SPILL_CORRUPT", adapter=name)


def _parse(data: bytes, path: Path, name: str) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """The header metadata and tensors of a safetensors file in our layout; SPILL_CORRUPT for anything else."""
    # safetensors: an 8-byte little-endian header length, then the JSON header; its own loader does not hand
    # back the metadata, so the header is read here from the same bytes the tensors come from.
    size = int.from_bytes(data[:8], "little") if len(data) >= 8 else -1
    if not 0 < size <= min(len(data) - 8, MAX_HEADER_BYTES):
        raise _corrupt(path, name, "not a safetensors file")
    try:
        header = json.loads(data[8 : 8 + size])
        meta = json.loads(header["__metadata__"][META_KEY])
        tensors = load_safetensors(data)
    except Exception as exc:  # whatever fails to parse gets the same answer: not a spill file
        raise _corrupt(path, name, f"not a spill file ({type(exc).__name__}: {exc})") from None
    if not _well_formed(meta):
        raise _corrupt(path, name, "its layout is not a spill's")
    return meta, tensors


def _well_formed(meta: Any) -> bool:
    """Enough to name the adapter and check the digests; past the digest check the layout is write_spill's own."""
    return (
        isinstance(meta, dict)
        and meta.get("format") == SPILL_FORMAT
        and isinstance(meta.get("adapter"), str)
        and isinstance(meta.get("sha256"), str)
    )


def _digest(meta: dict[str, Any], tensors: dict[str, torch.Tensor]) -> str:
    """sha256 over the metadata (without the digest) and every tensor's name, dtype, shape and bytes."""
    digest = hashlib.sha256(json.dumps(meta, sort_keys=True).encode())
    for key in sorted(tensors):
        tensor = tensors[key]
        digest.update(f"\0{key}\0{tensor.dtype}\0{list(tensor.shape)}\0".encode())
        digest.update(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()
