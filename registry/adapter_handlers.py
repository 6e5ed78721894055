"""RegistryService handlers for adapters: create (its LoRA config checked and defaulted), get, list, delete."""

from __future__ import annotations

from typing import Any

from opentinker.registry.handler_base import Context, Handlers
from opentinker.registry.limits import check_metadata
from opentinker.registry.lora_config import check_lora_config, lora_or_default
from opentinker.rpc.serving.auth import current_principal, require_access
from opentinker.rpc.serving.errors import PermissionDenied
from opentinker.v1 import registry_pb2
from opentinker.weights.names import check_adapter_name


class AdapterHandlers(Handlers):
    async def CreateAdapter(self, request: registry_pb2.CreateAdapterRequest, context: Context) -> Any:
        name = check_adapter_name(request.name)
        principal = require_access(name)
        if principal.tenant is not None and not principal.is_admin and "/" not in name:
            raise PermissionDenied(f"tenant {principal.tenant!r} must create adapters as '{principal.tenant}/...'")
        check_lora_config(request.lora_config)
        check_metadata(self.limits, request.description, request.labels)
        adapter = registry_pb2.Adapter(
            name=name,
            lora_config=lora_or_default(request.lora_config),
            base_model_digest=request.base_model_digest,
            labels=dict(request.labels),
            description=request.description,
        )
        created, event_id = await self.store.create_adapter(adapter, principal.actor)
        return registry_pb2.CreateAdapterResponse(adapter=created, event_id=event_id)

    async def GetAdapter(self, request: registry_pb2.GetAdapterRequest, context: Context) -> Any:
        name = check_adapter_name(request.name)
        require_access(name)
        return registry_pb2.GetAdapterResponse(adapter=await self.store.get_adapter(name))

    async def ListAdapters(self, request: registry_pb2.ListAdaptersRequest, context: Context) -> Any:
        principal = current_principal()
        prefix = request.prefix
        if principal.tenant is not None and not principal.is_admin:
            own = principal.tenant + "/"
            if not prefix.startswith(own):
                if not own.startswith(prefix):
                    return registry_pb2.ListAdaptersResponse()
                prefix = own
        adapters, token = await self.store.list_adapters(
            prefix, request.page_size, request.page_token, max_bytes=self.limits.max_page_bytes
        )
        return registry_pb2.ListAdaptersResponse(adapters=adapters, next_page_token=token)

    async def DeleteAdapter(self, request: registry_pb2.DeleteAdapterRequest, context: Context) -> Any:
        name = check_adapter_name(request.name)
        principal = require_access(name)  # a tenant deletes its own adapters; garbage collection stays admin
        return registry_pb2.DeleteAdapterResponse(event_id=await self.store.delete_adapter(name, principal.actor))
