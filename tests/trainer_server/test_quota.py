"""TenantQuota: a tenant's adapters in the trainer, creations in flight included; admins and no-auth not counted."""

from __future__ import annotations

import pytest

from opentinker.rpc.auth import LOCAL_PRINCIPAL, Principal, Role
from opentinker.rpc.errors import ResourceExhausted
from opentinker.trainer_server.quota import TenantQuota

USER = Principal(tenant="team-a", role=Role.USER)
ADMIN = Principal(tenant="ops", role=Role.ADMIN)


def test_quota_counts_the_tenants_adapters_and_creations_in_flight() -> None:
    quota = TenantQuota(3)
    adapters = ["team-a/x", "team-b/y", "team-b/z"]
    with quota.reserve(USER, adapters), quota.reserve(USER, adapters):  # 1 held + 2 in flight = 3
        with pytest.raises(ResourceExhausted) as caught, quota.reserve(USER, adapters):
            pass
        assert caught.value.reason == "TENANT_QUOTA"
    with quota.reserve(USER, adapters):  # the places in flight were given back
        pass
    with quota.reserve(Principal(tenant="team-b", role=Role.USER), adapters):  # another tenant's own count
        pass


@pytest.mark.parametrize("principal", [ADMIN, LOCAL_PRINCIPAL])
def test_admins_and_servers_without_tokens_are_not_refused(principal: Principal) -> None:
    with TenantQuota(1).reserve(principal, ["team-a/x", "team-a/y"]):
        pass


def test_zero_means_no_limit() -> None:
    with TenantQuota(0).reserve(USER, [f"team-a/{i}" for i in range(100)]):
        pass
