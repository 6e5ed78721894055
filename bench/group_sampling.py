"""RL group sampling: G prompts x n samples each, as GRPO-style training asks for them. The same sequences are
submitted to the engine (in-process, its own thread, as the server runs it) as (a) G requests of n samples
(one Sample call per prompt: the engine computes each prompt once and the other n - 1 samples copy its K/V) and
(b) G * n requests of one sample (every sample prefills its own copy of the prompt). Temperature 1 with a seed
per sample, so the samples differ as RL needs and both sides draw the same tokens. Runs alternate (a, b),
(b, a), ...; medians of:

  wall time until the last sample ends, (b) / (a)                               (reported)
  time to the first token, median over samples, (b) / (a)                       (reported)

and whether both sides drew the same tokens (they should: the copied K/V is the computed one; a near-tie
can still flip a draw, since the two sides batch their prefills differently).

    .venv/bin/python bench/group_sampling.py [--quick]
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import threading
import time
from dataclasses import dataclass

import torch
from inprocess import build_engine, fill_slots
from results import record
from workload import FULL_SPEC, QUICK_SPEC, ModelSpec, linear_shapes, lora_weights, model_dir, prompts, spec_config

from opentinker.sampler_server.engine import Engine
from opentinker.sampler_server.sequence import SamplingParams, Sequence
from opentinker.sampler_server.slot_pool import SlotPool
from opentinker.sampler_server.updates import SequenceUpdate


@dataclass(frozen=True, slots=True)
class Setup:
    groups: int  # prompts
    samples: int  # samples per prompt
    prompt_len: int
    max_tokens: int
    reps: int


FULL = Setup(groups=4, samples=8, prompt_len=256, max_tokens=32, reps=5)
QUICK = Setup(groups=2, samples=4, prompt_len=64, max_tokens=8, reps=3)


@dataclass(frozen=True, slots=True)
class Run:
    wall: float
    ttft: float  # median over samples
    outputs: tuple[tuple[int, ...], ...]


def run(
    engine: Engine, pool: SlotPool, slot: int, group_prompts: list[list[int]], setup: Setup, *, shared: bool
) -> Run:
    """Submits every sample (as one request per prompt when `shared`, else one request per sample) and waits."""
    ids = itertools.count()
    firsts: dict[tuple[str, int], float] = {}
    left = len(group_prompts) * setup.samples
    errors: list[str] = []
    done, lock = threading.Event(), threading.Lock()

    def on_update(update: SequenceUpdate) -> None:  # engine thread: record, never raise
        nonlocal left
        firsts.setdefault((update.request_id, update.sample_index), time.monotonic())
        with lock:
            errors.extend([update.error] if update.error else [])
            left -= update.finished
            if left == 0 or errors:
                done.set()

    params = SamplingParams(temperature=1.0, max_tokens=setup.max_tokens)
    requests: list[list[Sequence]] = []
    for g, prompt in enumerate(group_prompts):
        group = []
        for i in range(setup.samples):
            n = next(ids)
            generator = torch.Generator().manual_seed(1000 * g + i)
            request_id = f"group-{g}" if shared else f"sample-{g}-{i}"
            group.append(
                Sequence(
                    seq_id=n,
                    request_id=request_id,
                    sample_index=i if shared else 0,
                    prompt=list(prompt),
                    params=params,
                    lora_slot=slot,
                    generator=generator,
                )
            )
        requests.extend([group] if shared else [[seq] for seq in group])
    start = time.monotonic()
    for sequences in requests:
        for _ in sequences:
            pool.acquire(slot)  # each sequence's pin; the engine releases it when the sequence ends
        engine.submit(sequences, on_update)
    if not done.wait(600):
        raise TimeoutError("the samples did not finish")
    if errors:
        raise RuntimeError(f"a sample failed: {errors[0]}")
    wall = time.monotonic() - start
    outputs = tuple(tuple(seq.output) for sequences in requests for seq in sequences)
    return Run(wall, statistics.median(t - start for t in firsts.values()), outputs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small model, fewer samples and repetitions")
    args = parser.parse_args()
    setup, spec = (QUICK, QUICK_SPEC) if args.quick else (FULL, FULL_SPEC)
    torch.set_num_threads(1)  # as the other sampler benchmarks
    began = time.perf_counter()
    count = setup.groups * setup.samples
    engine, pool = build_engine(
        model_dir(spec), max_slots=1, max_seqs=count, max_len=setup.prompt_len + setup.max_tokens + 8
    )
    (slot,) = fill_slots(pool, [lora_weights(linear_shapes(spec), seed=0)])
    group_prompts = prompts(setup.groups, spec.vocab_size, lens=(setup.prompt_len, setup.prompt_len))
    engine.start()
    try:
        for shared in (True, False):  # warm-up: both sides' batch shapes
            run(engine, pool, slot, group_prompts, setup, shared=shared)
        runs: dict[str, list[Run]] = {"shared": [], "separate": []}
        for rep in range(setup.reps):
            for side in ("shared", "separate") if rep % 2 == 0 else ("separate", "shared"):
                runs[side].append(run(engine, pool, slot, group_prompts, setup, shared=side == "shared"))
        computed, copied = engine.stats.prompt_tokens_computed, engine.stats.prompt_tokens_shared
    finally:
        engine.stop()
    report(setup, spec, runs, computed, copied, time.perf_counter() - began)


def report(
    setup: Setup, spec: ModelSpec, runs: dict[str, list[Run]], computed: int, copied: int, seconds: float
) -> None:
    wall = {side: statistics.median(r.wall for r in rs) for side, rs in runs.items()}
    ttft = {side: statistics.median(r.ttft for r in rs) for side, rs in runs.items()}
    same = all(a.outputs == b.outputs for a, b in zip(runs["shared"], runs["separate"], strict=True))
    config = {
        **spec_config(spec),
        "workload": f"{setup.groups} prompts x {setup.samples} samples, {setup.prompt_len} prompt tokens, "
        f"{setup.max_tokens} tokens at temperature 1, one adapter",
        "engine": "in-process, its own thread, 1 torch thread",
        "reps": setup.reps,
        "same_tokens": same,
    }
    record(
        "Group sampling wall, one-sample requests / n-sample requests", wall["separate"] / wall["shared"], config=config
    )
    record(
        "Group sampling time to first token, one-sample requests / n-sample requests",
        ttft["separate"] / ttft["shared"],
        config=config,
    )
    print(f"Group sampling ({config['model']}; {config['lora']})")
    print(f"  {config['workload']}; {setup.reps} alternating reps, medians")
    for side, label in (
        ("shared", f"{setup.groups} requests of n={setup.samples}"),
        ("separate", f"{setup.groups * setup.samples} requests of n=1"),
    ):
        walls = ", ".join(f"{r.wall:.2f}" for r in runs[side])
        print(f"    {label:<22} wall {wall[side]:.3f} s (runs {walls}); median first token {ttft[side] * 1000:.0f} ms")
    print(
        f"  one-sample / n-sample requests: wall {wall['separate'] / wall['shared']:.2f}x, first token "
        f"{ttft['separate'] / ttft['shared']:.2f}x; same tokens on both sides: {same}"
    )
    print(f"  prompt tokens over all runs: {computed} computed, {copied} copied from a sibling sample")
    print(f"  total {seconds:.0f} s")


if __name__ == "__main__":
    main()
