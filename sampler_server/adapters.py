"""From a reference to a resident slot: resolve in the registry, fetch and verify the artifact, check it
fits this base model, load it into the slot pool. A version that fails any step never enters a slot."""

from __future__ import annotations

import asyncio
import collections
from dataclasses import dataclass
from typing import Protocol

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from opentinker.rpc.auth import require_access
from opentinker.rpc.errors import FailedPrecondition
from opentinker.rpc.memory import release_freed_memory
from opentinker.rpc.registry_link import Metadata, fetch_artifact, registry_call
from opentinker.sampler_server.slot_pool import SlotPool, VersionKey
from opentinker.v1 import common_pb2, registry_pb2, registry_pb2_grpc
from opentinker.weights.artifact_store import ArtifactStore
from opentinker.weights.names import BASE, parse_reference
from opentinker.weights.peft import (
    CONFIG_FILE,
    WEIGHTS_FILE,
    LoraMagnitudeError,
    PeftFormatError,
    check_lora_magnitudes,
    lora_a_key,
    lora_b_key,
    lora_modules,
    read_peft_config,
)


class AliasFollowerLike(Protocol):
    def note_traffic(self, adapter: str) -> None: ...
    def served_version(self, adapter: str, alias: str) -> int | None: ...
    def serving_alias(self, adapter: str) -> str | None: ...
    def adopt(self, adapter: str, alias: str, version: int) -> None: ...


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
        self._versions: dict[VersionKey, registry_pb2.Version] = {}  # registry records of versions seen
        self.follower: AliasFollowerLike | None = None  # set when the sampler follows registry events
        self.loads = 0
        self.load_failures = 0
        self.loads_by_adapter: collections.Counter[str] = collections.Counter()  # a tenant's GetStats sums its own
        self.load_failures_by_adapter: collections.Counter[str] = collections.Counter()

    async def resolve(self, reference: str) -> Resolved:
        ref = parse_reference(reference)
        if ref.is_base:
            return BASE_RESOLVED
        require_access(ref.adapter)
        follower = self.follower
        # A bare name serves the adapter's serving alias; unknown here (None): the registry resolves it.
        alias = ref.alias if follower is None or not ref.bare else follower.serving_alias(ref.adapter)
        if follower is not None:
            follower.note_traffic(ref.adapter)
            if alias is not None:
                number = follower.served_version(ref.adapter, alias)
                cached = self._versions.get((ref.adapter, number)) if number is not None else None
                if cached is not None:  # the alias as this sampler serves it: no registry round trip
                    message = common_pb2.ResolvedVersion(
                        adapter=cached.adapter, version=cached.version, reference=reference,
                        artifact_sha256=cached.artifact_sha256,
                    )  # fmt: skip
                    return Resolved((cached.adapter, cached.version), message, cached)
        response = await registry_call(
            self.registry.Resolve(registry_pb2.ResolveRequest(reference=reference), metadata=self.metadata)
        )
        version: registry_pb2.Version = response.version
        self._versions[(version.adapter, version.version)] = version
        if follower is not None and alias is not None:
            follower.adopt(ref.adapter, alias, version.version)
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
                await asyncio.to_thread(release_freed_memory)  # the load's temporary buffers, freed by now
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

            def fill() -> None:
                try:
                    self.pool.fill(index, weights, rank=rank, scaling=scaling, artifact_sha256=version.artifact_sha256)
                except BaseException:
                    self.pool.abandon(index)
                    raise

            # Shielded: a cancelled request must not free the slot while the copy into it is still running (another
            # version could take the slot and be served this one's weights); the copy ends as a cached version.
            await asyncio.shield(asyncio.to_thread(fill))
        except BaseException:
            self.load_failures += 1
            self.load_failures_by_adapter[version.adapter] += 1
            raise
        self.loads += 1
        self.loads_by_adapter[version.adapter] += 1
        return index

    def _read(self, version: registry_pb2.Version) -> tuple[dict[str, tuple[torch.Tensor, torch.Tensor]], int, float]:
        directory = self.store.path(version.artifact_uri)  # verifies every digest: DATA_LOSS on mismatch
        name = f"{version.adapter}@{version.version}"

        def unusable(why: str) -> FailedPrecondition:
            return FailedPrecondition(f"{name} is not a LoRA adapter this sampler can serve: {why}",
                                      reason="INCOMPATIBLE_ADAPTER")  # fmt: skip

        try:
            config = read_peft_config(directory / CONFIG_FILE)
            tensors = load_file(str(directory / WEIGHTS_FILE))
            modules = lora_modules({key: list(t.shape) for key, t in tensors.items()}, config)
        except (OSError, SafetensorError, PeftFormatError) as error:
            # Digests verified, so these are the publisher's bytes: not a usable peft LoRA adapter.
            raise unusable(str(error)) from None
        rank = config.rank
        if rank > self.pool.max_rank:
            raise FailedPrecondition(
                f"{name} has rank {rank}; this sampler serves ranks up to {self.pool.max_rank} (--max-rank)",
                reason="INCOMPATIBLE_ADAPTER",
            )
        weights: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        for module, (d_in, d_out) in modules.items():
            if module not in self.pool.a:
                raise FailedPrecondition(
                    f"{name} targets {module!r}, which this base model does not have", reason="INCOMPATIBLE_ADAPTER"
                )
            want_in, want_out = self.pool.a[module].shape[2], self.pool.b[module].shape[1]
            if (d_in, d_out) != (want_in, want_out):
                raise unusable(f"{module} maps {d_in} -> {d_out} features, this base model {want_in} -> {want_out}")
            weights[module] = (tensors[lora_a_key(module)].float(), tensors[lora_b_key(module)].float())
        scaling = config.scaling
        try:  # the one rule of import, snapshot and load: non-finite or huge weights would poison shared batches
            check_lora_magnitudes(tensors, scaling)
        except LoraMagnitudeError as error:
            raise FailedPrecondition(f"{name} is refused: {error}", reason="ADAPTER_OUT_OF_RANGE") from None
        return weights, rank, scaling
