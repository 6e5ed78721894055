"""What the benchmarks run on: the model sizes, random LoRA adapters in peft format, prompts and traffic
(Zipf adapter popularity, Poisson arrivals). Everything is generated locally and seeded."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import random
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from opentinker.weights.peft import lora_a_key, lora_b_key


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """TinyModelSpec's size fields (that module imports transformers, which a server-only benchmark skips)."""

    arch: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int


# The model: hidden 896, intermediate 4864, 4 layers, 14 heads / 2 KV heads, vocab 8192.
FULL_SPEC = ModelSpec(
    arch="qwen2",
    vocab_size=8192,
    hidden_size=896,
    intermediate_size=4864,
    num_hidden_layers=4,
    num_attention_heads=14,
    num_key_value_heads=2,
)
QUICK_SPEC = ModelSpec(
    arch="qwen2",
    vocab_size=2048,
    hidden_size=256,
    intermediate_size=1024,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
)
RANK = 16
ALPHA = 32
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
CACHE = Path(__file__).resolve().parent.parent / "build" / "bench-models"

Weights = dict[str, tuple[torch.Tensor, torch.Tensor]]  # module -> (A [r, d_in], B [d_out, r])


def spec_config(spec: ModelSpec) -> dict[str, str | int | float | bool | None]:
    return {
        "model": f"{spec.arch} hidden {spec.hidden_size}, intermediate {spec.intermediate_size}, "
        f"{spec.num_hidden_layers} layers, {spec.num_attention_heads}/{spec.num_key_value_heads} heads, "
        f"vocab {spec.vocab_size}",
        "lora": f"rank {RANK}, alpha {ALPHA}, all linear ({len(TARGETS)} projections per layer)",
    }


def model_dir(spec: ModelSpec) -> Path:
    """The model for `spec`, written once under build/bench-models (make_tiny_model is deterministic)."""
    key = hashlib.sha256(json.dumps(dataclasses.asdict(spec), sort_keys=True).encode()).hexdigest()[:16]
    target = CACHE / key
    if not target.exists():
        from opentinker.client.tiny_model import TinyModelSpec, make_tiny_model  # imports transformers: slow

        tmp = CACHE / f"{key}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        make_tiny_model(tmp, TinyModelSpec(**dataclasses.asdict(spec)))
        tmp.rename(target)
    return target


def linear_shapes(spec: ModelSpec) -> dict[str, tuple[int, int]]:
    """HF module path -> (d_in, d_out) of every projection (as LlamaForCausalLM.linear_shapes names them)."""
    h, head_dim = spec.hidden_size, spec.hidden_size // spec.num_attention_heads
    q, kv, inter = spec.num_attention_heads * head_dim, spec.num_key_value_heads * head_dim, spec.intermediate_size
    per_layer = {
        "self_attn.q_proj": (h, q),
        "self_attn.k_proj": (h, kv),
        "self_attn.v_proj": (h, kv),
        "self_attn.o_proj": (q, h),
        "mlp.gate_proj": (h, inter),
        "mlp.up_proj": (h, inter),
        "mlp.down_proj": (inter, h),
    }
    return {f"model.layers.{i}.{m}": s for i in range(spec.num_hidden_layers) for m, s in per_layer.items()}


def lora_weights(shapes: dict[str, tuple[int, int]], seed: int) -> Weights:
    """Random A and B (B non-zero, unlike peft's init), sized so each adapter really changes the output."""
    generator = torch.Generator().manual_seed(seed)
    return {
        module: (
            torch.randn(RANK, d_in, generator=generator) / d_in**0.5,  # A: [r, d_in]
            torch.randn(d_out, RANK, generator=generator) * 0.02,  # B: [d_out, r]
        )
        for module, (d_in, d_out) in shapes.items()
    }


def raw_bytes(shapes: dict[str, tuple[int, int]]) -> int:
    """Bytes of one rank-RANK adapter's parameters in float32."""
    return sum(RANK * (d_in + d_out) * 4 for d_in, d_out in shapes.values())


def peft_files(weights: Weights) -> dict[str, bytes]:
    """A peft-format artifact: adapter_config.json + adapter_model.safetensors."""
    from safetensors.torch import save

    tensors: dict[str, torch.Tensor] = {}
    for module, (a, b) in weights.items():
        tensors[lora_a_key(module)] = a.contiguous()
        tensors[lora_b_key(module)] = b.contiguous()
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": RANK,
        "lora_alpha": ALPHA,
        "lora_dropout": 0.0,
        "bias": "none",
        "target_modules": list(TARGETS),
        "use_rslora": False,
    }
    return {"adapter_config.json": json.dumps(config).encode(), "adapter_model.safetensors": bytes(save(tensors))}


def prompts(count: int, vocab: int, *, lens: tuple[int, int] = (12, 20), seed: int = 2) -> list[list[int]]:
    """Random token prompts, lengths uniform in [lo, hi] (mean ~16); ids from 3 on (skips special tokens)."""
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(*lens))] for _ in range(count)]


def zipf_draws(items: int, count: int, *, s: float = 1.1, seed: int = 3) -> list[int]:
    """`count` draws from Zipf(s) over ranks 0..items-1 (P(k) ~ 1 / (k + 1)^s)."""
    weights = [math.pow(k + 1, -s) for k in range(items)]
    return random.Random(seed).choices(range(items), weights=weights, k=count)


def zipf_mass(items: int, top: int, s: float = 1.1) -> float:
    """Share of Zipf(s) traffic over `items` that goes to the `top` most popular ones."""
    weights = [math.pow(k + 1, -s) for k in range(items)]
    return sum(weights[:top]) / sum(weights)


def poisson_arrivals(rate: float, count: int, *, seed: int = 4) -> list[float]:
    """Arrival times (seconds from 0) of a Poisson process of `rate` requests per second."""
    rng = random.Random(seed)
    times, now = [], 0.0
    for _ in range(count):
        now += -math.log(1.0 - rng.random()) / rate
        times.append(now)
    return times


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100]); nan for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q / 100 * len(ordered)) - 1))]
