"""P6 streaming overhead: the same N requests (request i on adapter i, greedy) sent (a) as N concurrent gRPC
Sample streams from this process to a sampler process and (b) submitted straight to the same engine code
(Engine.submit + the engine thread, no gRPC) in a helper process. Both sides: same model, adapters, flags
(max slots, seqs, length), tokenizer (the server detokenizes every token), 1 torch thread, and a process that
idles between runs (on a loaded machine the scheduler favours a process that just woke up over one that kept
running, so (b) does not run in this busy process). The runs alternate (a, b), (b, a), ...; medians of:

  wall time until the last request ends, (a) / (b)                              (target <= 1.05)
  time to first token, median over requests, (a) - (b)                         (reported)
  CPU time, (a) the sampler's processes + this client / (b) the engine's process (reported; load-insensitive)

    .venv/bin/python bench/streaming.py [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import multiprocessing
import statistics
import tempfile
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path

import grpc
import psutil
import torch
from inprocess import Client, Request, build_engine, fill_slots
from results import record
from stack import Stack, aio_stub, alternate_sides, publish, sample_request, start_stack, stream
from workload import (
    FULL_SPEC,
    QUICK_SPEC,
    ModelSpec,
    linear_shapes,
    lora_weights,
    model_dir,
    peft_files,
    prompts,
    spec_config,
)

from opentinker.cli.launch import ServerProcess
from opentinker.v1 import sampler_pb2, sampler_pb2_grpc

MAX_LEN = 128


@dataclass(frozen=True, slots=True)
class Setup:
    requests: int  # concurrent requests = distinct adapters
    max_tokens: int
    reps: int


FULL = Setup(requests=32, max_tokens=32, reps=5)
QUICK = Setup(requests=8, max_tokens=16, reps=3)


@dataclass(frozen=True, slots=True)
class Run:
    wall: float  # seconds from the first submission to the last token
    ttft: float  # median seconds to the first token
    tokens: int
    cpu: float = 0.0  # CPU seconds of every process involved (gRPC: the sampler and this client), all threads


def cpu_seconds(server: psutil.Process) -> float:
    """CPU seconds of this process plus the sampler's processes (server and engine; user + system, all threads)."""
    times = [p.cpu_times() for p in (psutil.Process(), server, *server.children(recursive=True))]
    return float(sum(t.user + t.system for t in times))


def register(stack: Stack, adapters: list[dict[str, bytes]]) -> list[str]:
    """Publishes adapter i as p6-ii version 1 and loads (pins) it in the sampler; returns the names."""
    names = [f"p6-{i:02d}" for i in range(len(adapters))]
    with grpc.insecure_channel(stack.samplers["sampler"].address) as channel:
        sampler = sampler_pb2_grpc.SamplerServiceStub(channel)
        for name, files in zip(names, adapters, strict=True):
            stack.client.create_adapter(name, rank=16, alpha=32)
            publish(stack, name, files)
            sampler.LoadAdapter(sampler_pb2.LoadAdapterRequest(reference=f"{name}@1", pin=True))
    return names


async def over_grpc(stub: sampler_pb2_grpc.SamplerServiceStub, requests: list[sampler_pb2.SampleRequest]) -> Run:
    start = time.monotonic()
    streams = await asyncio.gather(*(stream(stub, r) for r in requests))
    failed = [s.error for s in streams if s.error]
    if failed:
        raise RuntimeError(f"{len(failed)} streams failed: {failed[0]}")
    return Run(
        max(s.end for s in streams) - start,
        statistics.median(s.first - start for s in streams),
        sum(s.tokens for s in streams),
    )


def in_process(client: Client, requests: list[Request]) -> Run:
    start, cpu = time.monotonic(), time.process_time()
    timings = client.submit(requests)
    client.wait()
    failed = [t.error for t in timings if t.error]
    if failed:
        raise RuntimeError(f"{len(failed)} requests failed: {failed[0]}")
    return Run(
        max(t.end for t in timings) - start,
        statistics.median(t.first - start for t in timings),
        sum(t.tokens for t in timings),
        time.process_time() - cpu,
    )


def engine_process(conn: Connection, model: Path, spec: ModelSpec, prompts: list[list[int]], max_tokens: int) -> None:
    """The in-process side, in a helper process: builds the engine with adapter i in slot i + 1, then answers
    each "run" with a Run of the N requests, until "stop"."""
    torch.set_num_threads(1)
    n = len(prompts)
    engine, pool = build_engine(model, max_slots=n, max_seqs=n, max_len=MAX_LEN)
    slots = fill_slots(pool, [lora_weights(linear_shapes(spec), seed=i) for i in range(n)])
    engine.start()
    client = Client(engine, pool)
    requests = [Request(p, slot, max_tokens) for p, slot in zip(prompts, slots, strict=True)]
    conn.send("ready")
    while conn.recv() == "run":
        conn.send(dataclasses.astuple(in_process(client, requests)))
    engine.stop()


def run_in_helper(conn: Connection) -> Run:
    conn.send("run")
    return Run(*conn.recv())


async def alternate(
    server: ServerProcess, helper: Connection, grpc_requests: list[sampler_pb2.SampleRequest], reps: int
) -> dict[str, list[Run]]:
    channel, stub = aio_stub(server.address)
    process = psutil.Process(server.process.pid)

    async def grpc_side() -> Run:
        cpu = cpu_seconds(process)
        run = await over_grpc(stub, grpc_requests)
        return dataclasses.replace(run, cpu=cpu_seconds(process) - cpu)

    async def inprocess_side() -> Run:
        return await asyncio.to_thread(run_in_helper, helper)

    await over_grpc(stub, grpc_requests)  # warm-up: aliases adopted, first-call allocations
    await inprocess_side()
    runs = await alternate_sides({"grpc": grpc_side, "inprocess": inprocess_side}, reps)
    await channel.close()
    return runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small model, fewer requests and repetitions")
    args = parser.parse_args()
    setup, spec = (QUICK, QUICK_SPEC) if args.quick else (FULL, FULL_SPEC)
    began = time.perf_counter()
    model = model_dir(spec)
    n = setup.requests
    weights = [lora_weights(linear_shapes(spec), seed=i) for i in range(n)]
    flags = [
        "--max-slots",
        str(n),
        "--max-rank",
        "16",
        "--max-seqs",
        str(n),
        "--max-seqs-per-tenant",
        "0",
        "--max-len",
        str(MAX_LEN),
    ]  # one tenant: the whole batch
    ps = prompts(n, spec.vocab_size)
    parent, child = multiprocessing.get_context("spawn").Pipe()
    helper = multiprocessing.get_context("spawn").Process(
        target=engine_process, args=(child, model, spec, ps, setup.max_tokens), daemon=True
    )
    helper.start()  # builds its engine while the servers start
    with tempfile.TemporaryDirectory(prefix="ot-bench-p6-") as tmp:
        stack = start_stack(Path(tmp), model, {"sampler": flags})
        try:
            names = register(stack, [peft_files(w) for w in weights])
            if parent.recv() != "ready":
                raise RuntimeError("the engine helper process did not start")
            grpc_requests = [sample_request(name, p, setup.max_tokens) for name, p in zip(names, ps, strict=True)]
            runs = asyncio.run(alternate(stack.samplers["sampler"], parent, grpc_requests, setup.reps))
        finally:
            parent.send("stop")
            helper.join(30)
            stack.stop()
    wall = {side: statistics.median(r.wall for r in rs) for side, rs in runs.items()}
    ttft = {side: statistics.median(r.ttft for r in rs) for side, rs in runs.items()}
    cpu = {side: statistics.median(r.cpu for r in rs) for side, rs in runs.items()}
    tokens = {side: {r.tokens for r in rs} for side, rs in runs.items()}
    ratio = wall["grpc"] / wall["inprocess"]
    overhead_ms = (ttft["grpc"] - ttft["inprocess"]) * 1000
    config = {
        **spec_config(spec),
        "requests": f"{n} concurrent, one adapter each, ~16 prompt tokens, {setup.max_tokens} greedy tokens max",
        "sampler": f"1 torch thread, --max-slots {n} --max-rank 16 --max-seqs {n} --max-len {MAX_LEN}",
        "reps": setup.reps,
        "same_tokens": tokens["grpc"] == tokens["inprocess"],
    }
    record("P6 streaming wall, gRPC / in-process", ratio, target=1.05, comparison="<=", config=config)
    record("P6 time to first token overhead", overhead_ms, unit="ms", config=config)
    record("P6 CPU time, gRPC (sampler + client) / in-process", cpu["grpc"] / cpu["inprocess"], config=config)
    print(f"P6 streaming overhead ({config['model']}; {config['lora']})")
    print(f"  {config['requests']}; {setup.reps} alternating reps, medians")
    for side, label in (("grpc", f"{n} gRPC Sample streams"), ("inprocess", "Engine.submit in-process")):
        runs_s = ", ".join(f"{r.wall:.2f}" for r in runs[side])
        print(
            f"    {label:<26} wall {wall[side]:.3f} s (runs {runs_s}); median first token "
            f"{ttft[side] * 1000:.1f} ms; CPU {cpu[side]:.3f} s; tokens {sorted(tokens[side])}"
        )
    print(
        f"  wall gRPC / in-process {ratio:.3f} (target <= 1.05); first-token overhead {overhead_ms:+.1f} ms; "
        f"CPU time gRPC / in-process {cpu['grpc'] / cpu['inprocess']:.3f}"
    )
    print(f"  total {time.perf_counter() - began:.0f} s")


if __name__ == "__main__":
    main()
