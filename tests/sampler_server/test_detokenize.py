"""Streaming detokenization in the server process (detokenizer.py): the text deltas of a generation add up to decoding
all its tokens at once, never emit half a character, and each token decodes a window of a few tokens, not the whole
output (also when stray bytes never make a character); a stop string ends the sample at the token that completes it,
whatever the updates' sizes; the engine itself never decodes (it has no tokenizer) and frees a sample the server
finished."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoTokenizer

from opentinker.sampler_server.detokenizer import MAX_HELD_TOKENS, StreamText
from opentinker.sampler_server.engine import Engine
from opentinker.sampler_server.model.kv_cache import KVCache
from opentinker.sampler_server.model.llama import LlamaForCausalLM
from opentinker.sampler_server.scheduler import Scheduler
from opentinker.sampler_server.sequence import SamplingParams, Sequence, StopReason
from opentinker.sampler_server.slot_pool import SlotPool
from opentinker.sampler_server.update_stream import with_text
from opentinker.sampler_server.updates import SequenceUpdate

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


@pytest.fixture(scope="module")
def tokenizer(tiny_model: Path) -> Any:
    return AutoTokenizer.from_pretrained(tiny_model)


def test_deltas_add_up_to_the_whole_text_from_small_windows(tokenizer: Any) -> None:
    spy = WindowSpy(tokenizer)
    stream = StreamText(spy)
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    ids = [*ids[:40], eos, *ids[40:]]  # a special token inside: skipped, as in the final text
    assert len(ids) > 300
    deltas = [stream.feed([token], final=False).text for token in ids]
    deltas.append(stream.feed([], final=True).text)
    assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=True) == stream.text
    assert not any("\ufffd" in delta for delta in deltas)  # a character goes out whole, once complete
    assert sum(bool(delta) for delta in deltas) > len(ids) // 4  # streamed as it comes, not all at the end
    assert max(spy.windows) <= 8, max(spy.windows)  # windows, not the whole output (> 300 ids)


def test_updates_of_several_tokens_give_the_same_text(tokenizer: Any) -> None:
    ids = tokenizer.encode(TEXT, add_special_tokens=False)[:120]
    one_by_one = StreamText(tokenizer)
    single = "".join(one_by_one.feed([t], final=i == len(ids) - 1).text for i, t in enumerate(ids))
    chunked = StreamText(tokenizer)
    sizes = [1, 3, 7, 2, 11]
    text, at, turn = "", 0, 0
    while at < len(ids):
        chunk = ids[at : at + sizes[turn % len(sizes)]]
        at, turn = at + len(chunk), turn + 1
        text += chunked.feed(chunk, final=at >= len(ids)).text
    assert text == single == tokenizer.decode(ids, skip_special_tokens=True)


def test_held_back_bytes_go_out_at_the_end_as_they_are(tokenizer: Any) -> None:
    # A generation that stops in the middle of a character still returns everything it decoded.
    ids = tokenizer.encode("ab🙂", add_special_tokens=False)
    cut = next(n for n in range(1, len(ids)) if str(tokenizer.decode(ids[:n])).endswith("\ufffd"))
    stream = StreamText(tokenizer)
    assert "".join(stream.feed([t], final=False).text for t in ids[:cut]) == "ab"
    assert stream.feed([], final=True).text == str(tokenizer.decode(ids[:cut]))[2:]


def test_bytes_that_never_complete_a_character_go_out_as_replacements_from_small_windows(tokenizer: Any) -> None:
    # An adapter emitting stray byte tokens (each decodes to U+FFFD alone, and together to no character): held
    # back without end, every token re-decoded the whole output on the server's event loop.
    stray = next(i for i in range(tokenizer.vocab_size) if str(tokenizer.decode([i])) == "\ufffd")
    spy = WindowSpy(tokenizer)
    stream = StreamText(spy)
    deltas = [stream.feed([stray], final=False).text for _ in range(600)]
    assert max(spy.windows) <= 2 * MAX_HELD_TOKENS, max(spy.windows)  # not the 600 of the whole output
    assert set("".join(deltas)) == {"\ufffd"} and sum(bool(delta) for delta in deltas) >= 600 // MAX_HELD_TOKENS
    assert stream.feed([], final=True).text + "".join(deltas) == stream.text


@pytest.mark.parametrize("chunk", [1, 4, 64])
def test_a_stop_string_ends_the_sample_at_the_token_completing_it(tokenizer: Any, chunk: int) -> None:
    ids = tokenizer.encode("one two three STOP four five six seven", add_special_tokens=False)
    completes = next(n for n in range(1, len(ids) + 1) if "STOP" in tokenizer.decode(ids[:n]))
    stream = StreamText(tokenizer, ("STOP",))
    texts, updates = [], []
    for start in range(0, len(ids), chunk):
        update = SequenceUpdate(
            "r", 0, ids[start : start + chunk], [-0.5] * len(ids[start : start + chunk]), finished=False
        )
        update, text = with_text(update, stream)
        texts.append(text)
        updates.append(update)
        if update.finished:
            break
    last = updates[-1]
    assert last.finished and last.stop_reason == StopReason.STOP_STRING
    sent = [t for u in updates for t in u.tokens]
    assert sent == ids[:completes]  # up to the completing token, nothing after
    assert len(last.logprobs) == len(last.tokens)
    assert "".join(texts) == tokenizer.decode(ids[:completes], skip_special_tokens=True)
    assert stream.feed(ids[completes:], final=True).text == ""  # a stopped stream takes nothing more


def test_a_stop_token_that_also_completes_a_stop_string_stays_a_stop_token(tokenizer: Any) -> None:
    ids = tokenizer.encode("say END", add_special_tokens=False)
    update = SequenceUpdate("r", 0, ids, [-0.1] * len(ids), finished=True, stop_reason=StopReason.STOP_TOKEN)
    cut, text = with_text(update, StreamText(tokenizer, ("END",)))
    assert cut.stop_reason == StopReason.STOP_TOKEN and cut.tokens == ids and text == "say END"


def test_the_engine_frees_a_sample_the_server_finished(tiny_model: Path) -> None:
    runner = LlamaForCausalLM.from_pretrained(tiny_model, device=CPU, dtype=torch.float32)
    pool = SlotPool(runner.linear_shapes(), max_slots=1, max_rank=4, device=CPU)
    engine = Engine(
        runner,
        KVCache(runner.config, 16, 16, CPU, torch.float32),
        pool.tensors,
        Scheduler(max_seqs=4, max_batch_tokens=256),
        release=pool.release,
        max_len=64,
        eos_token_ids=(),
    )
    assert not hasattr(engine, "tokenizer")  # token ids only
    got: list[SequenceUpdate] = []
    params = SamplingParams(temperature=0.0, max_tokens=20)
    engine.submit([Sequence(i, "r", i, [5, 6, 7], params, lora_slot=0) for i in range(2)], got.append)
    engine._drain(block=False)
    engine.step()
    engine.finish("r", 0)  # the server saw a stop string in sample 0
    engine._drain(block=False)
    assert [seq.sample_index for seq in engine.scheduler.running] == [1]
    while engine.scheduler.has_work():
        engine.step()
    after = [u for u in got if u.sample_index == 0]
    assert len(after) == 1 and not after[0].finished  # nothing for sample 0 after finish
    assert [u.finished for u in got if u.sample_index == 1].count(True) == 1
    assert engine.blocks.num_used == 0 and "r" not in engine._callbacks
