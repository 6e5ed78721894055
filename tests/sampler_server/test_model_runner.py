"""The sampler's own Llama-family forward against transformers, on tiny fp32 models.

Every batch here goes through the one `LlamaForCausalLM.forward` code path: whole-prompt prefill of several
sequences, single-token decode of sequences with different context lengths, prefill of a continuation on top
of a cached prefix, and mixes of these, with and without a LoRA hook.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from opentinker.client.tiny_model import TinyModelSpec, make_tiny_model
from opentinker.rpc.serving.errors import FailedPrecondition, InvalidArgument
from opentinker.sampler_server.model import ForwardBatch, KVCache, LlamaForCausalLM
from opentinker.weights.base_model import resolve_model_dir
from opentinker.weights.model_config import load_config, parse_config

os.environ.setdefault("HF_HUB_OFFLINE", "1")

TOL = 1e-4
CPU = torch.device("cpu")


@dataclass(frozen=True)
class Pair:
    """Our model and transformers' for the same directory."""

    model_dir: Path
    ours: LlamaForCausalLM
    hf: Any  # transformers PreTrainedModel

    def cache(self, max_seqs: int = 4, max_len: int = 64) -> KVCache:
        return KVCache(self.ours.config, max_seqs, max_len, CPU, torch.float32)

    def hf_logits(self, tokens: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return self.hf(torch.tensor([tokens])).logits[0].float()  # type: ignore[no-any-return]


def _load_pair(model_dir: Path) -> Pair:
    from transformers import AutoModelForCausalLM

    hf: Any = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    hf.eval()
    ours = LlamaForCausalLM.from_pretrained(model_dir, device=CPU, dtype=torch.float32)
    return Pair(model_dir, ours, hf)


@pytest.fixture(scope="module", params=["qwen2", "llama"])
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Pair:
    arch = request.param
    model_dir = make_tiny_model(tmp_path_factory.mktemp("models") / arch, TinyModelSpec(arch=arch, seed=0))
    return _load_pair(model_dir)


def _prompt(length: int, seed: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, 512, (length,), generator=generator).tolist()


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape
    return float((a - b).abs().max())


def test_prefill_batch_matches_transformers(pair: Pair) -> None:
    prompts = [_prompt(7, 1), _prompt(12, 2), _prompt(3, 3)]
    batch = ForwardBatch.build(prompts, [0, 0, 0], kv_slots=[2, 0, 3], all_logits=True)
    logits = pair.ours.forward(batch, pair.cache())  # [22, V]
    assert logits.dtype == torch.float32
    assert logits.shape == (22, pair.ours.config.vocab_size)
    for chunk, prompt in zip(torch.split(logits, [7, 12, 3]), prompts, strict=True):
        assert _max_diff(chunk, pair.hf_logits(prompt)) <= TOL


def test_decode_steps_match_full_sequence_logits(pair: Pair) -> None:
    """Prefill a[:-k] and b, then decode; at one step a third sequence is prefilled in the same batch."""
    k = 5
    a, b, c = _prompt(14, 4), _prompt(6 + k, 5), _prompt(9, 6)
    hf_a, hf_b, hf_c = pair.hf_logits(a), pair.hf_logits(b), pair.hf_logits(c)
    cache = pair.cache()
    prefix_a, prefix_b = len(a) - k, len(b) - k
    logits = pair.ours.forward(
        ForwardBatch.build([a[:prefix_a], b[:prefix_b]], [0, 0], [1, 3], all_logits=False), cache
    )
    assert _max_diff(logits[0], hf_a[prefix_a - 1]) <= TOL
    assert _max_diff(logits[1], hf_b[prefix_b - 1]) <= TOL
    for step in range(k):
        pa, pb = prefix_a + step, prefix_b + step
        chunks, prefixes, slots = [[a[pa]], [b[pb]]], [pa, pb], [1, 3]
        if step == 2:  # continuous batching: a new prompt joins two decoding sequences
            chunks, prefixes, slots = [*chunks, c], [*prefixes, 0], [*slots, 0]
        logits = pair.ours.forward(ForwardBatch.build(chunks, prefixes, slots, all_logits=False), cache)
        assert _max_diff(logits[0], hf_a[pa]) <= TOL
        assert _max_diff(logits[1], hf_b[pb]) <= TOL
        if step == 2:
            assert _max_diff(logits[2], hf_c[-1]) <= TOL


def test_chunked_prefill_equals_full_prefill(pair: Pair) -> None:
    prompt = _prompt(13, 7)
    full = pair.ours.forward(ForwardBatch.build([prompt], [0], [0], all_logits=True), pair.cache())
    cache = pair.cache()
    first = pair.ours.forward(ForwardBatch.build([prompt[:6]], [0], [2], all_logits=True), cache)
    second = pair.ours.forward(ForwardBatch.build([prompt[6:]], [6], [2], all_logits=True), cache)
    assert _max_diff(torch.cat([first, second]), full) <= 1e-5
    assert _max_diff(full, pair.hf_logits(prompt)) <= TOL


def _greedy(model: LlamaForCausalLM, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """Batched greedy decoding over our forward; a sequence stops at eos."""
    cache = KVCache(model.config, len(prompts), 64, CPU, torch.float32)
    out: list[list[int]] = [[] for _ in prompts]
    logits = model.forward(
        ForwardBatch.build(prompts, [0] * len(prompts), list(range(len(prompts))), all_logits=False), cache
    )
    live = list(range(len(prompts)))
    for _ in range(new_tokens):
        picks = logits.argmax(-1).tolist()
        for index, token in zip(live, picks, strict=True):
            out[index].append(token)
        live = [i for i in live if out[i][-1] not in model.config.eos_token_ids and len(out[i]) < new_tokens]
        if not live:
            break
        batch = ForwardBatch.build(
            [[out[i][-1]] for i in live], [len(prompts[i]) + len(out[i]) - 1 for i in live], live, all_logits=False
        )
        logits = model.forward(batch, cache)
    return out


def test_greedy_generation_matches_transformers_generate(pair: Pair) -> None:
    prompts = [_prompt(5, 8), _prompt(11, 9)]
    ours = _greedy(pair.ours, prompts, 10)
    for prompt, generated in zip(prompts, ours, strict=True):
        ids = torch.tensor([prompt])
        with torch.no_grad():
            hf = pair.hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=10, do_sample=False)
        assert generated == hf[0, len(prompt) :].tolist()
        assert len(generated) == 10 or generated[-1] in pair.ours.config.eos_token_ids


def test_lora_hook_equals_merged_weights(pair: Pair) -> None:
    """A hook adding x A^T B^T to q_proj and down_proj == transformers with W + B A merged."""
    generator = torch.Generator().manual_seed(10)
    rank = 4
    deltas: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for module, (d_in, d_out) in pair.ours.linear_shapes().items():
        if module.endswith(("q_proj", "down_proj")):
            a = torch.randn(rank, d_in, generator=generator) * 0.1  # [r, d_in]
            b = torch.randn(d_out, rank, generator=generator) * 0.1  # [d_out, r]
            deltas[module] = (a, b)
    assert len(deltas) == 2 * pair.ours.config.num_layers
    seen: list[str] = []

    def hook(module: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        seen.append(module)
        if module not in deltas:
            return y
        a, b = deltas[module]
        return y + (x @ a.T) @ b.T  # [N, d_in] -> [N, r] -> [N, d_out]

    prompts = [_prompt(8, 11), _prompt(5, 12)]
    batch = ForwardBatch.build(prompts, [0, 0], [0, 1], all_logits=True)
    with_lora = pair.ours.forward(batch, pair.cache(), hook)
    assert set(seen) == set(pair.ours.linear_shapes())  # every projection of every layer is offered to the hook
    base = pair.ours.forward(batch, pair.cache())
    assert _max_diff(with_lora, base) > 1e-2  # the delta matters

    from transformers import AutoModelForCausalLM

    merged: Any = AutoModelForCausalLM.from_pretrained(pair.model_dir, dtype=torch.float32)
    merged.eval()
    modules = dict(merged.named_modules())
    with torch.no_grad():
        for module, (a, b) in deltas.items():
            modules[module].weight += b @ a
        for chunk, prompt in zip(torch.split(with_lora, [8, 5]), prompts, strict=True):
            assert _max_diff(chunk, merged(torch.tensor([prompt])).logits[0]) <= TOL


def test_unsupported_model_type_fails_clearly(pair: Pair, tmp_path: Path) -> None:
    copy = Path(shutil.copytree(pair.model_dir, tmp_path / "gpt2"))
    config = json.loads((copy / "config.json").read_text())
    config["model_type"] = "gpt2"
    (copy / "config.json").write_text(json.dumps(config))
    for load in (
        lambda: load_config(copy),
        lambda: LlamaForCausalLM.from_pretrained(copy, device=CPU, dtype=torch.float32),
    ):
        with pytest.raises(FailedPrecondition) as info:
            load()
        assert info.value.reason == "UNSUPPORTED_ARCHITECTURE"
        assert "'gpt2'" in info.value.message
        assert "llama, mistral, qwen2, qwen3" in info.value.message


def test_resolve_model_dir(pair: Pair) -> None:
    assert resolve_model_dir(str(pair.model_dir)) == pair.model_dir
    with pytest.raises(FailedPrecondition, match="not in the Hugging Face cache") as info:
        resolve_model_dir("opentinker-test/never-cached-model")
    assert info.value.reason == "MODEL_NOT_CACHED"
    with pytest.raises(InvalidArgument, match="neither a local directory"):
        resolve_model_dir("/no/such/model/dir")
    with pytest.raises(InvalidArgument, match="applies to a hub id") as refused:
        resolve_model_dir(str(pair.model_dir), revision="main")
    assert refused.value.reason == "INVALID_REVISION"
    with pytest.raises(FailedPrecondition, match="--revision v2"):
        resolve_model_dir("opentinker-test/never-cached-model", revision="v2")


def test_rope_settings_in_both_formats_and_unsupported_variants_fail_clearly() -> None:
    raw: dict[str, object] = {
        "model_type": "llama",
        "vocab_size": 8,
        "hidden_size": 4,
        "intermediate_size": 8,
        "num_hidden_layers": 1,
        "num_attention_heads": 1,
        "rope_theta": 500000.0,
        "rope_scaling": {"rope_type": "longrope", "factor": 8.0, "short_factor": [1.0], "long_factor": [1.0]},
    }
    with pytest.raises(FailedPrecondition, match="longrope") as info:
        parse_config(raw)
    assert info.value.reason == "UNSUPPORTED_ARCHITECTURE"
    assert "default, linear, dynamic, llama3, yarn" in info.value.message
    # The hub's format: top-level rope_theta, rope_scaling with "type" or "rope_type".
    raw["rope_scaling"] = {"type": "linear", "factor": 2.0}
    rope = parse_config(raw).rope
    assert (rope.rope_type, rope.theta, rope.factor) == ("linear", 500000.0, 2.0)
    # transformers 5's: one rope_parameters block carrying rope_theta.
    del raw["rope_scaling"], raw["rope_theta"]
    raw["rope_parameters"] = {"rope_type": "default", "rope_theta": 1000.0}
    assert parse_config(raw).rope.theta == 1000.0
    raw["rope_parameters"] = {"rope_type": "llama3", "rope_theta": 1000.0, "factor": 8.0}  # lacks its factors
    with pytest.raises(InvalidArgument, match="low_freq_factor"):
        parse_config(raw)
    raw["rope_parameters"] = {"rope_type": "default", "partial_rotary_factor": 0.5}
    with pytest.raises(FailedPrecondition, match="partial_rotary_factor"):
        parse_config(raw)


def test_config_fields(pair: Pair) -> None:
    config = pair.ours.config
    assert (config.num_layers, config.num_heads, config.num_kv_heads, config.head_dim) == (2, 4, 2, 16)
    assert config.eos_token_ids == (2,)
    assert config.pad_token_id == 0
    assert config.bos_token_id is None
    assert config.attention_bias == (config.arch == "qwen2")
    assert not config.tie_word_embeddings


def test_kv_cache_bytes_matches_formula(pair: Pair) -> None:
    config = pair.ours.config
    for dtype, size in ((torch.float32, 4), (torch.bfloat16, 2)):
        cache = KVCache(config, 3, 40, CPU, dtype)
        expected = 3 * 40 * config.num_layers * 2 * config.num_kv_heads * config.head_dim * size
        assert cache.bytes == expected == KVCache.bytes_for(config, 3, 40, dtype)
        assert cache.k[0].shape == (3, 40, config.num_kv_heads, config.head_dim)  # blocks, rows, kv heads, hd


# Architectures the tiny-model factory does not cover: qwen3 (q/k norms, head_dim != hidden / heads, tied
# embeddings) and mistral with a sliding window shorter than the prompts.
def _make_hf_model(out_dir: Path, arch: str) -> Path:
    from transformers import AutoModelForCausalLM, MistralConfig, Qwen3Config

    common: dict[str, Any] = {
        "vocab_size": 128,
        "hidden_size": 48,
        "intermediate_size": 96,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 256,
        "eos_token_id": 1,
        "pad_token_id": 0,
    }
    config: Any
    if arch == "qwen3":
        config = Qwen3Config(head_dim=16, tie_word_embeddings=True, **common)
    else:
        config = MistralConfig(sliding_window=5, **common)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        factory: Any = AutoModelForCausalLM
        model = factory.from_config(config, dtype=torch.float32)
        if arch == "qwen3":  # non-trivial q/k norm weights
            for name, param in model.named_parameters():
                if name.endswith(("q_norm.weight", "k_norm.weight")):
                    param.data.uniform_(0.5, 1.5)
    model.save_pretrained(out_dir)
    return out_dir


@pytest.mark.parametrize("arch", ["qwen3", "mistral"])
def test_other_architectures_match_transformers(arch: str, tmp_path: Path) -> None:
    pair = _load_pair(_make_hf_model(tmp_path / arch, arch))
    config = pair.ours.config
    assert config.qk_norm == (arch == "qwen3")
    assert config.sliding_window == (5 if arch == "mistral" else None)
    if arch == "qwen3":
        assert config.tie_word_embeddings and pair.ours.lm_head is pair.ours.embed
    gen = torch.Generator().manual_seed(13)
    prompts: list[list[int]] = [torch.randint(2, 128, (n,), generator=gen).tolist() for n in (11, 4)]
    hf = [pair.hf_logits(p) for p in prompts]
    cache = pair.cache()
    # prefill all but 3 tokens, then a 2-token chunk on top of the prefix, then one decode step
    logits = pair.ours.forward(ForwardBatch.build([p[:-3] for p in prompts], [0, 0], [0, 1], all_logits=True), cache)
    for chunk, p, ref in zip(torch.split(logits, [8, 1]), prompts, hf, strict=True):
        assert _max_diff(chunk, ref[: len(p) - 3]) <= TOL
    logits = pair.ours.forward(
        ForwardBatch.build([p[-3:-1] for p in prompts], [len(p) - 3 for p in prompts], [0, 1], all_logits=True), cache
    )
    assert _max_diff(logits[:2], hf[0][-3:-1]) <= TOL
    assert _max_diff(logits[2:], hf[1][-3:-1]) <= TOL
    logits = pair.ours.forward(
        ForwardBatch.build([p[-1:] for p in prompts], [len(p) - 1 for p in prompts], [0, 1], all_logits=False), cache
    )
    assert _max_diff(logits[0], hf[0][-1]) <= TOL
    assert _max_diff(logits[1], hf[1][-1]) <= TOL
