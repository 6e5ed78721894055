"""stable_reinforce through the real tinker SDK: sample with record_stability_info=True, train one step on
datums whose provenance names the sampled sequences; the loss is formed against the recorded sampler logprobs
(not the client's copy); bad provenance, unrecorded sequences, prompt advantages and bad config fail through the
SDK's error path with a precise message."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import tinker
from gatewayutil import KEY_A, KEY_B, base_url, floats, ints
from serverproc import ServerProcess
from tinker import types

PROMPT = [5, 17, 42, 99, 7]


def datum_of(seq: types.SampledSequence, advantage: float, client_logprobs: list[float] | None = None) -> types.Datum:
    """Prompt + completion, the cookbook's layout: targets from the prompt's second token on, advantages only on
    sampled tokens; ``client_logprobs`` replaces what the client sends as logprobs."""
    tokens = [*PROMPT, *seq.tokens]
    n_prompt, n_out = len(PROMPT), len(seq.tokens)
    logprobs = client_logprobs if client_logprobs is not None else [0.0] * (n_prompt - 1) + list(seq.logprobs or [])
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={
            "target_tokens": ints(tokens[1:]),
            "logprobs": floats(logprobs),
            "advantages": floats([0.0] * (n_prompt - 1) + [advantage] * n_out),
        },
    )
    sid = seq.sequence_id
    return datum.with_provenance(
        model_input=[
            types.PromptProvenanceSpan(sequence_id=sid, length=n_prompt),
            types.SampledProvenanceSpan(sequence_id=sid, length=n_out - 1),
        ],
        loss_fn_inputs=[
            types.PromptProvenanceSpan(sequence_id=sid, offset=1, length=n_prompt - 1),
            types.SampledProvenanceSpan(sequence_id=sid, length=n_out),
        ],
    )


def expected_loss(
    p: list[float], q: list[float], advantages: list[float], kl_coeff: float = 0.0
) -> tuple[float, float]:
    """(loss, kl) of the documented formula over the sampled positions (the gateway's weights: 1 on the tokens
    the provenance names sampled, whatever their advantage; 0 on the prompt, the first len(PROMPT) - 1)."""
    loss = kl = 0.0
    for t, (p_t, q_t, a_t) in enumerate(zip(p, q, advantages, strict=True)):
        if t < len(PROMPT) - 1:
            continue
        ratio = math.exp(p_t - q_t)
        loss -= min(ratio, 1.0) * a_t * p_t
        kl += ratio - 1 - (p_t - q_t)
    return loss + kl_coeff * kl, kl


def sample(sampler: tinker.SamplingClient, n: int = 4, seed: int = 3) -> list[types.SampledSequence]:
    params = types.SamplingParams(max_tokens=6, temperature=1.0, seed=seed)
    return list(sampler.sample(types.ModelInput.from_ints(PROMPT), n, params).result().sequences)


def test_sample_with_stability_info_then_train_one_step(gateway: ServerProcess, tiny_model: Path) -> None:
    service = tinker.ServiceClient(base_url=base_url(gateway), api_key=KEY_A)
    training = service.create_lora_training_client(base_model=str(tiny_model), rank=8, seed=5).result()
    sampler = training.save_weights_and_get_sampling_client(record_stability_info=True).result()
    sequences = sample(sampler)
    assert len({s.sequence_id for s in sequences}) == 4
    advantages = [1.0, -1.0, 0.5, -0.5]
    # the client's logprobs are garbage on purpose: the recorded sampler logprobs must be used instead
    data = [
        datum_of(s, a, client_logprobs=[-7.0] * (len(PROMPT) - 1 + len(s.tokens)))
        for s, a in zip(sequences, advantages, strict=True)
    ]

    result = training.forward_backward(data, "stable_reinforce").result()
    total = 0.0
    for seq, a, output in zip(sequences, advantages, result.loss_fn_outputs, strict=True):
        p = output["logprobs"].tolist()
        q = [0.0] * (len(PROMPT) - 1) + list(seq.logprobs or [])
        loss, _ = expected_loss(p, q, [0.0] * (len(PROMPT) - 1) + [a] * len(seq.tokens))
        total += loss
        # same weights sampled and trained: trainer and sampler logprobs agree on the sampled tokens
        assert max(abs(x - y) for x, y in zip(p[len(PROMPT) - 1 :], q[len(PROMPT) - 1 :], strict=True)) < 1e-3
    assert result.metrics["loss:sum"] == pytest.approx(total, rel=1e-4, abs=1e-4)
    assert result.metrics["ratio:mean"] == pytest.approx(1.0, abs=1e-3)
    step = training.optim_step(types.AdamParams(learning_rate=5e-2)).result()
    assert step is not None

    # after the step the sequences are off-policy; the KL penalty enters with kl_coeff and is >= 0
    after = training.forward(data, "stable_reinforce", {"kl_coeff": 0.5}).result()
    total = kl_total = 0.0
    for seq, a, output in zip(sequences, advantages, after.loss_fn_outputs, strict=True):
        p = output["logprobs"].tolist()
        q = [0.0] * (len(PROMPT) - 1) + list(seq.logprobs or [])
        loss, kl = expected_loss(p, q, [0.0] * (len(PROMPT) - 1) + [a] * len(seq.tokens), kl_coeff=0.5)
        total, kl_total = total + loss, kl_total + kl
    assert kl_total > 1e-6  # the step moved the policy away from the sampler
    assert after.metrics["kl:sum"] == pytest.approx(kl_total, rel=1e-3)
    assert after.metrics["loss:sum"] == pytest.approx(total, rel=1e-3, abs=1e-4)
    assert after.metrics["loss:sum"] != pytest.approx(result.metrics["loss:sum"], abs=1e-4)

    # Advantages all 0: the KL penalty still covers every sampled token, so a kl_coeff > 0 pulls the policy back.
    flat = [datum_of(s, 0.0) for s in sequences]
    zero = training.forward_backward(flat, "stable_reinforce", {"kl_coeff": 0.5}).result()
    kl_zero = 0.0
    for seq, output in zip(sequences, zero.loss_fn_outputs, strict=True):
        p = output["logprobs"].tolist()
        q = [0.0] * (len(PROMPT) - 1) + list(seq.logprobs or [])
        kl_zero += expected_loss(p, q, [0.0] * len(p), kl_coeff=0.5)[1]
    assert kl_zero > 1e-6 and zero.metrics["kl:sum"] == pytest.approx(kl_zero, rel=1e-3)
    assert zero.metrics["loss:sum"] == pytest.approx(0.5 * kl_zero, rel=1e-3)
    service.close("success").result()


def failure(training: tinker.TrainingClient, data: list[types.Datum], config: dict[str, float] | None = None) -> str:
    with pytest.raises(tinker.RequestFailedError) as info:
        training.forward_backward(data, "stable_reinforce", config).result()
    return str(info.value)


def test_bad_requests_fail_precisely(gateway: ServerProcess, tiny_model: Path) -> None:
    service = tinker.ServiceClient(base_url=base_url(gateway), api_key=KEY_A)

    def fresh() -> tinker.TrainingClient:  # a failed request poisons its model's later ones: one model per case
        return service.create_lora_training_client(base_model=str(tiny_model), rank=4, seed=1).result()

    training = fresh()
    recorded = sample(training.save_weights_and_get_sampling_client(record_stability_info=True).result(), 2)
    unrecorded = sample(training.save_weights_and_get_sampling_client().result(), 1)
    good = datum_of(recorded[0], 1.0)

    plain = types.Datum(model_input=good.model_input, loss_fn_inputs=good.loss_fn_inputs)
    assert "datum 0 model_input: no provenance" in failure(training, [plain])
    assert "has no stability record in this session" in failure(fresh(), [datum_of(unrecorded[0], 1.0)])

    on_prompt = datum_of(recorded[0], 1.0)
    advantages = on_prompt.loss_fn_inputs["advantages"].tolist()
    advantages[0] = 0.3
    on_prompt = types.Datum(
        model_input=on_prompt.model_input,
        loss_fn_inputs={**on_prompt.loss_fn_inputs, "advantages": floats(advantages)},
    ).with_provenance(model_input=good.model_input_spans or [], loss_fn_inputs=good.loss_fn_input_spans or [])
    assert "advantages must be 0 on prompt positions" in failure(fresh(), [on_prompt])

    # the provenance claims recorded[1]'s tokens for recorded[0]'s completion
    other = recorded[1]
    swapped = datum_of(recorded[0], 1.0).with_provenance(
        model_input=[
            types.PromptProvenanceSpan(sequence_id=other.sequence_id, length=len(PROMPT)),
            types.SampledProvenanceSpan(sequence_id=other.sequence_id, length=len(other.tokens) - 1),
        ],
        loss_fn_inputs=[
            types.PromptProvenanceSpan(sequence_id=other.sequence_id, offset=1, length=len(PROMPT) - 1),
            types.SampledProvenanceSpan(sequence_id=other.sequence_id, length=len(other.tokens)),
        ],
    )
    if list(other.tokens) != list(recorded[0].tokens):
        assert "is not the recorded token its provenance names" in failure(fresh(), [swapped])

    assert "kl_coeff must be >= 0" in failure(fresh(), [good], {"kl_coeff": -1.0})
    assert "unknown key(s) 'beta'" in failure(fresh(), [good], {"beta": 0.1})

    # another tenant cannot name team a's sequences
    other_tenant = tinker.ServiceClient(base_url=base_url(gateway), api_key=KEY_B)
    theirs = other_tenant.create_lora_training_client(base_model=str(tiny_model), rank=4).result()
    assert "has no stability record in this session" in failure(theirs, [good])
    other_tenant.close("success").result()

    # and the good datum trains on a fresh model
    assert fresh().forward_backward([good], "stable_reinforce").result().metrics["loss:sum"] != 0.0
    service.close("success").result()
