"""Attention cases over a random paged KV cache: sequences of given (new tokens, context) in shuffled,
non-contiguous blocks, so tests can run every attention path on the same numbers and compare."""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import torch

from opentinker.sampler_server.model.attention import AttentionBackend, AttentionPlan, attention
from opentinker.sampler_server.model.batch import ForwardBatch
from opentinker.weights.model_config import ModelConfig
from opentinker.weights.rope import RopeConfig


@dataclass(frozen=True, slots=True)
class AttnCase:
    name: str
    segments: tuple[tuple[int, int], ...]  # (new tokens, context) per sequence; new == 1 is a decode
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 8
    block_size: int = 4
    sliding_window: int | None = None


@dataclass(frozen=True, slots=True)
class AttnInputs:
    config: ModelConfig
    q: torch.Tensor  # [N, heads, hd]
    k_rows: torch.Tensor  # [num_blocks * block_size, kv_heads, hd]
    v_rows: torch.Tensor
    batch: ForwardBatch


def attn_config(heads: int, kv_heads: int, head_dim: int, sliding_window: int | None) -> ModelConfig:
    return ModelConfig(
        arch="qwen2",
        vocab_size=16,
        hidden_size=heads * head_dim,
        intermediate_size=16,
        num_layers=1,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=1e-6,
        rope=RopeConfig(rope_type="default", theta=10000.0),
        max_position_embeddings=4096,
        context_length=4096,
        tie_word_embeddings=False,
        attention_bias=False,
        qk_norm=False,
        eos_token_ids=(0,),
        bos_token_id=None,
        pad_token_id=None,
        sliding_window=sliding_window,
    )


def make_inputs(case: AttnCase, dtype: torch.dtype = torch.float32) -> AttnInputs:
    gen = torch.Generator().manual_seed(zlib.crc32(case.name.encode()))
    size = case.block_size
    needed = [-(-context // size) for _, context in case.segments]
    num_blocks = sum(needed) + 3  # a few blocks nobody uses
    order = torch.randperm(num_blocks, generator=gen).tolist()  # shuffled: tables are not contiguous runs
    tables, used = [], 0
    for count in needed:
        tables.append(order[used : used + count])
        used += count
    chunks = [[0] * new for new, _ in case.segments]
    batch = ForwardBatch.build(
        chunks, [context - new for new, context in case.segments], block_tables=tables, all_logits=True
    )
    n = batch.tokens.shape[0]
    rows = num_blocks * size
    q = torch.randn(n, case.heads, case.head_dim, generator=gen).to(dtype)
    k_rows = torch.randn(rows, case.kv_heads, case.head_dim, generator=gen).to(dtype)
    v_rows = torch.randn(rows, case.kv_heads, case.head_dim, generator=gen).to(dtype)
    config = attn_config(case.heads, case.kv_heads, case.head_dim, case.sliding_window)
    return AttnInputs(config, q, k_rows, v_rows, batch)


def run_attention(
    inputs: AttnInputs, backend: AttentionBackend, *, block_size: int, batch_prefills: bool = True
) -> torch.Tensor:
    """[N, heads * hd] attention of the batch's tokens by one path (torch: prefills batched whatever the padding
    when `batch_prefills`, each by itself otherwise)."""
    plan = AttentionPlan(
        inputs.batch,
        inputs.batch.positions,
        inputs.q.device,
        inputs.config.sliding_window,
        block_size,
        backend,
        batch_prefills=batch_prefills,
        min_pad_fill=0.0,
    )
    assert backend != "torch" or (plan.prefill_batch is not None) == (batch_prefills and len(plan.prefills) > 1)
    return attention(inputs.config, inputs.q, inputs.k_rows, inputs.v_rows, plan)


def naive_attention(inputs: AttnInputs, block_size: int) -> torch.Tensor:
    """The oracle: every query token by itself, its keys gathered position by position, float64 softmax."""
    c, out = inputs.config, []
    group = c.num_heads // c.num_kv_heads
    for start, table, length, context in inputs.batch.segments():
        rows = [table[p // block_size] * block_size + p % block_size for p in range(context)]
        k, v = inputs.k_rows[rows].double(), inputs.v_rows[rows].double()  # [ctx, kv_heads, hd]
        for i in range(length):
            pos = context - length + i
            seen = [p for p in range(pos + 1) if c.sliding_window is None or p > pos - c.sliding_window]
            qi = inputs.q[start + i].double()  # [heads, hd]
            kh = k[seen].repeat_interleave(group, dim=1)  # [seen, heads, hd]
            vh = v[seen].repeat_interleave(group, dim=1)
            weights = torch.softmax(torch.einsum("hd,shd->hs", qi, kh) / c.head_dim**0.5, dim=-1)  # [heads, seen]
            out.append(torch.einsum("hs,shd->hd", weights, vh).flatten())
    return torch.stack(out).to(inputs.q.dtype)


# Decode, prefill, continuation of a cached prefix, GQA, sliding window, several sequences of different lengths,
# and a mixed step; block tables are always shuffled. Tiny: the Triton interpreter runs them in seconds.
CASES = (
    AttnCase("decode_gqa", ((1, 9), (1, 3), (1, 16), (1, 1))),
    AttnCase("prefill_whole_prompts", ((7, 7), (12, 12), (3, 3))),
    AttnCase("prefill_same_length", ((6, 6), (6, 6), (6, 6))),
    AttnCase("continuation", ((5, 13), (4, 4), (9, 18))),
    AttnCase("mixed_step", ((1, 10), (6, 15), (1, 4), (5, 5), (1, 22))),
    AttnCase("sliding_window", ((1, 19), (8, 8), (6, 21), (1, 5)), sliding_window=5),
    AttnCase("mha", ((5, 11), (1, 7), (3, 3)), heads=2, kv_heads=2),
    AttnCase("one_kv_head_odd_dim", ((4, 10), (1, 6), (7, 7)), heads=3, kv_heads=1, head_dim=6, block_size=3),
)
