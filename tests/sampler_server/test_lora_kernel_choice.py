"""The LoRA kernel is decided once (`resolve_kernel`, from device, triton availability and the flag): the engine
runs exactly that kernel (on CUDA without triton, the planned segments path, which it used not to) and
GetSamplerInfo reports the engine's own choice, also from an engine in its own process."""

from __future__ import annotations

import types
from pathlib import Path
from typing import Any, cast

import grpc
import pytest
import torch
from serverproc import ServerProcess, start_sampler

from opentinker.sampler_server import kernels, lora_plan
from opentinker.sampler_server.engine import Engine
from opentinker.sampler_server.kernels import Backend, Kernel, resolve_kernel
from opentinker.sampler_server.scheduler import Scheduler
from opentinker.sampler_server.slot_pool import SlotPool
from opentinker.v1 import sampler_pb2, sampler_pb2_grpc

MODULE = "model.layers.0.self_attn.q_proj"
SHAPES = {MODULE: (8, 6)}  # (d_in, d_out)


@pytest.mark.parametrize(
    ("flag", "device", "triton", "expected"),
    [
        ("auto", "cpu", False, "segments"),
        ("auto", "cpu", True, "segments"),
        ("auto", "cuda", True, "triton"),
        ("auto", "cuda", False, "segments"),  # CUDA without triton
        ("segments", "cuda", True, "segments"),
        ("reference", "cpu", False, "reference"),
        ("triton", "cpu", True, "triton"),
    ],
)
def test_resolve_kernel(flag: Backend, device: str, triton: bool, expected: Kernel) -> None:
    assert resolve_kernel(flag, device, triton_available=triton) == expected


def test_resolve_kernel_refuses_an_unknown_flag() -> None:
    with pytest.raises(ValueError, match="unknown LoRA backend"):
        resolve_kernel(cast(Backend, "cuda"), "cpu")


def kernel_used(monkeypatch: pytest.MonkeyPatch, flag: Backend, device: str) -> tuple[Kernel, list[str]]:
    """An engine made with `flag` on `device` (a stand-in cache: only its device and size are read), and the kernel
    functions its LoRA hook calls on a two-token batch of adapter slot 1."""
    pool = SlotPool(SHAPES, max_slots=2, max_rank=2, device=torch.device("cpu"))
    pool.tensors.scaling[1], pool.tensors.ranks[1] = 1.0, 2
    cache = types.SimpleNamespace(device=torch.device(device), num_blocks=2, block_size=8)
    engine = Engine(
        cast(Any, None),
        cast(Any, cache),
        pool.tensors,
        Scheduler(max_seqs=1, max_batch_tokens=8),
        release=pool.release,
        max_len=8,
        eos_token_ids=(),
        kernel=flag,
    )
    calls: list[str] = []

    def recorder(name: str) -> Any:
        def record(*args: Any, **kwargs: Any) -> int:
            calls.append(name)
            return 0  # the reference path adds what it returns

        return record

    monkeypatch.setattr(lora_plan, "add_lora_runs", recorder("segments"))
    monkeypatch.setattr(kernels, "add_lora_segments", recorder("segments, unplanned"))
    monkeypatch.setattr(kernels, "add_lora_triton", recorder("triton"))
    monkeypatch.setattr(kernels, "lora_delta_reference", recorder("reference"))
    hook = engine._lora_hook([1, 1], [1])
    assert hook is not None
    hook(MODULE, torch.zeros(2, 8), torch.zeros(2, 6))
    return engine.kernel, calls


@pytest.mark.parametrize("triton", [False, True])
@pytest.mark.parametrize("flag", ["auto", "segments", "reference", "triton"])
def test_the_engine_runs_the_resolved_kernel_on_the_cpu(
    monkeypatch: pytest.MonkeyPatch, flag: Backend, triton: bool
) -> None:
    monkeypatch.setattr(kernels, "TRITON_AVAILABLE", triton)
    reported = resolve_kernel(flag, "cpu")
    assert kernel_used(monkeypatch, flag, "cpu") == (reported, [reported])
    assert kernel_used(monkeypatch, reported, "cpu") == (reported, [reported])  # the server passes it resolved


def test_cuda_without_triton_runs_the_planned_segments_it_reports(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kernels, "TRITON_AVAILABLE", False)
    reported = resolve_kernel("auto", "cuda")
    assert reported == "segments"
    # The planned path builds no device tensor, so a CUDA engine's hook runs here without a GPU.
    assert kernel_used(monkeypatch, "auto", "cuda") == ("segments", ["segments"])


def test_sampler_info_reports_the_engine_process_kernel(
    sampler: sampler_pb2_grpc.SamplerServiceStub,
    tiny_model: Path,
    registry_server: ServerProcess,
    tmp_path: Path,
) -> None:
    """The session's sampler (CPU, --kernel auto) and one with --kernel reference, both with the engine in its own
    process: GetSamplerInfo says what that process's engine runs."""
    assert sampler.GetSamplerInfo(sampler_pb2.GetSamplerInfoRequest()).lora_kernel == "segments"
    server = start_sampler(tmp_path, tiny_model, registry_server, "--kernel", "reference", "--max-slots", "2")
    try:
        with grpc.insecure_channel(server.address) as channel:
            info = sampler_pb2_grpc.SamplerServiceStub(channel).GetSamplerInfo(sampler_pb2.GetSamplerInfoRequest())
        assert info.lora_kernel == "reference"
    finally:
        assert server.terminate() == 0, server.log()
