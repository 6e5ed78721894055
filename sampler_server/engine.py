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

A ComputeLogprobs input is a sequence too (`score`): it computes its whole input and samples nothing
(max_tokens 0), so it takes its tenant's fair share of the batch, goes through chunked prefill with everyone
else's prompts and leaves its blocks in the prefix cache for the next turn, instead of one unbounded forward
inline on the engine thread between two steps.

Other threads talk to the engine only through its inbox (submit, abort, finish); it answers through the
callbacks given at submission, on the engine thread. The engine reads the adapters' weights from `SlotTensors`
and tells whoever keeps the slot books when a sequence lets go of its slot (`release`): the same process, or
the server process when the engine runs in its own (engine_process.py).

An idle engine woken by a request first waits for the rest of its burst (`burst_wait`): concurrent clients (an
RL group, a batch of prompts) reach it spread over milliseconds, and a prefill step costs about as much for
one short prompt as for thirty (each step reads every weight), so starting on the first one alone costs a
whole extra step before the others get their first token.

The n samples of one request (an RL group) share their prompt: the first of them runs the prefill and the
others hold its blocks by reference (block_manager.py) and take its last-position logits, then each samples
with its own generator. A group of 8 costs one prompt's prefill and one copy of its K/V instead of 8.

A prompt prefilled in chunks gives the same tokens and logprobs as in one piece: each chunk attends to the
K/V its earlier chunks wrote, and prompt logprobs are gathered chunk by chunk (`prompt_logprobs_so_far`).
"""

from __future__ import annotations

import concurrent.futures
import itertools
import logging
import math
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from opentinker.sampler_server.block_manager import BlockManager
from opentinker.sampler_server.kernels import Backend, Kernel, add_lora, resolve_kernel
from opentinker.sampler_server.kernels.segments import RunViews, add_lora_runs, plan_runs, plan_segments
from opentinker.sampler_server.model.batch import ForwardBatch
from opentinker.sampler_server.model.kv_cache import KVCache
from opentinker.sampler_server.model.llama import LlamaForCausalLM
from opentinker.sampler_server.sampling import sample
from opentinker.sampler_server.scheduler import Scheduler
from opentinker.sampler_server.sequence import SCORE_PARAMS, Sequence, TopLogprobs
from opentinker.sampler_server.slot_pool import SlotTensors
from opentinker.sampler_server.tenant_stats import RATE_WINDOW, tokens_per_second
from opentinker.v1 import sampler_pb2
from opentinker.weights.base_model import UNEMBED_MODULE

log = logging.getLogger("opentinker.sampler")

NON_FINITE_OUTPUT = "NON_FINITE_OUTPUT"  # SequenceUpdate.error_reason: the request's adapter, not the engine, failed
NON_FINITE_MESSAGE = "the adapter made the model's logits non-finite (inf or NaN)"


@dataclass(frozen=True, slots=True)
class SequenceUpdate:
    """What one sample gained in one step: plain values, so that it can cross a process boundary."""

    request_id: str
    sample_index: int
    tokens: list[int]
    logprobs: list[float]
    finished: bool
    stop_reason: int = sampler_pb2.STOP_REASON_UNSPECIFIED  # set when finished
    prompt_logprobs: list[float] | None = None  # on a sample's first update, when they were asked for
    error: str = ""  # set when the engine failed this sequence (the request ends with an error status)
    error_reason: str = ""  # NON_FINITE_OUTPUT: the request's adapter made its logits non-finite; "": the engine
    prompt_sources: tuple[int, int, int] = (0, 0, 0)  # the sample's tokens cached, computed, shared so far
    top_logprobs: list[TopLogprobs] = field(default_factory=list)  # one per token, when its params ask for them


UpdateCallback = Callable[[SequenceUpdate], None]


@dataclass(slots=True)
class _Submit:
    sequences: list[Sequence]
    on_update: UpdateCallback


@dataclass(slots=True)
class _Abort:
    request_id: str


@dataclass(slots=True)
class _Finish:
    request_id: str
    sample_index: int


@dataclass(slots=True)
class EngineStats:
    tokens_generated: int = 0
    steps: int = 0
    prompt_tokens_computed: int = 0  # prompt tokens run through a prefill forward
    prompt_tokens_shared: int = 0  # prompt tokens whose K/V a sample copied from another sample of its request
    prompt_tokens_cached: int = 0  # prompt tokens whose K/V were found in the prefix cache
    recent: list[tuple[float, int]] = field(default_factory=list)  # (time, tokens) of recent decode steps
    non_finite_failures: int = 0  # requests ended because their adapter made their logits non-finite
    blocks_total: int = 0  # KV-cache blocks sequences may hold
    block_size: int = 0  # tokens per block
    blocks_used: int = 0  # held by at least one sequence
    preemptions: int = 0  # running sequences sent back to the queue for want of blocks
    blocks_cached: int = 0  # full blocks in the prefix cache (held or idle)
    blocks_evicted: int = 0  # idle cached blocks taken for new tokens

    def tokens_per_second(self, window: float = RATE_WINDOW) -> float:
        return tokens_per_second(self.recent, window)


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
        self.stats = EngineStats(blocks_total=self.blocks.num_blocks, block_size=cache.block_size)
        self._inbox: queue.SimpleQueue[_Submit | _Abort | _Finish | None] = queue.SimpleQueue()
        self._score_ids = itertools.count()
        self._callbacks: dict[str, UpdateCallback] = {}
        self._run_views = RunViews()  # the slot pool's weight views per LoRA run, kept across steps
        self._thread: threading.Thread | None = None
        self._stopping = False

    # Thread-safe entry points

    def submit(self, sequences: list[Sequence], on_update: UpdateCallback) -> None:
        self._inbox.put(_Submit(sequences, on_update))

    def abort(self, request_id: str) -> None:
        self._inbox.put(_Abort(request_id))

    def finish(self, request_id: str, sample_index: int) -> None:
        """Ends one sample that the server has ended (it met a stop string): no more updates for it."""
        self._inbox.put(_Finish(request_id, sample_index))

    def score(
        self, tokens: list[int], lora_slot: int, cache_key: str = "", tenant: str = ""
    ) -> concurrent.futures.Future[list[float]]:
        """The logprob of every input token after the first (len(tokens) - 1 of them) under the slot's version.
        The caller holds a pin on the slot, which ends with the score; cancelling the future aborts it."""
        future: concurrent.futures.Future[list[float]] = concurrent.futures.Future()
        request_id = f"score-{next(self._score_ids)}"
        seq = Sequence(
            seq_id=-1,
            request_id=request_id,
            sample_index=0,
            prompt=list(tokens),
            params=SCORE_PARAMS,
            lora_slot=lora_slot,
            tenant=tenant,
            want_prompt_logprobs=True,
            cache_key=cache_key,
        )

        def on_update(update: SequenceUpdate) -> None:  # engine thread
            if update.error:
                settle_score(future, RuntimeError(update.error))
            elif update.finished:
                settle_score(future, update.prompt_logprobs or [])

        future.add_done_callback(lambda done: self.abort(request_id) if done.cancelled() else None)
        self.submit([seq], on_update)
        return future

    @property
    def num_waiting(self) -> int:
        return self.scheduler.num_waiting + self._inbox.qsize()

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

    # Engine thread

    def _run(self) -> None:
        while not self._stopping:
            idle = not self.scheduler.has_work()
            self._drain(block=idle)
            if idle and self.scheduler.has_work():
                self._await_burst()
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

    def _fail_all(self, error: str) -> None:
        for seq in [*self.scheduler.waiting, *self.scheduler.running]:
            self._retire(seq)
            callback = self._callbacks.pop(seq.request_id, None)
            if callback is not None:
                callback(SequenceUpdate(seq.request_id, seq.sample_index, [], [], finished=True, error=error))

    def _drain(self, *, block: bool) -> None:
        try:
            message = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while message is not None:
            self._handle(message)
            try:
                message = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _await_burst(self) -> None:
        """Takes in requests until none has come for `burst_wait`, for at most 10x that. Blocking here (not
        spinning) leaves the GIL to the threads that are still receiving the burst."""
        deadline = time.monotonic() + 10 * self.burst_wait
        while (left := deadline - time.monotonic()) > 0:
            try:
                message = self._inbox.get(timeout=min(self.burst_wait, left))
            except queue.Empty:
                return
            if message is None:
                return
            self._handle(message)

    def _handle(self, message: _Submit | _Abort | _Finish) -> None:
        if isinstance(message, _Submit):
            for seq in message.sequences:
                if seq.generator is None and seq.seed is not None:
                    # On the CPU whatever the device: a row's draw is one uniform, a host op (sampling.py).
                    seq.generator = torch.Generator().manual_seed(seq.seed)
                self._callbacks[seq.request_id] = message.on_update
                self.scheduler.add(seq)
        elif isinstance(message, _Abort):
            self._abort(message.request_id)
        else:
            self._finish(message.request_id, message.sample_index)

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

    def _forget_if_done(self, request_id: str) -> None:
        if all(s.request_id != request_id for s in [*self.scheduler.waiting, *self.scheduler.running]):
            self._callbacks.pop(request_id, None)

    def _retire(self, seq: Sequence) -> None:
        self.scheduler.finish(seq)
        self.release(seq.lora_slot)  # the request's pin on its adapter version ends with it
        self._block_stats()

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
        forward, token_slots, row_slots = self._prepare(computed)
        logits = self.model.forward(forward, self.cache, self._lora_hook(token_slots, row_slots))  # [M, V]
        last = self._last_logits(computed, logits)  # [E, V]: each ending sequence's last-position row
        if len(sampling) > len(ending):
            index = {id(seq): i for i, seq in enumerate(ending)}
            picked = torch.tensor([index[id(seq.leader or seq)] for seq in sampling], dtype=torch.long)
            last = last[picked.to(last.device)]  # [S, V]: a sample holding its leader's prompt takes its row
            self._share_prompts(sampling)
        self.stats.prompt_tokens_computed += batch.prefill_tokens
        draw = sample(last, sampling) if sampling else None
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
            self._end_score(seq)
        appended = 0
        for row, (seq, token, logprob) in enumerate(
            zip(sampling, draw.tokens if draw else [], draw.logprobs if draw else [], strict=True)
        ):
            if seq.request_id in failed:
                continue
            seq.num_cached = seq.num_tokens
            self.blocks.register(seq)  # its newly filled blocks join the prefix cache
            self._append(seq, token, logprob, None if draw is None else draw.top.get(row))
            appended += 1
        self.stats.steps += 1
        self.stats.tokens_generated += appended
        self.stats.recent = [*self.stats.recent[-63:], (time.monotonic(), appended)]
        self.stats.non_finite_failures += len(failed)
        self._block_stats()

    def _block_stats(self) -> None:
        blocks, stats = self.blocks, self.stats
        stats.blocks_used = blocks.num_used
        stats.blocks_cached = blocks.num_cached
        stats.blocks_evicted = blocks.evicted
        stats.preemptions = self.scheduler.preemptions
        stats.prompt_tokens_cached = self.scheduler.prompt_tokens_cached

    def _fail_request(self, request_id: str, error: str, reason: str) -> None:
        """Ends every sample of one request with an error; the others in the batch are not touched."""
        log.warning("request %s ended: %s", request_id, error)
        callback = self._callbacks.pop(request_id, None)
        for seq in [*self.scheduler.waiting, *self.scheduler.running]:
            if seq.request_id == request_id:
                self._retire(seq)
                if callback is not None:
                    callback(
                        SequenceUpdate(
                            request_id, seq.sample_index, [], [], finished=True, error=error, error_reason=reason
                        )
                    )

    def _end_score(self, seq: Sequence) -> None:
        """A score's input is computed: its prompt logprobs are the answer, and it ends."""
        seq.stop_reason = sampler_pb2.STOP_REASON_LENGTH
        callback = self._callbacks.get(seq.request_id)
        sources = (seq.tokens_cached, seq.tokens_computed, seq.tokens_shared)
        self._retire(seq)
        self._forget_if_done(seq.request_id)
        if callback is not None:
            callback(
                SequenceUpdate(
                    seq.request_id,
                    seq.sample_index,
                    [],
                    [],
                    True,
                    seq.stop_reason,
                    seq.prompt_logprobs,
                    prompt_sources=sources,
                )
            )

    def _share_prompts(self, sequences: list[Sequence]) -> None:
        """Each sample that held its leader's prompt blocks takes its prompt logprobs too."""
        for seq in sequences:
            leader, seq.leader = seq.leader, None
            if leader is not None:
                seq.prompt_logprobs = None if leader.prompt_logprobs is None else list(leader.prompt_logprobs)
                self.stats.prompt_tokens_shared += len(seq.prompt)

    def _prepare(self, computed: list[tuple[Sequence, int]]) -> tuple[ForwardBatch, list[int], list[int]]:
        """The forward batch of each sequence's chunk (its next `chunk` tokens from num_cached on), the adapter
        slot of each of its N tokens and of each of its M logit rows: one per sequence whose chunk ends it (its
        last position, to sample from), every position of a prompt chunk whose prompt logprobs are wanted,
        none for other partial chunks."""
        tokens: list[int] = []
        positions: list[int] = []
        token_slots: list[int] = []
        row_slots: list[int] = []
        new_lens: list[int] = []
        logits_indices: list[int] = []
        for seq, chunk in computed:
            new = seq.token_slice(seq.num_cached, seq.num_cached + chunk)  # a prompt chunk, or the last sampled token
            start = len(tokens)
            tokens.extend(new)
            positions.extend(range(seq.num_cached, seq.num_cached + chunk))
            token_slots.extend([seq.lora_slot] * chunk)
            new_lens.append(chunk)
            if _wants_prompt_logprobs(seq):
                logits_indices.extend(range(start, start + chunk))
            elif seq.num_cached + chunk == seq.num_tokens:
                logits_indices.append(start + chunk - 1)
            row_slots.extend([seq.lora_slot] * (len(logits_indices) - len(row_slots)))
        device = self.device
        forward = ForwardBatch(
            tokens=torch.tensor(tokens, dtype=torch.long, device=device),
            positions=torch.tensor(positions, dtype=torch.long, device=device),
            block_tables=[seq.block_table for seq, _ in computed],
            new_lens=new_lens,
            context_lens=[seq.num_cached + chunk for seq, chunk in computed],
            logits_indices=torch.tensor(logits_indices, dtype=torch.long, device=device),
        )
        return forward, token_slots, row_slots

    def _last_logits(self, computed: list[tuple[Sequence, int]], logits: torch.Tensor) -> torch.Tensor:
        """Picks the last-position row of each sequence whose chunk ends it; collects prompt logprobs chunk by
        chunk where they were asked for (position p predicts token p+1), whole once the last chunk is in."""
        rows: list[int] = []
        offset = 0
        for seq, chunk in computed:
            ends = seq.num_cached + chunk == seq.num_tokens
            if _wants_prompt_logprobs(seq):
                begin = seq.num_cached  # 0 at a first (or, after a preemption, again first) chunk
                count = min(begin + chunk, len(seq.prompt) - 1) - begin  # positions predicting a prompt token
                targets = torch.tensor(
                    seq.prompt[begin + 1 : begin + 1 + count], dtype=torch.long, device=logits.device
                )
                picked = logits[offset : offset + count].log_softmax(-1).gather(1, targets[:, None]).squeeze(1)
                so_far = [] if begin == 0 else seq.prompt_logprobs_so_far
                seq.prompt_logprobs_so_far = [*so_far, *picked.tolist()]
                if ends:
                    seq.prompt_logprobs, seq.prompt_logprobs_so_far = seq.prompt_logprobs_so_far, []
                offset += chunk
            elif ends:
                offset += 1
            if ends and not seq.scores_only:  # a score samples nothing: no last-position row
                rows.append(offset - 1)
        if rows == list(range(logits.shape[0])):
            return logits  # every row is a last position (a decode step): no [E, V] copy
        return logits[torch.tensor(rows, dtype=torch.long, device=logits.device)]

    def _lora_hook(
        self, token_slots: list[int], row_slots: list[int]
    ) -> Callable[[str, torch.Tensor, torch.Tensor], torch.Tensor] | None:
        """Each token's LoRA delta, added after every projection, and each logit row's after the unembedding
        (lm_head sees the M logit rows, `row_slots`, not the N tokens); planned once per step."""
        if not any(token_slots):
            return None  # base-model-only batch: no LoRA work at all
        lora, ranks, kernel = self.lora, self.lora.ranks.tolist(), self.kernel
        unembed = lora.unembed.tolist()
        row_slots = [slot if unembed[slot] else 0 for slot in row_slots]  # only versions with a LoRA on lm_head
        if kernel == "segments":  # its planned form: rows are ordered by slot, the plan serves every projection
            scales, views = lora.scaling.tolist(), self._run_views
            runs = plan_runs(plan_segments(token_slots, ranks, scales), lora.scaling)
            row_runs = plan_runs(plan_segments(row_slots, ranks, scales), lora.scaling)

            def planned(module: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
                if module in lora.a:
                    add_lora_runs(
                        y,
                        x,
                        lora.a[module],
                        lora.b[module],
                        row_runs if module == UNEMBED_MODULE else runs,
                        views,
                        module,
                    )
                return y

            return planned
        slot_ids = torch.tensor(token_slots, dtype=torch.long, device=self.device)
        row_ids = torch.tensor(row_slots, dtype=torch.long, device=self.device)
        any_unembed = any(row_slots)

        def hook(module: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            if module in lora.a and (any_unembed or module != UNEMBED_MODULE):
                ids = row_ids if module == UNEMBED_MODULE else slot_ids
                add_lora(y, x, lora.a[module], lora.b[module], lora.scaling, ids, ranks=ranks, backend=kernel)
            return y

        return hook

    def _append(self, seq: Sequence, token: int, logprob: float, top: TopLogprobs | None) -> None:
        seq.output.append(token)
        seq.output_logprobs.append(logprob)
        if top is not None:
            seq.output_top.append(top)
        params = seq.params
        if token in params.stop_token_ids or token in self.eos_token_ids:
            seq.stop_reason = sampler_pb2.STOP_REASON_STOP_TOKEN
        elif len(seq.output) >= params.max_tokens:
            seq.stop_reason = sampler_pb2.STOP_REASON_LENGTH
        elif seq.num_tokens >= self.max_len:
            seq.stop_reason = sampler_pb2.STOP_REASON_CONTEXT_LENGTH
        finished = seq.stop_reason != sampler_pb2.STOP_REASON_UNSPECIFIED
        first = seq.emitted_tokens == 0
        new_tokens = seq.output[seq.emitted_tokens :]
        new_logprobs = seq.output_logprobs[seq.emitted_tokens :]
        new_top = seq.output_top[seq.emitted_tokens :] if seq.output_top else []
        seq.emitted_tokens = len(seq.output)
        callback = self._callbacks.get(seq.request_id)
        sources = (seq.tokens_cached, seq.tokens_computed, seq.tokens_shared)
        if finished:
            self._retire(seq)
            self._forget_if_done(seq.request_id)
        if callback is not None:
            callback(
                SequenceUpdate(
                    seq.request_id,
                    seq.sample_index,
                    new_tokens,
                    new_logprobs,
                    finished,
                    seq.stop_reason,
                    seq.prompt_logprobs if first else None,
                    prompt_sources=sources,
                    top_logprobs=new_top,
                )
            )


def settle_score(future: concurrent.futures.Future[list[float]], outcome: list[float] | Exception) -> None:
    """Completes a score's future unless its caller cancelled it meanwhile."""
    try:
        if isinstance(outcome, Exception):
            future.set_exception(outcome)
        else:
            future.set_result(outcome)
    except concurrent.futures.InvalidStateError:
        pass  # cancelled: nobody waits for it (the cancel aborted the score)


def _wants_prompt_logprobs(seq: Sequence) -> bool:
    """Prompt logprobs are computed in a sequence's first prefill only (not when it recomputes after preemption,
    unless it was preempted before its last prompt chunk)."""
    return seq.want_prompt_logprobs and seq.prompt_logprobs is None
