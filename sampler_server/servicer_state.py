"""`ServicerState`: what every SamplerService handler shares (the engine, the slot books and their loader, the
base model's info, the tokenizer, the queue bounds, each tenant's figures); the handlers are its subclasses
(generation_handlers.py, adapter_admin.py), put together in service.py."""

from __future__ import annotations

import concurrent.futures
from typing import Any

from opentinker.sampler_server.adapters import AdapterLoader
from opentinker.sampler_server.constraint import Grammars
from opentinker.sampler_server.engine_api import EngineAPI
from opentinker.sampler_server.follower import AliasFollower
from opentinker.sampler_server.tenant_stats import TenantStats
from opentinker.sampler_server.update_stream import Mailbox
from opentinker.v1 import common_pb2

Context = Any  # grpc.aio.ServicerContext; untyped in the generated stubs


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
        # Grammars compile off the event loop too, on threads of their own: a tenant's slow schema holds up
        # neither text prompts nor a cached grammar (which skips the compile), and at most two slow compiles run.
        self.grammars = grammars
        self._compile = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="sampler-grammar")
        self._seq_ids = iter(range(1, 1 << 62))
        self._mailbox: Mailbox | None = None
