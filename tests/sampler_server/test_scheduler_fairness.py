"""The scheduler's prefill-first policy never starves running sequences: with new requests arriving before every
step (one tenant's flood), a running sequence still gets one token every other step."""

from __future__ import annotations

from opentinker.sampler_server.scheduler import Scheduler
from opentinker.sampler_server.sequence import SamplingParams, Sequence

PARAMS = SamplingParams(temperature=0.0, max_tokens=8)


def sequence(request: str) -> Sequence:
    return Sequence(
        seq_id=hash(request) & 0xFFFF, request_id=request, sample_index=0, prompt=[1, 2, 3], params=PARAMS, lora_slot=0
    )


def test_a_flood_of_new_requests_leaves_running_sequences_a_decode_every_other_step() -> None:
    scheduler = Scheduler(max_seqs=64, max_batch_tokens=4096)
    victim = sequence("team-b")
    scheduler.add(victim)
    assert scheduler.schedule().is_prefill  # type: ignore[union-attr]
    decodes_with_victim = 0
    for step in range(40):
        scheduler.add(sequence(f"team-a-{step}"))  # a new request before every step
        batch = scheduler.schedule()
        assert batch is not None
        if batch.is_prefill:
            for seq in batch.sequences:  # team-a's requests fail at their prefill and leave at once
                scheduler.finish(seq)
        else:
            decodes_with_victim += victim in batch.sequences
    assert decodes_with_victim == 20  # every other step; prefill-first alone would give 0


def test_without_running_sequences_prefills_follow_each_other() -> None:
    scheduler = Scheduler(max_seqs=64, max_batch_tokens=4096)
    kinds = []
    for step in range(5):
        scheduler.add(sequence(f"r{step}"))
        batch = scheduler.schedule()
        assert batch is not None
        kinds.append(batch.is_prefill)
        for seq in batch.sequences:
            scheduler.finish(seq)
    assert kinds == [True] * 5
