"""LoRA artifacts for the noisy-neighbour tests of the sampler: an adapter that passes the load-time magnitude
rule (weights.peft.check_lora_magnitudes) yet makes the model's logits NaN, and one beyond the rule.

The overflowing adapter targets layer 0's MLP with every weight at +-MAX_LORA_WEIGHT and the scaling at
MAX_LORA_SCALING. The gate and up deltas are s * B (A x) with A's rows all equal, so every output is +-G with
G ~ s * w^2 * r * sum(x) ~ 1e12 for a normalized x; B's rows alternate signs the same way in both, so half the
rows of silu(gate) * up are G^2 ~ 1e25 (the others ~0); the down delta then sums those coherently,
s * w^2 * r * 64 * G^2 > 3.4e38: inf in the residual stream, and the next RMS norm makes it NaN
(inf * rsqrt(inf) = inf * 0). Checked on the tiny qwen2 model with the sampler's own model code: every
position's logits are NaN, whatever the tokens.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save as save_safetensors

from opentinker.weights.peft import MAX_LORA_SCALING, MAX_LORA_WEIGHT


def _model_sizes(model: Path) -> tuple[int, int]:
    config = json.loads((model / "config.json").read_text())
    return int(config["hidden_size"]), int(config["intermediate_size"])


def _files(tensors: dict[str, torch.Tensor], modules: list[str], rank: int, alpha: float) -> dict[str, bytes]:
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": alpha, "target_modules": modules, "task_type": "CAUSAL_LM"}
    return {
        "adapter_config.json": json.dumps(config, sort_keys=True).encode(),
        "adapter_model.safetensors": bytes(save_safetensors({k: v.contiguous() for k, v in tensors.items()})),
    }


def overflowing_lora_files(model: Path, rank: int = 4, weight: float = MAX_LORA_WEIGHT) -> dict[str, bytes]:
    """Peft files within the magnitude limits (|w| <= MAX_LORA_WEIGHT, scaling = MAX_LORA_SCALING) whose delta
    overflows the residual stream to inf, so that every logit is NaN."""
    hidden, intermediate = _model_sizes(model)
    shapes = {
        "gate_proj": (hidden, intermediate),
        "up_proj": (hidden, intermediate),
        "down_proj": (intermediate, hidden),
    }
    tensors: dict[str, torch.Tensor] = {}
    for module, (d_in, d_out) in shapes.items():
        key = f"base_model.model.model.layers.0.mlp.{module}"
        b = torch.full((d_out, rank), weight)
        if module != "down_proj":
            b[1::2] *= -1  # the same alternation in gate and up: their product is +G^2 wherever the gate is open
        tensors[f"{key}.lora_A.weight"] = torch.full((rank, d_in), weight)
        tensors[f"{key}.lora_B.weight"] = b
    return _files(tensors, sorted(shapes), rank, alpha=MAX_LORA_SCALING * rank)


def out_of_range_lora_files(model: Path, rank: int = 4) -> dict[str, bytes]:
    """Valid peft files except for one weight of 3e38, far beyond MAX_LORA_WEIGHT: refused at load."""
    hidden, _ = _model_sizes(model)
    key = "base_model.model.model.layers.0.self_attn.q_proj"
    generator = torch.Generator().manual_seed(7)
    a = torch.randn(rank, hidden, generator=generator) * 0.1
    a[0, 0] = 3e38
    tensors = {f"{key}.lora_A.weight": a, f"{key}.lora_B.weight": torch.randn(hidden, rank, generator=generator) * 0.1}
    return _files(tensors, ["q_proj"], rank, alpha=float(rank))
