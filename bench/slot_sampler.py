"""Our side of bench/sampler_multilora.py: the sampler's model and slot pool in this process, every adapter in a
slot of its own, and engines over them stepped on this thread (Engine.submit, then step(); no engine thread)."""

from __future__ import annotations

import cProfile
import io
import itertools
import pstats
import time
from pathlib import Path

import torch
from inprocess import engine_over, fill_slots
from workload import RANK, TARGETS, Weights

from opentinker.sampler_server.engine import Engine
from opentinker.sampler_server.model.llama import LlamaForCausalLM
from opentinker.sampler_server.sequence import SamplingParams, Sequence
from opentinker.sampler_server.slot_pool import SlotPool
from opentinker.sampler_server.updates import SequenceUpdate


def random_adapters(shapes: dict[str, tuple[int, int]], count: int) -> list[Weights]:
    """Random LoRA pairs for every projection. B is non-zero (unlike peft's init) and sized so the delta is a
    noticeable fraction of the base output, so each adapter really changes what the model generates."""
    generator = torch.Generator().manual_seed(1)
    adapters: list[Weights] = []
    for _ in range(count):
        weights: Weights = {}
        for module, (d_in, d_out) in shapes.items():
            a = torch.randn(RANK, d_in, generator=generator) / d_in**0.5
            b = torch.randn(d_out, RANK, generator=generator) * 0.02
            weights[module] = (a, b)
        adapters.append(weights)
    return adapters


class OurSampler:
    """Our model and slot pool with every adapter resident in its own slot (slot i + 1 = adapter i), and any
    number of engines over them (each with its own KV cache and scheduler) so configurations can interleave
    step by step."""

    def __init__(self, model_dir: Path, count: int, batch: int, max_len: int, cpu_gemm: str = "onednn") -> None:
        self.device = torch.device("cpu")
        self.batch, self.max_len = batch, max_len
        self.runner = LlamaForCausalLM.from_pretrained(model_dir, device=self.device, dtype=torch.float32)
        self.packed = cpu_gemm == "onednn" and self.runner.pack_for_cpu()  # the server falls back to torch too
        # The projections peft's config targets (workload.TARGETS), and no others (linear_shapes also lists
        # lm_head): both sides then compute the same function, and greedy tokens can be compared.
        shapes = {m: s for m, s in self.runner.linear_shapes().items() if m.rsplit(".", 1)[-1] in TARGETS}
        self.adapters = random_adapters(shapes, count)
        self.pool = SlotPool(shapes, max_slots=count, max_rank=RANK, device=self.device)
        self.slots = fill_slots(self.pool, self.adapters)
        self._ids = itertools.count()

    def engine(self) -> Engine:
        # max_batch_tokens: the whole batch's prompts fit in one prefill step
        return engine_over(
            self.runner,
            self.pool,
            max_seqs=self.batch,
            max_len=self.max_len,
            max_batch_tokens=self.batch * self.max_len,
            eos_token_ids=(),
        )

    @staticmethod
    def _on_update(update: SequenceUpdate) -> None:
        if update.error:
            raise RuntimeError(update.error)

    def start(self, engine: Engine, prompts: list[list[int]], slots: list[int], max_tokens: int) -> list[Sequence]:
        """Submits one greedy request per (prompt, slot) and runs the prefill step (which samples token 1)."""
        seqs: list[Sequence] = []
        for prompt, slot in zip(prompts, slots, strict=True):
            n = next(self._ids)
            self.pool.acquire(slot)  # the engine releases each request's pin when it finishes
            params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
            seqs.append(
                Sequence(
                    seq_id=n, request_id=f"bench-{n}", sample_index=0, prompt=prompt, params=params, lora_slot=slot
                )
            )
        engine.submit(seqs, self._on_update)
        engine._drain(block=False)
        engine.step()
        if engine.scheduler.waiting or len(engine.scheduler.running) != len(seqs):
            raise RuntimeError("the prefill did not admit every sequence at once")
        return seqs

    @staticmethod
    def check(engine: Engine, seqs: list[Sequence], max_tokens: int) -> list[list[int]]:
        if engine.scheduler.has_work() or any(not s.finished or len(s.output) != max_tokens for s in seqs):
            raise RuntimeError("not every sequence generated exactly max_tokens tokens")
        return [list(s.output) for s in seqs]

    def run(self, engine: Engine, prompts: list[list[int]], slots: list[int], max_tokens: int) -> list[list[int]]:
        """End to end: submit, prefill, decode until every request is done -> the generated tokens."""
        seqs = self.start(engine, prompts, slots, max_tokens)
        while engine.scheduler.has_work():
            engine.step()
        return self.check(engine, seqs, max_tokens)

    def decode_interleaved(
        self, configs: dict[str, list[int]], prompts: list[list[int]], steps: int, reps: int
    ) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
        """Wall and process CPU seconds of every decode step per configuration (slot per row). One engine per
        configuration; each repetition prefills all of them, then steps them round robin, rotating who goes first,
        so that machine noise hits every configuration alike and all sit at the same context length."""
        engines = {name: self.engine() for name in configs}
        for name, engine in engines.items():  # warm-up
            self.run(engine, prompts, configs[name], 3)
        wall: dict[str, list[float]] = {name: [] for name in configs}
        cpu: dict[str, list[float]] = {name: [] for name in configs}
        names = list(configs)
        turn = 0
        for _ in range(reps):
            seqs = {name: self.start(engines[name], prompts, configs[name], steps + 1) for name in names}
            for _ in range(steps):
                turn += 1
                for name in names[turn % len(names) :] + names[: turn % len(names)]:
                    started, started_cpu = time.perf_counter(), time.process_time()
                    engines[name].step()
                    wall[name].append(time.perf_counter() - started)
                    cpu[name].append(time.process_time() - started_cpu)
            for name in names:
                self.check(engines[name], seqs[name], steps + 1)
        return wall, cpu

    def profile_decode(self, engine: Engine, prompts: list[list[int]], slots: list[int], steps: int) -> str:
        """cProfile of `steps` decode steps (after the prefill), the top functions by own time."""
        seqs = self.start(engine, prompts, slots, steps + 1)
        profiler = cProfile.Profile()
        profiler.enable()
        while engine.scheduler.has_work():
            engine.step()
        profiler.disable()
        self.check(engine, seqs, steps + 1)
        out = io.StringIO()
        pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(18)
        return out.getvalue()

    def memory(self, engine: Engine) -> dict[str, int]:
        pool = sum(t.numel() * t.element_size() for t in (*self.pool.a.values(), *self.pool.b.values()))
        pool += self.pool.scaling.numel() * self.pool.scaling.element_size()
        r = self.runner
        tensors = {id(t): t for t in (r.embed, r.norm, r.lm_head)}
        for layer in r.layers:
            for value in (getattr(layer, f) for f in layer.__slots__):
                for t in (value.weight, value.bias) if hasattr(value, "weight") else (value,):
                    if isinstance(t, torch.Tensor):
                        tensors[id(t)] = t
        base = sum(t.numel() * t.element_size() for t in tensors.values())
        return {
            "slot_pool_bytes": pool,
            "slot_bytes": pool // (self.pool.capacity + 1),
            "slots": self.pool.capacity,
            "kv_cache_bytes": engine.cache.bytes,
            "base_weights_bytes": base,
        }
