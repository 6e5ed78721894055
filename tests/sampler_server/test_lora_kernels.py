"""Multi-LoRA delta kernels: the segments path and the Triton kernels agree with the gather+einsum reference."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from opentinker.sampler_server import kernels
from opentinker.sampler_server.kernels import (
    TRITON_AVAILABLE,
    Backend,
    add_lora,
    add_lora_segments,
    lora_delta_reference,
    resolve_backend,
)

Pool = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def make_pool(
    gen: torch.Generator, ranks: list[int], max_rank: int, d_in: int, d_out: int, dtype: torch.dtype = torch.float32
) -> Pool:
    """Stacked a [S, R, d_in], b [S, d_out, R], scaling [S]; slot s zero beyond ranks[s]; slot 0 empty."""
    num_slots = len(ranks)
    a = torch.randn(num_slots, max_rank, d_in, generator=gen) / d_in**0.5
    b = torch.randn(num_slots, d_out, max_rank, generator=gen) / max_rank**0.5
    scaling = torch.rand(num_slots, generator=gen) + 0.5
    for s, rank in enumerate(ranks):
        a[s, rank:] = 0
        b[s, :, rank:] = 0
    scaling[0] = 0
    return a.to(dtype), b.to(dtype), scaling


def segments_delta(x: torch.Tensor, pool: Pool, slot_ids: torch.Tensor, ranks: list[int] | None = None) -> torch.Tensor:
    a, b, scaling = pool
    y = torch.zeros(x.shape[0], b.shape[1], dtype=x.dtype)
    add_lora_segments(y, x, a, b, scaling, slot_ids, ranks=ranks)
    return y


RANKS = [0, 3, 8, 1, 5]  # S=5, R=8: mixed real ranks, slot 0 = no adapter


@pytest.mark.parametrize("n", [1, 7, 64])
@pytest.mark.parametrize(("d_in", "d_out"), [(16, 16), (40, 96), (96, 24)])
@pytest.mark.parametrize("use_ranks", [False, True])
def test_segments_match_reference(n: int, d_in: int, d_out: int, use_ranks: bool) -> None:
    gen = torch.Generator().manual_seed(n * 1000 + d_in + d_out)
    pool = make_pool(gen, RANKS, 8, d_in, d_out)
    x = torch.randn(n, d_in, generator=gen)
    slot_ids = torch.randint(0, len(RANKS), (n,), generator=gen)
    expected = lora_delta_reference(x, *pool, slot_ids)
    got = segments_delta(x, pool, slot_ids, RANKS if use_ranks else None)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    assert torch.equal(got[slot_ids == 0], torch.zeros_like(got[slot_ids == 0]))


@pytest.mark.parametrize("backend", ["reference", "segments"])
def test_slot0_rows_unchanged_and_others_accumulate(backend: Backend) -> None:
    gen = torch.Generator().manual_seed(1)
    a, b, scaling = make_pool(gen, RANKS, 8, 32, 48)
    x = torch.randn(9, 32, generator=gen)
    slot_ids = torch.tensor([0, 1, 0, 2, 4, 0, 2, 3, 0])
    y = torch.randn(9, 48, generator=gen)
    y0 = y.clone()
    add_lora(y, x, a, b, scaling, slot_ids, ranks=RANKS, backend=backend)
    base = slot_ids == 0
    assert torch.equal(y[base], y0[base])  # bitwise: slot 0 adds exactly nothing
    torch.testing.assert_close(y[~base], y0[~base] + lora_delta_reference(x, a, b, scaling, slot_ids)[~base])
    assert not torch.equal(y[~base], y0[~base])


@pytest.mark.parametrize("slot", [0, 2])
def test_all_rows_one_slot(slot: int) -> None:
    gen = torch.Generator().manual_seed(2)
    pool = make_pool(gen, RANKS, 8, 24, 40)
    x = torch.randn(16, 24, generator=gen)
    slot_ids = torch.full((16,), slot, dtype=torch.long)
    got = segments_delta(x, pool, slot_ids, RANKS)
    torch.testing.assert_close(got, lora_delta_reference(x, *pool, slot_ids), atol=1e-5, rtol=1e-5)
    assert (got.abs().sum() == 0) == (slot == 0)


def test_empty_batch() -> None:
    gen = torch.Generator().manual_seed(3)
    a, b, scaling = make_pool(gen, RANKS, 8, 16, 16)
    x = torch.zeros(0, 16)
    slot_ids = torch.zeros(0, dtype=torch.long)
    assert lora_delta_reference(x, a, b, scaling, slot_ids).shape == (0, 16)
    for backend in ("reference", "segments", "auto"):
        y = torch.zeros(0, 16)
        add_lora(y, x, a, b, scaling, slot_ids, backend=backend)
        assert y.shape == (0, 16)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_x(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(4)
    pool = make_pool(gen, RANKS, 8, 64, 32, dtype)
    x = torch.randn(33, 64, generator=gen).to(dtype)
    slot_ids = torch.randint(0, len(RANKS), (33,), generator=gen)
    expected = lora_delta_reference(x, *pool, slot_ids)
    got = segments_delta(x, pool, slot_ids, RANKS)
    assert got.dtype == expected.dtype == dtype
    torch.testing.assert_close(got, expected, atol=1e-2, rtol=2e-2)


def test_deterministic() -> None:
    gen = torch.Generator().manual_seed(5)
    pool = make_pool(gen, RANKS, 8, 48, 48)
    x = torch.randn(64, 48, generator=gen)
    slot_ids = torch.randint(0, len(RANKS), (64,), generator=gen)
    first = segments_delta(x, pool, slot_ids, RANKS)
    for _ in range(3):
        assert torch.equal(segments_delta(x, pool, slot_ids, RANKS), first)


@settings(max_examples=30, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    n=st.integers(0, 20),
    d_in=st.integers(1, 40),
    d_out=st.integers(1, 40),
    max_rank=st.integers(1, 8),
    num_slots=st.integers(1, 6),
    pass_ranks=st.booleans(),
)
def test_segments_property(
    seed: int, n: int, d_in: int, d_out: int, max_rank: int, num_slots: int, pass_ranks: bool
) -> None:
    gen = torch.Generator().manual_seed(seed)
    ranks = [0, *torch.randint(0, max_rank + 1, (num_slots - 1,), generator=gen).tolist()]
    pool = make_pool(gen, ranks, max_rank, d_in, d_out)
    x = torch.randn(n, d_in, generator=gen)
    slot_ids = torch.randint(0, num_slots, (n,), generator=gen)
    got = segments_delta(x, pool, slot_ids, ranks if pass_ranks else None)
    torch.testing.assert_close(got, lora_delta_reference(x, *pool, slot_ids), atol=1e-5, rtol=1e-5)


def test_bad_inputs_raise() -> None:
    gen = torch.Generator().manual_seed(6)
    a, b, scaling = make_pool(gen, RANKS, 8, 16, 16)
    x = torch.randn(3, 16, generator=gen)
    y = torch.zeros(3, 16)
    slot_ids = torch.tensor([0, 1, 2])
    with pytest.raises(ValueError, match="mismatched"):
        add_lora(torch.zeros(3, 15), x, a, b, scaling, slot_ids)
    with pytest.raises(ValueError, match="ranks"):
        add_lora(y, x, a, b, scaling, slot_ids, ranks=[8, 8])
    with pytest.raises(ValueError, match="backend"):
        add_lora(y, x, a, b, scaling, slot_ids, backend="cuda")  # type: ignore[arg-type]
    if os.environ.get("TRITON_INTERPRET") is None:
        with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
            add_lora(y, x, a, b, scaling, slot_ids, backend="triton")
    with pytest.raises(IndexError):
        add_lora(y, x, a, b, scaling, torch.tensor([0, 1, 5]), backend="segments")


def test_dispatcher_picks_segments_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    x = torch.randn(4, 16)
    assert resolve_backend("auto", x) == "segments"
    calls: list[str] = []
    monkeypatch.setattr(kernels, "add_lora_segments", lambda *args, **kw: calls.append("segments"))
    monkeypatch.setattr(kernels, "add_lora_triton", lambda *args, **kw: calls.append("triton"))
    gen = torch.Generator().manual_seed(7)
    a, b, scaling = make_pool(gen, RANKS, 8, 16, 16)
    add_lora(torch.zeros(4, 16), x, a, b, scaling, torch.tensor([0, 1, 2, 3]))
    assert calls == ["segments"]


@pytest.mark.skipif(
    not TRITON_AVAILABLE, reason="triton is not installed, so its kernels cannot run (even interpreted)"
)
def test_triton_kernels_under_interpreter() -> None:
    """Shrink/expand kernels on tiny shapes, interpreted on CPU in a fresh process, against the reference."""
    script = Path(__file__).with_name("lora_triton_interp_check.py")
    proc = subprocess.run(
        [sys.executable, str(script)],
        env={**os.environ, "TRITON_INTERPRET": "1"},
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(results) >= 8
    assert {case["name"] for case in results} >= {"vocab_wide_elementwise", "vocab_wide_dot"}  # lm_head's expand
    for case in results:
        assert case["max_abs_err"] <= case["atol"], case
        assert case["slot0_unchanged"], case
