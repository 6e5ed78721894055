"""An adapter's LoRA and AdamW configuration as typed records: their defaults, range checks and the dict form
saved in a state's state.json (the keys and omissions of the proto's JSON form, so older states still load)."""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass, fields, replace
from typing import Any

from opentinker.rpc.serving.errors import InvalidArgument
from opentinker.weights.peft import MAX_LORA_SCALING, MAX_RANK, alpha_or_rank


def f32(value: float) -> float:
    """The value as the wire's float32 holds it (what the trainer computed with when configs were protos)."""
    return float(struct.unpack("<f", struct.pack("<f", value))[0])


def shortest_f32(value: float) -> float:
    """The shortest decimal that reads back as the same float32 (how a config prints: 0.1, not 0.100000001)."""
    for digits in range(1, 18):
        short = float(f"{value:.{digits}g}")
        if f32(short) == f32(value):
            return short
    return value


@dataclass(frozen=True, slots=True)
class LoraConfig:
    rank: int
    alpha: float  # 0: alpha = rank (lora_or_default)
    dropout: float
    target_modules: tuple[str, ...]  # empty: every linear module of the base


@dataclass(frozen=True, slots=True)
class AdamParams:
    learning_rate: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    grad_clip_norm: float  # 0: no clipping


# Tinker's AdamParams defaults (float32, as a request's own values are).
DEFAULT_ADAM = AdamParams(
    learning_rate=f32(1e-4), beta1=f32(0.9), beta2=f32(0.95), eps=f32(1e-12), weight_decay=0.0, grad_clip_norm=0.0
)
ADAM_FIELDS = tuple(f.name for f in fields(AdamParams))


def check_lora(lora: LoraConfig) -> None:
    if lora.rank <= 0 or lora.rank > MAX_RANK:
        raise InvalidArgument(
            f"lora_config.rank must be in 1..{MAX_RANK}, got {lora.rank}",
            reason="INVALID_LORA_CONFIG",
            field="lora_config.rank",
        )
    if not math.isfinite(lora.alpha) or lora.alpha < 0:
        raise InvalidArgument("lora_config.alpha must be >= 0", reason="INVALID_LORA_CONFIG", field="lora_config.alpha")
    scaling = alpha_or_rank(lora.alpha, lora.rank) / lora.rank
    if scaling > MAX_LORA_SCALING:
        raise InvalidArgument(
            f"lora_config.alpha / rank = {scaling:g} is beyond the limit of {MAX_LORA_SCALING:g}",
            reason="INVALID_LORA_CONFIG",
            field="lora_config.alpha",
        )
    if not 0 <= lora.dropout < 1:
        raise InvalidArgument(
            "lora_config.dropout must be in [0, 1)", reason="INVALID_LORA_CONFIG", field="lora_config.dropout"
        )


def lora_or_default(lora: LoraConfig) -> LoraConfig:
    """With the documented defaults filled in: alpha 0 means alpha = rank (scaling 1)."""
    return replace(lora, alpha=f32(alpha_or_rank(lora.alpha, lora.rank)))


def check_adam(adam: AdamParams) -> None:
    checks = {
        "learning_rate": adam.learning_rate >= 0,
        "beta1": 0 <= adam.beta1 < 1,
        "beta2": 0 <= adam.beta2 < 1,
        "eps": adam.eps >= 0,
        "weight_decay": adam.weight_decay >= 0,
        "grad_clip_norm": adam.grad_clip_norm >= 0,
    }
    for name, ok in checks.items():
        value = getattr(adam, name)
        if not ok or not math.isfinite(value):
            raise InvalidArgument(
                f"adam_params.{name} = {value} is out of range",
                reason="INVALID_ADAM_PARAMS",
                field=f"adam_params.{name}",
            )


def _camel(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(part.title() for part in rest)


def lora_dict(lora: LoraConfig) -> dict[str, Any]:
    """The proto JSON form: camelCase keys, zero and empty fields left out."""
    out: dict[str, Any] = {}
    if lora.rank:
        out["rank"] = lora.rank
    if lora.alpha:
        out["alpha"] = shortest_f32(lora.alpha)
    if lora.dropout:
        out["dropout"] = shortest_f32(lora.dropout)
    if lora.target_modules:
        out["targetModules"] = list(lora.target_modules)
    return out


def lora_from_dict(data: dict[str, Any]) -> LoraConfig:
    return LoraConfig(
        rank=int(data.get("rank", 0)),
        alpha=f32(float(data.get("alpha", 0.0))),
        dropout=f32(float(data.get("dropout", 0.0))),
        target_modules=tuple(data.get("targetModules", data.get("target_modules", ()))),
    )


def adam_dict(adam: AdamParams) -> dict[str, float]:
    return {_camel(name): shortest_f32(getattr(adam, name)) for name in ADAM_FIELDS}


def adam_from_dict(data: dict[str, Any]) -> AdamParams:
    """A field the dict lacks is 0 (an AdamParams saved without it had it unset)."""
    values = {name: f32(float(data.get(_camel(name), data.get(name, 0.0)))) for name in ADAM_FIELDS}
    return AdamParams(**values)
