"""Noisy neighbours on the sampler's adapter slots (issue 33, item 3): two user tenants and an admin with tokens, one
registry and one sampler with 16 slots, real processes. team-a pins versions until it is refused; its pins stop at
--max-pinned-per-tenant (default max(1, 16 // 8) = 2), each pin released once however it ends; admin pins are
not counted; and after team-a has also filled every other slot with loads of its own, team-b's new adapter
still loads, pinned, and serves."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from registryutil import lora_files, upload
from samplerutil import collect, params, prompt, request
from tenantstack import TenantStack, tenant_stack
from trainerutil import assert_status, rpc_error

from opentinker.v1 import common_pb2, registry_pb2, sampler_pb2

SLOTS = 16
LIMIT = 2  # --max-pinned-per-tenant's default at --max-slots 16


@dataclass
class Tenants(TenantStack):
    artifacts: dict[str, str]  # tenant -> the artifact its adapters publish

    def adapter(self, who: str, name: str) -> str:
        """A new adapter of `who` with one version: its exact reference (one version per adapter, so that no alias
        move makes the sampler replace a pinned version meanwhile)."""
        create = registry_pb2.CreateAdapterRequest(name=name, lora_config=common_pb2.LoraConfig(rank=4))
        self.registry.CreateAdapter(create, metadata=self.md(who), timeout=60)
        publish = registry_pb2.PublishVersionRequest(
            adapter=name, artifact_uri=self.artifacts[who], lora_config=common_pb2.LoraConfig(rank=4, alpha=4.0)
        )
        response = self.registry.PublishVersion(publish, metadata=self.md(who), timeout=60)
        return f"{name}@{response.version.version}"

    def load(self, who: str, reference: str, *, pin: bool = True) -> sampler_pb2.LoadedAdapter:
        load = sampler_pb2.LoadAdapterRequest(reference=reference, pin=pin)
        adapter: sampler_pb2.LoadedAdapter = self.sampler.LoadAdapter(load, metadata=self.md(who), timeout=60).adapter
        return adapter

    def refused_pin(self, who: str, reference: str) -> grpc.RpcError:
        return rpc_error(lambda: self.load(who, reference))

    def loaded(self, who: str) -> dict[str, sampler_pb2.LoadedAdapter]:
        listed = self.sampler.ListLoaded(sampler_pb2.ListLoadedRequest(), metadata=self.md(who), timeout=60)
        return {a.version.reference: a for a in listed.adapters}


@pytest.fixture(scope="module")
def tenants(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Tenants]:
    workdir = tmp_path_factory.mktemp("noisy-pins")
    with tenant_stack(workdir, tiny_model, "--max-slots", str(SLOTS)) as stack:
        artifacts = {
            who: upload(stack.registry, lora_files(tiny_model, seed=seed), metadata=stack.md(who), timeout=60)
            for who, seed in (("team-a", 1), ("team-b", 2))
        }
        yield Tenants(
            stack.registry_server, stack.sampler_server, stack.tokens, stack.registry, stack.sampler, artifacts
        )


def test_one_tenants_pins_leave_the_other_tenant_slots_to_load_and_serve(tenants: Tenants) -> None:
    pinned: list[str] = []
    refused: grpc.RpcError | None = None
    for i in range(SLOTS + 1):  # without a limit, team-a would pin all 16 slots and then find none free
        reference = tenants.adapter("team-a", f"team-a/pin-{i}")
        try:
            assert tenants.load("team-a", reference).pinned
        except grpc.RpcError as error:
            refused = error
            break
        pinned.append(reference)
    assert refused is not None and len(pinned) == LIMIT
    # The limit a client can read before it runs into it (the default here: max(1, 16 // 8)).
    info = tenants.sampler.GetSamplerInfo(sampler_pb2.GetSamplerInfoRequest(), metadata=tenants.md("team-a"))
    assert info.max_pinned_per_tenant == LIMIT
    metadata = assert_status(refused, grpc.StatusCode.RESOURCE_EXHAUSTED, "TOO_MANY_PINS")
    assert metadata == {"tenant": "team-a", "pinned": str(LIMIT), "limit": str(LIMIT)}
    assert f"--max-pinned-per-tenant ({LIMIT})" in str(refused.details())
    over = f"team-a/pin-{LIMIT}@1"
    assert over in str(refused.details()) and over not in tenants.loaded("team-a")  # refused: nothing loaded

    # Pinning a version it already pins is no new pin; an operator's pins are not counted.
    assert tenants.load("team-a", pinned[0]).pinned
    assert tenants.load("ops", over).pinned
    another = tenants.adapter("team-a", "team-a/pin-another")
    assert_status(tenants.refused_pin("team-a", another), grpc.StatusCode.RESOURCE_EXHAUSTED, "TOO_MANY_PINS")

    # An unpin (UnloadAdapter) gives the tenant one pin back, once: a second unload finds nothing to release.
    unload = sampler_pb2.UnloadAdapterRequest(reference=pinned[0])
    assert tenants.sampler.UnloadAdapter(unload, metadata=tenants.md("team-a"), timeout=60).freed_now
    gone = rpc_error(lambda: tenants.sampler.UnloadAdapter(unload, metadata=tenants.md("team-a"), timeout=60))
    assert_status(gone, grpc.StatusCode.NOT_FOUND, "ADAPTER_NOT_LOADED")
    assert tenants.load("team-a", another).pinned
    last = tenants.adapter("team-a", "team-a/pin-last")
    assert_status(tenants.refused_pin("team-a", last), grpc.StatusCode.RESOURCE_EXHAUSTED, "TOO_MANY_PINS")

    # team-a fills every other slot with loads of its own (unpinned: each evictable once idle).
    filled = 0
    while len(tenants.loaded("ops")) < SLOTS:
        tenants.load("team-a", tenants.adapter("team-a", f"team-a/fill-{filled}"), pin=False)
        filled += 1
    assert sum(a.pinned for a in tenants.loaded("ops").values()) == LIMIT + 1  # team-a's 2, the operator's 1

    # team-b's new adapter still loads, pinned, and serves its requests.
    fresh = tenants.adapter("team-b", "team-b/fresh")
    assert tenants.load("team-b", fresh).pinned
    result = collect(
        tenants.sampler.Sample(
            request("team-b/fresh", prompt(7), params(max_tokens=8)), metadata=tenants.md("team-b"), timeout=120
        )
    )
    assert result.only.tokens and set(result.versions) == {("team-b/fresh", 1)}
    mine = tenants.loaded("team-b")
    assert list(mine) == [fresh] and mine[fresh].pinned  # team-b sees its own adapter only
