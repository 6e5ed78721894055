"""Hypothesis strategies of the gateway's fuzz tests (test_fuzz_gateway.py): JSON bodies mutated from a route's
template, raw bytes, forward_backward protobufs (raw or zstd), whole requests of a tinker or /v1 route, and
near-valid forward_backward messages for the in-process conversions."""

from __future__ import annotations

import json

import zstandard
from gatewayfuzzcases import (
    FLOATS,
    GET_ROUTES,
    HUGE_INTS,
    KEY_A,
    KEY_B,
    MAX_BODY,
    QUERIES,
    REST_ROUTES,
    STRINGS,
    V1_ROUTES,
    V1_TEMPLATES,
    Fuzz,
    _fwdbwd,
)
from hypothesis import strategies as st
from tinker.proto import tinker_public_pb2 as tpb

# --- strategies -------------------------------------------------------------------------------------------


def _strings(known: dict[str, str]) -> st.SearchStrategy[str]:
    return st.one_of(st.sampled_from(sorted(known.values())), st.sampled_from(STRINGS), st.text(max_size=16))


def _json(known: dict[str, str]) -> st.SearchStrategy[object]:
    scalars = st.one_of(
        st.none(),
        st.booleans(),
        st.sampled_from(HUGE_INTS),
        st.integers(-5, 100),
        st.sampled_from(FLOATS),
        st.floats(allow_nan=False, allow_infinity=False),
        _strings(known),
    )

    def nest(children: st.SearchStrategy[object]) -> st.SearchStrategy[object]:
        return st.one_of(st.lists(children, max_size=3), st.dictionaries(st.text(max_size=8), children, max_size=3))

    return st.recursive(scalars, nest, max_leaves=8)


@st.composite
def mutated(draw: st.DrawFn, template: dict[str, object], known: dict[str, str]) -> dict[str, object]:
    """The template with up to three fields (top-level or one level down) replaced, dropped or added."""
    body: dict[str, object] = json.loads(json.dumps(template))
    for _ in range(draw(st.integers(0, 3))):
        target: dict[str, object] = body
        nested = [k for k, v in body.items() if isinstance(v, dict) and v]
        use_nested = draw(st.booleans())
        if nested and use_nested:
            inner = body[draw(st.sampled_from(sorted(nested)))]
            assert isinstance(inner, dict)
            target = inner
        keys = [*sorted(target), "extra"]
        key = draw(st.sampled_from(keys))
        action = draw(st.sampled_from(["replace", "replace", "drop", "deep"]))
        if action == "drop":
            target.pop(key, None)
        elif action == "deep":
            target[key] = json.loads("[" * 30 + "1" + "]" * 30)
        else:
            target[key] = draw(_json(known))
    return body


@st.composite
def raw_json(draw: st.DrawFn) -> bytes:
    """Bytes that are not a JSON object the gateway takes."""
    return draw(
        st.sampled_from(
            [
                b"",
                b"{",
                b"[]",
                b"null",
                b"1",
                b'"x"',
                b"\xff\xfe{}",
                b'{"a": NaN}',
                b'{"a": -Infinity}',
                b"[" * 100_000 + b"]" * 100_000,
                b'{"a":' * 5000 + b"1" + b"}" * 5000,
                b"{" + b'"a":1,' * 10 + b"}",
                b'{"num_samples": 1e400}',
                b'{"seq_id": 1' + b"0" * 5000 + b"}",
            ]
        )
        | st.binary(max_size=64)
    )


@st.composite
def json_body(draw: st.DrawFn, template: dict[str, object], known: dict[str, str]) -> bytes:
    """A JSON body: mostly the route's template mutated, else random fields of it, else raw bytes."""
    kind = draw(st.sampled_from(["mutated", "mutated", "mutated", "random", "raw"]))
    if kind == "raw":
        return draw(raw_json())
    if kind == "random":
        return json.dumps(draw(st.dictionaries(st.sampled_from([*template, "x"]), _json(known), max_size=4))).encode()
    return json.dumps(draw(mutated(template, known))).encode()


@st.composite
def protobuf_body(draw: st.DrawFn, known: dict[str, str]) -> tuple[bytes, str]:
    """A forward_backward body and its Content-Encoding."""
    message = tpb.ForwardBackwardRequest()
    message.ParseFromString(_fwdbwd(known["model"], 3))
    kind = draw(st.sampled_from(["mutant", "mutant", "flip", "truncate", "random", "bomb", "corrupt-zstd"]))
    if kind == "mutant":
        message.seq_id = draw(st.sampled_from([0, 1, 3, 4, 300, 2**31 - 1, -1, -(2**31)]))
        message.model_id = draw(st.sampled_from([known["model"], known["model"], "", "x" * 5000, "nope:train:0"]))
        message.loss_fn = draw(st.sampled_from(["cross_entropy", "importance_sampling", "ppo", "", "\n", "x" * 5000]))
        datum = message.data[0]
        if draw(st.booleans()):
            datum.model_input[0].encoded_text.tokens = draw(st.binary(max_size=24))
        tensor = datum.loss_fn_inputs[draw(st.sampled_from(["target_tokens", "weights", "advantages", "x" * 200]))]
        tensor.dtype = draw(st.integers(0, 6))  # type: ignore[assignment]  # unknown enum values too
        tensor.shape[:] = draw(st.lists(st.sampled_from([0, 1, 3, -1, 2**20, 2**40]), max_size=3))
        if draw(st.booleans()):
            tensor.sparse_csr.values = draw(st.binary(max_size=16))
            tensor.sparse_csr.crow_indices = draw(st.binary(max_size=16))
            tensor.sparse_csr.col_indices = draw(st.binary(max_size=16))
        else:
            tensor.dense = draw(st.binary(max_size=32))
        if draw(st.booleans()):
            message.loss_fn_config_v2["clip"].number = draw(st.sampled_from([1e300, -1.0, 0.5, float("nan")]))
        if draw(st.booleans()):
            message.forward_only = True
        body = bytes(message.SerializeToString())
    else:
        body = _fwdbwd(known["model"], draw(st.integers(3, 400)))
        if kind == "flip":
            at = draw(st.integers(0, len(body) - 1))
            body = body[:at] + bytes([body[at] ^ draw(st.integers(1, 255))]) + body[at + 1 :]
        elif kind == "truncate":
            body = body[: draw(st.integers(0, len(body) - 1))]
        elif kind == "random":
            body = draw(st.binary(max_size=128))
        elif kind == "bomb":
            inflated = tpb.ForwardBackwardRequest(model_id=known["model"], seq_id=5)
            inflated.data.add().model_input.add().encoded_text.tokens = bytes(MAX_BODY + 1)
            return zstandard.ZstdCompressor().compress(inflated.SerializeToString()), "zstd"
        else:
            return zstandard.ZstdCompressor().compress(body)[: draw(st.integers(0, 12))], "zstd"
    encoding = draw(st.sampled_from(["", "", "zstd", "gzip", "identity", "zstd, gzip"]))
    if encoding == "zstd":
        body = zstandard.ZstdCompressor().compress(body)
    return body, encoding


@st.composite
def request_of(draw: st.DrawFn, fuzz: Fuzz, route: str) -> tuple[str, str, bytes, dict[str, str]]:
    """(method, path, body, headers) for one fuzzed request of ``route``."""
    known = fuzz.known
    key = draw(st.sampled_from([KEY_A] * 16 + [KEY_B, "", "tml-nobody", "sk-x", "tml- x"]))
    headers = {"X-API-Key": key} if key else {}
    method = draw(st.sampled_from(REST_ROUTES.get(route, ("GET",) if route in GET_ROUTES else ("POST",))))
    # DELETE aims at the throwaway checkpoint, not at the ones the other routes use.
    names = ["doomed", "nope", "x" * 300] if method == "DELETE" else ["s", "w", "doomed", "nope", "x" * 300, "%0A"]
    path = route.format(
        session=draw(st.sampled_from([known["session"], "nope", "x" * 300, "%0A"])),
        sampler=draw(st.sampled_from([known["sampler"], "nope", "x" * 300])),
        run=draw(st.sampled_from([known["model"], known["model"], "nope", "x" * 300, "a:train:0"])),
        segment=draw(st.sampled_from(["weights", "sampler_weights", "external_weights", "x"])),
        name=draw(st.sampled_from(names)),
    )
    if method in ("GET", "DELETE"):
        return method, path + (draw(st.sampled_from(QUERIES)) if method == "GET" else ""), b"", headers
    if route == "forward_backward":
        body, encoding = draw(protobuf_body(known))
        headers["Content-Type"] = "application/x-protobuf"
        if encoding:
            headers["Content-Encoding"] = encoding
        return "POST", path, body, headers
    template = fuzz.templates.get(route, {})
    assert isinstance(template, dict)
    headers["Content-Type"] = "application/json"
    return method, path, draw(json_body(template, known)), headers


@st.composite
def v1_request_of(draw: st.DrawFn, fuzz: Fuzz, route: str) -> tuple[str, str, bytes, dict[str, str]]:
    """(method, path, body, headers) for one fuzzed request of the /v1 ``route``."""
    key = draw(st.sampled_from([KEY_A] * 16 + [KEY_B, "", "tml-nobody", "sk-x", "tml- x"]))
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    method = draw(st.sampled_from(V1_ROUTES[route]))
    path = route.format(
        model=draw(st.sampled_from(["base", "fuzz-a/nope", "fuzz-b/x@3", "x" * 300, "a@b@c", "%0A", "fuzz-a/x@-1"])),
        episode=draw(st.sampled_from(["fuzz-1", "nope", "x" * 300, "%0A", "a b"])),
    )
    if method in ("GET", "DELETE"):
        return method, path + (draw(st.sampled_from(QUERIES)) if method == "GET" else ""), b"", headers
    headers["Content-Type"] = "application/json"
    return method, path, draw(json_body(V1_TEMPLATES[route], fuzz.known)), headers


# --- near-valid messages, for the conversions behind the routes (tested in process) ----------------------


@st.composite
def near_valid_message(draw: st.DrawFn) -> tpb.ForwardBackwardRequest:
    """A valid forward_backward request with one to three of its datum's parts broken (so that conversion, which
    runs in the accepted job, is reached: the process fuzz above mostly stops at the model's lane)."""
    message = tpb.ForwardBackwardRequest()
    message.ParseFromString(_fwdbwd("m", 1))
    datum = message.data[draw(st.integers(0, 0))]
    for _ in range(draw(st.integers(1, 3))):
        part = draw(st.sampled_from(["tokens", "chunk", "dense", "csr", "shape", "dtype", "config", "span"]))
        tensor = datum.loss_fn_inputs[draw(st.sampled_from(["target_tokens", "weights", "logprobs"]))]
        if part == "tokens":
            datum.model_input[0].encoded_text.tokens = draw(st.binary(max_size=40))
        elif part == "chunk":
            datum.model_input.add().image.data = draw(st.binary(max_size=8))
        elif part == "dense":
            tensor.dense = draw(st.binary(max_size=40))
        elif part == "csr":
            csr = tensor.sparse_csr
            csr.values, csr.crow_indices, csr.col_indices = (draw(st.binary(max_size=32)) for _ in range(3))
        elif part == "shape":
            tensor.shape[:] = draw(st.lists(st.sampled_from([0, 1, 2, 3, 5, 2**31, 2**62, -1]), max_size=4))
        elif part == "dtype":
            tensor.dtype = draw(st.integers(0, 9))  # type: ignore[assignment]  # unknown enum values too
        elif part == "config":
            value = message.loss_fn_config_v2[draw(st.text(max_size=4))]
            if draw(st.booleans()):
                value.number = draw(st.floats())
            else:
                value.text = draw(st.text(max_size=4))
        else:
            datum.model_input_spans.add()
    return message
