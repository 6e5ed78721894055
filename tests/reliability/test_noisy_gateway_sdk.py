"""Noisy neighbours through the unmodified tinker SDK (issue case 1, the exploding adapter): team-a, via the
gateway, trains its LoRA with absurd learning rates; each such optim_step fails at once with a user error the SDK
does not retry (the trainer's FAILED_PRECONDITION WEIGHTS_OUT_OF_RANGE: it undid the step), and team-a's training
client keeps working on the previous weights (save_weights_for_sampler, sampling: the same seeded tokens as before
the failed steps). Meanwhile team-b samples its own model through the SDK: 0 errors, the same seeded tokens as
alone. The stack and the gateway (with test_noisy_gateway.py's flags) are private to this module."""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import tinker
from noisygateway import KEY_A, KEY_B, TOKENS, Gateway, MiB, _datums
from test_noisy_gateway import gateway  # noqa: F401 (a fixture)
from tinker import types

ABSURD_LEARNING_RATES = (1e30, 1e12, 3e38)
PROMPT = types.ModelInput.from_ints(TOKENS[:5])


def _seeded(sampler: tinker.SamplingClient, seed: int) -> tuple[tuple[int, ...], ...]:
    params = types.SamplingParams(max_tokens=6, temperature=1.0, seed=seed)
    result = sampler.sample(PROMPT, 2, params).result()
    return tuple(tuple(s.tokens) for s in result.sequences)


@pytest.fixture(scope="module")
def team_b_model(gateway: Gateway) -> str:  # noqa: F811
    """team-b's trained model, saved for sampling (a tinker:// path)."""
    service = tinker.ServiceClient(base_url=gateway.url, api_key=KEY_B)
    try:
        training = service.create_lora_training_client(base_model=str(gateway.tiny_model), rank=4, seed=7).result()
        for step in range(2):
            training.forward_backward(_datums(step), "cross_entropy").result()
            training.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        return str(training.save_weights_for_sampler("team-b-policy").result().path)
    finally:
        service.close("success").result()


def team_b(gw: Gateway, path: str, rounds: int = 6) -> list[tuple[tuple[int, ...], ...]]:
    """Seeded samples of team-b's own model through the SDK; raises on any error."""
    service = tinker.ServiceClient(base_url=gw.url, api_key=KEY_B)
    try:
        sampler = service.create_sampling_client(model_path=path).result()
        return [_seeded(sampler, 100 + i) for i in range(rounds)]
    finally:
        service.close("success").result()


@dataclass
class Exploded:
    before: tuple[tuple[int, ...], ...]  # team-a's seeded tokens before the absurd steps
    after_snapshot: tuple[tuple[int, ...], ...]  # ... from save_weights_and_get_sampling_client after them
    after_path: tuple[tuple[int, ...], ...]  # ... from save_weights_for_sampler(name) after them
    failures: list[tinker.RequestFailedError]
    trained_after: float  # the loss of a normal step after the failures (the client still trains)


def _explode(gw: Gateway) -> Exploded:
    service = tinker.ServiceClient(base_url=gw.url, api_key=KEY_A)
    try:
        training = service.create_lora_training_client(base_model=str(gw.tiny_model), rank=4, seed=3).result()
        training.forward_backward(_datums(5), "cross_entropy").result()
        training.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        before = _seeded(training.save_weights_and_get_sampling_client().result(), 21)
        failures = []
        for learning_rate in ABSURD_LEARNING_RATES:
            training.forward_backward(_datums(6), "cross_entropy").result()
            with pytest.raises(tinker.RequestFailedError) as caught:
                training.optim_step(types.AdamParams(learning_rate=learning_rate)).result()
            failures.append(caught.value)
        after_snapshot = _seeded(training.save_weights_and_get_sampling_client().result(), 21)
        path = training.save_weights_for_sampler("team-a-after").result().path
        after_path = _seeded(service.create_sampling_client(model_path=path).result(), 21)
        loss = training.forward_backward(_datums(7), "cross_entropy").result().metrics["loss:sum"]
        training.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        return Exploded(before, after_snapshot, after_path, failures, float(loss))
    finally:
        service.close("success").result()


def test_an_exploding_learning_rate_fails_alone_while_team_b_samples(
    gateway: Gateway,  # noqa: F811
    team_b_model: str,
    figure: Callable[[str, object], None],
) -> None:
    alone = team_b(gateway, team_b_model)
    before = gateway.memory()
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        workload = pool.submit(team_b, gateway, team_b_model)
        exploded = _explode(gateway)
        during = workload.result(timeout=600)
    after = gateway.memory()
    assert during == alone  # team-b: no error, the same seeded tokens

    # team-a: each absurd step is the caller's error (category user: the SDK raises it, no retry), naming why.
    assert len(exploded.failures) == len(ABSURD_LEARNING_RATES)
    for failure in exploded.failures:
        assert failure.category == types.RequestErrorCategory.User, failure
        assert "FAILED_PRECONDITION/WEIGHTS_OUT_OF_RANGE" in str(failure), failure
    # ... and the model is as before them: the same seeded tokens from both ways of saving it for sampling.
    assert exploded.after_snapshot == exploded.before
    assert exploded.after_path == exploded.before
    assert exploded.trained_after > 0
    figure("gateway_exploding_sdk_memory_mb", f"{before / MiB:.0f} -> {after / MiB:.0f}")
    assert after - before < 64 * MiB
    assert gateway.http.get("/api/v1/healthz").json() == {"status": "ok"}
