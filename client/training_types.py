"""The training SDK's typed records (Tinker-style): the LoRA and AdamW configuration users build and what the
trainer's calls return.

Every type is a frozen, slotted dataclass holding tuples (and plain dicts for mappings, so that values
pickle). Their conversion to and from the wire protos lives in `opentinker.client.wire` (internal: no
protobuf message appears in a public signature).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime
from typing import Literal

from opentinker.client.datum import TensorData

__all__ = [
    "AdamParams",
    "ForwardBackwardOutput",
    "LoraConfig",
    "OptimStepResult",
    "ResetResult",
    "SavedState",
    "StartedFrom",
    "TrainerInfo",
    "TrainingAdapterInfo",
]

ALL_LINEAR = "all-linear"
"""LoraConfig.target_modules for every linear layer (the wire spells it as an empty list)."""


def _strings(values: Iterable[str], what: str) -> tuple[str, ...]:
    # A bare string is iterable too; ("stable") instead of ("stable",) would otherwise become 6 items.
    if isinstance(values, str):
        raise TypeError(f"{what} must be a sequence of strings, not a single string")
    return tuple(values)


# Configuration


@dataclass(frozen=True, slots=True)
class LoraConfig:
    """LoRA hyper-parameters. alpha None means alpha = rank (scaling 1).

    target_modules: "attn", "mlp", "all-linear" (attn + mlp), "lm_head" (the unembedding) or explicit module names
    ("q_proj", "down_proj", ...), in any combination.
    """

    rank: int = 32
    alpha: float | None = None
    dropout: float = 0.0
    target_modules: tuple[str, ...] = (ALL_LINEAR,)

    def __post_init__(self) -> None:
        # Lists are accepted (and stored as a tuple, keeping the config hashable); a bare string is refused.
        object.__setattr__(self, "target_modules", _strings(self.target_modules, "target_modules"))


@dataclass(frozen=True, slots=True)
class AdamParams:
    """AdamW parameters of an optimizer step (Tinker defaults). grad_clip_norm 0 disables clipping.

    The trainer reads a zero field as "use the default", so beta1 = 0 or beta2 = 0 cannot be requested.
    """

    learning_rate: float = 1e-4
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-12
    weight_decay: float = 0.0
    grad_clip_norm: float = 0.0


# Results


@dataclass(frozen=True, slots=True)
class ForwardBackwardOutput:
    """The result of forward_backward (or forward).

    ``logprobs[i]`` holds datum i's target-token logprobs, one per model_input position;
    ``loss_fn_outputs[i]`` every per-datum output tensor ("logprobs" always). ``metrics`` are named
    "name:reduction" ("loss:sum", "tokens:sum", ...). ``batch_digest`` is the batch's id in the adapter's
    data ledger and ``step`` the optimizer step these gradients go into; forward sets neither ("" and 0).
    """

    logprobs: tuple[tuple[float, ...], ...]
    loss_fn_outputs: tuple[dict[str, TensorData], ...]
    metrics: dict[str, float]
    batch_digest: str = ""
    step: int = 0

    @property
    def loss(self) -> float:
        """The summed loss of the batch (metrics["loss:sum"])."""
        return self.metrics["loss:sum"]


@dataclass(frozen=True, slots=True)
class OptimStepResult:
    """step: the adapter's step count after this step. metrics: "grad_norm:value", "learning_rate:value"."""

    step: int
    metrics: dict[str, float]


@dataclass(frozen=True, slots=True)
class TrainingAdapterInfo:
    """An adapter's training state as the trainer holds it.

    ``pending_batches``: forward_backward calls whose gradients await the next optim_step;
    ``last_snapshot_version``: the last version save_snapshot published (0: none); ``resident``: False
    while its state is offloaded from the training device; ``adam``: the defaults optim_step uses.
    """

    name: str
    rank: int
    alpha: float
    target_modules: tuple[str, ...]
    step: int
    tokens_trained: int
    datums_trained: int
    pending_batches: int
    last_snapshot_version: int
    num_parameters: int
    resident: bool
    dropout: float
    seed: int
    adam: AdamParams
    created_at: datetime | None
    parent_adapter: str = ""  # last_snapshot_version's adapter when another one (a fork); "": this adapter

    @property
    def lora(self) -> LoraConfig:
        return LoraConfig(rank=self.rank, alpha=self.alpha, dropout=self.dropout, target_modules=self.target_modules)


@dataclass(frozen=True, slots=True)
class StartedFrom:
    """What create_training_client's adapter started from. kind: "fresh" (weights from the seed), "version"
    (``adapter``@``version``'s weights, fresh optimizer) or "state" (``state_id``: weights, optimizer, step, RNG;
    ``version`` the one it was saved with, when --persist-state saved it). ``description``: one line for people."""

    kind: Literal["fresh", "version", "state"]
    adapter: str
    version: int
    state_id: str
    description: str


@dataclass(frozen=True, slots=True)
class ResetResult:
    """A reset: the adapter now holds ``adapter``@``version``'s weights (the next snapshot's parent);
    ``optimizer_kept``: whether the AdamW moments were kept (else fresh)."""

    adapter: str
    version: int
    optimizer_kept: bool
    info: TrainingAdapterInfo


@dataclass(frozen=True, slots=True)
class SavedState:
    """A saved training state: pass ``state_id`` to load_state or create_training_client(resume_state=...)."""

    state_id: str
    step: int
    size_bytes: int


@dataclass(frozen=True, slots=True)
class TrainerInfo:
    """The base model a trainer holds and what it can train."""

    model: str
    model_digest: str
    architecture: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    max_position_embeddings: int
    dtype: str
    device: str
    loss_fns: tuple[str, ...]
    lora_target_modules: tuple[str, ...] = ()
    max_resident_adapters: int = 0
    served_name: str = ""  # the model's public name (a hub id or --served-model-name), which clients send
