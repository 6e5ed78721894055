"""P8 continuous batching: N requests arrive as a Poisson process (rate = a fraction of the engine's measured
capacity) with output lengths drawn uniformly, each on one of a few adapters, run through the engine in this
process (Engine.submit + the engine thread; EOS off, so every request generates exactly its length):

  continuous  each request is submitted when it arrives; the scheduler adds it between decode steps
  static      the engine takes every request that has arrived when it is idle (at most --max-seqs), runs that
              batch to completion, and only then takes the next (requests arriving meanwhile wait)

Both see the same arrivals, prompts and lengths; the runs alternate (order rotated each repetition). Reported
(medians over repetitions): throughput (generated tokens / time from the first arrival to the last token)
and latency (arrival -> last token) p50 / p99, each as continuous over static.

    .venv/bin/python bench/continuous_batching.py [--quick]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from dataclasses import dataclass

import torch
from inprocess import Client, Request, Timing, build_engine, fill_slots
from results import record
from workload import (
    FULL_SPEC,
    QUICK_SPEC,
    linear_shapes,
    lora_weights,
    model_dir,
    percentile,
    poisson_arrivals,
    prompts,
    spec_config,
)

MAX_LEN = 128


@dataclass(frozen=True, slots=True)
class Setup:
    requests: int
    reps: int
    max_seqs: int  # engine batch limit (KV slots); the static batch cap too
    tokens: tuple[int, int]  # output length range, uniform
    adapters: int
    load: float  # arrival rate as a fraction of the measured capacity


FULL = Setup(requests=96, reps=3, max_seqs=32, tokens=(8, 64), adapters=8, load=0.8)
QUICK = Setup(requests=32, reps=2, max_seqs=16, tokens=(4, 32), adapters=4, load=0.8)


@dataclass(frozen=True, slots=True)
class Run:
    throughput: float  # tokens/s
    p50: float  # seconds, arrival -> last token
    p99: float


def summarize(timings: list[Timing], arrivals: list[float], t0: float) -> Run:
    if any(t.error for t in timings):
        raise RuntimeError(next(t.error for t in timings if t.error))
    latency = [t.end - (t0 + a) for t, a in zip(timings, arrivals, strict=True)]
    tokens = sum(t.tokens for t in timings)
    return Run(
        tokens / (max(t.end for t in timings) - t0 - arrivals[0]), percentile(latency, 50), percentile(latency, 99)
    )


def sleep_until(deadline: float) -> None:
    delay = deadline - time.monotonic()
    if delay > 0:
        time.sleep(delay)


def continuous(client: Client, requests: list[Request], arrivals: list[float]) -> Run:
    t0 = time.monotonic()
    timings: list[Timing] = []
    for req, at in zip(requests, arrivals, strict=True):
        sleep_until(t0 + at)
        timings += client.submit([req])
    client.wait()
    return summarize(timings, arrivals, t0)


def static(client: Client, requests: list[Request], arrivals: list[float], cap: int) -> Run:
    t0 = time.monotonic()
    timings: list[Timing] = []
    i = 0
    while i < len(requests):
        sleep_until(t0 + arrivals[i])  # idle: wait for the next arrival
        now = time.monotonic() - t0
        end = i + 1
        while end < len(requests) and end - i < cap and arrivals[end] <= now:
            end += 1
        timings += client.submit(requests[i:end])
        client.wait()  # the batch runs to completion before anything joins
        i = end
    return summarize(timings, arrivals, t0)


def capacity(client: Client, requests: list[Request], batch: int) -> float:
    """Requests per second when the engine runs `batch` of them at once (mean length as in the workload)."""
    start = time.monotonic()
    timings = client.submit(requests[:batch])
    client.wait()
    return batch / (max(t.end for t in timings) - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small model, fewer requests")
    args = parser.parse_args()
    setup, spec = (QUICK, QUICK_SPEC) if args.quick else (FULL, FULL_SPEC)
    torch.set_num_threads(1)  # as the other sampler benchmarks
    began = time.perf_counter()
    engine, pool = build_engine(
        model_dir(spec), max_slots=setup.adapters, max_seqs=setup.max_seqs, max_len=MAX_LEN, stop_on_eos=False
    )
    slots = fill_slots(pool, [lora_weights(linear_shapes(spec), seed=i) for i in range(setup.adapters)])
    engine.start()
    try:
        rng = random.Random(5)
        requests = [
            Request(p, slots[i % len(slots)], rng.randint(*setup.tokens))
            for i, p in enumerate(prompts(setup.requests, spec.vocab_size))
        ]
        client = Client(engine, pool)
        capacity(client, requests, setup.max_seqs)  # warm-up
        rate = setup.load * capacity(client, requests, setup.max_seqs)
        arrivals = poisson_arrivals(rate, setup.requests)
        runs: dict[str, list[Run]] = {"continuous": [], "static": []}
        for rep in range(setup.reps):
            for mode in ("continuous", "static") if rep % 2 == 0 else ("static", "continuous"):
                if mode == "continuous":
                    runs[mode].append(continuous(client, requests, arrivals))
                else:
                    runs[mode].append(static(client, requests, arrivals, setup.max_seqs))
    finally:
        engine.stop()
    med = {
        mode: Run(*(statistics.median(getattr(r, f) for r in rs) for f in ("throughput", "p50", "p99")))
        for mode, rs in runs.items()
    }
    c, s = med["continuous"], med["static"]
    config = {
        **spec_config(spec),
        "workload": f"{setup.requests} requests, Poisson arrivals at {rate:.2f}/s ({setup.load:.0%} of the capacity "
        f"measured with {setup.max_seqs} at once), ~16 prompt tokens, output {setup.tokens[0]}-{setup.tokens[1]} "
        f"tokens uniform, {setup.adapters} adapters round robin",
        "engine": f"in-process, 1 torch thread, max_seqs {setup.max_seqs}, static batches up to {setup.max_seqs}",
        "reps": setup.reps,
        "continuous_tokens_per_s": round(c.throughput, 1),
        "static_tokens_per_s": round(s.throughput, 1),
        "continuous_p50_ms": round(c.p50 * 1000, 1),
        "continuous_p99_ms": round(c.p99 * 1000, 1),
        "static_p50_ms": round(s.p50 * 1000, 1),
        "static_p99_ms": round(s.p99 * 1000, 1),
    }
    record("P8 throughput, continuous / static", c.throughput / s.throughput, config=config)
    record("P8 latency p50, continuous / static", c.p50 / s.p50, config=config)
    record("P8 latency p99, continuous / static", c.p99 / s.p99, config=config)
    print(f"P8 continuous batching ({config['model']}; {config['lora']})")
    print(f"  {config['workload']}; {setup.reps} alternating reps, medians")
    for mode, run in med.items():
        print(
            f"    {mode:<10} {run.throughput:8.1f} tokens/s   latency p50 {run.p50 * 1000:7.0f} ms   "
            f"p99 {run.p99 * 1000:7.0f} ms"
        )
    print(
        f"  continuous / static: throughput {c.throughput / s.throughput:.2f}, latency p50 {c.p50 / s.p50:.2f}, "
        f"p99 {c.p99 / s.p99:.2f}"
    )
    print(f"  total {time.perf_counter() - began:.0f} s")


if __name__ == "__main__":
    main()
