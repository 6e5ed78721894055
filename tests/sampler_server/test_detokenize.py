"""Streaming detokenization: the text deltas of a generation add up to decoding all its tokens at once, never
emit half a character, and each step decodes a window of a few tokens, not the whole output."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import AutoTokenizer

from opentinker.sampler_server.engine import Engine
from opentinker.sampler_server.model.kv_cache import KVCache
from opentinker.sampler_server.model.llama import LlamaForCausalLM
from opentinker.sampler_server.scheduler import Scheduler
from opentinker.sampler_server.sequence import SamplingParams, Sequence
from opentinker.sampler_server.slot_pool import SlotPool

CPU = torch.device("cpu")
TEXT = "Grüße, wörld ✓ 日本語のテキスト — naïve café 🙂 " * 12


class WindowSpy:
    """The tokenizer, recording how many ids each decode call gets."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.windows: list[int] = []

    def decode(self, ids: list[int], **kwargs: Any) -> str:
        self.windows.append(len(ids))
        text: str = self.tokenizer.decode(ids, **kwargs)
        return text


def detokenizing_engine(model: Path, tokenizer: Any) -> Engine:
    """An engine that is never started: only its detokenizer is used."""
    runner = LlamaForCausalLM.from_pretrained(model, device=CPU, dtype=torch.float32)
    pool = SlotPool(runner.linear_shapes(), max_slots=1, max_rank=4, device=CPU)
    return Engine(runner, KVCache(runner.config, 2, 8, CPU, torch.float32), pool.tensors,
                  Scheduler(max_seqs=1, max_batch_tokens=8), release=pool.release, max_len=8, eos_token_ids=(),
                  tokenizer=tokenizer)  # fmt: skip


def test_deltas_add_up_to_the_whole_text_from_small_windows(tiny_model: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    spy = WindowSpy(tokenizer)
    engine = detokenizing_engine(tiny_model, spy)
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    ids = [*ids[:40], eos, *ids[40:]]  # a special token inside: skipped, as in the final text
    assert len(ids) > 300
    seq = Sequence(seq_id=1, request_id="r", sample_index=0, prompt=[1], params=SamplingParams(), lora_slot=0)
    deltas = []
    for token in ids:
        seq.output.append(token)
        deltas.append(engine._detokenize(seq))
    deltas.append(engine._detokenize(seq, final=True))
    assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=True) == seq.text
    assert not any("\ufffd" in delta for delta in deltas)  # a character goes out whole, once complete
    assert sum(bool(delta) for delta in deltas) > len(ids) // 4  # streamed as it comes, not all at the end
    assert max(spy.windows) <= 8, max(spy.windows)  # windows, not the whole output (> 300 ids)


def test_held_back_bytes_go_out_at_the_end_as_they_are(tiny_model: Path) -> None:
    # A generation that stops in the middle of a character still returns everything it decoded.
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    engine = detokenizing_engine(tiny_model, tokenizer)
    ids = tokenizer.encode("ab🙂", add_special_tokens=False)
    cut = next(n for n in range(1, len(ids)) if str(tokenizer.decode(ids[:n])).endswith("\ufffd"))
    seq = Sequence(seq_id=1, request_id="r", sample_index=0, prompt=[1], params=SamplingParams(), lora_slot=0)
    deltas = []
    for token in ids[:cut]:
        seq.output.append(token)
        deltas.append(engine._detokenize(seq))
    assert "".join(deltas) == "ab"
    assert engine._detokenize(seq, final=True) == str(tokenizer.decode(ids[:cut]))[2:]
