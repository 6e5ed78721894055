"""The gateway of the noisy-neighbour gateway tests (test_noisy_gateway.py, test_noisy_gateway_sdk.py): its keys,
small bounds and flags, a client of it, team-b's seeded workload through the tinker SDK, the check of a deliberate
refusal, and the out-of-range requests of cases 4 and 12."""

from __future__ import annotations

import concurrent.futures
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx
import tinker
from serverproc import ServerProcess
from tinker import types

from opentinker.cli.launch import tree_memory

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
