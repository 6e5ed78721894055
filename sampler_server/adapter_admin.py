"""The SamplerService handlers that administer the adapters and report on the sampler: GetSamplerInfo,
LoadAdapter (and pin), UnloadAdapter, ListLoaded and GetStats (a tenant's own figures, or an admin's whole
sampler's)."""

from __future__ import annotations

from typing import Any

from opentinker.rpc.serving.auth import Principal, current_principal
from opentinker.rpc.serving.errors import InvalidArgument, NotFound
from opentinker.sampler_server.servicer_state import Context, ServicerState
from opentinker.sampler_server.tenant_stats import TenantActivity
from opentinker.v1 import common_pb2, sampler_pb2


def _add_own_prompt_tokens(stats: sampler_pb2.GetStatsResponse, activity: TenantActivity) -> None:
    stats.own_prompt_tokens_cached += activity.prompt_tokens_cached
    stats.own_prompt_tokens_computed += activity.prompt_tokens_computed
    stats.own_prompt_tokens_shared += activity.prompt_tokens_shared


class AdapterAdminHandlers(ServicerState):
    async def GetSamplerInfo(self, request: sampler_pb2.GetSamplerInfoRequest, context: Context) -> Any:
        pool = self.pool
        return sampler_pb2.GetSamplerInfoResponse(
            base_model=self.info,
            max_slots=pool.capacity,
            max_rank=pool.max_rank,
            max_seqs=self.engine.max_seqs,
            max_batch_tokens=self.engine.max_batch_tokens,
            lora_kernel=self.engine.kernel,  # the kernel the engine runs, not a second guess at it
            max_pinned_per_tenant=self.loader.max_pinned_per_tenant,
        )

    def _loaded(self, index: int) -> sampler_pb2.LoadedAdapter:
        slot = self.pool.slots[index]
        adapter, version = slot.key or ("", 0)
        message = sampler_pb2.LoadedAdapter(
            version=common_pb2.ResolvedVersion(
                adapter=adapter, version=version, reference=f"{adapter}@{version}", artifact_sha256=slot.artifact_sha256
            ),
            slot=index,
            rank=slot.rank,
            pinned=slot.pinned,
            active_requests=slot.refs,
        )
        if self.follower is not None and slot.key is not None:
            message.serving_aliases.extend(self.follower.serving_aliases(adapter, version))
        message.load_time.FromNanoseconds(int(slot.load_time * 1e9))
        return message

    async def LoadAdapter(self, request: sampler_pb2.LoadAdapterRequest, context: Context) -> Any:
        resolved = await self.loader.resolve(request.reference)
        if resolved.version is None:
            raise InvalidArgument("the base model is always loaded", reason="INVALID_REFERENCE")
        if request.pin:
            # A user tenant's pins count against its --max-pinned-per-tenant, so that it cannot pin every slot and
            # leave none for other tenants' adapters; an admin's pins (and any without tokens) count against no one.
            principal = current_principal()
            tenant = None if principal.tenant is None or principal.is_admin else principal.tenant
            index = await self.loader.load_pinned(resolved, tenant)
        else:
            index = await self.loader.acquire(resolved)
            self.pool.release(index)
        return sampler_pb2.LoadAdapterResponse(adapter=self._loaded(index))

    async def UnloadAdapter(self, request: sampler_pb2.UnloadAdapterRequest, context: Context) -> Any:
        resolved = await self.loader.resolve(request.reference)
        if resolved.version is None:
            raise InvalidArgument("the base model cannot be unloaded", reason="INVALID_REFERENCE")
        freed = self.pool.unload(resolved.key)
        if freed is None:
            raise NotFound(f"{resolved.key[0]}@{resolved.key[1]} is not loaded", reason="ADAPTER_NOT_LOADED")
        return sampler_pb2.UnloadAdapterResponse(freed_now=freed)

    async def ListLoaded(self, request: sampler_pb2.ListLoadedRequest, context: Context) -> Any:
        pool, principal = self.pool, current_principal()
        loaded = [
            self._loaded(s.index)
            for s in pool.slots[1:]
            if s.key is not None and not s.loading and principal.can_access(s.key[0])  # other tenants' stay unseen
        ]
        return sampler_pb2.ListLoadedResponse(adapters=loaded, slots_total=pool.capacity)

    async def GetStats(self, request: sampler_pb2.GetStatsRequest, context: Context) -> Any:
        principal = current_principal()
        if principal.tenant is None or principal.is_admin:
            return self._all_stats()
        return self._tenant_stats(principal)

    def _all_stats(self) -> sampler_pb2.GetStatsResponse:
        engine, pool, follower = self.engine, self.pool, self.follower
        stats = sampler_pb2.GetStatsResponse(
            running_requests=engine.num_running,
            waiting_requests=engine.num_waiting,
            max_waiting=self.max_waiting,
            slots_used=pool.used(),
            slots_total=pool.capacity,
            tokens_generated=engine.stats.tokens_generated,
            decode_tokens_per_second=engine.stats.tokens_per_second(),
            kv_cache_usage=engine.stats.blocks_used / max(engine.stats.blocks_total, 1),  # blocks held
            adapter_loads_total=self.loader.loads,
            reload_failures_total=self.loader.load_failures,
            prompt_tokens_computed=engine.stats.prompt_tokens_computed,
            prompt_tokens_cached=engine.stats.prompt_tokens_cached,
            prompt_tokens_shared=engine.stats.prompt_tokens_shared,
            kv_blocks_total=engine.stats.blocks_total,
            kv_blocks_used=engine.stats.blocks_used,
            kv_blocks_cached=engine.stats.blocks_cached,
            kv_blocks_evicted=engine.stats.blocks_evicted,
            preemptions_total=engine.stats.preemptions,
            kv_block_size=engine.stats.block_size,
        )
        for activity in self.tenants.all():  # every caller's requests: the engine's counts less ComputeLogprobs
            _add_own_prompt_tokens(stats, activity)
        if (bucket := self.loader.bucket) is not None:
            b = bucket.stats
            stats.store.CopyFrom(
                sampler_pb2.StoreStatus(
                    url=bucket.describe(),
                    reachable=not b.last_error,
                    last_error=b.last_error,
                    failures_total=b.failures,
                    bytes_pulled_total=b.bytes_pulled,
                    cache_bytes=b.cached_bytes,
                )
            )
        if follower is not None:
            stats.reloads_total = follower.reloads_total
            stats.last_event_id = follower.last_event_id
            stats.recent_reloads.extend(follower.recent)
        return stats

    def _tenant_stats(self, principal: Principal) -> sampler_pb2.GetStatsResponse:
        """A tenant's own figures: its requests, its tokens, its adapters' slots, loads and reloads."""
        mine, follower, loader = principal.can_access, self.follower, self.loader
        activity = self.tenants.of(principal.tenant or "")
        stats = sampler_pb2.GetStatsResponse(
            running_requests=activity.running,
            waiting_requests=activity.waiting,
            max_waiting=self.max_waiting,
            slots_used=sum(1 for s in self.pool.slots[1:] if s.key is not None and mine(s.key[0])),
            slots_total=self.pool.capacity,
            tokens_generated=activity.tokens_generated,
            decode_tokens_per_second=activity.tokens_per_second(),
            kv_cache_usage=activity.running / max(self.engine.max_seqs, 1),
            adapter_loads_total=sum(n for a, n in loader.loads_by_adapter.items() if mine(a)),
            reload_failures_total=sum(n for a, n in loader.load_failures_by_adapter.items() if mine(a)),
        )
        _add_own_prompt_tokens(stats, activity)
        if follower is not None:
            stats.reloads_total = sum(n for a, n in follower.reloads_by_adapter.items() if mine(a))
            stats.recent_reloads.extend(r for r in follower.recent if mine(r.adapter))
        return stats
