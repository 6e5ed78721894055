"""Runs the Triton LoRA kernels under TRITON_INTERPRET=1 on tiny shapes and prints one JSON line of results.

Started as a subprocess by test_lora_kernels.py: the interpreter must be switched on before triton builds the
kernels, which the parent process (that may already have imported triton) cannot guarantee.
"""

from __future__ import annotations

import json
import os
import zlib
from typing import NamedTuple

os.environ["TRITON_INTERPRET"] = "1"  # before anything imports the kernels

import torch

from opentinker.sampler_server.kernels import lora_delta_reference
from opentinker.sampler_server.kernels.triton_ops import TritonConfig, add_lora_triton


def make_pool(
    gen: torch.Generator, num_slots: int, max_rank: int, d_in: int, d_out: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    a = torch.randn(num_slots, max_rank, d_in, generator=gen) / d_in**0.5  # [S, R, d_in]
    b = torch.randn(num_slots, d_out, max_rank, generator=gen) / max_rank**0.5  # [S, d_out, R]
    scaling = torch.rand(num_slots, generator=gen) + 0.5  # [S]
    for s in range(num_slots):
        rank = 0 if s == 0 else 1 + (s * 5) % max_rank  # mixed real ranks, zero-padded up to R
        a[s, rank:] = 0
        b[s, :, rank:] = 0
    scaling[0] = 0
    return a.to(dtype), b.to(dtype), scaling


class Shape(NamedTuple):
    n: int
    d_in: int
    d_out: int
    num_slots: int
    max_rank: int


def run_case(
    name: str,
    shape: Shape,
    config: TritonConfig | None,
    *,
    dtype: torch.dtype = torch.float32,
    slots: list[int] | None = None,
    strided: bool = False,
    pool_layout: bool = False,
    atol: float = 1e-5,
) -> dict[str, object]:
    gen = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    n, d_in, d_out, num_slots, max_rank = shape
    a, b, scaling = make_pool(gen, num_slots, max_rank, d_in, d_out, dtype)
    if pool_layout:  # B as the slot pool keeps it: [S, R, d_out] storage seen as [S, d_out, R] (rank stride d_out)
        b = b.transpose(1, 2).contiguous().transpose(1, 2)
    if slots is None:
        slot_ids = torch.randint(0, num_slots, (n,), generator=gen)  # [N]
        slot_ids[0] = 0  # always one row without adapter
    else:
        slot_ids = torch.tensor(slots, dtype=torch.long)
    if strided:  # x transposed storage, y a column slice of a wider buffer
        x = torch.randn(d_in, n, generator=gen).to(dtype).T  # [N, d_in], strides (1, N)
        y = torch.randn(n, d_out + 5, generator=gen).to(dtype)[:, 2 : 2 + d_out]  # [N, d_out]
    else:
        x = torch.randn(n, d_in, generator=gen).to(dtype)
        y = torch.randn(n, d_out, generator=gen).to(dtype)
    y0 = y.clone()
    expected = y0 + lora_delta_reference(x, a, b, scaling, slot_ids)
    add_lora_triton(y, x, a, b, scaling, slot_ids, config=config)
    base = slot_ids == 0
    return {
        "name": name,
        "max_abs_err": (y.float() - expected.float()).abs().max().item() if n else 0.0,
        "atol": atol,
        "slot0_unchanged": bool(torch.equal(y[base], y0[base])),
    }


def main() -> None:
    tiny = TritonConfig(block_m=4, block_r=4, block_k=16, block_n=8)  # elementwise path, several blocks per axis
    dot = TritonConfig(block_m=16, block_r=16, block_k=16, block_n=16)  # tl.dot path (every block >= 16)
    shape = Shape(n=8, d_in=32, d_out=24, num_slots=4, max_rank=8)
    vocab = Shape(n=7, d_in=32, d_out=515, num_slots=4, max_rank=8)
    results = [
        run_case("fp32_elementwise", shape, tiny),
        run_case("fp32_dot", shape, dot),
        run_case("fp32_default_config", shape, None),
        run_case("rank16_chunked", Shape(6, 20, 12, 3, 16), tiny),
        run_case("strided_x_y", shape, tiny, strided=True),
        run_case("all_rows_slot0", shape, tiny, slots=[0] * 8),
        run_case("all_rows_one_slot", shape, dot, slots=[2] * 8),
        run_case("single_row", Shape(1, 16, 16, 3, 8), tiny, slots=[1]),
        run_case("fp16", shape, dot, dtype=torch.float16, atol=1e-2),
        # The unembedding: hidden -> vocab, an expand over many column blocks (and a ragged last one), on the logit
        # rows of a few sequences, B in the pool's layout.
        run_case("vocab_wide_elementwise", vocab, tiny, pool_layout=True),
        run_case("vocab_wide_dot", vocab, dot, pool_layout=True),
        run_case("vocab_wide_default_config", vocab, None, pool_layout=True),
        run_case("vocab_wide_sorted_rows", vocab, dot, slots=[0, 1, 1, 2, 2, 2, 3], pool_layout=True),
    ]
    print(json.dumps(results))


if __name__ == "__main__":
    main()
