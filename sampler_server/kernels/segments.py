"""CPU production path for the multi-LoRA delta: rows grouped into one contiguous segment per slot (SGMV in torch).

`add_lora_segments` (any row order): stable-sort the rows by slot, count each segment (unique_consecutive), then
per segment one shrink matmul (x_seg @ A_s^T, float32, sliced to the slot's real rank) and one expand matmul
(h @ B_s^T), index_added back into y. Slot 0 ("no adapter") is skipped entirely. Unlike the reference it never
materialises a per-row copy of the weights.

The engine's path plans once per step instead: its rows are already ordered by slot, `plan_segments` finds the
segments and `plan_runs` merges segments of consecutive slots with equal row counts into runs, and
`add_lora_runs` gives each run one batched matmul pair over a strided view of the stacked weights. In decode
with one row per adapter that is two ops per projection for the whole batch, instead of two per adapter: the
per-op overhead goes and what is left is streaming the adapters' weights from memory.
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

    The engine orders a batch's sequences by slot, so each adapter's rows form one segment; the plan (merged into
    runs by `plan_runs`) then serves all projections of all layers without sorting, gathering or a device-to-host
    sync per projection.
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


@dataclass(frozen=True, slots=True)
class Run:
    """Planned segments of the consecutive slots `first .. first + count - 1`, `rows` rows each, stored one after
    another from row `start`. The pool stacks slots along dim 0, so their weights are one strided view and a
    single batched matmul pair serves the whole run: in decode (one row per sequence, each adapter in its own
    slot) a whole batch is typically one run instead of one op pair per adapter."""

    first: int
    count: int
    start: int
    rows: int
    rank: int  # the largest real rank in the run; the zero padding of smaller ranks adds exactly nothing
    scale: float  # the slot's scaling when count == 1
    scales: torch.Tensor | None  # [count, 1, 1] float32 scaling per slot (a view of the pool's); None if count == 1

    @property
    def end(self) -> int:
        return self.start + self.count * self.rows


def plan_runs(plan: Sequence[Segment], scaling: torch.Tensor) -> list[Run]:
    """Merges planned segments into runs of consecutive slots with equal row counts; scaling: [S] float32."""
    runs: list[Run] = []
    i = 0
    while i < len(plan):
        head = plan[i]
        rows = head.end - head.start
        j = i + 1
        while (
            j < len(plan)
            and plan[j].slot == plan[j - 1].slot + 1
            and plan[j].start == plan[j - 1].end
            and plan[j].end - plan[j].start == rows
        ):
            j += 1
        count = j - i
        rank = max(seg.rank for seg in plan[i:j])
        scales = scaling[head.slot : head.slot + count].view(count, 1, 1) if count > 1 else None
        runs.append(Run(head.slot, count, head.start, rows, rank, head.scale, scales))
        i = j
    return runs


class RunViews:
    """The weight views each (module, run) multiplies by: A^T [k, d_in, r] and B^T [k, r, d_out] of the run's
    slots (without the batch dim when k is 1). Slicing and transposing them is ~6 Python-to-torch calls per
    projection, a quarter of a one-adapter delta's cost at decode sizes; the pool's tensors never move, so a view
    made once serves every later step. Bounded: past `limit` entries (slot ranges seen), it starts over."""

    def __init__(self, limit: int = 4096) -> None:
        self.limit = limit
        self._views: dict[tuple[str, int, int, int], tuple[torch.Tensor, torch.Tensor]] = {}

    def get(self, module: str, a: torch.Tensor, b: torch.Tensor, run: Run) -> tuple[torch.Tensor, torch.Tensor]:
        key = (module, run.first, run.count, run.rank)
        views = self._views.get(key)
        if views is None:
            if len(self._views) >= self.limit:
                self._views.clear()
            k, r = run.count, run.rank
            a_run = a[run.first : run.first + k, :r].transpose(1, 2)  # [k, d_in, r]
            b_run = b[run.first : run.first + k, :, :r].transpose(1, 2)  # [k, r, d_out]
            views = self._views[key] = (a_run[0], b_run[0]) if k == 1 else (a_run, b_run)
        return views


def add_lora_runs(
    y: torch.Tensor,  # [N, d_out]; updated in place
    x: torch.Tensor,  # [N, d_in]
    a: torch.Tensor,  # [S, R, d_in]
    b: torch.Tensor,  # [S, d_out, R]
    runs: Sequence[Run],
    views: RunViews | None = None,
    module: str = "",
) -> None:
    """y[rows of slot s] += scale_s * (x[rows] @ A[s, :r]^T) @ B[s, :, :r]^T for every planned run: per run one shrink
    bmm, one scale and one expand bmm on contiguous row ranges and weight views (two ops for a one-slot run); the
    rank-sized intermediate in float32. `views` (keyed by `module`) keeps the weight views from step to step."""
    n = x.shape[0]
    for run in runs:
        k, m = run.count, run.rows
        whole = run.start == 0 and run.end == n
        xs, ys = (x, y) if whole else (x[run.start : run.end], y[run.start : run.end])  # [k * m, d_in], [.., d_out]
        a_run, b_run = (views or RunViews()).get(module, a, b, run)
        if run.scales is None:  # a_run: [d_in, r], b_run: [r, d_out]
            if y.dtype == torch.float32:
                ys.addmm_(torch.mm(xs, a_run), b_run, alpha=run.scale)
            else:
                ys += ((xs.float() @ a_run.float() @ b_run.float()) * run.scale).to(y.dtype)
            continue
        hk = torch.bmm(xs.reshape(k, m, -1).float(), a_run.float())  # [k, m, r]
        hk.mul_(run.scales)
        if y.dtype == torch.float32:
            ys.view(k, m, -1).baddbmm_(hk, b_run)
        else:
            ys += torch.bmm(hk, b_run.float()).to(y.dtype).view(k * m, -1)
