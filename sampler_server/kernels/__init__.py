"""Multi-LoRA delta for a mixed batch: every row carries the slot of its adapter version.

    y[n] += scaling[s] * (x[n] @ a[s].T) @ b[s].T        s = slot_ids[n]

per target module, with the pool's stacked tensors a: [S, R, d_in], b: [S, d_out, R], scaling: [S] (slot 0 =
"no adapter": zeros, scaling 0; smaller ranks zero-padded to R, which is exact). The rank-sized intermediate
is float32; the delta is cast back to x's dtype.

Three paths compute the same thing:

- "reference" (`lora_delta_reference`): gathers a full weight pair per row and einsums. Obviously right, so it
  is the test oracle; too slow to serve (the per-row weight copies dominate as the batch grows).
- "segments" (`add_lora_segments`): the CPU production path. Rows stably sorted by slot form one contiguous
  segment per slot; each segment is two small GEMMs sliced to the slot's real rank, scattered back with
  index_add_. Cost scales with distinct slots, not rows, and slot 0 costs nothing. It reads the segment
  boundaries on the host, which is free on CPU but would sync a GPU stream. The engine uses its planned form
  (`segments.plan_runs` + `add_lora_runs`): rows already ordered by slot, one batched matmul pair per run of
  consecutive slots.
- "triton" (`add_lora_triton`): shrink and expand kernels indexed by slot into the one stacked tensor, with
  segment metadata computed on the device, so there is no host sync and no per-row weight copy. Used on CUDA;
  also runs on CPU under TRITON_INTERPRET=1 for correctness tests on tiny shapes.

`resolve_kernel` is the one place that turns the `--kernel` flag into one of the three: "auto" picks triton on
CUDA when triton is installed, else segments (also on CUDA without triton). The server resolves it once at
startup; the engine runs exactly that kernel and GetSamplerInfo reports it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch

from opentinker.sampler_server.kernels.reference import lora_delta_reference
from opentinker.sampler_server.kernels.segments import add_lora_segments
from opentinker.sampler_server.kernels.triton_ops import TRITON_AVAILABLE, add_lora_triton

Backend = Literal["auto", "reference", "segments", "triton"]
Kernel = Literal["reference", "segments", "triton"]

__all__ = [
    "TRITON_AVAILABLE",
    "Backend",
    "Kernel",
    "add_lora",
    "add_lora_segments",
    "add_lora_triton",
    "check_lora_shapes",
    "lora_delta_reference",
    "resolve_backend",
    "resolve_kernel",
]


def check_lora_shapes(
    y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scaling: torch.Tensor, slot_ids: torch.Tensor
) -> None:
    """Raises ValueError unless the shapes and dtypes fit together (reads no values, so never syncs)."""
    if x.dim() != 2 or y.dim() != 2 or a.dim() != 3 or b.dim() != 3:
        raise ValueError(f"want x [N, d_in], y [N, d_out], a [S, R, d_in], b [S, d_out, R]; got {_shapes(y, x, a, b)}")
    n, d_in = x.shape
    num_slots, max_rank, a_d_in = a.shape
    if a_d_in != d_in or b.shape[0] != num_slots or b.shape[2] != max_rank or y.shape != (n, b.shape[1]):
        raise ValueError(f"mismatched shapes: {_shapes(y, x, a, b)}")
    if scaling.shape != (num_slots,) or slot_ids.shape != (n,):
        raise ValueError(f"want scaling [{num_slots}] and slot_ids [{n}]; got {scaling.shape} and {slot_ids.shape}")
    if y.dtype != x.dtype:
        raise ValueError(f"y dtype {y.dtype} differs from x dtype {x.dtype}")
    if slot_ids.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"slot_ids must be int64 or int32, got {slot_ids.dtype}")


def _shapes(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> str:
    return f"y {tuple(y.shape)}, x {tuple(x.shape)}, a {tuple(a.shape)}, b {tuple(b.shape)}"


def resolve_kernel(backend: Backend, device_type: str, *, triton_available: bool | None = None) -> Kernel:
    """The kernel that `backend` means on a device of `device_type` ("cpu", "cuda"); triton_available defaults to
    whether triton is installed here."""
    if backend == "auto":
        installed = TRITON_AVAILABLE if triton_available is None else triton_available
        return "triton" if device_type == "cuda" and installed else "segments"
    if backend not in ("reference", "segments", "triton"):
        raise ValueError(f"unknown LoRA backend {backend!r}")
    return backend


def resolve_backend(backend: Backend, x: torch.Tensor) -> Kernel:
    """`resolve_kernel` for the device x lives on."""
    return resolve_kernel(backend, x.device.type)


def add_lora(
    y: torch.Tensor,  # [N, d_out], dtype of x; updated in place
    x: torch.Tensor,  # [N, d_in] float32/bfloat16/float16
    a: torch.Tensor,  # [S, R, d_in]
    b: torch.Tensor,  # [S, d_out, R]
    scaling: torch.Tensor,  # [S] float32
    slot_ids: torch.Tensor,  # [N] int64, values in [0, S)
    *,
    ranks: Sequence[int] | None = None,  # [S] real rank per slot (segments path only; padding is exact anyway)
    backend: Backend = "auto",
) -> None:
    """Adds each row's LoRA delta to y in place, using the path `backend` names (see the module docstring)."""
    check_lora_shapes(y, x, a, b, scaling, slot_ids)
    chosen = resolve_backend(backend, x)
    if chosen == "reference":
        y.add_(lora_delta_reference(x, a, b, scaling, slot_ids))
    elif chosen == "segments":
        add_lora_segments(y, x, a, b, scaling, slot_ids, ranks=ranks)
    else:
        add_lora_triton(y, x, a, b, scaling, slot_ids)
