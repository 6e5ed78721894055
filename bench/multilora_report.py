"""The figures of bench/sampler_multilora.py: the statistics of its raw timings, its --json figures, the printed
report and the figures it records into bench/results.json (results.py)."""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from peft_reference import agreement
from results import record
from workload import ALPHA, RANK, TARGETS

if TYPE_CHECKING:
    from sampler_multilora import Setup


@dataclass(frozen=True, slots=True)
class Measured:
    """What one run measured, raw."""

    setup: Setup
    threads: int  # torch threads
    packed: bool  # our base matmuls packed for oneDNN
    max_len: int  # KV cache positions per sequence
    prompts: list[list[int]]
    step_times: dict[str, list[float]]  # decode configuration -> wall seconds of each decode step
    step_cpu: dict[str, list[float]]  # the same steps' process CPU seconds
    e2e: dict[str, list[float]]  # end-to-end side -> wall seconds of each run
    e2e_cpu: dict[str, list[float]]  # the same runs' process CPU seconds
    outputs: dict[str, list[list[int]]]  # end-to-end side -> the greedy tokens of its last run
    base_outputs: list[list[int]]  # ours on the base model (slot 0), same requests
    memory: dict[str, int]  # OurSampler.memory
    peft_lora: int  # bytes of peft's LoRA parameters
    profile: str  # --profile's cProfile report, or ""
    elapsed: float  # seconds of the whole run
    load_before: str
    load_after: str


@dataclass(frozen=True, slots=True)
class Stats:
    """The medians and comparisons the figures and the report are made of, unrounded."""

    step_s: dict[str, float]  # median decode step, wall
    cpu_s: dict[str, float]  # median decode step, process CPU
    tps: dict[str, float]  # decode tokens/s by the median step
    quartiles: dict[str, list[float]]  # of the decode steps, wall
    wall: dict[str, float]  # median end-to-end run
    wall_cpu: dict[str, float]
    agree_mixed: tuple[int, float]  # agreement() of peft mixed with ours
    agree_sequential: tuple[int, float]
    changed: int  # requests whose tokens the adapters change against the base model
    mean_prompt: float
    lora_step_bytes: int  # every projection's A and B of every distinct adapter


def stats_of(m: Measured) -> Stats:
    batch = m.setup.adapters
    step_s = {name: statistics.median(values) for name, values in m.step_times.items()}
    return Stats(
        step_s=step_s,
        cpu_s={name: statistics.median(values) for name, values in m.step_cpu.items()},
        tps={name: batch / seconds for name, seconds in step_s.items()},
        quartiles={name: statistics.quantiles(values, n=4) for name, values in m.step_times.items()},
        wall={name: statistics.median(values) for name, values in m.e2e.items()},
        wall_cpu={name: statistics.median(values) for name, values in m.e2e_cpu.items()},
        agree_mixed=agreement(m.outputs["ours"], m.outputs["peft_mixed"]),
        agree_sequential=agreement(m.outputs["ours"], m.outputs["peft_sequential"]),
        changed=sum(a != b for a, b in zip(m.outputs["ours"], m.base_outputs, strict=True)),
        mean_prompt=sum(map(len, m.prompts)) / len(m.prompts),
        lora_step_bytes=batch * m.memory["slot_bytes"],
    )


def figures_of(m: Measured, s: Stats) -> dict[str, Any]:
    """The figures as --json writes them."""
    setup, spec, threads = m.setup, m.setup.spec, m.threads
    return {
        "model": f"{spec.arch} hidden {spec.hidden_size}, intermediate {spec.intermediate_size}, "
        f"{spec.num_hidden_layers} layers, {spec.num_attention_heads}/{spec.num_key_value_heads} heads, "
        f"vocab {spec.vocab_size}, float32, CPU, {threads} torch thread{'s' if threads > 1 else ''}, "
        f"base matmuls {'oneDNN packed' if m.packed else 'torch dense'}",
        "lora": f"rank {RANK}, alpha {ALPHA}, {len(TARGETS)} projections x {spec.num_hidden_layers} layers",
        "adapters": setup.adapters,
        "decode_batch": setup.adapters,
        "decode_steps_per_rep": setup.decode_steps,
        "decode_reps": setup.decode_reps,
        "e2e_reps": len(m.e2e["ours"]),
        "new_tokens": setup.new_tokens,
        "mean_prompt_tokens": round(s.mean_prompt, 1),
        "decode_tokens_per_s": {name: round(v, 1) for name, v in s.tps.items()},
        "decode_step_ms_quartiles": {name: [round(q * 1000, 2) for q in qs] for name, qs in s.quartiles.items()},
        "decode_step_cpu_ms": {name: round(v * 1000, 2) for name, v in s.cpu_s.items()},
        "p1_mixed_over_single": round(s.tps["mixed"] / s.tps["single"], 3),
        "p1_target": 0.95,
        "p1_cpu_time": round(s.cpu_s["single"] / s.cpu_s["mixed"], 3),
        "p3_single_over_base": round(s.tps["single"] / s.tps["base"], 3),
        "p3_target": 0.90,
        "p3_cpu_time": round(s.cpu_s["base"] / s.cpu_s["single"], 3),
        "e2e_seconds": {name: round(v, 3) for name, v in s.wall.items()},
        "e2e_seconds_all": {name: [round(v, 3) for v in vs] for name, vs in m.e2e.items()},
        "e2e_cpu_seconds": {name: round(v, 3) for name, v in s.wall_cpu.items()},
        "p2a_peft_mixed_over_ours": round(s.wall["peft_mixed"] / s.wall["ours"], 2),
        "p2a_target": 3.0,
        "p2b_peft_sequential_over_ours": round(s.wall["peft_sequential"] / s.wall["ours"], 2),
        "p2b_target": 10.0,
        "p2a_cpu_time": round(s.wall_cpu["peft_mixed"] / s.wall_cpu["ours"], 2),
        "p2b_cpu_time": round(s.wall_cpu["peft_sequential"] / s.wall_cpu["ours"], 2),
        "agree_peft_mixed_requests": s.agree_mixed[0],
        "agree_peft_mixed_prefix_fraction": round(s.agree_mixed[1], 3),
        "agree_peft_sequential_requests": s.agree_sequential[0],
        "agree_peft_sequential_prefix_fraction": round(s.agree_sequential[1], 3),
        "adapters_change_output_requests": s.changed,
        **m.memory,
        "kv_cache_positions": m.max_len,
        "lora_bytes_read_per_mixed_step": s.lora_step_bytes,
        "peft_lora_bytes": m.peft_lora,
        "load_average_before_after": [m.load_before, m.load_after],
        "total_seconds": round(m.elapsed, 1),
    }


def print_report(m: Measured, s: Stats, figures: dict[str, Any]) -> None:
    setup, batch, memory = m.setup, m.setup.adapters, m.memory
    (same_mixed, prefix_mixed), (same_seq, prefix_seq) = s.agree_mixed, s.agree_sequential
    mib = 2**20
    print(f"sampler multi-LoRA ({figures['model']})")
    print(
        f"  LoRA {figures['lora']}; {batch} adapters, one request each; prompts {s.mean_prompt:.1f} tokens on average"
    )
    print(
        f"  decode only: {batch} rows, {setup.decode_reps} reps x {setup.decode_steps} steps, the 3 configurations "
        "interleaved step by step; median step (interquartile range) [median process CPU time]"
    )
    labels = {
        "mixed": f"{batch} rows on {batch} adapters",
        "single": f"{batch} rows on 1 adapter",
        "base": f"{batch} rows, base (slot 0)",
    }
    for name, label in labels.items():
        q1, _, q3 = s.quartiles[name]
        print(
            f"    {label:<28} {s.tps[name]:8.1f} tokens/s   {s.step_s[name] * 1000:7.2f} ms/step "
            f"({q1 * 1000:.2f}-{q3 * 1000:.2f}) [{s.cpu_s[name] * 1000:.2f} ms cpu]"
        )
    print(
        f"  P1 mixed / single adapter     {figures['p1_mixed_over_single']:6.3f}   (target >= 0.95; "
        f"by CPU time {figures['p1_cpu_time']:.3f})"
    )
    print(
        f"  P3 single adapter / base      {figures['p3_single_over_base']:6.3f}   (target >= 0.90; "
        f"by CPU time {figures['p3_cpu_time']:.3f})"
    )
    print(f"  end to end: {batch} requests x {setup.new_tokens} greedy tokens, {len(m.e2e['ours'])} alternating reps")
    for name, label in (
        ("ours", "ours, one mixed batch"),
        ("peft_mixed", "peft, generate(adapter_names)"),
        ("peft_sequential", f"peft, {batch} x set_adapter+gen"),
    ):
        runs = ", ".join(f"{v:.2f}" for v in m.e2e[name])
        print(f"    {label:<30} {s.wall[name]:8.3f} s median   (runs: {runs}) [{s.wall_cpu[name]:.3f} s cpu]")
    print(
        f"  P2a peft mixed / ours         {figures['p2a_peft_mixed_over_ours']:6.2f}   (target >= 3; "
        f"by CPU time {figures['p2a_cpu_time']:.2f})"
    )
    print(
        f"  P2b peft sequential / ours    {figures['p2b_peft_sequential_over_ours']:6.2f}   (target >= 10; "
        f"by CPU time {figures['p2b_cpu_time']:.2f})"
    )
    print(
        f"  greedy tokens equal to ours (not asserted; near-ties may flip): peft mixed {same_mixed}/{batch} requests "
        f"({prefix_mixed:.1%} of tokens before a first difference), peft sequential {same_seq}/{batch} "
        f"({prefix_seq:.1%}); adapters change the output of {s.changed}/{batch} requests vs the base model"
    )
    print(
        f"  memory: slot pool {memory['slot_pool_bytes'] / mib:.1f} MiB ({memory['slots']} slots + slot 0 at "
        f"{memory['slot_bytes'] / mib:.2f} MiB, r_max {RANK}; peft's LoRA params {m.peft_lora / mib:.1f}"
        f" MiB); KV cache {memory['kv_cache_bytes'] / mib:.1f} MiB per engine ({batch + 1} slots x {m.max_len} "
        f"positions); base weights {memory['base_weights_bytes'] / mib:.1f} MiB"
    )
    print(
        f"  weights read per decode step: base {memory['base_weights_bytes'] / mib:.1f} MiB, plus LoRA "
        f"{s.lora_step_bytes / mib:.1f} MiB with {batch} distinct adapters "
        f"({s.lora_step_bytes / memory['base_weights_bytes']:.0%} of the base; one adapter: "
        f"{memory['slot_bytes'] / mib:.1f} MiB); one row per adapter reuses nothing, so that part is memory-bound"
    )
    reduced = (
        f"; end-to-end reps cut to {len(m.e2e['ours'])} of {setup.e2e_reps} by the {setup.budget_s:.0f} s budget"
        if len(m.e2e["ours"]) < setup.e2e_reps
        else ""
    )
    print(f"  total {m.elapsed:.0f} s; load average before {m.load_before}, after {m.load_after}{reduced}")
    if m.profile:
        print("\ncProfile of mixed-adapter decode steps (by own time):")
        print(m.profile)


def record_figures(figures: dict[str, Any]) -> None:
    """P1, P2 and P3 into bench/results.json (results.py), with the configuration they were measured in."""
    keys = ("model", "lora", "adapters", "decode_steps_per_rep", "decode_reps", "new_tokens", "e2e_reps")
    config = {key: figures[key] for key in keys}
    agree = f"{figures['agree_peft_mixed_requests']}/{figures['adapters']}"
    record(
        "P1 mixed-adapter decode tokens/s, distinct adapters / one adapter",
        figures["p1_mixed_over_single"],
        target=0.95,
        config={**config, "by_cpu_time": figures["p1_cpu_time"]},
    )
    record(
        "P2a peft generate(adapter_names) wall / ours",
        figures["p2a_peft_mixed_over_ours"],
        target=3.0,
        config={**config, "by_cpu_time": figures["p2a_cpu_time"], "greedy_tokens_equal": agree},
    )
    record(
        "P2b peft one adapter at a time wall / ours",
        figures["p2b_peft_sequential_over_ours"],
        target=10.0,
        config={**config, "by_cpu_time": figures["p2b_cpu_time"]},
    )
    record(
        "P3 one adapter / base model decode tokens/s",
        figures["p3_single_over_base"],
        target=0.90,
        config={**config, "by_cpu_time": figures["p3_cpu_time"]},
    )
