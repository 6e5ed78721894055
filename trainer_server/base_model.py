"""The frozen base model with a LoRA hook in every targetable Linear (the projections and the unembedding).

Each targetable `nn.Linear` is replaced by a `LoraLinear` that holds the frozen base layer and, only while an
adapter's compute runs, a reference to that adapter's A/B tensors. Adapters never own modules of the base
model and never touch its `requires_grad` flags, so no optimizer can pick up another adapter's parameters
(the peft "active adapter" bug class): each adapter keeps its own explicit parameter list.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import nn

from opentinker.rpc.serving.errors import InvalidArgument
from opentinker.weights.base_model import (
    ATTN_MODULES,
    MLP_MODULES,
    UNEMBED_MODULE,
    model_digest,
    resolve_model_dir,
)
from opentinker.weights.model_config import load_config
from opentinker.weights.served_name import served_model_name


@dataclass(slots=True)
class LoraWeights:
    """One adapter's tensors for one module: y += scaling * dropout(x) A^T B^T."""

    a: nn.Parameter  # [r, d_in]
    b: nn.Parameter  # [d_out, r]
    scaling: float
    dropout: float
    generator: torch.Generator | None  # the adapter's own RNG, for dropout masks


class LoraLinear(nn.Module):
    def __init__(self, base: nn.Linear) -> None:
        super().__init__()
        self.base = base
        self.active: LoraWeights | None = None

    @property
    def in_features(self) -> int:
        return self.base.in_features

    @property
    def out_features(self) -> int:
        return self.base.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y: torch.Tensor = self.base(x)  # [..., d_out]
        lora = self.active
        if lora is None:
            return y
        h = x.to(lora.a.dtype)
        if lora.dropout > 0 and self.training:
            keep = 1.0 - lora.dropout
            mask = torch.empty_like(h).bernoulli_(keep, generator=lora.generator)
            h = h * mask / keep
        delta = (h @ lora.a.T) @ lora.b.T  # [..., r] -> [..., d_out], rank-sized intermediate in fp32
        out: torch.Tensor = y + (delta * lora.scaling).to(y.dtype)
        return out


@dataclass(frozen=True, slots=True)
class ModuleShape:
    d_in: int
    d_out: int


class BaseModel:
    """HF causal LM, frozen, with LoraLinear hooks; compute happens on one thread at a time."""

    def __init__(
        self,
        model_path: str,
        *,
        device: str = "cpu",
        dtype: str = "float32",
        revision: str | None = None,
        served_name: str | None = None,
    ) -> None:
        from transformers import AutoModelForCausalLM

        # The same config checks as the sampler's: a model one process refuses, the other refuses too.
        model_dir = resolve_model_dir(model_path, revision)
        self.served_name = served_model_name(model_path, served_name, model_dir)  # refused before the load
        self.shape = load_config(model_dir)  # eos/bos/pad ids as every process reads them (lists included)
        torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
        self.model_path = model_path
        self.device = torch.device(device)
        self.dtype = dtype
        # safetensors only, as the sampler (sampler_server/model/weights.py): a pytorch_model.bin is a pickle.
        if not any(model_dir.glob("*.safetensors")):
            raise InvalidArgument(
                f"{model_dir} has no *.safetensors weights (pickled weights are never loaded)",
                reason="INVALID_MODEL_WEIGHTS",
            )
        self.model: Any = cast(
            Any, AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch_dtype, use_safetensors=True)
        )
        self.model.to(self.device)
        self.model.eval()
        for parameter in self.model.parameters():
            parameter.requires_grad_(False)
        config = self.model.config  # the one transformers read while loading the weights
        self.config = config
        self.vocab_size = int(config.vocab_size)
        self.max_positions = self.shape.context_length
        self.hooks: dict[str, LoraLinear] = {}
        self._inject()
        self.model_dir = model_dir
        self.digest = model_digest(model_dir)

    def _inject(self) -> None:
        targets = set(ATTN_MODULES + MLP_MODULES)
        for name, module in list(self.model.named_modules()):
            for child_name, child in list(module.named_children()):
                # The unembedding only at the top (the CausalLM's own lm_head): when tied, its weight is the
                # embedding's, which stays frozen and unchanged; the LoRA delta is added to the logits alone.
                wanted = child_name in targets or (child_name == UNEMBED_MODULE and not name)
                if isinstance(child, nn.Linear) and wanted:
                    hook = LoraLinear(child)
                    setattr(module, child_name, hook)
                    self.hooks[f"{name}.{child_name}" if name else child_name] = hook

    def module_shapes(self) -> dict[str, ModuleShape]:
        return {name: ModuleShape(h.in_features, h.out_features) for name, h in self.hooks.items()}

    def resolve_targets(self, requested: list[str]) -> list[str]:
        """Target spec ("attn", "mlp", "all-linear" = attn + mlp, leaf names incl. "lm_head") -> full module paths."""
        leaves: set[str] = set()
        names = (*ATTN_MODULES, *MLP_MODULES, UNEMBED_MODULE)
        for item in requested or ["all-linear"]:
            if item == "all-linear":
                leaves.update(ATTN_MODULES + MLP_MODULES)
            elif item == "attn":
                leaves.update(ATTN_MODULES)
            elif item == "mlp":
                leaves.update(MLP_MODULES)
            elif item in names:
                leaves.add(item)
            else:
                raise InvalidArgument(
                    f"unknown LoRA target module {item!r}: use attn, mlp, all-linear (attn + mlp) or one of "
                    f"{', '.join(names)}",
                    reason="INVALID_LORA_CONFIG",
                    field="lora_config.target_modules",
                )
        return [name for name in self.hooks if name.rsplit(".", 1)[-1] in leaves]

    @contextlib.contextmanager
    def activate(self, weights: Mapping[str, LoraWeights], *, training: bool) -> Iterator[None]:
        """Routes every hooked module to this adapter's weights for the duration of one computation."""
        for name, hook in self.hooks.items():
            hook.active = weights.get(name)
            hook.train(training)
        try:
            yield
        finally:
            for hook in self.hooks.values():
                hook.active = None
                hook.train(False)
