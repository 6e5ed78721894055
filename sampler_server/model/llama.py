"""The sampler's own forward for Llama-family decoders (llama, mistral, qwen2, qwen3), over a slot KV cache.

One `forward` serves any mix of sequences: whole-prompt prefill, a prefill chunk on top of a cached prefix,
and single-token decode. Projections run on the flat [N, d] tokens of all sequences (no padding); only
attention looks at sequences one by one (prefill) or as one gathered batch (decode). After every
q/k/v/o/gate/up/down projection the engine's `LoraHook` may add each token's LoRA delta.

Numerics follow transformers' modeling_llama/qwen2/qwen3/mistral (RMSNorm in float32, rotate-half RoPE with
cos/sin cast to the model dtype, residual adds in the model dtype), so fp32 logits agree to ~1e-6.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch
import torch.nn.functional as F

from opentinker.rpc.errors import InvalidArgument
from opentinker.sampler_server.model.kv_cache import KVCache
from opentinker.weights.model_config import ModelConfig, load_config


class LoraHook(Protocol):
    def __call__(self, module: str, x: torch.Tensor, y: torch.Tensor, /) -> torch.Tensor:
        """module: HF path ("model.layers.0.self_attn.q_proj"); x: [N, d_in]; y: [N, d_out] base output.

        Returns y plus each token's LoRA delta. Positional-only, so any plain `Callable[[str, Tensor, Tensor],
        Tensor]` is a LoraHook.
        """
        ...


@dataclass(frozen=True, slots=True)
class ForwardBatch:
    tokens: torch.Tensor  # [N] int64, the new tokens of every sequence, concatenated
    positions: torch.Tensor  # [N] int64, absolute position of each token in its sequence
    kv_slots: list[int]  # [B] cache slot of each sequence
    new_lens: list[int]  # [B] new tokens per sequence in this batch (decode: all 1)
    context_lens: list[int]  # [B] tokens of each sequence in the cache after this step (prefix + new)
    logits_indices: torch.Tensor  # [M] int64 indices into the N tokens whose logits are wanted

    @classmethod
    def build(
        cls, chunks: Sequence[Sequence[int]], prefix_lens: Sequence[int], kv_slots: Sequence[int], *, all_logits: bool
    ) -> ForwardBatch:
        """Sequence b appends tokens `chunks[b]` after `prefix_lens[b]` cached ones; logits of the last token of
        each sequence, or of every token when `all_logits`."""
        tokens: list[int] = []
        positions: list[int] = []
        wanted: list[int] = []
        for chunk, prefix in zip(chunks, prefix_lens, strict=True):
            start = len(tokens)
            tokens.extend(chunk)
            positions.extend(range(prefix, prefix + len(chunk)))
            wanted.extend(range(start, len(tokens)) if all_logits else [len(tokens) - 1])
        return cls(
            tokens=torch.tensor(tokens, dtype=torch.int64),
            positions=torch.tensor(positions, dtype=torch.int64),
            kv_slots=list(kv_slots),
            new_lens=[len(chunk) for chunk in chunks],
            context_lens=[prefix + len(chunk) for chunk, prefix in zip(chunks, prefix_lens, strict=True)],
            logits_indices=torch.tensor(wanted, dtype=torch.int64),
        )


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


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # x: [..., d] -> [..., d]; statistics in float32, scale applied in the input dtype (as transformers does)
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    # x: [..., head_dim]; (x1, x2) -> (-x2, x1)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [N, heads, head_dim]; cos, sin: [N, head_dim]
    return x * cos[:, None] + rotate_half(x) * sin[:, None]


# Rows for which the CPU computes float32 x @ W^T as (W @ x^T)^T: at decode batch sizes MKL's sgemm runs that
# operand order 15-30% faster (hidden 896 -> 4864, 16-32 rows, one thread; the benchmark's decode step ~15%
# faster); at 1-4 rows and from 64 rows on plain F.linear is as fast or faster. Other dtypes
# (oneDNN) and CUDA (cuBLAS picks its own layout) keep F.linear.
TRANSPOSED_GEMM_ROWS = range(16, 49)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    # x: [N, d_in], weight: [d_out, d_in] (dense or oneDNN-packed), bias: [d_out] -> [N, d_out] contiguous
    if weight.is_mkldnn:
        n, rows = x.shape[0], packed_rows(x.shape[0])
        if rows != n:  # zeros in the padding rows only (F.pad would zero the whole buffer first: 4% of a prefill)
            padded = x.new_empty(rows, x.shape[1])
            padded[:n] = x
            padded[n:].zero_()
            x = padded
        else:
            x = x.contiguous()
        y: torch.Tensor = torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
        return y[:n]  # [rows, d_out] -> its first n rows, still contiguous
    if x.device.type == "cpu" and x.dtype == torch.float32 and x.shape[0] in TRANSPOSED_GEMM_ROWS:
        y_t = torch.mm(weight, x.t()) if bias is None else torch.addmm(bias[:, None], weight, x.t())  # [d_out, N]
        return y_t.t().contiguous()
    return F.linear(x, weight, bias)


def packed_rows(n: int) -> int:
    """Rows a oneDNN matmul of n rows runs with. oneDNN builds and keeps a kernel with its own buffers for every
    input shape (measured on the benchmark model: +940 MiB RSS over 64 decode sizes and 54 prefill lengths), so
    rows are padded to few sizes: multiples of 8 up to 64, then 4 sizes per doubling (at most 25% padding);
    the same traffic then costs +264 MiB, about what the dense path's allocations cost (+162 MiB)."""
    if n <= 64:
        return -(-n // 8) * 8
    step = 1 << (n.bit_length() - 3)
    return -(-n // step) * step


def pack_onednn(weight: torch.Tensor) -> torch.Tensor:
    """A float32 CPU matrix [d_out, d_in] in oneDNN's blocked layout for `linear` (an opaque tensor). oneDNN's
    packed sgemm beats the dense path at every batch size we measured (1.4-2x at 4-64 rows on AMD EPYC, where
    MKL's sgemm is slow), and the packing does not depend on the batch size."""
    packed: torch.Tensor = torch.ops.mkldnn._reorder_linear_weight(weight, None)
    return packed


def onednn_packing_works() -> bool:
    """Whether this torch build has oneDNN's packed linear (private ops of torch's CPU inductor path) and it agrees
    with F.linear on a probe."""
    try:
        if not torch.backends.mkldnn.is_available():  # type: ignore[no-untyped-call]
            return False
        generator = torch.Generator().manual_seed(0)
        weight, x = torch.randn(48, 40, generator=generator), torch.randn(5, 40, generator=generator)
        bias = torch.randn(48, generator=generator)
        packed = linear(x, pack_onednn(weight), bias)
        return bool(torch.allclose(packed, F.linear(x, weight, bias), rtol=1e-5, atol=1e-5))
    except (RuntimeError, AttributeError):
        return False


def _linear(module: str, weights: Linear, x: torch.Tensor, lora: LoraHook | None) -> torch.Tensor:
    y = linear(x, weights.weight, weights.bias)  # x: [N, d_in] -> y: [N, d_out]
    return y if lora is None else lora(module, x, y)


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


class LlamaForCausalLM:
    """Frozen base weights as plain tensors plus the forward over a `KVCache`."""

    def __init__(
        self,
        config: ModelConfig,
        embed: torch.Tensor,  # [vocab, hidden]
        layers: list[LayerWeights],
        norm: torch.Tensor,  # [hidden]
        lm_head: torch.Tensor,  # [vocab, hidden]
    ) -> None:
        self.config = config
        self.embed = embed
        self.layers = layers
        self.norm = norm
        self.lm_head = lm_head
        self.device = embed.device
        self.dtype = embed.dtype
        # inv_freq: [head_dim / 2], computed on the CPU in float32 exactly like transformers' default RoPE.
        exponents = torch.arange(0, config.head_dim, 2, dtype=torch.int64).to(torch.float32) / config.head_dim
        self.inv_freq = (1.0 / (config.rope_theta**exponents)).to(self.device)

    @classmethod
    def from_pretrained(cls, model_dir: Path, *, device: torch.device, dtype: torch.dtype) -> LlamaForCausalLM:
        config = load_config(Path(model_dir))
        c = config
        shapes = _projection_shapes(c)  # projection -> (d_out, d_in)
        with ExitStack() as stack:
            ckpt = _Checkpoint(Path(model_dir), stack)

            def take(name: str, *shape: int) -> torch.Tensor:
                return ckpt.get(name, shape).to(device=device, dtype=dtype)

            def linear(prefix: str, proj: str, need_bias: bool) -> Linear:
                d_out, d_in = shapes[proj]
                bias_name = f"{prefix}.{proj}.bias"
                has_bias = need_bias or ckpt.has(bias_name)
                return Linear(
                    take(f"{prefix}.{proj}.weight", d_out, d_in), take(bias_name, d_out) if has_bias else None
                )

            layers: list[LayerWeights] = []
            for i in range(c.num_layers):
                p = f"model.layers.{i}"
                layers.append(
                    LayerWeights(
                        input_norm=take(f"{p}.input_layernorm.weight", c.hidden_size),
                        q_proj=linear(p, "self_attn.q_proj", c.attention_bias),
                        k_proj=linear(p, "self_attn.k_proj", c.attention_bias),
                        v_proj=linear(p, "self_attn.v_proj", c.attention_bias),
                        o_proj=linear(p, "self_attn.o_proj", False),
                        q_norm=take(f"{p}.self_attn.q_norm.weight", c.head_dim) if c.qk_norm else None,
                        k_norm=take(f"{p}.self_attn.k_norm.weight", c.head_dim) if c.qk_norm else None,
                        post_norm=take(f"{p}.post_attention_layernorm.weight", c.hidden_size),
                        gate_proj=linear(p, "mlp.gate_proj", False),
                        up_proj=linear(p, "mlp.up_proj", False),
                        down_proj=linear(p, "mlp.down_proj", False),
                    )
                )
            embed = take("model.embed_tokens.weight", c.vocab_size, c.hidden_size)
            norm = take("model.norm.weight", c.hidden_size)
            tied = c.tie_word_embeddings or not ckpt.has("lm_head.weight")
            lm_head = embed if tied else take("lm_head.weight", c.vocab_size, c.hidden_size)
        return cls(config, embed, layers, norm, lm_head)

    def pack_for_cpu(self) -> bool:
        """Float32 on the CPU: every projection and the LM head become oneDNN-packed weights (the dense copies are
        dropped; a tied LM head gets its own packed copy, the embedding stays dense). Returns whether it did."""
        if self.device.type != "cpu" or self.dtype != torch.float32 or not onednn_packing_works():
            return False

        def packed(weights: Linear) -> Linear:
            return Linear(pack_onednn(weights.weight), weights.bias)

        def packed_layer(layer: LayerWeights) -> LayerWeights:
            return dataclasses.replace(
                layer, q_proj=packed(layer.q_proj), k_proj=packed(layer.k_proj), v_proj=packed(layer.v_proj),
                o_proj=packed(layer.o_proj), gate_proj=packed(layer.gate_proj), up_proj=packed(layer.up_proj),
                down_proj=packed(layer.down_proj),
            )  # fmt: skip

        self.layers = [packed_layer(layer) for layer in self.layers]
        self.lm_head = pack_onednn(self.lm_head)
        return True

    def linear_shapes(self) -> dict[str, tuple[int, int]]:
        """HF module path of every LoRA-targetable projection -> (d_in, d_out)."""
        return linear_shapes(self.config)

    def forward(self, batch: ForwardBatch, cache: KVCache, lora: LoraHook | None = None) -> torch.Tensor:
        """Append the batch's tokens to their cache slots and return float32 logits [M, vocab]."""
        _check_batch(batch, cache)
        with torch.inference_mode():
            return self._forward(batch, cache, lora)

    def _forward(self, batch: ForwardBatch, cache: KVCache, lora: LoraHook | None) -> torch.Tensor:
        c, dev = self.config, self.device
        tokens = batch.tokens.to(dev)  # [N]
        positions = batch.positions.to(dev)  # [N]
        n = tokens.shape[0]
        # Cache address of every new token: (slot, position).
        token_slots = torch.repeat_interleave(
            torch.tensor(batch.kv_slots, dtype=torch.int64), torch.tensor(batch.new_lens, dtype=torch.int64)
        ).to(dev)  # [N]
        freqs = positions.to(torch.float32)[:, None] * self.inv_freq[None, :]  # [N, head_dim / 2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [N, head_dim]
        cos, sin = emb.cos().to(self.dtype), emb.sin().to(self.dtype)
        plan = _AttentionPlan(batch, positions, dev, c.sliding_window)

        h = F.embedding(tokens, self.embed)  # [N, hidden]
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}"
            x = rms_norm(h, layer.input_norm, c.rms_norm_eps)  # [N, hidden]
            q = _linear(f"{p}.self_attn.q_proj", layer.q_proj, x, lora).view(n, c.num_heads, c.head_dim)
            k = _linear(f"{p}.self_attn.k_proj", layer.k_proj, x, lora).view(n, c.num_kv_heads, c.head_dim)
            v = _linear(f"{p}.self_attn.v_proj", layer.v_proj, x, lora).view(n, c.num_kv_heads, c.head_dim)
            if layer.q_norm is not None and layer.k_norm is not None:
                q = rms_norm(q, layer.q_norm, c.rms_norm_eps)
                k = rms_norm(k, layer.k_norm, c.rms_norm_eps)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
            # cache.k[i]: [slots, kv_heads, max_len, head_dim]; [token_slots, :, positions] addresses [N, kv_heads, hd]
            cache.k[i][token_slots, :, positions] = k
            cache.v[i][token_slots, :, positions] = v
            attn = self._attention(q, cache.k[i], cache.v[i], plan)  # [N, heads * head_dim]
            h = h + _linear(f"{p}.self_attn.o_proj", layer.o_proj, attn, lora)

            x = rms_norm(h, layer.post_norm, c.rms_norm_eps)
            gate = _linear(f"{p}.mlp.gate_proj", layer.gate_proj, x, lora)  # [N, intermediate]
            up = _linear(f"{p}.mlp.up_proj", layer.up_proj, x, lora)  # [N, intermediate]
            h = h + _linear(f"{p}.mlp.down_proj", layer.down_proj, F.silu(gate) * up, lora)

        rows = h[batch.logits_indices.to(dev)]  # [M, hidden]
        logits = linear(rms_norm(rows, self.norm, c.rms_norm_eps), self.lm_head)  # [M, vocab]
        return logits.float()

    def _attention(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: _AttentionPlan
    ) -> torch.Tensor:
        # q: [N, heads, head_dim]; k_cache, v_cache: [slots, kv_heads, max_len, head_dim] -> [N, heads * head_dim]
        c = self.config
        n, group = q.shape[0], c.num_heads // c.num_kv_heads
        out = q.new_empty(n, c.num_heads, c.head_dim)
        if plan.decode_rows is not None:
            # All single-token sequences at once; the `group` query heads sharing a kv head become that head's
            # query rows, so no K/V is repeated: q [B, kv_heads, group, hd] against k, v [B, kv_heads, T, hd].
            rows, slots, t = plan.decode_rows, plan.decode_slots, plan.decode_len
            qd = (q if plan.decode_only else q[rows]).view(-1, c.num_kv_heads, group, c.head_dim)
            kd, vd = k_cache[slots, :, :t], v_cache[slots, :, :t]
            od = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=plan.decode_mask)  # [B, kv_heads, group, hd]
            if plan.decode_only:  # rows are all N tokens in order: no scatter
                return od.reshape(n, c.num_heads * c.head_dim)
            out[rows] = od.reshape(-1, c.num_heads, c.head_dim)
        for start, length, slot, context in plan.prefills:
            qs = q[start : start + length].transpose(0, 1)[None]  # [1, heads, L, hd]
            ks, vs = k_cache[slot, :, :context][None], v_cache[slot, :, :context][None]  # [1, kv_heads, ctx, hd]
            if context == length and c.sliding_window is None:  # whole prompt: plain causal
                o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True)
            else:  # continuation of a cached prefix: query at position p sees keys at positions <= p
                mask = attention_mask(plan.positions[start : start + length], context, c.sliding_window)
                mask = mask[None, None]  # [1, 1, L, ctx]
                o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, enable_gqa=True)
            out[start : start + length] = o[0].transpose(0, 1)  # [L, heads, hd]
        return out.view(n, c.num_heads * c.head_dim)


def attention_mask(q_pos: torch.Tensor, length: int, sliding_window: int | None) -> torch.Tensor:
    # q_pos: [M] -> bool [M, length]: True where the query at q_pos may attend to the key at that position
    k_pos = torch.arange(length, device=q_pos.device)[None, :]
    mask = k_pos <= q_pos[:, None]
    if sliding_window is not None:
        mask &= k_pos > q_pos[:, None] - sliding_window
    return mask


class _AttentionPlan:
    """How one batch's sequences meet attention: single-token ones gathered together (with one mask for every
    layer), the rest one by one."""

    def __init__(
        self, batch: ForwardBatch, positions: torch.Tensor, device: torch.device, sliding_window: int | None
    ) -> None:
        self.positions = positions  # [N]
        decode_rows: list[int] = []
        decode_slots: list[int] = []
        self.decode_len = 0
        self.prefills: list[tuple[int, int, int, int]] = []  # (first token, new tokens, slot, context length)
        for start, slot, length, context in _segments(batch):
            if length == 1:
                decode_rows.append(start)
                decode_slots.append(slot)
                self.decode_len = max(self.decode_len, context)
            else:
                self.prefills.append((start, length, slot, context))
        self.decode_rows = torch.tensor(decode_rows, dtype=torch.int64, device=device) if decode_rows else None
        self.decode_slots = torch.tensor(decode_slots, dtype=torch.int64, device=device)
        self.decode_only = not self.prefills  # then decode row i is token i
        self.decode_mask: torch.Tensor | None = None  # [B, 1, 1, T] bool
        if self.decode_rows is not None:
            mask = attention_mask(positions[self.decode_rows], self.decode_len, sliding_window)
            self.decode_mask = mask[:, None, None, :]


def _segments(batch: ForwardBatch) -> Iterator[tuple[int, int, int, int]]:
    """(first token index, kv slot, new tokens, context length) of each sequence."""
    start = 0
    for slot, length, context in zip(batch.kv_slots, batch.new_lens, batch.context_lens, strict=True):
        yield start, slot, length, context
        start += length


def _check_batch(batch: ForwardBatch, cache: KVCache) -> None:
    """Host-side consistency checks (no device sync); a failure is a scheduler bug, hence ValueError."""
    n = batch.tokens.shape[0]
    if not len(batch.kv_slots) == len(batch.new_lens) == len(batch.context_lens):
        raise ValueError("kv_slots, new_lens and context_lens must have one entry per sequence")
    if batch.positions.shape != (n,) or sum(batch.new_lens) != n:
        raise ValueError(
            f"{n} tokens but positions {tuple(batch.positions.shape)} and new_lens sum {sum(batch.new_lens)}"
        )
    if len(set(batch.kv_slots)) != len(batch.kv_slots):
        raise ValueError(f"a kv slot appears twice in one batch: {batch.kv_slots}")
    for slot, length, context in zip(batch.kv_slots, batch.new_lens, batch.context_lens, strict=True):
        if not 0 <= slot < cache.max_seqs:
            raise ValueError(f"kv slot {slot} outside [0, {cache.max_seqs})")
        if not 1 <= length <= context <= cache.max_len:
            raise ValueError(f"need 1 <= new_len {length} <= context_len {context} <= cache max_len {cache.max_len}")


def _projection_shapes(c: ModelConfig) -> dict[str, tuple[int, int]]:
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
    """HF module path of every LoRA-targetable projection -> (d_in, d_out), from the config alone (a server
    process that leaves the weights to its engine process sizes its adapter slots with this)."""
    per_layer = _projection_shapes(config)
    return {
        f"model.layers.{i}.{proj}": (d_in, d_out)
        for i in range(config.num_layers)
        for proj, (d_out, d_in) in per_layer.items()
    }
