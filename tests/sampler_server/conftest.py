"""The engine-level tests' model and LoRA slot pool (tests/pagedkvutil.py): one fp32 tiny model and one pool of
random adapters per test module. A module that needs another model or pool defines its own `runner` / `pool`."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from pagedkvutil import CPU, make_pool

from opentinker.sampler_server.model.llama import LlamaForCausalLM
from opentinker.sampler_server.slot_pool import SlotPool


@pytest.fixture(scope="module")
def runner(tiny_model: Path) -> LlamaForCausalLM:
    return LlamaForCausalLM.from_pretrained(tiny_model, device=CPU, dtype=torch.float32)


@pytest.fixture(scope="module")
def pool(runner: LlamaForCausalLM) -> SlotPool:
    return make_pool(runner)
