"""LoRA on the unembedding in the sampler's own forward: the lm_head delta is added per logit row (M rows, not the
N tokens), each row with its own sequence's adapter slot, in one batch mixing the base model, an adapter with
lm_head, one without and an lm_head-only one; every row equals peft with that sequence's adapter alone, for an
untied model and a tied one (the input embedding is the output projection's weight and stays as it is)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from opentinker.client.tiny_model import make_family_model
from opentinker.sampler_server.engine import Engine
from opentinker.sampler_server.kernels import Kernel
from opentinker.sampler_server.model.batch import ForwardBatch
from opentinker.sampler_server.model.kv_cache import KVCache
from opentinker.sampler_server.model.llama import LlamaForCausalLM
from opentinker.sampler_server.scheduler import Scheduler
from opentinker.sampler_server.slot_pool import SlotPool
from opentinker.weights.peft import lora_a_key, lora_b_key

CPU = torch.device("cpu")
TOL = 1e-5
# Adapter slot -> (rank, alpha, leaf names it targets); slot 0 is the base model.
ADAPTERS: dict[int, tuple[int, float, tuple[str, ...]]] = {
    1: (4, 8.0, ("q_proj", "down_proj", "lm_head")),
    2: (2, 4.0, ("v_proj", "up_proj")),
    3: (8, 16.0, ("lm_head",)),
}


@pytest.fixture(scope="module", params=["untied", "tied"])
def model_dir(request: pytest.FixtureRequest, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    if request.param == "untied":
        return tiny_model
    tied = make_family_model(tmp_path_factory.mktemp("tied") / "qwen3", "qwen3", seed=3)
    assert json.loads((tied / "config.json").read_text())["tie_word_embeddings"]
    return tied


def adapter_weights(shapes: dict[str, tuple[int, int]], slot: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    rank, _, leaves = ADAPTERS[slot]
    generator = torch.Generator().manual_seed(100 + slot)
    return {
        module: (
            torch.randn(rank, d_in, generator=generator) * 0.2,
            torch.randn(d_out, rank, generator=generator) * 0.2,
        )
        for module, (d_in, d_out) in shapes.items()
        if module.rsplit(".", 1)[-1] in leaves
    }


def peft_folder(
    directory: Path, model_dir: Path, slot: int, weights: dict[str, tuple[torch.Tensor, torch.Tensor]]
) -> Path:
    rank, alpha, leaves = ADAPTERS[slot]
    directory.mkdir()
    tensors = {key(m): t.contiguous() for m, (a, b) in weights.items() for key, t in ((lora_a_key, a), (lora_b_key, b))}
    save_file(tensors, directory / "adapter_model.safetensors")
    config = {
        "peft_type": "LORA",
        "r": rank,
        "lora_alpha": alpha,
        "target_modules": list(leaves),
        "base_model_name_or_path": str(model_dir),
        "task_type": "CAUSAL_LM",
        "lora_dropout": 0.0,
    }
    (directory / "adapter_config.json").write_text(json.dumps(config))
    return directory


def peft_logits(model_dir: Path, adapter: Path | None, tokens: list[int]) -> torch.Tensor:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model: Any = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, str(adapter))
    with torch.no_grad():
        logits: torch.Tensor = model.eval()(input_ids=torch.tensor([tokens])).logits[0].float()
    return logits  # [L, V]


@pytest.mark.parametrize("kernel", ["reference", "segments"])
@pytest.mark.parametrize("all_logits", [False, True])
def test_mixed_batch_rows_equal_peft(model_dir: Path, tmp_path: Path, kernel: Kernel, all_logits: bool) -> None:
    model = LlamaForCausalLM.from_pretrained(model_dir, device=CPU, dtype=torch.float32)
    shapes = model.linear_shapes()
    assert shapes["lm_head"] == (model.config.hidden_size, model.config.vocab_size)
    pool = SlotPool(shapes, max_slots=len(ADAPTERS), max_rank=8, device=CPU)
    folders: dict[int, Path | None] = {0: None}
    for slot, (rank, alpha, _) in ADAPTERS.items():
        weights = adapter_weights(shapes, slot)
        index = pool.reserve(("unembed", slot))
        pool.fill(index, weights, rank=rank, scaling=alpha / rank, artifact_sha256="")
        assert index == slot
        folders[slot] = peft_folder(tmp_path / f"adapter-{slot}", model_dir, slot, weights)
    assert pool.tensors.unembed.tolist() == [0, 1, 0, 1]  # the versions with a LoRA on lm_head
    cache = KVCache(model.config, 4, 32, CPU, torch.float32)
    engine = Engine(
        model,
        cache,
        pool.tensors,
        Scheduler(max_seqs=4, max_batch_tokens=64),
        release=pool.release,
        max_len=32,
        eos_token_ids=(),
        kernel=kernel,
    )
    prompts = [[3 + (7 * s + 11 * i) % 400 for i in range(5 + s)] for s in range(4)]  # slot s: prompt s
    batch = ForwardBatch.build(prompts, [0] * 4, kv_slots=[0, 1, 2, 3], all_logits=all_logits)
    token_slots = [s for s, p in enumerate(prompts) for _ in p]
    rows_per_seq = [len(p) if all_logits else 1 for p in prompts]
    row_slots = [s for s, count in enumerate(rows_per_seq) for _ in range(count)]
    logits = model.forward(batch, cache, engine._lora_hook(token_slots, row_slots))  # [M, V]
    assert logits.shape == (len(row_slots), model.config.vocab_size)
    for slot, (prompt, rows) in enumerate(zip(prompts, torch.split(logits, rows_per_seq), strict=True)):
        want = peft_logits(model_dir, folders[slot], prompt)[-rows.shape[0] :]
        assert (rows - want).abs().max().item() <= TOL, slot
    # The unembedding's delta matters: without lm_head's tensors, the lm_head-only adapter is the base model.
    base = peft_logits(model_dir, None, prompts[3])[-1]
    assert (torch.split(logits, rows_per_seq)[3][-1] - base).abs().max().item() > 1e-2


def test_the_unembedding_is_offered_to_the_hook_with_the_logit_rows(model_dir: Path) -> None:
    model = LlamaForCausalLM.from_pretrained(model_dir, device=CPU, dtype=torch.float32)
    seen: dict[str, tuple[int, int]] = {}

    def hook(module: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        seen[module] = (x.shape[0], y.shape[1])
        return y

    cache = KVCache(model.config, 2, 16, CPU, torch.float32)
    batch = ForwardBatch.build([[5, 6, 7, 8], [9, 10]], [0, 0], kv_slots=[0, 1], all_logits=False)
    model.forward(batch, cache, hook)
    assert set(seen) == set(model.linear_shapes())
    assert seen["lm_head"] == (2, model.config.vocab_size)  # 2 logit rows of 6 tokens, vocab wide
    assert seen["model.layers.0.self_attn.q_proj"][0] == 6


def test_a_tied_model_serves_lm_head_lora_and_keeps_its_embedding(tmp_path: Path) -> None:
    """Tied: the pool's lm_head slot is separate from the embedding; serving an adapter never writes the base."""
    tied = make_family_model(tmp_path / "qwen2.5", "qwen2.5", seed=4)
    model = LlamaForCausalLM.from_pretrained(tied, device=CPU, dtype=torch.float32)
    assert model.lm_head is model.embed
    before = model.embed.clone()
    pool = SlotPool(model.linear_shapes(), max_slots=1, max_rank=8, device=CPU)
    weights = adapter_weights(model.linear_shapes(), 3)
    pool.fill(pool.reserve(("tied", 1)), weights, rank=8, scaling=2.0, artifact_sha256="")
    cache = KVCache(model.config, 2, 16, CPU, torch.float32)
    engine = Engine(
        model,
        cache,
        pool.tensors,
        Scheduler(max_seqs=1, max_batch_tokens=16),
        release=pool.release,
        max_len=16,
        eos_token_ids=(),
        kernel="segments",
    )
    batch = ForwardBatch.build([[4, 5, 6]], [0], kv_slots=[0], all_logits=True)
    with_lora = model.forward(batch, cache, engine._lora_hook([1, 1, 1], [1, 1, 1]))
    assert torch.equal(model.embed, before)
    assert (with_lora - model.forward(batch, cache)).abs().max().item() > 1e-2  # the delta was added to the logits


@pytest.mark.parametrize("kernel", ["reference", "segments"])
def test_versions_without_lm_head_skip_the_vocabulary_wide_delta(
    tiny_model: Path, monkeypatch: pytest.MonkeyPatch, kernel: Kernel
) -> None:
    """A batch whose adapters have no LoRA on lm_head runs no lm_head kernel (its zeros would cost ~8% of the LM
    head's matmul); one with such an adapter runs it, on that adapter's rows only."""
    from opentinker.sampler_server import lora_plan

    model = LlamaForCausalLM.from_pretrained(tiny_model, device=CPU, dtype=torch.float32)
    shapes = model.linear_shapes()
    pool = SlotPool(shapes, max_slots=2, max_rank=8, device=CPU)
    for slot in (1, 2):  # slot 1: lm_head among its targets; slot 2: none
        rank, alpha, _ = ADAPTERS[slot]
        pool.fill(
            pool.reserve(("skip", slot)),
            adapter_weights(shapes, slot),
            rank=rank,
            scaling=alpha / rank,
            artifact_sha256="",
        )
    calls: list[tuple[str, int]] = []  # (module, rows it got)
    from opentinker.sampler_server.kernels import add_lora as real_add
    from opentinker.sampler_server.kernels.segments import add_lora_runs as real_runs

    def runs_spy(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, runs: Any, *rest: Any) -> None:
        calls.append(
            ("lm_head" if b.shape[1] == model.config.vocab_size else "other", sum(r.end - r.start for r in runs))
        )
        real_runs(y, x, a, b, runs, *rest)

    def add_spy(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        calls.append(("lm_head" if b.shape[1] == model.config.vocab_size else "other", x.shape[0]))
        real_add(y, x, a, b, *args, **kwargs)

    monkeypatch.setattr(lora_plan, "add_lora_runs", runs_spy)
    monkeypatch.setattr(lora_plan, "add_lora", add_spy)
    cache = KVCache(model.config, 2, 16, CPU, torch.float32)
    engine = Engine(
        model,
        cache,
        pool.tensors,
        Scheduler(max_seqs=2, max_batch_tokens=32),
        release=pool.release,
        max_len=16,
        eos_token_ids=(),
        kernel=kernel,
    )
    batch = ForwardBatch.build([[4, 5, 6]], [0], kv_slots=[0], all_logits=True)
    model.forward(batch, cache, engine._lora_hook([2, 2, 2], [2, 2, 2]))
    assert calls and not [c for c in calls if c[0] == "lm_head" and c[1] > 0]
    calls.clear()
    batch = ForwardBatch.build([[4, 5, 6], [7, 8]], [0, 0], kv_slots=[0, 1], all_logits=False)
    model.forward(batch, cache, engine._lora_hook([1, 1, 1, 2, 2], [1, 2]))
    lm_head_rows = [rows for module, rows in calls if module == "lm_head"]
    assert lm_head_rows == ([1] if kernel == "segments" else [2])  # segments: slot 1's row; others: slot 2's as 0
