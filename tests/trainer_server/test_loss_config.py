"""Loss functions: config resolution and validation, inactive tokens, batching, metrics and input dtypes."""

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
    ref_dro,
    ref_importance_sampling,
    ref_loss,
    run,
)

from opentinker.rpc.serving.errors import InvalidArgument
from opentinker.trainer_server.losses import LOSS_FNS, compute_loss, required_inputs, resolve_config

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
