"""Constrained decoding's grammars: a request's constraint (JSON schema, any JSON object, regex, Lark grammar)
compiled with llguidance against the base's tokenizer, into a matcher per sample that says which tokens may come
next (grammar_masks.py turns that into the step's token masks).

Compiling runs on the caller's thread, never the engine's: the service edge compiles once to check the request
(a bad grammar is INVALID_ARGUMENT INVALID_CONSTRAINT with llguidance's message, before anything is queued), and
the engine's `submit` (the server's thread, or the engine process's reader thread) takes each sample's matcher
from the same cache. The cache is bounded (LRU over `MAX_CACHED` grammars) and keyed by the constraint's
canonical form (a schema's JSON with sorted keys), so a schema sent with its keys in another order is one
entry; each sample gets a deep copy of the cached matcher, which copies its parser state and shares the
compiled lexer.

Bounds: a constraint's text is at most MAX_CONSTRAINT_BYTES, and llguidance's parser limits cap the work of the
compile (lexer fuel, grammar size, lexer states: memory) and of every mask; over them the compile fails with
the limit named, and the request gets INVALID_ARGUMENT, never a stalled engine.

JSON comes out compact (", " and ": " separators, no free whitespace): a random or weak model otherwise fills
its max_tokens with the whitespace JSON allows between tokens.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import llguidance
import llguidance.hf

from opentinker.rpc.serving.errors import InvalidArgument

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

ConstraintKind = Literal["json_schema", "json_object", "regex", "lark"]

MAX_CONSTRAINT_BYTES = 256 * 1024
MAX_CACHED = 256


# llguidance's defaults are made for one trusted user; these bound one request's compile to well under a second
# and tens of MiB on this project's CPUs (docs/structured.md).
def _limits() -> llguidance.LLParserLimits:
    return llguidance.LLParserLimits(
        initial_lexer_fuel=1_000_000, step_lexer_fuel=200_000, max_lexer_states=50_000, max_grammar_size=200_000
    )


_JSON_OPTIONS: JsonCompileOptions = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
}


@dataclass(frozen=True, slots=True)
class Constraint:
    """What a request's samples must follow; `source` is the schema's canonical JSON, the regex or the Lark text."""

    kind: ConstraintKind
    source: str = ""

    @property
    def key(self) -> str:
        return f"{self.kind}:{self.source}"

    def grammar(self) -> str:
        """llguidance's grammar text for this constraint."""
        if self.kind == "json_object":
            return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, overrides=_JSON_OPTIONS)
        if self.kind == "json_schema":
            return llguidance.LLMatcher.grammar_from_json_schema(self.source, overrides=_JSON_OPTIONS)
        if self.kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(self.source)
        return llguidance.LLMatcher.grammar_from_lark(self.source)


def json_schema(schema: str) -> Constraint:
    """A schema's JSON text -> its constraint, in canonical form; not JSON, or not an object: INVALID_CONSTRAINT."""
    try:
        value = json.loads(schema)
    except json.JSONDecodeError as exc:
        raise invalid(f"constraint.json_schema is not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise invalid("constraint.json_schema must be a JSON object (a schema)")
    return Constraint("json_schema", json.dumps(value, sort_keys=True, separators=(",", ":")))


def invalid(message: str) -> InvalidArgument:
    return InvalidArgument(message, reason="INVALID_CONSTRAINT", field="constraint")


class Grammars:
    """The sampler's grammar compiler and cache; thread-safe (the edge and the engine's submit both use it)."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: tuple[int, ...]) -> None:
        self._hf_tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._eos = list(eos_token_ids)
        self._tokenizer: llguidance.LLTokenizer | None = None  # made on first use (it walks the whole vocabulary)
        self._cache: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()
        self._lock = threading.Lock()
        self.compiles = 0  # grammars compiled (cache misses), for the bench and the tests

    def matcher(self, constraint: Constraint) -> llguidance.LLMatcher:
        """A fresh matcher at the grammar's start; a grammar llguidance refuses: INVALID_CONSTRAINT."""
        with self._lock:
            cached = self._cache.get(constraint.key)
            if cached is not None:
                self._cache.move_to_end(constraint.key)
                return cached.deep_copy()
        compiled = self._compile(constraint)  # outside the lock: one tenant's slow grammar holds up no other's
        with self._lock:
            self._cache[constraint.key] = compiled
            self._cache.move_to_end(constraint.key)
            while len(self._cache) > MAX_CACHED:
                self._cache.popitem(last=False)
        return compiled.deep_copy()

    def cached(self, constraint: Constraint) -> bool:
        with self._lock:
            return constraint.key in self._cache

    def _compile(self, constraint: Constraint) -> llguidance.LLMatcher:
        if len(constraint.source.encode()) > MAX_CONSTRAINT_BYTES:
            raise invalid(f"the constraint is over {MAX_CONSTRAINT_BYTES:,} bytes")
        try:
            grammar = constraint.grammar()
        except ValueError as exc:
            raise invalid(f"constraint.{constraint.kind}: {exc}") from None
        # The matcher's constructor drops the GIL while it builds: the engine thread steps on meanwhile.
        matcher = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0, limits=_limits())
        if matcher.is_error():
            raise invalid(f"constraint.{constraint.kind} does not compile: {matcher.get_error()[:2000]}")
        self.compiles += 1
        return matcher

    @property
    def tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._tokenizer is None:
                if self._hf_tokenizer is None:
                    raise invalid("this sampler's base has no tokenizer: constrained decoding needs one")
                try:
                    self._tokenizer = llguidance.hf.from_tokenizer(
                        self._hf_tokenizer, n_vocab=self.vocab_size, eos_token=self._eos or None
                    )
                except ValueError as exc:  # a slow (Python) tokenizer: llguidance reads fast ones only
                    raise invalid(f"constrained decoding needs a fast tokenizer: {exc}") from None
            return self._tokenizer
