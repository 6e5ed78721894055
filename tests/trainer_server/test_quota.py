"""TenantQuota: a tenant's adapters in the trainer and their LoRA memory, creations in flight included; admins and
no-auth not counted."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from opentinker.rpc.serving.auth import LOCAL_PRINCIPAL, Principal, Role
from opentinker.rpc.serving.errors import ResourceExhausted
from opentinker.trainer_server.base_model import ModuleShape
from opentinker.trainer_server.quota import MiB, TenantQuota, lora_bytes, lora_parameters

USER = Principal(tenant="team-a", role=Role.USER)
ADMIN = Principal(tenant="ops", role=Role.ADMIN)


@dataclass(frozen=True)
class Held:
    num_parameters: int


def held(*names: str, num_parameters: int = 1) -> dict[str, Held]:
    return {name: Held(num_parameters) for name in names}


def test_quota_counts_the_tenants_adapters_and_creations_in_flight() -> None:
    quota = TenantQuota(3)
    adapters = held("team-a/x", "team-b/y", "team-b/z")
    with quota.reserve(USER, "team-a/1", adapters, 1), quota.reserve(USER, "team-a/2", adapters, 1):  # 1 + 2 = 3
        with pytest.raises(ResourceExhausted) as caught, quota.reserve(USER, "team-a/3", adapters, 1):
            pass
        assert caught.value.reason == "TENANT_QUOTA" and "--max-adapters-per-tenant 3" in str(caught.value)
    with quota.reserve(USER, "team-a/3", adapters, 1):  # the places in flight were given back
        pass
    with quota.reserve(Principal(tenant="team-b", role=Role.USER), "team-b/w", adapters, 1):  # its own count
        pass


@pytest.mark.parametrize("principal", [ADMIN, LOCAL_PRINCIPAL])
def test_admins_and_servers_without_tokens_are_not_refused(principal: Principal) -> None:
    with TenantQuota(1, 1).reserve(principal, "team-a/z", held("team-a/x", "team-a/y"), 1 << 30):
        pass


def test_zero_means_no_limit() -> None:
    with TenantQuota(0, 0).reserve(USER, "team-a/new", held(*(f"team-a/{i}" for i in range(100))), 1 << 40):
        pass


def test_lora_memory_is_weights_gradients_and_two_moments_of_float32() -> None:
    shapes = [ModuleShape(64, 64), ModuleShape(64, 128)]
    assert lora_parameters(8, shapes) == 8 * (64 + 64) + 8 * (64 + 128)
    assert lora_bytes(1000) == 16_000  # 4 copies x 4 bytes


def test_memory_quota_counts_held_adapters_and_creations_in_flight() -> None:
    quota = TenantQuota(0, 10)  # 10 MiB
    mib_params = MiB // 16  # parameters of one MiB of LoRA memory
    adapters = held("team-a/x", "team-a/y", num_parameters=3 * mib_params) | held(
        "team-b/z", num_parameters=100 * mib_params
    )
    with quota.reserve(USER, "team-a/new", adapters, 2 * mib_params):  # 6 held + 2 in flight
        assert quota.held_bytes("team-a", adapters) == 8 * MiB
        with pytest.raises(ResourceExhausted) as caught, quota.reserve(USER, "team-a/big", adapters, 3 * mib_params):
            pass
        assert caught.value.reason == "TENANT_QUOTA"
        message = str(caught.value)
        assert "holds 8.0 MiB" in message and "needs 3.0 MiB" in message and "--max-tenant-memory-mb 10" in message
        with quota.reserve(USER, "team-a/fits", adapters, 2 * mib_params):  # exactly the quota: allowed
            pass
    assert quota.held_bytes("team-a", adapters) == 6 * MiB  # the creation's reservation was given back


def test_a_created_adapter_is_not_counted_twice_while_its_creation_finishes() -> None:
    quota = TenantQuota(2, 4)
    mib_params = MiB // 16
    adapters = held("team-a/x", num_parameters=2 * mib_params)
    with quota.reserve(USER, "team-a/new", adapters, 2 * mib_params):
        adapters |= held("team-a/new", num_parameters=2 * mib_params)  # the trainer allocated it meanwhile
        assert quota.held_bytes("team-a", adapters) == 4 * MiB


def test_an_adapter_bigger_than_the_whole_quota_is_refused_before_anything_is_held() -> None:
    quota = TenantQuota(64, 1)
    with pytest.raises(ResourceExhausted) as caught, quota.reserve(USER, "team-a/huge", {}, MiB):
        pass
    assert "holds 0.0 MiB" in str(caught.value) and "needs 16.0 MiB" in str(caught.value)
    assert quota.held_bytes("team-a", {}) == 0
