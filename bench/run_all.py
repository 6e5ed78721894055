"""Runs every benchmark, one after the other (never two at once: they would measure each other), into a fresh
bench/results.json (with --only, re-runs those scripts and keeps the other figures), then prints the table of
all figures. A script that fails is reported and the others still run; the exit status is 1 if any failed.
Targets not met do not fail the run (they are results).

    .venv/bin/python bench/run_all.py [--quick] [--only SCRIPT ...]
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

from results import figures, start_run, table, update_run

BENCH = Path(__file__).resolve().parent
SCRIPTS = (
    "trainer_overhead.py",  # P5
    "sampler_multilora.py",  # P1, P2, P3
    "hot_reload.py",  # P4
    "streaming.py",  # P6
    "openai_streaming.py",  # /v1 SSE vs gRPC Sample streams
    "scale.py",  # P7
    "continuous_batching.py",  # P8
    "group_sampling.py",  # RL groups: n samples sharing one prompt
    "noisy_neighbours.py",  # team-b latency during team-a abuse / alone
    "bf16_drift.py",  # sampler vs trainer logprobs in bfloat16, per model family
    "prefix_cache.py",  # multi-turn agents, prefix cache on / off; the paged KV memory figure
    "fleet.py",  # F1-F4: adapter-affinity routing vs round robin over 3 samplers, a SIGKILL in the run
    "trainer_pool.py",  # the pool's cost (pool / direct), 4 adapters on 1 vs 2 trainers, SIGKILL to next step
    "structured.py",  # half the batch JSON-schema constrained / free, grammar compile, TTFT cached grammar / none
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small sizes, short runs (< 2 min on an idle machine)")
    parser.add_argument("--only", action="append", choices=SCRIPTS, help="run only these scripts")
    args = parser.parse_args()
    scripts = args.only or list(SCRIPTS)
    began = time.perf_counter()
    run: dict[str, str | int | float | bool | None] = {
        "quick": args.quick,
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.system()} {platform.release()}",
        "python": platform.python_version(),
        "torch": importlib.metadata.version("torch"),
        "load_average_before": " ".join(f"{x:.1f}" for x in os.getloadavg()),
    }
    if args.only:
        update_run(run)  # a partial re-run replaces its own figures and keeps the others
    else:
        start_run(run)
    failed: list[str] = []
    for script in scripts:
        print(f"\n=== {script}{' --quick' if args.quick else ''}", flush=True)
        started = time.perf_counter()
        command = [sys.executable, str(BENCH / script), *(["--quick"] if args.quick else [])]
        code = subprocess.run(command, check=False).returncode
        seconds = round(time.perf_counter() - started, 1)
        update_run({f"seconds {script}": seconds})
        if code != 0:
            failed.append(f"{script} (exit {code})")
    total = round(time.perf_counter() - began, 1)
    update_run({"seconds total": total, "load_average_after": " ".join(f"{x:.1f}" for x in os.getloadavg())})
    print(f"\n=== all figures ({'quick' if args.quick else 'full'} run, {total:.0f} s)")
    print(table(figures()))
    if failed:
        print(f"FAILED: {', '.join(failed)}")
        sys.exit(1)


if __name__ == "__main__":
    main()
