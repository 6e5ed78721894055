"""Constrained decoding in the batched engine (constraint.py, grammar_masks.py) on the tiny random-weight model:

- 16 free and 16 constrained greedy samples over two adapters and three grammars in one batch: every constrained
  output parses and follows its grammar, and every free one is token for token (and logprob for logprob) what it
  is in a batch without constrained neighbours (logprobs to float precision: the batch's shape differs).
- A constrained row's logprob is of the masked, renormalized distribution; its top logprobs only allowed tokens.
- A sample ends where its grammar ends (STOP_TOKEN), or max_tokens cuts it (LENGTH), never a silent early end.
- The compile cache: one compile per canonical schema, whatever its key order but its fields'; bad grammars
  refused by name.
- A parser limit reached mid-sample fails that request (GRAMMAR_LIMIT), never an early "complete" end.
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Callable
from pathlib import Path

import llguidance
import pytest
import torch
from pagedkvutil import LOGPROB_TOLERANCE, engine, outputs, run
from samplerutil import max_diff
from transformers import AutoTokenizer

from opentinker.rpc.serving.errors import InvalidArgument
from opentinker.sampler_server.constraint import Constraint, Grammars, json_schema
from opentinker.sampler_server.engine import Engine
from opentinker.sampler_server.grammar_masks import GRAMMAR_LIMIT, MaskWorker, StepMasks
from opentinker.sampler_server.model.llama import LlamaForCausalLM
from opentinker.sampler_server.sampling import sample
from opentinker.sampler_server.sequence import SamplingParams, Sequence, StopReason
from opentinker.sampler_server.slot_pool import SlotPool
from opentinker.sampler_server.updates import SequenceUpdate

MAX_LEN = 320
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "kind": {"enum": ["cat", "dog"]},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "kind", "ok"],
    "additionalProperties": False,
}
NESTED = {
    "type": "object",
    "properties": {"tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 2}},
    "required": ["tags"],
    "additionalProperties": False,
    "$defs": {"unused": {"type": "integer"}},
}
REGEX = r"(yes|no)-[0-9]{3}"


@pytest.fixture(scope="module")
def grammars(tiny_model: Path, runner: LlamaForCausalLM) -> Grammars:
    return Grammars(AutoTokenizer.from_pretrained(tiny_model), runner.config.vocab_size, (2,))


def _engine(runner: LlamaForCausalLM, pool: SlotPool, grammars: Grammars) -> Engine:
    eng = engine(runner, pool, block_size=16, num_blocks=200, max_seqs=32, max_len=MAX_LEN)
    eng.grammars = grammars
    eng.masks = MaskWorker(grammars.vocab_size)
    eng.eos_token_ids = {2}
    return eng


def _free(i: int) -> Sequence:
    prompt = [(11 * i + 5 * j) % 200 + 3 for j in range(6 + i % 5)]
    params = SamplingParams(temperature=0.0, max_tokens=24, logprobs=True)
    return Sequence(i, f"free-{i}", 0, prompt, params, lora_slot=i % 3)


def _constrained(i: int, constraint: Constraint) -> Sequence:
    prompt = [(7 * i + 3 * j) % 200 + 3 for j in range(5 + i % 4)]
    params = SamplingParams(temperature=0.0, max_tokens=250, logprobs=True, constraint=constraint)
    return Sequence(100 + i, f"json-{i}", 0, prompt, params, lora_slot=(i + 1) % 3)


def _text(grammars: Grammars, seq: Sequence) -> str:
    tokens = [t for t in seq.output if t != 2]
    text: str = grammars._hf_tokenizer.decode(tokens)
    return text


def test_free_rows_are_unchanged_by_constrained_neighbours(
    runner: LlamaForCausalLM, pool: SlotPool, grammars: Grammars
) -> None:
    kinds = [json_schema(json.dumps(SCHEMA)), json_schema(json.dumps(NESTED)), Constraint("regex", REGEX)]
    alone = [[_free(i)] for i in range(16)]
    run(_engine(runner, pool, grammars), alone)
    mixed_free = [[_free(i)] for i in range(16)]
    constrained = [[_constrained(i, kinds[i % 3])] for i in range(16)]
    run(_engine(runner, pool, grammars), [s for pair in zip(mixed_free, constrained, strict=True) for s in pair])
    before = outputs(alone)
    for key, seq in outputs(mixed_free).items():
        assert seq.output == before[key].output, key
        # Another batch shape sums the matmuls in another order: the same tokens, logprobs to float precision.
        assert max_diff(seq.output_logprobs, before[key].output_logprobs) < LOGPROB_TOLERANCE, key
    for (seq,) in constrained:
        assert seq.stop_reason is StopReason.STOP_TOKEN, (seq.request_id, _text(grammars, seq))
        text = _text(grammars, seq)
        if seq.params.constraint == kinds[2]:
            assert re.fullmatch(REGEX, text), text
            continue
        value = json.loads(text)
        if seq.params.constraint == kinds[0]:
            assert set(value) == {"name", "age", "kind", "ok"} and value["kind"] in ("cat", "dog"), value
            assert isinstance(value["age"], int) and 0 <= value["age"] <= 120 and isinstance(value["ok"], bool)
            assert len(value["name"]) <= 8
        else:
            assert set(value) == {"tags"} and len(value["tags"]) <= 2 and all(len(t) <= 4 for t in value["tags"])
        assert all(lp <= 0.0 for lp in seq.output_logprobs)


def test_max_tokens_cuts_a_constrained_sample_with_length(
    runner: LlamaForCausalLM, pool: SlotPool, grammars: Grammars
) -> None:
    long = Constraint("regex", "a{200}")  # the tiny tokenizer has no token of many a's: it needs > 5 tokens
    seq = Sequence(1, "cut", 0, [5, 6, 7], SamplingParams(temperature=1.0, max_tokens=5, constraint=long), 0, seed=3)
    run(_engine(runner, pool, grammars), [[seq]])
    assert seq.stop_reason is StopReason.LENGTH and len(seq.output) == 5
    assert set(_text(grammars, seq)) == {"a"}


def test_a_constrained_rows_logprobs_are_of_the_masked_distribution(grammars: Grammars) -> None:
    vocab = grammars.vocab_size
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(1))
    allowed = torch.zeros(1, vocab, dtype=torch.bool)
    allowed[0, [10, 20, 30]] = True
    rows = [Sequence(i, f"r{i}", 0, [1], SamplingParams(temperature=0.0, top_logprobs=5), 0) for i in range(3)]
    free = sample(logits, rows)
    masked = sample(logits, rows, StepMasks([1], allowed))
    assert masked.tokens[0] == free.tokens[0] and masked.logprobs[0] == free.logprobs[0]
    assert masked.tokens[2] == free.tokens[2] and masked.logprobs[2] == free.logprobs[2]
    sub = logits[1, [10, 20, 30]]
    assert masked.tokens[1] == [10, 20, 30][int(sub.argmax())]
    assert masked.logprobs[1] == pytest.approx(float(sub.max() - sub.logsumexp(0)), abs=1e-5)
    assert sorted(masked.top[1].token_ids) == [10, 20, 30]  # only allowed tokens, though 5 were asked for
    assert len(free.top[1].token_ids) == 5


def test_one_compile_per_canonical_schema_and_bad_grammars_named(grammars: Grammars) -> None:
    before = grammars.compiles
    first = json_schema('{"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}')
    again = json_schema('{"required": ["x"], "properties": {"x": {"type": "integer"}}, "type": "object"}')
    assert first == again
    grammars.matcher(first)
    grammars.matcher(again)
    assert grammars.compiles == before + 1 and grammars.cached(first)
    # The order of `properties` is the output's field order: kept, and part of the key.
    fields, closed = {"zeta": {"const": 1}, "alpha": {"const": 2}}, {"additionalProperties": False}
    ordered = json.dumps({"type": "object", "properties": fields, "required": ["zeta", "alpha"]} | closed)
    swapped = json.dumps(
        {"required": ["alpha", "zeta"], "properties": dict(reversed(fields.items())), "type": "object"} | closed
    )
    assert json_schema(ordered) != json_schema(swapped)
    for schema, text in ((ordered, '{"zeta": 1, "alpha": 2}'), (swapped, '{"alpha": 2, "zeta": 1}')):
        walk = grammars.matcher(json_schema(schema))
        forced: list[int] = []
        while not walk.is_stopped() and len(forced) < 64:
            token = walk.compute_ff_tokens()  # the whole output is forced: consts in a fixed order
            if not token:
                break
            forced.extend(token)
            assert walk.consume_tokens(token)
        assert grammars.tokenizer.decode_str(forced) == text
    cases: list[tuple[Callable[[], object], str]] = [
        (lambda: json_schema("{not json"), "not JSON"),
        (lambda: json_schema("[1, 2]"), "must be a JSON object"),
        (lambda: grammars.matcher(json_schema('{"type": "strin"}')), "strin"),
        (lambda: grammars.matcher(Constraint("regex", "a(b")), "unclosed group"),
        (lambda: grammars.matcher(Constraint("lark", "start: foo")), "unknown name"),
        (lambda: grammars.matcher(Constraint("regex", "x" * 300_000)), "bytes"),
    ]
    for make, words in cases:
        with pytest.raises(InvalidArgument, match=words) as caught:
            make()
        assert caught.value.reason == "INVALID_CONSTRAINT"


def test_a_parser_limit_reached_mid_sample_fails_that_request_alone(
    runner: LlamaForCausalLM, pool: SlotPool, grammars: Grammars
) -> None:
    """A matcher whose per-step lexer fuel runs out while its mask is computed: llguidance then allows only the end
    of sequence (and would accept it), so without the check the sample would end "complete" with no text. It
    fails with GRAMMAR_LIMIT instead; its free neighbour finishes as usual."""
    tight = llguidance.LLParserLimits(step_lexer_fuel=10)
    grammar = llguidance.LLMatcher.grammar_from_regex("(a|b)*a(a|b){12}")
    constraint = Constraint("regex", "(a|b)*a(a|b){12}")
    seq = Sequence(1, "tight", 0, [5, 6, 7], SamplingParams(temperature=0.0, max_tokens=20, constraint=constraint), 0)
    seq.matcher = llguidance.LLMatcher(grammars.tokenizer, grammar, log_level=0, limits=tight)
    assert not seq.matcher.is_error()  # the compile itself was within its (initial) fuel
    free = _free(3)
    updates: dict[str, list[SequenceUpdate]] = {"tight": [], free.request_id: []}
    done = threading.Event()

    def on_update(update: SequenceUpdate) -> None:
        updates[update.request_id].append(update)
        if all(u and u[-1].finished for u in updates.values()):
            done.set()

    eng = _engine(runner, pool, grammars)
    eng.start()
    try:
        eng.submit([seq], on_update)
        eng.submit([free], on_update)
        assert done.wait(60)
    finally:
        eng.stop()
    last = updates["tight"][-1]
    assert last.error_reason == GRAMMAR_LIMIT and "parser limit" in last.error, last
    assert not updates[free.request_id][-1].error and len(free.output) == free.params.max_tokens
