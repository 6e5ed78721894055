"""O1-O4 artifacts in an object store (S3 on a local moto server) against a local folder, side by side in one run.

Two stacks run at once, each a registry (embedded Redis) and a sampler with --follow, one on a folder store and
one on s3://; rounds alternate between them so machine noise falls on both alike.

O1 reload      publish -> served over N reloads of a rank-16 adapter of the quick model: the artifact is put into
               the store first (committed to the folder, or pushed to the bucket, as a trainer does), the version
               published, and the sampler's own reload record says how long from the registry's publish to serving
               (GetStats.recent_reloads: it includes the sampler's pull from the bucket). Targets: bucket p50 <=
               1.5x the folder's, and <= 100 ms. Also shown: put + publish -> served (the trainer's push included).
O2 cold start  a fresh sampler process (empty cache) loading K published adapters with concurrent LoadAdapter
               calls, from the bucket against from the folder (seconds, and the ratio).
O3 download    a 256 MiB artifact pulled (ranged parallel reads, sha256 verified, written to the local cache)
               against a raw GET of the same object with the same library (obstore): throughput ratio >= 0.8.
O4 registry    artifact bytes the bucket registry received or sent during the run
               (opentinker_registry_artifact_bytes_total): 0.

  .venv/bin/python bench/object_store.py [--quick]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import functools
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
import obstore
from results import record
from workload import QUICK_SPEC, linear_shapes, lora_weights, model_dir, peft_files, percentile

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))  # the tests' object-store servers
from metricsutil import metric, scrape
from storeservers import StoreServer, start_moto

from opentinker.cli.launch import ServerProcess, start_registry, start_sampler
from opentinker.client import RegistryClient
from opentinker.v1 import sampler_pb2, sampler_pb2_grpc
from opentinker.weights.artifact_remote import object_key, pull, push
from opentinker.weights.artifact_store import ArtifactStore
from opentinker.weights.object_store import ObjectStore, parse_store_url


@dataclass(frozen=True, slots=True)
class Setup:
    reloads: int
    cold_adapters: int
    download_mib: int


FULL = Setup(reloads=40, cold_adapters=64, download_mib=256)
QUICK = Setup(reloads=10, cold_adapters=16, download_mib=64)
SAMPLER_FLAGS = ["--follow", "o-*", "--max-slots", "80", "--max-rank", "16", "--max-len", "256"]


@dataclass
class Side:
    """One stack: its store (a folder, or the bucket), its registry and sampler."""

    name: str  # "folder" or "bucket"
    registry: ServerProcess
    sampler: ServerProcess
    client: RegistryClient
    folder: ArtifactStore | None  # the folder store (folder side)
    bucket: ObjectStore | None  # the bucket (bucket side)
    staging: ArtifactStore  # where the bucket side's artifacts are built before the push

    def put(self, files: dict[str, bytes]) -> tuple[str, str, int]:
        """Into the store as a trainer puts a snapshot there: (uri, sha256, size)."""
        if self.folder is not None:
            ref = self.folder.commit_files(files)
        else:
            assert self.bucket is not None
            ref = self.staging.commit_files(files)
            push(self.staging, self.bucket, ref.uri)
        return ref.uri, ref.sha256, ref.size_bytes

    def stop(self) -> None:
        self.client.close()
        for process in (self.sampler, self.registry):
            process.terminate()


def start_side(name: str, work: Path, model: Path, store: str | None, env: dict[str, str]) -> Side:
    registry = start_registry(work / "registry", *(["--store", store] if store else []), env=env)
    cache = ["--store", store, "--cache-dir", str(work / "cache")] if store else []
    sampler = start_sampler(work / "sampler", model, registry, *SAMPLER_FLAGS, *cache, env=env)
    folder = None if store else ArtifactStore(work / "registry" / "artifacts")
    bucket = ObjectStore(parse_store_url(store)) if store else None
    return Side(name, registry, sampler, RegistryClient(registry.address), folder, bucket, ArtifactStore(work / "tmp"))


def reload_record(sampler: sampler_pb2_grpc.SamplerServiceStub, adapter: str, version: int) -> sampler_pb2.ReloadRecord:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        for r in sampler.GetStats(sampler_pb2.GetStatsRequest()).recent_reloads:
            if r.adapter == adapter and r.to_version == version:
                if not r.ok:
                    raise RuntimeError(f"reload of {adapter}@{version} failed: {r.error}")
                found: sampler_pb2.ReloadRecord = r
                return found
        time.sleep(0.002)
    raise TimeoutError(f"{adapter}@{version} not served within 60 s")


def reloads(
    sides: list[Side], files: list[dict[str, bytes]], adapter: str
) -> dict[str, tuple[list[float], list[float]]]:
    """Per side: (publish -> served, put + publish -> served) seconds, rounds alternating between the sides."""
    out: dict[str, tuple[list[float], list[float]]] = {s.name: ([], []) for s in sides}
    channels = {s.name: grpc.insecure_channel(s.sampler.address) for s in sides}
    try:
        for side in sides:
            side.client.create_adapter(adapter, rank=16, alpha=32)
        for index, artifact in enumerate(files):
            for side in sides if index % 2 == 0 else reversed(sides):
                stub = sampler_pb2_grpc.SamplerServiceStub(channels[side.name])
                began = time.time()
                uri, sha, size = side.put(artifact)
                number = side.client.publish_version(adapter, uri, sha, size_bytes=size).number
                served = reload_record(stub, adapter, number)
                out[side.name][0].append(served.latency_seconds)
                out[side.name][1].append(served.time.ToNanoseconds() / 1e9 - began)
    finally:
        for channel in channels.values():
            channel.close()
    return out


def cold_start(
    sides: list[Side], work: Path, model: Path, count: int, env: dict[str, str], shapes: dict[str, tuple[int, int]]
) -> dict[str, float]:
    """Seconds for a fresh sampler to load `count` published adapters, per side (one side at a time)."""
    names = [f"o-cold-{i}" for i in range(count)]
    for side in sides:
        for i, name in enumerate(names):
            side.client.create_adapter(name, rank=16, alpha=32)
            uri, sha, size = side.put(peft_files(lora_weights(shapes, seed=1000 + i)))
            side.client.publish_version(name, uri, sha, size_bytes=size)
    seconds: dict[str, float] = {}
    for side in sides:
        store = (
            []
            if side.bucket is None
            else ["--store", side.bucket.describe(), "--cache-dir", str(work / f"cold-{side.name}")]
        )
        flags = ["--max-slots", str(count + 8), "--max-rank", "16", "--max-len", "256", *store]
        fresh = start_sampler(work / f"cold-sampler-{side.name}", model, side.registry, *flags, env=env)
        try:
            with grpc.insecure_channel(fresh.address) as channel:
                stub = sampler_pb2_grpc.SamplerServiceStub(channel)
                requests = [sampler_pb2.LoadAdapterRequest(reference=f"{n}@1") for n in names]
                began = time.perf_counter()
                with concurrent.futures.ThreadPoolExecutor(8) as pool:
                    list(pool.map(functools.partial(stub.LoadAdapter, timeout=120), requests))
                seconds[side.name] = time.perf_counter() - began
        finally:
            fresh.terminate()
    return seconds


def download(bucket: ObjectStore, work: Path, mib: int) -> tuple[float, float]:
    """(pull MiB/s, raw GET MiB/s) of one artifact of `mib` MiB, best of 3 each, alternating."""
    staging = ArtifactStore(work / "big-src")
    ref = staging.commit_files({"adapter_model.safetensors": os.urandom(mib << 20)})
    push(staging, bucket, ref.uri)
    key = object_key(ref.sha256, "adapter_model.safetensors")
    raw_store = bucket._store  # the same obstore client: the baseline is the library itself
    pulls, raws = [], []
    for attempt in range(3):
        cache = ArtifactStore(work / f"big-dst-{attempt}")
        began = time.perf_counter()
        pull(bucket, cache, ref.uri)
        pulls.append(mib / (time.perf_counter() - began))
        began = time.perf_counter()
        size = len(bytes(obstore.get(raw_store, key).bytes()))
        raws.append(mib / (time.perf_counter() - began))
        assert size == mib << 20
    return max(pulls), max(raws)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer reloads and adapters, a 64 MiB download")
    args = parser.parse_args()
    setup = QUICK if args.quick else FULL
    began = time.perf_counter()
    model = model_dir(QUICK_SPEC)
    shapes = linear_shapes(QUICK_SPEC)
    with tempfile.TemporaryDirectory(prefix="ot-bench-store-") as tmp:
        work = Path(tmp)
        moto: StoreServer = start_moto(work)
        env = moto.env()
        os.environ.update(env)  # this process's own view of the bucket (pushes, the raw GET)
        sides: list[Side] = []
        try:
            sides.append(start_side("folder", work / "folder", model, None, env))
            sides.append(start_side("bucket", work / "bucket", model, moto.url("bench"), env))
            warm = [peft_files(lora_weights(shapes, seed=s)) for s in range(2)]
            reloads(sides, warm, "o-warm")  # first loads: allocations, connections, page cache
            files = [peft_files(lora_weights(shapes, seed=100 + i)) for i in range(setup.reloads)]
            latency = reloads(sides, files, "o-reload")
            cold = cold_start(sides, work, model, setup.cold_adapters, env, shapes)
            metrics = scrape(sides[1].registry.metrics_address)
            registry_bytes = sum(
                metric(metrics, "opentinker_registry_artifact_bytes_total", direction=d) for d in ("upload", "download")
            )
            pulled, raw = download(ObjectStore(parse_store_url(moto.url("bench-download"))), work, setup.download_mib)
        finally:
            for side in sides:
                side.stop()
            moto.stop()
    ms = {name: [x * 1000 for x in values[0]] for name, values in latency.items()}
    end_ms = {name: [x * 1000 for x in values[1]] for name, values in latency.items()}
    p50 = {name: percentile(v, 50) for name, v in ms.items()}
    p99 = {name: percentile(v, 99) for name, v in ms.items()}
    artifact_kib = sum(len(b) for b in files[0].values()) / 1024
    config: dict[str, str | int | float] = {
        "model": "quick qwen2 (hidden 256, 2 layers)",
        "lora": "rank 16, all linear modules",
        "artifact_kib": round(artifact_kib, 1),
        "store": "moto_server on loopback (S3 API, IAM enforced) vs a local folder",
        "reloads": setup.reloads,
    }
    record(
        "O1 bucket reload p50 / folder p50", p50["bucket"] / p50["folder"], target=1.5, comparison="<=", config=config
    )
    record("O1 bucket reload p50", p50["bucket"], target=100, comparison="<=", unit="ms", config=config)
    record(
        "O2 cold start bucket / folder",
        cold["bucket"] / cold["folder"],
        config={**config, "adapters": setup.cold_adapters},
    )
    record(
        "O3 pull / raw GET throughput",
        pulled / raw,
        target=0.8,
        comparison=">=",
        config={**config, "mib": setup.download_mib},
    )
    record(
        "O4 registry artifact bytes (bucket)", registry_bytes, target=0, comparison="<=", unit="bytes", config=config
    )
    print(f"Object store ({config['model']}; {config['lora']}; artifact {artifact_kib:.0f} KiB; {config['store']})")
    for name in ("folder", "bucket"):
        print(
            f"  O1 {name:6}: publish -> served p50 {p50[name]:.1f} ms, p99 {p99[name]:.1f} ms, mean "
            f"{statistics.mean(ms[name]):.1f} ms; put + publish -> served p50 {percentile(end_ms[name], 50):.1f} ms"
        )
    print(f"     bucket / folder p50 {p50['bucket'] / p50['folder']:.2f}x (target <= 1.5x, and <= 100 ms)")
    print(
        f"  O2 cold start, {setup.cold_adapters} adapters: folder {cold['folder']:.2f} s, "
        f"bucket {cold['bucket']:.2f} s ({cold['bucket'] / cold['folder']:.2f}x)"
    )
    print(
        f"  O3 {setup.download_mib} MiB: pull {pulled:.0f} MiB/s, raw GET {raw:.0f} MiB/s: "
        f"{pulled / raw:.2f} (target >= 0.8)"
    )
    print(f"  O4 artifact bytes through the bucket registry: {registry_bytes:.0f} (target 0)")
    print(f"  total {time.perf_counter() - began:.0f} s")


if __name__ == "__main__":
    main()
