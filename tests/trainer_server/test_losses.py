"""Loss functions: values and gradients against per-token references, clipping, config, masking, sums."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

import pytest
import torch

from opentinker.rpc.serving.errors import InvalidArgument
from opentinker.trainer_server.losses import LOSS_FNS, compute_loss, required_inputs, resolve_config

ATOL = 1e-6
PG_LOSSES = ("importance_sampling", "ppo", "cispo", "dro")

# --- independent references: plain Python floats, one token at a time -------------------------------------
# Each returns (loss, d loss / d p per token), the gradient derived by hand.

Ref = tuple[float, list[float]]


def ref_cross_entropy(p: list[float], w: list[float]) -> Ref:
    loss = 0.0
    grad = []
    for p_i, w_i in zip(p, w, strict=True):
        loss -= w_i * p_i
        grad.append(-w_i)
    return loss, grad


def ref_importance_sampling(p: list[float], q: list[float], a: list[float]) -> Ref:
    loss = 0.0
    grad = []
    for p_i, q_i, a_i in zip(p, q, a, strict=True):
        ratio = math.exp(p_i - q_i)
        loss -= ratio * a_i
        grad.append(-a_i * ratio)  # d/dp exp(p - q) = exp(p - q)
    return loss, grad


def ref_ppo(p: list[float], q: list[float], a: list[float], lo: float = 0.8, hi: float = 1.2) -> Ref:
    loss = 0.0
    grad = []
    for p_i, q_i, a_i in zip(p, q, a, strict=True):
        ratio = math.exp(p_i - q_i)
        clipped_ratio = lo if ratio < lo else hi if ratio > hi else ratio
        unclipped_term = ratio * a_i
        clipped_term = clipped_ratio * a_i
        if clipped_term < unclipped_term:  # pessimistic branch is the constant clipped one
            loss -= clipped_term
            grad.append(0.0)
        else:
            loss -= unclipped_term
            grad.append(-a_i * ratio)
    return loss, grad


def ref_cispo(p: list[float], q: list[float], a: list[float], lo: float = 0.0, hi: float = 4.0) -> Ref:
    loss = 0.0
    grad = []
    for p_i, q_i, a_i in zip(p, q, a, strict=True):
        ratio = math.exp(p_i - q_i)
        weight = min(max(ratio, lo), hi)  # a constant: stop-gradient
        loss -= weight * a_i * p_i
        grad.append(-weight * a_i)
    return loss, grad


def ref_dro(p: list[float], q: list[float], a: list[float], beta: float = 0.05) -> Ref:
    loss = 0.0
    grad = []
    for p_i, q_i, a_i in zip(p, q, a, strict=True):
        loss -= p_i * a_i - beta / 2 * (p_i - q_i) ** 2
        grad.append(-(a_i - beta * (p_i - q_i)))
    return loss, grad


def ref_stable_reinforce(p: list[float], q: list[float], a: list[float], kl_coeff: float = 0.0) -> Ref:
    loss = 0.0
    grad = []
    for p_i, q_i, a_i in zip(p, q, a, strict=True):
        if a_i == 0:
            grad.append(0.0)
            continue
        ratio = math.exp(p_i - q_i)
        weight = min(ratio, 1.0)  # a constant: stop-gradient
        loss += -weight * a_i * p_i + kl_coeff * (ratio - 1 - (p_i - q_i))
        grad.append(-weight * a_i + kl_coeff * (ratio - 1))
    return loss, grad


def ref_loss(loss_fn: str, p: list[float], ins: Mapping[str, list[float]], **config: float) -> Ref:
    if loss_fn == "cross_entropy":
        return ref_cross_entropy(p, ins["weights"])
    refs: dict[str, Callable[..., Ref]] = {
        "importance_sampling": ref_importance_sampling,
        "ppo": ref_ppo,
        "cispo": ref_cispo,
        "dro": ref_dro,
        "stable_reinforce": ref_stable_reinforce,
    }
    return refs[loss_fn](p, ins["logprobs"], ins["advantages"], **config)


# --- helpers -----------------------------------------------------------------------------------------------


def run(
    loss_fn: str, p: list[float], ins: Mapping[str, list[float]], config: Mapping[str, float] | None = None
) -> tuple[float, list[float], dict[str, float]]:
    """compute_loss on float32 tensors: (loss, grad w.r.t. logprobs, metrics)."""
    logprobs = torch.tensor(p, dtype=torch.float32, requires_grad=True)
    inputs = {key: torch.tensor(values, dtype=torch.float32) for key, values in ins.items()}
    result = compute_loss(loss_fn, logprobs, inputs, config or {})
    assert result.loss.shape == ()
    assert result.loss.dtype == torch.float32
    (grad,) = torch.autograd.grad(result.loss, logprobs)
    return result.loss.item(), grad.tolist(), result.metrics


def assert_close(actual: list[float], expected: list[float], atol: float = ATOL) -> None:
    assert len(actual) == len(expected)
    for x, y in zip(actual, expected, strict=True):
        assert x == pytest.approx(y, abs=atol, rel=0), (actual, expected)


def f32(values: list[float]) -> list[float]:
    """Round to float32 so the float64 reference sees exactly the values the implementation sees."""
    return torch.tensor(values, dtype=torch.float32).tolist()


P = f32([-0.3, -1.2, -2.0, -0.05, -0.7, -4.0])
Q = f32([-0.5, -1.0, -2.0, -0.9, -0.2, -3.5])  # ratios ~1.22, 0.82, 1.0, 2.34, 0.61, 0.61
A = f32([1.0, -0.5, 2.0, -1.5, 0.75, -2.0])
W = f32([1.0, 0.0, 0.5, 2.0, 1.0, 0.25])


def inputs_for(loss_fn: str) -> dict[str, list[float]]:
    return {"weights": W} if loss_fn == "cross_entropy" else {"logprobs": Q, "advantages": A}


# --- registry ----------------------------------------------------------------------------------------------


def test_registry_lists_the_six_losses_with_their_inputs_and_defaults() -> None:
    assert set(LOSS_FNS) == {"cross_entropy", "importance_sampling", "ppo", "cispo", "dro", "stable_reinforce"}
    assert required_inputs("cross_entropy") == ("target_tokens", "weights")
    for name in PG_LOSSES:
        assert required_inputs(name) == ("target_tokens", "logprobs", "advantages")
        assert LOSS_FNS[name].name == name
    assert dict(LOSS_FNS["ppo"].defaults) == {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}
    assert dict(LOSS_FNS["cispo"].defaults) == {"clip_low_threshold": 0.0, "clip_high_threshold": 4.0}
    assert dict(LOSS_FNS["dro"].defaults) == {"beta": 0.05}
    assert required_inputs("stable_reinforce") == ("target_tokens", "logprobs", "advantages")
    assert dict(LOSS_FNS["stable_reinforce"].defaults) == {"kl_coeff": 0.0}
    assert dict(LOSS_FNS["cross_entropy"].defaults) == {}
    assert dict(LOSS_FNS["importance_sampling"].defaults) == {}
    with pytest.raises(TypeError):
        LOSS_FNS["ppo"].defaults["beta"] = 1.0  # type: ignore[index]


def test_required_inputs_rejects_unknown_loss() -> None:
    with pytest.raises(InvalidArgument) as info:
        required_inputs("nope")
    assert info.value.reason == "UNKNOWN_LOSS_FN"


# --- values and gradients against the references -----------------------------------------------------------


@pytest.mark.parametrize("loss_fn", sorted(LOSS_FNS))
def test_value_and_gradient_match_reference(loss_fn: str) -> None:
    ins = inputs_for(loss_fn)
    loss, grad, metrics = run(loss_fn, P, ins)
    ref_value, ref_grad = ref_loss(loss_fn, P, ins)
    assert loss == pytest.approx(ref_value, abs=ATOL, rel=0)
    assert_close(grad, ref_grad)
    assert metrics["loss:sum"] == pytest.approx(ref_value, abs=ATOL, rel=0)


def test_hand_derived_gradients_in_closed_form() -> None:
    """The gradients spelled out as tensor formulas, independently of the per-token references."""
    p, q, a, w = (torch.tensor(x, dtype=torch.float64) for x in (P, Q, A, W))
    r = torch.exp(p - q)
    _, grad, _ = run("cross_entropy", P, {"weights": W})
    assert_close(grad, (-w).tolist())
    _, grad, _ = run("importance_sampling", P, {"logprobs": Q, "advantages": A})
    assert_close(grad, (-a * r).tolist())
    _, grad, _ = run("cispo", P, {"logprobs": Q, "advantages": A})
    assert_close(grad, (-r.clamp(0.0, 4.0) * a).tolist())
    _, grad, _ = run("dro", P, {"logprobs": Q, "advantages": A})
    assert_close(grad, (-(a - 0.05 * (p - q))).tolist())
    _, grad, _ = run("ppo", P, {"logprobs": Q, "advantages": A})
    unclipped_active = ((a > 0) & (r <= 1.2)) | ((a < 0) & (r >= 0.8))
    assert_close(grad, torch.where(unclipped_active, -a * r, torch.zeros_like(r)).tolist())


@pytest.mark.parametrize("loss_fn", sorted(LOSS_FNS))
def test_gradcheck_float64(loss_fn: str) -> None:
    # ppo and cispo are smooth away from the thresholds: these ratios stay clear of them (ppo's clipped
    # tokens are still exercised: some sit outside [0.8, 1.2]).
    generator = torch.Generator().manual_seed(0)
    n = 7
    p = (-torch.rand(n, generator=generator, dtype=torch.float64) * 2).requires_grad_()
    q = p.detach() + torch.tensor([0.5, -0.5, 0.02, -0.03, 0.6, -0.4, 0.0], dtype=torch.float64)
    a = torch.tensor([1.0, -1.0, 0.5, -2.0, -0.3, 0.7, 0.0], dtype=torch.float64)
    w = torch.rand(n, generator=generator, dtype=torch.float64)
    inputs = {"weights": w, "logprobs": q, "advantages": a}
    p0 = p.detach().clone()  # gradcheck perturbs p in place

    def fn(x: torch.Tensor) -> torch.Tensor:
        if loss_fn in ("cispo", "stable_reinforce"):
            # the stop-gradient weight clip(r) (min(r, 1)) is a constant of the objective: move q with x (detached) so
            # finite differences see the frozen-weight objective -sum(c * A * x) whose gradient autograd gives
            inputs["logprobs"] = q + (x.detach() - p0)
        result = compute_loss(loss_fn, x, inputs, {})
        assert result.loss.dtype == torch.float64
        return result.loss

    assert torch.autograd.gradcheck(fn, (p,), eps=1e-6, atol=1e-7)


# --- clipping ----------------------------------------------------------------------------------------------


def ratios_to_logprobs(ratios: list[float], q: float = -1.0) -> tuple[list[float], list[float]]:
    p = [q + math.log(r) for r in ratios]
    return f32(p), f32([q] * len(ratios))


# ratio far below, just below, inside, just above, far above the ppo window [0.8, 1.2]
PPO_RATIOS = [0.5, 0.79, 1.0, 1.21, 2.0]


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_ppo_clips_at_both_thresholds(sign: float) -> None:
    p, q = ratios_to_logprobs(PPO_RATIOS)
    a = [sign] * len(p)
    loss, grad, metrics = run("ppo", p, {"logprobs": q, "advantages": a})
    ref_value, ref_grad = ref_ppo(p, q, a)
    assert loss == pytest.approx(ref_value, abs=ATOL, rel=0)
    assert_close(grad, ref_grad)
    if sign > 0:
        # A > 0: the upper threshold binds (ratios 1.21 and 2.0 pay 1.2 and get no gradient)
        zero_grad = [False, False, False, True, True]
        expected_objective = 0.5 + 0.79 + 1.0 + 1.2 + 1.2
    else:
        # A < 0: the lower threshold binds (ratios 0.5 and 0.79 pay -0.8 and get no gradient)
        zero_grad = [True, True, False, False, False]
        expected_objective = -(0.8 + 0.8 + 1.0 + 1.21 + 2.0)
    for g, r, is_zero in zip(grad, PPO_RATIOS, zero_grad, strict=True):
        assert (g == 0.0) == is_zero
        if not is_zero:
            assert g == pytest.approx(-sign * r, abs=1e-5)
    assert loss == pytest.approx(-expected_objective, abs=1e-5)
    assert metrics["clip_fraction:mean"] == pytest.approx(2 / 5)


def test_ppo_ratio_exactly_at_threshold_keeps_gradient() -> None:
    # p == q gives r == 1.0 exactly; with the binding threshold at 1.0 both terms are equal and the
    # unclipped one (with gradient) is taken
    for sign, config in [
        (1.0, {"clip_low_threshold": 0.5, "clip_high_threshold": 1.0}),
        (-1.0, {"clip_low_threshold": 1.0, "clip_high_threshold": 1.5}),
    ]:
        loss, grad, metrics = run("ppo", [-0.75], {"logprobs": [-0.75], "advantages": [sign]}, config)
        assert loss == -sign
        assert grad == [-sign]
        assert metrics["clip_fraction:mean"] == 0.0


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_cispo_clips_the_weight_at_both_thresholds_but_keeps_gradient(sign: float) -> None:
    config = {"clip_low_threshold": 0.5, "clip_high_threshold": 2.0}
    ratios = [0.25, 0.5, 1.0, 2.0, 3.0]
    p, q = ratios_to_logprobs(ratios)
    a = [sign] * len(p)
    loss, grad, metrics = run("cispo", p, {"logprobs": q, "advantages": a}, config)
    ref_value, ref_grad = ref_cispo(p, q, a, lo=0.5, hi=2.0)
    assert loss == pytest.approx(ref_value, abs=ATOL, rel=0)
    assert_close(grad, ref_grad)
    # every token keeps a gradient, scaled by its clipped weight
    assert_close(grad, [-sign * c for c in [0.5, 0.5, 1.0, 2.0, 2.0]], atol=1e-5)
    assert metrics["clip_fraction:mean"] == pytest.approx(2 / 5)


def test_cispo_default_window_only_caps_large_ratios() -> None:
    p, q = ratios_to_logprobs([0.01, 1.0, 3.9, 10.0])
    a = [1.0, -1.0, 1.0, -1.0]
    _, grad, metrics = run("cispo", p, {"logprobs": q, "advantages": a})
    assert_close(grad, [-0.01, 1.0, -3.9, 4.0], atol=1e-5)
    assert metrics["clip_fraction:mean"] == pytest.approx(1 / 4)


# --- config ------------------------------------------------------------------------------------------------


def test_resolve_config_defaults_and_overrides() -> None:
    assert resolve_config("ppo", {}) == {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}
    assert resolve_config("cispo", {}) == {"clip_low_threshold": 0.0, "clip_high_threshold": 4.0}
    assert resolve_config("dro", {}) == {"beta": 0.05}
    assert resolve_config("cross_entropy", {}) == {}
    assert resolve_config("importance_sampling", {}) == {}
    assert resolve_config("ppo", {"clip_high_threshold": 1.5}) == {
        "clip_low_threshold": 0.8,
        "clip_high_threshold": 1.5,
    }
    assert resolve_config("dro", {"beta": 0}) == {"beta": 0.0}
    assert resolve_config("ppo", {"clip_low_threshold": 1.0, "clip_high_threshold": 1.0})["clip_low_threshold"] == 1.0


def test_defaults_equal_explicit_defaults() -> None:
    for loss_fn in PG_LOSSES:
        ins = inputs_for(loss_fn)
        implicit = run(loss_fn, P, ins)
        explicit = run(loss_fn, P, ins, dict(LOSS_FNS[loss_fn].defaults))
        assert implicit == explicit


def test_custom_config_changes_results() -> None:
    ins = {"logprobs": Q, "advantages": A}
    for loss_fn, config in [
        ("ppo", {"clip_low_threshold": 0.5, "clip_high_threshold": 3.0}),
        ("cispo", {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1}),
        ("dro", {"beta": 1.5}),
    ]:
        default_loss, default_grad, _ = run(loss_fn, P, ins)
        loss, grad, _ = run(loss_fn, P, ins, config)
        ref_value, ref_grad = ref_loss(loss_fn, P, ins, **{_short(k): v for k, v in config.items()})
        assert loss == pytest.approx(ref_value, abs=ATOL, rel=0)
        assert_close(grad, ref_grad)
        assert abs(loss - default_loss) > 1e-3
        assert grad != default_grad


def _short(key: str) -> str:
    return {"clip_low_threshold": "lo", "clip_high_threshold": "hi"}.get(key, key)


def test_ppo_wide_window_equals_importance_sampling() -> None:
    ins = {"logprobs": Q, "advantages": A}
    wide = {"clip_low_threshold": 0.0, "clip_high_threshold": 1e6}
    loss_ppo, grad_ppo, metrics = run("ppo", P, ins, wide)
    loss_is, grad_is, _ = run("importance_sampling", P, ins)
    assert loss_ppo == pytest.approx(loss_is, abs=ATOL)
    assert_close(grad_ppo, grad_is)
    assert metrics["clip_fraction:mean"] == 0.0


def test_dro_with_zero_beta_is_advantage_weighted_logprob() -> None:
    loss, grad, _ = run("dro", P, {"logprobs": Q, "advantages": A}, {"beta": 0.0})
    assert loss == pytest.approx(-sum(p * a for p, a in zip(P, A, strict=True)), abs=ATOL)
    assert_close(grad, [-a for a in A])


def test_unknown_loss_fn_lists_the_known_ones() -> None:
    for call in (
        lambda: resolve_config("reinforce", {}),
        lambda: compute_loss("reinforce", torch.zeros(2), {}, {}),
    ):
        with pytest.raises(InvalidArgument) as info:
            call()
        assert info.value.reason == "UNKNOWN_LOSS_FN"
        assert info.value.metadata == {"loss_fn": "reinforce"}
        for name in LOSS_FNS:
            assert name in info.value.message


@pytest.mark.parametrize(
    ("loss_fn", "config", "key", "words"),
    [
        ("ppo", {"beta": 0.1}, "beta", ["'beta'", "clip_high_threshold", "clip_low_threshold"]),
        ("cross_entropy", {"clip_low_threshold": 0.5}, "clip_low_threshold", ["allowed: none"]),
        ("importance_sampling", {"beta": 0.1}, "beta", ["'beta'"]),
        ("dro", {"clip_high_threshold": 2.0}, "clip_high_threshold", ["'clip_high_threshold'", "beta"]),
        ("ppo", {"clip_low_threshold": math.nan}, "clip_low_threshold", ["finite"]),
        ("cispo", {"clip_high_threshold": math.inf}, "clip_high_threshold", ["finite"]),
        ("dro", {"beta": -math.inf}, "beta", ["finite"]),
        ("ppo", {"clip_low_threshold": 1.3}, "clip_low_threshold", ["<="]),
        ("cispo", {"clip_low_threshold": 2.0, "clip_high_threshold": 1.0}, "clip_low_threshold", ["<="]),
        ("ppo", {"clip_low_threshold": -0.1}, "clip_low_threshold", [">= 0"]),
        ("cispo", {"clip_low_threshold": -1.0, "clip_high_threshold": -0.5}, "clip_low_threshold", [">= 0"]),
        ("dro", {"beta": -0.01}, "beta", [">= 0"]),
    ],
)
def test_invalid_config(loss_fn: str, config: dict[str, float], key: str, words: list[str]) -> None:
    for call in (
        lambda: resolve_config(loss_fn, config),
        lambda: compute_loss(loss_fn, torch.zeros(1), {k: torch.zeros(1) for k in required_inputs(loss_fn)}, config),
    ):
        with pytest.raises(InvalidArgument) as info:
            call()
        assert info.value.reason == "INVALID_LOSS_CONFIG"
        assert info.value.metadata == {"loss_fn": loss_fn, "key": key}
        assert key in info.value.message
        for word in words:
            assert word in info.value.message


def test_resolve_config_does_not_mutate_defaults() -> None:
    resolve_config("dro", {"beta": 2.0})
    assert resolve_config("dro", {}) == {"beta": 0.05}


# --- masking -----------------------------------------------------------------------------------------------


def test_zero_weight_tokens_contribute_nothing_to_cross_entropy() -> None:
    p = f32([-0.5, -3.0, -1.0, -50.0])
    w = [1.0, 0.0, 2.0, 0.0]
    loss, grad, metrics = run("cross_entropy", p, {"weights": w})
    assert loss == pytest.approx(0.5 + 2.0, abs=ATOL)
    assert grad == [-1.0, 0.0, -2.0, 0.0]
    assert metrics["weights:sum"] == 3.0
    # a -inf logprob under weight 0 stays exactly out
    loss, grad, _ = run("cross_entropy", [-0.5, -math.inf], {"weights": [1.0, 0.0]})
    assert loss == pytest.approx(0.5, abs=ATOL)
    assert grad == [-1.0, 0.0]


@pytest.mark.parametrize("loss_fn", ["importance_sampling", "ppo", "cispo"])
def test_zero_advantage_tokens_contribute_nothing(loss_fn: str) -> None:
    active_p, active_q, active_a = f32([-0.3, -0.7]), f32([-0.5, -0.2]), [1.0, -1.0]
    # inactive tokens with wild values: q = 0 on prompt positions, and one whose ratio would overflow
    inactive_p, inactive_q = f32([-2.0, -0.1, -1.0]), f32([0.0, -200.0, -1e30])
    p = active_p + inactive_p
    ins = {"logprobs": active_q + inactive_q, "advantages": [*active_a, 0.0, 0.0, 0.0]}
    loss, grad, metrics = run(loss_fn, p, ins)
    only_loss, only_grad, only_metrics = run(loss_fn, active_p, {"logprobs": active_q, "advantages": active_a})
    assert loss == only_loss
    assert grad[:2] == only_grad
    assert grad[2:] == [0.0, 0.0, 0.0]
    assert metrics == only_metrics  # means run over active tokens only


def test_all_inactive_tokens_give_zero_loss_and_neutral_metrics() -> None:
    ins = {"logprobs": [-1.0, 0.0], "advantages": [0.0, 0.0]}
    assert run("importance_sampling", [-0.5, -2.0], ins) == (
        0.0,
        [0.0, 0.0],
        {"loss:sum": 0.0, "ratio:mean": 1.0},
    )
    for loss_fn in ("ppo", "cispo"):
        assert run(loss_fn, [-0.5, -2.0], ins) == (
            0.0,
            [0.0, 0.0],
            {"loss:sum": 0.0, "clip_fraction:mean": 0.0},
        )


def test_dro_penalises_drift_even_without_advantage() -> None:
    # documented: dro has no mask; A = 0 tokens contribute beta/2 (p - q)^2, and nothing only when p == q
    loss, grad, _ = run("dro", [-1.0, -2.0], {"logprobs": [-1.5, -2.0], "advantages": [0.0, 0.0]}, {"beta": 0.5})
    assert loss == pytest.approx(0.25 * 0.25, abs=ATOL)
    assert_close(grad, [0.5 * 0.5, 0.0])


# --- sum semantics and metrics -----------------------------------------------------------------------------


@pytest.mark.parametrize("loss_fn", sorted(LOSS_FNS))
def test_batch_loss_is_sum_of_part_losses(loss_fn: str) -> None:
    ins = inputs_for(loss_fn)
    whole_loss, whole_grad, whole_metrics = run(loss_fn, P, ins)
    split = 2
    first = run(loss_fn, P[:split], {k: v[:split] for k, v in ins.items()})
    second = run(loss_fn, P[split:], {k: v[split:] for k, v in ins.items()})
    assert whole_loss == pytest.approx(first[0] + second[0], abs=ATOL)
    assert_close(whole_grad, first[1] + second[1])
    for name, value in whole_metrics.items():
        if name.endswith(":sum"):
            assert value == pytest.approx(first[2][name] + second[2][name], abs=ATOL)


def test_metrics() -> None:
    _, _, metrics = run("cross_entropy", P, {"weights": W})
    assert set(metrics) == {"loss:sum", "weights:sum"}
    assert metrics["weights:sum"] == pytest.approx(sum(W))
    _, _, metrics = run("importance_sampling", P, {"logprobs": Q, "advantages": A})
    assert set(metrics) == {"loss:sum", "ratio:mean"}
    ratios = [math.exp(p - q) for p, q in zip(P, Q, strict=True)]
    assert metrics["ratio:mean"] == pytest.approx(sum(ratios) / len(ratios), abs=1e-6)
    _, _, metrics = run("ppo", P, {"logprobs": Q, "advantages": A})
    assert set(metrics) == {"loss:sum", "clip_fraction:mean"}
    # ratios ~1.22 (A>0, clipped), 0.82 (A<0), 1.0, 2.34 (A<0), 0.61 (A>0), 0.61 (A<0, clipped)
    assert metrics["clip_fraction:mean"] == pytest.approx(2 / 6)
    _, _, metrics = run("cispo", P, {"logprobs": Q, "advantages": A})
    assert set(metrics) == {"loss:sum", "clip_fraction:mean"}
    assert metrics["clip_fraction:mean"] == 0.0
    _, _, metrics = run("dro", P, {"logprobs": Q, "advantages": A})
    assert set(metrics) == {"loss:sum"}
    for metrics in (run(name, P, inputs_for(name))[2] for name in LOSS_FNS):
        assert all(isinstance(value, float) for value in metrics.values())


def test_empty_batch() -> None:
    for loss_fn in LOSS_FNS:
        loss, grad, metrics = run(loss_fn, [], {k: [] for k in inputs_for(loss_fn)})
        assert loss == 0.0
        assert grad == []
        assert metrics["loss:sum"] == 0.0


# --- dtypes and input validation ---------------------------------------------------------------------------


def test_low_precision_logprobs_are_computed_in_float32() -> None:
    logprobs = torch.tensor(P, dtype=torch.bfloat16, requires_grad=True)
    inputs = {
        "logprobs": torch.tensor(Q, dtype=torch.float64),
        "advantages": torch.tensor(A, dtype=torch.float16),
    }
    result = compute_loss("importance_sampling", logprobs, inputs, {})
    assert result.loss.dtype == torch.float32
    (grad,) = torch.autograd.grad(result.loss, logprobs)
    assert grad.dtype == torch.bfloat16
    p32 = logprobs.detach().float().tolist()
    a32 = torch.tensor(A, dtype=torch.float16).float().tolist()
    ref_value, _ = ref_importance_sampling(p32, Q, a32)
    assert result.loss.item() == pytest.approx(ref_value, abs=1e-5)


def test_extra_inputs_are_ignored_and_inputs_are_not_differentiated() -> None:
    q = torch.tensor(Q, requires_grad=True)
    logprobs = torch.tensor(P, requires_grad=True)
    inputs = {"target_tokens": torch.arange(len(P)), "logprobs": q, "advantages": torch.tensor(A)}
    loss = compute_loss("dro", logprobs, inputs, {}).loss
    grad_p, grad_q = torch.autograd.grad(loss, (logprobs, q), allow_unused=True)
    assert grad_q is None
    assert_close(grad_p.tolist(), ref_dro(P, Q, A)[1])


@pytest.mark.parametrize(
    ("logprobs", "inputs", "key"),
    [
        (torch.zeros(3), {"advantages": torch.zeros(3)}, "logprobs"),
        (torch.zeros(3), {"logprobs": torch.zeros(3), "advantages": torch.zeros(2)}, "advantages"),
        (torch.zeros(3), {"logprobs": torch.zeros(3, 1), "advantages": torch.zeros(3)}, "logprobs"),
        (torch.zeros(1, 3), {"logprobs": torch.zeros(1, 3), "advantages": torch.zeros(1, 3)}, "logprobs"),
    ],
)
def test_bad_inputs_are_invalid_datum(logprobs: torch.Tensor, inputs: dict[str, torch.Tensor], key: str) -> None:
    with pytest.raises(InvalidArgument) as info:
        compute_loss("ppo", logprobs, inputs, {})
    assert info.value.reason == "INVALID_DATUM"
    assert info.value.metadata == {"loss_fn": "ppo", "key": key}
