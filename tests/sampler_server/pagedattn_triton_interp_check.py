"""Runs the Triton paged attention kernel under TRITON_INTERPRET=1 on tiny shapes and prints one JSON line of results.

Started as a subprocess by test_paged_attention.py: the interpreter must be switched on before triton builds the
kernel, which the parent process (that may already have imported triton) cannot guarantee.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "1"  # before anything imports the kernel
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for pagedattnutil

import torch
from pagedattnutil import CASES, make_inputs, naive_attention, run_attention

from opentinker.sampler_server.kernels.paged_attention_ops import (
    PagedAttentionConfig,
    PagedAttentionMeta,
    paged_attention,
)

CONFIGS = {
    "elementwise": PagedAttentionConfig(block_m=4, block_n=8, use_dot=False),  # several tiles on both axes
    "dot": PagedAttentionConfig(block_m=16, block_n=16, use_dot=True),  # the tl.dot form the GPU runs
}


def main() -> None:
    results: list[dict[str, object]] = []
    for case in CASES:
        inputs = make_inputs(case)
        torch_path = run_attention(inputs, "torch", block_size=case.block_size)  # [N, heads * hd]
        oracle = naive_attention(inputs, case.block_size)
        meta = PagedAttentionMeta.build(
            inputs.batch.block_tables,
            inputs.batch.new_lens,
            inputs.batch.context_lens,
            case.block_size,
            case.sliding_window,
            torch.device("cpu"),
        )
        for config_name, config in CONFIGS.items():
            out = paged_attention(inputs.q, inputs.k_rows, inputs.v_rows, meta, config).flatten(1)
            results.append(
                {
                    "name": f"{case.name}/{config_name}",
                    "err_vs_torch": (out - torch_path).abs().max().item(),
                    "err_vs_oracle": (out - oracle).abs().max().item(),
                    "finite": bool(out.isfinite().all()),
                }
            )
        # The plan's own dispatch (backend "triton" on a CPU cache), with the GPU's default block sizes.
        planned = run_attention(inputs, "triton", block_size=case.block_size)
        results.append(
            {
                "name": f"{case.name}/plan_default",
                "err_vs_torch": (planned - torch_path).abs().max().item(),
                "err_vs_oracle": (planned - oracle).abs().max().item(),
                "finite": bool(planned.isfinite().all()),
            }
        )
    print(json.dumps(results))


if __name__ == "__main__":
    main()
