"""The prefix cache on a multi-turn agent workload, through real sampler server processes: C concurrent
conversations x T turns on A adapters (conversation c on adapter c mod A), one shared system prompt, each turn
re-sending the whole conversation so far plus ~100 new observation tokens and generating 32 (greedy). Two
samplers run side by side, one with `--no-prefix-cache`; the workload runs on each in turn, alternating which
goes first, with fresh tokens every repetition (so no repetition finds an earlier one's blocks). Reported,
cache on / cache off (medians over repetitions):

  prompt tokens computed (GetStats' prompt_tokens_computed over the run)          target <= 0.2x
  time to first token, p50 over every turn's request                              target <= 0.35x
  throughput: generated tokens / wall time of the whole workload                  target >= 2x

and whether both sides generated the same tokens (they should: the cached K/V is the computed one). Also printed:
the paged KV cache's memory figure (bench/kv_concurrency.py).

    .venv/bin/python bench/prefix_cache.py [--quick] [--reps N]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import math
import random
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
import kv_concurrency
from results import record
from stack import Stream, aio_stub, publish, sample_request, start_stack
from workload import (
    FULL_SPEC,
    QUICK_SPEC,
    ModelSpec,
    linear_shapes,
    lora_weights,
    model_dir,
    peft_files,
    percentile,
    spec_config,
)

from opentinker.v1 import sampler_pb2, sampler_pb2_grpc

SIDES = ("on", "off")
FIELDS = ("wall", "ttft_p50", "throughput", "computed", "cached")


@dataclass(frozen=True, slots=True)
class Setup:
    conversations: int
    turns: int
    adapters: int
    system_tokens: int
    observation_tokens: int
    max_tokens: int
    reps: int


FULL = Setup(conversations=16, turns=6, adapters=4, system_tokens=512, observation_tokens=100, max_tokens=32, reps=3)
QUICK = Setup(conversations=16, turns=6, adapters=4, system_tokens=512, observation_tokens=100, max_tokens=32, reps=1)


@dataclass(frozen=True, slots=True)
class Run:
    wall: float
    ttft_p50: float
    generated: int
    computed: int  # prompt tokens the sampler ran through a prefill forward
    cached: int  # prompt tokens it found in the prefix cache
    outputs: tuple[tuple[int, ...], ...]

    @property
    def throughput(self) -> float:
        return self.generated / self.wall


def stats(address: str) -> sampler_pb2.GetStatsResponse:
    with grpc.insecure_channel(address) as channel:
        response: sampler_pb2.GetStatsResponse = sampler_pb2_grpc.SamplerServiceStub(channel).GetStats(
            sampler_pb2.GetStatsRequest(), timeout=30
        )
        return response


async def conversation(
    stub: sampler_pb2_grpc.SamplerServiceStub, model: str, system: list[int], turns: list[list[int]], setup: Setup
) -> list[tuple[Stream, list[int]]]:
    """One agent: every turn sends the whole history plus its new observation and appends the answer."""
    history, done = list(system), []
    for observation in turns:
        history += observation
        tokens: list[int] = []
        request = sample_request(model, history, setup.max_tokens)
        result = await stream_tokens(stub, request, tokens)
        if result.error:
            raise RuntimeError(result.error)
        history += tokens
        done.append((result, tokens))
    return done


async def stream_tokens(
    stub: sampler_pb2_grpc.SamplerServiceStub, request: sampler_pb2.SampleRequest, tokens: list[int]
) -> Stream:
    """stack.stream, keeping the tokens in `tokens` (the next turn's history holds them)."""
    result = Stream(start=time.monotonic())
    try:
        async for message in stub.Sample(request, timeout=600):
            if message.tokens and math.isnan(result.first):
                result.first = time.monotonic()
            result.tokens += len(message.tokens)
            tokens.extend(message.tokens)
    except grpc.aio.AioRpcError as exc:
        result.error = f"{exc.code().name}: {exc.details()}"
    result.end = time.monotonic()
    return result


def workload(setup: Setup, vocab: int, rep: int) -> tuple[list[int], list[list[list[int]]]]:
    """The system prompt and every conversation's observations, fresh for each repetition."""
    rng = random.Random(1000 + rep)
    system = [rng.randrange(3, vocab) for _ in range(setup.system_tokens)]
    observations = [
        [
            [rng.randrange(3, vocab) for _ in range(setup.observation_tokens + rng.randrange(-8, 9))]
            for _ in range(setup.turns)
        ]
        for _ in range(setup.conversations)
    ]
    return system, observations


def run(address: str, names: list[str], setup: Setup, vocab: int, rep: int) -> Run:
    system, observations = workload(setup, vocab, rep)
    before = stats(address)

    async def all_conversations() -> tuple[float, list[list[tuple[Stream, list[int]]]]]:
        channel, stub = aio_stub(address)
        try:
            start = time.monotonic()
            done = await asyncio.gather(
                *(
                    conversation(stub, names[c % len(names)], system, observations[c], setup)
                    for c in range(setup.conversations)
                )
            )
            return time.monotonic() - start, done
        finally:
            await channel.close()

    wall, done = asyncio.run(all_conversations())
    after = stats(address)
    streams = [s for turns in done for s, _ in turns]
    return Run(
        wall=wall,
        ttft_p50=percentile([s.first - s.start for s in streams], 50),
        generated=sum(s.tokens for s in streams),
        computed=after.prompt_tokens_computed - before.prompt_tokens_computed,
        cached=after.prompt_tokens_cached - before.prompt_tokens_cached,
        outputs=tuple(tuple(tokens) for turns in done for _, tokens in turns),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small model, one repetition")
    parser.add_argument("--reps", type=int, default=0, help="repetitions of each side (0: the setup's)")
    args = parser.parse_args()
    setup, spec = (QUICK, QUICK_SPEC) if args.quick else (FULL, FULL_SPEC)
    if args.reps:
        setup = dataclasses.replace(setup, reps=args.reps)
    began = time.perf_counter()
    memory = kv_concurrency.measure()
    longest = setup.system_tokens + setup.turns * (setup.observation_tokens + 8 + setup.max_tokens)
    flags = [
        "--max-slots",
        str(setup.adapters),
        "--max-rank",
        "16",
        "--max-seqs",
        str(setup.conversations),
        "--max-len",
        str(1 << (longest + 64).bit_length()),
        "--num-blocks",
        "4096",
    ]
    shapes = linear_shapes(spec)
    with tempfile.TemporaryDirectory(prefix="bench-prefix-cache-") as tmp:
        stack = start_stack(Path(tmp), model_dir(spec), {"on": flags, "off": [*flags, "--no-prefix-cache"]})
        try:
            names = [f"agent-{i}" for i in range(setup.adapters)]
            for i, name in enumerate(names):
                stack.client.create_adapter(name, rank=16, alpha=32)
                publish(stack, name, peft_files(lora_weights(shapes, seed=300 + i)))
            addresses = {side: stack.samplers[side].address for side in SIDES}
            for side in SIDES:  # warm-up: load the adapters, run each batch shape once
                run(
                    addresses[side],
                    names,
                    Setup(setup.adapters, 2, setup.adapters, 64, 16, 4, 1),
                    spec.vocab_size,
                    rep=-1,
                )
            runs: dict[str, list[Run]] = {side: [] for side in SIDES}
            for rep in range(setup.reps):
                for side in SIDES if rep % 2 == 0 else SIDES[::-1]:
                    runs[side].append(run(addresses[side], names, setup, spec.vocab_size, rep))
        finally:
            stack.stop()
    report(setup, spec, runs, memory, time.perf_counter() - began)


def report(
    setup: Setup, spec: ModelSpec, runs: dict[str, list[Run]], memory: kv_concurrency.Concurrency, seconds: float
) -> None:
    def med(side: str, field: str) -> float:
        return float(statistics.median(float(getattr(r, field)) for r in runs[side]))

    computed = med("on", "computed") / med("off", "computed")
    ttft = med("on", "ttft_p50") / med("off", "ttft_p50")
    throughput = med("on", "throughput") / med("off", "throughput")
    same = all(a.outputs == b.outputs for a, b in zip(runs["on"], runs["off"], strict=True))
    config = {
        **spec_config(spec),
        "workload": f"{setup.conversations} concurrent conversations x {setup.turns} turns on {setup.adapters} "
        f"adapters, {setup.system_tokens}-token shared system prompt, ~{setup.observation_tokens} observation "
        f"tokens per turn, {setup.max_tokens} generated (greedy)",
        "samplers": "two server processes, 1 torch thread each, --num-blocks 4096; one with --no-prefix-cache",
        "reps": setup.reps,
        "same_tokens": same,
        **{f"{side}_{field}": round(med(side, field), 4) for side in SIDES for field in FIELDS},
        "kv_concurrency": kv_concurrency.report(memory),
    }
    record("Prefix cache prompt tokens computed, on / off", computed, target=0.2, comparison="<=", config=config)
    record("Prefix cache time to first token p50, on / off", ttft, target=0.35, comparison="<=", config=config)
    record("Prefix cache throughput, on / off", throughput, target=2.0, comparison=">=", config=config)
    record(
        "Paged KV concurrent sequences, paged / slots",
        memory.ratio,
        target=3.0,
        comparison=">=",
        config={"measure": kv_concurrency.report(memory)},
    )
    print(f"Prefix cache ({config['model']}; {config['lora']})")
    print(f"  {config['workload']}; {setup.reps} alternating reps, medians")
    print(f"    {'':<10} {'computed':>10} {'cached':>10} {'TTFT p50':>10} {'tokens/s':>10} {'wall':>8}")
    for side in SIDES:
        computed_side, cached_side, first = med(side, "computed"), med(side, "cached"), med(side, "ttft_p50")
        print(
            f"    cache {side:<4} {computed_side:>10.0f} {cached_side:>10.0f} {first * 1000:>8.0f} ms "
            f"{med(side, 'throughput'):>10.1f} {med(side, 'wall'):>6.1f} s"
        )
    print(
        f"  on / off: prompt tokens computed {computed:.3f}x (target <= 0.2), TTFT p50 {ttft:.3f}x (<= 0.35), "
        f"throughput {throughput:.2f}x (>= 2); same tokens on both sides: {same}"
    )
    print(f"  memory: {kv_concurrency.report(memory)}")
    print(f"  total {seconds:.0f} s")


if __name__ == "__main__":
    main()
