"""Loss functions: values and gradients against per-token references, the registry, PPO and CISPO clipping."""

from __future__ import annotations

import math

import pytest
import torch
from lossutil import (
    ATOL,
    PG_LOSSES,
    A,
    P,
    Q,
    W,
    assert_close,
    f32,
    inputs_for,
    ref_cispo,
    ref_loss,
    ref_ppo,
    run,
)

from opentinker.rpc.serving.errors import InvalidArgument
from opentinker.trainer_server.losses import LOSS_FNS, compute_loss, required_inputs

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
