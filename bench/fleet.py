"""The sampler fleet: adapter-affinity routing (docs/fleet.md) against round robin, side by side in one run.

Each mode gets its own stack, started the same way: a registry (embedded Redis, folder store) and 3 sampler
processes, each with 40 adapter slots and a KV pool of 192 blocks (the fleet holds the 96 adapters and their
prefixes about once, not on every replica: a fleet is sized for its working set, not three times it), N published
rank-16 adapters of the quick model, and the same requests: Zipf(1.1) adapter draws with a fixed seed, each
prompt the adapter's own 128-token prefix (its agent's system prompt) plus 8 fresh tokens, 8 greedy tokens out,
12 clients at once, through `ServiceClient(registry=...)`. The first quarter of the requests warms both fleets
and is not counted (a fleet runs for hours: its cold loads are a constant, its churn is the cost). A third of
the way from the end one replica is SIGKILLed. The modes alternate request blocks so machine noise falls on
both alike.

Figures, over the counted requests: adapter loads (all replicas' adapter_loads_total; target affinity <= 0.3x
round robin), prefix-cache hit rate (prompt tokens found cached / all prompt tokens; target >= 2x) with the
ceiling an ideal router could reach on the same draws (an LRU cache of the pool's prefixes per replica, every
adapter on exactly one replica), prompt tokens computed (the prefill the misses cost), time to first token p99
(<= 0.7x), and failed requests across the SIGKILL (0). Throughput growth with replicas needs more cores than
this 2-core machine: docs/fleet.md gives the model.

  .venv/bin/python bench/fleet.py [--quick]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import math
import random
import tempfile
import threading
import time
from collections import OrderedDict
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from results import record
from workload import QUICK_SPEC, linear_shapes, lora_weights, model_dir, peft_files, percentile, zipf_draws

from opentinker.cli.launch import ServerProcess, start_registry, start_sampler
from opentinker.client import OpenTinkerError, SamplingParams, ServiceClient
from opentinker.client.fleet_router import FleetRouter, candidates, score
from opentinker.client.fleet_types import Replica
from opentinker.v1 import sampler_pb2, sampler_pb2_grpc
from opentinker.weights.artifact_store import ArtifactStore

REPLICAS = 3
CLIENTS = 12
SLOTS = 64  # 3 x 64 slots: the 96 adapters and those the load bound spills (about half) once, not 3 x 96
PREFIX, SUFFIX, OUT = 128, 8, 8
MAX_LEN = 160
BLOCK = 16  # tokens per KV block (sampler_server/block_manager.py)
KV_BLOCKS = 192  # about 16 cached prefixes of 8 blocks beside the running sequences' blocks


@dataclass(frozen=True, slots=True)
class Setup:
    adapters: int
    requests: int


FULL = Setup(adapters=96, requests=4800)
QUICK = Setup(adapters=24, requests=240)


class RoundRobin(FleetRouter):
    """The baseline: every request to the next serving replica in turn, whatever its adapter."""

    def __init__(self) -> None:
        super().__init__()
        self._turn = 0
        self._turn_lock = threading.Lock()

    def route(
        self, adapter: str | None, replicas: Sequence[Replica], base_fingerprint: str = "", skip: Collection[str] = ()
    ) -> list[Replica]:
        pool = sorted(
            (r for r in candidates(replicas, base_fingerprint) if r.address not in skip), key=lambda r: r.address
        )
        with self._turn_lock:
            self._turn += 1
            turn = self._turn
        return pool[turn % len(pool) :] + pool[: turn % len(pool)] if pool else []


@dataclass
class Mode:
    name: str
    registry: ServerProcess
    samplers: list[ServerProcess]
    client: ServiceClient
    ttft: list[float] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)
    warm: dict[str, sampler_pb2.GetStatsResponse] = field(default_factory=dict)
    before_kill: dict[str, sampler_pb2.GetStatsResponse] = field(default_factory=dict)
    counting: bool = False  # True in the steady window only (after the warm-up, before the SIGKILL)
    after_kill: dict[str, sampler_pb2.GetStatsResponse] = field(default_factory=dict)
    served: dict[str, set[str]] = field(default_factory=dict)  # adapter -> the replicas that served it (counted)

    def stats(self) -> dict[str, sampler_pb2.GetStatsResponse]:
        out = {}
        for sampler in self.samplers:
            if sampler.process.poll() is not None:
                continue
            with grpc.insecure_channel(sampler.address) as channel:
                stub = sampler_pb2_grpc.SamplerServiceStub(channel)
                out[sampler.address] = stub.GetStats(sampler_pb2.GetStatsRequest(), timeout=30)
        return out

    def stop(self) -> None:
        self.client.close()
        for sampler in self.samplers:
            sampler.kill()
        self.registry.terminate()


def start_mode(name: str, work: Path, model: Path, adapters: list[str], files: list[dict[str, bytes]]) -> Mode:
    registry = start_registry(work / "registry")
    flags = ["--max-slots", str(SLOTS), "--max-rank", "16", "--max-len", str(MAX_LEN), "--num-blocks", str(KV_BLOCKS)]
    flags += ["--heartbeat-s", "0.5"]
    samplers = [start_sampler(work / f"sampler-{i}", model, registry, *flags) for i in range(REPLICAS)]
    router = RoundRobin() if name == "round robin" else FleetRouter()
    client = ServiceClient(registry=registry.address, fleet_router=router)
    store = ArtifactStore(work / "registry" / "artifacts")  # the folder store the samplers share
    registry_client = client.registry_client()
    for adapter, artifact in zip(adapters, files, strict=True):
        registry_client.create_adapter(adapter, rank=16, alpha=32)
        ref = store.commit_files(artifact)
        registry_client.publish_version(adapter, ref.uri, ref.sha256, size_bytes=ref.size_bytes)
    deadline = time.monotonic() + 60
    while len(registry_client.list_replicas("sampler")) < REPLICAS:
        if time.monotonic() > deadline:
            raise RuntimeError(f"{name}: the samplers did not all register")
        time.sleep(0.1)
    return Mode(name, registry, samplers, client)


def one_request(mode: Mode, adapter: str, prompt: list[int]) -> None:
    sampling = mode.client.create_sampling_client(f"{adapter}@1")
    began = time.perf_counter()
    first = None
    try:
        for chunk in sampling.stream(prompt, SamplingParams(max_tokens=OUT, temperature=0.0)):
            if first is None and chunk.tokens:
                first = time.perf_counter() - began
            if mode.counting and chunk.replica:
                mode.served.setdefault(adapter, set()).add(chunk.replica)
        if mode.counting:
            mode.ttft.append(first if first is not None else time.perf_counter() - began)
    except OpenTinkerError as error:
        mode.failed.append(f"{adapter}: {error}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="24 adapters and 240 requests per mode")
    args = parser.parse_args()
    setup = QUICK if args.quick else FULL
    began = time.perf_counter()
    model = model_dir(QUICK_SPEC)
    shapes = linear_shapes(QUICK_SPEC)
    rng = random.Random(11)
    adapters = [f"fleet/agent-{i:03d}" for i in range(setup.adapters)]
    files = [peft_files(lora_weights(shapes, seed=3000 + i)) for i in range(setup.adapters)]
    prefixes = {a: [rng.randrange(3, QUICK_SPEC.vocab_size) for _ in range(PREFIX)] for a in adapters}
    draws = zipf_draws(setup.adapters, setup.requests, s=1.1, seed=5)
    work_items = [
        (adapters[d], prefixes[adapters[d]] + [rng.randrange(3, QUICK_SPEC.vocab_size) for _ in range(SUFFIX)])
        for d in draws
    ]
    block = CLIENTS * 4
    warm_end = max(block, setup.requests // 3 // block * block)
    kill_at = setup.requests * 3 // 4
    steady_end = kill_at // block * block  # the block the SIGKILL falls in and the rest are the failover window
    with tempfile.TemporaryDirectory(prefix="ot-bench-fleet-") as tmp:
        work = Path(tmp)
        modes = [
            start_mode(name, work / name.replace(" ", "-"), model, adapters, files)
            for name in ("affinity", "round robin")
        ]
        try:
            for start in range(0, setup.requests, block):
                for mode in modes if (start // block) % 2 == 0 else reversed(modes):
                    if start == warm_end:
                        mode.warm, mode.counting = mode.stats(), True
                    if start <= kill_at < start + block:
                        mode.before_kill, mode.counting = mode.stats(), False
                        victim = mode.samplers[1]
                        threading.Timer(0.05, victim.process.kill).start()  # SIGKILL while this block runs
                    with concurrent.futures.ThreadPoolExecutor(CLIENTS) as pool:
                        list(pool.map(lambda item, m=mode: one_request(m, *item), work_items[start : start + block]))
            for mode in modes:
                mode.after_kill = mode.stats()
            figures = {mode.name: counted(mode) for mode in modes}
        finally:
            for mode in modes:
                mode.stop()
    running_blocks = math.ceil(CLIENTS / REPLICAS) * math.ceil(MAX_LEN / BLOCK)  # a replica's sequences at most
    capacity = (KV_BLOCKS - running_blocks) // (PREFIX // BLOCK)  # prefixes a replica's pool keeps cached
    ceiling = ideal_hit_rates(draws[:steady_end], warm_end, capacity)
    report(setup, figures, ceiling, capacity, (warm_end, steady_end), kill_at, sum(len(m.failed) for m in modes))
    for mode in modes:
        moved = sum(s.adapter_loads_total - mode.before_kill[a].adapter_loads_total for a, s in mode.after_kill.items())
        print(f"  {mode.name}: {moved} adapter loads on the survivors after the SIGKILL")
    for mode in modes:
        print_spread(mode)
    first_failures = "; ".join(m.failed[0] for m in modes if m.failed)
    if first_failures:
        print(f"  first failures: {first_failures}")
    print(f"  total {time.perf_counter() - began:.0f} s")


@dataclass(frozen=True, slots=True)
class Figures:
    loads: int
    hit_rate: float
    computed: int  # prompt tokens prefilled
    ttft_p99: float


def counted(mode: Mode) -> Figures:
    """The steady window's figures: each replica's figures just before the SIGKILL less its figures when the
    warm-up ended."""

    def total(field_name: str) -> int:
        return sum(getattr(s, field_name) - getattr(mode.warm[a], field_name) for a, s in mode.before_kill.items())

    cached, computed = total("prompt_tokens_cached"), total("prompt_tokens_computed")
    return Figures(
        total("adapter_loads_total"), cached / max(cached + computed, 1), computed, percentile(mode.ttft, 99)
    )


def ideal_hit_rates(draws: list[int], warm_end: int, capacity: int) -> tuple[float, float]:
    """The prefix-cache hit rates (cached prompt tokens / prompt tokens) of an ideal affinity router (every
    adapter on one replica, by rendezvous) and of round robin, each replica an LRU cache of `capacity` prefixes,
    over the same draws: what routing alone can reach on this traffic, whatever the engine."""
    home = [max(range(REPLICAS), key=lambda r: score(f"a{a}", f"replica-{r}")) for a in range(max(draws) + 1)]
    rates = []
    for by_adapter in (True, False):
        caches: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(REPLICAS)]
        hits = 0
        for i, adapter in enumerate(draws):
            cache = caches[home[adapter] if by_adapter else i % REPLICAS]
            hit = adapter in cache
            cache[adapter] = None
            cache.move_to_end(adapter)
            if len(cache) > capacity:
                cache.popitem(last=False)
            hits += hit and i >= warm_end
        rates.append(hits * PREFIX / ((len(draws) - warm_end) * (PREFIX + SUFFIX)))
    return rates[0], rates[1]


def report(
    setup: Setup,
    figures: dict[str, Figures],
    ceiling: tuple[float, float],
    capacity: int,
    window: tuple[int, int],
    kill_at: int,
    failed: int,
) -> None:
    affinity, rr = figures["affinity"], figures["round robin"]
    config: dict[str, str | int | float] = {
        "model": "quick qwen2 (hidden 256, 2 layers)",
        "replicas": REPLICAS,
        "slots": SLOTS,
        "kv_blocks": KV_BLOCKS,
        "adapters": setup.adapters,
        "requests": setup.requests,
        "counted": f"requests {window[0]}-{window[1] - 1}",
        "clients": CLIENTS,
        "traffic": "Zipf(1.1), seed 5",
    }
    loads = affinity.loads / max(rr.loads, 1)
    hits = affinity.hit_rate / max(rr.hit_rate, 1e-9)
    ideal = ceiling[0] / max(ceiling[1], 1e-9)
    prefill = affinity.computed / max(rr.computed, 1)
    p99 = affinity.ttft_p99 / rr.ttft_p99
    record("F1 adapter loads affinity / round robin", loads, target=0.3, comparison="<=", config=config)
    record("F2 prefix-cache hit rate affinity / round robin", hits, target=2.0, comparison=">=", config=config)
    record("F2b ideal router's hit-rate ratio on the same draws", ideal, config=config)
    record("F2c prompt tokens prefilled affinity / round robin", prefill, comparison="<=", config=config)
    record("F3 TTFT p99 affinity / round robin", p99, target=0.7, comparison="<=", config=config)
    record("F4 failed requests across a SIGKILL", failed, target=0, comparison="<=", config=config)
    print(
        f"Fleet ({config['model']}; {REPLICAS} replicas x {SLOTS} slots x {KV_BLOCKS} KV blocks, "
        f"{setup.adapters} adapters, {setup.requests} requests, Zipf(1.1), {CLIENTS} clients; figures over requests "
        f"{window[0]}-{window[1] - 1} (after the warm-up, before one replica is SIGKILLed at request {kill_at})"
    )
    for name, f in figures.items():
        print(
            f"  {name:12s}: adapter loads {f.loads}, prefix-cache hit rate {f.hit_rate:.3f}, prompt tokens "
            f"prefilled {f.computed}, TTFT p99 {f.ttft_p99 * 1000:.1f} ms"
        )
    print(
        f"  affinity / round robin: loads {loads:.2f}x (target <= 0.3), hit rate {hits:.2f}x (>= 2; an ideal "
        f"router on these draws with {capacity} prefixes cached per replica: {ceiling[0]:.3f} / {ceiling[1]:.3f} "
        f"= {ideal:.2f}x), prompt tokens prefilled {prefill:.2f}x, TTFT p99 {p99:.2f}x (<= 0.7)"
    )
    print(f"  failed requests: {failed} (target 0)")


def print_spread(mode: Mode) -> None:
    spread = [len(replicas) for replicas in mode.served.values()]
    print(
        f"  {mode.name}: of {len(spread)} adapters served, "
        + ", ".join(f"{sum(n == k for n in spread)} on {k} replica(s)" for k in range(1, REPLICAS + 1))
    )


if __name__ == "__main__":
    main()
