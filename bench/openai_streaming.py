"""The OpenAI-compatible endpoint's streaming overhead: N concurrent streamed chat completions through the
gateway's /v1/chat/completions vs the same requests as N gRPC Sample streams straight to the sampler (the same
prompt token ids: the chat template rendered by the gateway, the same greedy parameters, so every side samples
the same tokens). Two HTTP clients: the unmodified openai SDK's AsyncOpenAI, and a plain httpx SSE reader (as
thin as the bench's gRPC client: json.loads per event), which separates the endpoint's cost from the SDK's own
parsing on the same cores. Same registry, trainer, sampler and gateway processes for all; the runs alternate
(a, b, c), (c, b, a), ...; medians of:

  wall time until the last stream ends, HTTP / gRPC, per HTTP client          (target <= 1.10)
  time to first token, median over requests, HTTP - gRPC                      (reported)
  CPU seconds per run of this client, the gateway and the sampler (server + engine processes)   (reported)

    .venv/bin/python bench/openai_streaming.py [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import math
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import httpx
import openai
import psutil
from openai.types.chat import ChatCompletionMessageParam
from results import record
from stack import aio_stub, alternate_sides, model_input
from streaming import FULL, QUICK, Run, Setup, over_grpc
from workload import FULL_SPEC, QUICK_SPEC, model_dir, spec_config

from opentinker.cli.launch import ServerProcess, opentinker_command, start_registry, start_sampler, start_trainer
from opentinker.v1 import sampler_pb2

KEY = "tml-bench-openai"
MAX_LEN = 256


def question(i: int) -> list[ChatCompletionMessageParam]:
    return [{"role": "user", "content": f"Question {i}: what is {i} plus {2 * i}? Answer step by step."}]


async def http_stream(
    client: openai.AsyncOpenAI, i: int, max_tokens: int, start: float
) -> tuple[float, float, list[int]]:
    first, tokens = math.nan, list[int]()
    chunks = await client.chat.completions.create(
        model="base",
        messages=question(i),
        max_tokens=max_tokens,
        temperature=0.0,
        stream=True,
        extra_body={"return_token_ids": True},
    )
    async for chunk in chunks:
        for choice in chunk.choices:
            new = (choice.model_extra or {}).get("token_ids") or []
            if new and math.isnan(first):
                first = time.monotonic()
            tokens.extend(new)
    return first - start, time.monotonic(), tokens


async def plain_stream(
    http: httpx.AsyncClient, i: int, max_tokens: int, start: float
) -> tuple[float, float, list[int]]:
    first, tokens = math.nan, list[int]()
    body = {
        "model": "base",
        "messages": question(i),
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
        "return_token_ids": True,
    }
    async with http.stream("POST", "/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for choice in json.loads(line[6:])["choices"]:
                new = choice.get("token_ids") or []
                if new and math.isnan(first):
                    first = time.monotonic()
                tokens.extend(new)
    return first - start, time.monotonic(), tokens


Streamed = Callable[[int, int, float], Awaitable[tuple[float, float, list[int]]]]  # (i, max_tokens, start)


async def over_http(one: Streamed, setup: Setup) -> Run:
    start = time.monotonic()
    done = await asyncio.gather(*(one(i, setup.max_tokens, start) for i in range(setup.requests)))
    return Run(
        max(end for _, end, _ in done) - start,
        statistics.median(t for t, _, _ in done),
        sum(len(tokens) for _, _, tokens in done),
    )


async def prompts(client: openai.AsyncOpenAI, setup: Setup) -> list[list[int]]:
    """Each request's prompt token ids as the gateway renders them (a 1-token completion answers them)."""
    out = []
    for i in range(setup.requests):
        reply = await client.chat.completions.create(
            model="base",
            messages=question(i),
            max_tokens=1,
            extra_body={"return_token_ids": True},
        )
        out.append(list((reply.model_extra or {})["prompt_token_ids"]))
    return out


SIDES = {"sdk": "/v1 SSE, openai SDK", "plain": "/v1 SSE, plain httpx", "grpc": "gRPC Sample streams"}
Cpu = dict[str, float]  # CPU seconds (user + system, all threads) per process group: client, gateway, sampler


def cpu_now(gateway: ServerProcess, sampler: ServerProcess) -> Cpu:
    def seconds(*processes: psutil.Process) -> float:
        return float(sum(t.user + t.system for t in (p.cpu_times() for p in processes)))

    server = psutil.Process(sampler.process.pid)
    return {
        "client": seconds(psutil.Process()),
        "gateway": seconds(psutil.Process(gateway.process.pid)),
        "sampler": seconds(server, *server.children(recursive=True)),
    }


async def alternate(
    gateway: ServerProcess, sampler: ServerProcess, setup: Setup
) -> tuple[dict[str, list[Run]], dict[str, list[Cpu]], bool]:
    client = openai.AsyncOpenAI(base_url=f"http://{gateway.address}/v1", api_key=KEY, max_retries=0, timeout=600)
    http = httpx.AsyncClient(
        base_url=f"http://{gateway.address}",
        headers={"Authorization": f"Bearer {KEY}"},
        timeout=600,
        limits=httpx.Limits(max_connections=setup.requests),
    )
    channel, stub = aio_stub(sampler.address)
    ids = await prompts(client, setup)
    params = sampler_pb2.SamplingParams(temperature=0.0, max_tokens=setup.max_tokens, logprobs=True)
    requests = [sampler_pb2.SampleRequest(model="base", prompt=model_input(p), sampling_params=params) for p in ids]

    cpu: dict[str, list[Cpu]] = {side: [] for side in SIDES}

    async def measured(side: str, run: Awaitable[Run]) -> Run:
        before = cpu_now(gateway, sampler)
        done = await run
        after = cpu_now(gateway, sampler)
        cpu[side].append({k: after[k] - before[k] for k in after})
        return done

    async def sdk_side() -> Run:
        return await measured("sdk", over_http(functools.partial(http_stream, client), setup))

    async def plain_side() -> Run:
        return await measured("plain", over_http(functools.partial(plain_stream, http), setup))

    async def grpc_side() -> Run:
        return await measured("grpc", over_grpc(stub, requests))

    sides = {"sdk": sdk_side, "plain": plain_side, "grpc": grpc_side}
    for side in sides.values():
        await side()  # warm-up: connections, tokenizer, first-call allocations
    cpu = {side: [] for side in SIDES}
    runs = await alternate_sides(sides, setup.reps)
    same = all(len({r.tokens for r in rep}) == 1 for rep in zip(*runs.values(), strict=True))
    await client.close()
    await http.aclose()
    await channel.close()
    return runs, cpu, same


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small model, fewer requests and repetitions")
    args = parser.parse_args()
    setup, spec = (QUICK, QUICK_SPEC) if args.quick else (FULL, FULL_SPEC)
    began = time.perf_counter()
    model = model_dir(spec)
    n = setup.requests
    with tempfile.TemporaryDirectory(prefix="ot-bench-openai-") as tmp:
        work = Path(tmp)
        servers: list[ServerProcess] = []
        try:
            registry = start_registry(work / "registry")
            servers.append(registry)
            servers.append(trainer := start_trainer(work / "trainer", model, registry))
            sampler_flags = [
                "--max-seqs",
                str(n),
                "--max-seqs-per-tenant",
                "0",
                "--max-len",
                str(MAX_LEN),
                "--metrics-port",
                "-1",
            ]
            servers.append(sampler := start_sampler(work / "sampler", model, registry, *sampler_flags))
            (work / "keys.json").write_text(json.dumps({"keys": [{"key": KEY, "tenant": "bench"}]}))
            gateway_args = opentinker_command(
                "gateway",
                "serve",
                "--trainer",
                trainer.address,
                "--sampler",
                sampler.address,
                "--registry",
                registry.address,
                "--keys-file",
                str(work / "keys.json"),
                "--port",
                "0",
            )
            servers.append(gateway := ServerProcess(gateway_args, work / "gateway", timeout=120))
            runs, cpu, same = asyncio.run(alternate(gateway, sampler, setup))
        finally:
            for server in reversed(servers):
                server.terminate()
    wall = {side: statistics.median(r.wall for r in rs) for side, rs in runs.items()}
    ttft = {side: statistics.median(r.ttft for r in rs) for side, rs in runs.items()}
    config = {
        **spec_config(spec),
        "requests": f"{n} concurrent chat completions on the base model, greedy, {setup.max_tokens} tokens max",
        "sampler": f"--max-seqs {n} --max-len {MAX_LEN}",
        "reps": setup.reps,
        "same_token_counts": same,
    }
    print(f"OpenAI-compatible streaming ({config['model']})")
    print(f"  {config['requests']}; {setup.reps} alternating reps, medians")
    for side, label in SIDES.items():
        walls = ", ".join(f"{r.wall:.2f}" for r in runs[side])
        medians = {k: statistics.median(c[k] for c in cpu[side]) for k in cpu[side][0]}
        print(
            f"    {label:<22} wall {wall[side]:.3f} s (runs {walls}); median first token "
            f"{ttft[side] * 1000:.1f} ms; tokens {sorted({r.tokens for r in runs[side]})}"
        )
        print("      CPU s per run: " + ", ".join(f"{k} {v:.2f}" for k, v in medians.items()))
    for side, client in (("sdk", "openai SDK client"), ("plain", "plain httpx SSE client")):
        ratio, overhead_ms = wall[side] / wall["grpc"], (ttft[side] - ttft["grpc"]) * 1000
        record(f"OpenAI streaming wall, HTTP SSE ({client}) / gRPC", ratio, target=1.10, comparison="<=", config=config)
        record(f"OpenAI streaming time to first token overhead ({client})", overhead_ms, unit="ms", config=config)
        print(f"  {client}: wall HTTP / gRPC {ratio:.3f} (target <= 1.10); first-token overhead {overhead_ms:+.1f} ms")
    print(f"  total {time.perf_counter() - began:.0f} s")


if __name__ == "__main__":
    main()
