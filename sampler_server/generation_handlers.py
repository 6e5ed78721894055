"""The SamplerService handlers that run the model: Sample (validate -> resolve the reference ONCE to an exact
version -> pin its slot, loading it on demand -> n sequences into the engine -> stream their tokens as they come,
each sample's text decoded and its stop strings checked here, update_stream.py) and ComputeLogprobs (each input
scored by the engine in its tenant's share of the batch). The version each message names is the one that
produced its tokens, whatever aliases do meanwhile."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import math
import os
import uuid
from collections.abc import AsyncIterator
from typing import Any

from opentinker.rpc.serving.auth import Principal, current_principal
from opentinker.rpc.serving.errors import FailedPrecondition, Internal, InvalidArgument, ResourceExhausted
from opentinker.rpc.serving.fair_executor import TenantQueueFull
from opentinker.rpc.serving.model_input import tokens_of
from opentinker.sampler_server.adapters import Resolved
from opentinker.sampler_server.constraint import Constraint, invalid
from opentinker.sampler_server.detokenizer import StreamText
from opentinker.sampler_server.grammar_masks import GRAMMAR_LIMIT, GRAMMAR_REFUSED
from opentinker.sampler_server.sample_request import STOP_REASONS, cache_salt, constraint_of, sampling_params
from opentinker.sampler_server.sequence import SamplingParams, Sequence
from opentinker.sampler_server.servicer_state import Context, Flight, ServicerState
from opentinker.sampler_server.tenant_stats import TenantActivity, batch_tenant
from opentinker.sampler_server.update_stream import Mailbox, coalesce, with_text
from opentinker.sampler_server.updates import NON_FINITE_OUTPUT, SequenceUpdate
from opentinker.v1 import sampler_pb2
from opentinker.weights.names import tenant_of

MAX_SAMPLES = 64
REQUEST_SLACK = 65536  # bytes of a text SampleRequest besides its prompt_text, before the text is read


def _non_finite(resolved: Resolved) -> FailedPrecondition:
    name = resolved.message.reference if resolved.version is None else f"{resolved.key[0]}@{resolved.key[1]}"
    return FailedPrecondition(
        f"{name} made the model's logits non-finite (inf or NaN): its weights overflow the model's activations; "
        "this request ended, other requests were not affected",
        reason="NON_FINITE_OUTPUT",
    )


def _engine_error(update: SequenceUpdate, resolved: Resolved) -> Exception:
    """The status a request ends with when the engine failed one of its samples."""
    if update.error_reason == NON_FINITE_OUTPUT:
        return _non_finite(resolved)
    if update.error_reason == GRAMMAR_LIMIT:  # the request's grammar needs more than the parser's bounds
        return invalid(f"{update.error}; this request ended, other requests were not affected")
    if update.error_reason == GRAMMAR_REFUSED:
        return Internal(update.error, reason=GRAMMAR_REFUSED)
    return Internal(update.error, reason="ENGINE_FAILED")


class GenerationHandlers(ServicerState):
    async def Sample(self, request: sampler_pb2.SampleRequest, context: Context) -> AsyncIterator[Any]:
        salt = cache_salt(request.cache_salt)
        prompt = await self._prompt(request)
        params = sampling_params(request.sampling_params, vocab_size=self.info.vocab_size)
        constraint = constraint_of(request)
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
        tenant = batch_tenant(principal, request.model)
        # Counted as waiting from here on, before the awaits below (its grammar's compile too): concurrent requests
        # of the tenant see them.
        activity.waiting += count
        remaining = count
        started: set[int] = set()
        done: set[int] = set()
        submitted = ""  # the request id, once its sequences are in the engine
        try:
            if constraint is not None:
                await self._check_constraint(constraint, tenant)
                params = dataclasses.replace(params, constraint=constraint)
            resolved = await self.loader.resolve(request.model or "base")
            slot = await self.loader.acquire(resolved, count)  # refs released by the engine as sequences end
            request_id = f"{request.request_id or 'req'}-{uuid.uuid4().hex[:12]}"
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
                    yield self._response(update, text, resolved, params, prompt, first, self.replica)
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
        replica: str,
    ) -> sampler_pb2.SampleResponse:
        index = update.sample_index
        message = sampler_pb2.SampleResponse(
            replica=replica,
            sample_index=index,
            tokens=update.tokens,
            version=resolved.message,
            stop_reason=STOP_REASONS[update.stop_reason] if update.finished else sampler_pb2.STOP_REASON_UNSPECIFIED,
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
        response = sampler_pb2.ComputeLogprobsResponse(version=resolved.message, replica=self.replica)
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

    async def _check_constraint(self, constraint: Constraint, tenant: str) -> None:
        """Compiles the grammar once (unless cached) so that a bad one is refused before anything is queued; the
        engine's submit takes each sample's matcher from the same cache. Off the event loop, on the compile
        threads in the tenant's turn; concurrent requests of one tenant with one grammar share its compile."""
        grammars = self.grammars
        if grammars is None:
            raise invalid("this sampler does not do constrained decoding")
        if grammars.cached(constraint):
            return
        key = (tenant, constraint.key)
        flight = self._compiling.get(key)
        if flight is None:
            flight = self._compiling[key] = Flight(asyncio.ensure_future(self._compile_grammar(constraint, tenant)))
            flight.task.add_done_callback(functools.partial(self._compiled, key))
        flight.waiters += 1
        try:
            await asyncio.shield(flight.task)  # one caller leaving does not cancel the others' compile
        finally:
            flight.waiters -= 1
            if not flight.waiters and not flight.task.done():  # the last one left: a compile not started is dropped
                flight.task.cancel()
                self._compiled(key, flight.task)

    def _compiled(self, key: tuple[str, str], task: asyncio.Future[None]) -> None:
        flight = self._compiling.get(key)
        if flight is not None and flight.task is task:
            del self._compiling[key]
        if task.done() and not task.cancelled():
            task.exception()  # its callers got it; none left is no error to log

    async def _compile_grammar(self, constraint: Constraint, tenant: str) -> None:
        assert self.grammars is not None
        try:
            await self._compile.run(tenant, functools.partial(self.grammars.matcher, constraint))
        except TenantQueueFull as exc:
            raise ResourceExhausted(
                f"tenant {tenant!r} already has {exc.limit} grammars waiting to compile on this sampler "
                "(--max-compiles-per-tenant): retry when they have compiled, or reuse a schema (compiled once)",
                reason="TENANT_COMPILES_FULL",
                tenant=tenant,
                limit=exc.limit,
            ) from None

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
