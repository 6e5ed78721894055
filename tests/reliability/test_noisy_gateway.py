"""Noisy neighbours at the gateway (issue cases 4, 5, 10, 12): team-a abuses the HTTP API while team-b (another
API key, another tenant) trains and samples through the unmodified tinker SDK at the same time. team-b gets
0 errors and the same losses and seeded tokens as when it ran alone; team-a gets 4xx answers the SDK does
not retry (``x-should-retry: false``, the gateway's error body); the gateway's memory comes back within a
stated bound. The stack (registry, trainer, sampler, gateway) is private to this module."""

from __future__ import annotations

import concurrent.futures
import json
import os
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import tinker
import zstandard
from serverproc import ServerProcess, opentinker_command
from tinker import types
from tinker.proto import tinker_public_pb2 as tpb

from opentinker.cli.launch import tree_memory

os.environ["TINKER_TELEMETRY"] = "0"

KEY_A, KEY_B = "tml-noisy-team-a", "tml-noisy-team-b"
TOKENS = [17, 42, 99, 7, 256, 301, 12, 88, 150, 33, 64, 5]
MiB = 1 << 20
# Small bounds so that the abuse reaches them quickly (the defaults are in `opentinker gateway serve --help`).
BODY_CAP, PENDING_CAP, TENANT_PENDING_CAP, WINDOW, PENDING_TTL, SESSION_TTL = 16 * MiB, 64 * MiB, 100 * MiB, 16, 10, 25
GATEWAY_FLAGS = (
    "--max-body-bytes",
    str(BODY_CAP),
    "--max-pending-bytes",
    str(PENDING_CAP),
    "--seq-window",
    str(WINDOW),
    "--max-tenant-pending-bytes",
    str(TENANT_PENDING_CAP),
    "--pending-ttl-seconds",
    str(PENDING_TTL),
    "--session-ttl-seconds",
    str(SESSION_TTL),
)


@dataclass
class Gateway:
    server: ServerProcess
    url: str
    tiny_model: Path
    http: httpx.Client

    def post(self, route: str, body: object, key: str = KEY_A, **kwargs: object) -> httpx.Response:
        content = body if isinstance(body, bytes) else json.dumps(body).encode()
        headers = {"X-API-Key": key, "Content-Type": "application/json", **kwargs.pop("headers", {})}  # type: ignore[dict-item]
        return self.http.post(f"/api/v1/{route}", content=content, headers=headers)

    def memory(self) -> int:
        return int(tree_memory(self.server.process.pid))


@pytest.fixture(scope="module")
def gateway(
    start_stack: Callable[..., dict[str, ServerProcess]], tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Gateway]:
    stack = start_stack("noisy-gateway")
    workdir = tmp_path_factory.mktemp("noisy-gateway-http")
    keys = workdir / "keys.json"
    keys.write_text(json.dumps({"keys": [{"key": KEY_A, "tenant": "team-a"}, {"key": KEY_B, "tenant": "team-b"}]}))
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
        *GATEWAY_FLAGS,
    )
    server = ServerProcess(args, workdir)
    url = f"http://{server.address}"
    with httpx.Client(base_url=url, timeout=120) as http:
        yield Gateway(server, url, tiny_model, http)
    assert server.terminate() == 0, server.log()
    assert "Traceback" not in server.log() and "incident" not in server.log(), server.log()


# --- team-b's normal workload ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Outputs:
    losses: tuple[float, ...]
    tokens: tuple[tuple[int, ...], ...]


def _datums(shift: int) -> list[types.Datum]:
    data = []
    for i in range(2):
        tokens = [(t + 31 * i + shift) % 500 + 3 for t in TOKENS]
        n = len(tokens) - 1
        data.append(
            types.Datum(
                model_input=types.ModelInput.from_ints(tokens[:-1]),
                loss_fn_inputs={
                    "target_tokens": types.TensorData(data=tokens[1:], dtype="int64", shape=[n]),
                    "weights": types.TensorData(data=[1.0] * n, dtype="float32", shape=[n]),
                },
            )
        )
    return data


def team_b(gw: Gateway, steps: int = 3) -> Outputs:
    """Seeded SFT steps, a snapshot and seeded samples from it, through the SDK; raises on any error."""
    service = tinker.ServiceClient(base_url=gw.url, api_key=KEY_B)
    try:
        training = service.create_lora_training_client(base_model=str(gw.tiny_model), rank=4, seed=7).result()
        losses = []
        for step in range(steps):
            out = training.forward_backward(_datums(step), "cross_entropy").result()
            losses.append(float(out.metrics["loss:sum"]))
            training.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        sampler = training.save_weights_and_get_sampling_client().result()
        params = types.SamplingParams(max_tokens=6, temperature=1.0, seed=11)
        result = sampler.sample(types.ModelInput.from_ints(TOKENS[:5]), 2, params).result()
        return Outputs(tuple(losses), tuple(tuple(s.tokens) for s in result.sequences))
    finally:
        service.close("success").result()


@pytest.fixture(scope="module")
def alone(gateway: Gateway) -> Outputs:
    """team-b's outputs with nobody else on the gateway."""
    return team_b(gateway)


def during(gw: Gateway, abuse: Callable[[], None]) -> Outputs:
    """Runs team-b's workload while ``abuse`` runs; team-b must finish without an error."""
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        workload = pool.submit(team_b, gw)
        abuse()
        return workload.result(timeout=600)


def refused(response: httpx.Response, status: int, code: str) -> None:
    """A deliberate answer: the status, the gateway's error body, and no retry by the SDK."""
    assert response.status_code == status, response.text[:500]
    assert response.headers.get("x-should-retry") == "false", response.headers
    body = response.json()
    assert body["error"] == code and body["detail"], body


# --- cases 4 and 12: every numeric field checked before anything is built -------------------------------


def result(gw: Gateway, request_id: str, key: str = KEY_A) -> dict[str, object]:
    """A future's JSON result (long-polls until it is there)."""
    while True:
        reply = gw.post("retrieve_future", {"request_id": request_id}, key)
        assert reply.status_code == 200, reply.text
        body = reply.json()
        if body.get("type") != "try_again":
            return dict(body)


def _session(gw: Gateway, key: str = KEY_A) -> str:
    response = gw.post("create_session", {"tags": [], "sdk_version": "0.38.0", "user_metadata": None}, key)
    assert response.status_code == 200, response.text
    return str(response.json()["session_id"])


def _sample_body(**changes: object) -> dict[str, object]:
    params = {"max_tokens": 4, "temperature": 1.0, "seed": 1, **changes.pop("params", {})}  # type: ignore[dict-item]
    return {
        "base_model": "tiny-qwen2",
        "num_samples": 1,
        "prompt": {"chunks": [{"type": "encoded_text", "tokens": [1, 2]}]},
        "sampling_params": params,
        **changes,
    }


def _bad_requests(gw: Gateway, session: str) -> list[tuple[str, bytes | dict[str, object], int, str]]:
    """(route, body, status, error code) for every out-of-range field of cases 4 and 12."""
    model = {"session_id": session, "model_seq_id": 0, "base_model": "tiny-qwen2"}
    deep = ("[" * 100_000 + "]" * 100_000).encode()
    rows: list[tuple[str, bytes | dict[str, object], int, str]] = [
        ("asample", _sample_body(num_samples=10_000_000), 400, "INVALID_FIELD"),
        ("asample", _sample_body(num_samples=65), 400, "INVALID_FIELD"),
        ("asample", _sample_body(num_samples=0), 400, "INVALID_FIELD"),
        ("asample", _sample_body(num_samples=2**70), 400, "INVALID_FIELD"),
        ("asample", _sample_body(num_samples="3"), 400, "INVALID_FIELD"),
        ("asample", _sample_body(params={"max_tokens": 1e12}), 400, "INVALID_FIELD"),
        ("asample", _sample_body(params={"max_tokens": 0}), 400, "INVALID_FIELD"),
        ("asample", _sample_body(params={"max_tokens": 2.5}), 400, "INVALID_FIELD"),
        (
            "asample",
            json.dumps(_sample_body()).replace('"max_tokens": 4', '"max_tokens": Infinity').encode(),
            400,
            "MALFORMED_JSON",
        ),
        (
            "asample",
            json.dumps(_sample_body()).replace('"temperature": 1.0', '"temperature": NaN').encode(),
            400,
            "MALFORMED_JSON",
        ),
        ("asample", _sample_body(params={"top_k": 1e20}), 400, "INVALID_FIELD"),
        ("asample", _sample_body(params={"top_k": 2**40}), 400, "INVALID_FIELD"),
        ("asample", _sample_body(params={"top_p": 1.5}), 400, "INVALID_FIELD"),
        ("asample", _sample_body(params={"temperature": -1}), 400, "INVALID_FIELD"),
        ("asample", _sample_body(params={"temperature": 1e300}), 400, "INVALID_FIELD"),
        ("asample", _sample_body(params={"seed": 2**64}), 400, "INVALID_FIELD"),
        ("asample", _sample_body(params={"seed": -1}), 400, "INVALID_FIELD"),
        ("asample", _sample_body(params={"stop": [2**40]}), 400, "INVALID_FIELD"),
        ("asample", _sample_body(params={"stop": ["x"] * 17}), 400, "INVALID_FIELD"),
        (
            "asample",
            _sample_body(prompt={"chunks": [{"type": "encoded_text", "tokens": [2**63]}]}),
            400,
            "INVALID_FIELD",
        ),
        ("asample", _sample_body(topk_prompt_logprobs=2**70), 400, "INVALID_FIELD"),
        ("asample", deep, 400, "JSON_TOO_DEEP"),
        ("asample", ("{" + '"a":{' * 40 + "}" * 41).encode(), 400, "JSON_TOO_DEEP"),
        ("create_model", {**model, "lora_config": {"rank": 4, "seed": 2**70}}, 400, "INVALID_FIELD"),
        ("create_model", {**model, "lora_config": {"rank": 4, "seed": -5}}, 400, "INVALID_FIELD"),
        ("create_model", {**model, "lora_config": {"rank": 10**6}}, 400, "INVALID_FIELD"),
        ("create_model", {**model, "lora_config": {"rank": 0}}, 400, "INVALID_FIELD"),
        ("create_model", {**model, "lora_config": {"rank": 4.5}}, 400, "INVALID_FIELD"),
        ("create_model", {**model, "lora_config": {"rank": 4, "train_mlp": "yes"}}, 400, "INVALID_FIELD"),
        ("create_model", {**model, "model_seq_id": 2**70}, 400, "INVALID_FIELD"),
        ("create_model", {**model, "model_seq_id": -1}, 400, "INVALID_FIELD"),
        ("create_sampling_session", {"session_id": session, "sampling_session_seq_id": 2**64}, 400, "INVALID_FIELD"),
        ("optim_step", deep, 400, "JSON_TOO_DEEP"),
        ("create_session", deep, 400, "JSON_TOO_DEEP"),
        ("session_heartbeat", b"\xff\xfe{}", 400, "MALFORMED_JSON"),
    ]
    return rows


def _abuse_numbers(gw: Gateway) -> None:
    session = _session(gw)
    for route, body, status, code in _bad_requests(gw, session):
        refused(gw.post(route, body), status, code)
    # A model of team-a, so that its numbered requests get past the model lookup to their own fields.
    created = gw.post(
        "create_model",
        {"session_id": session, "model_seq_id": 1, "base_model": "tiny-qwen2", "lora_config": {"rank": 4, "seed": 1}},
    )
    assert created.status_code == 200, created.text
    model_id = created.json()["model_id"]
    assert result(gw, created.json()["request_id"])["model_id"] == model_id
    for adam in ({"learning_rate": 1e39}, {"learning_rate": "fast"}, {"beta1": 1e300}, {"eps": -(2**200)}):
        refused(gw.post("optim_step", {"model_id": model_id, "seq_id": 1, "adam_params": adam}), 400, "INVALID_FIELD")
    infinite = json.dumps({"model_id": model_id, "seq_id": 1, "adam_params": {"eps": float("-inf")}}).encode()
    refused(gw.post("optim_step", infinite), 400, "MALFORMED_JSON")
    for seq in (0, -3, 2**64, "1"):
        refused(gw.post("optim_step", {"model_id": model_id, "seq_id": seq, "adam_params": {}}), 400, "INVALID_FIELD")
    refused(gw.post("save_weights", {"model_id": model_id, "seq_id": 1, "overwrite": "no"}), 400, "INVALID_FIELD")
    refused(
        gw.post("load_weights", {"path": "tinker://x", "optimizer": 3, "model_id": model_id, "seq_id": 1}),
        400,
        "INVALID_FIELD",
    )

    # The same through the unmodified SDK: BadRequestError at once (the SDK does not retry it).
    service = tinker.ServiceClient(base_url=gw.url, api_key=KEY_A)
    try:
        sampler = service.create_sampling_client(base_model=str(gw.tiny_model)).result()
        prompt = types.ModelInput.from_ints([1, 2, 3])
        with pytest.raises(tinker.BadRequestError, match="num_samples"):
            sampler.sample(prompt, 10_000_000, types.SamplingParams(max_tokens=4)).result()
        for params in (
            types.SamplingParams(max_tokens=10**12),
            types.SamplingParams(max_tokens=4, top_k=10**20),
            types.SamplingParams(max_tokens=4, seed=2**64),
        ):
            with pytest.raises(tinker.BadRequestError, match=r"INVALID_FIELD|must be"):
                sampler.sample(prompt, 1, params).result()
        with pytest.raises(tinker.BadRequestError, match=r"lora_config\.seed"):
            service.create_lora_training_client(base_model=str(gw.tiny_model), rank=4, seed=2**70).result()
    finally:
        service.close("success").result()


def test_out_of_range_numbers_are_400_while_team_b_runs(
    gateway: Gateway, alone: Outputs, figure: Callable[[str, object], None]
) -> None:
    before = gateway.memory()
    outputs = during(gateway, lambda: _abuse_numbers(gateway))
    after = gateway.memory()
    assert outputs == alone
    assert gateway.http.get("/api/v1/healthz").json() == {"status": "ok"}
    figure("gateway_numbers_memory_mb", f"{before / MiB:.0f} -> {after / MiB:.0f}")
    assert after - before < 64 * MiB


# --- case 5: forward_backward bodies parked behind a seq_id gap ---------------------------------------------


def _inflating_body(model_id: str, seq_id: int, inflated: int) -> bytes:
    """A zstd forward_backward body of a few KB that inflates to ``inflated`` bytes (one datum of zero tokens)."""
    message = tpb.ForwardBackwardRequest(model_id=model_id, seq_id=seq_id, loss_fn="cross_entropy")
    message.data.add().model_input.add().encoded_text.tokens = bytes(inflated)
    return bytes(zstandard.ZstdCompressor().compress(message.SerializeToString()))


def _post_fwdbwd(gw: Gateway, body: bytes) -> httpx.Response:
    headers = {"Content-Type": "application/x-protobuf", "Content-Encoding": "zstd"}
    return gw.post("forward_backward", body, headers=headers)


@dataclass
class Parked:
    accepted: list[str]  # request ids of the bodies parked behind the gap
    refused: dict[str, int]  # error code -> count
    session: str
    models: list[str]
    peak: int  # gateway memory with the bodies parked


def _park(gw: Gateway) -> Parked:
    """Two models of team-a, each with bodies parked behind seq_id 1 (which never comes) until refused."""
    session = _session(gw)
    models = []
    for seq in (0, 1):
        lora = {"rank": 4, "seed": 3}
        created = gw.post(
            "create_model",
            {"session_id": session, "model_seq_id": seq, "base_model": "tiny-qwen2", "lora_config": lora},
        )
        models.append(str(result(gw, created.json()["request_id"])["model_id"]))
    accepted: list[str] = []
    counts: Counter[str] = Counter()
    for model_id in models:
        for seq_id in range(2, WINDOW + 3):
            response = _post_fwdbwd(gw, _inflating_body(model_id, seq_id, 12 * MiB))
            if response.status_code == 200:
                accepted.append(str(response.json()["request_id"]))
            else:
                code = "SEQ_ID_TOO_FAR_AHEAD" if seq_id > WINDOW else "TOO_MUCH_PENDING"
                refused(response, 400 if seq_id > WINDOW else 429, code)
                counts[code] += 1
    peak = gw.memory()
    refused(_post_fwdbwd(gw, _inflating_body(models[0], 3, 32 * MiB)), 413, "BODY_TOO_LARGE")
    return Parked(accepted, dict(counts), session, models, peak)


def test_parked_bodies_are_bounded_and_expire_while_team_b_runs(
    gateway: Gateway, alone: Outputs, figure: Callable[[str, object], None]
) -> None:
    before = gateway.memory()
    parked: list[Parked] = []

    def abuse() -> None:
        parked.append(_park(gateway))
        for request_id in parked[0].accepted:  # each fails once the gap outlives --pending-ttl-seconds
            failure = result(gateway, request_id)
            assert failure["category"] == "user" and "seq_id 1 did not arrive" in str(failure["error"]), failure

    outputs = during(gateway, abuse)
    after = gateway.memory()
    (abuse_a,) = parked
    assert outputs == alone
    # 15 ids in each model's window behind the gap: 5 bodies of 12 MiB fit in the model's 64 MiB, then 3 more in
    # the second model (the tenant's 100 MiB); the rest are refused, and 2 ids per model beyond the window.
    assert len(abuse_a.accepted) == 8
    assert abuse_a.refused == {"TOO_MUCH_PENDING": 22, "SEQ_ID_TOO_FAR_AHEAD": 4}
    figure("gateway_parked_memory_mb", f"{before / MiB:.0f} -> {abuse_a.peak / MiB:.0f} -> {after / MiB:.0f}")
    assert abuse_a.peak - before > 80 * MiB  # the parked bodies (96 MiB) were held ...
    assert after - before < 16 * MiB  # ... and given back after expiry
    # The gap's own request now fails too (the model is poisoned), and the model's lane holds nothing.
    late = _post_fwdbwd(gateway, _inflating_body(abuse_a.models[0], 1, 1024))
    assert late.status_code == 200, late.text
    assert "did not arrive" in str(result(gateway, late.json()["request_id"])["error"])

    # team-a's session sends no heartbeats: it expires, its model is forgotten, a heartbeat then answers 410.
    while gateway.post("get_info", {"model_id": abuse_a.models[0]}).status_code == 200:
        time.sleep(1)
    refused(gateway.post("get_info", {"model_id": abuse_a.models[0]}), 404, "UNKNOWN_MODEL")
    refused(gateway.post("session_heartbeat", {"session_id": abuse_a.session}), 410, "SESSION_FINISHED")
    assert gateway.http.get("/api/v1/healthz").json() == {"status": "ok"}


# --- case 10: strings bounded, client strings escaped in the log ---------------------------------------------

FORGED = "0.1\n2026-01-01 00:00:00 ERROR gateway: forged-by-team-a"  # at most 64 characters


def _abuse_strings(gw: Gateway) -> None:
    session = _session(gw)
    refused(gw.post("create_session", {"tags": [], "sdk_version": "x" * (20 * MiB)}), 413, "BODY_TOO_LARGE")
    refused(gw.post("create_session", {"tags": [], "sdk_version": "x" * 5000}), 400, "STRING_TOO_LONG")
    refused(gw.post("create_session", {"tags": [], "sdk_version": "x" * 65}), 400, "INVALID_FIELD")
    refused(gw.post("create_session", {"tags": [], "sdk_version": 7}), 400, "INVALID_FIELD")
    refused(gw.post("create_session", {"tags": ["t" * 5000], "sdk_version": "0.38.0"}), 400, "STRING_TOO_LONG")
    refused(
        gw.post("create_session", {"tags": [], "sdk_version": "0.38.0", "user_metadata": {"k" * 5000: 1}}),
        400,
        "STRING_TOO_LONG",
    )
    long = "m" * 5000
    for route, body in (
        ("create_model", {"session_id": session, "model_seq_id": 2, "base_model": long}),
        ("get_info", {"model_id": long}),
        ("retrieve_future", {"request_id": long}),
        ("session_heartbeat", {"session_id": long}),
        ("asample", _sample_body(base_model=long)),
        ("save_weights", {"model_id": "x", "seq_id": 1, "path": long}),
    ):
        refused(gw.post(route, body), 400, "STRING_TOO_LONG")
    message = tpb.ForwardBackwardRequest(model_id=long, seq_id=1, loss_fn="cross_entropy")
    message.data.add().model_input.add().encoded_text.tokens = bytes(8)
    refused(_post_fwdbwd(gw, zstandard.ZstdCompressor().compress(message.SerializeToString())), 400, "STRING_TOO_LONG")
    # A newline in a string the gateway logs (an unsupported sdk_version is logged as a warning).
    warned = gw.post("create_session", {"tags": [], "sdk_version": FORGED})
    assert warned.status_code == 200 and "forged-by-team-a" in warned.json()["warning_message"]


def test_strings_are_bounded_and_escaped_in_the_log_while_team_b_runs(
    gateway: Gateway, alone: Outputs, figure: Callable[[str, object], None]
) -> None:
    before = gateway.memory()
    outputs = during(gateway, lambda: _abuse_strings(gateway))
    after = gateway.memory()
    assert outputs == alone
    figure("gateway_strings_memory_mb", f"{before / MiB:.0f} -> {after / MiB:.0f}")
    assert after - before < 32 * MiB
    log = gateway.server.log()
    assert "forged-by-team-a" in log  # logged, escaped, on the warning's own line
    assert not [line for line in log.splitlines() if "forged-by-team-a" in line and " WARNING " not in line]
