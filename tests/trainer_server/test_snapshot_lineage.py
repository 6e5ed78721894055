"""SaveSnapshot calls for one adapter at once are serialized: the versions form one parent chain and each trained
batch is in exactly one version's lineage."""

from __future__ import annotations

import asyncio

from trainerutil import Trainer, create, forward_backward, get_adapter, optim_step, sft_batch

from opentinker.trainer_server.lineage_locks import LineageLocks
from opentinker.v1 import registry_pb2, registry_pb2_grpc, trainer_pb2

SAVES = 4


def test_concurrent_saves_of_one_adapter_form_a_chain(
    trainer: Trainer, registry: registry_pb2_grpc.RegistryServiceStub
) -> None:
    name = create(trainer, seed=33).name
    trained = forward_backward(trainer, name, sft_batch(seed=33), trace_ids=["the-batch"])
    optim_step(trainer, name)

    calls = [trainer.SaveSnapshot.future(trainer_pb2.SaveSnapshotRequest(adapter=name)) for _ in range(SAVES)]
    versions = sorted((call.result().version for call in calls), key=lambda v: v.version)

    assert [v.version for v in versions] == list(range(1, SAVES + 1))
    assert [v.lineage.parent_version for v in versions] == list(range(SAVES))
    assert [[b.digest for b in v.lineage.batches] for v in versions] == [[trained.batch_digest]] + [[]] * (SAVES - 1)
    assert all(v.lineage.trainer_step == 1 for v in versions)
    chain = registry.GetLineage(registry_pb2.GetLineageRequest(reference=f"{name}@{SAVES}")).chain
    assert [v.version for v in chain] == list(range(SAVES, 0, -1))
    assert get_adapter(trainer, name).last_snapshot_version == SAVES


def test_lineage_locks_serialize_one_adapter_not_others_and_are_dropped() -> None:
    events: list[str] = []

    async def save(locks: LineageLocks, adapter: str, label: str) -> None:
        async with locks.hold(adapter):
            events.append(f"{label} in")
            for _ in range(3):  # yield to every other task: a second holder of the same lock would run now
                await asyncio.sleep(0)
            events.append(f"{label} out")

    async def main() -> int:
        locks = LineageLocks()
        await asyncio.gather(save(locks, "a", "a1"), save(locks, "a", "a2"), save(locks, "b", "b1"))
        return len(locks)

    assert asyncio.run(main()) == 0  # nothing kept for adapters no one saves any more
    assert events.index("a1 out") < events.index("a2 in")
    assert events.index("b1 in") < events.index("a1 out")  # another adapter does not wait
