"""One step's LoRA plan: the hook the model forward calls after every projection, adding each token's own
adapter delta (and each logit row's after the unembedding), planned once per step from the rows' slots."""

from __future__ import annotations

from collections.abc import Callable

import torch

from opentinker.sampler_server.kernels import Kernel, add_lora
from opentinker.sampler_server.kernels.segments import RunViews, add_lora_runs, plan_runs, plan_segments
from opentinker.sampler_server.slot_pool import SlotTensors
from opentinker.weights.base_model import UNEMBED_MODULE

LoraHook = Callable[[str, torch.Tensor, torch.Tensor], torch.Tensor]


def lora_hook(
    lora: SlotTensors,
    kernel: Kernel,
    views: RunViews,
    token_slots: list[int],
    row_slots: list[int],
    device: torch.device,
) -> LoraHook | None:
    """Each token's LoRA delta, added after every projection, and each logit row's after the unembedding
    (lm_head sees the M logit rows, `row_slots`, not the N tokens). `views`: the slot pool's weight views per
    LoRA run, kept across steps by the engine. None: a base-model-only batch, no LoRA work at all."""
    if not any(token_slots):
        return None
    ranks = lora.ranks.tolist()
    unembed = lora.unembed.tolist()
    row_slots = [slot if unembed[slot] else 0 for slot in row_slots]  # only versions with a LoRA on lm_head
    if kernel == "segments":  # its planned form: rows are ordered by slot, the plan serves every projection
        scales = lora.scaling.tolist()
        runs = plan_runs(plan_segments(token_slots, ranks, scales), lora.scaling)
        row_runs = plan_runs(plan_segments(row_slots, ranks, scales), lora.scaling)

        def planned(module: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            if module in lora.a:
                add_lora_runs(
                    y,
                    x,
                    lora.a[module],
                    lora.b[module],
                    row_runs if module == UNEMBED_MODULE else runs,
                    views,
                    module,
                )
            return y

        return planned
    slot_ids = torch.tensor(token_slots, dtype=torch.long, device=device)
    row_ids = torch.tensor(row_slots, dtype=torch.long, device=device)
    any_unembed = any(row_slots)

    def hook(module: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if module in lora.a and (any_unembed or module != UNEMBED_MODULE):
            ids = row_ids if module == UNEMBED_MODULE else slot_ids
            add_lora(y, x, lora.a[module], lora.b[module], lora.scaling, ids, ranks=ranks, backend=kernel)
        return y

    return hook
