"""From a reference to a resident slot: resolve in the registry, fetch and verify the artifact, check it
fits this base model, load it into the slot pool. A version that fails any step never enters a slot.

What the loader keeps per version is bounded, however many versions pass through it: a load lock lives while
acquires of its version run, registry records while the version is served, resident or loading (and a few
hundred others), so a sampler that hot-reloads a new version every few seconds for months holds no more than
one that just started."""

from __future__ import annotations

import asyncio
import collections
from dataclasses import dataclass, field
from typing import Protocol

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from opentinker.rpc.process.memory import release_freed_memory
from opentinker.rpc.serving.auth import require_access
from opentinker.rpc.serving.errors import DataLoss, FailedPrecondition, ResourceExhausted
from opentinker.rpc.serving.registry_link import Metadata, registry_call
from opentinker.sampler_server.slot_pool import SlotPool, VersionKey
from opentinker.v1 import common_pb2, registry_pb2, registry_pb2_grpc
from opentinker.weights.artifact_bucket import Bucket
from opentinker.weights.artifact_store import ArtifactStore
from opentinker.weights.artifact_transfer import fetch_artifact
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
    def serving_aliases(self, adapter: str, version: int) -> list[str]: ...


@dataclass(frozen=True, slots=True)
class Resolved:
    key: VersionKey  # ("", 0) for the base model
    message: common_pb2.ResolvedVersion
    version: registry_pb2.Version | None


BASE_RESOLVED = Resolved(("", 0), common_pb2.ResolvedVersion(reference=BASE), None)
# Registry records kept before the loader forgets those no one needs (then: twice what it still needs, at least
# this): a few hundred small messages, so that a forgetting pass runs once per that many new versions.
VERSIONS_KEPT = 256


@dataclass(slots=True)
class _Load:
    """One version's load lock and the acquires of that version running now (waiting for the lock or holding it):
    concurrent acquires share one load through it; the last of them to end drops it."""

    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    users: int = 0


class AdapterLoader:
    def __init__(
        self,
        pool: SlotPool,
        store: ArtifactStore,
        registry: registry_pb2_grpc.RegistryServiceStub,
        *,
        metadata: Metadata,
        model_digest: str,
        max_pinned_per_tenant: int = 0,
        bucket: Bucket | None = None,
    ) -> None:
        """max_pinned_per_tenant: the versions one user tenant may pin at once (0: no limit). bucket: where
        versions are pulled from (the registry moves no bytes then); store is its verified cache."""
        self.pool = pool
        self.store = store
        self.bucket = bucket
        self.registry = registry
        self.metadata = metadata
        self.model_digest = model_digest
        self.max_pinned_per_tenant = max_pinned_per_tenant
        self._loading: dict[VersionKey, _Load] = {}  # versions with acquires running now
        # Registry records of versions seen, for the follower's fast path (resolve); bounded by `_remember`.
        self._versions: dict[VersionKey, registry_pb2.Version] = {}
        self._versions_limit = VERSIONS_KEPT
        # user tenant -> versions its LoadAdapter(pin) calls are loading to pin -> how many calls: counted with
        # the tenant's pins while they load, so that concurrent calls cannot pin past the limit together.
        self._pin_claims: dict[str, dict[VersionKey, int]] = {}
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
                        adapter=cached.adapter,
                        version=cached.version,
                        reference=reference,
                        artifact_sha256=cached.artifact_sha256,
                    )
                    return Resolved((cached.adapter, cached.version), message, cached)
        response = await registry_call(
            self.registry.Resolve(registry_pb2.ResolveRequest(reference=reference), metadata=self.metadata)
        )
        version: registry_pb2.Version = response.version
        self._remember(version)
        if follower is not None and alias is not None:
            follower.adopt(ref.adapter, alias, version.version)
        return Resolved((version.adapter, version.version), response.resolved, version)

    async def acquire(self, resolved: Resolved, count: int = 1) -> int:
        """The slot of a resolved version, loaded on demand, with `count` references taken on it."""
        if resolved.version is None:
            return 0
        key = resolved.key
        load = self._loading.get(key)
        if load is None:
            load = self._loading[key] = _Load()
        load.users += 1  # before the first await: an acquire of the key that starts meanwhile waits on this lock
        try:
            async with load.lock:
                index = self.pool.lookup(key)
                if index is None:
                    index = await self._load(resolved.version)
                    await asyncio.to_thread(release_freed_memory)  # the load's temporary buffers, freed by now
                for _ in range(count):
                    self.pool.acquire(index)
        finally:
            load.users -= 1
            if not load.users:
                # No acquire of the key waits on the lock: the version is resident (a later acquire finds it with
                # lookup) or its load failed (a later acquire tries afresh, as it would have with the lock).
                del self._loading[key]
        return index

    async def load_pinned(self, resolved: Resolved, tenant: str | None) -> int:
        """LoadAdapter with pin: the version's slot, loaded on demand, pinned against eviction, the pin counted
        against the user tenant `tenant` (None: an admin's pin, counted against no one). A tenant at its
        --max-pinned-per-tenant is refused before anything loads, so a refused pin loads and evicts nothing."""
        key = resolved.key
        if tenant is not None:
            self._claim_pin(tenant, key)
        try:
            index = await self.acquire(resolved)
            self.pool.pin(index, tenant)
            self.pool.release(index)
        finally:
            if tenant is not None:
                self._drop_pin_claim(tenant, key)
        return index

    def _claim_pin(self, tenant: str, key: VersionKey) -> None:
        claims = self._pin_claims.get(tenant, {})
        held = self.pool.pinned_by(tenant) | claims.keys()
        limit = self.max_pinned_per_tenant
        if limit and key not in held and len(held) >= limit:  # pinning a version it already pins costs nothing
            names = ", ".join(f"{a}@{v}" for a, v in sorted(held)[:8]) + (", ..." if len(held) > 8 else "")
            raise ResourceExhausted(
                f"tenant {tenant!r} already pins {len(held)} adapter versions on this sampler ({names}), the most "
                f"--max-pinned-per-tenant ({limit}) allows: unload one (UnloadAdapter) before pinning "
                f"{key[0]}@{key[1]}, or load it without pin",
                reason="TOO_MANY_PINS",
                tenant=tenant,
                pinned=len(held),
                limit=limit,
            )
        claims[key] = claims.get(key, 0) + 1
        self._pin_claims[tenant] = claims

    def _drop_pin_claim(self, tenant: str, key: VersionKey) -> None:
        claims = self._pin_claims[tenant]
        claims[key] -= 1
        if not claims[key]:
            del claims[key]
        if not claims:
            del self._pin_claims[tenant]

    def _remember(self, version: registry_pb2.Version) -> None:
        key = (version.adapter, version.version)
        if key not in self._versions and len(self._versions) >= self._versions_limit:
            self._forget_unneeded()
        self._versions[key] = version

    def _forget_unneeded(self) -> None:
        """Drops the registry records no one can still read. resolve's fast path reads a record only for a
        version the follower serves an alias as; the follower flips an alias to a version right after loading it
        (no await between), so the versions resident or loading are kept too. The next pass runs when the map has
        doubled what this one kept: amortized O(1) a resolve."""
        follower = self.follower

        def needed(key: VersionKey) -> bool:
            if key in self._loading or key in self.pool.by_key:
                return True
            return follower is not None and bool(follower.serving_aliases(*key))

        self._versions = {key: version for key, version in self._versions.items() if needed(key)}
        self._versions_limit = max(VERSIONS_KEPT, 2 * len(self._versions))

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
            try:
                await fetch_artifact(
                    self.registry,
                    self.store,
                    version.artifact_uri,
                    self.metadata,
                    bucket=self.bucket,
                    guess=(CONFIG_FILE, WEIGHTS_FILE),  # a peft adapter's files, fetched with its manifest
                    size_hint=version.artifact_size_bytes,
                )
            except DataLoss as error:  # the digest alone does not tell a caller which version is damaged
                named = f"{version.adapter}@{version.version}: {error.message}"
                raise DataLoss(named, reason=error.reason, **error.metadata) from None
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
            return FailedPrecondition(
                f"{name} is not a LoRA adapter this sampler can serve: {why}", reason="INCOMPATIBLE_ADAPTER"
            )

        try:
            config = read_peft_config(directory / CONFIG_FILE)
            tensors = load_file(str(directory / WEIGHTS_FILE))
            modules = lora_modules({key: list(t.shape) for key, t in tensors.items()}, config)
        except (OSError, SafetensorError, PeftFormatError) as error:
            # Digests verified, so these are the publisher's bytes: not a usable peft LoRA adapter. The text may
            # name the file by its place in our store, which the client has no business seeing.
            raise unusable(str(error).replace(str(directory), version.artifact_uri)) from None
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
