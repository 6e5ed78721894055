"""Structured outputs (docs/structured.md) through a real sampler process on the tiny random-weight model, base
weights, temperature 1 with a seed per sample, 1 torch thread, no prefix cache (every arm computes its prompts):

  decode throughput, half the batch constrained by a 10-field JSON schema / all free   (target >= 0.9)
      same batch, prompts, seeds and max_tokens; the arms alternate (free, half), (half, free), ...; the median of
      each repetition's ratio (its two runs are neighbours in time). Also the sampler's CPU seconds per token
      (server and engine processes: load-insensitive, and it counts the mask thread's work, which the wall hides
      where a core is free).
      max_tokens is the shortest constrained output of a calibration round (the same batch, uncut), so the
      constrained samples decode about as many tokens as the free ones instead of ending early; tokens decoded
      per arm and how the samples ended are printed beside
  grammar compile time p50 of that schema, cold and cached:
      in-process: opentinker.sampler_server.constraint.Grammars.matcher, each cold schema a fresh cache key (the
      schema with another "description": the same grammar to build, another canonical form), the cached one the
      same schema again; also the first mask after a cold compile and the mask of one row per decode step
      server: time to first token of a cold schema minus that of the cached schema (the edge's check and the
      engine process's own compile, both in the path of a cold request)
  time to first token, cached grammar / no constraint, p50 and p90                        (target <= 1.1)
      one request at a time on an idle sampler, 1 token each, the three kinds (free, cached, cold) in rotating
      order

    .venv/bin/python bench/structured.py [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import math
import random
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import psutil
import torch
from results import record
from stack import aio_stub, alternate_sides, model_input, start_stack
from workload import FULL_SPEC, QUICK_SPEC, ModelSpec, model_dir, percentile, prompts, spec_config

from opentinker.cli.launch import ServerProcess
from opentinker.v1 import sampler_pb2, sampler_pb2_grpc

MAX_LEN = 1024
SEED = 1000
CATEGORIES = ("billing", "bug", "feature_request", "account", "other")
TIERS = ("free", "pro", "enterprise")
# A support ticket as a triage agent fills it in: a nested object, enums, bounded integers and strings, a number,
# a boolean, an array, a pattern and a nullable field; every field required, nothing else allowed.
PROPERTIES: dict[str, dict[str, object]] = {
    "ticket_id": {"type": "integer", "minimum": 1, "maximum": 999999},
    "summary": {"type": "string", "minLength": 8, "maxLength": 80},
    "category": {"enum": list(CATEGORIES)},
    "priority": {"type": "integer", "minimum": 1, "maximum": 5},
    "sentiment": {"type": "number", "minimum": -1, "maximum": 1},
    "needs_human": {"type": "boolean"},
    "customer": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 40},
            "tier": {"enum": list(TIERS)},
            "account_age_days": {"type": "integer", "minimum": 0},
        },
        "required": ["name", "tier", "account_age_days"],
        "additionalProperties": False,
    },
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 16}, "minItems": 1, "maxItems": 4},
    "language": {"type": "string", "pattern": "^[a-z]{2}$"},
    "follow_up_days": {"type": ["integer", "null"], "minimum": 0, "maximum": 30},
}
SCHEMA: dict[str, object] = {
    "title": "SupportTicket",
    "description": "A support ticket, triaged",
    "type": "object",
    "properties": PROPERTIES,
    "required": list(PROPERTIES),
    "additionalProperties": False,
}
SCHEMA_TEXT = json.dumps(SCHEMA)
FIELDS = frozenset(PROPERTIES)
KINDS = ("free", "cached", "cold")


@dataclass(frozen=True, slots=True)
class Setup:
    batch: int  # concurrent samples in the throughput arms; half of them constrained in the "half" arm
    reps: int  # alternating repetitions of each throughput arm
    first_tokens: int  # requests of each kind (free, cached, cold) for the time to first token
    compiles: int  # in-process cold compiles (and as many cached ones)
    walks: int  # in-process random walks through the grammar, for the per-step mask time
    prompt_tokens: int  # prompt length of the time-to-first-token requests


FULL = Setup(batch=32, reps=4, first_tokens=60, compiles=100, walks=16, prompt_tokens=64)
QUICK = Setup(batch=16, reps=6, first_tokens=40, compiles=30, walks=6, prompt_tokens=64)


def variant(label: str, i: int) -> str:
    """The schema with another description: a cache miss with the same grammar to build."""
    return json.dumps({**SCHEMA, "description": f"A support ticket, triaged ({label} {i})"})


def valid(text: str) -> bool:
    """A finished constrained output: JSON with exactly the schema's fields and a few of its bounds."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return False
    if not isinstance(value, dict) or set(value) != FIELDS:
        return False
    customer, priority = value["customer"], value["priority"]
    return (
        value["category"] in CATEGORIES
        and isinstance(priority, int)
        and 1 <= priority <= 5
        and isinstance(customer, dict)
        and customer.get("tier") in TIERS
        and isinstance(value["tags"], list)
        and 1 <= len(value["tags"]) <= 4
    )


# In-process: the sampler's own compiler and cache, on this process's thread


@dataclass(frozen=True, slots=True)
class Compiles:
    tokenizer_ms: float  # llguidance's view of the tokenizer, built once per process on first use
    cold_ms: list[float]  # Grammars.matcher of a schema not in the cache: canonical text -> grammar -> matcher
    cached_ms: list[float]  # Grammars.matcher of the cached schema: a deep copy of its matcher
    first_mask_ms: list[float]  # the first mask of each freshly compiled matcher (its lexer builds lazily)
    step_mask_us: list[float]  # one row's mask at each step of random walks through the grammar


def compile_in_process(model: Path, setup: Setup) -> Compiles:
    from opentinker.sampler_server.build import load_tokenizer
    from opentinker.sampler_server.constraint import Grammars, json_schema
    from opentinker.weights.model_config import load_config

    config = load_config(model)
    grammars = Grammars(load_tokenizer(model), config.vocab_size, config.eos_token_ids)
    words = (config.vocab_size + 31) // 32
    bitmask = torch.zeros(words, dtype=torch.int32)  # bit j of word w allows token 32w + j, as grammar_masks.py
    bits = torch.arange(32, dtype=torch.int32)
    started = time.perf_counter()
    _ = grammars.tokenizer  # built on first use: timed apart from the compiles
    tokenizer_ms = (time.perf_counter() - started) * 1000
    cold, first_mask = [], []
    for i in range(setup.compiles):
        constraint = json_schema(variant("in-process", i))
        started = time.perf_counter()
        matcher = grammars.matcher(constraint)
        cold.append((time.perf_counter() - started) * 1000)
        started = time.perf_counter()
        matcher.unsafe_compute_mask_ptr(bitmask.data_ptr(), words * 4)
        first_mask.append((time.perf_counter() - started) * 1000)
    schema = json_schema(SCHEMA_TEXT)
    grammars.matcher(schema)
    cached = []
    for _ in range(setup.compiles):
        started = time.perf_counter()
        grammars.matcher(schema)
        cached.append((time.perf_counter() - started) * 1000)
    steps: list[float] = []
    rng = random.Random(5)
    for _ in range(setup.walks):  # a random model's walk: any allowed token, uniformly
        matcher = grammars.matcher(schema)
        while not matcher.is_stopped() and len(steps) < 100_000:
            started = time.perf_counter()
            matcher.unsafe_compute_mask_ptr(bitmask.data_ptr(), words * 4)
            steps.append((time.perf_counter() - started) * 1e6)
            allowed = ((bitmask[:, None] >> bits) & 1).flatten()[: config.vocab_size].nonzero().flatten().tolist()
            if not matcher.consume_token(rng.choice(allowed)):
                raise RuntimeError(f"the grammar refused a token its own mask allowed: {matcher.get_error()}")
    return Compiles(tokenizer_ms, cold, cached, first_mask, steps)


# Through the server


@dataclass(frozen=True, slots=True)
class Sampled:
    """One Sample stream as the client saw it (monotonic seconds)."""

    start: float
    first: float
    end: float
    tokens: tuple[int, ...]
    text: str
    stop_reason: int  # sampler_pb2.StopReason


async def sample(stub: sampler_pb2_grpc.SamplerServiceStub, request: sampler_pb2.SampleRequest) -> Sampled:
    start, first = time.monotonic(), math.nan
    tokens: list[int] = []
    texts: list[str] = []
    stop = 0
    async for message in stub.Sample(request, timeout=600):
        if message.tokens and math.isnan(first):
            first = time.monotonic()
        tokens.extend(message.tokens)
        texts.append(message.text)
        stop = message.stop_reason or stop
    return Sampled(start, first, time.monotonic(), tuple(tokens), "".join(texts), stop)


def sample_request(prompt: list[int], seed: int, max_tokens: int, schema: str | None) -> sampler_pb2.SampleRequest:
    params = sampler_pb2.SamplingParams(temperature=1.0, seed=seed, max_tokens=max_tokens)
    request = sampler_pb2.SampleRequest(model="base", prompt=model_input(prompt), sampling_params=params)
    if schema is not None:
        request.constraint.json_schema = schema
    return request


@dataclass(frozen=True, slots=True)
class BatchRun:
    wall: float  # first submission to the last token
    cpu: float  # CPU seconds of the sampler's processes (server and engine, every thread) over the run
    samples: tuple[Sampled, ...]

    @property
    def tokens(self) -> int:
        return sum(len(s.tokens) for s in self.samples)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall


def constrained_row(row: int, half: bool) -> bool:
    return half and row % 2 == 1  # every other row: the constrained and free rows interleave in the batch


def cpu_seconds(server: psutil.Process) -> float:
    """CPU seconds (user + system, all threads) of the sampler's server process and its engine process."""
    times = [p.cpu_times() for p in (server, *server.children(recursive=True))]
    return float(sum(t.user + t.system for t in times))


async def run_batch(
    stub: sampler_pb2_grpc.SamplerServiceStub,
    server: psutil.Process,
    batch_prompts: list[list[int]],
    max_tokens: int,
    half: bool,
) -> BatchRun:
    requests = [
        sample_request(p, SEED + row, max_tokens, SCHEMA_TEXT if constrained_row(row, half) else None)
        for row, p in enumerate(batch_prompts)
    ]
    cpu, start = cpu_seconds(server), time.monotonic()
    samples = await asyncio.gather(*(sample(stub, r) for r in requests))
    return BatchRun(max(s.end for s in samples) - start, cpu_seconds(server) - cpu, tuple(samples))


@dataclass(frozen=True, slots=True)
class Served:
    calibration: BatchRun  # the half arm uncut: how long the constrained outputs are, and whether they validate
    max_tokens: int
    runs: dict[str, list[BatchRun]]  # "free", "half" -> one run per repetition
    first_token: dict[str, list[float]]  # kind -> seconds to the first token, one per request


async def serve_figures(sampler: ServerProcess, setup: Setup, spec: ModelSpec) -> Served:
    channel, stub = aio_stub(sampler.address)
    server = psutil.Process(sampler.process.pid)
    try:
        batch_prompts = prompts(setup.batch, spec.vocab_size, seed=7)
        await run_batch(stub, server, batch_prompts, 8, half=False)  # warm-up: the batch shape, first allocations
        calibration = await run_batch(stub, server, batch_prompts, MAX_LEN - 64, half=True)  # compiles the schema
        lengths = [len(s.tokens) for row, s in enumerate(calibration.samples) if constrained_row(row, True)]
        max_tokens = min(lengths)

        async def free() -> BatchRun:
            return await run_batch(stub, server, batch_prompts, max_tokens, half=False)

        async def half() -> BatchRun:
            return await run_batch(stub, server, batch_prompts, max_tokens, half=True)

        runs = await alternate_sides({"free": free, "half": half}, setup.reps)
        first_token = await first_tokens(stub, setup, spec)
    finally:
        await channel.close()
    return Served(calibration, max_tokens, runs, first_token)


async def first_tokens(
    stub: sampler_pb2_grpc.SamplerServiceStub, setup: Setup, spec: ModelSpec
) -> dict[str, list[float]]:
    """One request at a time, 1 token each: free, the cached schema, a cold one (fresh description), the order
    rotating each round so that each kind takes each place alike; every request a prompt of its own."""
    n = setup.first_tokens
    lens = (setup.prompt_tokens, setup.prompt_tokens)
    fresh = iter(prompts(len(KINDS) * (n + 1), spec.vocab_size, lens=lens, seed=11))
    schemas: dict[str, Callable[[int], str | None]] = {
        "free": lambda i: None,
        "cached": lambda i: SCHEMA_TEXT,
        "cold": lambda i: variant("server", i),
    }
    for kind in KINDS:  # warm-up of each kind (the cold one compiles variant -1, never used again)
        await sample(stub, sample_request(next(fresh), SEED, 1, schemas[kind](-1)))
    seconds: dict[str, list[float]] = {kind: [] for kind in KINDS}
    for i in range(n):
        for kind in KINDS[i % 3 :] + KINDS[: i % 3]:
            done = await sample(stub, sample_request(next(fresh), SEED + i, 1, schemas[kind](i)))
            seconds[kind].append(done.first - done.start)
    return seconds


# Report


def stops(run: BatchRun, half: bool) -> str:
    """How the samples of a run ended, constrained and free apart: e.g. "free 8 length; constrained 8 length"."""
    names: dict[int, str] = {sampler_pb2.STOP_REASON_LENGTH: "length", sampler_pb2.STOP_REASON_STOP_TOKEN: "stop_token"}
    parts = []
    for label, constrained in (("free", False), ("constrained", True)):
        counts = collections.Counter(
            names.get(s.stop_reason, str(s.stop_reason))
            for row, s in enumerate(run.samples)
            if constrained_row(row, half) == constrained
        )
        if counts:
            parts.append(f"{label} " + ", ".join(f"{n} {reason}" for reason, n in sorted(counts.items())))
    return "; ".join(parts)


def report(setup: Setup, spec: ModelSpec, compiles: Compiles, served: Served, seconds: float) -> None:
    runs = served.runs
    throughput = {arm: statistics.median(r.tokens_per_s for r in rs) for arm, rs in runs.items()}
    tokens = {arm: sorted({r.tokens for r in rs}) for arm, rs in runs.items()}
    # Each repetition's two runs are neighbours in time: their ratio cancels most of the machine's drift.
    pairs = [h.tokens_per_s / f.tokens_per_s for f, h in zip(runs["free"], runs["half"], strict=True)]
    ratio = statistics.median(pairs)
    cpu = {arm: statistics.median(r.cpu / r.tokens * 1000 for r in rs) for arm, rs in runs.items()}
    first, again = runs["free"][0].samples, runs["half"][0].samples
    free_rows = [row for row in range(setup.batch) if not constrained_row(row, True)]
    same_free = sum(first[row].tokens == again[row].tokens for row in free_rows)
    calibration = served.calibration
    lengths = sorted(len(s.tokens) for row, s in enumerate(calibration.samples) if constrained_row(row, True))
    finished = [s for row, s in enumerate(calibration.samples) if constrained_row(row, True)]
    validated = sum(s.stop_reason == sampler_pb2.STOP_REASON_STOP_TOKEN and valid(s.text) for s in finished)
    ttft = {kind: (percentile(v, 50), percentile(v, 90)) for kind, v in served.first_token.items()}
    ttft_p50 = ttft["cached"][0] / ttft["free"][0]
    ttft_p90 = ttft["cached"][1] / ttft["free"][1]
    server_compile_ms = (ttft["cold"][0] - ttft["cached"][0]) * 1000
    cold_p50, cached_p50 = percentile(compiles.cold_ms, 50), percentile(compiles.cached_ms, 50)
    step_us = statistics.fmean(compiles.step_mask_us)
    steps = statistics.median(r.wall for r in runs["free"]) / served.max_tokens
    config = {
        **spec_config(spec),
        "schema": "10 fields (nested object, 2 enums, bounded integers and strings, number, boolean, array, "
        "pattern, nullable), all required, additionalProperties false",
        "throughput": f"{setup.batch} samples, every other one constrained in the half arm, temperature 1 seeded, "
        f"max_tokens {served.max_tokens} (the shortest constrained output uncut: {lengths[0]}..{lengths[-1]})",
        "sampler": f"1 torch thread, engine process, --max-seqs {setup.batch} --max-len {MAX_LEN} --no-prefix-cache",
        "reps": setup.reps,
        "tokens_free": ", ".join(map(str, tokens["free"])),
        "tokens_half": ", ".join(map(str, tokens["half"])),
        "free_rows_identical": f"{same_free}/{len(free_rows)}",
        "first_token_requests": f"{setup.first_tokens} per kind, {setup.prompt_tokens}-token prompts, 1 token",
        "compiles": setup.compiles,
    }
    record("Structured decode throughput, half constrained / free", ratio, target=0.9, config=config)
    record("Structured sampler CPU per token, half constrained / free", cpu["half"] / cpu["free"], config=config)
    record("Structured TTFT p50, cached grammar / none", ttft_p50, target=1.1, comparison="<=", config=config)
    record("Structured TTFT p90, cached grammar / none", ttft_p90, target=1.1, comparison="<=", config=config)
    record("Structured compile p50, cold (in-process)", cold_p50, unit="ms", config=config)
    record("Structured compile p50, cached (in-process)", cached_p50 * 1000, unit="us", config=config)
    record("Structured compile, cold TTFT - cached TTFT p50 (server)", server_compile_ms, unit="ms", config=config)
    record("Structured mask per row per step (in-process)", step_us, unit="us", config=config)

    print(f"Structured outputs ({config['model']}; base weights; {time.strftime('%Y-%m-%d')})")
    print(f"  schema: {config['schema']}")
    print(
        f"  calibration (half arm uncut): constrained lengths {lengths[0]}..{lengths[-1]} tokens (median "
        f"{statistics.median(lengths):.0f}); {validated}/{len(finished)} ended where the grammar ended and validate"
    )
    print(f"  decode throughput: {config['throughput']}; {setup.reps} alternating reps, medians")
    for arm, label in (("free", "all free"), ("half", "half constrained")):
        walls = ", ".join(f"{r.wall:.2f}" for r in runs[arm])
        print(
            f"    {label:<17} {throughput[arm]:7.1f} tokens/s (runs {walls} s), sampler CPU {cpu[arm]:.1f} s per "
            f"1000 tokens; tokens decoded {', '.join(map(str, tokens[arm]))}; {stops(runs[arm][0], arm == 'half')}"
        )
    print(
        f"    half / free {ratio:.3f} (median of the reps' ratios {', '.join(f'{x:.3f}' for x in pairs)}; target "
        f">= 0.9); sampler CPU per token half / free {cpu['half'] / cpu['free']:.3f}; free rows token-identical "
        f"in both arms {same_free}/{len(free_rows)}"
    )
    print("  grammar compile of the schema:")
    print(
        f"    in-process Grammars.matcher: cold p50 {cold_p50:.1f} ms (p90 "
        f"{percentile(compiles.cold_ms, 90):.1f}, {setup.compiles} compiles), cached p50 {cached_p50 * 1000:.0f} us; "
        f"first mask after a cold compile p50 {percentile(compiles.first_mask_ms, 50):.2f} ms; llguidance "
        f"tokenizer built once per process {compiles.tokenizer_ms:.0f} ms"
    )
    print(
        f"    server: cold TTFT - cached TTFT, p50 {server_compile_ms:.1f} ms (the edge's check and the engine "
        "process's own compile)"
    )
    print(
        f"    mask of one row per decode step, random walks: mean {step_us:.0f} us, p50 "
        f"{percentile(compiles.step_mask_us, 50):.0f} us, p90 {percentile(compiles.step_mask_us, 90):.0f} us "
        f"({len(compiles.step_mask_us)} steps); {setup.batch // 2} rows ~ {setup.batch // 2 * step_us / 1000:.2f} "
        f"ms of a {steps * 1000:.1f} ms free decode step, on the mask thread while the forward runs"
    )
    print(f"  time to first token ({config['first_token_requests']}, one at a time):")
    for kind in KINDS:
        p50, p90 = ttft[kind]
        print(f"    {kind:<7} p50 {p50 * 1000:6.1f} ms  p90 {p90 * 1000:6.1f} ms")
    print(f"    cached / free: p50 {ttft_p50:.3f}, p90 {ttft_p90:.3f} (target <= 1.1)")
    print(f"  total {seconds:.0f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small model, smaller batch, fewer requests")
    args = parser.parse_args()
    setup, spec = (QUICK, QUICK_SPEC) if args.quick else (FULL, FULL_SPEC)
    began = time.perf_counter()
    model = model_dir(spec)
    torch.set_num_threads(1)
    compiles = compile_in_process(model, setup)  # before the sampler starts: an idle machine
    flags = [
        "--max-slots",
        "2",
        "--max-rank",
        "16",
        "--max-seqs",
        str(setup.batch),
        "--max-seqs-per-tenant",
        "0",
        "--max-len",
        str(MAX_LEN),
        "--no-prefix-cache",
    ]  # one tenant: the whole batch
    with tempfile.TemporaryDirectory(prefix="ot-bench-structured-") as tmp:
        stack = start_stack(Path(tmp), model, {"sampler": flags})
        try:
            served = asyncio.run(serve_figures(stack.samplers["sampler"], setup, spec))
        finally:
            stack.stop()
    report(setup, spec, compiles, served, time.perf_counter() - began)


if __name__ == "__main__":
    main()
