"""What smaller micro-batches cost: one ForwardBackward of a 64 x 2,047 batch through the trainer's compute core
(in process, no gRPC), split at several --micro-batch-positions values. For each: the whole request's time
(throughput: positions per second) and its longest part (how long the compute thread is held before another
tenant's job can run). Sizes alternate round by round, so machine noise hits them alike; the minimum over the
rounds (and the median) is printed.

Two batches: "dense" (64 datums of 2,047 real tokens) and "limit" (bench/noisy_neighbours.py's limit batch: one
2,047-token datum and 63 one-token datums: the long datum's part is padded to 2,047 in every row, so a smaller
micro-batch also computes less padding).

    .venv/bin/python bench/micro_batch_cost.py [--quick] [--rounds N] [--rows 64] [--sizes 4096,8192,16384]
                                               [--device cpu]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))  # the tests' datum builders

import torch  # noqa: E402
from trainerutil import random_tokens, sft_datum  # noqa: E402
from workload import FULL_SPEC, QUICK_SPEC, RANK, model_dir  # noqa: E402

from opentinker.trainer_server.adapter_config import LoraConfig  # noqa: E402
from opentinker.trainer_server.base_model import BaseModel  # noqa: E402
from opentinker.trainer_server.batch import Batch, build_batch, split_batch  # noqa: E402
from opentinker.trainer_server.losses import resolve_config  # noqa: E402
from opentinker.trainer_server.micro_batch import release_after  # noqa: E402
from opentinker.trainer_server.trainer import Trainer  # noqa: E402
from opentinker.trainer_server.wire import datums_of  # noqa: E402
from opentinker.v1 import common_pb2  # noqa: E402
from opentinker.weights.artifact_store import ArtifactStore  # noqa: E402

LENGTH = 2048  # x 64 rows: the default --max-batch-positions


def batches(trainer: Trainer, rows: int) -> dict[str, Batch]:
    base = trainer.base
    dense = [sft_datum(random_tokens(row, LENGTH)) for row in range(rows)]
    limit = [sft_datum(random_tokens(1, LENGTH)), *(sft_datum([5, 6]) for _ in range(rows - 1))]

    def build(datums: list[common_pb2.Datum]) -> Batch:
        return build_batch(
            datums_of(datums),
            "cross_entropy",
            vocab_size=base.vocab_size,
            max_positions=base.max_positions,
            pad_id=trainer.pad_id,
            max_batch_positions=rows * LENGTH,
        )

    return {"dense": build(dense), "limit": build(limit)}


def sync(trainer: Trainer) -> None:
    if trainer.base.device.type == "cuda":
        torch.cuda.synchronize()


def run_request(trainer: Trainer, name: str, batch: Batch, positions: int) -> tuple[float, float, int]:
    """(whole request s, longest part s, parts) of one ForwardBackward split at `positions`."""
    config = resolve_config("cross_entropy", {})
    parts = split_batch(batch, positions)
    times = []
    for part in parts:
        start = time.perf_counter()
        trainer.accumulate(name, part, "cross_entropy", config)
        release_after(part)
        sync(trainer)
        times.append(time.perf_counter() - start)
    for param in trainer.get(name).params:
        param.grad = None
    return sum(times), max(times), len(parts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the quick model (qwen2 hidden 256, 2 layers)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--rows", type=int, default=64, help="datums per request (fewer: a quicker run)")
    parser.add_argument("--sizes", default="2048,4096,8192,16384,32768")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    spec = QUICK_SPEC if args.quick else FULL_SPEC
    with tempfile.TemporaryDirectory() as tmp:
        trainer = Trainer(BaseModel(str(model_dir(spec)), device=args.device), ArtifactStore(Path(tmp)))
        lora = LoraConfig(rank=RANK, alpha=2 * RANK, dropout=0.0, target_modules=())
        trainer.create("bench/adapter", lora, None, 0)
        work = batches(trainer, args.rows)
        for batch in work.values():  # warm-up: allocator, kernels
            run_request(trainer, "bench/adapter", batch, sizes[-1])
        results: dict[tuple[str, int], list[tuple[float, float, int]]] = {}
        for round_index in range(args.rounds):
            order = sizes[round_index % len(sizes) :] + sizes[: round_index % len(sizes)]
            for size in order:
                for name, batch in work.items():
                    run = run_request(trainer, "bench/adapter", batch, size)
                    results.setdefault((name, size), []).append(run)
                    print(
                        f"round {round_index} {name} {size}: {run[2]} parts, {run[0]:.2f} s, longest part "
                        f"{run[1]:.3f} s",
                        flush=True,
                    )
    model = "quick" if args.quick else "full"
    print(
        f"model {model} ({spec.hidden_size} hidden, {spec.num_hidden_layers} layers), rank {RANK}, device "
        f"{args.device}, torch threads {torch.get_num_threads()}, {args.rounds} rounds, "
        f"{args.rows} x {LENGTH - 1} positions"
    )
    # min: the run least disturbed by the machine's other work (a shared machine's noise only adds time)
    print("batch  micro-batch  parts  request s (min / median)  padded positions/s  vs 16384  longest part s (min)")
    for name in work:
        reference = min(r[0] for r in results.get((name, 16384), results[(name, sizes[-1])]))
        for size in sizes:
            runs = results[(name, size)]
            best, median = min(r[0] for r in runs), statistics.median(r[0] for r in runs)
            positions = args.rows * (LENGTH - 1)
            print(
                f"{name:6} {size:11} {runs[0][2]:6} {best:11.2f} / {median:6.2f} {positions / best:19.0f} "
                f"{best / reference:8.2f}x {min(r[1] for r in runs):21.3f}"
            )


if __name__ == "__main__":
    main()
