"""Rotary position embeddings: the variants the served families publish, read from either config format.

A hub `config.json` writes `rope_theta` at the top level and the scaling as `rope_scaling` ({"rope_type" or
"type": ..., "factor": ...}); transformers 5 saves both as one `rope_parameters` block. Both are read here, into
one `RopeConfig`, and `inverse_frequencies` turns it into the per-dimension frequencies and the cos/sin scale
that transformers' rotary embeddings use, so the sampler's forward and the trainer (transformers' modeling
code) rotate q and k identically:

- default: theta ** (-2i / d).
- linear: the default divided by `factor` (positions interpolated).
- dynamic (NTK): theta grown with the sequence once it passes max_position_embeddings; it depends on the
  sequence's length, so `inverse_frequencies(seq_len=...)` takes it (per sequence, see `dynamic_seq_len`).
- llama3: low frequencies divided by `factor`, high ones kept, a smooth ramp between (Llama 3.1 / 3.2).
- yarn: per-dimension blend of interpolated and extrapolated frequencies (`beta_fast` / `beta_slow`) and an
  attention scale (`attention_factor`, or from `mscale` / `mscale_all_dim`, else 0.1 ln(factor) + 1) applied
  to cos and sin (Qwen2.5's long-context setting).
Anything else (longrope: the Phi-3 family; partial rotary dims) is refused by `parse_rope` with the field named.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import cast

import torch

from opentinker.rpc.serving.errors import FailedPrecondition, InvalidArgument

JsonDict = dict[str, object]

ROPE_TYPES: tuple[str, ...] = ("default", "linear", "dynamic", "llama3", "yarn")


@dataclass(frozen=True, slots=True)
class RopeConfig:
    rope_type: str  # one of ROPE_TYPES
    theta: float
    factor: float = 1.0
    # llama3 / yarn: the context length the model was pretrained with (before scaling).
    original_max_position_embeddings: int = 0
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    attention_factor: float | None = None  # yarn: None derives it from mscale / factor
    mscale: float | None = None  # yarn
    mscale_all_dim: float | None = None  # yarn
    truncate: bool = True  # yarn: round the correction range to whole dimensions


def _number(block: JsonDict, key: str, default: float | None, where: str) -> float | None:
    value = block.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise InvalidArgument(
            f"config.json {where}.{key} must be a finite number, got {value!r}", reason="INVALID_MODEL_CONFIG"
        )
    return float(value)


def _required(block: JsonDict, key: str, where: str) -> float:
    value = _number(block, key, None, where)
    if value is None:
        raise InvalidArgument(f"config.json {where} lacks {key!r}", reason="INVALID_MODEL_CONFIG")
    return value


def parse_rope(raw: JsonDict, model_type: str, max_position_embeddings: int) -> RopeConfig:
    """The RoPE settings of a config.json in the hub's format (rope_theta + rope_scaling) or transformers 5's
    (rope_parameters); the latter wins where both are present, as transformers reads them."""
    block: JsonDict = {}
    where = "rope_scaling"
    for key in ("rope_scaling", "rope_parameters"):
        value = raw.get(key)
        if value is None:
            continue
        if not isinstance(value, dict):
            raise InvalidArgument(f"config.json {key} must be an object, got {value!r}", reason="INVALID_MODEL_CONFIG")
        block, where = cast(JsonDict, value), key
    theta = _number(block, "rope_theta", None, where) or _number(raw, "rope_theta", 10000.0, "config")
    assert theta is not None
    rope_type = block.get("rope_type", block.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise FailedPrecondition(
            f"model_type {model_type!r}: {where}.rope_type {rope_type!r} is not supported; supported: "
            f"{', '.join(ROPE_TYPES)}",
            reason="UNSUPPORTED_ARCHITECTURE",
        )
    partial = _number(block, "partial_rotary_factor", None, where) or _number(
        raw, "partial_rotary_factor", 1.0, "config"
    )
    if partial != 1.0:
        raise FailedPrecondition(
            f"model_type {model_type!r}: partial_rotary_factor {partial} (rotating part of each head) is not supported",
            reason="UNSUPPORTED_ARCHITECTURE",
        )
    if rope_type == "default":
        return RopeConfig("default", theta)
    factor = _required(block, "factor", where) if rope_type != "yarn" else _number(block, "factor", None, where)
    original = _number(block, "original_max_position_embeddings", None, where)
    original = original or _number(raw, "original_max_position_embeddings", float(max_position_embeddings), "config")
    assert original is not None
    if rope_type == "yarn" and factor is None:  # DeepSeek-style: the ratio of the context lengths
        factor = max_position_embeddings / original
    assert factor is not None
    if factor <= 0 or (rope_type in ("linear", "dynamic", "llama3") and factor < 1):
        raise InvalidArgument(
            f"config.json {where}.factor must be at least 1, got {factor}", reason="INVALID_MODEL_CONFIG"
        )
    if rope_type in ("linear", "dynamic"):
        return RopeConfig(str(rope_type), theta, factor, int(original))
    if rope_type == "llama3":
        low, high = _required(block, "low_freq_factor", where), _required(block, "high_freq_factor", where)
        if high <= low:
            raise InvalidArgument(
                f"config.json {where}: high_freq_factor {high} must exceed low_freq_factor {low}",
                reason="INVALID_MODEL_CONFIG",
            )
        return RopeConfig("llama3", theta, factor, int(original), low_freq_factor=low, high_freq_factor=high)
    truncate = block.get("truncate", True)
    return RopeConfig(
        "yarn",
        theta,
        factor,
        int(original),
        beta_fast=_number(block, "beta_fast", None, where) or 32.0,
        beta_slow=_number(block, "beta_slow", None, where) or 1.0,
        attention_factor=_number(block, "attention_factor", None, where),
        mscale=_number(block, "mscale", None, where),
        mscale_all_dim=_number(block, "mscale_all_dim", None, where),
        truncate=truncate is not False,
    )


def _default_inv_freq(theta: float, head_dim: int) -> torch.Tensor:
    # [head_dim / 2] in float32, exponents from an int64 arange as transformers computes them
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim
    return 1.0 / (theta**exponents)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(rope: RopeConfig, head_dim: int) -> tuple[torch.Tensor, float]:
    factor, original = rope.factor, rope.original_max_position_embeddings
    if rope.attention_factor is not None:
        scale = rope.attention_factor
    elif rope.mscale and rope.mscale_all_dim:
        scale = _yarn_mscale(factor, rope.mscale) / _yarn_mscale(factor, rope.mscale_all_dim)
    else:
        scale = _yarn_mscale(factor)

    def correction_dim(rotations: float) -> float:
        # the dimension whose wavelength makes `rotations` turns over the original context
        return head_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(rope.theta))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # a one-dimension ramp would divide by zero
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)  # [head_dim / 2]
    # theta ** (2i / d), from a float arange as transformers' yarn computes it
    wavelengths = rope.theta ** (torch.arange(0, head_dim, 2).to(torch.float32) / head_dim)
    extrapolated, interpolated = 1.0 / wavelengths, 1.0 / (factor * wavelengths)
    keep = 1 - ramp  # 1: the dimension keeps its pretrained frequency
    return interpolated * (1 - keep) + extrapolated * keep, scale


def _llama3(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    inv_freq = _default_inv_freq(rope.theta, head_dim)
    original, factor = rope.original_max_position_embeddings, rope.factor
    low_wavelen, high_wavelen = original / rope.low_freq_factor, original / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (original / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


def inverse_frequencies(
    rope: RopeConfig, head_dim: int, max_position_embeddings: int, seq_len: int | None = None
) -> tuple[torch.Tensor, float]:
    """(inv_freq [head_dim / 2] float32 on the CPU, the scale of cos and sin). seq_len: the sequence's length,
    used by `dynamic` only (None: max_position_embeddings, i.e. the plain frequencies)."""
    if rope.rope_type == "linear":
        return _default_inv_freq(rope.theta, head_dim) / rope.factor, 1.0
    if rope.rope_type == "dynamic":
        length = max(seq_len or 0, max_position_embeddings)
        grown = (rope.factor * length / max_position_embeddings) - (rope.factor - 1)
        theta = rope.theta * grown ** (head_dim / (head_dim - 2))
        return _default_inv_freq(theta, head_dim), 1.0
    if rope.rope_type == "llama3":
        return _llama3(rope, head_dim), 1.0
    if rope.rope_type == "yarn":
        return _yarn(rope, head_dim)
    return _default_inv_freq(rope.theta, head_dim), 1.0
