"""Pure-torch oracle for the multi-LoRA delta: gather each row's weights, two einsums.

Simple and obviously right, and slow: the gather copies a full [R, d_in] and [d_out, R] weight pair per row.
Tests compare every other path against this one.
"""

from __future__ import annotations

import torch


def lora_delta_reference(
    x: torch.Tensor,  # [N, d_in] float32/bfloat16/float16
    a: torch.Tensor,  # [S, R, d_in]
    b: torch.Tensor,  # [S, d_out, R]
    scaling: torch.Tensor,  # [S] float32
    slot_ids: torch.Tensor,  # [N] int64
) -> torch.Tensor:  # [N, d_out], dtype of x
    """delta[n] = scaling[s] * (x[n] @ a[s].T) @ b[s].T with s = slot_ids[n]; the intermediate in float32.

    Slot 0 ("no adapter") holds zeros and scaling 0, so its rows get an exact zero without special casing.
    """
    a_rows = a[slot_ids].float()  # [N, R, d_in]
    b_rows = b[slot_ids].float()  # [N, d_out, R]
    h = torch.einsum("nk,nrk->nr", x.float(), a_rows)  # [N, R] float32
    h = h * scaling[slot_ids].float()[:, None]  # [N, R]
    delta = torch.einsum("nr,nor->no", h, b_rows)  # [N, d_out] float32
    return delta.to(x.dtype)
