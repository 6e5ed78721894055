"""The engine's planned LoRA path (contiguous per-adapter rows, one plan per step, consecutive slots batched into
runs) against the reference."""

from __future__ import annotations

import pytest
import torch

from opentinker.sampler_server.kernels.reference import lora_delta_reference
from opentinker.sampler_server.kernels.segments import (
    RunViews,
    Segment,
    add_lora_runs,
    plan_runs,
    plan_segments,
)


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
    add_lora_runs(y, x, a, b, plan_runs(plan, scaling))  # b: [S, d_out, R] contiguous (not the pool's layout)
    torch.testing.assert_close(y, expected, atol=1e-5, rtol=1e-5)
    assert torch.equal(y[:2], expected[:2])  # slot-0 rows untouched


def test_runs_merge_consecutive_slots_with_equal_rows() -> None:
    ranks = [0, 4, 8, 2, 4, 4]
    scaling = torch.tensor([0.0, 2.0, 1.0, 0.5, 1.5, 3.0])
    #             slot: 1  2  3  3  4  4  5  1  2
    token_slots = [0, 1, 2, 3, 3, 4, 4, 5, 1, 2]
    runs = plan_runs(plan_segments(token_slots, ranks, scaling.tolist()), scaling)
    # slots 1, 2 (one row each) | 3, 4 (two rows each) | 5 alone (one row, after two-row slots) | 1, 2 again
    assert [(r.first, r.count, r.start, r.rows, r.rank) for r in runs] == [
        (1, 2, 1, 1, 8),
        (3, 2, 3, 2, 4),
        (5, 1, 7, 1, 4),
        (1, 2, 8, 1, 8),
    ]
    assert runs[2].scales is None and runs[2].scale == 3.0
    assert runs[1].scales is not None and runs[1].scales.flatten().tolist() == [0.5, 1.5]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_runs_delta_equals_reference(dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(1)
    slots, max_rank, d_in, d_out = 7, 8, 24, 40
    ranks = [0, 3, 8, 1, 5, 8, 2]
    a = torch.randn(slots, max_rank, d_in, generator=generator)
    b_t = torch.randn(slots, max_rank, d_out, generator=generator)  # stored [S, R, d_out] like the slot pool
    for slot, rank in enumerate(ranks):
        a[slot, rank:] = 0
        b_t[slot, rank:] = 0
    a, b = a.to(dtype), b_t.to(dtype).transpose(1, 2)  # b: the pool's [S, d_out, R] view
    scaling = torch.tensor([0.0, 0.5, 2.0, 1.0, 0.25, 1.5, 0.75])
    token_slots = [0, 1, 2, 3, 4, 4, 5, 5, 6, 6, 6, 1, 2, 3]  # runs of one, two and three rows per slot, slot 0 first
    x = torch.randn(len(token_slots), d_in, generator=generator).to(dtype)
    y = torch.randn(len(token_slots), d_out, generator=generator).to(dtype)
    expected = y + lora_delta_reference(x, a, b, scaling, torch.tensor(token_slots))
    runs = plan_runs(plan_segments(token_slots, ranks, scaling.tolist()), scaling)
    assert any(r.count > 1 for r in runs) and any(r.count == 1 for r in runs)
    add_lora_runs(y, x, a, b, runs)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(y, expected, atol=tol, rtol=tol)
    assert torch.equal(y[:1], expected[:1])  # the slot-0 row is untouched


def test_weight_views_kept_across_steps_follow_the_slots_new_contents_and_stay_bounded() -> None:
    generator = torch.Generator().manual_seed(3)
    slots, rank, d_in, d_out = 4, 4, 16, 24
    a = torch.randn(slots, rank, d_in, generator=generator)
    b = torch.randn(slots, rank, d_out, generator=generator).transpose(1, 2)  # the pool's layout: a view
    scaling = torch.tensor([0.0, 2.0, 0.5, 1.0])
    views = RunViews(limit=3)
    x = torch.randn(6, d_in, generator=generator)
    for token_slots in ([1] * 6, [1, 1, 2, 2, 3, 3], [2] * 6):
        runs = plan_runs(plan_segments(token_slots, [0, rank, rank, rank], scaling.tolist()), scaling)
        for step in range(2):
            if step:  # a new version loaded into the same slots in place: the kept views see it
                a.mul_(-1.5)
                b.mul_(0.5)
            y = torch.zeros(6, d_out)
            add_lora_runs(y, x, a, b, runs, views, "q_proj")
            expected = lora_delta_reference(x, a, b, scaling, torch.tensor(token_slots))
            torch.testing.assert_close(y, expected, atol=1e-5, rtol=1e-5)
    assert 0 < len(views._views) <= 3
