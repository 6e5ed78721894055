"""The tinker SDK's "which parts to train" (train_attn, train_mlp, train_unembed, each true by default) become
exactly these target modules in the trainer: attn, mlp, lm_head; the adapter holds the parameters of those modules
and no others, the default (all three) trains the unembedding and serves it, and all three false is refused with
a message saying so (and creates nothing)."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import tinker
from gatewayutil import KEY_A, base_url
from serverproc import ServerProcess
from tinker import types
from trainerutil import Trainer, get_adapter

from opentinker.client import RegistryClient
from opentinker.sampler_server.model.weights import linear_shapes
from opentinker.v1 import trainer_pb2
from opentinker.weights.base_model import ATTN_MODULES, MLP_MODULES
from opentinker.weights.model_config import load_config

RANK = 4
GROUPS = {"attn": set(ATTN_MODULES), "mlp": set(MLP_MODULES), "lm_head": {"lm_head"}}


@pytest.fixture(scope="module")
def service(gateway: ServerProcess) -> Iterator[tinker.ServiceClient]:
    client = tinker.ServiceClient(base_url=base_url(gateway), api_key=KEY_A)
    yield client
    client.close("success").result()


def adapter_of(model_id: str) -> str:
    session, _, seq = model_id.split(":")
    return f"gw-a/tinker-{session}-{seq}"


def parameters(model: Path, groups: list[str]) -> int:
    """LoRA parameters of rank RANK on every module of `groups`, from the model's shapes."""
    wanted = set().union(*(GROUPS[g] for g in groups))
    shapes = linear_shapes(load_config(model))
    return sum(RANK * (d_in + d_out) for path, (d_in, d_out) in shapes.items() if path.rsplit(".", 1)[-1] in wanted)


FLAGS = [combo for combo in itertools.product([True, False], repeat=3) if any(combo)]


@pytest.mark.parametrize(("attn", "mlp", "unembed"), FLAGS)
def test_the_flags_give_exactly_their_targets(
    service: tinker.ServiceClient, trainer: Trainer, tiny_model: Path, attn: bool, mlp: bool, unembed: bool
) -> None:
    training = service.create_lora_training_client(
        base_model=tiny_model.name, rank=RANK, seed=1, train_attn=attn, train_mlp=mlp, train_unembed=unembed
    ).result()
    expected = [g for g, on in zip(GROUPS, (attn, mlp, unembed), strict=True) if on]
    adapter = get_adapter(trainer, adapter_of(training.model_id))
    assert list(adapter.lora_config.target_modules) == expected
    assert adapter.num_parameters == parameters(tiny_model, expected)


def test_the_default_trains_and_serves_the_unembedding(
    service: tinker.ServiceClient, trainer: Trainer, tiny_model: Path, registry_server: ServerProcess, tmp_path: Path
) -> None:
    from safetensors import safe_open

    training = service.create_lora_training_client(base_model=tiny_model.name, rank=RANK, seed=2).result()
    assert get_adapter(trainer, adapter_of(training.model_id)).num_parameters == parameters(
        tiny_model, ["attn", "mlp", "lm_head"]
    )
    tokens = [17, 42, 99, 7, 256, 301, 12, 88, 150, 33, 64, 5]
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={
            "target_tokens": types.TensorData(data=tokens[1:], dtype="int64", shape=[len(tokens) - 1]),
            "weights": types.TensorData(data=[1.0] * (len(tokens) - 1), dtype="float32", shape=[len(tokens) - 1]),
        },
    )
    for _ in range(2):
        training.forward_backward([datum], "cross_entropy").result()
        training.optim_step(types.AdamParams(learning_rate=5e-2)).result()
    sampling = training.save_weights_and_get_sampling_client().result()
    registry = RegistryClient(registry_server.address)
    (version,) = registry.list_versions(adapter_of(training.model_id))
    registry.download_artifact(version.artifact_uri, tmp_path / "peft")
    with safe_open(str(tmp_path / "peft" / "adapter_model.safetensors"), framework="pt") as handle:
        lm_head_b = handle.get_tensor("base_model.model.lm_head.lora_B.weight")
    assert lm_head_b.abs().max().item() > 0  # trained
    trained = training.forward([datum], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].data
    served = sampling.compute_logprobs(types.ModelInput.from_ints(tokens)).result()
    assert max(abs(a - float(b or 0.0)) for a, b in zip(trained, served[1:], strict=True)) <= 1e-5


def test_nothing_to_train_is_refused(gateway: ServerProcess, trainer: Trainer, tiny_model: Path) -> None:
    """The SDK itself refuses all three false; a client that sends it anyway gets a 400 that says why."""
    with pytest.raises(AssertionError, match="train_unembed"):
        tinker.ServiceClient(base_url=base_url(gateway), api_key=KEY_A).create_lora_training_client(
            base_model=tiny_model.name, rank=RANK, train_attn=False, train_mlp=False, train_unembed=False
        )
    headers = {"X-API-Key": KEY_A, "Content-Type": "application/json"}
    with httpx.Client(base_url=base_url(gateway), headers=headers, timeout=60) as http:
        session = http.post("/api/v1/create_session", json={"tags": [], "sdk_version": "0.38.0"}).json()["session_id"]
        lora = {"rank": RANK, "train_attn": False, "train_mlp": False, "train_unembed": False}
        body = {"session_id": session, "model_seq_id": 0, "base_model": tiny_model.name, "lora_config": lora}
        reply = http.post("/api/v1/create_model", json=body)
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"] == "INVALID_FIELD"
    assert "train_attn, train_mlp and train_unembed are all false" in reply.json()["detail"]
    listed = trainer.ListAdapters(trainer_pb2.TrainerServiceListAdaptersRequest())
    assert not [a for a in listed.adapters if a.name.startswith(f"gw-a/tinker-{session}-")]  # nothing created
