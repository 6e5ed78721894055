"""Noisy neighbours, with real processes and tokens: team-b's latency while team-a abuses a shared resource, against
team-b alone, side by side in one run (windows alternate alone / during the abuse, order rotated each pair). Target
for every case: team-b's p99 during the abuse <= 3x its p99 alone.

case               shared resource                 team-a (in a loop, several threads)      team-b measures
sampler flood      the sampler's batch (KV slots)  24 x 4 greedy samples of 128 tokens each  a seeded 8-token Sample
exploding adapter  the sampler's batch             samples an adapter whose logits are NaN   a seeded 8-token Sample
huge prompt text   the sampler's event loop        sends 10 MiB prompt_text                  a seeded 8-token Sample
logprobs flood     the sampler's batch             20 concurrent max-length ComputeLogprobs  a seeded 8-token Sample
watch flood        the registry's Redis pool       holds 100 WatchEvents streams open        GetAdapter + Resolve
many-file upload   the registry's event loop       uploads manifests of 50,000 files         GetAdapter + Resolve
padded batch       the trainer's compute thread    ForwardBackward of 65 x 2,047 positions   ForwardBackward, 4 x 32
limit batch        the trainer's compute thread    ForwardBackward at --max-batch-positions   ForwardBackward, 4 x 32
gateway absurd     the gateway's event loop        asample num_samples 10,000,000 & co (400)  asample, 8 tokens (HTTP)
gateway parked     the gateway's memory            forward_backward bodies behind a seq_id   asample, 8 tokens (HTTP)
                                                   gap (12 MiB each inflated; 429/400/expired)
gateway 8 MiB JSON the gateway's event loop        8 MB JSON asample bodies (parsed, 400)     asample, 8 tokens (HTTP)

Every abuse but "sampler flood", "logprobs flood" and "limit batch" is refused by its bound
(tests/reliability/test_noisy_*.py assert the statuses); "sampler flood" and "logprobs flood" (each input a sequence of
the batch, chunked like a prompt) run within team-a's share of the batch (--max-seqs-per-tenant: a free slot goes to
the tenant holding the fewest), and "limit batch" is allowed and runs in micro-batches (--micro-batch-positions), so
team-b's jobs wait for at most one of them. The gateway cases go through a gateway process in front of the servers (a
keys file with both tenants); team-b's call there is the tinker protocol over HTTP: an asample and its retrieve_future.
team-b must see no error in any window.

  .venv/bin/python bench/noisy_neighbours.py [--quick] [--only CASE-PREFIX]
"""

from __future__ import annotations

import argparse
import dataclasses
import multiprocessing
import os
import shlex
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import httpx
from neighbour_stack import Clients, prepare, start
from neighbour_workloads import ABUSES, CallFailed, team_b_gateway, team_b_registry, team_b_sample, team_b_train
from results import record
from workload import FULL_SPEC, QUICK_SPEC, model_dir, percentile
from workload import spec_config as model_config

TARGET = 3.0  # team-b's p99 during the abuse / alone


@dataclass(frozen=True, slots=True)
class Setup:
    pairs: int  # (alone, abuse) window pairs per case
    window_s: float
    abusers: int  # team-a threads
    abuser_nice: int = 0  # team-a's processes' niceness: 19 leaves the servers the cores, as clients on other hosts


FULL = Setup(pairs=3, window_s=6.0, abusers=4)
QUICK = Setup(pairs=2, window_s=2.5, abusers=2)


def _abuse_process(case: str, clients: Clients, ready: Any, stop: Any, nice: int) -> None:
    os.nice(nice)
    abuse = ABUSES[case](clients)
    ready.release()
    while not stop.is_set():
        abuse()


def measure(
    workload: Callable[[int], None], case: str | None, clients: Clients, setup: Setup, abusers: int
) -> tuple[list[float], int]:
    """team-b's call latencies over one window, with `abusers` processes running team-a's `case` meanwhile
    (None: alone); and team-b's errors."""
    context = multiprocessing.get_context("spawn")
    stop, ready = context.Event(), context.Semaphore(0)
    work = (case, clients, ready, stop, setup.abuser_nice)
    processes = [context.Process(target=_abuse_process, args=work, daemon=True) for _ in range(abusers if case else 0)]
    for process in processes:
        process.start()
    for _ in processes:
        if not ready.acquire(timeout=120):
            raise TimeoutError("an abuse process did not start")
    latencies: list[float] = []
    errors = 0
    end = time.monotonic() + setup.window_s
    i = 0
    while time.monotonic() < end or not latencies:
        began = time.perf_counter()
        try:
            workload(i)
            latencies.append(time.perf_counter() - began)
        except grpc.RpcError as error:
            print(f"    team-b error: {error.code().name} {error.details()}")
            errors += 1
        except (CallFailed, httpx.HTTPError) as error:
            print(f"    team-b error: {error}")
            errors += 1
        i += 1
    stop.set()
    for process in processes:
        process.join(900)
    return latencies, errors


def run_case(
    name: str,
    workload: Callable[[int], None],
    clients: Clients,
    setup: Setup,
    abusers: int,
    config: dict[str, str | int | float | bool | None],
) -> None:
    alone: list[float] = []
    during: list[float] = []
    errors = 0
    for pair in range(setup.pairs):
        order = (None, name) if pair % 2 == 0 else (name, None)
        for side in order:
            latencies, failed = measure(workload, side, clients, setup, abusers)
            errors += failed
            (during if side else alone).extend(latencies)
    p50a, p99a = percentile(alone, 50), percentile(alone, 99)
    p50d, p99d = percentile(during, 50), percentile(during, 99)
    print(
        f"  {name:18s} team-b alone p50 {p50a * 1e3:7.1f} ms p99 {p99a * 1e3:7.1f} ms ({len(alone)} calls); "
        f"during p50 {p50d * 1e3:7.1f} ms p99 {p99d * 1e3:7.1f} ms ({len(during)} calls); "
        f"errors {errors}"
    )
    record(f"NN {name}: team-b p99 during / alone", p99d / p99a, target=TARGET, comparison="<=", config=config)
    record(f"NN {name}: team-b p50 during / alone", p50d / p50a, config=config)
    record(f"NN {name}: team-b errors", float(errors), target=0, comparison="<=", unit="requests", config=config)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--only", default="", help="Run only the cases whose name starts with this.")
    parser.add_argument(
        "--sampler-args", default="", help="More `sampler serve` flags, e.g. '--mixed-prefill-tokens 16'."
    )
    parser.add_argument(
        "--abuser-nice", type=int, default=0, help="Niceness of team-a's processes (19: as if on other hosts)."
    )
    args = parser.parse_args()
    setup, spec = (QUICK, QUICK_SPEC) if args.quick else (FULL, FULL_SPEC)
    setup = dataclasses.replace(setup, abuser_nice=args.abuser_nice)
    model = model_dir(spec)
    config: dict[str, str | int | float | bool | None] = {
        **model_config(spec),
        "pairs": setup.pairs,
        "window_s": setup.window_s,
        "abusers": setup.abusers,
        "sampler_args": args.sampler_args,
        "abuser_nice": args.abuser_nice,
    }
    print(
        f"noisy neighbours ({spec.arch} hidden {spec.hidden_size}, {spec.num_hidden_layers} layers; {setup.pairs} x "
        f"{setup.window_s:g} s windows per side; {setup.abusers} team-a threads)"
    )
    with tempfile.TemporaryDirectory(prefix="nn-bench-") as tmp:
        stack = start(Path(tmp), model, tuple(shlex.split(args.sampler_args)))
        try:
            clients = stack.clients
            prepare(clients, model, spec)
            workloads = {
                "sample": team_b_sample(clients),
                "registry": team_b_registry(clients),
                "train": team_b_train(clients),
                "gateway": team_b_gateway(clients),
            }
            warmed = False
            for case, (workload, abusers) in {
                "sampler flood": ("sample", setup.abusers),
                "exploding adapter": ("sample", setup.abusers),
                "huge prompt text": ("sample", setup.abusers),
                "logprobs flood": ("sample", setup.abusers),
                "watch flood": ("registry", 1),
                "many-file upload": ("registry", setup.abusers),
                "padded batch": ("train", setup.abusers),
                "limit batch": ("train", 1),
                "gateway absurd": ("gateway", setup.abusers),
                "gateway parked": ("gateway", setup.abusers),
                "gateway 8 MiB JSON": ("gateway", setup.abusers),
            }.items():
                if args.only and not case.startswith(args.only):
                    continue
                if workload == "gateway" and not warmed:  # the gateway's first calls look up the base model
                    for i in range(5):
                        workloads["gateway"](i)
                    warmed = True
                run_case(case, workloads[workload], clients, setup, abusers, config)
        finally:
            stack.stop()


if __name__ == "__main__":
    main()
