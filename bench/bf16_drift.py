"""How far the sampler's and the trainer's logprobs drift apart in bfloat16, per model family.

Sampler/trainer mismatch is the most common complaint of RL users: the sampler's logprobs (q) and the trainer's
(p) of the same tokens should agree, or importance ratios p/q are noise. Both processes compute in float32
exactly (the support-matrix tests hold them to 1e-5); in bfloat16 they round differently (the sampler's own
forward vs transformers' modeling code). For each scaled family copy (`make-tiny-model --like`, random weights)
this runs, side by side on the same 320 tokens: transformers in float32 (the reference), the trainer's model
(transformers) in bfloat16 and the sampler's forward in bfloat16, and prints per family the mean and max
|logprob difference| and the mean KL(sampler || trainer) per token over the whole vocabulary, for the sampler's
prefill (ComputeLogprobs) and for its decode steps (the logprobs a Sample returns).

    .venv/bin/python bench/bf16_drift.py [--quick]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path
from typing import Any

import torch
from results import record

from opentinker.client.model_families import FAMILIES
from opentinker.client.tiny_model import make_family_model
from opentinker.sampler_server.model import ForwardBatch, KVCache, LlamaForCausalLM

CPU = torch.device("cpu")
PREFIX = 32


def _tokens(length: int) -> list[int]:
    return torch.randint(3, 500, (length,), generator=torch.Generator().manual_seed(0)).tolist()


def _transformers_logits(model_dir: Path, dtype: torch.dtype, tokens: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model: Any = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    model.eval()
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0, :-1].double().log_softmax(-1)  # type: ignore[no-any-return]


def _sampler_logits(model_dir: Path, dtype: torch.dtype, tokens: list[int]) -> torch.Tensor:
    model = LlamaForCausalLM.from_pretrained(model_dir, device=CPU, dtype=dtype)
    cache = KVCache(model.config, 1, len(tokens), CPU, dtype)
    logits = model.forward(ForwardBatch.build([tokens], [0], kv_slots=[0], all_logits=True), cache)
    return logits[:-1].double().log_softmax(-1)


def _sampler_decode_logits(model_dir: Path, dtype: torch.dtype, tokens: list[int], prefix: int) -> torch.Tensor:
    """The sampler's logprobs as sampling produces them: a prefill of `prefix` tokens, then one decode step per
    token (teacher-forced), each over the KV cache. Rows for positions prefix-1 .. len-2."""
    model = LlamaForCausalLM.from_pretrained(model_dir, device=CPU, dtype=dtype)
    cache = KVCache(model.config, 1, len(tokens), CPU, dtype)
    rows = [model.forward(ForwardBatch.build([tokens[:prefix]], [0], kv_slots=[0], all_logits=False), cache)[-1]]
    for position in range(prefix, len(tokens) - 1):
        batch = ForwardBatch.build([[tokens[position]]], [position], kv_slots=[0], all_logits=False)
        rows.append(model.forward(batch, cache)[-1])
    return torch.stack(rows).double().log_softmax(-1)


def _picked(logprobs: torch.Tensor, tokens: list[int]) -> torch.Tensor:
    return logprobs.gather(1, torch.tensor(tokens[1:])[:, None])[:, 0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="three families, 160 tokens")
    args = parser.parse_args()
    families = ["llama3.2", "qwen2.5", "qwen3"] if args.quick else list(FAMILIES)
    tokens = _tokens(160 if args.quick else 320)
    print(f"{len(tokens)} tokens, random-weight scaled copies (hidden 64, 2 layers), CPU")
    print("sampler vs trainer: fp32 (prefill, max |d|); bf16 prefill (ComputeLogprobs, prompt logprobs) and bf16")
    print(f"decode (the logprobs sampling returns: prefill of {PREFIX}, then one token per step); KL(sampler||trainer)")
    print(
        f"{'family':14} {'fp32 max|d|':>12} {'pre mean|d|':>13} {'pre max|d|':>12} {'pre KL/token':>14} "
        f"{'dec mean|d|':>13} {'dec max|d|':>12} {'dec KL/token':>14} "
        f"{'trainer bf16 vs fp32 mean|d|':>29}"
    )
    worst_mean, worst_kl = 0.0, 0.0
    with tempfile.TemporaryDirectory() as tmp:
        for family in families:
            model_dir = make_family_model(Path(tmp) / family, family, seed=1)
            reference = _transformers_logits(model_dir, torch.float32, tokens)
            fp32 = _sampler_logits(model_dir, torch.float32, tokens)
            trainer = _transformers_logits(model_dir, torch.bfloat16, tokens)
            sampler = _sampler_logits(model_dir, torch.bfloat16, tokens)
            decode = _sampler_decode_logits(model_dir, torch.bfloat16, tokens, PREFIX)
            exact = float((_picked(fp32, tokens) - _picked(reference, tokens)).abs().max())
            diff = (_picked(sampler, tokens) - _picked(trainer, tokens)).abs()
            kl = float((sampler.exp() * (sampler - trainer)).sum(-1).mean())
            tail = trainer[PREFIX - 1 :]  # the positions the decode steps predicted
            decode_diff = (_picked(decode, tokens[PREFIX - 1 :]) - _picked(tail, tokens[PREFIX - 1 :])).abs()
            decode_kl = float((decode.exp() * (decode - tail)).sum(-1).mean())
            trainer_drift = float((_picked(trainer, tokens) - _picked(reference, tokens)).abs().mean())
            print(
                f"{family:14} {exact:12.2e} {float(diff.mean()):13.2e} {float(diff.max()):12.2e} {kl:14.2e} "
                f"{float(decode_diff.mean()):13.2e} {float(decode_diff.max()):12.2e} {decode_kl:14.2e} "
                f"{trainer_drift:29.2e}"
            )
            worst_mean = max(worst_mean, float(diff.mean()), float(decode_diff.mean()))
            worst_kl = max(worst_kl, kl, decode_kl)
    config: dict[str, str | int] = {
        "families": ",".join(families),
        "tokens": len(tokens),
        "model": "scaled copies, random weights",
    }
    record(
        "bf16 sampler vs trainer mean |logprob diff| (worst family, prefill or decode)",
        worst_mean,
        unit="nats",
        config=config,
    )
    record(
        "bf16 sampler vs trainer KL per token (worst family, prefill or decode)", worst_kl, unit="nats", config=config
    )


if __name__ == "__main__":
    main()
