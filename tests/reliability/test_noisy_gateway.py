"""Noisy neighbours at the gateway (issue cases 4, 5, 10, 12): team-a abuses the HTTP API while team-b (another
API key, another tenant) trains and samples through the unmodified tinker SDK at the same time. team-b gets
0 errors and the same losses and seeded tokens as when it ran alone; team-a gets 4xx answers the SDK does
not retry (``x-should-retry: false``, the gateway's error body); the gateway's memory comes back within a
stated bound. The stack (registry, trainer, sampler, gateway) is private to this module."""

from __future__ import annotations

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
from noisygateway import (
    GATEWAY_FLAGS,
    KEY_A,
    KEY_B,
    WINDOW,
    Gateway,
    MiB,
    Outputs,
    _bad_requests,
    _sample_body,
    _session,
    during,
    refused,
    result,
    team_b,
)
from serverproc import ServerProcess, opentinker_command
from tinker import types
from tinker.proto import tinker_public_pb2 as tpb

os.environ["TINKER_TELEMETRY"] = "0"


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


@pytest.fixture(scope="module")
def alone(gateway: Gateway) -> Outputs:
    """team-b's outputs with nobody else on the gateway."""
    return team_b(gateway)


# --- cases 4 and 12: every numeric field checked before anything is built -------------------------------


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
