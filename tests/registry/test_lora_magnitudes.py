"""The one magnitude rule for LoRA weights that import, the trainer and the sampler apply."""

from __future__ import annotations

import math

import pytest
import torch

from opentinker.weights.peft import MAX_LORA_SCALING, MAX_LORA_WEIGHT, LoraMagnitudeError, check_lora_magnitudes


def test_ordinary_weights_and_empty_tensors_pass() -> None:
    check_lora_magnitudes({"a": torch.randn(4, 8), "b": torch.zeros(8, 4), "e": torch.empty(0)}, 2.0)
    check_lora_magnitudes({"a": torch.full((2, 2), MAX_LORA_WEIGHT)}, MAX_LORA_SCALING)  # the limits themselves


@pytest.mark.parametrize("value", [math.inf, -math.inf, math.nan, MAX_LORA_WEIGHT * 2, -3e38])
def test_non_finite_or_huge_weights_are_refused_naming_the_tensor(value: float) -> None:
    weights = torch.randn(4, 8)
    weights[1, 2] = value
    with pytest.raises(LoraMagnitudeError, match=r"layers\.0\.q_proj\.lora_B"):
        check_lora_magnitudes({"ok": torch.randn(2, 2), "layers.0.q_proj.lora_B": weights}, 1.0)


@pytest.mark.parametrize("scaling", [MAX_LORA_SCALING * 1.01, 1e38 / 8, math.inf, math.nan, -2 * MAX_LORA_SCALING])
def test_a_scaling_beyond_the_limit_is_refused(scaling: float) -> None:
    with pytest.raises(LoraMagnitudeError, match="scaling"):
        check_lora_magnitudes({"a": torch.randn(2, 2)}, scaling)


def test_bfloat16_weights_are_checked_too() -> None:
    weights = torch.randn(4, 4, dtype=torch.bfloat16)
    weights[0, 0] = float("inf")
    with pytest.raises(LoraMagnitudeError):
        check_lora_magnitudes({"w": weights}, 1.0)
