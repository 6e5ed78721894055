"""P7 scale: more registered adapters than slots. Real processes: a registry and two samplers with the same
flags (--max-slots S, --max-rank 16):

  resident  S adapters, all loaded up front; Zipf(1.1) traffic over those S
  paged     K > S adapters registered (loaded on demand, LRU eviction); Zipf(1.1) traffic over all K

Closed-loop Sample streams; windows of W seconds alternate between the two samplers (order rotated each pair).
tokens/s paged / resident (target >= 0.80). Memory: PSS of the resident sampler's processes (server + engine,
so their shared slots count once; S slots full) minus that of a third sampler with --max-slots 1 (one adapter
loaded), per extra slot, over an adapter's raw float32 parameter bytes (target <= 1.1). Both measured after
serving the same requests, the third all on its one adapter (the same batch shapes: oneDNN keeps buffers per
matmul shape, which are no adapter's memory).

    .venv/bin/python bench/scale.py [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import grpc
from results import record
from stack import Stack, aio_stub, closed_loop, publish, sample_request, start_stack, stream, tokens_between
from workload import (
    FULL_SPEC,
    QUICK_SPEC,
    linear_shapes,
    lora_weights,
    model_dir,
    peft_files,
    prompts,
    raw_bytes,
    spec_config,
    zipf_draws,
    zipf_mass,
)

from opentinker.cli.launch import tree_memory
from opentinker.v1 import sampler_pb2, sampler_pb2_grpc

ZIPF_S = 1.1


@dataclass(frozen=True, slots=True)
class Setup:
    adapters: int  # registered for the paged sampler
    slots: int  # --max-slots of both samplers; the resident case uses this many adapters
    concurrency: int
    max_tokens: int
    pairs: int
    window_s: float


FULL = Setup(adapters=256, slots=64, concurrency=32, max_tokens=32, pairs=3, window_s=8.0)
QUICK = Setup(adapters=48, slots=12, concurrency=8, max_tokens=16, pairs=2, window_s=1.5)


def register(stack: Stack, count: int, shapes: dict[str, tuple[int, int]]) -> list[str]:
    names = [f"p7-{i:03d}" for i in range(count)]
    for i, name in enumerate(names):
        stack.client.create_adapter(name, rank=16, alpha=32)
        publish(stack, name, peft_files(lora_weights(shapes, seed=1000 + i)))
    return names


def sampler_memory(stack: Stack, sampler: str) -> int:
    """The sampler's memory: PSS of its server and engine processes (their shared adapter slots count once)."""
    return tree_memory(stack.samplers[sampler].process.pid)


def serve(address: str, requests: list[sampler_pb2.SampleRequest]) -> None:
    """Runs requests through a sampler, 8 at a time (warm-up, loads)."""

    async def run() -> None:
        channel, stub = aio_stub(address)
        for i in range(0, len(requests), 8):
            done = await asyncio.gather(*(stream(stub, r) for r in requests[i : i + 8]))
            if any(s.error for s in done):
                raise RuntimeError(next(s.error for s in done if s.error))
        await channel.close()

    asyncio.run(run())


def stats(address: str) -> sampler_pb2.GetStatsResponse:
    with grpc.insecure_channel(address) as channel:
        response: sampler_pb2.GetStatsResponse = sampler_pb2_grpc.SamplerServiceStub(channel).GetStats(
            sampler_pb2.GetStatsRequest()
        )
        return response


@dataclass
class Windows:
    rates: dict[str, list[float]]  # tokens/s of each window, per sampler
    requests: dict[str, int]
    failed: dict[str, int]
    loads: dict[str, int]  # adapter versions loaded during the windows


async def windows(stack: Stack, setup: Setup, make: dict[str, Callable[[int], sampler_pb2.SampleRequest]]) -> Windows:
    """Closed-loop load on one sampler at a time; the windows alternate between them."""
    names = list(make)
    result = Windows({n: [] for n in names}, dict.fromkeys(names, 0), dict.fromkeys(names, 0), dict.fromkeys(names, 0))
    for pair in range(setup.pairs):
        for name in names if pair % 2 == 0 else names[::-1]:
            address = stack.samplers[name].address
            loads_before = stats(address).adapter_loads_total
            channel, stub = aio_stub(address)
            stop = asyncio.Event()
            start = time.monotonic()
            load = asyncio.create_task(closed_loop(stub, make[name], setup.concurrency, stop))
            await asyncio.sleep(setup.window_s)
            end = time.monotonic()
            stop.set()
            streams = await load  # requests in flight finish after the window; their later tokens do not count
            await channel.close()
            result.rates[name].append(tokens_between(streams, start, end) / (end - start))
            result.requests[name] += len(streams)
            result.failed[name] += sum(1 for s in streams if s.error)
            result.loads[name] += stats(address).adapter_loads_total - loads_before
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small model, fewer adapters and shorter windows")
    args = parser.parse_args()
    setup, spec = (QUICK, QUICK_SPEC) if args.quick else (FULL, FULL_SPEC)
    began = time.perf_counter()
    model = model_dir(spec)
    shapes = linear_shapes(spec)
    # One tenant owns every adapter here: --max-seqs-per-tenant 0 lets it use the whole batch, as before.
    common = [
        "--max-rank",
        "16",
        "--max-len",
        "128",
        "--max-seqs",
        str(setup.concurrency),
        "--max-seqs-per-tenant",
        "0",
    ]
    samplers = {
        "resident": ["--max-slots", str(setup.slots), *common],
        "paged": ["--max-slots", str(setup.slots), *common],
        "one-slot": ["--max-slots", "1", *common],
    }
    pool = prompts(64, spec.vocab_size, seed=11)
    draws = {
        "resident": zipf_draws(setup.slots, 1 << 16, s=ZIPF_S),
        "paged": zipf_draws(setup.adapters, 1 << 16, s=ZIPF_S),
    }
    with tempfile.TemporaryDirectory(prefix="ot-bench-p7-") as tmp:
        stack = start_stack(Path(tmp), model, samplers)
        try:
            names = register(stack, setup.adapters, shapes)

            def maker(sampler: str, max_tokens: int) -> Callable[[int], sampler_pb2.SampleRequest]:
                d = draws[sampler]
                return lambda i: sample_request(names[d[i % len(d)]], pool[i % len(pool)], max_tokens)

            make = {"resident": maker("resident", setup.max_tokens), "paged": maker("paged", setup.max_tokens)}

            def memory_traffic(adapter: Callable[[int], str]) -> list[sampler_pb2.SampleRequest]:
                """A request for each slot's adapter, then 16 of the windows' kind (prompts from the pool)."""
                loads = [sample_request(adapter(i), pool[0], 2) for i in range(setup.slots)]
                return loads + [sample_request(adapter(i), pool[i % len(pool)], setup.max_tokens) for i in range(16)]

            # Resident: every one of its adapters loaded first. Paged: warmed by the traffic it will get.
            serve(stack.samplers["resident"].address, memory_traffic(lambda i: names[i % setup.slots]))
            warm = maker("paged", 2)
            serve(stack.samplers["paged"].address, [warm(len(draws["paged"]) - 1 - i) for i in range(2 * setup.slots)])
            # Memory: the one-slot sampler gets the same requests on its one adapter, so that both samplers have
            # met the same batch shapes (oneDNN keeps buffers per matmul shape) and differ in the adapters held.
            serve(stack.samplers["one-slot"].address, memory_traffic(lambda i: names[0]))
            mem_full, mem_one = sampler_memory(stack, "resident"), sampler_memory(stack, "one-slot")
            stack.samplers.pop("one-slot").terminate()  # nothing else runs during the windows
            result = asyncio.run(windows(stack, setup, make))
        finally:
            stack.stop()
    rates = result.rates
    tps = {name: statistics.median(values) for name, values in rates.items()}
    ratio = tps["paged"] / tps["resident"]
    per_slot = (mem_full - mem_one) / (setup.slots - 1)
    raw = raw_bytes(shapes)
    config = {
        **spec_config(spec),
        "adapters": setup.adapters,
        "slots": setup.slots,
        "traffic": f"Zipf({ZIPF_S}); {setup.concurrency} closed-loop streams x {setup.max_tokens} greedy tokens; "
        f"{setup.pairs} x {setup.window_s:.0f} s windows per sampler, alternating",
        "sampler": f"1 torch thread, --max-slots {setup.slots} --max-rank 16",
        "top_slots_traffic_share": round(zipf_mass(setup.adapters, setup.slots, ZIPF_S), 3),
        "paged_loads_per_request": round(result.loads["paged"] / max(result.requests["paged"], 1), 3),
        "failed_requests": sum(result.failed.values()),
    }
    record("P7 tokens/s, paged / all resident", ratio, target=0.80, comparison=">=", config=config)
    memory = {**config, "raw_adapter_bytes": raw, "pss_full_bytes": mem_full, "pss_one_slot_bytes": mem_one}
    record("P7 resident bytes per extra adapter / raw", per_slot / raw, target=1.1, comparison="<=", config=memory)
    print(f"P7 scale ({config['model']}; {config['lora']})")
    print(f"  {setup.adapters} registered over {setup.slots} slots vs {setup.slots} resident; {config['traffic']}")
    for name in ("resident", "paged"):
        values = ", ".join(f"{v:.0f}" for v in rates[name])
        print(
            f"    {name:<9} {tps[name]:8.1f} tokens/s (windows {values}); requests {result.requests[name]}, "
            f"failed {result.failed[name]}, adapter loads {result.loads[name]}"
        )
    print(
        f"  paged / resident {ratio:.3f} (target >= 0.80); the top {setup.slots} adapters get "
        f"{config['top_slots_traffic_share']:.0%} of the traffic"
    )
    print(
        f"  memory: PSS {mem_full / 2**20:.0f} MiB with {setup.slots} slots full, {mem_one / 2**20:.0f} MiB with 1: "
        f"{per_slot / 2**20:.2f} MiB per extra adapter = {per_slot / raw:.3f} x raw {raw / 2**20:.2f} MiB "
        "(target <= 1.1)"
    )
    print(f"  total {time.perf_counter() - began:.0f} s")


if __name__ == "__main__":
    main()
