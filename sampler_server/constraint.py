"""Constrained decoding's grammars: a request's constraint (JSON schema, any JSON object, regex, Lark grammar)
compiled with llguidance against the base's tokenizer, into a matcher per sample that says which tokens may come
next (grammar_masks.py turns that into the step's token masks).

Compiling runs on the caller's thread, never the engine's: the service edge compiles once to check the request
(a bad grammar is INVALID_ARGUMENT INVALID_CONSTRAINT with llguidance's message, before anything is queued), on
its tenant-fair compile threads, and the engine takes each sample's matcher from the same cache, or compiles it
on threads of its own (grammar_lane.py). The cache is bounded (LRU over `MAX_CACHED` grammars) and keyed by the
constraint's canonical form (a schema's JSON with sorted keys, but for the order of its `properties`, which is
the order of the output's fields), so a schema sent with its other keys in another order is one entry; each
sample gets a deep copy of the cached matcher, which copies its parser state and shares the compiled lexer.

Bounds: a constraint's text is at most MAX_CONSTRAINT_BYTES, an object of a schema has at most
MAX_OPTIONAL_PROPERTIES optional properties, and llguidance's parser limits cap the lexer's work (fuel, lexer
states: memory) at the compile and at every mask; over them the request gets INVALID_ARGUMENT naming the limit.
llguidance's limits do not see its JSON-schema translation, whose time grows with the square of an object's
optional properties: 2,000 of them took 0.47 s, 4,000 1.7 s, 8,000 19.7 s (a 75 KB schema within every parser
limit); a required property costs about the same as a byte elsewhere, ~5 us per byte of schema on a 2-core
CPU, so a compile stays under ~1.5 s at the byte bound (docs/isolation.md).

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
MAX_OPTIONAL_PROPERTIES = 256  # per object of a schema: ~10 ms of compile at most (see above)
MAX_CACHED = 256


# llguidance's defaults are made for one trusted user; these bound the lexer's work at the compile and at each
# mask to tens of ms and tens of MiB on this project's CPUs.
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
    """A schema's JSON text -> its constraint, in canonical form; not JSON, not an object, or over a bound:
    INVALID_CONSTRAINT."""
    _check_size(schema)
    try:
        value = json.loads(schema)
    except json.JSONDecodeError as exc:
        raise invalid(f"constraint.json_schema is not JSON: {exc}") from None
    except RecursionError:
        raise invalid("constraint.json_schema is nested too deeply") from None
    if not isinstance(value, dict):
        raise invalid("constraint.json_schema must be a JSON object (a schema)")
    _check_optional_properties(value)
    return Constraint("json_schema", json.dumps(_canonical(value), separators=(",", ":")))


def _canonical(value: Any, ordered: bool = False) -> Any:
    """A schema with every object's keys sorted, except the names in a `properties` map (``ordered``): their order
    is the order the output writes the fields in (llguidance follows it), so a schema that puts `reasoning` before
    `answer` gets that order, and the same fields in another order are another grammar."""
    if isinstance(value, dict):
        keys = list(value) if ordered else sorted(value)
        return {k: _canonical(value[k], ordered=k == "properties" and not ordered) for k in keys}
    if isinstance(value, list):
        return [_canonical(v) for v in value]
    return value


def _check_size(source: str) -> None:
    if len(source) > MAX_CONSTRAINT_BYTES or len(source.encode()) > MAX_CONSTRAINT_BYTES:
        raise invalid(f"the constraint is over {MAX_CONSTRAINT_BYTES:,} bytes")


def _check_optional_properties(schema: dict[str, Any]) -> None:
    """Every object of the schema (a `properties` map, wherever it is) has at most MAX_OPTIONAL_PROPERTIES
    properties that are not `required`: llguidance's compile time grows with the square of their number."""
    pending: list[Any] = [schema]
    while pending:
        node = pending.pop()
        if isinstance(node, list):
            pending.extend(node)
        elif isinstance(node, dict):
            properties, required = node.get("properties"), node.get("required")
            if isinstance(properties, dict):
                needed = {r for r in required if isinstance(r, str)} if isinstance(required, list) else set()
                needed &= properties.keys()
                optional = len(properties) - len(needed)
                if optional > MAX_OPTIONAL_PROPERTIES:
                    raise invalid(
                        f"constraint.json_schema has an object with {optional:,} optional properties, over the limit "
                        f"of {MAX_OPTIONAL_PROPERTIES} per object (compiling takes the square of their number): make "
                        "more of them required, or split the object"
                    )
            pending.extend(node.values())


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
        cached = self.cached_matcher(constraint)
        if cached is not None:
            return cached
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

    def cached_matcher(self, constraint: Constraint) -> llguidance.LLMatcher | None:
        """A fresh matcher from the cache, or None when the grammar is not cached (it never compiles here)."""
        with self._lock:
            cached = self._cache.get(constraint.key)
            if cached is None:
                return None
            self._cache.move_to_end(constraint.key)
            return cached.deep_copy()

    def _compile(self, constraint: Constraint) -> llguidance.LLMatcher:
        _check_size(constraint.source)
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
