"""Moving an idle adapter off the device and back: its weights, gradients and AdamW moments go to CPU memory, or
to a spill file on disk when the device is the CPU (spill.py), and come back bitwise."""

from __future__ import annotations

from pathlib import Path

import torch

from opentinker.trainer_server.adapter import AdapterState
from opentinker.trainer_server.spill import Moments, Offloaded, read_spill, spill_path, write_spill


def offload(state: AdapterState, device: torch.device, spill_dir: Path | None) -> None:
    cpu = torch.device("cpu")
    offloaded = Offloaded(
        params=[p.detach().cpu() for p in state.params],
        grads=[None if p.grad is None else p.grad.detach().cpu() for p in state.params],
        # AdamW moments in parameter order (the state dict is keyed by the parameter objects).
        moments=[_moments_to(state.optimizer.state.get(p), cpu) for p in state.params],
    )
    if device.type == "cpu":
        assert spill_dir is not None, "offloading on CPU needs a spill directory"
        state.spill_digest = write_spill(spill_dir, state.name, offloaded)
        state.offloaded = None
    else:
        state.offloaded = offloaded
    for param in state.params:
        param.data = torch.empty(0, device=param.device)
        param.grad = None
    state.optimizer.state.clear()
    state.resident = False


def restore(state: AdapterState, device: torch.device, spill_dir: Path | None) -> None:
    """DATA_LOSS, changing nothing, when the spill file is not the one written."""
    offloaded = state.offloaded
    if offloaded is None:
        assert spill_dir is not None
        offloaded = read_spill(spill_dir, state.name, state.spill_digest)
    for param, data, grad in zip(state.params, offloaded.params, offloaded.grads, strict=True):
        param.data = data.to(device)
        param.grad = None if grad is None else grad.to(device)
    for param, saved in zip(state.params, offloaded.moments, strict=True):
        if saved is not None:
            state.optimizer.state[param] = _moments_to(saved, device)
    if state.offloaded is None and spill_dir is not None:
        spill_path(spill_dir, state.name).unlink(missing_ok=True)
    state.offloaded = None
    state.spill_digest = ""
    state.resident = True


def _moments_to(moments: Moments | None, device: torch.device) -> Moments | None:
    if moments is None:
        return None
    return {key: value.to(device) if isinstance(value, torch.Tensor) else value for key, value in moments.items()}
