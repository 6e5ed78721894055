"""The model's `linear` (operand order picked by row count for speed) equals F.linear at every row count."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from opentinker.sampler_server.model.linear import TRANSPOSED_GEMM_ROWS, linear


@pytest.mark.parametrize("rows", [1, 4, TRANSPOSED_GEMM_ROWS.start, 32, TRANSPOSED_GEMM_ROWS.stop - 1, 64])
@pytest.mark.parametrize("with_bias", [False, True])
def test_linear_equals_f_linear(rows: int, with_bias: bool) -> None:
    generator = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 96, generator=generator)
    weight = torch.randn(80, 96, generator=generator)
    bias = torch.randn(80, generator=generator) if with_bias else None
    y = linear(x, weight, bias)
    assert y.shape == (rows, 80) and y.is_contiguous()  # callers view it per head and add LoRA deltas in place
    torch.testing.assert_close(y, F.linear(x, weight, bias), atol=1e-5, rtol=1e-5)
