"""The sampler fleet: adapter-affinity routing (docs/fleet.md) against round robin, side by side in one run.

Each mode gets its own stack, started the same way: a registry (embedded Redis, folder store) and 3 sampler
processes with 40 slots each (the 96 adapters fit the fleet once, not on every replica), N published rank-16
adapters of the quick model, and the same requests: Zipf(1.1) adapter draws with a fixed seed, each prompt the
adapter's own 64-token prefix (its agent's system prompt) plus 8 fresh tokens, 8 greedy tokens out, 8 clients
at once, through `ServiceClient(registry=...)`. A third of the way from the end one replica is SIGKILLed. The
modes alternate request blocks so machine noise falls on both alike.

Figures: adapter loads (all replicas' adapter_loads_total; target affinity <= 0.3x round robin), prefix-cache
hit rate (prompt tokens found cached / all prompt tokens; target >= 2x), time to first token p99 (<= 0.7x), and
failed requests across the SIGKILL (0). Throughput growth with replicas needs more cores than this 2-core
machine: not measured here.

  .venv/bin/python bench/fleet.py [--quick]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import random
import tempfile
import threading
import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from results import record
from workload import QUICK_SPEC, linear_shapes, lora_weights, model_dir, peft_files, percentile, zipf_draws

from opentinker.cli.launch import ServerProcess, start_registry, start_sampler
from opentinker.client import OpenTinkerError, SamplingParams, ServiceClient
from opentinker.client.fleet_router import FleetRouter, candidates
from opentinker.client.fleet_types import Replica
from opentinker.v1 import sampler_pb2, sampler_pb2_grpc
from opentinker.weights.artifact_store import ArtifactStore

REPLICAS = 3
CLIENTS = 8
SLOTS = 40  # 3 x 40 slots hold the 96 adapters once (affinity), not three times over (round robin)
PREFIX, SUFFIX, OUT = 64, 8, 8


@dataclass(frozen=True, slots=True)
class Setup:
    adapters: int
    requests: int


FULL = Setup(adapters=96, requests=720)
QUICK = Setup(adapters=24, requests=180)


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
    before_kill: dict[str, sampler_pb2.GetStatsResponse] = field(default_factory=dict)

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
    flags = ("--max-slots", str(SLOTS), "--max-rank", "16", "--max-len", "256", "--heartbeat-s", "0.5")
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
        mode.ttft.append(first if first is not None else time.perf_counter() - began)
    except OpenTinkerError as error:
        mode.failed.append(f"{adapter}: {error}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="24 adapters and 180 requests per mode")
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
    kill_at = setup.requests * 2 // 3
    with tempfile.TemporaryDirectory(prefix="ot-bench-fleet-") as tmp:
        work = Path(tmp)
        modes = [
            start_mode(name, work / name.replace(" ", "-"), model, adapters, files)
            for name in ("affinity", "round robin")
        ]
        try:
            block = CLIENTS * 4
            for start in range(0, setup.requests, block):
                for mode in modes if (start // block) % 2 == 0 else reversed(modes):
                    if start <= kill_at < start + block:
                        mode.before_kill = mode.stats()
                        victim = mode.samplers[1]
                        threading.Timer(0.05, victim.process.kill).start()  # SIGKILL while this block runs
                    with concurrent.futures.ThreadPoolExecutor(CLIENTS) as pool:
                        list(pool.map(lambda item, m=mode: one_request(m, *item), work_items[start : start + block]))
            figures = {}
            for mode in modes:
                final = {**mode.before_kill, **mode.stats()}  # the victim's last figures, the others' at the end
                loads = sum(s.adapter_loads_total for s in final.values())
                cached = sum(s.prompt_tokens_cached for s in final.values())
                computed = sum(s.prompt_tokens_computed for s in final.values())
                figures[mode.name] = (loads, cached / max(cached + computed, 1), percentile(mode.ttft, 99))
        finally:
            for mode in modes:
                mode.stop()
    affinity, rr = figures["affinity"], figures["round robin"]
    config: dict[str, str | int | float] = {
        "model": "quick qwen2 (hidden 256, 2 layers)",
        "replicas": REPLICAS,
        "slots": SLOTS,
        "adapters": setup.adapters,
        "requests": setup.requests,
        "clients": CLIENTS,
        "traffic": "Zipf(1.1), seed 5",
    }
    record(
        "F1 adapter loads affinity / round robin",
        affinity[0] / max(rr[0], 1),
        target=0.3,
        comparison="<=",
        config=config,
    )
    record(
        "F2 prefix-cache hit rate affinity / round robin",
        affinity[1] / max(rr[1], 1e-9),
        target=2.0,
        comparison=">=",
        config=config,
    )
    record("F3 TTFT p99 affinity / round robin", affinity[2] / rr[2], target=0.7, comparison="<=", config=config)
    failed = sum(len(m.failed) for m in modes)
    record("F4 failed requests across a SIGKILL", failed, target=0, comparison="<=", config=config)
    print(
        f"Fleet ({config['model']}; {REPLICAS} replicas x {SLOTS} slots, {setup.adapters} adapters, "
        f"{setup.requests} requests, Zipf(1.1), {CLIENTS} clients, one replica SIGKILLed at request {kill_at})"
    )
    for name, (loads, hit, p99) in figures.items():
        print(f"  {name:12s}: adapter loads {loads}, prefix-cache hit rate {hit:.3f}, TTFT p99 {p99 * 1000:.1f} ms")
    print(
        f"  affinity / round robin: loads {affinity[0] / max(rr[0], 1):.2f}x (target <= 0.3), "
        f"hit rate {affinity[1] / max(rr[1], 1e-9):.2f}x (>= 2), TTFT p99 {affinity[2] / rr[2]:.2f}x (<= 0.7)"
    )
    first_failures = "; ".join(m.failed[0] for m in modes if m.failed)
    print(f"  failed requests: {failed} (target 0)" + (f": {first_failures}" if failed else ""))
    print(f"  total {time.perf_counter() - began:.0f} s")


if __name__ == "__main__":
    main()
