"""Attention over block tables: the torch path's batched prefill (several multi-token segments in one padded SDPA
call) equals the per-segment path and a float64 oracle; the Triton paged attention kernel, interpreted on the CPU,
equals the torch path on decode, prefill, continuation of a cached prefix, GQA, sliding window, mixed steps and
shuffled block tables; the backend is chosen by the cache's device."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from pagedattnutil import CASES, AttnCase, make_inputs, naive_attention, run_attention

from opentinker.sampler_server.kernels import TRITON_AVAILABLE
from opentinker.sampler_server.kernels.paged_attention_ops import PagedAttentionMeta, paged_attention
from opentinker.sampler_server.model import ForwardBatch, KVCache, LlamaForCausalLM
from opentinker.sampler_server.model.attention import MIN_PAD_FILL, AttentionPlan, padding_fill, resolve_attention

FP32 = 1e-5  # fp32 rounding of attention outputs of magnitude ~1 (summation order differs, nothing else)


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.name)
def test_batched_prefill_equals_the_per_segment_path(case: AttnCase) -> None:
    inputs = make_inputs(case)
    batched = run_attention(inputs, "torch", block_size=case.block_size)
    per_segment = run_attention(inputs, "torch", block_size=case.block_size, batch_prefills=False)
    oracle = naive_attention(inputs, case.block_size)
    assert (batched - per_segment).abs().max().item() <= FP32
    assert (batched - oracle).abs().max().item() <= FP32
    assert (per_segment - oracle).abs().max().item() <= FP32


def test_the_plan_batches_two_or_more_prefills_and_leaves_one_alone() -> None:
    for name, segments, batched in (
        ("two", ((5, 9), (1, 4), (4, 8)), True),  # fill 77 / 90
        ("one", ((5, 9), (1, 4), (1, 3)), False),
        ("none", ((1, 9), (1, 4)), False),
        ("mostly_padding", ((2, 2), (80, 80), (2, 2), (2, 2)), False),  # fill 0.25: each keeps its own call
    ):
        inputs = make_inputs(AttnCase(name, segments))
        plan = AttentionPlan(inputs.batch, inputs.batch.positions, torch.device("cpu"), None, 4, "torch")
        assert (plan.prefill_batch is not None) == batched, name
        assert plan.decode_rows is not None or name in ("two", "mostly_padding")


def test_a_mixed_batch_of_the_tiny_model_gives_each_sequences_logits_alone(tiny_model: Path) -> None:
    # Whole prompts of different lengths, a chunk continuing a cached prefix and a decode, in one forward, equal
    # each sequence forwarded by itself (one prefill: the single-segment path) in the same blocks.
    model = LlamaForCausalLM.from_pretrained(tiny_model, device=torch.device("cpu"), dtype=torch.float32)
    prompts = [list(range(3, 3 + n)) for n in (21, 18, 30, 17)]
    prefix = {2: 12, 3: 16}  # sequence 2 continues 12 cached tokens; sequence 3 decodes its 17th
    tables = [[0, 5], [2, 4], [7, 1], [3, 6]]

    def fresh_cache() -> KVCache:
        cache = KVCache(model.config, 8, 16, torch.device("cpu"), torch.float32)
        for i, cached in prefix.items():
            model.forward(
                ForwardBatch.build([prompts[i][:cached]], [0], block_tables=[tables[i]], all_logits=False), cache
            )
        return cache

    chunks = [prompt[prefix.get(i, 0) :] for i, prompt in enumerate(prompts)]
    starts = [prefix.get(i, 0) for i in range(len(prompts))]
    prefills = [(0, len(chunk), torch.arange(starts[i] + len(chunk))) for i, chunk in enumerate(chunks[:3])]
    assert padding_fill(prefills) >= MIN_PAD_FILL  # the three prefills do run as one padded call
    together = model.forward(ForwardBatch.build(chunks, starts, block_tables=tables, all_logits=True), fresh_cache())
    alone, cache = [], fresh_cache()
    for i, chunk in enumerate(chunks):
        alone.append(
            model.forward(ForwardBatch.build([chunk], [starts[i]], block_tables=[tables[i]], all_logits=True), cache)
        )
    assert together.shape[0] == sum(len(chunk) for chunk in chunks)
    assert (together - torch.cat(alone)).abs().max().item() <= 1e-4  # logits of magnitude ~10


def test_the_backend_follows_the_caches_device() -> None:
    assert resolve_attention("cpu", triton_available=True) == "torch"
    assert resolve_attention("cuda", triton_available=True) == "triton"
    assert resolve_attention("cuda", triton_available=False) == "torch"
    assert resolve_attention("cpu") == "torch"


def test_the_triton_kernel_refuses_cpu_tensors_without_the_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    inputs = make_inputs(CASES[0])
    meta = PagedAttentionMeta.build(
        inputs.batch.block_tables, inputs.batch.new_lens, inputs.batch.context_lens, 4, None, torch.device("cpu")
    )
    with pytest.raises(RuntimeError, match="CUDA tensors, or TRITON_INTERPRET=1"):
        paged_attention(inputs.q, inputs.k_rows, inputs.v_rows, meta)


@pytest.mark.skipif(not TRITON_AVAILABLE, reason="triton is not installed, so its kernel cannot run (even interpreted)")
def test_the_triton_kernel_under_the_interpreter_equals_the_torch_path() -> None:
    script = Path(__file__).with_name("pagedattn_triton_interp_check.py")
    proc = subprocess.run(
        [sys.executable, str(script)],
        env={**os.environ, "TRITON_INTERPRET": "1"},
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(results) == 3 * len(CASES)
    for case in results:
        assert case["finite"], case
        assert case["err_vs_torch"] <= FP32, case
        assert case["err_vs_oracle"] <= FP32, case


@pytest.mark.skipif(not (torch.cuda.is_available() and TRITON_AVAILABLE), reason="needs a CUDA device and triton")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_the_triton_kernel_on_cuda_equals_the_torch_path(dtype: torch.dtype) -> None:
    case = AttnCase(
        "cuda",
        ((1, 300), (64, 64), (40, 200), (1, 17), (130, 130), (1, 1)),
        heads=8,
        kv_heads=2,
        head_dim=64,
        block_size=16,
    )
    inputs = make_inputs(case, dtype)
    cuda = make_inputs(case, dtype)
    moved = type(cuda)(cuda.config, cuda.q.cuda(), cuda.k_rows.cuda(), cuda.v_rows.cuda(), cuda.batch)
    triton_out = run_attention(moved, "triton", block_size=16).cpu().float()
    torch_out = run_attention(inputs, "torch", block_size=16).float()
    assert (triton_out - torch_out).abs().max().item() <= (FP32 if dtype == torch.float32 else 2e-2)


def test_stale_nan_rows_of_freed_blocks_never_reach_another_sequence(tiny_model: Path) -> None:
    # A freed block keeps what its last holder wrote, NaN included (an adapter that overflowed). The rows a batched
    # call pads with are masked, but a masked key still enters the score sum: NaN there is NaN everywhere. Padding
    # must read only rows the sequence itself wrote. Decodes of different lengths pad; two prefills of different
    # lengths batch into one padded call.
    model = LlamaForCausalLM.from_pretrained(tiny_model, device=torch.device("cpu"), dtype=torch.float32)
    prompts = [list(range(3, 3 + n)) for n in (5, 20, 9)]
    tables = [[4, 0], [1, 2], [3, 5]]

    def run(fill: float) -> torch.Tensor:
        cache = KVCache(model.config, 6, 16, torch.device("cpu"), torch.float32)
        for layer in range(model.config.num_layers):
            cache.k[layer].fill_(fill)
            cache.v[layer].fill_(fill)
        prefill = model.forward(
            ForwardBatch.build(prompts[:2], [0, 0], block_tables=tables[:2], all_logits=False), cache
        )
        decode = model.forward(
            ForwardBatch.build([[7], [8]], [len(p) for p in prompts[:2]], block_tables=tables[:2], all_logits=False),
            cache,
        )
        step = ForwardBatch.build(
            [[9], prompts[2]], [len(prompts[0]) + 1, 0], block_tables=[tables[0], tables[2]], all_logits=False
        )
        mixed = model.forward(step, cache)
        return torch.cat([prefill, decode, mixed])

    clean, stale = run(0.0), run(math.nan)
    assert clean.isfinite().all()
    assert stale.isfinite().all(), "a stale NaN row reached a sequence's attention"
    assert (stale - clean).abs().max().item() <= 1e-5
