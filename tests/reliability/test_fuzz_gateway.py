"""Property-based fuzzing of every HTTP route of the gateway (test_fuzz_rpcs.py does the gRPC services).

Bodies are random JSON, valid bodies with fields replaced, dropped or nested deeper (wrong types, huge and
negative numbers, long and control-character strings, the ids of things that exist), raw bytes (invalid UTF-8,
truncated JSON, NaN/Infinity, 100k-deep nesting), and for forward_backward mutated tinker protobufs, raw or
zstd (corrupt frames, bombs). Every answer must be 2xx or a deliberate 4xx with the gateway's error body and
``x-should-retry: false``, never 5xx; the jobs accepted must never fail as an "internal gateway error" (the
gateway logs those with an incident id); the gateway must stay healthy. The stack is private to this module.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import httpx
import pytest
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from serverproc import ServerProcess, opentinker_command
from tinker.proto import tinker_public_pb2 as tpb

KEY_A, KEY_B = "tml-fuzz-team-a", "tml-fuzz-team-b"
MiB = 1 << 20
MAX_BODY = 4 * MiB
POST_ROUTES = (
    "client/config",
    "client/dynamic_config",
    "create_session",
    "session_heartbeat",
    "sessions/{session}/finish",
    "retrieve_future",
    "cancel_future",
    "telemetry",
    "create_model",
    "get_info",
    "forward_backward",
    "optim_step",
    "save_weights",
    "save_weights_for_sampler",
    "load_weights",
    "create_sampling_session",
    "asample",
)
GET_ROUTES = ("healthz", "get_server_capabilities", "samplers/{sampler}")
ONE_CHECKPOINT = "training_runs/{run}/checkpoints/{segment}/{name}"
# The RestClient's routes and their methods (GET and DELETE without a body).
REST_ROUTES = {
    "training_runs": ("GET",),
    "training_runs/{run}": ("GET",),
    "training_runs/{run}/checkpoints": ("GET",),
    "checkpoints": ("GET",),
    ONE_CHECKPOINT: ("GET", "DELETE"),
    f"{ONE_CHECKPOINT}/ttl": ("PUT",),
    f"{ONE_CHECKPOINT}/publish": ("POST", "DELETE"),
    "weights_info": ("POST",),
}
QUERIES = [
    "",
    "?limit=5",
    "?limit=0",
    "?limit=-1",
    "?limit=99999999999999999999",
    "?offset=3&limit=2",
    "?access_scope=accessible",
    "?access_scope=x",
    "?limit=abc",
    "?offset=-4",
]
EXAMPLES = {route: 40 for route in (*POST_ROUTES, *GET_ROUTES, *REST_ROUTES)} | {
    "forward_backward": 80,
    "asample": 70,
    "create_model": 50,
    "healthz": 10,
    "client/dynamic_config": 15,
    "telemetry": 15,
    "get_server_capabilities": 10,
}
# The OpenAI-compatible surface (/v1): its routes and methods; errors in OpenAI's JSON instead of the tinker one.
V1_ROUTES = {
    "models": ("GET",),
    "models/{model}": ("GET",),
    "chat/completions": ("POST",),
    "completions": ("POST",),
    "episodes": ("GET",),
    "episodes/{episode}": ("GET", "DELETE"),
    "episodes/{episode}/reward": ("POST",),
}
V1_EXAMPLES = {route: 30 for route in V1_ROUTES} | {"chat/completions": 60, "completions": 50}
V1_TEMPLATES: dict[str, dict[str, object]] = {
    "chat/completions": {
        "model": "base",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 3,
        "temperature": 1.0,
        "seed": 5,
        "stop": ["x"],
        "return_token_ids": True,
        "metadata": {"episode_id": "fuzz-1"},
        "stream": False,
    },
    "completions": {"model": "base", "prompt": [1, 2, 3], "max_tokens": 3, "n": 2, "logprobs": 1, "stream": True},
    "episodes/{episode}/reward": {"reward": 1.0, "turn": 0},
}

HUGE_INTS = [2**31, 2**32, 2**53 + 1, 2**63, 2**64, 2**70, 10**30, -(2**63) - 1, -(2**70), -1, 0, 1, 64, 65, 10**7]
FLOATS = [1e12, 1e20, 1e39, 1e300, -1e300, 0.5, -0.0, 1e-320, 3.4e38, 2.5]
STRINGS = [
    "",
    " ",
    "\n",
    "a\nb",
    "\x00",
    "\x1b[2J",
    "\u2028",
    "é",
    "\U0001f600",
    "../x",
    "tinker://",
    "tinker://x/weights/y",
    "base",
    "0.38.0",
    "cross_entropy",
    "adamw",
    "snapshot",
    "x" * 5000,
    "%s%n",
    "null",
    "NaN",
]


@dataclass
class Fuzz:
    server: ServerProcess
    http: httpx.Client
    known: dict[str, str]  # session, model, sampler, state, weights, request
    templates: dict[str, object]


@dataclass
class Tally:
    """The cases the fuzz tests of this module sent (by route) and the statuses they got: each test asserts on the
    cases it sent itself; the module's totals go to the run's summary."""

    counts: Counter[str] = field(default_factory=Counter)
    statuses: Counter[int] = field(default_factory=Counter)


@pytest.fixture(scope="module")
def tally(module_figure: Callable[[str, object], None]) -> Iterator[Tally]:
    cases = Tally()
    yield cases
    module_figure("gateway_fuzz_cases", sum(cases.counts.values()))
    module_figure("gateway_fuzz_statuses", dict(sorted(cases.statuses.items())))


def _post(http: httpx.Client, route: str, body: object, key: str = KEY_A) -> httpx.Response:
    return http.post(f"/api/v1/{route}", json=body, headers={"X-API-Key": key})


def _result(http: httpx.Client, request_id: str) -> dict[str, object]:
    while True:
        body = _post(http, "retrieve_future", {"request_id": request_id}).json()
        if body.get("type") != "try_again":
            return dict(body)


def _fwdbwd(model_id: str, seq_id: int) -> bytes:
    message = tpb.ForwardBackwardRequest(model_id=model_id, seq_id=seq_id, loss_fn="cross_entropy")
    datum = message.data.add()
    datum.model_input.add().encoded_text.tokens = bytes(4 * 3)
    target = datum.loss_fn_inputs["target_tokens"]
    target.dtype, target.dense = tpb.DTYPE_INT64, bytes(8 * 3)
    target.shape.append(3)
    return bytes(message.SerializeToString())


@pytest.fixture(scope="module")
def fuzz(
    start_stack: Callable[..., dict[str, ServerProcess]], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Fuzz]:
    stack = start_stack("fuzz-gateway")
    workdir = tmp_path_factory.mktemp("fuzz-gateway-http")
    keys = workdir / "keys.json"
    keys.write_text(json.dumps({"keys": [{"key": KEY_A, "tenant": "fuzz-a"}, {"key": KEY_B, "tenant": "fuzz-b"}]}))
    args = opentinker_command(
        "gateway",
        "serve",
        "--trainer",
        stack["trainer"].address,
        "--sampler",
        stack["sampler"].address,
        "--registry",
        stack["registry"].address,
        "--keys-file",
        str(keys),
        "--port",
        "0",
        "--poll-seconds",
        "1",
        "--max-body-bytes",
        str(MAX_BODY),
    )
    server = ServerProcess(args, workdir)
    with httpx.Client(base_url=f"http://{server.address}", timeout=60) as http:
        session = _post(http, "create_session", {"tags": [], "sdk_version": "0.38.0", "user_metadata": None})
        session_id = session.json()["session_id"]
        lora = {"rank": 4, "seed": 1, "train_attn": True, "train_mlp": True, "train_unembed": False}
        model_body = {"session_id": session_id, "model_seq_id": 0, "base_model": "tiny-qwen2", "lora_config": lora}
        created = _post(http, "create_model", model_body).json()
        model_id = str(_result(http, created["request_id"])["model_id"])
        state = _post(http, "save_weights", {"model_id": model_id, "seq_id": 1, "path": "s"}).json()
        weights = _post(http, "save_weights_for_sampler", {"model_id": model_id, "seq_id": 2, "path": "w"}).json()
        sampler_body = {"session_id": session_id, "sampling_session_seq_id": 0, "base_model": "tiny-qwen2"}
        sampler = _post(http, "create_sampling_session", sampler_body).json()["sampling_session_id"]
        _post(http, "save_weights", {"model_id": model_id, "seq_id": 3, "path": "doomed"})  # fuzzed DELETEs may hit it
        known = {
            "session": session_id,
            "model": model_id,
            "sampler": sampler,
            "request": created["request_id"],
            "state": str(_result(http, state["request_id"])["path"]),
            "weights": str(_result(http, weights["request_id"])["path"]),
        }
        prompt = {"chunks": [{"type": "encoded_text", "tokens": [1, 2, 3]}]}
        params = {"max_tokens": 3, "temperature": 1.0, "top_k": -1, "top_p": 1.0, "seed": 5, "stop": None}
        templates: dict[str, object] = {
            "client/config": {"sdk_version": "0.38.0"},
            "client/dynamic_config": {},
            "create_session": {"tags": ["t"], "sdk_version": "0.38.0", "user_metadata": {"k": "v"}},
            "session_heartbeat": {"session_id": session_id},
            "sessions/{session}/finish": {"reason": {"type": "success"}},
            "retrieve_future": {"request_id": created["request_id"]},
            "cancel_future": {"request_id": created["request_id"]},
            "telemetry": {"events": []},
            "create_model": {**model_body, "model_seq_id": 1, "optimizer_config": {"type": "adamw"}},
            "get_info": {"model_id": model_id},
            "optim_step": {"model_id": model_id, "seq_id": 4, "adam_params": {"learning_rate": 1e-3, "beta1": 0.9}},
            "save_weights": {
                "model_id": model_id,
                "seq_id": 4,
                "path": "s2",
                "overwrite": False,
                "ttl_seconds": 3600,
                "user_metadata": {"k": "v"},
            },
            "save_weights_for_sampler": {"model_id": model_id, "seq_id": 4, "path": "w2", "ttl_seconds": 7200},
            f"{ONE_CHECKPOINT}/ttl": {"ttl_seconds": 7200},
            f"{ONE_CHECKPOINT}/publish": {},
            "weights_info": {"tinker_path": known["weights"]},
            "load_weights": {"session_id": session_id, "model_seq_id": 2, "path": known["state"], "optimizer": True},
            "create_sampling_session": {**sampler_body, "sampling_session_seq_id": 1},
            "asample": {
                "sampling_session_id": sampler,
                "seq_id": 0,
                "num_samples": 2,
                "prompt": prompt,
                "sampling_params": params,
                "prompt_logprobs": False,
                "topk_prompt_logprobs": 0,
            },
        }
        yield Fuzz(server, http, known, templates)
    assert server.terminate() == 0, server.log()


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


# --- checks -----------------------------------------------------------------------------------------------


def _check(response: httpx.Response, what: str, statuses: Counter[int]) -> None:
    statuses[response.status_code] += 1
    assert response.status_code < 500, f"{what}: {response.status_code} {response.text[:300]}"
    if response.status_code >= 400:
        assert response.headers.get("x-should-retry") == "false", f"{what}: {response.headers}"
        body = response.json()
        assert set(body) == {"error", "detail", "request_id"} and body["error"].isupper() and body["detail"], (
            f"{what}: {body}"
        )
        assert body["request_id"] == response.headers["x-request-id"], f"{what}: {body}"


def _assert_fuzzed(tally: Tally, route: str, examples: int, statuses: Counter[int]) -> None:
    """This test's own cases: at least half the examples asked for were sent, and none was answered 5xx."""
    cases = sum(statuses.values())
    tally.counts[route] += cases
    tally.statuses.update(statuses)
    assert cases >= examples // 2, f"{route}: {cases} cases of {examples}"
    assert not any(status >= 500 for status in statuses), f"{route}: {dict(statuses)}"


def fuzz_settings(examples: int) -> settings:
    """Reproducible runs of ``examples`` cases; the servers' answers, not hypothesis' timing, are under test."""
    return settings(
        max_examples=examples,
        deadline=None,
        database=None,
        derandomize=True,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example],
    )


def test_every_route_is_fuzzed(fuzz: Fuzz) -> None:
    from opentinker.gateway.app import create_app
    from opentinker.gateway.auth import KeyStore
    from opentinker.gateway.backend import Backends
    from opentinker.gateway.state import Gateway

    app = create_app(Gateway(keys=KeyStore([]), backends=Backends("x:1", "x:2", "x:3")))
    served = {r.resource.canonical.removeprefix("/api/v1/") for r in app.router.routes() if r.resource is not None}
    names = {"{session}": "{session_id}", "{sampler}": "{sampler_id}", "{run}": "{run_id}"}
    fuzzed = {f"/v1/{route}".replace("{episode}", "{episode_id}") for route in V1_ROUTES}
    for route in EXAMPLES:
        canonical = route
        for short, full in names.items():
            canonical = canonical.replace(short, full)
        fuzzed.add(canonical)
    # /openapi.json is a static document: tests/gateway/test_http_fuzz.py and test_openapi.py cover it.
    assert served - {"/openapi.json"} == fuzzed


@pytest.mark.parametrize("route", sorted(EXAMPLES))
def test_fuzzed_requests_get_deliberate_answers(fuzz: Fuzz, tally: Tally, route: str) -> None:
    statuses: Counter[int] = Counter()

    @fuzz_settings(EXAMPLES[route])
    @given(request_of(fuzz, route))
    def check(request: tuple[str, str, bytes, dict[str, str]]) -> None:
        method, path, body, headers = request
        response = fuzz.http.request(method, f"/api/v1/{path}", content=body or None, headers=headers)
        _check(response, f"{method} {path} {body[:200]!r}", statuses)

    check()
    _assert_fuzzed(tally, route, EXAMPLES[route], statuses)


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


def _check_v1(response: httpx.Response, what: str, statuses: Counter[int]) -> None:
    statuses[response.status_code] += 1
    assert response.status_code < 500, f"{what}: {response.status_code} {response.text[:300]}"
    if response.status_code >= 400:
        error = response.json()["error"]
        assert isinstance(error, dict) and error["message"] and error["type"], f"{what}: {response.text[:300]}"


@pytest.mark.parametrize("route", sorted(V1_ROUTES))
def test_fuzzed_v1_requests_get_deliberate_answers(fuzz: Fuzz, tally: Tally, route: str) -> None:
    statuses: Counter[int] = Counter()

    @fuzz_settings(V1_EXAMPLES[route])
    @given(v1_request_of(fuzz, route))
    def check(request: tuple[str, str, bytes, dict[str, str]]) -> None:
        method, path, body, headers = request
        response = fuzz.http.request(method, f"/v1/{path}", content=body or None, headers=headers)
        _check_v1(response, f"{method} {path} {body[:200]!r}", statuses)

    check()
    _assert_fuzzed(tally, f"v1/{route}", V1_EXAMPLES[route], statuses)


def test_gateway_stays_healthy_and_no_job_failed_internally(fuzz: Fuzz) -> None:
    time.sleep(2)  # the last jobs accepted finish (samples, forward_backward)
    assert fuzz.http.get("/api/v1/healthz").json() == {"status": "ok"}
    created = _post(fuzz.http, "create_session", {"tags": [], "sdk_version": "0.38.0"})
    assert created.status_code == 200
    log = fuzz.server.log()
    assert "incident" not in log and "Traceback" not in log, log[-5000:]


# --- the conversions behind the routes, in process (a job's failure is never "internal") --------------------


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


@settings(max_examples=600, deadline=None, database=None, derandomize=True)
@given(near_valid_message())
def test_forward_backward_conversion_fails_only_deliberately(tally: Tally, message: tpb.ForwardBackwardRequest) -> None:
    from opentinker.gateway.errors import GatewayError, RequestFailed
    from opentinker.gateway.tinker import convert

    try:
        convert.check_sizes(message)
        convert.loss_fn_config(message)
        convert.datums(message)
        convert.trace_ids(message, "s")
    except (GatewayError, RequestFailed):
        tally.counts["conversion refused"] += 1


@settings(max_examples=400, deadline=None, database=None, derandomize=True)
@given(
    st.dictionaries(
        st.sampled_from(
            [
                "max_tokens",
                "seed",
                "stop",
                "temperature",
                "top_k",
                "top_p",
                "rank",
                "train_attn",
                "train_mlp",
                "learning_rate",
                "beta1",
                "eps",
            ]
        ),
        _json({"x": "base"}),
        max_size=5,
    )
)
def test_json_conversions_fail_only_deliberately(params: dict[str, object]) -> None:
    from opentinker.gateway.errors import GatewayError
    from opentinker.gateway.tinker import convert

    for conversion in (
        lambda: convert.sampling_params(params, 16),
        lambda: convert.lora_config(params),
        lambda: convert.adam_params(params),
        lambda: convert.prompt_tokens({"chunks": [{"tokens": params.get("stop")}]}),
    ):
        try:
            conversion()
        except GatewayError as exc:
            assert exc.status == 400 and exc.code == "INVALID_FIELD"
