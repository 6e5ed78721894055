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

import httpx
import pytest
from gatewayfuzzcases import (
    EXAMPLES,
    KEY_A,
    KEY_B,
    MAX_BODY,
    ONE_CHECKPOINT,
    V1_EXAMPLES,
    V1_ROUTES,
    Fuzz,
    Tally,
    _post,
    _result,
)
from gatewayfuzzstrategies import _json, near_valid_message, request_of, v1_request_of
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from serverproc import ServerProcess, opentinker_command
from tinker.proto import tinker_public_pb2 as tpb


@pytest.fixture(scope="module")
def tally(module_figure: Callable[[str, object], None]) -> Iterator[Tally]:
    cases = Tally()
    yield cases
    module_figure("gateway_fuzz_cases", sum(cases.counts.values()))
    module_figure("gateway_fuzz_statuses", dict(sorted(cases.statuses.items())))


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
