"""Sampler multi-LoRA: one decode batch whose rows use different adapter versions (S-LoRA style), driven
in-process (Engine.submit, then step() on this thread; no gRPC, no engine thread). Prints, measured side by
side in one run, medians; the decode configurations interleave step by step, the end-to-end runs alternate
(order rotated every repetition):

  P1  decode tokens/s, every row on its own adapter / every row on one adapter   (target >= 0.95)
  P3  decode tokens/s, every row on one adapter / base model, no LoRA (slot 0)   (target >= 0.90)
  P2  end-to-end greedy generation of the same requests (one adapter each), wall time of
      (a) peft, all adapters loaded, one mixed-batch generate(adapter_names=...) / ours  (target >= 3)
      (b) peft, one adapter at a time (set_adapter, batch-1 generate per request) / ours (target >= 10)
      plus how many requests produce exactly the same greedy tokens as ours (near-ties may differ; not asserted)

and the memory of the slot pool and the KV cache. Decode figures time only the decode steps: every run
prefills all its sequences in one step first. Token ids only (the engine never detokenizes: the server does);
EOS never stops a sequence (engine eos_token_ids=(), peft eos_token_id=None), so every request runs the full
token count on both sides. `--profile` adds a cProfile of mixed-adapter decode steps.

One torch thread by default: on a shared machine, another process's load stalls every multi-threaded op at
its OpenMP barrier, and a mixed-adapter step issues ~30 small ops per projection (28 projections here), so
with 2 threads on 2 busy cores single runs swing 10-20x. `--threads N` measures with N threads. Every figure
also comes as process CPU time, which other processes' load barely moves (meaningful with one thread only:
with more, it adds up the threads, spinning included).

    .venv/bin/python bench/sampler_multilora.py [--quick] [--json OUT] [--threads N] [--profile]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from multilora_report import Measured, figures_of, print_report, record_figures, stats_of
from peft_reference import PeftSampler, write_peft_adapter
from slot_sampler import OurSampler
from workload import FULL_SPEC, QUICK_SPEC, ModelSpec

from opentinker.client.tiny_model import TinyModelSpec, make_tiny_model


@dataclass(frozen=True, slots=True)
class Setup:
    spec: ModelSpec
    adapters: int  # distinct adapters = decode batch (one request per adapter)
    decode_steps: int  # P1/P3: decode steps timed per run (each row generates this many tokens after prefill)
    new_tokens: int  # P2: tokens generated per request (the first one comes out of the prefill)
    prompt_lens: tuple[int, int]  # P2 and decode runs: prompt lengths drawn in [lo, hi], mean ~16
    decode_reps: int  # alternating repetitions of (mixed, single, base)
    e2e_reps: int  # alternating repetitions of (ours, peft mixed, peft sequential), at most
    budget_s: float  # no further end-to-end repetition starts after this many seconds of the whole run


FULL = Setup(
    spec=FULL_SPEC,
    adapters=32,
    decode_steps=32,
    new_tokens=32,
    prompt_lens=(12, 20),
    decode_reps=6,
    e2e_reps=5,
    budget_s=420.0,
)
QUICK = Setup(
    spec=QUICK_SPEC,
    adapters=8,
    decode_steps=16,
    new_tokens=16,
    prompt_lens=(12, 20),
    decode_reps=7,
    e2e_reps=5,
    budget_s=90.0,
)


def make_prompts(count: int, lens: tuple[int, int], vocab: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(2)
    lengths = torch.randint(lens[0], lens[1] + 1, (count,), generator=generator).tolist()
    return [torch.randint(3, vocab, (n,), generator=generator).tolist() for n in lengths]


def load() -> str:
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="smaller model, fewer adapters and tokens (< 2 min)")
    parser.add_argument("--json", type=Path, help="write the figures here")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1, see above)")
    parser.add_argument("--profile", action="store_true", help="also cProfile mixed-adapter decode steps")
    gemm_help = "our base matmuls, as the sampler's --cpu-gemm (torch: not recorded in results.json)"
    parser.add_argument("--cpu-gemm", choices=("torch", "onednn"), default="onednn", help=gemm_help)
    args = parser.parse_args()
    setup = QUICK if args.quick else FULL
    threads = args.threads
    torch.set_num_threads(threads)
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()  # type: ignore[no-untyped-call]
    hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call]
    warnings.filterwarnings("ignore", category=FutureWarning)
    spec, batch = setup.spec, setup.adapters
    began = time.perf_counter()
    max_len = setup.prompt_lens[1] + max(setup.decode_steps + 1, setup.new_tokens) + 8

    with tempfile.TemporaryDirectory(prefix="ot-bench-") as tmp:
        work = Path(tmp)
        model_dir = make_tiny_model(work / "model", TinyModelSpec(**dataclasses.asdict(spec)))
        ours = OurSampler(model_dir, batch, batch, max_len, args.cpu_gemm)
        dirs = [write_peft_adapter(work / f"adapter-{i}", w, model_dir) for i, w in enumerate(ours.adapters)]
        peft = PeftSampler(model_dir, dirs)  # the same weights as our slots, in peft's format
    prompts = make_prompts(batch, setup.prompt_lens, spec.vocab_size)
    with torch.inference_mode():
        configs = {
            "mixed": ours.slots[:batch],  # row i on adapter i: `batch` distinct adapters
            "single": [ours.slots[0]] * batch,  # every row on one adapter
            "base": [0] * batch,  # slot 0: no LoRA work at all
        }
        load_before = load()

        # P1 / P3: decode only, the three configurations interleaved step by step; median step time.
        step_times, step_cpu = ours.decode_interleaved(configs, prompts, setup.decode_steps, setup.decode_reps)

        # P2: end to end, same requests (request i on adapter i), greedy. Warm up, then alternate whole runs.
        engine = ours.engine()
        ours.run(engine, prompts, configs["mixed"], 2)
        peft.mixed(prompts, 2)
        peft.sequential(prompts[:2], 2)
        runners: dict[str, Callable[[], list[list[int]]]] = {
            "ours": lambda: ours.run(engine, prompts, configs["mixed"], setup.new_tokens),
            "peft_mixed": lambda: peft.mixed(prompts, setup.new_tokens),
            "peft_sequential": lambda: peft.sequential(prompts, setup.new_tokens),
        }
        e2e: dict[str, list[float]] = {name: [] for name in runners}
        e2e_cpu: dict[str, list[float]] = {name: [] for name in runners}
        outputs: dict[str, list[list[int]]] = {}
        order = list(runners)
        for rep in range(setup.e2e_reps):
            if rep >= 2 and time.perf_counter() - began > setup.budget_s:
                break  # a slow (loaded) machine: fewer repetitions rather than a run far past ~10 minutes
            for name in order[rep % len(order) :] + order[: rep % len(order)]:
                started, started_cpu = time.perf_counter(), time.process_time()
                outputs[name] = runners[name]()
                e2e[name].append(time.perf_counter() - started)
                e2e_cpu[name].append(time.process_time() - started_cpu)
        base_outputs = ours.run(engine, prompts, configs["base"], setup.new_tokens)
        profile = ours.profile_decode(engine, prompts, configs["mixed"], setup.decode_steps) if args.profile else ""
        memory = ours.memory(engine)
    elapsed = time.perf_counter() - began
    measured = Measured(
        setup=setup,
        threads=threads,
        packed=ours.packed,
        max_len=max_len,
        prompts=prompts,
        step_times=step_times,
        step_cpu=step_cpu,
        e2e=e2e,
        e2e_cpu=e2e_cpu,
        outputs=outputs,
        base_outputs=base_outputs,
        memory=memory,
        peft_lora=peft.lora_bytes(),
        profile=profile,
        elapsed=elapsed,
        load_before=load_before,
        load_after=load(),
    )
    stats = stats_of(measured)
    figures = figures_of(measured, stats)
    print_report(measured, stats, figures)
    if args.cpu_gemm == "onednn":  # the sampler's default is what the targets are about
        record_figures(figures)
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
