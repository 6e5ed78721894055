"""The peft LoRA format, as every process reads and writes it: file and key names, the rank limit, the alpha
default, and ONE validator of an adapter's config and tensors.

An adapter is usable when the trainer and the sampler compute exactly what peft computes: `adapter_config.json`
with peft_type LORA and none of the features that change the math (DoRA, fan_in_fan_out, LoRA biases, per-module
ranks or alphas, full weights in modules_to_save), and `adapter_model.safetensors` holding one
`lora_A`/`lora_B` pair per targeted projection (the output projection `lm_head` included), with shapes that agree
with the rank. `registry import`, the sampler's loader and the trainer's snapshot loading all call
`parse_peft_config` and `lora_modules`, so what one of them accepts the others accept too.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from opentinker.weights.base_model import LORA_TARGETS, UNEMBED_MODULE

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PEFT_FILES = (CONFIG_FILE, WEIGHTS_FILE)
# peft's key prefix for a causal LM: "base_model.model.<module path>.lora_A.weight".
PEFT_PREFIX = "base_model.model."
# The whole output layer, which peft's save_pretrained stores beside a LoRA on lm_head (save_embedding_layers="auto").
FULL_UNEMBED_KEY = f"{PEFT_PREFIX}{UNEMBED_MODULE}.base_layer.weight"
# The largest LoRA rank any process accepts (the sampler may serve less: its --max-rank).
MAX_RANK = 1024
# The largest LoRA scaling (alpha / r) and weight magnitude any process accepts. Trained adapters stay far below
# (|w| ~ 1e-3..10, scaling <= ~64); beyond these an adapter's delta overflows half precision or saturates the
# softmax, and one tenant's adapter could poison a shared batch. Refused at import, snapshot and load.
MAX_LORA_SCALING = 1024.0
MAX_LORA_WEIGHT = 1e4


class PeftFormatError(ValueError):
    """Not a usable peft LoRA adapter; the message says which file or tensor and why."""


class LoraMagnitudeError(PeftFormatError):
    """Weights that are not finite, or a weight or scaling beyond MAX_LORA_WEIGHT / MAX_LORA_SCALING."""


class _Tensor(Protocol):  # a torch.Tensor, typed structurally: this module does not import torch
    def abs(self) -> _Tensor: ...
    def max(self) -> _Tensor: ...
    def isfinite(self) -> _Tensor: ...
    def all(self) -> _Tensor: ...
    def item(self) -> float | int | bool: ...
    def numel(self) -> int: ...


def lora_a_key(module: str) -> str:
    return f"{PEFT_PREFIX}{module}.lora_A.weight"


def lora_b_key(module: str) -> str:
    return f"{PEFT_PREFIX}{module}.lora_B.weight"


def alpha_or_rank(alpha: float, rank: int) -> float:
    """The documented default: alpha 0 (unset) means alpha = rank, a scaling of 1."""
    return alpha or float(rank)


def lora_scaling(alpha: float, rank: int, *, use_rslora: bool = False) -> float:
    """peft's scaling of the LoRA delta: alpha / r, or alpha / sqrt(r) for rsLoRA."""
    return alpha / math.sqrt(rank) if use_rslora else alpha / rank


def check_lora_magnitudes(tensors: Mapping[str, _Tensor], scaling: float) -> None:
    """Refuses (LoraMagnitudeError naming the tensor) non-finite weights, a weight beyond MAX_LORA_WEIGHT and a
    scaling beyond MAX_LORA_SCALING: the one rule the registry's import, the trainer and the sampler apply."""
    if not math.isfinite(scaling) or abs(scaling) > MAX_LORA_SCALING:
        raise LoraMagnitudeError(f"LoRA scaling {scaling:g} (alpha / r) is beyond the limit of {MAX_LORA_SCALING:g}")
    present = {key: tensor for key, tensor in tensors.items() if tensor.numel()}
    if not present:
        return
    import torch  # here, not at module level: the registry's admin commands stay light

    # The common case costs one device sync for all tensors: the largest |w| of each (inf and NaN propagate),
    # without an abs() copy. Only a failure walks the tensors one by one to name the culprit.
    largest_of_all = torch.stack([torch.linalg.vector_norm(t, ord=math.inf).float() for t in present.values()]).max()
    if float(largest_of_all) <= MAX_LORA_WEIGHT:
        return
    for key, tensor in present.items():
        if not bool(tensor.isfinite().all().item()):
            raise LoraMagnitudeError(f"{key} holds non-finite values (inf or NaN)")
        largest = float(tensor.abs().max().item())
        if largest > MAX_LORA_WEIGHT:
            raise LoraMagnitudeError(
                f"{key} holds a weight of magnitude {largest:.3g}, beyond the limit of {MAX_LORA_WEIGHT:g}"
            )


@dataclass(frozen=True, slots=True)
class PeftConfig:
    rank: int
    alpha: float
    dropout: float
    use_rslora: bool
    target_modules: tuple[str, ...]  # as written in the config (may be empty)
    base_model_name_or_path: str

    @property
    def scaling(self) -> float:
        return lora_scaling(self.alpha, self.rank, use_rslora=self.use_rslora)


def parse_peft_config(config: object) -> PeftConfig:
    """The parsed contents of adapter_config.json; refuses every peft feature that would change the math."""
    if not isinstance(config, dict):
        raise PeftFormatError(f"{CONFIG_FILE} must hold a JSON object")
    if config.get("peft_type", "LORA") != "LORA":
        raise PeftFormatError(f"peft_type {config.get('peft_type')!r} is not supported (only LORA)")
    for flag, what in (
        ("use_dora", "DoRA"),
        ("fan_in_fan_out", "fan_in_fan_out (Conv1D) layouts"),
        ("lora_bias", "LoRA bias terms"),
    ):
        if config.get(flag):
            raise PeftFormatError(f"{what} is not supported ({flag}: true)")
    for key in ("rank_pattern", "alpha_pattern"):
        if config.get(key):
            raise PeftFormatError(f"per-module ranks or alphas ({key}) are not supported")
    if config.get("modules_to_save"):
        raise PeftFormatError(f"modules_to_save {config['modules_to_save']} (full weights) are not supported")
    if config.get("bias", "none") not in ("none", None):
        raise PeftFormatError(f"bias {config['bias']!r} is not supported (only 'none')")
    rank = config.get("r")
    if not isinstance(rank, int) or isinstance(rank, bool) or not 1 <= rank <= MAX_RANK:
        raise PeftFormatError(f"rank r={rank!r} must be an integer in [1, {MAX_RANK}]")
    alpha = config.get("lora_alpha", rank)
    dropout = config.get("lora_dropout", 0.0) or 0.0
    if isinstance(alpha, bool) or not isinstance(alpha, int | float) or not math.isfinite(alpha) or alpha <= 0:
        raise PeftFormatError(f"lora_alpha {alpha!r} must be a positive number")
    if isinstance(dropout, bool) or not isinstance(dropout, int | float) or not 0 <= dropout < 1:
        raise PeftFormatError(f"lora_dropout {dropout!r} must be in [0, 1)")
    targets = config.get("target_modules")
    target_list = [str(t) for t in targets] if isinstance(targets, list) else []
    return PeftConfig(
        rank=rank,
        alpha=float(alpha),
        dropout=float(dropout),
        use_rslora=bool(config.get("use_rslora")),
        target_modules=tuple(target_list),
        base_model_name_or_path=str(config.get("base_model_name_or_path") or ""),
    )


def read_peft_config(path: Path) -> PeftConfig:
    try:
        raw = json.loads(path.read_text())
    except OSError as exc:
        raise PeftFormatError(f"cannot read {CONFIG_FILE}: {exc.strerror or exc}") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise PeftFormatError(f"{CONFIG_FILE} is not valid JSON: {exc}") from None
    return parse_peft_config(raw)


def lora_modules(shapes: Mapping[str, Sequence[int]], config: PeftConfig) -> dict[str, tuple[int, int]]:
    """Module path (without the peft prefix) -> (d_in, d_out) of every lora_A/lora_B pair in a weights file
    whose tensor shapes are `shapes`; refuses anything else in it, and pairs that disagree with the config."""
    modules: dict[str, tuple[int, int]] = {}
    for key, shape in shapes.items():
        if key.endswith(".lora_B.weight") and key.replace(".lora_B.", ".lora_A.") in shapes:
            continue
        if key == FULL_UNEMBED_KEY:
            raise PeftFormatError(
                f"{WEIGHTS_FILE}: {key} is a full copy of lm_head (peft saves one with a LoRA on "
                "lm_head): re-save the adapter with save_pretrained(..., "
                "save_embedding_layers=False), or import it with --base-model, which leaves out "
                "a copy equal to the base model's"
            )
        if not key.startswith(PEFT_PREFIX) or not key.endswith(".lora_A.weight"):
            raise PeftFormatError(
                f"{WEIGHTS_FILE}: unexpected tensor {key!r} (only "
                f"'{PEFT_PREFIX}<module>.lora_A.weight' / '.lora_B.weight' pairs)"
            )
        module = key.removeprefix(PEFT_PREFIX).removesuffix(".lora_A.weight")
        b_shape = shapes.get(lora_b_key(module))
        if b_shape is None:
            raise PeftFormatError(f"{WEIGHTS_FILE}: {module} has lora_A but no lora_B")
        if len(shape) != 2 or len(b_shape) != 2 or shape[0] != config.rank or b_shape[1] != config.rank:
            raise PeftFormatError(
                f"{WEIGHTS_FILE}: {module} has lora_A {list(shape)} / lora_B {list(b_shape)}, "
                f"which does not match rank r={config.rank}"
            )
        leaf = module.rsplit(".", 1)[-1]
        if leaf not in LORA_TARGETS:
            raise PeftFormatError(f"targets {module!r}; only {', '.join(sorted(LORA_TARGETS))} can be served")
        modules[module] = (int(shape[1]), int(b_shape[0]))
    if not modules:
        raise PeftFormatError(f"{WEIGHTS_FILE} holds no LoRA weights")
    leaves = {m.rsplit(".", 1)[-1] for m in modules}
    if config.target_modules and not leaves <= {t.rsplit(".", 1)[-1] for t in config.target_modules}:
        raise PeftFormatError(f"weights for {sorted(leaves)} but target_modules is {list(config.target_modules)}")
    return modules
