"""P4 hot reload, with real processes: a registry (embedded Redis) and a sampler with --follow.

latency   publish ack -> the sampler serving the new version, over N reloads of a rank-16 adapter on all
          linear layers (p50 target <= 50 ms, p99 <= 250 ms). The artifact is committed to the shared store
          first (as a trainer does); the clock starts when PublishVersion returns and stops at the time the
          sampler's reload record says the alias flipped (GetStats.recent_reloads; same host clock), so the
          polling interval does not add to it. After each reload a 1-token Sample of the alias must name
          the new version.
traffic   closed-loop Sample streams on the reloaded alias; windows of W seconds alternate between quiet and
          "a publish every second" (order rotated each pair). tokens/s with reloads / without (target >= 0.90)
          and failed requests during the run (target 0).

  .venv/bin/python bench/hot_reload.py [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from results import record
from stack import Stack, aio_stub, closed_loop, publish, sample_request, start_stack, tokens_between
from workload import FULL_SPEC, QUICK_SPEC, linear_shapes, lora_weights, model_dir, peft_files, percentile, prompts
from workload import spec_config as model_config

from opentinker.v1 import sampler_pb2, sampler_pb2_grpc

ADAPTER = "p4-hot"


@dataclass(frozen=True, slots=True)
class Setup:
    reloads: int  # latency samples
    pairs: int  # (quiet, reloading) window pairs
    window_s: float
    concurrency: int  # closed-loop client streams
    max_tokens: int


FULL = Setup(reloads=50, pairs=4, window_s=5.0, concurrency=8, max_tokens=32)
QUICK = Setup(reloads=10, pairs=2, window_s=1.5, concurrency=4, max_tokens=16)


def served_at(sampler: sampler_pb2_grpc.SamplerServiceStub, version: int, timeout: float = 30.0) -> float:
    """Wall-clock time at which the sampler flipped the alias to `version` (polls its reload records)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        stats = sampler.GetStats(sampler_pb2.GetStatsRequest())
        for r in stats.recent_reloads:
            if r.adapter == ADAPTER and r.to_version == version:
                if not r.ok:
                    raise RuntimeError(f"reload of version {version} failed: {r.error}")
                return float(r.time.ToNanoseconds()) / 1e9
        time.sleep(0.002)
    raise TimeoutError(f"version {version} not served after {timeout} s")


def measure_latency(stack: Stack, files: list[dict[str, bytes]], prompt: list[int]) -> list[float]:
    """Publish -> served seconds per reload; each artifact already in the store before its publish."""
    import grpc

    refs = [stack.store.commit_files(f) for f in files]
    latencies: list[float] = []
    with grpc.insecure_channel(stack.samplers["sampler"].address) as channel:
        sampler = sampler_pb2_grpc.SamplerServiceStub(channel)
        for ref in refs:
            version = stack.client.publish_version(ADAPTER, ref.uri, ref.sha256, size_bytes=ref.size_bytes).number
            acked = time.time()
            latencies.append(served_at(sampler, version) - acked)
            message = next(iter(sampler.Sample(sample_request(ADAPTER, prompt, 1), timeout=60)))
            if message.version.version != version:
                raise RuntimeError(f"sampled {message.version.version} after version {version} was served")
    return latencies


async def traffic(stack: Stack, setup: Setup, files: list[dict[str, bytes]], vocab: int) -> dict[str, float]:
    """Quiet and reloading windows alternating under closed-loop load -> tokens/s of each, failures."""
    refs = [stack.store.commit_files(f) for f in files]  # written before the clock runs, as in measure_latency
    channel, stub = aio_stub(stack.samplers["sampler"].address)
    pool = prompts(64, vocab, seed=7)
    stop = asyncio.Event()
    make = lambda i: sample_request(ADAPTER, pool[i % len(pool)], setup.max_tokens)  # noqa: E731
    load = asyncio.create_task(closed_loop(stub, make, setup.concurrency, stop))
    await asyncio.sleep(setup.window_s)  # warm-up: every client streaming
    windows: list[tuple[str, float, float]] = []
    published = 0
    for pair in range(setup.pairs):
        for kind in ("quiet", "reload") if pair % 2 == 0 else ("reload", "quiet"):
            start = due = time.monotonic()
            while (now := time.monotonic()) < start + setup.window_s:
                if kind == "reload" and now >= due:  # one publish per second of the window
                    ref = refs[published % len(refs)]
                    await asyncio.to_thread(
                        stack.client.publish_version, ADAPTER, ref.uri, ref.sha256, size_bytes=ref.size_bytes
                    )
                    published += 1
                    due += 1.0
                await asyncio.sleep(0.01)
            windows.append((kind, start, time.monotonic()))
    stop.set()
    streams = await load
    await channel.close()
    rates: dict[str, list[float]] = {"quiet": [], "reload": []}
    for kind, start, end in windows:
        rates[kind].append(tokens_between(streams, start, end) / (end - start))
    during = [s for s in streams if any(start <= s.end and s.start < end for _, start, end in windows)]
    latencies = {k: [s.end - s.start for s in during if _window_of(s.end, windows) == k] for k in rates}
    return {
        "quiet_tps": statistics.median(rates["quiet"]),
        "reload_tps": statistics.median(rates["reload"]),
        "failed": float(sum(1 for s in streams if s.error)),
        "requests": float(len(during)),
        "publishes": float(published),
        "quiet_p99_s": percentile(latencies["quiet"], 99),
        "reload_p99_s": percentile(latencies["reload"], 99),
    }


def _window_of(t: float, windows: list[tuple[str, float, float]]) -> str:
    return next((kind for kind, start, end in windows if start <= t < end), "")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small model, fewer reloads and shorter windows")
    args = parser.parse_args()
    setup, spec = (QUICK, QUICK_SPEC) if args.quick else (FULL, FULL_SPEC)
    began = time.perf_counter()
    model = model_dir(spec)
    shapes = linear_shapes(spec)
    with tempfile.TemporaryDirectory(prefix="ot-bench-p4-") as tmp:
        flags = ["--follow", "p4-*", "--max-slots", "8", "--max-rank", "16", "--max-len", "256"]
        stack = start_stack(Path(tmp), model, {"sampler": flags})
        try:
            stack.client.create_adapter(ADAPTER, rank=16, alpha=32)
            publish(stack, ADAPTER, peft_files(lora_weights(shapes, seed=0)))
            warm = [peft_files(lora_weights(shapes, seed=s)) for s in range(1, 3)]
            measure_latency(stack, warm, prompts(1, spec.vocab_size)[0])  # first loads: allocations, page cache
            files = [peft_files(lora_weights(shapes, seed=100 + i)) for i in range(setup.reloads)]
            latencies = measure_latency(stack, files, prompts(1, spec.vocab_size)[0])
            load = asyncio.run(traffic(stack, setup, files[:8], spec.vocab_size))
        finally:
            stack.stop()
    ms = [x * 1000 for x in latencies]
    p50, p99 = percentile(ms, 50), percentile(ms, 99)
    ratio = load["reload_tps"] / load["quiet_tps"]
    config = {
        **model_config(spec),
        "reloads": setup.reloads,
        "artifact_mib": round(sum(len(b) for b in files[0].values()) / 2**20, 2),
        "sampler": "1 torch thread, --follow p4-*, --max-slots 8, --max-rank 16",
        "traffic": f"{setup.concurrency} closed-loop streams x {setup.max_tokens} greedy tokens on the reloaded alias; "
        f"{setup.pairs} x ({setup.window_s:.0f} s quiet, {setup.window_s:.0f} s with a publish every second)",
    }
    record("P4 reload latency p50", p50, target=50, comparison="<=", unit="ms", config=config)
    record("P4 reload latency p99", p99, target=250, comparison="<=", unit="ms", config=config)
    record("P4 tokens/s with reloads / without", ratio, target=0.90, comparison=">=", config=config)
    record(
        "P4 failed requests during reloads",
        load["failed"],
        target=0,
        comparison="<=",
        unit="requests",
        config={**config, "requests": int(load["requests"])},
    )
    print(f"P4 hot reload ({config['model']}; {config['lora']}; artifact {config['artifact_mib']} MiB)")
    print(
        f"  publish ack -> served over {len(ms)} reloads: p50 {p50:.1f} ms, p99 {p99:.1f} ms, "
        f"mean {statistics.mean(ms):.1f} ms, max {max(ms):.1f} ms   (targets <= 50 / <= 250 ms)"
    )
    print(f"  traffic: {config['traffic']}")
    print(
        f"    quiet {load['quiet_tps']:.1f} tokens/s, with reloads {load['reload_tps']:.1f} tokens/s: ratio "
        f"{ratio:.3f} (target >= 0.90); {int(load['publishes'])} publishes"
    )
    print(
        f"    requests {int(load['requests'])}, failed {int(load['failed'])}; request p99 quiet "
        f"{load['quiet_p99_s'] * 1000:.0f} ms, with reloads {load['reload_p99_s'] * 1000:.0f} ms"
    )
    print(f"  total {time.perf_counter() - began:.0f} s")


if __name__ == "__main__":
    main()
