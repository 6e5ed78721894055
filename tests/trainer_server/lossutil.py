"""Per-token reference losses and small helpers shared by the loss function tests."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

import pytest
import torch

from opentinker.trainer_server.losses import compute_loss

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
