"""What one tenant, or a long run, can make the sampler's adapter loader hold (issue 33, items 3 and 7), in process
against an in-memory registry (deterministic, and fast enough for 10,000 versions):

- pins: a user tenant pins at most --max-pinned-per-tenant versions; the excess is refused RESOURCE_EXHAUSTED
  TOO_MANY_PINS before anything loads; pinning a version twice counts once; a pin is released exactly once
  however it ends (unload, an unload while requests run, the slot's reuse); admins' pins count against no one.
- per-version books: the load locks and registry records stay within a fixed size over 10,000
  publish/load/unload cycles, and concurrent acquires of one version still share one load.

The two-tenant case over gRPC, real processes, is tests/reliability/test_noisy_sampler_pins.py."""

from __future__ import annotations

import asyncio
import functools
import json
import threading
from collections.abc import Awaitable, Callable, Coroutine
from pathlib import Path
from types import SimpleNamespace
from typing import Any, TypeVar, cast

import pytest
import torch
from safetensors.torch import save

from opentinker.rpc.serving import auth
from opentinker.rpc.serving.auth import Principal, Role
from opentinker.rpc.serving.errors import NotFound, ResourceExhausted
from opentinker.sampler_server import adapters
from opentinker.sampler_server.adapters import VERSIONS_KEPT, AdapterLoader
from opentinker.sampler_server.service import SamplerServicer
from opentinker.sampler_server.slot_pool import SlotPool, VersionKey, default_tenant_pins
from opentinker.v1 import common_pb2, registry_pb2, sampler_pb2
from opentinker.weights.artifact_store import ArtifactStore

CPU = torch.device("cpu")
Q0 = "model.layers.0.self_attn.q_proj"
SHAPES = {Q0: (64, 64)}  # one target module is all a load needs; no model
CYCLES = 10_000
T = TypeVar("T")


def lora_files(rank: int = 4, seed: int = 0) -> dict[str, bytes]:
    generator = torch.Generator().manual_seed(seed)
    tensors = {
        f"base_model.model.{Q0}.lora_A.weight": torch.randn(rank, 64, generator=generator),
        f"base_model.model.{Q0}.lora_B.weight": torch.randn(64, rank, generator=generator),
    }
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": ["q_proj"]}
    return {"adapter_config.json": json.dumps(config).encode(), "adapter_model.safetensors": bytes(save(tensors))}


class MemoryRegistry:
    """The registry's Resolve over versions published here, all of one artifact already in the sampler's store
    (to a sampler, a trainer publishing a snapshot every step looks like this); counts the Resolve calls."""

    def __init__(self, uri: str, sha256: str) -> None:
        self.uri, self.sha256 = uri, sha256
        self.latest: dict[str, int] = {}
        self.calls = 0

    def publish(self, adapter: str) -> int:
        self.latest[adapter] = self.latest.get(adapter, 0) + 1
        return self.latest[adapter]

    def Resolve(self, request: registry_pb2.ResolveRequest, metadata: object = None) -> Awaitable[Any]:
        self.calls += 1
        return self._resolve(request.reference)

    async def _resolve(self, reference: str) -> registry_pb2.ResolveResponse:
        name, _, suffix = reference.partition("@")
        number = int(suffix) if suffix else self.latest[name]
        version = registry_pb2.Version(adapter=name, version=number, artifact_uri=self.uri, artifact_sha256=self.sha256)
        resolved = common_pb2.ResolvedVersion(
            adapter=name, version=number, reference=reference, artifact_sha256=self.sha256
        )
        return registry_pb2.ResolveResponse(version=version, resolved=resolved)


class LatestFollower:
    """What the loader asks of the AliasFollower, for bare names serving `latest`: a publish makes the served
    mapping stale (as for an adapter the follower does not preload), the next resolve adopts the new version."""

    def __init__(self) -> None:
        self.served: dict[str, int] = {}  # adapter -> the version its latest serves

    def published(self, adapter: str) -> None:
        self.served.pop(adapter, None)

    def note_traffic(self, adapter: str) -> None:
        pass

    def served_version(self, adapter: str, alias: str) -> int | None:
        return self.served.get(adapter)

    def serving_alias(self, adapter: str) -> str | None:
        return "latest"

    def adopt(self, adapter: str, alias: str, version: int) -> None:
        self.served[adapter] = version

    def serving_aliases(self, adapter: str, version: int) -> list[str]:
        return ["latest"] if self.served.get(adapter) == version else []


class GatedFillPool(SlotPool):
    """Copies into a slot wait until `gate` opens, so that a test can act while a load is in the middle."""

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.gate, self.copying = threading.Event(), threading.Event()

    def fill(self, index: int, weights: dict[str, tuple[torch.Tensor, torch.Tensor]], **kw: Any) -> None:
        self.copying.set()
        assert self.gate.wait(timeout=60), "the test never opened the gate"
        super().fill(index, weights, **kw)


def make_loader(tmp_path: Path, pool: SlotPool, *, max_pins: int = 0) -> tuple[AdapterLoader, MemoryRegistry]:
    store = ArtifactStore(tmp_path / "store")
    ref = store.commit_files(lora_files(seed=1))
    registry = MemoryRegistry(ref.uri, ref.sha256)
    loader = AdapterLoader(
        pool, store, registry=cast(Any, registry), metadata=None, model_digest="", max_pinned_per_tenant=max_pins
    )
    return loader, registry


def run_as(principal: Principal, call: Callable[[], Coroutine[Any, Any, T]]) -> Coroutine[Any, Any, T]:
    """`call` run as `principal` (what the auth interceptor sets for an RPC)."""

    async def scoped() -> T:
        token = auth.set_principal(principal)
        try:
            return await call()
        finally:
            auth.reset_principal(token)

    return scoped()


# --- item 3: pins per tenant ------------------------------------------------------------------------------------

TEAM_A = Principal("team-a", Role.USER)
TEAM_B = Principal("team-b", Role.USER)
OPS = Principal("ops", Role.ADMIN)


class Pins:
    """A servicer's LoadAdapter/UnloadAdapter over a loader with --max-pinned-per-tenant `limit`."""

    def __init__(self, tmp_path: Path, *, slots: int, limit: int) -> None:
        self.pool = SlotPool(SHAPES, max_slots=slots, max_rank=8, device=CPU)
        self.loader, self.registry = make_loader(tmp_path, self.pool, max_pins=limit)
        engine = cast(Any, SimpleNamespace())  # LoadAdapter and UnloadAdapter never reach the engine
        self.servicer = SamplerServicer(
            engine, self.loader, info=common_pb2.BaseModelInfo(), tokenizer=None, max_waiting=1
        )

    def publish(self, adapter: str) -> str:
        return f"{adapter}@{self.registry.publish(adapter)}"

    async def load(self, who: Principal, reference: str, *, pin: bool = True) -> sampler_pb2.LoadAdapterResponse:
        request = sampler_pb2.LoadAdapterRequest(reference=reference, pin=pin)
        response: sampler_pb2.LoadAdapterResponse = await run_as(who, lambda: self.servicer.LoadAdapter(request, None))
        return response

    async def unload(self, who: Principal, reference: str) -> bool:
        request = sampler_pb2.UnloadAdapterRequest(reference=reference)
        response = await run_as(who, lambda: self.servicer.UnloadAdapter(request, None))
        return bool(response.freed_now)

    def resident(self) -> set[VersionKey]:
        return {s.key for s in self.pool.slots[1:] if s.key is not None}


def test_the_default_limit_is_an_eighth_of_the_slots_and_at_least_one() -> None:
    assert [default_tenant_pins(n) for n in (1, 4, 8, 16, 32, 100)] == [1, 1, 1, 2, 4, 12]


def test_a_tenant_pins_up_to_its_limit_and_a_refused_pin_changes_nothing(tmp_path: Path) -> None:
    pins = Pins(tmp_path, slots=4, limit=2)

    async def scenario() -> None:
        first, second, third = (pins.publish(f"team-a/p{i}") for i in range(3))
        assert (await pins.load(TEAM_A, first)).adapter.pinned
        assert (await pins.load(TEAM_A, second)).adapter.pinned
        again = await pins.load(TEAM_A, first)  # pinning a version it already pins: no second pin counted
        assert again.adapter.pinned and pins.pool.pinned_by("team-a") == {("team-a/p0", 1), ("team-a/p1", 1)}
        loads, resident = pins.loader.loads, pins.resident()
        with pytest.raises(ResourceExhausted) as refused:
            await pins.load(TEAM_A, third)
        error = refused.value
        assert error.reason == "TOO_MANY_PINS"
        assert error.metadata == {"tenant": "team-a", "pinned": "2", "limit": "2"}
        assert "--max-pinned-per-tenant (2)" in error.message and "team-a/p0@1, team-a/p1@1" in error.message
        assert "team-a/p2@1" in error.message
        # Refused before the load: nothing loaded, nothing evicted, no pin moved.
        assert pins.loader.loads == loads and pins.resident() == resident and pins.pool.evictions == 0
        assert len(pins.pool.pinned_by("team-a")) == 2
        # The same version without pin loads (evictable), and another tenant pins as many of its own.
        assert not (await pins.load(TEAM_A, third, pin=False)).adapter.pinned
        for i in range(2):
            assert (await pins.load(TEAM_B, pins.publish(f"team-b/p{i}"))).adapter.pinned
        assert len(pins.pool.pinned_by("team-b")) == 2 and pins.loader._pin_claims == {}

    asyncio.run(scenario())


def test_admin_pins_count_against_no_one(tmp_path: Path) -> None:
    pins = Pins(tmp_path, slots=4, limit=1)

    async def scenario() -> None:
        mine, extra = pins.publish("team-a/p0"), pins.publish("team-a/p1")
        await pins.load(TEAM_A, mine)
        with pytest.raises(ResourceExhausted):
            await pins.load(TEAM_A, extra)
        # An operator pins the tenant's other version (and more): not counted, the tenant stays at 1.
        assert (await pins.load(OPS, extra)).adapter.pinned
        assert (await pins.load(OPS, pins.publish("team-b/p0"))).adapter.pinned
        assert pins.pool.pinned_by("team-a") == {("team-a/p0", 1)} and pins.pool.pinned_by("ops") == set()
        # The operator re-pinning the tenant's own pin leaves it counted against the tenant, once.
        await pins.load(OPS, mine)
        assert pins.pool.pinned_by("team-a") == {("team-a/p0", 1)}

    asyncio.run(scenario())


def test_a_pin_is_released_exactly_once_however_it_ends(tmp_path: Path) -> None:
    pins = Pins(tmp_path, slots=3, limit=1)

    async def refused(reference: str) -> None:
        with pytest.raises(ResourceExhausted):
            await pins.load(TEAM_A, reference)

    async def scenario() -> None:
        v = [pins.publish(f"team-a/p{i}") for i in range(4)]
        await pins.load(TEAM_A, v[0])
        await refused(v[1])
        assert await pins.unload(TEAM_A, v[0]) is True  # unpinned and freed
        with pytest.raises(NotFound):  # a second unload finds nothing: no second release
            await pins.unload(TEAM_A, v[0])
        await pins.load(TEAM_A, v[1])  # the released pin is the tenant's again, once
        await refused(v[2])
        # Unloaded while a request holds it: the pin ends now, the slot when the request does.
        index = pins.pool.lookup(("team-a/p1", 1))
        assert index is not None
        pins.pool.acquire(index)
        assert await pins.unload(TEAM_A, v[1]) is False
        assert pins.pool.pinned_by("team-a") == set()
        await pins.load(TEAM_A, v[2])
        await refused(v[3])
        pins.pool.release(index)  # the request ends: the retired slot is freed, no pin released twice
        assert pins.pool.pinned_by("team-a") == {("team-a/p2", 1)}
        await refused(v[3])
        # Re-pinning the version it pins, at the limit, is not refused and counts once.
        await pins.load(TEAM_A, v[2])
        # What a hot reload does to the version it replaces (follower.py: pool.unload) releases its pin too.
        assert pins.pool.unload(("team-a/p2", 1)) is True
        await pins.load(TEAM_A, v[3])
        # A freed slot's next occupant starts unpinned, counted against no one.
        assert pins.pool.unload(("team-a/p3", 1)) is True
        for i in range(3):
            await pins.load(OPS, pins.publish(f"team-b/q{i}"), pin=False)
        assert all(not s.pinned and s.pin_tenant is None for s in pins.pool.slots)
        assert pins.pool.pinned_by("team-a") == set()

    asyncio.run(scenario())


def test_concurrent_pins_of_one_tenant_cannot_pass_its_limit_together(tmp_path: Path) -> None:
    pins = Pins(tmp_path, slots=6, limit=2)

    async def scenario() -> None:
        references = [pins.publish(f"team-a/p{i}") for i in range(5)]
        # All five start before any load ends: none is pinned yet when the others are checked.
        results = await asyncio.gather(*(pins.load(TEAM_A, r) for r in references), return_exceptions=True)
        won = [r for r in results if isinstance(r, sampler_pb2.LoadAdapterResponse)]
        lost = [r for r in results if isinstance(r, ResourceExhausted)]
        assert len(won) == 2 and len(lost) == 3 and all(e.reason == "TOO_MANY_PINS" for e in lost)
        assert len(pins.pool.pinned_by("team-a")) == 2 and pins.loader.loads == 2
        assert pins.loader._pin_claims == {}  # the claims of the loads in flight ended with them

    asyncio.run(scenario())


# --- item 7: per-version books ----------------------------------------------------------------------------------


def test_10000_publish_load_unload_cycles_keep_the_loader_maps_bounded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Heap trimming after each load, and parsing the same artifact's files 10,000 times, would take most of the
    # test's time and have no part in what it checks: every version's files are read once, copied per load.
    monkeypatch.setattr(adapters, "release_freed_memory", lambda: None)
    pool = SlotPool(SHAPES, max_slots=4, max_rank=8, device=CPU)
    loader, registry = make_loader(tmp_path, pool)
    read = functools.cache(lambda uri: AdapterLoader._read(loader, registry_pb2.Version(artifact_uri=uri)))
    monkeypatch.setattr(loader, "_read", lambda version: read(version.artifact_uri))
    follower = LatestFollower()
    loader.follower = follower
    name = "team-a/policy"
    largest = {"versions": 0, "loading": 0}

    async def cycles() -> None:
        for _ in range(CYCLES):
            number = registry.publish(name)
            follower.published(name)
            resolved = await loader.resolve(name)  # through the registry; the follower adopts the new version
            assert resolved.key == (name, number)
            index = await loader.acquire(resolved)
            pool.release(index)
            assert pool.unload((name, number)) is True
            largest["versions"] = max(largest["versions"], len(loader._versions))
            largest["loading"] = max(largest["loading"], len(loader._loading))

    asyncio.run(cycles())
    print(
        f"after {CYCLES} cycles: largest _versions {largest['versions']}, _loading {largest['loading']}; "
        f"now {len(loader._versions)}, {len(loader._loading)}; loads {loader.loads}"
    )
    assert loader.loads == CYCLES
    assert largest["versions"] <= VERSIONS_KEPT and largest["loading"] == 0
    # The version the alias serves kept its record: a bare name still resolves without the registry.
    calls = registry.calls
    resolved = asyncio.run(loader.resolve(name))
    assert resolved.key == (name, CYCLES) and registry.calls == calls


def test_what_the_fast_path_can_read_is_never_forgotten(tmp_path: Path) -> None:
    pool = SlotPool(SHAPES, max_slots=2, max_rank=8, device=CPU)
    loader, registry = make_loader(tmp_path, pool)
    follower = LatestFollower()
    loader.follower = follower

    async def scenario() -> None:
        served = []
        for i in range(VERSIONS_KEPT // 2):  # adapters whose latest alias the follower serves: all needed
            adapter = f"team-a/served{i}"
            registry.publish(adapter)
            served.append((await loader.resolve(adapter)).key)
        resident = await loader.resolve(f"team-a/resident@{registry.publish('team-a/resident')}")
        pool.release(await loader.acquire(resident))
        for i in range(3 * VERSIONS_KEPT):  # versions resolved once by exact reference: no one needs them after
            await loader.resolve(f"team-a/once{i}@{registry.publish(f'team-a/once{i}')}")
        kept = set(loader._versions)
        assert set(served) <= kept and resident.key in kept and len(kept) <= VERSIONS_KEPT + len(served)

    asyncio.run(scenario())


def test_concurrent_acquires_share_one_load_while_its_books_come_and_go(tmp_path: Path) -> None:
    """A waiter that gives up must not drop the load lock the others still wait on: an acquire that starts after
    it would take a fresh lock and load the version a second time, beside the load still running."""
    pool = GatedFillPool(SHAPES, max_slots=4, max_rank=8, device=CPU)
    loader, registry = make_loader(tmp_path, pool)

    async def scenario() -> None:
        resolved = await loader.resolve(f"team-a/policy@{registry.publish('team-a/policy')}")
        first = asyncio.create_task(loader.acquire(resolved))
        while not pool.copying.is_set():  # the first acquire is copying the weights into a slot
            await asyncio.sleep(0.01)
        quitter = asyncio.create_task(loader.acquire(resolved))
        for _ in range(5):
            await asyncio.sleep(0)  # the quitter waits on the load's lock
        quitter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await quitter
        later = [asyncio.create_task(loader.acquire(resolved)) for _ in range(3)]
        for _ in range(5):
            await asyncio.sleep(0)
        pool.gate.set()
        indices = await asyncio.gather(first, *later)
        assert len(set(indices)) == 1 and loader.loads == 1 and pool.slots[indices[0]].refs == 4
        assert loader._loading == {}  # the last acquire of the version dropped its lock

    asyncio.run(scenario())
