"""Training through a real trainer process: SFT converges, masks mask, Forward is side-effect free, every RL
loss runs, snapshots load in peft with the trainer's logprobs and carry lineage, init_from starts from them."""

from __future__ import annotations

import itertools
import math
from pathlib import Path

import grpc
import pytest
import torch
from registryutil import unique_name
from serverproc import ServerProcess, registry_store
from trainerutil import (
    Trainer,
    assert_status,
    create,
    float_tensor,
    forward,
    forward_backward,
    get_adapter,
    logprobs,
    lora,
    optim_step,
    random_tokens,
    rl_datum,
    save_state,
    sft_batch,
    sft_datum,
    snapshot_weights,
    train_step,
)

from opentinker.v1 import common_pb2, registry_pb2, registry_pb2_grpc, trainer_pb2


def snapshot(trainer: Trainer, name: str, **fields: object) -> registry_pb2.Version:
    response: trainer_pb2.SaveSnapshotResponse = trainer.SaveSnapshot(
        trainer_pb2.SaveSnapshotRequest(adapter=name, **fields)  # type: ignore[arg-type]
    )
    return response.version


def test_cross_entropy_drives_the_loss_down(trainer: Trainer) -> None:
    name = create(trainer, seed=1).name
    batch = sft_batch(seed=1, count=2, length=16)
    losses = [train_step(trainer, name, batch)[0] for _ in range(10)]
    final = forward(trainer, name, batch).metrics["loss:sum"]
    assert all(b < a for a, b in itertools.pairwise(losses)), losses
    # The tiny model's lm_head (init std 0.02, frozen) bounds how far the logits can move: ~10% in 10 steps.
    assert final < 0.9 * losses[0], (losses, final)
    adapter = get_adapter(trainer, name)
    assert adapter.step == 10 and adapter.pending_batches == 0
    assert adapter.datums_trained == 20 and adapter.tokens_trained == 10 * (15 + 12)


def test_default_alpha_is_rank(trainer: Trainer) -> None:
    """alpha 0 means alpha = rank (scaling 1): the adapter must still learn."""
    name = create(trainer, seed=2, config=lora(rank=4, alpha=0.0)).name
    batch = sft_batch(seed=2)
    first, _ = train_step(trainer, name, batch)
    for _ in range(4):
        train_step(trainer, name, batch)
    assert forward(trainer, name, batch).metrics["loss:sum"] < first - 1.0


def test_zero_weights_mask_targets(trainer: Trainer, registry_server: ServerProcess) -> None:
    store = registry_store(registry_server)
    tokens = random_tokens(7, 14)
    weights = [0.0] * 5 + [1.0] * 8  # 13 target positions; the first 5 are "prompt"
    datum = sft_datum(tokens, weights)
    other = common_pb2.Datum()
    other.CopyFrom(datum)
    targets = other.loss_fn_inputs["target_tokens"].int64_values
    for i in range(5):  # same inputs, other targets wherever the weight is 0
        targets[i] = (targets[i] + 100) % 512
    first, second = create(trainer, seed=3).name, create(trainer, seed=3).name
    a = forward_backward(trainer, first, [datum])
    b = forward_backward(trainer, second, [other])
    assert a.batch_digest != b.batch_digest
    assert logprobs(a)[0][5:] == logprobs(b)[0][5:] and logprobs(a)[0][:5] != logprobs(b)[0][:5]
    assert a.metrics["loss:sum"] == b.metrics["loss:sum"]
    assert a.metrics["weights:sum"] == 8.0
    assert optim_step(trainer, first).metrics == optim_step(trainer, second).metrics
    weights_a = snapshot_weights(store, snapshot(trainer, first).artifact_uri)
    weights_b = snapshot_weights(store, snapshot(trainer, second).artifact_uri)
    assert weights_a.keys() == weights_b.keys()
    assert all(torch.equal(weights_a[k], weights_b[k]) for k in weights_a)
    # ...and the masked positions really carry no loss: their logprob is not in the sum.
    assert a.metrics["loss:sum"] == pytest.approx(-sum(logprobs(a)[0][5:]), rel=1e-5)


def test_forward_matches_forward_backward_and_changes_nothing(trainer: Trainer) -> None:
    name = create(trainer, seed=4).name
    batch = sft_batch(seed=4, count=3)
    train_step(trainer, name, batch)  # nonzero B: the adapter affects the logprobs
    before = save_state(trainer, name)
    fwd = forward(trainer, name, batch)
    assert get_adapter(trainer, name).pending_batches == 0
    assert save_state(trainer, name) == before
    fb = forward_backward(trainer, name, batch)
    assert logprobs(fwd) == logprobs(fb)
    assert [len(row) for row in logprobs(fwd)] == [11, 8, 5]
    assert fwd.metrics["loss:sum"] == fb.metrics["loss:sum"]
    assert fwd.metrics["tokens:sum"] == 24.0 and fwd.metrics["datums:sum"] == 3.0
    assert get_adapter(trainer, name).pending_batches == 1


PG_CASES = [
    ("importance_sampling", {}, {"ratio:mean"}),
    ("ppo", {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1}, {"clip_fraction:mean"}),
    ("cispo", {}, {"clip_fraction:mean"}),
    ("dro", {"beta": 0.1}, set()),
]


@pytest.mark.parametrize(("loss_fn", "config", "extra"), PG_CASES, ids=[c[0] for c in PG_CASES])
def test_rl_losses_end_to_end(trainer: Trainer, loss_fn: str, config: dict[str, float], extra: set[str]) -> None:
    name = create(trainer, seed=5).name
    sequences = [random_tokens(50 + i, 10) for i in range(2)]
    sampled = logprobs(forward(trainer, name, [sft_datum(s) for s in sequences]))
    # Off-policy by a little; prompt positions (advantage 0) carry logprob 0 as samplers send them.
    datums = [
        rl_datum(s, [0.0] * 3 + [q - 0.05 * (i + 1) for q in lp[3:]], [0.0] * 3 + [1.0 - 2 * i] * 6)
        for i, (s, lp) in enumerate(zip(sequences, sampled, strict=True))
    ]
    first = forward_backward(trainer, name, datums, loss_fn, config)
    assert {"loss:sum", "tokens:sum", "datums:sum", *extra} <= first.metrics.keys()
    assert all(key.endswith((":sum", ":mean")) for key in first.metrics), first.metrics
    assert all(math.isfinite(v) for v in first.metrics.values())
    assert first.metrics["tokens:sum"] == 18.0 and first.step == 1
    step = optim_step(trainer, name)
    assert step.step == 1 and step.metrics["grad_norm:value"] > 0
    second = forward_backward(trainer, name, datums, loss_fn, config)
    assert logprobs(second) != logprobs(first)
    assert optim_step(trainer, name).step == 2


def test_stable_reinforce_penalty_trains_a_zero_advantage_batch(trainer: Trainer) -> None:
    """Every advantage 0 (equal rewards in the group) and kl_coeff > 0: the KL penalty on the sampled tokens the
    weights select still gives a gradient, so the step pulls the policy back towards the sampler."""
    name = create(trainer, seed=12).name
    sequences = [random_tokens(120 + i, 10) for i in range(2)]
    sampled = logprobs(forward(trainer, name, [sft_datum(s) for s in sequences]))
    datums = []
    for i, (tokens, lp) in enumerate(zip(sequences, sampled, strict=True)):
        datum = rl_datum(tokens, [0.0] * 3 + [q - 0.2 * (i + 1) for q in lp[3:]], [0.0] * 9)  # off-policy
        datum.loss_fn_inputs["weights"].CopyFrom(float_tensor([0.0] * 3 + [1.0] * 6))  # prompt positions: 0
        datums.append(datum)
    first = forward_backward(trainer, name, datums, "stable_reinforce", {"kl_coeff": 1.0})
    assert first.metrics["kl:sum"] > 0 and first.metrics["loss:sum"] == pytest.approx(first.metrics["kl:sum"])
    assert optim_step(trainer, name).metrics["grad_norm:value"] > 0
    after = forward(trainer, name, datums, "stable_reinforce")
    assert logprobs(after) != logprobs(first)


def test_snapshot_loads_in_peft_with_the_trainers_logprobs(
    trainer: Trainer, registry_server: ServerProcess, tiny_model: Path
) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    name = create(trainer, seed=6, config=lora(rank=8, alpha=16.0)).name
    for step in range(3):
        train_step(trainer, name, sft_batch(seed=60 + step))
    version = snapshot(trainer, name)
    tokens = random_tokens(61, 20)
    expected = logprobs(forward(trainer, name, [sft_datum(tokens)]))[0]

    directory = registry_store(registry_server) / "sha256" / version.artifact_uri.removeprefix("sha256:")
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model), directory)
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([tokens[:-1]])).logits[0].float()
    got = logits.log_softmax(-1).gather(1, torch.tensor(tokens[1:])[:, None]).squeeze(1)
    torch.testing.assert_close(got, torch.tensor(expected), atol=1e-5, rtol=0)
    # The adapter matters: the base model alone gives other logprobs.
    with torch.no_grad(), model.disable_adapter():
        base = model(input_ids=torch.tensor([tokens[:-1]])).logits[0].float().log_softmax(-1)
    assert not torch.allclose(base.gather(1, torch.tensor(tokens[1:])[:, None]).squeeze(1), got, atol=1e-4)


def test_snapshot_lineage_and_init_from(trainer: Trainer, registry: registry_pb2_grpc.RegistryServiceStub) -> None:
    name = create(trainer, seed=8).name
    batch = sft_batch(seed=8)
    fb1 = forward_backward(trainer, name, batch, trace_ids=["trace-a1", "trace-a2"])
    optim_step(trainer, name)
    fb2 = forward_backward(trainer, name, sft_batch(seed=9), trace_ids=["trace-b"])
    optim_step(trainer, name)
    v1 = snapshot(trainer, name, metrics={"eval": 0.5})
    probe = [sft_datum(random_tokens(80, 15))]
    at_v1 = logprobs(forward(trainer, name, probe))
    fb3 = forward_backward(trainer, name, batch, trace_ids=["trace-c"])
    optim_step(trainer, name)
    forward_backward(trainer, name, batch, trace_ids=["trace-pending"])  # not applied yet: not in v2
    v2 = snapshot(trainer, name)
    assert (v1.version, v2.version) == (1, 2)
    assert get_adapter(trainer, name).last_snapshot_version == 2

    chain = registry.GetLineage(registry_pb2.GetLineageRequest(reference=f"{name}@2")).chain
    assert [v.version for v in chain] == [2, 1]
    first, second = chain[1].lineage, chain[0].lineage
    assert first.parent_version == 0 and second.parent_version == 1
    assert (first.trainer_step, second.trainer_step) == (2, 3)
    assert [list(b.trace_ids) for b in first.batches] == [["trace-a1", "trace-a2"], ["trace-b"]]
    assert [b.digest for b in first.batches] == [fb1.batch_digest, fb2.batch_digest]
    assert [b.step for b in first.batches] == [1, 2]
    assert [list(b.trace_ids) for b in second.batches] == [["trace-c"]]
    assert second.batches[0].digest == fb3.batch_digest and second.batches[0].step == 3
    assert first.tokens_trained == 2 * (11 + 8) and second.tokens_trained == 3 * (11 + 8)
    assert dict(first.metrics) == {"eval": 0.5}
    assert first.base_model_digest and first.batches[0].loss_fn == "cross_entropy"

    # A new adapter initialised from v1 computes v1's logprobs (not v2's, not fresh ones).
    child = unique_name("child")
    adapter = create(trainer, child, seed=99, init_from=f"{name}@1")
    # The fork's next snapshot's parent is the version its weights came from, of the other adapter.
    assert adapter.step == 0 and (adapter.last_snapshot_version, adapter.parent_adapter) == (1, name)
    assert logprobs(forward(trainer, child, probe)) == at_v1
    assert logprobs(forward(trainer, name, probe)) != at_v1


def test_batching_does_not_change_a_datums_logprobs(trainer: Trainer) -> None:
    """Right padding is masked: a datum's logprobs are the same alone or next to a longer one."""
    name = create(trainer, seed=10).name
    train_step(trainer, name, sft_batch(seed=10))
    short, long = sft_datum(random_tokens(90, 6)), sft_datum(random_tokens(91, 30))
    alone = logprobs(forward(trainer, name, [short]))[0] + logprobs(forward(trainer, name, [long]))[0]
    batched = logprobs(forward(trainer, name, [short, long]))
    assert [len(row) for row in batched] == [5, 29]
    torch.testing.assert_close(torch.tensor(batched[0] + batched[1]), torch.tensor(alone), atol=1e-5, rtol=0)
    total = forward(trainer, name, [short, long]).metrics["loss:sum"]
    assert total == pytest.approx(-sum(alone), rel=1e-5)


def test_init_from_an_incompatible_snapshot_creates_nothing(
    trainer: Trainer, registry: registry_pb2_grpc.RegistryServiceStub
) -> None:
    source = create(trainer, seed=11, config=lora(rank=4)).name
    train_step(trainer, source, sft_batch(seed=11))
    snapshot(trainer, source)
    for config in (lora(rank=8), lora(rank=4, targets=["attn"])):
        name = unique_name("misfit")
        request = trainer_pb2.TrainerServiceCreateAdapterRequest(
            name=name, lora_config=config, seed=1, init_from=f"{source}@1"
        )
        with pytest.raises(grpc.RpcError) as caught:
            trainer.CreateAdapter(request)
        assert_status(caught.value, grpc.StatusCode.FAILED_PRECONDITION, "INCOMPATIBLE_SNAPSHOT")
        for call, message in (
            (trainer.GetAdapter, trainer_pb2.TrainerServiceGetAdapterRequest(name=name)),
            (registry.GetAdapter, registry_pb2.GetAdapterRequest(name=name)),
        ):
            with pytest.raises(grpc.RpcError) as caught:
                call(message)
            assert_status(caught.value, grpc.StatusCode.NOT_FOUND, "ADAPTER_NOT_FOUND")
