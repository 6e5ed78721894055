"""The registry's rules for a LoRA config: the values it accepts, and the Tinker defaults it fills in."""

from __future__ import annotations

import re

from opentinker.rpc.serving.errors import InvalidArgument
from opentinker.v1 import common_pb2
from opentinker.weights.peft import MAX_RANK, alpha_or_rank

_TARGET_RE = re.compile(r"^[a-z_][a-z0-9_.-]{0,127}$")


def check_lora_config(config: common_pb2.LoraConfig) -> None:
    if config.rank > MAX_RANK:
        raise InvalidArgument(f"LoRA rank {config.rank} exceeds {MAX_RANK}", reason="INVALID_LORA_CONFIG")
    if config.alpha < 0 or not 0 <= config.dropout < 1:
        raise InvalidArgument("LoRA alpha must be >= 0 and dropout in [0, 1)", reason="INVALID_LORA_CONFIG")
    for target in config.target_modules:
        if not _TARGET_RE.match(target):
            raise InvalidArgument(f"invalid LoRA target module {target!r}", reason="INVALID_LORA_CONFIG")


def lora_or_default(config: common_pb2.LoraConfig) -> common_pb2.LoraConfig:
    """Fills unset LoRA fields with the Tinker defaults (rank 32, alpha = rank, all-linear)."""
    filled = common_pb2.LoraConfig()
    filled.CopyFrom(config)
    filled.rank = filled.rank or 32
    filled.alpha = alpha_or_rank(filled.alpha, filled.rank)
    if not filled.target_modules:
        filled.target_modules.append("all-linear")
    return filled
