"""What every Triton launch wrapper here needs before its first launch: the kernel module, imported lazily (once
per process, so CPU-only processes never pay for or depend on triton), and the device check (CUDA tensors, or
the interpreter on CPU: TRITON_INTERPRET=1 set before the first launch)."""

from __future__ import annotations

import functools
import importlib
import os
from types import ModuleType

import torch


@functools.cache
def kernel_module(name: str, what: str) -> ModuleType:
    """``opentinker.sampler_server.kernels.<name>``, imported on first use; ``what`` names it in the error."""
    try:
        return importlib.import_module(f"opentinker.sampler_server.kernels.{name}")
    except ImportError as e:
        raise RuntimeError(f"{what} needs the triton package: {e}") from e


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "").lower() in ("1", "true", "yes", "on")


def check_launchable(x: torch.Tensor, what: str) -> None:
    """Raises unless ``what`` can run on x's device: CUDA, or the CPU under TRITON_INTERPRET=1."""
    if not x.is_cuda and not interpreting():
        raise RuntimeError(f"{what} needs CUDA tensors, or TRITON_INTERPRET=1 to run on the CPU")
