"""schemathesis against a running gateway (over real trainer, sampler and registry processes): requests generated
from the OpenAPI document the gateway serves (gateway/openapi.py), schema-valid and schema-invalid (schemathesis'
positive and negative modes), for every route, with a valid key (X-API-Key, or Bearer under /v1), a random key or
none. Some generated values are swapped for the ids of a live session, model, checkpoint and sampling session (so
that requests get past "unknown id" into the handlers) or for values schemathesis does not make (NASTY). Every
answer must be below 500, free of tracebacks and exception reprs, documented (status, content type, error body
shape) and come within TIMEOUT seconds (a hang fails).

The budget is OPENTINKER_FUZZ_EXAMPLES examples per route (`make soak` runs 500); hypothesis is derandomized, so
a run is reproducible, and a failure prints the request (as curl) that caused it."""

from __future__ import annotations

import copy
import gzip
import os
import re
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

import pytest
import requests
import schemathesis
from gatewayutil import KEY_A, base_url
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)
from serverproc import ServerProcess

from opentinker.gateway import openapi, route_schema

EXAMPLES = int(os.environ.get("OPENTINKER_FUZZ_EXAMPLES", "40"))
TIMEOUT = 30.0  # seconds per request; the slowest (retrieve_future's long poll) answers within --poll-seconds
GATEWAY_FLAGS = ("--poll-seconds", "2")
CHECKS = (status_code_conformance, content_type_conformance, response_schema_conformance)
# A traceback, a frame line, an exception's repr (KeyError('x'), ValueError(...)), an OS error's text.
_LEAKS = re.compile(r"Traceback \(most|File \"[^\"]*\", line|\b[A-Z]\w*(?:Error|Exception)\(|\[Errno -?\d+\]")
# Mostly a valid key, so that most requests reach a handler; schemathesis itself also leaves the key out of the
# negative cases that target it (those answer 401 MISSING_API_KEY).
AUTH = ("key",) * 6 + ("bearer", "none")

# forward_backward's body is a tinker protobuf: the fuzzer sends bytes (tests/reliability/test_fuzz_gateway.py
# mutates valid messages).
schemathesis.serializer.alias(route_schema.PROTOBUF, "application/octet-stream")


# Values schemathesis does not make (its strings are valid UTF-8 text, its numbers fit the schema's type), put in
# place of some generated ones: a lone surrogate escape, digits str.isdigit() accepts and int() refuses, a version
# suffix of them, control characters, JSON numbers past int64/float64, type confusion.
NASTY: tuple[object, ...] = (
    "\ud800",
    "x\udfff",
    "\u00b2",
    "gw-a/x@\u00b2",
    "x@\u0661",
    "x@0",
    "x@-1",
    "\x00",
    "",
    " ",
    "../..",
    "tinker://",
    "tinker://x/weights/",
    "%s%n%x",
    "a" * 5000,
    "\U0001f600",
    "NaN",
    "-1",
    "1e400",
    0,
    -1,
    2**31,
    2**63,
    2**64,
    -(2**63) - 1,
    10**400,
    1e308,
    -0.0,
    0.5,
    True,
    None,
    [],
    {},
    [None],
    {"": None},
)
_DEPTH = 3  # how deep into a body values are swapped


def _url_safe(value: object) -> bool:
    return isinstance(value, str) and value.encode("utf-8", "surrogatepass") == value.encode("utf-8", "replace")


NASTY_IN_QUERY = tuple(value for value in NASTY if _url_safe(value))  # UTF-8 text
# A path parameter of "", ".." or holding "/" would send the request to another route (or none): not this one's test
NASTY_IN_PATH = tuple(
    value
    for value in NASTY_IN_QUERY
    if isinstance(value, str) and value and "/" not in value and value.strip(".") != ""
)


@dataclass(frozen=True)
class Steer:
    """Swaps values into a generated request: each id of a live object of KEY_A's tenant with even odds (so that
    requests get past "unknown session" into the handlers), and up to two values for NASTY ones."""

    ids: dict[str, object]

    def apply(self, case: Any, data: st.DataObject) -> None:
        # copies: the generator may hand out the same objects again (a replay must draw the same values)
        for name in ("body", "query", "path_parameters"):
            value = getattr(case, name)
            if isinstance(value, dict | list):
                setattr(case, name, copy.deepcopy(value))
        places: list[tuple[Any, Any, tuple[object, ...]]] = []  # (container, key, the nasty values that fit)
        if isinstance(case.body, dict | list):
            _places(case.body, _DEPTH, NASTY, places)
        if case.query:
            _places(case.query, 1, NASTY_IN_QUERY, places)
        if case.path_parameters:
            _places(case.path_parameters, 1, NASTY_IN_PATH, places)
        for node, key, _nasty in places:
            if key in self.ids and data.draw(st.booleans(), label=f"real {key}"):
                node[key] = self.ids[key]
        if isinstance(case.body, dict):
            self._bound(case.body)
        if not places:
            return
        for _ in range(data.draw(st.sampled_from((0, 1, 1, 2)), label="nasty values")):
            node, key, nasty = places[data.draw(st.integers(0, len(places) - 1), label="nasty place")]
            node[key] = data.draw(st.sampled_from(nasty), label=f"nasty {key}")

    def _bound(self, body: dict[str, Any]) -> None:
        """A sample of a live model: at most MAX_TOKENS tokens (none given is the rest of a 2048-token context),
        so that the fuzzer's samples stay short on the sampler the whole test session shares."""
        if body.get("model") == self.ids["model"]:
            for name in ("max_tokens", "max_completion_tokens"):
                if name in body or name == "max_tokens":
                    body[name] = _bounded(body.get(name))
        params = body.get("sampling_params")
        if isinstance(params, dict) and {"sampling_session_id", "base_model", "model_path"} & set(body):
            params["max_tokens"] = _bounded(params.get("max_tokens"))


MAX_TOKENS = 8


def _bounded(value: object) -> object:
    if value is None or (isinstance(value, int) and not isinstance(value, bool) and value > MAX_TOKENS):
        return MAX_TOKENS
    return value


def _places(node: Any, depth: int, nasty: tuple[object, ...], out: list[tuple[Any, Any, tuple[object, ...]]]) -> None:
    keys: list[Any] = list(node) if isinstance(node, dict) else list(range(len(node)))
    for key in keys[:16]:
        out.append((node, key, nasty))
        if isinstance(node[key], dict | list) and depth > 1:
            _places(node[key], depth - 1, nasty, out)


def _post(gateway: ServerProcess, path: str, body: dict[str, Any]) -> dict[str, Any]:
    answer = requests.post(f"{base_url(gateway)}{path}", json=body, headers={"X-API-Key": KEY_A}, timeout=TIMEOUT)
    assert answer.status_code == 200, answer.text
    result: dict[str, Any] = answer.json()
    return result


def _finished(gateway: ServerProcess, request_id: str) -> dict[str, Any]:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        result = _post(gateway, "/api/v1/retrieve_future", {"request_id": request_id})
        if result.get("type") != "try_again":
            return result
    raise AssertionError(f"request {request_id} did not finish")


def _episode(gateway: ServerProcess, model: str, episode_id: str) -> None:
    """An episode of one turn (a completion recorded under ``episode_id``)."""
    completion = requests.post(
        f"{base_url(gateway)}/v1/completions",
        json={"model": model, "prompt": [1, 2, 3], "max_tokens": 4},
        headers={"X-API-Key": KEY_A, "X-OpenTinker-Episode": episode_id},
        timeout=TIMEOUT,
    )
    assert completion.status_code == 200, completion.text


@pytest.fixture(scope="module")
def steer(gateway: ServerProcess) -> Steer:
    """A session, a model in it (its run) with a saved state and sampler weights, a sampling session, an episode."""
    capabilities = requests.get(
        f"{base_url(gateway)}/api/v1/get_server_capabilities", headers={"X-API-Key": KEY_A}, timeout=TIMEOUT
    ).json()
    base = capabilities["supported_models"][0]["model_name"]
    session = _post(gateway, "/api/v1/create_session", {"sdk_version": "0.38.0"})["session_id"]
    created = _post(
        gateway,
        "/api/v1/create_model",
        {"session_id": session, "model_seq_id": 0, "base_model": base, "lora_config": {"rank": 2}},
    )
    model = _finished(gateway, created["request_id"])["model_id"]
    sampler = _post(
        gateway,
        "/api/v1/create_sampling_session",
        {"session_id": session, "sampling_session_seq_id": 0, "base_model": base},
    )["sampling_session_id"]
    state = _post(gateway, "/api/v1/save_weights", {"model_id": model, "seq_id": 1, "path": "fuzz"})
    state_path = _finished(gateway, state["request_id"])["path"]
    weights = _post(gateway, "/api/v1/save_weights_for_sampler", {"model_id": model, "seq_id": 2, "path": "fuzz"})
    sampler_path = _finished(gateway, weights["request_id"])["path"]
    _episode(gateway, base, "fuzz-episode")
    ids: dict[str, object] = {
        "session_id": session,
        "model_id": model,
        "run_id": model,
        "sampling_session_id": sampler,
        "sampler_id": sampler,
        "base_model": base,
        "model": base,
        "path": state_path,
        "tinker_path": state_path,
        "model_path": sampler_path,
        "segment": "weights",
        "name": "fuzz",
        "seq_id": 3,
        "model_seq_id": 1,
        "episode_id": "fuzz-episode",
    }
    return Steer(ids)


@pytest.fixture(scope="module")
def schema(gateway: ServerProcess) -> Any:
    loaded = schemathesis.openapi.from_url(f"{base_url(gateway)}/openapi.json")
    return loaded


def test_the_gateway_serves_the_document(gateway: ServerProcess) -> None:
    answer = requests.get(f"{base_url(gateway)}/openapi.json", timeout=TIMEOUT)  # no key needed
    assert answer.status_code == 200
    assert answer.json() == openapi.document()


# What the fuzzer found (each answered 500 before its fix), pinned: method, path, JSON body, the status now.
FOUND: tuple[tuple[str, str, object, int], ...] = (
    # a lone surrogate escape reached protobuf or the tokenizer (UnicodeEncodeError): bodies.check_json
    ("POST", "/v1/completions", {"model": "{base}", "prompt": "\ud800", "max_tokens": 2}, 400),
    (
        "POST",
        "/api/v1/asample",
        {
            "sampling_session_id": "{sampler}",
            "seq_id": 0,
            "sampling_params": {"stop": "x\udfff"},
            "prompt": {"chunks": [{"type": "encoded_text", "tokens": [1, 2]}]},
        },
        400,
    ),
    # "²".isdigit() holds and int("²") raises: episode_routes.list_episodes, openai_routes.reference
    ("GET", "/v1/episodes?limit=%C2%B2", None, 400),
    ("GET", "/v1/models/gw-a%2Fx@%C2%B2", None, 404),
    ("POST", "/v1/chat/completions", {"model": "x@\u00b2", "messages": [{"role": "user", "content": "hi"}]}, 404),
    # an integer past float64: float() / math.isfinite raised OverflowError (openai_requests.number, parse_reward)
    ("POST", "/v1/completions", {"model": "{base}", "prompt": "hi", "frequency_penalty": 10**400}, 400),
    ("POST", "/v1/episodes/{episode}/reward", {"reward": 10**400}, 400),
    # an unhashable role met a set lookup (TypeError): openai_requests.message
    ("POST", "/v1/chat/completions", {"model": "{base}", "messages": [{"role": [None], "content": "hi"}]}, 400),
)


def _filled(value: object, names: dict[str, str]) -> Any:
    if isinstance(value, str):
        return value.format(**names) if value.startswith("{") and value.endswith("}") else value
    if isinstance(value, dict):
        return {key: _filled(item, names) for key, item in value.items()}
    if isinstance(value, list):
        return [_filled(item, names) for item in value]
    return value


@pytest.mark.parametrize(("method", "path", "body", "status"), FOUND, ids=[f"{m} {p}" for m, p, _b, _s in FOUND])
def test_what_the_fuzzer_found_is_a_4xx(
    gateway: ServerProcess, steer: Steer, method: str, path: str, body: object, status: int
) -> None:
    names = {"base": str(steer.ids["model"]), "sampler": str(steer.ids["sampler_id"]), "episode": "fuzz-found"}
    if "{episode}" in path:
        _episode(gateway, str(steer.ids["model"]), "fuzz-found")
    answer = requests.request(
        method,
        f"{base_url(gateway)}{path.format(**names)}",
        json=_filled(body, names),
        headers={"X-API-Key": KEY_A},
        timeout=TIMEOUT,
    )
    assert answer.status_code == status, answer.text
    assert not _LEAKS.search(answer.text), answer.text


def test_a_compressed_json_body_is_a_400(gateway: ServerProcess) -> None:
    """The gateway does not decode Content-Encoding on JSON routes (only forward_backward's zstd): gzip bytes are
    not JSON."""
    answer = requests.post(
        f"{base_url(gateway)}/api/v1/create_session",
        data=gzip.compress(b"{}"),
        timeout=TIMEOUT,
        headers={"X-API-Key": KEY_A, "Content-Encoding": "gzip"},
    )
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"] == "MALFORMED_JSON"


def _headers(case: Any, auth: str) -> dict[str, str]:
    """The key as drawn: a valid one in X-API-Key or (any route: /api/v1 must refuse it) as a Bearer token, or
    whatever the generator made (a random key, or none)."""
    if auth == "none":
        return {}
    if case.headers:
        case.headers = {k: v for k, v in case.headers.items() if k.lower() not in ("x-api-key", "authorization")}
    return {"X-API-Key": KEY_A} if auth == "key" else {"Authorization": f"Bearer {KEY_A}"}


STATUSES: Counter[tuple[str, int]] = Counter()  # (route, status) of every answer


def check(case: Any, auth: str, gateway: ServerProcess) -> None:
    headers = _headers(case, auth)
    where = f"{case.method} {case.formatted_path}"
    try:
        response = case.call(base_url=base_url(gateway), headers=headers, timeout=TIMEOUT)
    except requests.Timeout:
        pytest.fail(f"{where}: no answer within {TIMEOUT} s (a hang)\n{case.as_curl_command(headers=headers)}")
    STATUSES[(case.operation.label, response.status_code)] += 1
    shown = f"{where} -> {response.status_code} {response.text[:500]}\n{case.as_curl_command(headers=headers)}"
    assert response.status_code < 500, shown
    assert not _LEAKS.search(response.text), shown
    case.validate_response(response, checks=list(CHECKS), headers=headers)


@pytest.mark.timeout(300 + 2 * EXAMPLES)
def test_every_route_answers_fuzzed_requests_without_a_5xx(gateway: ServerProcess, schema: Any, steer: Steer) -> None:
    operations = [result.ok() for result in schema.get_all_operations()]
    documented = {f"{route.method} {openapi.openapi_path(route.path)}" for route in openapi.ROUTES}
    # from_url leaves out the route it loaded the document from (test_the_gateway_serves_the_document asks it)
    assert {operation.label for operation in operations} == documented - {"GET /openapi.json"}
    STATUSES.clear()
    seconds: dict[str, float] = {}
    for operation in operations:
        cases = st.one_of(
            operation.as_strategy(GenerationMode.POSITIVE), operation.as_strategy(GenerationMode.NEGATIVE)
        )

        @settings(
            max_examples=EXAMPLES,
            deadline=None,
            suppress_health_check=list(HealthCheck),
            derandomize=True,
            database=None,
        )
        @given(case=cases, auth=st.sampled_from(AUTH), data=st.data())
        def fuzz(case: Any, auth: str, data: st.DataObject) -> None:
            steer.apply(case, data)
            check(case, auth, gateway)

        started = time.monotonic()
        fuzz()
        seconds[operation.label] = time.monotonic() - started
    # Every route was reached, and past the key check: some answers of each come from its handler.
    reached = {label for label, _status in STATUSES}
    assert reached == {operation.label for operation in operations}, reached
    handled = {label for (label, status) in STATUSES if status != 401}
    assert handled == reached, reached - handled
    by_status = Counter[int]()
    for (_label, status), n in STATUSES.items():
        by_status[status] += n
    slowest = ", ".join(f"{label} {t:.1f} s" for label, t in sorted(seconds.items(), key=lambda kv: -kv[1])[:3])
    print(
        f"fuzzed {sum(by_status.values())} requests over {len(operations)} routes: {sorted(by_status.items())}; "
        f"slowest: {slowest}"
    )
