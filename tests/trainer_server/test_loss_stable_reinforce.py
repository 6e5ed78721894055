"""stable_reinforce: value, gradient and metrics against a direct numpy implementation of the formula
(float64, gradient derived by hand), truncation, the KL penalty and the weights that select its tokens, masking,
sums over batches, bad config, and the weights through build_batch."""

from __future__ import annotations

import math

import numpy as np
import numpy.typing as npt
import pytest
import torch
from trainerutil import VOCAB, float_tensor, random_tokens, rl_datum

from opentinker.rpc.serving.errors import InvalidArgument
from opentinker.trainer_server.batch import Batch, build_batch
from opentinker.trainer_server.losses import compute_loss, resolve_config
from opentinker.trainer_server.wire import datums_of
from opentinker.v1 import common_pb2

Array = npt.NDArray[np.float64]


def direct(
    p: Array, q: Array, a: Array, kl_coeff: float, w: Array | None = None
) -> tuple[float, Array, dict[str, float]]:
    """The documented formula, token by token: the policy term over the active tokens (A != 0), the penalty over
    the selected ones (w != 0, w = [A != 0] without weights):
    loss = sum([A != 0] * -min(r, 1) * A * p) + kl_coeff * sum([w != 0] * w * (r - 1 - log r)), r = exp(p - q);
    d loss / d p = -[A != 0] * min(r, 1) * A + kl_coeff * [w != 0] * w * (r - 1) (min(r, 1): stop-gradient)."""
    active = a != 0
    w = active.astype(np.float64) if w is None else w
    selected = w != 0
    log_r = np.where(active, p - q, 0.0)
    r = np.exp(log_r)
    weight = np.minimum(r, 1.0)
    kl_log_r = np.where(selected, p - q, 0.0)
    kl_r = np.exp(kl_log_r)
    kl_terms = np.where(selected, w * (kl_r - 1.0 - kl_log_r), 0.0)
    loss = float(np.sum(np.where(active, -weight * a * p, 0.0)) + kl_coeff * np.sum(kl_terms))
    grad = np.where(active, -weight * a, 0.0) + np.where(selected, kl_coeff * w * (kl_r - 1.0), 0.0)
    n = int(active.sum())
    metrics = {
        "loss:sum": loss,
        "ratio:mean": float(r[active].mean()) if n else 1.0,
        "clip_fraction:mean": float((r[active] > 1.0).mean()) if n else 0.0,
        "kl:sum": float(kl_terms.sum()),
    }
    return loss, grad, metrics


def run(
    p: Array,
    q: Array,
    a: Array,
    config: dict[str, float] | None = None,
    dtype: torch.dtype = torch.float64,
    w: Array | None = None,
) -> tuple[float, Array, dict[str, float]]:
    logprobs = torch.tensor(p, dtype=dtype, requires_grad=True)
    inputs = {"logprobs": torch.tensor(q, dtype=dtype), "advantages": torch.tensor(a, dtype=dtype)}
    if w is not None:
        inputs["weights"] = torch.tensor(w, dtype=dtype)
    result = compute_loss("stable_reinforce", logprobs, inputs, config or {})
    (grad,) = torch.autograd.grad(result.loss, logprobs)
    return result.loss.item(), grad.double().numpy(), result.metrics


def random_case(seed: int, n: int) -> tuple[Array, Array, Array]:
    rng = np.random.default_rng(seed)
    p = -rng.exponential(1.5, n)
    q = p + rng.normal(0.0, 0.4, n)  # an off-policy sampler: ratios both sides of 1
    a = rng.normal(0.0, 1.0, n) * (rng.random(n) > 0.25)  # a quarter masked (A = 0)
    return p, q, a


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("kl_coeff", [0.0, 0.3])
def test_value_gradient_and_metrics_match_the_formula(seed: int, kl_coeff: float) -> None:
    p, q, a = random_case(seed, 40)
    loss, grad, metrics = run(p, q, a, {"kl_coeff": kl_coeff})
    ref_loss, ref_grad, ref_metrics = direct(p, q, a, kl_coeff)
    assert loss == pytest.approx(ref_loss, rel=1e-12, abs=1e-12)
    np.testing.assert_allclose(grad, ref_grad, rtol=1e-12, atol=1e-12)
    assert metrics.keys() == ref_metrics.keys()
    for key, value in ref_metrics.items():
        assert metrics[key] == pytest.approx(value, rel=1e-12, abs=1e-12), key
    assert 0.0 < metrics["clip_fraction:mean"] < 1.0  # the cases do truncate some tokens and not others


@pytest.mark.parametrize("seed", range(4))
def test_weights_select_the_penalty_tokens_whatever_their_advantage(seed: int) -> None:
    p, q, a = random_case(seed, 40)
    rng = np.random.default_rng(100 + seed)
    w = rng.uniform(0.5, 2.0, 40) * (rng.random(40) > 0.2)  # some tokens unselected, A = 0 or not
    assert np.any((a == 0) & (w != 0)) and np.any((a != 0) & (w == 0))
    loss, grad, metrics = run(p, q, a, {"kl_coeff": 0.4}, w=w)
    ref_loss, ref_grad, ref_metrics = direct(p, q, a, 0.4, w)
    assert loss == pytest.approx(ref_loss, rel=1e-12, abs=1e-12)
    np.testing.assert_allclose(grad, ref_grad, rtol=1e-12, atol=1e-12)
    for key, value in ref_metrics.items():
        assert metrics[key] == pytest.approx(value, rel=1e-12, abs=1e-12), key


def test_zero_advantage_batch_with_kl_gets_the_penalty_gradient() -> None:
    """Every advantage 0 (a group whose rewards were all equal), off-policy, kl_coeff > 0: the policy term is 0,
    the penalty is not, and its gradient kl_coeff * w * (r - 1) pulls each selected token back to the sampler."""
    q = np.array([-1.0, -2.0, -0.5, -3.0])
    p = q + np.array([0.3, -0.4, 0.1, 0.0])
    a = np.zeros(4)
    w = np.ones(4)
    loss, grad, metrics = run(p, q, a, {"kl_coeff": 0.5}, w=w)
    r = np.exp(p - q)
    np.testing.assert_allclose(grad, 0.5 * (r - 1.0), rtol=1e-12)
    assert np.count_nonzero(grad) == 3  # the on-policy token (r = 1) is already where the penalty wants it
    assert metrics["kl:sum"] == pytest.approx(float(np.sum(r - 1.0 - (p - q))), rel=1e-12)
    assert loss == pytest.approx(0.5 * metrics["kl:sum"], rel=1e-12) and loss > 0
    assert metrics["ratio:mean"] == 1.0 and metrics["clip_fraction:mean"] == 0.0  # no active token
    # without weights a datum's penalty covers its A != 0 tokens only: here none
    _, unweighted, _ = run(p, q, a, {"kl_coeff": 0.5})
    assert not unweighted.any()


def test_unselected_prompt_positions_stay_finite_and_silent() -> None:
    # a prompt position: q = 0 (no sampler logprob), p far below, A = 0, w = 0: nothing, not inf/NaN
    p = np.array([-90.0, -0.5, -0.9])
    q = np.array([0.0, -0.7, -0.4])
    a = np.array([0.0, 0.0, 1.0])
    w = np.array([0.0, 1.0, 2.0])
    loss, grad, metrics = run(p, q, a, {"kl_coeff": 1.0}, dtype=torch.float32, w=w)
    ref_loss, ref_grad, ref_metrics = direct(p, q, a, 1.0, w)
    assert math.isfinite(loss) and loss == pytest.approx(ref_loss, rel=1e-5)
    np.testing.assert_allclose(grad, ref_grad, rtol=1e-5)
    assert grad[0] == 0.0 and grad[1] != 0.0
    assert metrics["kl:sum"] == pytest.approx(ref_metrics["kl:sum"], rel=1e-5)


def test_float32_matches_the_float64_formula() -> None:
    p, q, a = random_case(7, 64)
    p, q, a = (np.asarray(x, dtype=np.float32).astype(np.float64) for x in (p, q, a))
    loss, grad, _ = run(p, q, a, {"kl_coeff": 0.1}, dtype=torch.float32)
    ref_loss, ref_grad, _ = direct(p, q, a, 0.1)
    assert loss == pytest.approx(ref_loss, rel=1e-5)
    np.testing.assert_allclose(grad, ref_grad, rtol=1e-5, atol=1e-6)


def test_weight_is_the_ratio_truncated_at_one() -> None:
    ratios = np.array([0.25, 0.5, 1.0, 2.0, 8.0])
    q = np.full(5, -1.0)
    p = q + np.log(ratios)
    for sign in (1.0, -1.0):
        a = np.full(5, sign)
        _, grad, metrics = run(p, q, a)
        # below 1 the ratio weights the token down; at or above 1 the weight is exactly 1 (plain REINFORCE)
        np.testing.assert_allclose(grad, -sign * np.minimum(ratios, 1.0), rtol=1e-12)
        assert metrics["clip_fraction:mean"] == pytest.approx(2 / 5)
        assert metrics["ratio:mean"] == pytest.approx(ratios.mean())


def test_on_policy_it_is_reinforce_and_the_penalty_vanishes() -> None:
    p, _, a = random_case(3, 20)
    loss, grad, metrics = run(p, p.copy(), a, {"kl_coeff": 5.0})
    active = a != 0
    assert loss == pytest.approx(float(-(a * p)[active].sum()), rel=1e-12)
    np.testing.assert_allclose(grad, -a, rtol=1e-12)
    assert metrics["kl:sum"] == 0.0
    assert metrics["ratio:mean"] == 1.0


def test_penalty_is_non_negative_and_pulls_towards_the_sampler() -> None:
    q = np.array([-1.0, -1.0, -2.0])
    p = np.array([-0.5, -1.5, -2.0])  # above, below and equal to the sampler's logprob
    a = np.full(3, 1e-9)  # active, with a negligible policy term
    _, grad, metrics = run(p, q, a, {"kl_coeff": 1.0})
    assert metrics["kl:sum"] > 0
    assert grad[0] > 0 and grad[1] < 0 and grad[2] == pytest.approx(0.0, abs=1e-8)  # descent moves p to q
    with_kl, _, _ = run(p, q, a, {"kl_coeff": 2.0})
    without, _, _ = run(p, q, a)
    assert with_kl - without == pytest.approx(2.0 * metrics["kl:sum"], rel=1e-9)


def test_masked_tokens_contribute_nothing_whatever_their_logprobs() -> None:
    # prompt positions often carry q = 0 with p far below: A = 0 must give 0, not inf/NaN from exp(p - q)
    p = np.array([-80.0, -0.5, -900.0])
    q = np.array([0.0, -0.7, 50.0])
    a = np.array([0.0, 1.0, 0.0])
    loss, grad, metrics = run(p, q, a, {"kl_coeff": 1.0}, dtype=torch.float32)
    ref_loss, ref_grad, _ = direct(p, q, a, 1.0)
    assert math.isfinite(loss) and loss == pytest.approx(ref_loss, rel=1e-5)
    np.testing.assert_allclose(grad, ref_grad, rtol=1e-5)
    assert grad[0] == 0.0 and grad[2] == 0.0
    assert metrics["kl:sum"] == pytest.approx(math.exp(0.2) - 1 - 0.2, rel=1e-5)  # the active token's only
    empty = run(p, q, np.zeros(3), {"kl_coeff": 1.0})
    assert empty[0] == 0.0 and not empty[1].any()
    assert empty[2]["ratio:mean"] == 1.0 and empty[2]["clip_fraction:mean"] == 0.0


def test_the_loss_of_a_batch_is_the_sum_of_its_parts() -> None:
    p, q, a = random_case(11, 30)
    whole, whole_grad, _ = run(p, q, a, {"kl_coeff": 0.2})
    parts = [run(p[s], q[s], a[s], {"kl_coeff": 0.2}) for s in (slice(0, 13), slice(13, 30))]
    assert whole == pytest.approx(sum(part[0] for part in parts), rel=1e-12)
    np.testing.assert_allclose(whole_grad, np.concatenate([part[1] for part in parts]), rtol=1e-12)


def test_gradcheck_of_the_penalty() -> None:
    # the penalty has no stop-gradient: finite differences see it exactly (policy term off: A tiny)
    generator = torch.Generator().manual_seed(0)
    p = (-torch.rand(9, generator=generator, dtype=torch.float64) * 2).requires_grad_()
    q = p.detach() + torch.linspace(-0.6, 0.6, 9, dtype=torch.float64)
    a = torch.full((9,), 1e-300, dtype=torch.float64)

    def fn(x: torch.Tensor) -> torch.Tensor:
        return compute_loss("stable_reinforce", x, {"logprobs": q, "advantages": a}, {"kl_coeff": 0.7}).loss

    assert torch.autograd.gradcheck(fn, (p,), eps=1e-6, atol=1e-8)


@pytest.mark.parametrize(
    ("config", "key", "message"),
    [
        ({"kl_coef": 0.1}, "kl_coef", "unknown key(s) 'kl_coef'; allowed: kl_coeff"),
        ({"clip_high_threshold": 2.0}, "clip_high_threshold", "allowed: kl_coeff"),
        ({"kl_coeff": -0.01}, "kl_coeff", "kl_coeff must be >= 0"),
        ({"kl_coeff": math.nan}, "kl_coeff", "kl_coeff must be finite"),
        ({"kl_coeff": math.inf}, "kl_coeff", "kl_coeff must be finite"),
    ],
)
def test_bad_config_is_refused_precisely(config: dict[str, float], key: str, message: str) -> None:
    with pytest.raises(InvalidArgument) as info:
        resolve_config("stable_reinforce", config)
    assert info.value.reason == "INVALID_LOSS_CONFIG"
    assert message in info.value.message
    assert info.value.metadata["key"] == key
    assert resolve_config("stable_reinforce", {}) == {"kl_coeff": 0.0}
    assert resolve_config("stable_reinforce", {"kl_coeff": 0.05}) == {"kl_coeff": 0.05}


def test_missing_or_misshaped_inputs_are_refused() -> None:
    p = torch.zeros(3, dtype=torch.float64, requires_grad=True)
    with pytest.raises(InvalidArgument) as info:
        compute_loss("stable_reinforce", p, {"logprobs": torch.zeros(3)}, {})
    assert info.value.reason == "INVALID_DATUM" and "missing loss_fn_inputs 'advantages'" in info.value.message
    with pytest.raises(InvalidArgument) as info:
        compute_loss("stable_reinforce", p, {"logprobs": torch.zeros(2), "advantages": torch.zeros(3)}, {})
    assert info.value.reason == "INVALID_DATUM" and "logprobs has shape [2]" in info.value.message


def test_misshaped_weights_are_refused() -> None:
    p = torch.zeros(3, dtype=torch.float64, requires_grad=True)
    inputs = {"logprobs": torch.zeros(3), "advantages": torch.zeros(3), "weights": torch.ones(2)}
    with pytest.raises(InvalidArgument) as info:
        compute_loss("stable_reinforce", p, inputs, {"kl_coeff": 1.0})
    assert info.value.reason == "INVALID_DATUM" and "weights has shape [2]" in info.value.message


def sr_datum(tokens: list[int], q: list[float], a: list[float], w: list[float] | None) -> common_pb2.Datum:
    datum = rl_datum(tokens, q, a)
    if w is not None:
        datum.loss_fn_inputs["weights"].CopyFrom(float_tensor(w))
    return datum


def build(datums: list[common_pb2.Datum]) -> Batch:
    return build_batch(datums_of(datums), "stable_reinforce", vocab_size=VOCAB, max_positions=64, pad_id=0)


def test_build_batch_carries_the_weights_and_defaults_them_per_datum() -> None:
    weighted = sr_datum(random_tokens(1, 5), [0.0, -1.0, -1.5, -2.0], [0.0, 0.0, 0.0, 0.0], [0.0, 1.0, 1.0, 2.0])
    unweighted = sr_datum(random_tokens(2, 4), [0.0, -1.0, -0.5], [0.0, 1.0, -1.0], None)
    assert build([weighted, unweighted]).inputs["weights"].tolist() == [0.0, 1.0, 1.0, 2.0, 0.0, 1.0, 1.0]
    assert "weights" in build([unweighted]).inputs  # [A != 0] when no datum sends them
    # all advantages 0, as built for the trainer: the penalty alone gives the gradient, on the selected tokens
    batch = build([weighted])
    p = (batch.inputs["logprobs"] + torch.tensor([0.0, 0.2, -0.3, 0.1])).double().requires_grad_()
    result = compute_loss("stable_reinforce", p, batch.inputs, {"kl_coeff": 0.5})
    (grad,) = torch.autograd.grad(result.loss, p)
    assert grad[0] == 0.0 and bool((grad[1:] != 0).all())


def test_build_batch_refuses_negative_weights_and_digests_given_ones() -> None:
    tokens, q, a = random_tokens(3, 5), [0.0, -1.0, -1.5, -2.0], [0.0, 1.0, 1.0, 1.0]
    with pytest.raises(InvalidArgument) as info:
        build([sr_datum(tokens, q, a, None), sr_datum(tokens, q, a, [0.0, 1.0, -0.5, 1.0])])
    assert info.value.reason == "INVALID_DATUM" and "must be >= 0" in info.value.message
    assert info.value.metadata == {"field": "datums[1].loss_fn_inputs['weights']", "datum": "1"}
    # the weights are part of the batch's id (the ledger's record of what was trained on)
    plain, weighted = build([sr_datum(tokens, q, a, None)]), build([sr_datum(tokens, q, a, [0.0, 1.0, 1.0, 1.0])])
    assert plain.inputs["weights"].tolist() == weighted.inputs["weights"].tolist()
    assert plain.digest != weighted.digest
