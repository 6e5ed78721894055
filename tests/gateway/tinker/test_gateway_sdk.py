"""The unmodified tinker SDK (0.38.0) against real processes: registry + trainer + sampler + gateway.

Supervised training with every built-in loss, exact resume from a saved state, sampling from the exact
version save_weights_and_get_sampling_client published, and sampler logprobs that agree with the trainer's.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path

import pytest
import tinker
from gatewayutil import KEY_A, base_url, floats, ints
from serverproc import ServerProcess
from tinker import types

from opentinker.client import RegistryClient

TOKENS = [17, 42, 99, 7, 256, 301, 12, 88, 150, 33, 64, 5, 210, 77, 123, 45]


# Two datums per request: a batch of four goes out as two chunks, sent in parallel.
GATEWAY_FLAGS = ("--fwdbwd-max-chunk-len", "2")


@pytest.fixture(scope="module")
def service(gateway: ServerProcess) -> Iterator[tinker.ServiceClient]:
    client = tinker.ServiceClient(base_url=base_url(gateway), api_key=KEY_A)
    yield client
    client.close("success").result()


def sft_data(shift: int = 0) -> list[types.Datum]:
    data = []
    for i in range(4):
        tokens = [(t + 31 * i + shift) % 500 + 3 for t in TOKENS]
        data.append(
            types.Datum(
                model_input=types.ModelInput.from_ints(tokens[:-1]),
                loss_fn_inputs={"target_tokens": ints(tokens[1:]), "weights": floats([1.0] * (len(tokens) - 1))},
            )
        )
    return data


def rl_data(logprobs: list[list[float]], data: list[types.Datum]) -> list[types.Datum]:
    """The same tokens with positive advantages and the logprobs of the policy that 'sampled' them."""
    return [
        types.Datum(
            model_input=d.model_input,
            loss_fn_inputs={
                "target_tokens": d.loss_fn_inputs["target_tokens"],
                "logprobs": floats(lp),
                "advantages": floats([1.0] * len(lp)),
            },
        )
        for d, lp in zip(data, logprobs, strict=True)
    ]


def target_logprobs(client: tinker.TrainingClient, data: list[types.Datum]) -> list[list[float]]:
    out = client.forward(data, "cross_entropy").result()
    return [[float(v) for v in o["logprobs"].data] for o in out.loss_fn_outputs]


def adapter_of(model_id: str, tenant: str = "gw-a") -> str:
    session, _, seq = model_id.split(":")
    return f"{tenant}/tinker-{session}-{seq}"


def test_training_losses_resume_and_sampling(
    service: tinker.ServiceClient, tiny_model: Path, registry_server: ServerProcess
) -> None:
    training = service.create_lora_training_client(base_model=tiny_model.name, rank=8, seed=3).result()
    info = training.get_info()
    assert info.lora_rank == 8 and info.model_data.model_name == str(tiny_model)
    assert training.get_tokenizer().vocab_size > 0  # the base model's own tokenizer, offline

    # Cross-entropy: four datums in two parallel chunks per step; the loss falls.
    data, losses = sft_data(), []
    for _ in range(6):
        fb = training.forward_backward(data, "cross_entropy")
        opt = training.optim_step(types.AdamParams(learning_rate=2e-2))
        out = fb.result()
        opt.result()
        assert len(out.loss_fn_outputs) == 4
        assert all(len(o["logprobs"].data) == len(TOKENS) - 1 for o in out.loss_fn_outputs)
        assert all(key.count(":") == 1 for key in out.metrics)  # name:reduction, combined over chunks
        losses.append(out.metrics["loss:sum"])
    assert losses[-1] < losses[0] - 1.0, losses

    # Policy-gradient losses: positive advantages raise the logprobs of the taken tokens.
    pg_losses: list[tuple[types.LossFnType, dict[str, float | str] | None]] = [
        ("importance_sampling", None),
        ("ppo", {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}),
    ]
    for loss_fn, config in pg_losses:
        before = target_logprobs(training, data)
        out = training.forward_backward(rl_data(before, data), loss_fn, config).result()
        assert math.isfinite(out.metrics["loss:sum"])
        training.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        after = target_logprobs(training, data)
        assert sum(map(sum, after)) > sum(map(sum, before)), loss_fn

    # save_state, then the same step on the original and on a client resumed from the state: identical.
    path = training.save_state("ckpt-1").result().path
    at_checkpoint = target_logprobs(training, data)
    assert path == f"tinker://{training.model_id}/weights/ckpt-1"
    resumed = service.create_training_client_from_state_with_optimizer(path).result()
    assert resumed.model_id != training.model_id and resumed.get_info().lora_rank == 8
    step_data = sft_data(shift=5)
    for client in (training, resumed):
        client.forward_backward(step_data, "cross_entropy").result()
        client.optim_step(types.AdamParams(learning_rate=2e-2)).result()
    assert target_logprobs(resumed, data) == target_logprobs(training, data)

    # save_weights_and_get_sampling_client: a sampler pinned to the exact new registry version.
    sampling = training.save_weights_and_get_sampling_client().result()
    registry = RegistryClient(registry_server.address)
    versions = registry.list_versions(adapter_of(training.model_id))
    assert len(versions) == 1
    prompt = types.ModelInput.from_ints(TOKENS[:6])
    greedy = sampling.sample(prompt, 1, types.SamplingParams(max_tokens=4, temperature=0.0)).result()
    first = greedy.sequences[0].tokens[0]
    result = sampling.sample(prompt, 3, types.SamplingParams(max_tokens=5, temperature=1.0, seed=7)).result()
    assert len(result.sequences) == 3
    for seq in result.sequences:
        assert 1 <= len(seq.tokens) <= 5 and len(seq.logprobs or []) == len(seq.tokens)
        assert seq.stop_reason in ("length", "stop")
    stopped = sampling.sample(prompt, 2, types.SamplingParams(max_tokens=6, temperature=0.0, stop=[first])).result()
    assert [s.tokens for s in stopped.sequences] == [[first], [first]]
    assert [s.stop_reason for s in stopped.sequences] == ["stop", "stop"]

    # Sampler logprobs of prompt + completion agree with the trainer's forward logprobs (same weights).
    tokens = [*TOKENS[:6], *greedy.sequences[0].tokens]
    sampler_lp = sampling.compute_logprobs(types.ModelInput.from_ints(tokens)).result()
    assert sampler_lp[0] is None and len(sampler_lp) == len(tokens)
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": ints(tokens[1:]), "weights": floats([1.0] * (len(tokens) - 1))},
    )
    trainer_lp = target_logprobs(training, [datum])[0]
    assert sampler_lp[1:] == pytest.approx(trainer_lp, abs=1e-4)

    # Named sampler weights: a second registry version; a new training client starts from its weights
    # (fresh optimizer); so does one from the full state's weights alone.
    weights = training.save_weights_for_sampler("s-1").result().path
    assert weights == f"tinker://{training.model_id}/sampler_weights/s-1"
    assert len(registry.list_versions(adapter_of(training.model_id))) == 2
    from_weights = service.create_training_client_from_state(weights).result()
    assert target_logprobs(from_weights, data) == target_logprobs(training, data)
    from_state = service.create_training_client_from_state(path).result()
    assert target_logprobs(from_state, data) == at_checkpoint
    from_state.forward_backward(step_data, "cross_entropy").result()
    from_state.optim_step(types.AdamParams(learning_rate=2e-2)).result()
    assert target_logprobs(from_state, data) != at_checkpoint
    registry.close()

    # The base model, sampled by name.
    base = service.create_sampling_client(base_model=tiny_model.name).result()
    assert len(base.sample(prompt, 1, types.SamplingParams(max_tokens=3)).result().sequences[0].tokens) <= 3


def test_topk_sample_logprobs_are_the_models_alternatives(service: tinker.ServiceClient, tiny_model: Path) -> None:
    """SampledSequence.topk_logprobs: at each sampled position the k most likely (token id, logprob), as a direct
    transformers forward of the prompt and the sampled prefix ranks them (fp32); None when not asked for."""
    import torch
    from samplerutil import PeftReference

    base = service.create_sampling_client(base_model=tiny_model.name).result()
    prompt = TOKENS[:7]
    params = types.SamplingParams(max_tokens=6, temperature=1.0, seed=11)
    asked = base.sample(types.ModelInput.from_ints(prompt), 2, params, topk_sample_logprobs=4).result()
    model = PeftReference(tiny_model).model(None)
    for seq in asked.sequences:
        assert seq.topk_logprobs is not None and seq.logprobs is not None
        assert len(seq.topk_logprobs) == len(seq.tokens) >= 1
        with torch.no_grad():
            logits = model(torch.tensor([prompt + seq.tokens])).logits[0].float()  # [L, V]
        oracle = logits[len(prompt) - 1 : len(prompt) - 1 + len(seq.tokens)].log_softmax(-1)  # [T, V]
        for position, (top, token, logprob) in enumerate(zip(seq.topk_logprobs, seq.tokens, seq.logprobs, strict=True)):
            assert top is not None and len(top) == 4
            ids, values = [t for t, _ in top], [v for _, v in top]
            assert values == sorted(values, reverse=True)
            assert values == pytest.approx(oracle[position].topk(4).values.tolist(), abs=1e-4)
            assert values == pytest.approx(oracle[position][ids].tolist(), abs=1e-4)
            if token in ids:  # the sampled token's entry is its own logprob
                assert values[ids.index(token)] == pytest.approx(logprob, abs=1e-6)
    plain = base.sample(types.ModelInput.from_ints(prompt), 2, params).result()
    assert [s.tokens for s in plain.sequences] == [s.tokens for s in asked.sequences]
    assert all(s.topk_logprobs is None for s in plain.sequences)
    with pytest.raises(tinker.BadRequestError, match="topk_sample_logprobs"):
        base.sample(types.ModelInput.from_ints(prompt), 1, params, topk_sample_logprobs=21).result()


def test_top_p_zero_is_greedy(service: tinker.ServiceClient, tiny_model: Path) -> None:
    """tinker's top_p 0 (documented as the nucleus mass) keeps the most likely token alone: greedy, whatever the
    temperature and seed, rather than the sampler's "0: off" (full-distribution sampling at that temperature)."""
    base = service.create_sampling_client(base_model=tiny_model.name).result()
    prompt = types.ModelInput.from_ints(TOKENS[:7])
    greedy = base.sample(prompt, 1, types.SamplingParams(max_tokens=8, temperature=0.0)).result().sequences[0]
    for seed in (7, 8):
        nucleus = types.SamplingParams(max_tokens=8, temperature=1.0, top_p=0.0, seed=seed)
        assert [s.tokens for s in base.sample(prompt, 2, nucleus).result().sequences] == [greedy.tokens] * 2
    free = base.sample(prompt, 2, types.SamplingParams(max_tokens=8, temperature=1.0, seed=7)).result()
    assert [s.tokens for s in free.sequences] != [greedy.tokens] * 2  # the same draw without top_p is not greedy
