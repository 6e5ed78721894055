"""Batched vs per-segment prefill attention on the torch path (CPU), side by side in one run.

8 prompts of 200 tokens (and a ragged mix, and chunks continuing cached prefixes) prefilled in one forward of the
tiny model (`make-tiny-model` defaults: qwen2, 2 layers, 4 heads, 2 kv heads, head_dim 16), blocks of 16: the
same forward with the step's prefill segments in one padded SDPA call (`batch_prefills`, the default) and one
call per segment, alternating, min and median time per forward; also the attention calls alone. Not a test: prints
ratios.

    .venv/bin/python bench/prefill_attention.py [--repeats N]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from opentinker.client.tiny_model import TinyModelSpec, make_tiny_model
from opentinker.sampler_server.model import ForwardBatch, KVCache, LlamaForCausalLM
from opentinker.sampler_server.model.attention import AttentionPlan, attention

CPU = torch.device("cpu")
BLOCK = 16


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def workload(lengths: list[int], cached: list[int]) -> tuple[ForwardBatch, int]:
    """Sequences of `lengths` tokens whose first `cached` are in the cache; consecutive blocks per sequence."""
    tables, next_block = [], 0
    for length in lengths:
        count = -(-length // BLOCK)
        tables.append(list(range(next_block, next_block + count)))
        next_block += count
    chunks = [[3 + t % 500 for t in range(length)][done:] for length, done in zip(lengths, cached, strict=True)]
    return ForwardBatch.build(chunks, cached, block_tables=tables, all_logits=False), next_block


def compare(model: LlamaForCausalLM, name: str, lengths: list[int], cached: list[int], repeats: int) -> None:
    batch, blocks = workload(lengths, cached)
    cache = KVCache(model.config, blocks, BLOCK, CPU, torch.float32)
    c = model.config
    rows = blocks * BLOCK
    q = torch.randn(batch.tokens.shape[0], c.num_heads, c.head_dim)
    k, v = torch.randn(rows, c.num_kv_heads, c.head_dim), torch.randn(rows, c.num_kv_heads, c.head_dim)

    def forward(batched: bool) -> Callable[[], object]:
        def run() -> object:
            model.batch_prefills = batched
            return model.forward(batch, cache)

        return run

    def attn(batched: bool) -> Callable[[], object]:
        plan = AttentionPlan(batch, batch.positions, CPU, c.sliding_window, BLOCK, "torch", batch_prefills=batched)
        return lambda: attention(c, q, k, v, plan)

    for label, make in (("forward", forward), ("attention", attn)):
        times: dict[bool, list[float]] = {True: [], False: []}
        for batched in (True, False):  # warm-up
            make(batched)()
        with torch.inference_mode():
            for _ in range(repeats):
                for batched in (False, True):
                    times[batched].append(timed(make(batched)))
        for stat in (min, statistics.median):  # min: the least disturbed run on a shared machine
            per_seg, batched_t = stat(times[False]), stat(times[True])
            print(
                f"{name:<34} {label:<9} {stat.__name__:<6} per-segment {per_seg * 1e3:8.2f} ms  "
                f"batched {batched_t * 1e3:8.2f} ms  batched/per-segment {batched_t / per_seg:5.2f}x"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_tiny_model(Path(tmp) / "tiny", TinyModelSpec())
        model = LlamaForCausalLM.from_pretrained(model_dir, device=CPU, dtype=torch.float32)
        model.pack_for_cpu()
        print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
        compare(model, "8 prompts x 200 tokens", [200] * 8, [0] * 8, args.repeats)
        compare(model, "8 prompts of 20..380 tokens", [20 + 51 * i for i in range(8)], [0] * 8, args.repeats)
        compare(
            model,
            "8 x 100 new after 100..800 cached",
            [200 + 100 * i for i in range(8)],
            [100 + 100 * i for i in range(8)],
            args.repeats,
        )
        compare(model, "32 prompts x 24 tokens", [24] * 32, [0] * 32, args.repeats)


if __name__ == "__main__":
    main()
