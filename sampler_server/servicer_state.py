"""`ServicerState`: what every SamplerService handler shares (the engine, the slot books and their loader, the
base model's info, the tokenizer, the queue bounds, each tenant's figures); the handlers are its subclasses
(generation_handlers.py, adapter_admin.py), put together in service.py."""

from __future__ import annotations

import asyncio
import concurrent.futures
from dataclasses import dataclass
from typing import Any

from opentinker.rpc.serving.fair_executor import FairExecutor
from opentinker.sampler_server.adapters import AdapterLoader
from opentinker.sampler_server.constraint import Grammars
from opentinker.sampler_server.engine_api import EngineAPI
from opentinker.sampler_server.follower import AliasFollower
from opentinker.sampler_server.tenant_stats import TenantStats
from opentinker.sampler_server.update_stream import Mailbox
from opentinker.v1 import common_pb2

Context = Any  # grpc.aio.ServicerContext; untyped in the generated stubs


@dataclass(slots=True)
class Flight:
    """One grammar's compile at the edge, shared by the concurrent requests of a tenant that want it."""

    task: asyncio.Future[None]
    waiters: int = 0


class ServicerState:
    def __init__(
        self,
        engine: EngineAPI,
        loader: AdapterLoader,
        *,
        info: common_pb2.BaseModelInfo,
        tokenizer: Any | None,
        max_waiting: int,
        follower: AliasFollower | None = None,
        max_prompt_bytes: int = 65536,
        max_queued_per_tenant: int = 0,
        share_base_prefix_cache: bool = False,
        grammars: Grammars | None = None,
        max_compiles_per_tenant: int = 16,
    ) -> None:
        self.engine = engine
        self.pool = loader.pool  # the slot books: which version is in which slot, pins, references
        self.loader = loader
        self.info = info
        self.tokenizer = tokenizer
        self.max_waiting = max_waiting
        self.follower = follower
        self.max_prompt_bytes = max_prompt_bytes
        self.max_queued_per_tenant = max_queued_per_tenant  # 0: no per-tenant bound, only max_waiting
        self.share_base_prefix_cache = share_base_prefix_cache  # base-model blocks shared across tenants
        self.tenants = TenantStats()  # each tenant's own GetStats figures
        self.replica = ""  # the address registered with the fleet, named in every response (set once serving)
        # Tokenizing runs here, off the event loop, one prompt at a time (a fast tokenizer is not safe to share
        # between threads): a long prompt_text delays no other tenant's stream, only other text prompts.
        self._tokenize = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="sampler-tokenize")
        # Grammars compile off the event loop too, on two threads of their own that the tenants take in turns, one
        # at most per tenant: a tenant's slow schemas hold up neither text prompts, nor a cached grammar (which
        # skips the compile), nor another tenant's compile; past --max-compiles-per-tenant waiting, refused.
        self.grammars = grammars
        self._compile = FairExecutor(max_compiles_per_tenant, thread_name="sampler-grammar", workers=2)
        self._compiling: dict[tuple[str, str], Flight] = {}  # (tenant, grammar) -> its compile
        self._seq_ids = iter(range(1, 1 << 62))
        self._mailbox: Mailbox | None = None
