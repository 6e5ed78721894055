"""Reading a JSON body within bounds, before any handler looks at it.

Python's json module recurses once per nesting level (100k-deep JSON raises RecursionError), accepts
``NaN``/``Infinity`` (not JSON; they would reach the numeric fields as floats) and keeps strings of any length.
Here a body is refused with 400 when it nests deeper than ``MAX_JSON_DEPTH``, holds a non-finite constant,
or holds a string (or object key) longer than the configured bound, naming where.

``json.loads`` runs in C and holds the GIL throughout: on a worker thread it would still stop the event loop for
the whole parse of a big body. With ``yielding`` (the gateway's worker-thread parse of big bodies) numbers and
objects go through small Python functions, which give the GIL away as Python code does (every few ms), so the
event loop keeps serving other tenants meanwhile; the values are the same. The cyclic garbage collector is paused
meanwhile: the parse makes up to millions of containers, and each full collection they would trigger walks every
object of the process with the GIL held (hundreds of ms on an 8 MiB body); it runs again right after.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import json
import re
import threading
from collections.abc import Iterator
from typing import TypeVar

from aiohttp import web

from opentinker.gateway.errors import GatewayError, bad_request
from opentinker.gateway.state import gateway_of

MAX_JSON_DEPTH = 32  # the SDK's bodies nest 4 levels (user_metadata aside)
# A \uD800-\uDFFF escape: json.loads keeps a lone one as a str that no UTF-8 codec (protobuf, tokenizers) encodes.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def _no_constant(name: str) -> object:
    raise bad_request(f"body holds {name}, which is not JSON (numbers must be finite)", "MALFORMED_JSON")


def _int(text: str) -> int:
    return int(text)


def _float(text: str) -> float:
    return float(text)


def _object(pairs: dict[str, object]) -> dict[str, object]:
    return pairs


class _CollectorPause:
    """Pauses the cyclic garbage collector while at least one big body is being parsed."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._parses = 0

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        with self._lock:
            self._parses += 1
            if self._parses == 1:
                gc.disable()
        try:
            yield
        finally:
            with self._lock:
                self._parses -= 1
                if self._parses == 0:
                    gc.enable()


_COLLECTOR = _CollectorPause()
_SCALARS = frozenset({int, float, bool, type(None)})
_NOT_UNICODE = "is not Unicode text (it holds a lone surrogate such as \\ud800)"


def _path(parents: tuple[object, ...]) -> str:
    text = ""
    for key in parents:
        text += f"[{key}]" if isinstance(key, int) else (f".{key}" if text else str(key))
    return text or "the body"


def check_json(body: object, *, max_string: int, max_depth: int = MAX_JSON_DEPTH, unicode: bool = False) -> None:
    """Every string and object key of ``body`` at most ``max_string`` characters (``unicode``: and valid Unicode
    text, without a lone surrogate such as JSON's "\\ud800"), nesting at most ``max_depth`` levels; 400 naming the
    first place that is not. Iterative: any depth is safe to walk."""
    stack: list[tuple[object, tuple[object, ...]]] = [(body, ())]
    while stack:
        item, parents = stack.pop()
        if isinstance(item, str):
            if len(item) > max_string:
                raise bad_request(
                    f"{_path(parents)} is {len(item)} characters long; at most {max_string}", "STRING_TOO_LONG"
                )
            if unicode and not _is_unicode(item):
                raise bad_request(f"{_path(parents)} {_NOT_UNICODE}", "MALFORMED_JSON")
            continue
        if not isinstance(item, dict | list):
            continue
        if len(parents) >= max_depth:
            raise bad_request(f"JSON nests deeper than {max_depth} levels (at {_path(parents)})", "JSON_TOO_DEEP")
        if isinstance(item, list) and set(map(type, item)) <= _SCALARS:
            continue  # a list of numbers (a prompt's tokens): nothing in it to check, and no Python loop over it
        if isinstance(item, dict):
            for key, child in item.items():
                if len(key) > max_string:
                    raise bad_request(f"a key of {_path(parents)} is longer than {max_string}", "STRING_TOO_LONG")
                if unicode and not _is_unicode(key):
                    raise bad_request(f"a key of {_path(parents)} {_NOT_UNICODE}", "MALFORMED_JSON")
                if isinstance(child, str | dict | list):
                    stack.append((child, (*parents, key)))
        else:
            stack.extend((child, (*parents, i)) for i, child in enumerate(item) if isinstance(child, str | dict | list))


def _is_unicode(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def parse_json(raw: bytes, *, max_bytes: int, max_string: int, yielding: bool = False) -> dict[str, object]:
    """The body as a JSON object; 413 (BODY_TOO_LARGE) or 400 (MALFORMED_JSON, JSON_TOO_DEEP,
    STRING_TOO_LONG) otherwise. ``yielding``: parse so that other threads get the GIL meanwhile (slower)."""
    if len(raw) > max_bytes:
        raise GatewayError(413, "BODY_TOO_LARGE", f"JSON body of {len(raw)} bytes; at most {max_bytes}")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise bad_request(f"body is not UTF-8: {exc}", "MALFORMED_JSON") from exc
    try:
        if yielding:
            with _COLLECTOR.held():
                body = json.loads(
                    text, parse_constant=_no_constant, parse_int=_int, parse_float=_float, object_hook=_object
                )
        else:
            body = json.loads(text, parse_constant=_no_constant)
    except RecursionError:
        raise bad_request(f"JSON nests deeper than {MAX_JSON_DEPTH} levels", "JSON_TOO_DEEP") from None
    except ValueError as exc:
        raise bad_request(f"body is not JSON: {str(exc)[:200]}", "MALFORMED_JSON") from exc
    if not isinstance(body, dict):
        raise bad_request("body must be a JSON object", "MALFORMED_JSON")
    # A lone surrogate can only come from a \u escape: only then is each string's encoding checked.
    check_json(body, max_string=max_string, unicode=_SURROGATE_ESCAPE.search(raw) is not None)
    return body


# A request's body

Json = dict[str, object]
_T = TypeVar("_T")
JSON_INLINE_BYTES = 64 << 10  # smaller JSON bodies (all the SDK's but long prompts) are parsed on the event loop


async def json_body(request: web.Request) -> Json:
    """The body as a JSON object within the configured size, depth and string bounds (parse_json). A body
    above ``JSON_INLINE_BYTES`` is parsed on a worker thread, two at a time, so that one tenant's big bodies
    leave the event loop to every other request (the answers are the same either way; see this module's docstring
    for what still holds the GIL)."""
    gw = gateway_of(request)
    raw = await request.read()
    parse = functools.partial(
        parse_json, raw, max_bytes=gw.config.max_json_bytes, max_string=gw.config.max_string_length
    )
    if len(raw) <= JSON_INLINE_BYTES or len(raw) > gw.config.max_json_bytes:
        return parse()
    async with gw.json_slots:
        return await asyncio.to_thread(parse, yielding=True)


def field_of(body: Json, name: str, kind: type[_T], *, required: bool = True) -> _T | None:
    value = body.get(name)
    if value is None:
        if required:
            raise bad_request(f"{name} is required", "MISSING_FIELD")
        return None
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise bad_request(f"{name} must be {kind.__name__}, got {type(value).__name__}", "INVALID_FIELD")
    return value


def required(body: Json, name: str, kind: type[_T]) -> _T:
    value = field_of(body, name, kind)
    assert value is not None
    return value
