"""`linear`: x @ W^T for every projection and the LM head, in the fastest layout each device offers: oneDNN's
packed weights on a float32 CPU, MKL's transposed sgemm at decode row counts, F.linear everywhere else."""

from __future__ import annotations

import torch
import torch.nn.functional as F

# Rows for which the CPU computes float32 x @ W^T as (W @ x^T)^T: at decode batch sizes MKL's sgemm runs that
# operand order 15-30% faster (hidden 896 -> 4864, 16-32 rows, one thread; the benchmark's decode step ~15%
# faster); at 1-4 rows and from 64 rows on plain F.linear is as fast or faster. Other dtypes
# (oneDNN) and CUDA (cuBLAS picks its own layout) keep F.linear.
TRANSPOSED_GEMM_ROWS = range(16, 49)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    # x: [N, d_in], weight: [d_out, d_in] (dense or oneDNN-packed), bias: [d_out] -> [N, d_out] contiguous
    if weight.is_mkldnn:
        n, rows = x.shape[0], packed_rows(x.shape[0])
        if rows != n:  # zeros in the padding rows only (F.pad would zero the whole buffer first: 4% of a prefill)
            padded = x.new_empty(rows, x.shape[1])
            padded[:n] = x
            padded[n:].zero_()
            x = padded
        else:
            x = x.contiguous()
        y: torch.Tensor = torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
        return y[:n]  # [rows, d_out] -> its first n rows, still contiguous
    if x.device.type == "cpu" and x.dtype == torch.float32 and x.shape[0] in TRANSPOSED_GEMM_ROWS:
        y_t = torch.mm(weight, x.t()) if bias is None else torch.addmm(bias[:, None], weight, x.t())  # [d_out, N]
        return y_t.t().contiguous()
    return F.linear(x, weight, bias)


def packed_rows(n: int) -> int:
    """Rows a oneDNN matmul of n rows runs with. oneDNN builds and keeps a kernel with its own buffers for every
    input shape (measured on the benchmark model: +940 MiB RSS over 64 decode sizes and 54 prefill lengths), so
    rows are padded to few sizes: multiples of 8 up to 64, then 4 sizes per doubling (at most 25% padding);
    the same traffic then costs +264 MiB, about what the dense path's allocations cost (+162 MiB)."""
    if n <= 64:
        return -(-n // 8) * 8
    step = 1 << (n.bit_length() - 3)
    return -(-n // step) * step


def pack_onednn(weight: torch.Tensor) -> torch.Tensor:
    """A float32 CPU matrix [d_out, d_in] in oneDNN's blocked layout for `linear` (an opaque tensor). oneDNN's
    packed sgemm beats the dense path at every batch size we measured (1.4-2x at 4-64 rows on AMD EPYC, where
    MKL's sgemm is slow), and the packing does not depend on the batch size."""
    packed: torch.Tensor = torch.ops.mkldnn._reorder_linear_weight(weight, None)
    return packed


def onednn_packing_works() -> bool:
    """Whether this torch build has oneDNN's packed linear (private ops of torch's CPU inductor path) and it agrees
    with F.linear on a probe."""
    try:
        if not torch.backends.mkldnn.is_available():  # type: ignore[no-untyped-call]
            return False
        generator = torch.Generator().manual_seed(0)
        weight, x = torch.randn(48, 40, generator=generator), torch.randn(5, 40, generator=generator)
        bias = torch.randn(48, generator=generator)
        packed = linear(x, pack_onednn(weight), bias)
        return bool(torch.allclose(packed, F.linear(x, weight, bias), rtol=1e-5, atol=1e-5))
    except (RuntimeError, AttributeError):
        return False
