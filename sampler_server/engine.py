"""The serving engine: one thread runs `step()` over a continuously changing batch.

    step: schedule (each sequence's chunk: 1 decode token, a run of prompt tokens, or 0 for a sample taking
          its leader's row; in chunked mode decodes and prompt chunks share a step; blocks for every token,
          preempting when out)
          -> copy-on-write: a sample about to append to a partial block other samples hold gets its own copy
          -> prepare flat tokens, positions, block tables and each token's adapter slot (one sample per request
             computes the prompt, its other samples hold the same blocks)
          -> one model forward; every projection adds each token's own LoRA delta (slot pool + kernels),
             the LM head each logit row's (only rows to sample from, and prompt-logprob positions)
          -> sample one token per sequence whose chunk ended what it lacked (with its position's most likely
             tokens where asked); a partly computed prompt only advances (num_cached += chunk)
          -> stop checks on token ids (stop tokens, max_tokens, the context), emit the ids -> free finished
             sequences; the server process detokenizes each stream and checks its stop strings (detokenizer.py),
             and finishes a sample that met one (`finish`)

A ComputeLogprobs input is a sequence too (`score`, scoring.py): it computes its whole input and samples
nothing, scheduled like everyone else's prompts.

Other threads talk to the engine only through its inbox (submit, abort, finish; a constrained request whose
grammar is not cached gets there once compiled on the engine's compile threads, grammar_lane.py); it answers
through the callbacks given at submission, on the engine thread. The engine reads the adapters' weights from
`SlotTensors` and tells whoever keeps the slot books when a sequence lets go of its slot (`release`): the same
process, or the server process when the engine runs in its own (engine_process.py).

An idle engine woken by a request first waits for the rest of its burst (`burst_wait`, inbox.py).

The n samples of one request (an RL group) share their prompt: the first of them runs the prefill and the
others hold its blocks by reference (block_manager.py) and take its last-position logits, then each samples
with its own generator. A group of 8 costs one prompt's prefill and one copy of its K/V instead of 8.

Each thing `step` calls lives in a file named for it: the scheduler (scheduler.py), the step's rows
(step_rows.py), the LoRA plan (lora_plan.py), sampling (sampling.py), prompt logprobs and scores (scoring.py),
and what a step hands back (updates.py).
"""

from __future__ import annotations

import concurrent.futures
import itertools
import logging
import math
import threading
import time
from collections.abc import Callable

import torch

from opentinker.sampler_server.block_manager import BlockManager
from opentinker.sampler_server.constraint import Grammars
from opentinker.sampler_server.engine_stats import EngineStats
from opentinker.sampler_server.grammar_lane import GrammarLane
from opentinker.sampler_server.grammar_masks import MaskWorker, consume
from opentinker.sampler_server.grammar_masks import failure as grammar_failure
from opentinker.sampler_server.inbox import Abort, Finish, Inbox, Message, Submit
from opentinker.sampler_server.kernels import Backend, Kernel, resolve_kernel
from opentinker.sampler_server.kernels.segments import RunViews
from opentinker.sampler_server.lora_plan import LoraHook, lora_hook
from opentinker.sampler_server.model.kv_cache import KVCache
from opentinker.sampler_server.model.llama import LlamaForCausalLM
from opentinker.sampler_server.sampling import sample
from opentinker.sampler_server.scheduler import Scheduler
from opentinker.sampler_server.scoring import score_callback, score_sequence, score_update
from opentinker.sampler_server.sequence import Sequence
from opentinker.sampler_server.slot_pool import SlotTensors
from opentinker.sampler_server.step_rows import last_logits, prepare_forward
from opentinker.sampler_server.updates import (
    NON_FINITE_MESSAGE,
    NON_FINITE_OUTPUT,
    SequenceUpdate,
    UpdateCallback,
    append_token,
    failed_update,
)

log = logging.getLogger("opentinker.sampler")


class Engine:
    def __init__(
        self,
        model: LlamaForCausalLM,
        cache: KVCache,
        lora: SlotTensors,
        scheduler: Scheduler,
        *,
        release: Callable[[int], None],
        max_len: int,
        eos_token_ids: tuple[int, ...],
        kernel: Backend = "auto",
        burst_wait: float = 0.002,
        prefix_cache: bool = True,
        on_iteration: Callable[[], None] | None = None,
        grammars: Grammars | None = None,
    ) -> None:
        self.model = model
        self.cache = cache
        self.lora = lora
        self.release = release  # a sequence's pin on its adapter slot ends
        self.scheduler = scheduler
        self.max_len = max_len
        self.eos_token_ids = set(eos_token_ids)
        self.kernel: Kernel = resolve_kernel(kernel, cache.device.type)  # the server passes it resolved already
        # The cache's last max_len blocks stay out of the pool (they were the ComputeLogprobs area, which scores
        # no longer need): measured with bench-check, a pool over the whole cache decoded at 0.78-0.84x (two
        # runs), this layout at 1.04x of the build before; the cause is not found yet (docs/performance.md).
        sequence_blocks = -(-max_len // cache.block_size)
        if cache.num_blocks < 2 * sequence_blocks:
            raise ValueError(
                f"a KV cache of {cache.num_blocks} blocks of {cache.block_size} tokens cannot hold one "
                f"{max_len}-token sequence besides the blocks kept out of the pool"
            )
        self.blocks = BlockManager(cache.num_blocks - sequence_blocks, cache.block_size, prefix_cache=prefix_cache)
        scheduler.use_blocks(self.blocks, sequence_blocks=sequence_blocks)
        self.burst_wait = burst_wait  # seconds without a new request that end a burst; the whole wait is at most 10x
        self.on_iteration = on_iteration  # called on the engine thread after each round of inbox + step
        self.device = cache.device
        self._compiles: GrammarLane | None = None
        self.grammars = grammars  # constrained decoding's compiler (constraint.py); None: no constraint accepted
        self.masks = MaskWorker(grammars.vocab_size if grammars is not None else 0)  # no grammars: never used
        self.stats = EngineStats(blocks_total=self.blocks.num_blocks, block_size=cache.block_size)
        self._inbox = Inbox()
        self._score_ids = itertools.count()
        self._callbacks: dict[str, UpdateCallback] = {}
        self._run_views = RunViews()  # the slot pool's weight views per LoRA run, kept across steps
        self._thread: threading.Thread | None = None
        self._stopping = False

    @property
    def grammars(self) -> Grammars | None:
        return None if self._compiles is None else self._compiles.grammars

    @grammars.setter
    def grammars(self, grammars: Grammars | None) -> None:
        """Set before the engine starts. Grammars not cached compile on threads of their own, the tenants in
        turns, never on the submitting thread."""
        self._compiles = None if grammars is None else GrammarLane(grammars, self._compiled)

    # Thread-safe entry points

    def submit(self, sequences: list[Sequence], on_update: UpdateCallback) -> None:
        """On the caller's thread, which never compiles: a constrained sample's matcher comes from the cache here,
        or the request waits for its grammar on the engine's compile threads (grammar_lane.py)."""
        message = Submit(sequences, on_update)
        if any(seq.params.constraint is not None and seq.matcher is None for seq in sequences):
            if self._compiles is None:
                message.error = "the constraint did not compile: this engine has no grammar compiler"
            elif not self._compiles.take(message):
                return  # it enters the inbox once compiled
        self._inbox.put(message)

    def _compiled(self, message: Submit) -> None:
        """The compile threads hand over a request whose grammar compiled (or failed)."""
        self._inbox.put(message)

    def abort(self, request_id: str) -> None:
        if self._compiles is not None:
            self._compiles.abort(request_id)
        self._inbox.put(Abort(request_id))

    def finish(self, request_id: str, sample_index: int) -> None:
        """Ends one sample that the server has ended (it met a stop string): no more updates for it."""
        self._inbox.put(Finish(request_id, sample_index))

    def score(
        self, tokens: list[int], lora_slot: int, cache_key: str = "", tenant: str = ""
    ) -> concurrent.futures.Future[list[float]]:
        """The logprob of every input token after the first (len(tokens) - 1 of them) under the slot's version.
        The caller holds a pin on the slot, which ends with the score; cancelling the future aborts it."""
        future: concurrent.futures.Future[list[float]] = concurrent.futures.Future()
        request_id = f"score-{next(self._score_ids)}"
        future.add_done_callback(lambda done: self.abort(request_id) if done.cancelled() else None)
        self.submit([score_sequence(request_id, tokens, lora_slot, cache_key, tenant)], score_callback(future))
        return future

    @property
    def num_waiting(self) -> int:
        compiling = 0 if self._compiles is None else self._compiles.num_waiting
        return self.scheduler.num_waiting + self._inbox.qsize() + compiling

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def max_seqs(self) -> int:
        return self.scheduler.max_seqs

    @property
    def max_batch_tokens(self) -> int:
        return self.scheduler.max_batch_tokens

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="sampler-engine", daemon=True)
        self._thread.start()

    @property
    def started(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def stop(self) -> None:
        self._stopping = True
        self._inbox.put(None)
        if self._thread is not None:
            self._thread.join(30)
        self.masks.stop()
        if self._compiles is not None:
            self._compiles.stop()

    # Engine thread

    def _run(self) -> None:
        while not self._stopping:
            idle = not self.scheduler.has_work()
            self._drain(block=idle)
            if idle and self.scheduler.has_work():
                self._inbox.await_burst(self._handle, self.burst_wait)
            if self.scheduler.has_work():
                try:
                    self.step()
                except Exception:
                    # A bug must not kill the engine thread and hang every stream: fail what was in flight.
                    log.exception("engine step failed; failing the sequences in flight")
                    self._fail_all("the sampler engine failed; see the server log")
            if self.on_iteration is not None:
                self.on_iteration()
        for seq in [*self.scheduler.waiting, *self.scheduler.running]:
            self._retire(seq)

    def _drain(self, *, block: bool) -> None:
        self._inbox.drain(self._handle, block=block)

    def _handle(self, message: Message) -> None:
        if isinstance(message, Submit) and message.error:
            for seq in message.sequences:  # never queued: their pins on the slot end here
                self.release(seq.lora_slot)
                message.on_update(failed_update(seq, message.error))
        elif isinstance(message, Submit):
            for seq in message.sequences:
                if seq.generator is None and seq.seed is not None:
                    # On the CPU whatever the device: a row's draw is one uniform, a host op (sampling.py).
                    seq.generator = torch.Generator().manual_seed(seq.seed)
                self._callbacks[seq.request_id] = message.on_update
                self.scheduler.add(seq)
        elif isinstance(message, Abort):
            self._abort(message.request_id)
        else:
            self._finish(message.request_id, message.sample_index)

    def step(self) -> None:
        batch = self.scheduler.schedule()
        if batch is None:
            return
        # Rows of one adapter side by side: one contiguous segment per adapter for the LoRA kernels.
        work = sorted(zip(batch.sequences, batch.chunks, strict=True), key=lambda w: w[0].lora_slot)
        computed = [(seq, chunk) for seq, chunk in work if chunk]  # the others take their leader's row
        ended = [seq for seq, chunk in computed if seq.num_cached + chunk == seq.num_tokens]
        ending = [seq for seq in ended if not seq.scores_only]  # they sample
        scored = [seq for seq in ended if seq.scores_only]  # a score's input is in: its logprobs are done
        partial = [(seq, chunk) for seq, chunk in computed if seq.num_cached + chunk < seq.num_tokens]
        sampling = [
            seq
            for seq, chunk in work
            if (not chunk or seq.num_cached + chunk == seq.num_tokens) and not seq.scores_only
        ]
        for src, dst, rows in self.blocks.take_copies():  # copy-on-write of shared partial blocks
            self.cache.copy_block(src, dst, rows)
        masks = self.masks.start(sampling)  # the grammar masks compute while the forward runs
        forward, token_slots, row_slots = prepare_forward(computed, self.device)
        logits = self.model.forward(forward, self.cache, self._lora_hook(token_slots, row_slots))  # [M, V]
        last = last_logits(computed, logits)  # [E, V]: each ending sequence's last-position row
        if len(sampling) > len(ending):
            index = {id(seq): i for i, seq in enumerate(ending)}
            picked = torch.tensor([index[id(seq.leader or seq)] for seq in sampling], dtype=torch.long)
            last = last[picked.to(last.device)]  # [S, V]: a sample holding its leader's prompt takes its row
            self._share_prompts(sampling)
        self.stats.prompt_tokens_computed += batch.prefill_tokens
        draw = sample(last, sampling, masks.result() if masks else None) if sampling else None
        failed = set() if draw is None else {sampling[row].request_id for row in draw.failed}
        for request_id in failed:  # only those requests end; the step goes on for every other row
            self._fail_request(request_id, NON_FINITE_MESSAGE, NON_FINITE_OUTPUT)
        for seq, chunk in partial:  # a prompt computed in part: no token yet
            if seq.request_id not in failed:
                seq.num_cached += chunk
                self.blocks.register(seq)
        for seq in scored:  # non-finite logprobs go back as they are (the server refuses them, naming the adapter)
            if all(map(math.isfinite, seq.prompt_logprobs or [])):  # and such K/V are not cached
                seq.num_cached = seq.num_tokens
                self.blocks.register(seq)  # the next turn, which extends the scored text, finds its blocks
            self._emit(seq, score_update(seq), finished=True)
        appended = 0
        for row, (seq, token, logprob) in enumerate(
            zip(sampling, draw.tokens if draw else [], draw.logprobs if draw else [], strict=True)
        ):
            if seq.request_id in failed:
                continue
            accepted, grammar_ended = consume(seq, token)
            if not accepted:  # a parser limit reached, or a library fault: this request alone ends
                failed.add(seq.request_id)
                self._fail_request(seq.request_id, *grammar_failure(seq, token))
                continue
            seq.num_cached = seq.num_tokens
            self.blocks.register(seq)  # its newly filled blocks join the prefix cache
            top = None if draw is None else draw.top.get(row)
            update = append_token(seq, token, logprob, top, self.eos_token_ids, self.max_len, grammar_ended)
            self._emit(seq, update, finished=update.finished)
            appended += 1
        self.stats.steps += 1
        self.stats.tokens_generated += appended
        self.stats.recent = [*self.stats.recent[-63:], (time.monotonic(), appended)]
        self.stats.non_finite_failures += len(failed)
        self._block_stats()

    def _lora_hook(self, token_slots: list[int], row_slots: list[int]) -> LoraHook | None:
        return lora_hook(self.lora, self.kernel, self._run_views, token_slots, row_slots, self.device)

    def _share_prompts(self, sequences: list[Sequence]) -> None:
        """Each sample that held its leader's prompt blocks takes its prompt logprobs too."""
        for seq in sequences:
            leader, seq.leader = seq.leader, None
            if leader is not None:
                seq.prompt_logprobs = None if leader.prompt_logprobs is None else list(leader.prompt_logprobs)
                self.stats.prompt_tokens_shared += len(seq.prompt)

    def _emit(self, seq: Sequence, update: SequenceUpdate, *, finished: bool) -> None:
        """Hands a sample's update to its request's callback; a finished sample is retired first."""
        callback = self._callbacks.get(seq.request_id)
        if finished:
            self._retire(seq)
            self._forget_if_done(seq.request_id)
        if callback is not None:
            callback(update)

    def _block_stats(self) -> None:
        blocks, stats = self.blocks, self.stats
        stats.blocks_used = blocks.num_used
        stats.blocks_cached = blocks.num_cached
        stats.blocks_evicted = blocks.evicted
        stats.preemptions = self.scheduler.preemptions
        stats.prompt_tokens_cached = self.scheduler.prompt_tokens_cached

    # Ending sequences

    def _retire(self, seq: Sequence) -> None:
        self.scheduler.finish(seq)
        self.release(seq.lora_slot)  # the request's pin on its adapter version ends with it
        self._block_stats()

    def _forget_if_done(self, request_id: str) -> None:
        if all(s.request_id != request_id for s in [*self.scheduler.waiting, *self.scheduler.running]):
            self._callbacks.pop(request_id, None)

    def _abort(self, request_id: str) -> None:
        for seq in [*self.scheduler.waiting, *self.scheduler.running]:
            if seq.request_id == request_id:
                self._retire(seq)
        self._callbacks.pop(request_id, None)

    def _finish(self, request_id: str, sample_index: int) -> None:
        for seq in [*self.scheduler.waiting, *self.scheduler.running]:
            if seq.request_id == request_id and seq.sample_index == sample_index:
                self._retire(seq)
                self._forget_if_done(request_id)

    def _fail_request(self, request_id: str, error: str, reason: str) -> None:
        """Ends every sample of one request with an error; the others in the batch are not touched."""
        log.warning("request %s ended: %s", request_id, error)
        callback = self._callbacks.pop(request_id, None)
        for seq in [*self.scheduler.waiting, *self.scheduler.running]:
            if seq.request_id == request_id:
                self._retire(seq)
                if callback is not None:
                    callback(failed_update(seq, error, reason))

    def _fail_all(self, error: str) -> None:
        for seq in [*self.scheduler.waiting, *self.scheduler.running]:
            self._retire(seq)
            callback = self._callbacks.pop(seq.request_id, None)
            if callback is not None:
                callback(failed_update(seq, error))
