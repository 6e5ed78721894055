"""Who owns a saved state: the tenant of the adapter it was saved from, recorded in its state.json at SaveState.

A state id is a content digest, which anyone may learn (logs, a shared notebook): it must not work as a bearer
key. So LoadState and CreateAdapter(resume_state) of a state another tenant owns answer exactly what they answer
for a state that does not exist (NOT_FOUND STATE_NOT_FOUND), revealing nothing. Admins (and a server without
tokens) may load any state.
"""

from __future__ import annotations

from typing import Any

from opentinker.rpc.serving.auth import Principal


def tenant_of(adapter: str) -> str | None:
    """An adapter's tenant: its name's first segment ("team-a/policy" -> "team-a"); None without one."""
    tenant, slash, _ = adapter.partition("/")
    return tenant if slash else None


def state_owner(adapter: str, principal: Principal) -> str | None:
    """The owner recorded for a state of `adapter` saved by `principal`: the caller's tenant for a user (who
    can only reach its own adapters), the adapter's tenant for an admin saving on a tenant's behalf."""
    if principal.tenant is not None and not principal.is_admin:
        return principal.tenant
    return tenant_of(adapter)


def may_load(meta: dict[str, Any], principal: Principal) -> bool:
    """Whether `principal` may load a state with this state.json (states from before owners were recorded
    belong to the tenant of the adapter they were saved from)."""
    if principal.tenant is None or principal.is_admin:
        return True
    owner = meta["owner"] if "owner" in meta else tenant_of(str(meta.get("adapter", "")))
    return owner is not None and owner == principal.tenant
