"""The sampler's own forward on scaled copies of the public checkpoints (`make-tiny-model --like`), against
transformers: every RoPE variant they publish (llama3, yarn, plain), tied embeddings, head_dim given, biases,
q/k norms, eos lists, sliding-window fields that are off; 320 positions, past each original context length."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from opentinker.client.model_families import FAMILIES
from opentinker.client.tiny_model import make_family_model
from opentinker.sampler_server.model import ForwardBatch, KVCache, LlamaForCausalLM
from opentinker.weights.model_config import load_config
from opentinker.weights.rope import RopeConfig, inverse_frequencies

os.environ.setdefault("HF_HUB_OFFLINE", "1")

CPU = torch.device("cpu")
LENGTH = 320
TOL = 1e-5


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("families")
    return {family: make_family_model(root / family, family, seed=3) for family in FAMILIES}


def _hf(model_dir: Path) -> Any:
    from transformers import AutoModelForCausalLM

    hf: Any = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return hf.eval()


def _tokens(length: int, seed: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, 500, (length,), generator=generator).tolist()


def _logprobs(logits: torch.Tensor, tokens: list[int]) -> torch.Tensor:
    # logits: [T, V] -> [T - 1] logprob of each next token
    return torch.log_softmax(logits[:-1].double(), -1).gather(1, torch.tensor(tokens[1:])[:, None])[:, 0]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_scaled_copy_keeps_the_published_keys(models: dict[str, Path], family: str) -> None:
    config = json.loads((models[family] / "config.json").read_text())
    published = FAMILIES[family][1]
    assert set(config) == set(published)  # every key as published, in the hub's format
    assert "rope_parameters" not in config
    shape = load_config(models[family])
    generation = FAMILIES[family][2]
    assert len(shape.eos_token_ids) == (
        len(generation["eos_token_id"]) if isinstance(generation.get("eos_token_id"), list) else 1
    )
    original = shape.rope.original_max_position_embeddings
    assert original == 0 or original < LENGTH  # the test positions pass the pretrained length
    assert shape.context_length >= LENGTH + 32


@pytest.mark.parametrize("family", list(FAMILIES))
def test_prefill_logprobs_and_greedy_decode_equal_transformers(models: dict[str, Path], family: str) -> None:
    hf = _hf(models[family])
    ours = LlamaForCausalLM.from_pretrained(models[family], device=CPU, dtype=torch.float32)
    tokens = _tokens(LENGTH, seed=len(family))
    with torch.no_grad():
        expected = _logprobs(hf(torch.tensor([tokens])).logits[0].float(), tokens)
    cache = KVCache(ours.config, 1, LENGTH + 40, CPU, torch.float32)
    logits = ours.forward(ForwardBatch.build([tokens], [0], kv_slots=[0], all_logits=True), cache)
    diff = (_logprobs(logits, tokens) - expected).abs()
    assert float(diff.max()) <= TOL, f"{family}: max |logprob diff| {float(diff.max()):.2e}"

    # Greedy: 32 tokens decoded one at a time on our KV cache, and transformers' own incremental decode.
    prompt = tokens[:40]
    cache = KVCache(ours.config, 1, LENGTH + 40, CPU, torch.float32)
    step = ours.forward(ForwardBatch.build([prompt], [0], kv_slots=[0], all_logits=False), cache)
    ours_out: list[int] = []
    for _ in range(32):
        ours_out.append(int(step[-1].argmax()))
        position = len(prompt) + len(ours_out) - 1
        step = ours.forward(ForwardBatch.build([[ours_out[-1]]], [position], kv_slots=[0], all_logits=False), cache)
    with torch.no_grad():
        out = hf(torch.tensor([prompt]), use_cache=True)
        hf_out: list[int] = []
        for _ in range(32):
            hf_out.append(int(out.logits[0, -1].argmax()))
            out = hf(torch.tensor([[hf_out[-1]]]), cache=out.past_key_values, use_cache=True)
    assert ours_out == hf_out


def test_dynamic_and_linear_rope_equal_transformers(models: dict[str, Path], tmp_path: Path) -> None:
    """The two variants no listed checkpoint publishes, on the llama copy: one sequence prefilled past
    max_position_embeddings (dynamic grows its base with the length), as transformers computes it."""
    base = models["llama3.1"]
    for scaling in ({"rope_type": "dynamic", "factor": 2.0}, {"rope_type": "linear", "factor": 4.0}):
        copy = tmp_path / str(scaling["rope_type"])
        copy.mkdir()
        for path in base.iterdir():
            (copy / path.name).write_bytes(path.read_bytes())
        config = json.loads((base / "config.json").read_text())
        config.update(rope_scaling=scaling, max_position_embeddings=128)
        (copy / "config.json").write_text(json.dumps(config))
        hf = _hf(copy)
        ours = LlamaForCausalLM.from_pretrained(copy, device=CPU, dtype=torch.float32)
        tokens = _tokens(LENGTH, seed=11)
        with torch.no_grad():
            expected = _logprobs(hf(torch.tensor([tokens])).logits[0].float(), tokens)
        cache = KVCache(ours.config, 1, LENGTH, CPU, torch.float32)
        logits = ours.forward(ForwardBatch.build([tokens], [0], kv_slots=[0], all_logits=True), cache)
        assert float((_logprobs(logits, tokens) - expected).abs().max()) <= TOL, scaling


def test_inverse_frequencies_equal_transformers_for_every_variant() -> None:
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    head_dim, max_positions = 64, 4096
    variants: list[dict[str, Any]] = [
        {"rope_type": "linear", "factor": 4.0},
        {"rope_type": "dynamic", "factor": 2.0},
        {
            "rope_type": "llama3",
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 512,
        },
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024},
        {
            "rope_type": "yarn",
            "factor": 40.0,
            "original_max_position_embeddings": 1024,
            "mscale": 1.0,
            "mscale_all_dim": 0.707,
            "beta_fast": 32,
            "beta_slow": 1,
        },
        {
            "rope_type": "yarn",
            "factor": 8.0,
            "original_max_position_embeddings": 1024,
            "attention_factor": 0.9,
            "truncate": False,
        },
    ]
    from opentinker.weights.rope import parse_rope

    for variant in variants:
        config = LlamaConfig(
            hidden_size=head_dim * 4,
            num_attention_heads=4,
            max_position_embeddings=max_positions,
            rope_parameters={**variant, "rope_theta": 10000.0},
        )
        for seq_len in (None, 9000) if variant["rope_type"] == "dynamic" else (None,):
            expected, expected_scale = ROPE_INIT_FUNCTIONS[variant["rope_type"]](config, CPU, seq_len=seq_len)
            rope: RopeConfig = parse_rope({"rope_scaling": variant, "rope_theta": 10000.0}, "llama", max_positions)
            inv_freq, scale = inverse_frequencies(rope, head_dim, max_positions, seq_len)
            assert torch.equal(inv_freq, expected.float()), variant
            assert scale == pytest.approx(expected_scale, rel=1e-12), variant
