"""Two API keys are two tenants that cannot reach each other's models, checkpoints or futures; bad requests
(wrong key, unknown model, malformed protobuf, unsupported loss) get the statuses and bodies the SDK
handles, and the gateway keeps serving."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import tinker
import zstandard
from gatewayutil import KEY_A, KEY_B, base_url, floats, ints
from serverproc import ServerProcess
from tinker import types
from tinker.proto import tinker_public_pb2 as tpb

from opentinker.client import RegistryClient

TOKENS = [11, 22, 33, 44, 55, 66, 77, 88]


@pytest.fixture(scope="module")
def http(gateway: ServerProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=base_url(gateway), timeout=60) as client:
        yield client


def sft_datum() -> types.Datum:
    return types.Datum(
        model_input=types.ModelInput.from_ints(TOKENS[:-1]),
        loss_fn_inputs={"target_tokens": ints(TOKENS[1:]), "weights": floats([1.0] * (len(TOKENS) - 1))},
    )


def fwdbwd_body(model_id: str, seq_id: int) -> bytes:
    message = tpb.ForwardBackwardRequest(model_id=model_id, seq_id=seq_id, loss_fn="cross_entropy")
    datum = message.data.add()
    datum.model_input.add().encoded_text.tokens = bytes(4 * 3)
    return bytes(message.SerializeToString())


def error_of(response: httpx.Response, status: int) -> str:
    assert response.status_code == status, response.text
    assert response.headers["x-should-retry"] == "false"
    body = response.json()
    assert body["detail"]
    return str(body["error"])


def test_tenants_are_isolated(
    gateway: ServerProcess, http: httpx.Client, tiny_model: Path, registry_server: ServerProcess
) -> None:
    a = tinker.ServiceClient(base_url=base_url(gateway), api_key=KEY_A)
    b = tinker.ServiceClient(base_url=base_url(gateway), api_key=KEY_B)
    training_a = a.create_lora_training_client(base_model=str(tiny_model), rank=4, seed=1).result()
    training_a.forward_backward([sft_datum()], "cross_entropy").result()
    state = training_a.save_state("a-state").result().path
    weights = training_a.save_weights_for_sampler("a-weights").result().path

    # B cannot load A's checkpoints, sample A's weights, or read A's model or futures.
    with pytest.raises(tinker.RequestFailedError, match="unknown checkpoint"):
        b.create_training_client_from_state_with_optimizer(state).result()
    with pytest.raises(tinker.NotFoundError):
        b.create_sampling_client(model_path=weights).result()
    assert (
        error_of(
            http.post("/api/v1/get_info", json={"model_id": training_a.model_id}, headers={"X-API-Key": KEY_B}), 404
        )
        == "UNKNOWN_MODEL"
    )
    headers_b = {"X-API-Key": KEY_B, "Content-Type": "application/x-protobuf"}
    response = http.post("/api/v1/forward_backward", content=fwdbwd_body(training_a.model_id, 99), headers=headers_b)
    assert error_of(response, 404) == "UNKNOWN_MODEL"
    future = http.post("/api/v1/get_info", json={"model_id": training_a.model_id}, headers={"X-API-Key": KEY_A})
    assert future.status_code == 200
    request_id = http.post(
        "/api/v1/optim_step",
        json={"model_id": training_a.model_id, "seq_id": 200, "adam_params": {"learning_rate": 1e-3}},
        headers={"X-API-Key": KEY_A},
    ).json()["request_id"]
    assert (
        error_of(
            http.post("/api/v1/retrieve_future", json={"request_id": request_id}, headers={"X-API-Key": KEY_B}), 404
        )
        == "UNKNOWN_REQUEST"
    )

    # B trains its own adapter, under its own tenant; A's adapter is untouched by it.
    training_b = b.create_lora_training_client(base_model=str(tiny_model), rank=4, seed=1).result()
    training_b.forward_backward([sft_datum()], "cross_entropy").result()
    training_b.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    training_b.save_weights_for_sampler("b-weights").result()
    with RegistryClient(registry_server.address) as registry:
        tenants = {adapter.name.split("/")[0] for adapter in registry.list_adapters("gw-")}
        session, _, seq = training_a.model_id.split(":")
        a_versions = registry.list_versions(f"gw-a/tinker-{session}-{seq}")
    assert {"gw-a", "gw-b"} <= tenants
    assert len(a_versions) == 1
    a.close("success").result()
    b.close("success").result()


def test_bad_requests_get_sdk_errors_and_the_gateway_keeps_serving(
    gateway: ServerProcess, http: httpx.Client, tiny_model: Path
) -> None:
    # Keys: missing, without the tml- prefix, unknown (the SDK raises AuthenticationError).
    assert error_of(http.post("/api/v1/create_session", json={}), 401) == "MISSING_API_KEY"
    assert (
        error_of(http.post("/api/v1/create_session", json={}, headers={"X-API-Key": "sk-1"}), 401) == "INVALID_API_KEY"
    )
    with pytest.raises(tinker.AuthenticationError):
        tinker.ServiceClient(base_url=base_url(gateway), api_key="tml-nobody").create_lora_training_client(
            base_model=str(tiny_model), rank=4
        ).result()

    headers = {"X-API-Key": KEY_A}
    proto = {**headers, "Content-Type": "application/x-protobuf"}
    # Another SDK version is served, with a warning the SDK logs.
    session = http.post("/api/v1/create_session", json={"tags": [], "sdk_version": "0.1.0"}, headers=headers)
    assert session.status_code == 200 and "0.38.0" in session.json()["warning_message"]
    # Unknown model, malformed protobuf, corrupt zstd, malformed JSON, unknown route, unknown future.
    assert (
        error_of(http.post("/api/v1/get_info", json={"model_id": "nope:train:0"}, headers=headers), 404)
        == "UNKNOWN_MODEL"
    )
    assert (
        error_of(http.post("/api/v1/forward_backward", content=fwdbwd_body("nope:train:0", 1), headers=proto), 404)
        == "UNKNOWN_MODEL"
    )
    garbage = b"\xff\xff\xff\xff not a protobuf"
    assert error_of(http.post("/api/v1/forward_backward", content=garbage, headers=proto), 400) == "MALFORMED_PROTOBUF"
    zstd = {**proto, "Content-Encoding": "zstd"}
    assert error_of(http.post("/api/v1/forward_backward", content=b"not zstd", headers=zstd), 400) == "BAD_ENCODING"
    truncated = zstandard.ZstdCompressor().compress(fwdbwd_body("nope:train:0", 1))[:-3]
    assert error_of(http.post("/api/v1/forward_backward", content=truncated, headers=zstd), 400) == "BAD_ENCODING"
    assert error_of(http.post("/api/v1/optim_step", content=b"{", headers=headers), 400) == "MALFORMED_JSON"
    assert error_of(http.post("/api/v1/no_such_route", json={}, headers=headers), 404) == "NOT_FOUND"
    assert (
        error_of(http.post("/api/v1/retrieve_future", json={"request_id": "0" * 32}, headers=headers), 404)
        == "UNKNOWN_REQUEST"
    )

    # Unsupported and custom losses fail through the SDK's error path; later requests of that model are
    # poisoned, as the SDK expects; other models keep training.
    service = tinker.ServiceClient(base_url=base_url(gateway), api_key=KEY_A)
    training = service.create_lora_training_client(base_model=str(tiny_model), rank=4, seed=2).result()
    with pytest.raises(tinker.RequestFailedError, match=r"gspo.*not supported"):
        training.forward_backward([sft_datum()], "gspo").result()
    with pytest.raises(tinker.RequestFailedError, match="earlier request"):
        training.optim_step(types.AdamParams(learning_rate=1e-3)).result()
    with pytest.raises(tinker.RequestFailedError, match="not supported"):
        other = service.create_lora_training_client(base_model=str(tiny_model), rank=4)
        other.result().forward_backward([sft_datum()], "custom", {"loss_id": 1.0}).result()
    with pytest.raises(tinker.RequestFailedError, match="base_model"):
        service.create_lora_training_client(base_model="Qwen/Qwen3-8B", rank=4).result()

    assert http.get("/api/v1/healthz").json() == {"status": "ok"}
    healthy = service.create_lora_training_client(base_model=str(tiny_model), rank=4, seed=3).result()
    out = healthy.forward_backward([sft_datum()], "cross_entropy").result()
    assert len(out.loss_fn_outputs) == 1
    assert healthy.optim_step(types.AdamParams(learning_rate=1e-3)).result().metrics is not None
    service.close("success").result()
