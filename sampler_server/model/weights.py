"""The frozen base weights of a Llama-family checkpoint as plain tensors: read from its safetensors files (one
file or a sharded index), every shape checked against config.json."""

from __future__ import annotations

import json
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import torch

from opentinker.rpc.serving.errors import InvalidArgument
from opentinker.weights.base_model import UNEMBED_MODULE
from opentinker.weights.model_config import ModelConfig, load_config


@dataclass(frozen=True, slots=True)
class Linear:
    weight: torch.Tensor  # [d_out, d_in]
    bias: torch.Tensor | None  # [d_out]


@dataclass(frozen=True, slots=True)
class LayerWeights:
    input_norm: torch.Tensor  # [hidden]
    q_proj: Linear
    k_proj: Linear
    v_proj: Linear
    o_proj: Linear
    q_norm: torch.Tensor | None  # [head_dim] (qwen3)
    k_norm: torch.Tensor | None  # [head_dim] (qwen3)
    post_norm: torch.Tensor  # [hidden]
    gate_proj: Linear
    up_proj: Linear
    down_proj: Linear


@dataclass(frozen=True, slots=True)
class ModelWeights:
    config: ModelConfig
    embed: torch.Tensor  # [vocab, hidden]
    layers: list[LayerWeights]
    norm: torch.Tensor  # [hidden]
    lm_head: torch.Tensor  # [vocab, hidden]; the embedding itself when tied


class _Checkpoint:
    """The safetensors files of a model directory (one file or a sharded index), opened lazily by tensor name."""

    def __init__(self, model_dir: Path, stack: ExitStack) -> None:
        index = model_dir / "model.safetensors.index.json"
        if index.is_file():
            weight_map: dict[str, str] = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            self.files = {name: model_dir / file for name, file in weight_map.items()}
        else:
            self.files = {}
            from safetensors import safe_open

            for path in sorted(model_dir.glob("*.safetensors")):
                with safe_open(str(path), framework="pt") as handle:
                    self.files.update({name: path for name in handle.keys()})  # noqa: SIM118 (not a dict)
        if not self.files:
            raise InvalidArgument(f"{model_dir} has no *.safetensors weights", reason="INVALID_MODEL_WEIGHTS")
        self.stack = stack
        self.handles: dict[Path, object] = {}

    def has(self, name: str) -> bool:
        return name in self.files

    def get(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        from safetensors import safe_open

        path = self.files.get(name)
        if path is None:
            raise InvalidArgument(f"checkpoint lacks tensor {name!r}", reason="INVALID_MODEL_WEIGHTS")
        if path not in self.handles:
            self.handles[path] = self.stack.enter_context(safe_open(str(path), framework="pt"))
        tensor: torch.Tensor = self.handles[path].get_tensor(name)  # type: ignore[attr-defined]
        if tuple(tensor.shape) != shape:
            raise InvalidArgument(
                f"tensor {name!r} has shape {tuple(tensor.shape)}, config.json implies {shape}",
                reason="INVALID_MODEL_WEIGHTS",
            )
        return tensor


def load_weights(model_dir: Path, *, device: torch.device, dtype: torch.dtype) -> ModelWeights:
    c = load_config(Path(model_dir))
    shapes = projection_shapes(c)  # projection -> (d_out, d_in)
    with ExitStack() as stack:
        ckpt = _Checkpoint(Path(model_dir), stack)

        def take(name: str, *shape: int) -> torch.Tensor:
            return ckpt.get(name, shape).to(device=device, dtype=dtype)

        def projection(prefix: str, proj: str, need_bias: bool) -> Linear:
            d_out, d_in = shapes[proj]
            bias_name = f"{prefix}.{proj}.bias"
            has_bias = need_bias or ckpt.has(bias_name)
            return Linear(take(f"{prefix}.{proj}.weight", d_out, d_in), take(bias_name, d_out) if has_bias else None)

        layers: list[LayerWeights] = []
        for i in range(c.num_layers):
            p = f"model.layers.{i}"
            layers.append(
                LayerWeights(
                    input_norm=take(f"{p}.input_layernorm.weight", c.hidden_size),
                    q_proj=projection(p, "self_attn.q_proj", c.attention_bias),
                    k_proj=projection(p, "self_attn.k_proj", c.attention_bias),
                    v_proj=projection(p, "self_attn.v_proj", c.attention_bias),
                    o_proj=projection(p, "self_attn.o_proj", False),
                    q_norm=take(f"{p}.self_attn.q_norm.weight", c.head_dim) if c.qk_norm else None,
                    k_norm=take(f"{p}.self_attn.k_norm.weight", c.head_dim) if c.qk_norm else None,
                    post_norm=take(f"{p}.post_attention_layernorm.weight", c.hidden_size),
                    gate_proj=projection(p, "mlp.gate_proj", False),
                    up_proj=projection(p, "mlp.up_proj", False),
                    down_proj=projection(p, "mlp.down_proj", False),
                )
            )
        embed = take("model.embed_tokens.weight", c.vocab_size, c.hidden_size)
        norm = take("model.norm.weight", c.hidden_size)
        tied = c.tie_word_embeddings or not ckpt.has("lm_head.weight")
        lm_head = embed if tied else take("lm_head.weight", c.vocab_size, c.hidden_size)
    return ModelWeights(c, embed, layers, norm, lm_head)


def projection_shapes(c: ModelConfig) -> dict[str, tuple[int, int]]:
    """Projection within a layer ("self_attn.q_proj") -> its weight's shape (d_out, d_in)."""
    q_dim, kv_dim = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    return {
        "self_attn.q_proj": (q_dim, c.hidden_size),
        "self_attn.k_proj": (kv_dim, c.hidden_size),
        "self_attn.v_proj": (kv_dim, c.hidden_size),
        "self_attn.o_proj": (c.hidden_size, q_dim),
        "mlp.gate_proj": (c.intermediate_size, c.hidden_size),
        "mlp.up_proj": (c.intermediate_size, c.hidden_size),
        "mlp.down_proj": (c.hidden_size, c.intermediate_size),
    }


def linear_shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """HF module path of every LoRA-targetable projection -> (d_in, d_out), the unembedding `lm_head` (hidden ->
    vocab) last, from the config alone (a server process that leaves the weights to its engine process sizes its
    adapter slots with this)."""
    per_layer = projection_shapes(config)
    shapes = {
        f"model.layers.{i}.{proj}": (d_in, d_out)
        for i in range(config.num_layers)
        for proj, (d_out, d_in) in per_layer.items()
    }
    shapes[UNEMBED_MODULE] = (config.hidden_size, config.vocab_size)
    return shapes
