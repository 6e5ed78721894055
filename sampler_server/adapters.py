"""From a reference to a resident slot: resolve in the registry, fetch and verify the artifact, check it
fits this base model, load it into the slot pool. A version that fails any step never enters a slot."""

from __future__ import annotations

import asyncio
import json
import math
from dataclasses import dataclass

import torch
from safetensors.torch import load_file

from opentinker.registry.artifacts import ArtifactStore
from opentinker.registry.names import BASE, parse_reference
from opentinker.registry.remote import Metadata, fetch_artifact, registry_call
from opentinker.rpc.auth import require_access
from opentinker.rpc.errors import FailedPrecondition
from opentinker.sampler_server.slot_pool import SlotPool, VersionKey
from opentinker.v1 import common_pb2, registry_pb2, registry_pb2_grpc

PEFT_PREFIX = "base_model.model."


@dataclass(frozen=True, slots=True)
class Resolved:
    key: VersionKey  # ("", 0) for the base model
    message: common_pb2.ResolvedVersion
    version: registry_pb2.Version | None


BASE_RESOLVED = Resolved(("", 0), common_pb2.ResolvedVersion(reference=BASE), None)


class AdapterLoader:
    def __init__(
        self,
        pool: SlotPool,
        store: ArtifactStore,
        registry: registry_pb2_grpc.RegistryServiceStub,
        *,
        metadata: Metadata,
        model_digest: str,
    ) -> None:
        self.pool = pool
        self.store = store
        self.registry = registry
        self.metadata = metadata
        self.model_digest = model_digest
        self._loading: dict[VersionKey, asyncio.Lock] = {}
        self.loads = 0
        self.load_failures = 0

    async def resolve(self, reference: str) -> Resolved:
        ref = parse_reference(reference)
        if ref.is_base:
            return BASE_RESOLVED
        require_access(ref.adapter)
        response = await registry_call(
            self.registry.Resolve(registry_pb2.ResolveRequest(reference=reference), metadata=self.metadata)
        )
        version: registry_pb2.Version = response.version
        return Resolved((version.adapter, version.version), response.resolved, version)

    async def acquire(self, resolved: Resolved, count: int = 1) -> int:
        """The slot of a resolved version, loaded on demand, with `count` references taken on it."""
        if resolved.version is None:
            return 0
        lock = self._loading.setdefault(resolved.key, asyncio.Lock())
        async with lock:
            index = self.pool.lookup(resolved.key)
            if index is None:
                index = await self._load(resolved.version)
            for _ in range(count):
                self.pool.acquire(index)
        return index

    async def _load(self, version: registry_pb2.Version) -> int:
        if version.artifact_deleted:
            raise FailedPrecondition(
                f"{version.adapter}@{version.version} was garbage-collected", reason="ARTIFACT_DELETED"
            )
        base_digest = version.lineage.base_model_digest
        if base_digest and base_digest != self.model_digest:
            raise FailedPrecondition(
                f"{version.adapter}@{version.version} was trained on another base model",
                reason="INCOMPATIBLE_ADAPTER",
            )
        try:
            await fetch_artifact(self.registry, self.store, version.artifact_uri, self.metadata)
            weights, rank, scaling = await asyncio.to_thread(self._read, version)
            key = (version.adapter, version.version)
            index = self.pool.reserve(key)
            try:
                await asyncio.to_thread(
                    self.pool.fill, index, weights, rank=rank, scaling=scaling, artifact_sha256=version.artifact_sha256
                )
            except BaseException:
                self.pool.abandon(index)
                raise
        except BaseException:
            self.load_failures += 1
            raise
        self.loads += 1
        return index

    def _read(self, version: registry_pb2.Version) -> tuple[dict[str, tuple[torch.Tensor, torch.Tensor]], int, float]:
        directory = self.store.path(version.artifact_uri)  # verifies every digest: DATA_LOSS on mismatch
        name = f"{version.adapter}@{version.version}"
        config = json.loads((directory / "adapter_config.json").read_text())
        rank = int(config["r"])
        alpha = float(config.get("lora_alpha", rank))
        scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
        if rank > self.pool.max_rank:
            raise FailedPrecondition(
                f"{name} has rank {rank}; this sampler serves ranks up to {self.pool.max_rank} (--max-rank)",
                reason="INCOMPATIBLE_ADAPTER",
            )
        tensors = load_file(str(directory / "adapter_model.safetensors"))
        weights: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        for key, tensor in tensors.items():
            if not key.endswith(".lora_A.weight"):
                continue
            module = key.removeprefix(PEFT_PREFIX).removesuffix(".lora_A.weight")
            if module not in self.pool.a:
                raise FailedPrecondition(
                    f"{name} targets {module!r}, which this base model does not have", reason="INCOMPATIBLE_ADAPTER"
                )
            b = tensors[key.replace(".lora_A.", ".lora_B.")]
            weights[module] = (tensor.float(), b.float())
        if not weights:
            # An adapter that changes nothing must not silently serve the base model.
            raise FailedPrecondition(f"{name} targets no module of this base model", reason="INCOMPATIBLE_ADAPTER")
        return weights, rank, scaling
