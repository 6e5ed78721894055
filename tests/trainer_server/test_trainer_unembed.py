"""The trainer's LoRA targets with the unembedding: "lm_head" names the output projection, "all-linear" stays
attn + mlp (as in peft), the groups add up to every hooked module; an lm_head adapter holds exactly
rank * (hidden + vocab) parameters, its snapshot fits only a config that targets lm_head, and on a tied model a
training step moves the lm_head LoRA while the shared embedding stays bit for bit what it was."""

from __future__ import annotations

import json
from pathlib import Path

import grpc
import pytest
import torch
from samplerutil import snapshot
from trainerutil import Trainer, assert_status, create, get_adapter, lora, sft_batch, train_step

from opentinker.client.tiny_model import make_family_model
from opentinker.rpc.serving.errors import InvalidArgument
from opentinker.trainer_server.adapter import new_adapter
from opentinker.trainer_server.adapter_config import AdamParams, LoraConfig
from opentinker.trainer_server.base_model import BaseModel
from opentinker.trainer_server.wire import base_model_info
from opentinker.v1 import trainer_pb2
from opentinker.weights.base_model import ATTN_MODULES, MLP_MODULES


@pytest.fixture(scope="module")
def tied_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    model = make_family_model(tmp_path_factory.mktemp("tied") / "qwen2.5", "qwen2.5", seed=2)
    assert json.loads((model / "config.json").read_text())["tie_word_embeddings"]
    return model


def leaves(paths: list[str]) -> set[str]:
    return {path.rsplit(".", 1)[-1] for path in paths}


def test_target_specs_resolve_to_exactly_their_modules(tiny_model: Path) -> None:
    base = BaseModel(str(tiny_model))
    assert base.resolve_targets(["lm_head"]) == ["lm_head"]
    assert leaves(base.resolve_targets(["all-linear"])) == set(ATTN_MODULES + MLP_MODULES)  # no lm_head
    assert base.resolve_targets([]) == base.resolve_targets(["all-linear"])
    groups = [base.resolve_targets([g]) for g in ("attn", "mlp", "lm_head")]
    assert sorted(p for g in groups for p in g) == sorted(base.hooks)  # disjoint, and together every hook
    assert set(base.resolve_targets(["all-linear", "lm_head"])) == set(base.hooks)
    assert "lm_head" in base_model_info(base).lora_target_modules
    with pytest.raises(InvalidArgument, match="lm_head") as error:
        base.resolve_targets(["embed_tokens"])  # the input embedding is not a target
    assert error.value.reason == "INVALID_LORA_CONFIG"


def test_a_training_step_on_a_tied_model_leaves_the_embedding_alone(tied_model: Path) -> None:
    base = BaseModel(str(tied_model))
    embedding = base.model.model.embed_tokens.weight
    assert base.hooks["lm_head"].base.weight is embedding  # tied: one tensor for both
    before = embedding.detach().clone()
    shapes = base.module_shapes()
    config = LoraConfig(rank=4, alpha=8.0, dropout=0.0, target_modules=("lm_head",))
    state = new_adapter(
        "t",
        config,
        AdamParams(learning_rate=5e-2, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.0, grad_clip_norm=0.0),
        1,
        {"lm_head": shapes["lm_head"]},
        base.device,
    )
    tokens = torch.tensor([[5, 17, 40, 99, 230, 7, 61, 3]])
    with base.activate(state.modules, training=True):
        loss = base.model(input_ids=tokens, labels=tokens).loss
    loss.backward()
    state.optimizer.step()
    assert state.modules["lm_head"].b.abs().max().item() > 0  # the LoRA moved (B starts at zero)
    assert torch.equal(embedding, before) and not embedding.requires_grad
    with torch.no_grad(), base.activate(state.modules, training=False):
        after = base.model(input_ids=tokens).logits
        hidden = base.model.model(input_ids=tokens).last_hidden_state  # everything below the output projection
    with torch.no_grad():
        plain_logits = base.model(input_ids=tokens).logits
        plain_hidden = base.model.model(input_ids=tokens).last_hidden_state
    assert torch.equal(hidden, plain_hidden)  # the input side (embedding lookups) is the base model's
    assert (after - plain_logits).abs().max().item() > 1e-3


def test_an_lm_head_adapter_over_rpc(trainer: Trainer, tiny_model: Path) -> None:
    config = json.loads((tiny_model / "config.json").read_text())
    hidden, vocab = config["hidden_size"], config["vocab_size"]
    info = trainer.GetTrainerInfo(trainer_pb2.GetTrainerInfoRequest())
    assert "lm_head" in info.base_model.lora_target_modules
    only = create(trainer, seed=3, config=lora(rank=4, targets=["lm_head"]))
    assert only.num_parameters == 4 * (hidden + vocab)
    linear = create(trainer, seed=3, config=lora(rank=4, targets=["all-linear"]))
    both = create(trainer, seed=3, config=lora(rank=4, targets=["all-linear", "lm_head"]), lr=5e-2)
    assert both.num_parameters == linear.num_parameters + only.num_parameters
    train_step(trainer, both.name, sft_batch(seed=5))
    assert get_adapter(trainer, both.name).step == 1

    # A snapshot with lm_head fits only a config that targets lm_head too.
    version = snapshot(trainer, both.name)
    start = f"{both.name}@{version.version}"
    fits = create(trainer, config=lora(rank=4, targets=["all-linear", "lm_head"]), init_from=start)
    assert fits.num_parameters == both.num_parameters
    with pytest.raises(grpc.RpcError) as error:
        create(trainer, config=lora(rank=4, targets=["all-linear"]), init_from=start)
    assert_status(error.value, grpc.StatusCode.FAILED_PRECONDITION, "INCOMPATIBLE_SNAPSHOT")
    assert "lm_head" in (error.value.details() or "")
