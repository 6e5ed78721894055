"""The trainer pool's cost and its failover, measured on real processes (a registry, trainers, the SDK).

1. One adapter: steps/s with an explicit trainer address against the same trainer through the pool
   (ServiceClient(registry=...): placement, leases, fencing, the journal), step blocks alternating so machine
   noise falls on both. Target: pool >= 0.95x.
2. Four adapters on one trainer against the same four spread over two trainers (placed by the registry). On
   this 2-core machine both trainers share the cores: the figure is the pool's cost, not more compute.
3. Failover: the trainer holding an adapter is SIGKILLed; the time from the kill to the next completed step,
   next to what it is made of: the lease (3 beats), then the placement, the state load and the replay.

    .venv/bin/python bench/trainer_pool.py [--quick]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

from results import record
from workload import QUICK_SPEC, model_dir

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from serverproc import start_registry, start_trainer  # noqa: E402

from opentinker.client import AdamParams, Datum, LoraConfig, ModelInput, ServiceClient, TrainingClient  # noqa: E402

BEAT_S = 0.5  # leases of 1.5 s
LORA = LoraConfig(rank=16)
ADAM = AdamParams(learning_rate=1e-3)


def _datums(seed: int, count: int = 4, length: int = 64) -> list[Datum]:
    out = []
    for i in range(count):
        tokens = [(seed * 7919 + i * 104729 + j * 31) % (QUICK_SPEC.vocab_size - 3) + 3 for j in range(length)]
        out.append(
            Datum(
                model_input=ModelInput.from_ints(tokens[:-1]),
                loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (length - 1)},
            )
        )
    return out


def _step(training: TrainingClient, seed: int) -> None:
    training.forward_backward(_datums(seed))
    training.optim_step(ADAM)


def _steps_per_s(adapters: list[TrainingClient], steps: int, seed: int) -> float:
    start = time.perf_counter()
    for step in range(steps):
        for i, training in enumerate(adapters):
            _step(training, seed + 100 * step + i)
    return steps * len(adapters) / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    blocks, steps = (3, 4) if args.quick else (6, 10)
    model = model_dir(QUICK_SPEC)
    flags = ("--heartbeat-s", str(BEAT_S))
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        registry = start_registry(work / "registry")
        first = start_trainer(work / "t1", model, registry, *flags)
        servers = [first]
        try:
            time.sleep(3 * BEAT_S)  # registered
            with (
                ServiceClient(trainer=first.address, registry=registry.address) as direct,
                ServiceClient(registry=registry.address) as pooled,
            ):
                plain = direct.create_training_client("bench-direct", LORA, seed=1)
                placed = pooled.create_training_client("bench-pooled", LORA, seed=1)
                _step(plain, 0)
                _step(placed, 0)
                direct_rates, pool_rates = [], []
                for block in range(blocks):
                    direct_rates.append(_steps_per_s([plain], steps, 1000 * block))
                    pool_rates.append(_steps_per_s([placed], steps, 1000 * block))
                d, p = statistics.median(direct_rates), statistics.median(pool_rates)
                print(f"one adapter: direct {d:.2f} steps/s, through the pool {p:.2f} steps/s: {p / d:.3f}x")
                record("trainer pool: one adapter, pool / direct steps/s", p / d, target=0.95)

                four_one = [direct.create_training_client(f"bench-one-{i}", LORA, seed=i) for i in range(4)]
                one_rate = statistics.median(_steps_per_s(four_one, steps // 2 or 1, 7 * b) for b in range(blocks))
                servers.append(start_trainer(work / "t2", model, registry, *flags))
                time.sleep(3 * BEAT_S)
                four_two = [pooled.create_training_client(f"bench-two-{i}", LORA, seed=i) for i in range(4)]
                where = sorted({t.trainer_address for t in four_two})
                two_rate = statistics.median(_steps_per_s(four_two, steps // 2 or 1, 7 * b) for b in range(blocks))
                print(
                    f"four adapters: one trainer {one_rate:.2f} steps/s, spread over {len(where)} trainers "
                    f"{two_rate:.2f} steps/s ({two_rate / one_rate:.3f}x; both share this machine's cores)"
                )
                record("trainer pool: 4 adapters, two trainers / one", two_rate / one_rate)

                victim_address = four_two[0].trainer_address
                victim = next(s for s in servers if s.address == victim_address)
                victim.kill()
                killed = time.perf_counter()
                _step(four_two[0], 99)
                recovery = time.perf_counter() - killed
                (failover,) = four_two[0].failovers
                lease = 3 * BEAT_S
                print(
                    f"failover: SIGKILL to the next completed step {recovery:.2f} s (lease {lease:.1f} s); the SDK: "
                    f"placed elsewhere after {failover.placed_s:.2f} s, state at step {failover.state_step} loaded "
                    f"in {failover.load_s:.2f} s, {failover.calls_replayed} calls replayed in {failover.replay_s:.2f} s"
                )
                record("trainer pool: SIGKILL to next step (s)", recovery, unit="s")
                record("trainer pool: failover, placed elsewhere (s)", failover.placed_s, unit="s")
                record("trainer pool: failover, state load (s)", failover.load_s, unit="s")
                record("trainer pool: failover, replay (s)", failover.replay_s, unit="s")
        finally:
            for server in servers:
                server.kill()
            registry.terminate()


if __name__ == "__main__":
    main()
