"""The base model's shape, read from a Hugging Face model directory (config.json + generation_config.json).

Only the Llama family is served (llama, mistral, qwen2, qwen3): one decoder block with RMSNorm, rotary
attention with grouped-query heads and a SwiGLU MLP; the RoPE variants of `rope.py`. Anything the sampler's
forward would silently get wrong (another architecture, longrope, per-layer sliding windows) fails at startup
with a clear message, in every process, before any weights are read.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import cast

from opentinker.rpc.serving.errors import FailedPrecondition, InvalidArgument
from opentinker.weights.base_model import SUPPORTED_ARCHITECTURES
from opentinker.weights.rope import RopeConfig, parse_rope

JsonDict = dict[str, object]


@dataclass(frozen=True, slots=True)
class ModelConfig:
    arch: str  # config.json model_type: one of SUPPORTED_ARCHITECTURES
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeConfig
    max_position_embeddings: int
    # The longest sequence served and trained: max_position_embeddings, or for yarn / dynamic RoPE the pretrained
    # length times the scaling factor when that is longer (Qwen2.5's model card keeps 32768 and adds factor 4).
    context_length: int
    tie_word_embeddings: bool
    attention_bias: bool  # q/k/v (and for llama/qwen3 also o) projections carry a bias
    qk_norm: bool  # qwen3: RMSNorm over each head of q and k before RoPE
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    pad_token_id: int | None
    sliding_window: int | None = None  # mistral: a key is visible to a query only if q_pos - k_pos < window


def _read_json(path: Path) -> JsonDict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise InvalidArgument(f"cannot read {path}: {exc}", reason="INVALID_MODEL_CONFIG") from exc
    if not isinstance(data, dict):
        raise InvalidArgument(f"{path} is not a JSON object", reason="INVALID_MODEL_CONFIG")
    return cast(JsonDict, data)


def _int(raw: JsonDict, key: str, default: int | None = None) -> int:
    value = raw.get(key)
    if value is None:
        if default is None:
            raise InvalidArgument(f"config.json lacks {key!r}", reason="INVALID_MODEL_CONFIG")
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidArgument(f"config.json {key!r} must be an integer, got {value!r}", reason="INVALID_MODEL_CONFIG")
    return value


def _float(raw: JsonDict, key: str, default: float) -> float:
    value = raw.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidArgument(f"config.json {key!r} must be a number, got {value!r}", reason="INVALID_MODEL_CONFIG")
    return float(value)


def _token_ids(value: object) -> tuple[int, ...]:
    """An eos/bos/pad field: null, one id or a list of ids."""
    if value is None:
        return ()
    items = value if isinstance(value, list) else [value]
    ids: list[int] = []
    for item in items:
        if isinstance(item, bool) or not isinstance(item, int):
            raise InvalidArgument(f"token id must be an integer, got {item!r}", reason="INVALID_MODEL_CONFIG")
        ids.append(item)
    return tuple(ids)


def _first_id(*values: object) -> int | None:
    for value in values:
        ids = _token_ids(value)
        if ids:
            return ids[0]
    return None


def _sliding_window(raw: JsonDict, model_type: str) -> int | None:
    if model_type == "mistral":  # one window on every layer; transformers' default is 4096 when the key is absent
        if "sliding_window" in raw and raw["sliding_window"] is None:
            return None
        return _int(raw, "sliding_window", 4096)
    if model_type in ("qwen2", "qwen3") and raw.get("use_sliding_window") is True:
        raise FailedPrecondition(
            f"model_type {model_type!r} with use_sliding_window=true (per-layer windows) is not supported",
            reason="UNSUPPORTED_ARCHITECTURE",
        )
    return None


def _context_length(rope: RopeConfig, max_positions: int) -> int:
    if rope.rope_type in ("yarn", "dynamic"):
        original = rope.original_max_position_embeddings or max_positions
        return max(max_positions, int(original * rope.factor))
    return max_positions


def parse_config(raw: JsonDict, generation: JsonDict | None = None) -> ModelConfig:
    """Check and convert config.json (+ generation_config.json) contents."""
    model_type = raw.get("model_type")
    if model_type not in SUPPORTED_ARCHITECTURES:
        raise FailedPrecondition(
            f"model_type {model_type!r} is not a supported family; supported: {', '.join(SUPPORTED_ARCHITECTURES)} "
            "(Llama 3.x, Mistral, Qwen2.5, Qwen3)",
            reason="UNSUPPORTED_ARCHITECTURE",
        )
    arch: str = model_type
    hidden_act = raw.get("hidden_act", "silu")
    if hidden_act != "silu":
        raise FailedPrecondition(
            f"model_type {arch!r} with hidden_act {hidden_act!r} is not supported (only 'silu')",
            reason="UNSUPPORTED_ARCHITECTURE",
        )
    hidden_size = _int(raw, "hidden_size")
    num_heads = _int(raw, "num_attention_heads")
    num_kv_heads = _int(raw, "num_key_value_heads", num_heads)
    if num_heads % num_kv_heads != 0:
        raise InvalidArgument(
            f"num_attention_heads {num_heads} is not a multiple of num_key_value_heads {num_kv_heads}",
            reason="INVALID_MODEL_CONFIG",
        )
    head_dim = _int(raw, "head_dim", 128 if arch == "qwen3" else hidden_size // num_heads)
    if arch == "qwen2":
        attention_bias = True  # Qwen2 always has q/k/v biases (and none on o_proj)
    elif arch == "mistral":
        attention_bias = False
    else:
        attention_bias = raw.get("attention_bias") is True
    max_positions = _int(raw, "max_position_embeddings", 2048)
    rope = parse_rope(raw, arch, max_positions)
    gen = generation or {}
    eos = _token_ids(gen.get("eos_token_id")) or _token_ids(raw.get("eos_token_id"))
    return ModelConfig(
        arch=arch,
        vocab_size=_int(raw, "vocab_size"),
        hidden_size=hidden_size,
        intermediate_size=_int(raw, "intermediate_size"),
        num_layers=_int(raw, "num_hidden_layers"),
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        rms_norm_eps=_float(raw, "rms_norm_eps", 1e-6),
        rope=rope,
        max_position_embeddings=max_positions,
        context_length=_context_length(rope, max_positions),
        tie_word_embeddings=raw.get("tie_word_embeddings") is True,
        attention_bias=attention_bias,
        qk_norm=arch == "qwen3",
        eos_token_ids=eos,
        bos_token_id=_first_id(gen.get("bos_token_id"), raw.get("bos_token_id")),
        pad_token_id=_first_id(gen.get("pad_token_id"), raw.get("pad_token_id")),
        sliding_window=_sliding_window(raw, arch),
    )


def load_config(model_dir: Path) -> ModelConfig:
    """Read `model_dir`/config.json and, when present, generation_config.json (its eos ids win)."""
    config_path = Path(model_dir) / "config.json"
    if not config_path.is_file():
        raise InvalidArgument(f"{model_dir} has no config.json", reason="INVALID_MODEL_CONFIG")
    generation_path = Path(model_dir) / "generation_config.json"
    generation = _read_json(generation_path) if generation_path.is_file() else None
    return parse_config(_read_json(config_path), generation)
