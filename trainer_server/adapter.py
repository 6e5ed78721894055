"""One adapter's training state: its own LoRA parameters, AdamW, step, RNG and data ledger.

`params` is the explicit, ordered parameter list the optimizer was built from; nothing here is found by
scanning modules for requires_grad, so a step of one adapter cannot touch another's weights.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch
from torch import nn

from opentinker.trainer_server.adapter_config import AdamParams, LoraConfig
from opentinker.trainer_server.base_model import LoraWeights, ModuleShape
from opentinker.trainer_server.ledger import Ledger
from opentinker.trainer_server.spill import Offloaded
from opentinker.weights.peft import lora_a_key, lora_b_key


@dataclass(slots=True)
class AdapterState:
    name: str
    lora: LoraConfig
    adam: AdamParams
    seed: int
    modules: dict[str, LoraWeights]
    generator: torch.Generator
    optimizer: torch.optim.AdamW
    step: int = 0
    ledger: Ledger = field(default_factory=Ledger)
    last_snapshot_version: int = 0
    # Adapter of last_snapshot_version when the weights came from another adapter's version (init_from, reset).
    parent_adapter: str = ""
    create_time: float = field(default_factory=time.time)
    resident: bool = True
    # Offloaded weights, gradients and AdamW moments while not resident on a GPU (None: on disk or resident).
    offloaded: Offloaded | None = None
    # sha256 of the spill file written when it went to disk (spill.py): a restore accepts that file only.
    spill_digest: str = ""
    last_used: float = field(default_factory=time.monotonic)
    # Counted once at creation: offloading empties the tensors, not the adapter.
    num_parameters: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        self.num_parameters = sum(p.numel() for p in self.params)

    @property
    def params(self) -> list[nn.Parameter]:
        return [p for weights in self.modules.values() for p in (weights.a, weights.b)]

    def has_gradients(self) -> bool:
        return any(p.grad is not None for p in self.params)

    def peft_state_dict(self) -> dict[str, torch.Tensor]:
        """Weights under peft's key names, so PeftModel.from_pretrained loads the snapshot."""
        tensors: dict[str, torch.Tensor] = {}
        for name, weights in sorted(self.modules.items()):
            tensors[lora_a_key(name)] = weights.a.detach().to("cpu", torch.float32).contiguous()
            tensors[lora_b_key(name)] = weights.b.detach().to("cpu", torch.float32).contiguous()
        return tensors

    def load_peft_state_dict(self, tensors: dict[str, torch.Tensor]) -> None:
        expected = {key(n) for n in self.modules for key in (lora_a_key, lora_b_key)}
        missing, extra = expected - tensors.keys(), tensors.keys() - expected
        if missing or extra:
            raise ValueError(
                f"adapter weights do not match the config: missing {sorted(missing)[:3]}, extra {sorted(extra)[:3]}"
            )
        for name, weights in self.modules.items():  # every shape checked before anything is copied
            for key, param in ((lora_a_key(name), weights.a), (lora_b_key(name), weights.b)):
                if tensors[key].shape != param.shape:
                    raise ValueError(f"{key} has shape {list(tensors[key].shape)}, expected {list(param.shape)}")
        with torch.no_grad():
            for name, weights in self.modules.items():
                weights.a.copy_(tensors[lora_a_key(name)])
                weights.b.copy_(tensors[lora_b_key(name)])

    def peft_config(self, base_model_path: str) -> dict[str, object]:
        leaves = sorted({n.rsplit(".", 1)[-1] for n in self.modules})
        return {
            "base_model_name_or_path": base_model_path,
            "bias": "none",
            "fan_in_fan_out": False,
            "inference_mode": True,
            "init_lora_weights": True,
            "lora_alpha": self.lora.alpha,
            "lora_dropout": self.lora.dropout,
            "modules_to_save": None,
            "peft_type": "LORA",
            "r": self.lora.rank,
            "target_modules": leaves,
            "task_type": "CAUSAL_LM",
            "use_dora": False,
            "use_rslora": False,
        }


def new_adapter(
    name: str,
    lora: LoraConfig,
    adam: AdamParams,
    seed: int,
    shapes: dict[str, ModuleShape],
    device: torch.device,
) -> AdapterState:
    """Fresh LoRA weights from the adapter's seed: A kaiming-uniform (as peft), B zero (delta starts at 0)."""
    generator = torch.Generator(device=device)  # init and dropout masks; saved with the state
    generator.manual_seed(seed)
    scaling = lora.alpha / lora.rank
    modules: dict[str, LoraWeights] = {}
    for module_name, shape in shapes.items():
        a = torch.empty(lora.rank, shape.d_in, device=device)
        bound = 1.0 / math.sqrt(shape.d_in)  # kaiming_uniform(a=sqrt(5)) bound for fan_in d_in
        a.uniform_(-bound, bound, generator=generator)
        b = torch.zeros(shape.d_out, lora.rank, device=device)
        modules[module_name] = LoraWeights(
            a=nn.Parameter(a),
            b=nn.Parameter(b),
            scaling=scaling,
            dropout=lora.dropout,
            generator=generator if lora.dropout > 0 else None,
        )
    params = [p for w in modules.values() for p in (w.a, w.b)]
    optimizer = torch.optim.AdamW(
        params,
        lr=adam.learning_rate,
        betas=(adam.beta1, adam.beta2),
        eps=adam.eps,
        weight_decay=adam.weight_decay,
    )
    return AdapterState(name, lora, adam, seed, modules, generator, optimizer)
