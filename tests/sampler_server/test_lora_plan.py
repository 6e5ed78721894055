"""The engine's planned LoRA path (contiguous per-adapter rows, one plan per step) against the reference."""

from __future__ import annotations

import torch

from opentinker.sampler_server.kernels.reference import lora_delta_reference
from opentinker.sampler_server.kernels.segments import Segment, add_lora_planned, plan_segments


def test_plan_groups_contiguous_runs_and_skips_inactive_slots() -> None:
    ranks = [0, 4, 8, 0, 2]
    scales = [0.0, 2.0, 1.0, 1.0, 0.0]  # slot 3 has rank 0, slot 4 scale 0: both add nothing
    plan = plan_segments([0, 0, 1, 1, 1, 2, 3, 4, 1], ranks, scales)
    assert plan == [Segment(1, 2, 5, 4, 2.0), Segment(2, 5, 6, 8, 1.0), Segment(1, 8, 9, 4, 2.0)]
    assert plan_segments([], ranks, scales) == []
    assert plan_segments([0, 0], ranks, scales) == []


def test_planned_delta_equals_reference_with_mixed_ranks() -> None:
    generator = torch.Generator().manual_seed(0)
    slots, max_rank, d_in, d_out = 5, 8, 24, 40
    ranks = [0, 3, 8, 1, 5]
    a = torch.randn(slots, max_rank, d_in, generator=generator)
    b = torch.randn(slots, d_out, max_rank, generator=generator)
    for slot, rank in enumerate(ranks):  # zero padding beyond each slot's rank, as the slot pool stores them
        a[slot, rank:] = 0
        b[slot, :, rank:] = 0
    scaling = torch.tensor([0.0, 0.5, 2.0, 1.0, 0.25])
    token_slots = [0, 0, 1, 1, 2, 2, 2, 3, 4, 4, 4, 4]  # sorted by slot, as the engine orders rows
    x = torch.randn(len(token_slots), d_in, generator=generator)
    y = torch.randn(len(token_slots), d_out, generator=generator)
    expected = y + lora_delta_reference(x, a, b, scaling, torch.tensor(token_slots))
    plan = plan_segments(token_slots, ranks, scaling.tolist())
    add_lora_planned(y, x, a, b, plan)
    torch.testing.assert_close(y, expected, atol=1e-5, rtol=1e-5)
    assert torch.equal(y[:2], expected[:2])  # slot-0 rows untouched
