"""Running streams while a long prompt enters: chunked prefill (mixed steps) against whole-prompt prefill.

4 streams decode 64 tokens each; at their first token a 1,500-token prompt arrives. Printed side by side per
--prefill-chunk-tokens: the streams' largest gap between two tokens (in engine steps and in ms), their median
gap, and the long prompt's time to first token. In-process engine (float32, CPU unless --device cuda), the
tiny model unless --model is given.

    .venv/bin/python bench/chunked_prefill.py [--model DIR] [--chunks 0,256,512] [--device cpu]
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import tempfile
import threading
import time
from pathlib import Path

import torch

from opentinker.sampler_server.engine import Engine
from opentinker.sampler_server.model.kv_cache import KVCache
from opentinker.sampler_server.model.llama import LlamaForCausalLM
from opentinker.sampler_server.scheduler import Scheduler
from opentinker.sampler_server.sequence import SamplingParams, Sequence
from opentinker.sampler_server.slot_pool import SlotPool
from opentinker.sampler_server.updates import SequenceUpdate

STREAMS, STREAM_TOKENS, LONG_PROMPT, MAX_LEN, BLOCK = 4, 64, 1500, 2048, 16


def measure(runner: LlamaForCausalLM, device: torch.device, chunk: int) -> dict[str, float]:
    blocks = (STREAMS + 2) * MAX_LEN // BLOCK
    cache = KVCache(runner.config, blocks, BLOCK, device, runner.dtype)
    pool = SlotPool(runner.linear_shapes(), max_slots=1, max_rank=8, device=device)
    scheduler = Scheduler(max_seqs=8, max_batch_tokens=4096, prefill_chunk_tokens=chunk)
    engine = Engine(
        runner,
        cache,
        pool.tensors,
        scheduler,
        release=lambda slot: None,
        max_len=MAX_LEN,
        eos_token_ids=(),
        burst_wait=0.02,
    )
    params = SamplingParams(temperature=0.0, max_tokens=STREAM_TOKENS)
    streams = [
        Sequence(
            seq_id=i,
            request_id=f"s{i}",
            sample_index=0,
            params=params,
            lora_slot=0,
            prompt=[(7 * i + j) % 200 + 3 for j in range(16)],
        )
        for i in range(STREAMS)
    ]
    long = Sequence(
        seq_id=99,
        request_id="long",
        sample_index=0,
        params=SamplingParams(temperature=0.0, max_tokens=4),
        lora_slot=0,
        prompt=[(13 * j) % 300 + 3 for j in range(LONG_PROMPT)],
    )
    seen: dict[str, list[tuple[int, float]]] = {}  # request -> (engine step, time) of each token
    done, left, sent = threading.Event(), [STREAMS + 1], [0.0]

    def on_update(update: SequenceUpdate) -> None:
        now = time.perf_counter()
        seen.setdefault(update.request_id, []).extend([(engine.stats.steps, now)] * len(update.tokens))
        if not sent[0] and update.request_id.startswith("s"):
            sent[0] = now
            engine.submit([long], on_update)  # taken in before the next step
        left[0] -= update.finished
        if not left[0]:
            done.set()

    engine.start()
    try:
        engine.submit(streams, on_update)
        assert done.wait(600)
    finally:
        engine.stop()
    step_gaps, ms_gaps = [], []
    for request, marks in seen.items():
        if request.startswith("s"):
            step_gaps += [b[0] - a[0] for a, b in itertools.pairwise(marks)]
            ms_gaps += [1000 * (b[1] - a[1]) for a, b in itertools.pairwise(marks)]
    return {
        "max gap (steps)": max(step_gaps),
        "max gap (ms)": max(ms_gaps),
        "median gap (ms)": statistics.median(ms_gaps),
        "long prompt TTFT (ms)": 1000 * (seen["long"][0][1] - sent[0]),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", type=Path)
    parser.add_argument("--chunks", default="0,256,512")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    device = torch.device(args.device)
    model = args.model
    if model is None:
        from opentinker.client.tiny_model import TinyModelSpec, make_tiny_model

        model = make_tiny_model(Path(tempfile.mkdtemp()) / "tiny", TinyModelSpec(arch="qwen2", seed=0))
    runner = LlamaForCausalLM.from_pretrained(model, device=device, dtype=torch.float32)
    chunks = [int(c) for c in args.chunks.split(",")]
    measure(runner, device, chunks[0])  # warm-up
    results: dict[int, list[dict[str, float]]] = {c: [] for c in chunks}
    for _ in range(args.repeats):  # alternating, so that drift in the machine's load hits every setting alike
        for c in chunks:
            results[c].append(measure(runner, device, c))
    keys = list(results[chunks[0]][0])
    print(f"{STREAMS} streams decoding while a {LONG_PROMPT}-token prompt enters (median of {args.repeats} runs)")
    print(f"{'--prefill-chunk-tokens':<24}" + "".join(f"{c if c else 'whole':>12}" for c in chunks))
    for key in keys:
        print(f"{key:<24}" + "".join(f"{statistics.median(r[key] for r in results[c]):>12.1f}" for c in chunks))


if __name__ == "__main__":
    main()
