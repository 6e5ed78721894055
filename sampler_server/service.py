"""SamplerService. A Sample request: validate -> resolve the reference ONCE to an exact version -> pin its
slot (loading it on demand) -> n sequences into the engine -> stream their tokens as they come, each sample's
text decoded here and its stop strings checked here (detokenizer.py; the engine deals in token ids). The version
each message names is the one that produced its tokens, whatever aliases do meanwhile."""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import functools
import hashlib
import math
import os
import threading
import uuid
from collections.abc import AsyncIterator
from typing import Any

from opentinker.rpc.auth import Principal, current_principal
from opentinker.rpc.errors import FailedPrecondition, Internal, InvalidArgument, NotFound, ResourceExhausted
from opentinker.rpc.model_input import tokens_of
from opentinker.sampler_server.adapters import AdapterLoader, Resolved
from opentinker.sampler_server.detokenizer import StreamText
from opentinker.sampler_server.engine import NON_FINITE_OUTPUT, SequenceUpdate
from opentinker.sampler_server.engine_api import EngineAPI
from opentinker.sampler_server.follower import AliasFollower
from opentinker.sampler_server.sequence import SamplingParams, Sequence
from opentinker.sampler_server.tenant_stats import TenantActivity, TenantStats, batch_tenant
from opentinker.v1 import common_pb2, sampler_pb2, sampler_pb2_grpc
from opentinker.weights.names import tenant_of

Context = Any  # grpc.aio.ServicerContext; untyped in the generated stubs
MAX_SAMPLES = 64
MAX_STOP_STRINGS = 16
MAX_TOP_LOGPROBS = 20  # most likely tokens reported per sampled position (OpenAI's bound)
MAX_PENALTY = 2.0  # OpenAI's bound on frequency and presence penalties (either sign)
REQUEST_SLACK = 65536  # bytes of a text SampleRequest besides its prompt_text, before the text is read
MAX_CACHE_SALT_BYTES = 256  # UTF-8 bytes of a request's cache_salt (only its SHA-256 enters the cache key)


def cache_salt(salt: str) -> str:
    """The SHA-256 (hex) of a request's cache_salt, the part of its prefix-cache key that keeps requests of one
    tenant with different salts from sharing blocks; "" for no salt. Longer than MAX_CACHE_SALT_BYTES:
    INVALID_ARGUMENT INVALID_CACHE_SALT."""
    if not salt:
        return ""
    data = salt.encode()
    if len(data) > MAX_CACHE_SALT_BYTES:
        raise InvalidArgument(
            f"cache_salt is {len(data):,} bytes; at most {MAX_CACHE_SALT_BYTES}",
            reason="INVALID_CACHE_SALT",
            field="cache_salt",
        )
    return hashlib.sha256(data).hexdigest()


def sampling_params(message: sampler_pb2.SamplingParams, *, vocab_size: int) -> SamplingParams:
    temperature = message.temperature if message.HasField("temperature") else 1.0
    if not math.isfinite(temperature) or temperature < 0:
        raise InvalidArgument(
            "sampling_params.temperature must be >= 0",
            reason="INVALID_SAMPLING_PARAMS",
            field="sampling_params.temperature",
        )
    top_p = message.top_p or 1.0
    if not 0.0 < top_p <= 1.0:
        raise InvalidArgument(
            "sampling_params.top_p must be in (0, 1]", reason="INVALID_SAMPLING_PARAMS", field="sampling_params.top_p"
        )
    max_tokens = message.max_tokens or 16
    stop_ids = tuple(int(t) for t in message.stop_token_ids)
    if any(not 0 <= t < vocab_size for t in stop_ids):
        raise InvalidArgument(
            "sampling_params.stop_token_ids has ids outside the vocabulary",
            reason="INVALID_SAMPLING_PARAMS",
            field="sampling_params.stop_token_ids",
        )
    if len(message.stop_strings) > MAX_STOP_STRINGS or any(not s for s in message.stop_strings):
        raise InvalidArgument(
            f"at most {MAX_STOP_STRINGS} non-empty stop strings",
            reason="INVALID_SAMPLING_PARAMS",
            field="sampling_params.stop_strings",
        )
    if message.top_logprobs > MAX_TOP_LOGPROBS:
        raise InvalidArgument(
            f"sampling_params.top_logprobs is {message.top_logprobs}; at most {MAX_TOP_LOGPROBS} "
            "most likely tokens per position are reported (0: none)",
            reason="INVALID_SAMPLING_PARAMS",
            field="sampling_params.top_logprobs",
        )
    for name in ("frequency_penalty", "presence_penalty"):
        value = getattr(message, name)
        if not -MAX_PENALTY <= value <= MAX_PENALTY:  # NaN fails this too
            raise InvalidArgument(
                f"sampling_params.{name} is {value}; it must be in {-MAX_PENALTY:g}..{MAX_PENALTY:g}",
                reason="INVALID_SAMPLING_PARAMS",
                field=f"sampling_params.{name}",
            )
    return SamplingParams(
        temperature=temperature,
        top_k=message.top_k,
        top_p=top_p,
        seed=message.seed if message.HasField("seed") else None,
        max_tokens=max_tokens,
        stop_token_ids=stop_ids,
        stop_strings=tuple(message.stop_strings),
        logprobs=message.logprobs,
        top_logprobs=message.top_logprobs,
        frequency_penalty=message.frequency_penalty,
        presence_penalty=message.presence_penalty,
    )


def coalesce(updates: list[SequenceUpdate]) -> list[SequenceUpdate]:
    """Updates that queued up while the client was reading, merged into one per sample (in the order each sample
    first appears), so a lagging client gets one message with several tokens instead of a backlog of one-token
    messages. A sample's tokens, logprobs and top logprobs stay in order; an error is kept."""
    merged: dict[int, SequenceUpdate] = {}
    for new in updates:
        index = new.sample_index
        old = merged.get(index)
        merged[index] = (
            new
            if old is None
            else SequenceUpdate(
                new.request_id,
                index,
                old.tokens + new.tokens,
                old.logprobs + new.logprobs,
                new.finished,
                new.stop_reason,
                old.prompt_logprobs,
                new.error or old.error,
                new.error_reason or old.error_reason,
                new.prompt_sources,
                old.top_logprobs + new.top_logprobs,
            )
        )
    return list(merged.values())


def with_text(update: SequenceUpdate, stream: StreamText) -> tuple[SequenceUpdate, str]:
    """One sample's update and the text its tokens add; cut after the token that completes a stop string (then
    finished with STOP_REASON_STOP_STRING, unless that token is the stop token that ended it anyway)."""
    fed = stream.feed(update.tokens, final=update.finished)
    if fed.stop_at is None:
        return update, fed.text
    keep = fed.stop_at + 1
    last = update.finished and keep == len(update.tokens)
    by_token = last and update.stop_reason == sampler_pb2.STOP_REASON_STOP_TOKEN
    cut = dataclasses.replace(
        update,
        tokens=update.tokens[:keep],
        logprobs=update.logprobs[:keep],
        top_logprobs=update.top_logprobs[:keep],
        finished=True,
        stop_reason=update.stop_reason if by_token else sampler_pb2.STOP_REASON_STOP_STRING,
    )
    return cut, fed.text


def _non_finite(resolved: Resolved) -> FailedPrecondition:
    name = resolved.message.reference if resolved.version is None else f"{resolved.key[0]}@{resolved.key[1]}"
    return FailedPrecondition(
        f"{name} made the model's logits non-finite (inf or NaN): its weights overflow the model's activations; "
        "this request ended, other requests were not affected",
        reason="NON_FINITE_OUTPUT",
    )


def _add_own_prompt_tokens(stats: sampler_pb2.GetStatsResponse, activity: TenantActivity) -> None:
    stats.own_prompt_tokens_cached += activity.prompt_tokens_cached
    stats.own_prompt_tokens_computed += activity.prompt_tokens_computed
    stats.own_prompt_tokens_shared += activity.prompt_tokens_shared


def _engine_error(update: SequenceUpdate, resolved: Resolved) -> Exception:
    """The status a request ends with when the engine failed one of its samples."""
    if update.error_reason == NON_FINITE_OUTPUT:
        return _non_finite(resolved)
    return Internal(update.error, reason="ENGINE_FAILED")


class Mailbox:
    """Carries the engine thread's updates to the event loop's request queues with one loop wake-up for all the
    updates of a step instead of one per token per stream (each wake-up is a self-pipe write plus a GIL hand-off
    between the two threads)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._lock = threading.Lock()
        self._pending: list[tuple[asyncio.Queue[SequenceUpdate], SequenceUpdate]] = []

    def post(self, updates: asyncio.Queue[SequenceUpdate], update: SequenceUpdate) -> None:  # engine thread
        with self._lock:
            self._pending.append((updates, update))
            if len(self._pending) > 1:
                return  # a delivery is already scheduled and will take this one too
        self.loop.call_soon_threadsafe(self._deliver)

    def _deliver(self) -> None:  # event loop
        with self._lock:
            pending, self._pending = self._pending, []
        for updates, update in pending:
            updates.put_nowait(update)


class SamplerServicer(sampler_pb2_grpc.SamplerServiceServicer):
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
        # Tokenizing runs here, off the event loop, one prompt at a time (a fast tokenizer is not safe to share
        # between threads): a long prompt_text delays no other tenant's stream, only other text prompts.
        self._tokenize = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="sampler-tokenize")
        self._seq_ids = iter(range(1, 1 << 62))
        self._mailbox: Mailbox | None = None

    async def _prompt(self, request: sampler_pb2.SampleRequest) -> list[int]:
        tokens = tokens_of(request.prompt)
        if tokens:
            return self._check_tokens(tokens, "prompt")
        # A text prompt is bounded before it is tokenized, and a huge one before it is even copied out of the
        # request: the request's serialized size is at least the text's bytes (its other fields are small).
        limit = self.max_prompt_bytes
        if request.ByteSize() > limit + REQUEST_SLACK or len((text := request.prompt_text).encode()) > limit:
            raise InvalidArgument(
                f"prompt_text is longer than {limit:,} bytes, the most this sampler tokenizes (--max-prompt-bytes)",
                reason="PROMPT_TOO_LONG",
                field="prompt_text",
            )
        if text:
            if self.tokenizer is None:
                raise InvalidArgument("this sampler has no tokenizer: send prompt tokens", reason="INVALID_PROMPT")
            encode = functools.partial(self.tokenizer.encode, text, add_special_tokens=False)
            tokens = list(await asyncio.get_running_loop().run_in_executor(self._tokenize, encode))
        return self._check_tokens(tokens, "prompt")

    def _check_tokens(self, tokens: list[int], field: str) -> list[int]:
        if not tokens:
            raise InvalidArgument(f"{field} is empty", reason="INVALID_PROMPT", field=field)
        bad = next((t for t in tokens if not 0 <= t < self.info.vocab_size), None)
        if bad is not None:
            raise InvalidArgument(
                f"{field} has token id {bad} outside the vocabulary [0, {self.info.vocab_size})",
                reason="TOKEN_OUT_OF_RANGE",
                field=field,
            )
        if len(tokens) >= self.engine.max_len:
            raise InvalidArgument(
                f"{field} has {len(tokens)} tokens; the context holds {self.engine.max_len}",
                reason="PROMPT_TOO_LONG",
                field=field,
            )
        return tokens

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

    async def Sample(self, request: sampler_pb2.SampleRequest, context: Context) -> AsyncIterator[Any]:
        salt = cache_salt(request.cache_salt)
        prompt = await self._prompt(request)
        params = sampling_params(request.sampling_params, vocab_size=self.info.vocab_size)
        if len(prompt) + params.max_tokens > self.engine.max_len:
            raise InvalidArgument(
                f"prompt ({len(prompt)}) + max_tokens ({params.max_tokens}) exceeds the context "
                f"of {self.engine.max_len}",
                reason="INVALID_SAMPLING_PARAMS",
                field="sampling_params.max_tokens",
            )
        count = request.num_samples or 1
        if count > MAX_SAMPLES:
            raise InvalidArgument(
                f"num_samples is at most {MAX_SAMPLES}", reason="INVALID_SAMPLING_PARAMS", field="num_samples"
            )
        if self.engine.num_waiting + count > self.max_waiting:
            raise ResourceExhausted(f"the waiting queue is full ({self.max_waiting} sequences)", reason="QUEUE_FULL")
        principal = current_principal()
        activity = self.tenants.of(principal.tenant or "")
        self._check_tenant_queue(principal, activity, count)
        # Counted as waiting from here on, before the awaits below: concurrent requests of the tenant see them.
        activity.waiting += count
        remaining = count
        started: set[int] = set()
        done: set[int] = set()
        submitted = ""  # the request id, once its sequences are in the engine
        try:
            resolved = await self.loader.resolve(request.model or "base")
            slot = await self.loader.acquire(resolved, count)  # refs released by the engine as sequences end
            request_id = f"{request.request_id or 'req'}-{uuid.uuid4().hex[:12]}"
            tenant = batch_tenant(principal, request.model)
            key = self._cache_key(slot, principal.tenant or "", salt)
            sequences = [
                self._sequence(request_id, i, prompt, params, slot, request.prompt_logprobs, tenant, key)
                for i in range(count)
            ]
            updates: asyncio.Queue[SequenceUpdate] = asyncio.Queue()
            loop = asyncio.get_running_loop()
            if self._mailbox is None or self._mailbox.loop is not loop:
                self._mailbox = Mailbox(loop)
            self.engine.submit(sequences, functools.partial(self._mailbox.post, updates))
            submitted = request_id
            first = [True] * count
            counted = [(0, 0, 0)] * count  # each sample's prompt_sources already in its tenant's books
            texts = [StreamText(self.tokenizer, params.stop_strings) for _ in range(count)]
            while remaining:
                pending = [await updates.get()]
                while not updates.empty():  # the client read slower than we generate: one message per sample
                    pending.append(updates.get_nowait())
                for engine_update in coalesce(pending):
                    if engine_update.error:
                        remaining = 0
                        raise _engine_error(engine_update, resolved)
                    if engine_update.sample_index in done:
                        continue  # tokens the engine made past a stop string before it was told
                    update, text = with_text(engine_update, texts[engine_update.sample_index])
                    if update.finished and not engine_update.finished:  # a stop string: the engine still runs it
                        self.engine.finish(request_id, update.sample_index)
                    if update.sample_index not in started:
                        started.add(update.sample_index)
                        activity.waiting, activity.running = activity.waiting - 1, activity.running + 1
                    activity.add_tokens(len(update.tokens))
                    activity.add_prompt_sources(counted[update.sample_index], update.prompt_sources)
                    counted[update.sample_index] = update.prompt_sources
                    if update.finished:
                        remaining -= 1
                        done.add(update.sample_index)
                        activity.running -= 1
                    yield self._response(update, text, resolved, params, prompt, first)
        finally:
            activity.running -= len(started - done)
            activity.waiting -= count - len(started)
            if remaining and submitted:  # the client went away or the server is stopping: free the sequences now
                self.engine.abort(submitted)

    def _check_tenant_queue(self, principal: Principal, activity: TenantActivity, count: int) -> None:
        """A user tenant's samples not yet started stay within --max-queued-per-tenant; admins (and callers of a
        sampler without tokens) are bounded by --max-waiting alone."""
        limit = self.max_queued_per_tenant
        if not limit or principal.tenant is None or principal.is_admin or activity.waiting + count <= limit:
            return
        raise ResourceExhausted(
            f"tenant {principal.tenant!r} already has {activity.waiting} samples waiting on this sampler; "
            f"{count} more would exceed its {limit} (--max-queued-per-tenant): retry when some have started",
            reason="TENANT_QUEUE_FULL",
            tenant=principal.tenant,
            waiting=activity.waiting,
            limit=limit,
        )

    @staticmethod
    def _response(
        update: SequenceUpdate,
        text: str,
        resolved: Resolved,
        params: SamplingParams,
        prompt: list[int],
        first: list[bool],
    ) -> sampler_pb2.SampleResponse:
        index = update.sample_index
        message = sampler_pb2.SampleResponse(
            sample_index=index,
            tokens=update.tokens,
            version=resolved.message,
            stop_reason=update.stop_reason if update.finished else sampler_pb2.STOP_REASON_UNSPECIFIED,  # type: ignore[arg-type]
            text=text,
        )
        if params.logprobs:
            message.logprobs.extend(update.logprobs)
        for top in update.top_logprobs:  # empty unless params.top_logprobs
            message.top_logprobs.add(token_ids=top.token_ids, logprobs=top.logprobs)
        if first[index]:
            message.prompt_tokens = len(prompt)
            if update.prompt_logprobs is not None:
                message.prompt_logprobs.extend(update.prompt_logprobs)
            first[index] = False
        return message

    def _sequence(
        self,
        request_id: str,
        index: int,
        prompt: list[int],
        params: SamplingParams,
        slot: int,
        prompt_logprobs: bool,
        tenant: str,
        cache_key: str,
    ) -> Sequence:
        seed = None
        if not params.greedy:
            seed = int.from_bytes(os.urandom(7), "little") if params.seed is None else (params.seed + index) % 2**64
        return Sequence(
            seq_id=next(self._seq_ids),
            request_id=request_id,
            sample_index=index,
            prompt=list(prompt),
            params=params,
            lora_slot=slot,
            tenant=tenant,
            want_prompt_logprobs=prompt_logprobs,
            seed=seed,
            cache_key=cache_key,
        )

    def _cache_key(self, slot: int, tenant: str, salt: str = "") -> str:
        """The prefix cache's weights identity for a request (block_manager.py): the content digest of the
        adapter version in its slot salted with the tenant that owns the adapter, or the base model's digest
        salted with the caller's tenant (unless --share-base-prefix-cache), so no tenant can time another's
        prompts: two tenants serving byte-identical adapters (both imported one public peft folder) share no
        block. An admin's request on team-a's adapter shares team-a's blocks. Never a name or an alias. `salt`:
        the request's cache_salt digest (cache_salt()), appended when set, so requests of one tenant with
        different salts share no block either; no salt keeps the key as it was."""
        base = self.info.model_digest
        suffix = f":salt:{salt}" if salt else ""
        if slot:
            held = self.pool.slots[slot]
            owner = tenant_of(held.key[0]) if held.key else ""
            key = f"lora:{base}:{held.artifact_sha256}:tenant:{owner}" if held.artifact_sha256 and base else ""
            return key + suffix if key else ""
        if not base:
            return ""
        return (f"base:{base}" if self.share_base_prefix_cache else f"base:{base}:tenant:{tenant}") + suffix

    async def ComputeLogprobs(self, request: sampler_pb2.ComputeLogprobsRequest, context: Context) -> Any:
        if not request.inputs:
            raise InvalidArgument("inputs is empty", reason="INVALID_PROMPT", field="inputs")
        salt = cache_salt(request.cache_salt)
        sequences = [self._check_tokens(tokens_of(m), f"inputs[{i}]") for i, m in enumerate(request.inputs)]
        principal = current_principal()
        activity = self.tenants.of(principal.tenant or "")
        # An input waits in the engine's queues like a prompt: the same bounds, the tenant's share of the batch.
        self._check_tenant_queue(principal, activity, 1)
        if self.engine.num_waiting + 1 > self.max_waiting:
            raise ResourceExhausted(f"the waiting queue is full ({self.max_waiting} sequences)", reason="QUEUE_FULL")
        resolved = await self.loader.resolve(request.model or "base")
        response = sampler_pb2.ComputeLogprobsResponse(version=resolved.message)
        tenant = batch_tenant(principal, request.model)
        for tokens in sequences:  # one at a time: a request holds at most one seat of the batch
            activity.waiting += 1
            try:
                slot = await self.loader.acquire(resolved)  # released by the engine after scoring
                # Its blocks join the prefix cache under the same weights identity a Sample of this slot uses.
                key = self._cache_key(slot, principal.tenant or "", salt)
                logprobs = await asyncio.wrap_future(self.engine.score(tokens, slot, key, tenant))
            finally:
                activity.waiting -= 1
            if not all(math.isfinite(x) for x in logprobs):
                raise _non_finite(resolved)
            response.results.append(sampler_pb2.TokenLogprobs(logprobs=logprobs))
        return response

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
