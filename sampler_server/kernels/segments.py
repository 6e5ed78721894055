"""CPU production path for the multi-LoRA delta: rows grouped into one contiguous segment per slot (SGMV in torch).

Stable-sort the rows by slot, count each run (unique_consecutive), then per segment one shrink matmul
(x_seg @ A_s^T, float32, sliced to the slot's real rank) and one expand matmul (h @ B_s^T), and index_add the
result back into y. Slot 0 ("no adapter") is skipped entirely. Unlike the reference it never materialises a
per-row copy of the weights: the work is two small GEMMs per resident slot in the batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


def _segment_delta(
    x_seg: torch.Tensor,  # [M, d_in]
    a_s: torch.Tensor,  # [r, d_in]
    b_s: torch.Tensor,  # [d_out, r]
    scale: float,
) -> torch.Tensor:  # [M, d_out], dtype of x_seg
    h = x_seg.float() @ a_s.float().T  # [M, r] float32 (.float() is free for float32 inputs)
    h.mul_(scale)
    return (h @ b_s.float().T).to(x_seg.dtype)  # [M, d_out]


def add_lora_segments(
    y: torch.Tensor,  # [N, d_out], dtype of x; updated in place
    x: torch.Tensor,  # [N, d_in]
    a: torch.Tensor,  # [S, R, d_in]
    b: torch.Tensor,  # [S, d_out, R]
    scaling: torch.Tensor,  # [S] float32
    slot_ids: torch.Tensor,  # [N] int64
    ranks: Sequence[int] | None = None,  # [S] real rank per slot; None = R for every slot
) -> None:
    """y[n] += scaling[s] * (x[n] @ a[s].T) @ b[s].T with s = slot_ids[n], one matmul pair per distinct slot.

    With `ranks`, slot s multiplies only a[s, :ranks[s]] and b[s, :, :ranks[s]]: the zero padding up to R
    contributes nothing, so skipping it is exact. Slot 0, rank-0 slots and slots with scaling 0 add nothing
    and are skipped.
    """
    n = x.shape[0]
    num_slots, max_rank = a.shape[0], a.shape[1]
    if ranks is not None and len(ranks) != num_slots:
        raise ValueError(f"ranks has {len(ranks)} entries for {num_slots} slots")
    if n == 0:
        return
    scales: list[float] = scaling.tolist()

    def rank_of(slot: int) -> int:
        rank = max_rank if ranks is None else ranks[slot]
        if not 0 <= rank <= max_rank:
            raise ValueError(f"slot {slot} has rank {rank}, outside [0, {max_rank}]")
        return rank

    def active(slot: int) -> bool:
        if not 0 <= slot < num_slots:
            raise IndexError(f"slot id {slot} outside [0, {num_slots})")
        return slot != 0 and scales[slot] != 0.0 and rank_of(slot) > 0

    first = int(slot_ids[0])
    if bool((slot_ids == first).all()):  # one slot for the whole batch (common in decode): no sort, no scatter
        if active(first):
            r = rank_of(first)
            y.add_(_segment_delta(x, a[first, :r], b[first, :, :r], scales[first]))
        return

    order = torch.argsort(slot_ids, stable=True)  # [N] row indices grouped by slot, original order kept within
    slots, counts = torch.unique_consecutive(slot_ids[order], return_counts=True)  # [G], [G]
    start = 0
    for slot, count in zip(slots.tolist(), counts.tolist(), strict=True):
        rows = order[start : start + count]  # [M] this slot's rows
        start += count
        if not active(slot):
            continue
        r = rank_of(slot)
        delta = _segment_delta(x.index_select(0, rows), a[slot, :r], b[slot, :, :r], scales[slot])  # [M, d_out]
        y.index_add_(0, rows, delta)


@dataclass(frozen=True, slots=True)
class Segment:
    slot: int
    start: int
    end: int
    rank: int
    scale: float


def plan_segments(token_slots: Sequence[int], ranks: Sequence[int], scales: Sequence[float]) -> list[Segment]:
    """Contiguous runs of rows on the same active slot, computed once per engine step on the host.

    The engine orders a batch's sequences by slot, so each adapter's rows form one run; the plan then serves
    all projections of all layers without sorting, gathering or a device-to-host sync per projection.
    """
    plan: list[Segment] = []
    start = 0
    for index in range(1, len(token_slots) + 1):
        if index == len(token_slots) or token_slots[index] != token_slots[start]:
            slot = token_slots[start]
            if slot != 0 and ranks[slot] > 0 and scales[slot] != 0.0:
                plan.append(Segment(slot, start, index, ranks[slot], scales[slot]))
            start = index
    return plan


def add_lora_planned(
    y: torch.Tensor,  # [N, d_out]; updated in place
    x: torch.Tensor,  # [N, d_in]
    a: torch.Tensor,  # [S, R, d_in]
    b: torch.Tensor,  # [S, d_out, R]
    plan: Sequence[Segment],
) -> None:
    """y[s:e] += scale * (x[s:e] @ A[slot, :r]^T) @ B[slot, :, :r]^T for every planned segment: two ops per
    segment on contiguous slices, the rank-sized intermediate in float32."""
    for seg in plan:
        h = x[seg.start : seg.end].float() @ a[seg.slot, : seg.rank].float().T  # [M, r]
        if y.dtype == torch.float32:
            y[seg.start : seg.end].addmm_(h, b[seg.slot, :, : seg.rank].T, alpha=seg.scale)
        else:
            y[seg.start : seg.end] += ((h @ b[seg.slot, :, : seg.rank].float().T) * seg.scale).to(y.dtype)
