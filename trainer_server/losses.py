"""The six Tinker loss functions over one flat vector of target-token logprobs.

The trainer concatenates every datum's positions into one vector of N tokens (no padding) and calls
`compute_loss`. Every reduction is a SUM over tokens, so the loss of a batch equals the sum of the losses
of its parts: batching changes neither the loss nor its gradient.

With p = logprobs under the current policy ([N], requires grad), q = sampler logprobs, A = advantages,
w = weights, r = exp(p - q), clip(x) = clamp(x, lo, hi) and sg = stop-gradient:

    cross_entropy        loss = -sum(w * p)
    importance_sampling  loss = -sum(r * A)
    ppo                  loss = -sum(min(r * A, clip(r) * A))     lo = 0.8, hi = 1.2
    cispo                loss = -sum(sg(clip(r)) * A * p)         lo = 0.0, hi = 4.0
    dro                  loss = -sum(p * A - beta / 2 * (p - q)^2)  beta = 0.05
    stable_reinforce     loss = -sum(sg(min(r, 1)) * A * p) + kl_coeff * sum(w * (r - 1 - (p - q)))   kl_coeff = 0

stable_reinforce is REINFORCE whose per-token weight is the truncated ratio min(r, 1): a token the trainer now
finds likelier than the sampler did is weighted as on-policy, one it finds less likely is weighted down, so no
weight ever exceeds 1 however stale or numerically different the sampler was. The optional penalty is the k3
estimate of KL(sampler || trainer) per sampled token (>= 0, gradient r - 1), which pulls the policy back
towards the one that sampled. It covers the tokens the datum's optional `weights` select (w != 0, each
weighted by w >= 0), whatever their advantage, so a sampled token with A = 0 is regularized too; a datum
without weights gets w = [A != 0] (the trainer cannot tell a sampled token with A = 0 from a prompt position,
whose q is no logprob). q must be the sampler's recorded logprobs, the log-softmax of its raw logits at
temperature 1 (sampler_server/sampling.py); the gateway fills them from what it recorded when sampling ran
with record_stability_info (gateway/tinker/stability.py), never from the client's copy. docs/components.md lists
what this estimator is biased by (temperature and filters, truncation, per-token ratios, the mask).

Gradients w.r.t. p: cross_entropy -w; importance_sampling -A * r; ppo -A * r where the unclipped term is
the minimum, else 0; cispo -sg(clip(r)) * A; dro -(A - beta * (p - q)); stable_reinforce
-[A != 0] * sg(min(r, 1)) * A + kl_coeff * [w != 0] * w * (r - 1).

Masking: a token with w = 0 (cross_entropy) or A = 0 (importance_sampling, ppo, cispo, stable_reinforce's
policy term) contributes exactly 0 to that term and to its gradient whatever its p and q (prompt positions
often carry q = 0); stable_reinforce's penalty is masked by w = 0 alone. A masked ratio is formed from p - q
replaced by 0, so an overflowing exp cannot turn 0 * inf into NaN. dro has no mask: its (p - q)^2 penalty
applies at every position, A = 0 or not.

Metrics are named "name:reduction" and always include "loss:sum". cross_entropy adds "weights:sum";
importance_sampling adds "ratio:mean"; ppo and cispo add "clip_fraction:mean"; stable_reinforce adds
"ratio:mean", "clip_fraction:mean" (tokens with r > 1, whose weight was truncated) and "kl:sum" (the penalty's
sum(w * k3) before kl_coeff). Means run over the active tokens (A != 0) only, so prompt positions do not dilute
them; with no active token ratio:mean is 1.0 and clip_fraction:mean is 0.0. ppo's clip fraction counts tokens
where the clipped term is strictly smaller (A > 0 and r > hi, or A < 0 and r < lo); cispo's counts tokens where
clip(r) != r.

Everything is computed in float32 (lower-precision inputs are upcast), or in float64 when `logprobs` is
float64 (gradient checks); the loss has that dtype.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType

import torch

from opentinker.rpc.serving.errors import InvalidArgument

CLIP_LOW = "clip_low_threshold"
CLIP_HIGH = "clip_high_threshold"
BETA = "beta"
KL_COEFF = "kl_coeff"


@dataclass(frozen=True, slots=True)
class LossSpec:
    name: str
    # Required loss_fn_inputs keys besides target_tokens, e.g. ("weights",).
    inputs: tuple[str, ...]
    # loss_fn_config keys and their defaults.
    defaults: Mapping[str, float]
    # loss_fn_inputs keys a datum may carry; where it does not, default_input gives their values.
    optional: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class LossResult:
    # Scalar, differentiable w.r.t. logprobs.
    loss: torch.Tensor
    # Named "name:reduction"; always includes "loss:sum".
    metrics: dict[str, float]


_PG_INPUTS = ("logprobs", "advantages")


def _spec(
    name: str, inputs: tuple[str, ...], defaults: Mapping[str, float] | None = None, optional: tuple[str, ...] = ()
) -> LossSpec:
    return LossSpec(name=name, inputs=inputs, defaults=MappingProxyType(dict(defaults or {})), optional=optional)


LOSS_FNS: Mapping[str, LossSpec] = MappingProxyType(
    {
        spec.name: spec
        for spec in (
            _spec("cross_entropy", ("weights",)),
            _spec("importance_sampling", _PG_INPUTS),
            _spec("ppo", _PG_INPUTS, {CLIP_LOW: 0.8, CLIP_HIGH: 1.2}),
            _spec("cispo", _PG_INPUTS, {CLIP_LOW: 0.0, CLIP_HIGH: 4.0}),
            _spec("dro", _PG_INPUTS, {BETA: 0.05}),
            _spec("stable_reinforce", _PG_INPUTS, {KL_COEFF: 0.0}, optional=("weights",)),
        )
    }
)


def _lookup(loss_fn: str) -> LossSpec:
    spec = LOSS_FNS.get(loss_fn)
    if spec is None:
        raise InvalidArgument(
            f"unknown loss_fn {loss_fn!r}; known: {', '.join(LOSS_FNS)}",
            reason="UNKNOWN_LOSS_FN",
            loss_fn=loss_fn,
        )
    return spec


def required_inputs(loss_fn: str) -> tuple[str, ...]:
    """The loss_fn_inputs keys every datum must carry for `loss_fn`, "target_tokens" first."""
    return ("target_tokens", *_lookup(loss_fn).inputs)


def optional_inputs(loss_fn: str) -> tuple[str, ...]:
    """The loss_fn_inputs keys a datum may carry for `loss_fn` (default_input fills in the others' values)."""
    return _lookup(loss_fn).optional


def default_input(loss_fn: str, key: str, inputs: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """Optional input `key` ([N]) for tokens whose datum does not carry it, from the required `inputs` ([N] each).

    stable_reinforce's weights select the tokens its KL penalty covers: a datum without them gets [A != 0], the
    only sampled tokens the trainer can tell from prompt positions (whose q is no sampler logprob, often 0)."""
    if (loss_fn, key) != ("stable_reinforce", "weights"):
        raise KeyError(f"{loss_fn} has no optional input {key!r}")
    advantages = inputs["advantages"]
    return (advantages != 0).to(advantages.dtype)


def input_error(loss_fn: str, key: str, values: list[float]) -> str | None:
    """Why a datum's values of optional input `key` are refused, or None."""
    if (loss_fn, key) == ("stable_reinforce", "weights") and any(v < 0 for v in values):
        # k3 >= 0 has no upper bound: a negative weight would make the loss unbounded below
        return "stable_reinforce weights (the KL penalty's per-token weights) must be >= 0"
    return None


def _config_error(loss_fn: str, key: str, message: str) -> InvalidArgument:
    return InvalidArgument(
        f"loss_fn_config for {loss_fn}: {message}", reason="INVALID_LOSS_CONFIG", loss_fn=loss_fn, key=key
    )


def resolve_config(loss_fn: str, config: Mapping[str, float]) -> dict[str, float]:
    """The defaults of `loss_fn` overridden by `config`, validated."""
    spec = _lookup(loss_fn)
    unknown = sorted(set(config) - set(spec.defaults))
    if unknown:
        allowed = ", ".join(sorted(spec.defaults)) or "none"
        raise _config_error(loss_fn, unknown[0], f"unknown key(s) {', '.join(map(repr, unknown))}; allowed: {allowed}")
    resolved = dict(spec.defaults)
    for key, value in config.items():
        number = float(value)
        if not math.isfinite(number):
            raise _config_error(loss_fn, key, f"{key} must be finite, got {value!r}")
        resolved[key] = number
    for key in (CLIP_LOW, CLIP_HIGH, BETA, KL_COEFF):
        if key in resolved and resolved[key] < 0:
            raise _config_error(loss_fn, key, f"{key} must be >= 0, got {resolved[key]!r}")
    if CLIP_LOW in resolved and resolved[CLIP_LOW] > resolved[CLIP_HIGH]:
        raise _config_error(
            loss_fn,
            CLIP_LOW,
            f"{CLIP_LOW} ({resolved[CLIP_LOW]!r}) must be <= {CLIP_HIGH} ({resolved[CLIP_HIGH]!r})",
        )
    return resolved


# --- the losses: p [N] (current policy logprobs), inputs [N] each, resolved config -> (loss, metrics) ---

_Metrics = dict[str, torch.Tensor]
_LossImpl = Callable[[torch.Tensor, Mapping[str, torch.Tensor], Mapping[str, float]], tuple[torch.Tensor, _Metrics]]


def _masked_ratio(p: torch.Tensor, q: torch.Tensor, active: torch.Tensor) -> torch.Tensor:
    # p, q, active: [N] -> r: [N], exactly 1 (and gradient-free) where inactive
    log_ratio = torch.where(active, p - q, torch.zeros_like(p))
    return torch.exp(log_ratio)


def _active_mean(values: torch.Tensor, active: torch.Tensor, empty: float) -> torch.Tensor:
    # values, active: [N] -> scalar mean over active tokens, `empty` if none
    count = active.sum()
    total = torch.where(active, values, torch.zeros_like(values)).sum()
    return torch.where(count > 0, total / count.clamp(min=1), torch.full_like(total, empty))


def _cross_entropy(
    p: torch.Tensor, inputs: Mapping[str, torch.Tensor], config: Mapping[str, float]
) -> tuple[torch.Tensor, _Metrics]:
    w = inputs["weights"]  # [N]
    # where, not w * p: a weight-0 token with p = -inf contributes 0, not NaN
    per_token = torch.where(w != 0, w * p, torch.zeros_like(p))  # [N]
    return -per_token.sum(), {"weights:sum": w.sum()}


def _importance_sampling(
    p: torch.Tensor, inputs: Mapping[str, torch.Tensor], config: Mapping[str, float]
) -> tuple[torch.Tensor, _Metrics]:
    q, a = inputs["logprobs"], inputs["advantages"]  # [N], [N]
    active = a != 0  # [N]
    r = _masked_ratio(p, q, active)  # [N]
    return -(r * a).sum(), {"ratio:mean": _active_mean(r.detach(), active, 1.0)}


def _ppo(
    p: torch.Tensor, inputs: Mapping[str, torch.Tensor], config: Mapping[str, float]
) -> tuple[torch.Tensor, _Metrics]:
    q, a = inputs["logprobs"], inputs["advantages"]  # [N], [N]
    active = a != 0  # [N]
    r = _masked_ratio(p, q, active)  # [N]
    unclipped = r * a  # [N]
    clipped = r.clamp(config[CLIP_LOW], config[CLIP_HIGH]) * a  # [N]
    # clipped < unclipped only where r lies strictly outside [lo, hi], where clamp passes no gradient
    use_clipped = clipped < unclipped  # [N]
    objective = torch.where(use_clipped, clipped, unclipped)  # [N] = min(unclipped, clipped)
    return -objective.sum(), {"clip_fraction:mean": _active_mean(use_clipped.to(p.dtype), active, 0.0)}


def _cispo(
    p: torch.Tensor, inputs: Mapping[str, torch.Tensor], config: Mapping[str, float]
) -> tuple[torch.Tensor, _Metrics]:
    q, a = inputs["logprobs"], inputs["advantages"]  # [N], [N]
    active = a != 0  # [N]
    r = _masked_ratio(p.detach(), q, active)  # [N], no gradient
    clipped = r.clamp(config[CLIP_LOW], config[CLIP_HIGH])  # [N]
    coeff = clipped * a  # [N], exactly 0 where inactive
    per_token = torch.where(active, coeff * p, torch.zeros_like(p))  # [N]
    was_clipped = (clipped != r).to(p.dtype)  # [N]
    return -per_token.sum(), {"clip_fraction:mean": _active_mean(was_clipped, active, 0.0)}


def _dro(
    p: torch.Tensor, inputs: Mapping[str, torch.Tensor], config: Mapping[str, float]
) -> tuple[torch.Tensor, _Metrics]:
    q, a = inputs["logprobs"], inputs["advantages"]  # [N], [N]
    objective = p * a - 0.5 * config[BETA] * (p - q).square()  # [N]
    return -objective.sum(), {}


def _stable_reinforce(
    p: torch.Tensor, inputs: Mapping[str, torch.Tensor], config: Mapping[str, float]
) -> tuple[torch.Tensor, _Metrics]:
    q, a, w = inputs["logprobs"], inputs["advantages"], inputs["weights"]  # [N], [N], [N]
    active = a != 0  # [N]
    r = _masked_ratio(p, q, active)  # [N], exactly 1 where inactive
    weight = r.detach().clamp(max=1.0)  # [N], sg(min(r, 1))
    policy = torch.where(active, weight * a * p, torch.zeros_like(p))  # [N]
    # The penalty has its own mask, w != 0, not A != 0: a sampled token whose advantage is 0 (a group whose
    # rewards are all equal) still drifts from the sampler and is pulled back.
    selected = w != 0  # [N]
    log_ratio = torch.where(selected, p - q, torch.zeros_like(p))  # [N], 0 where unselected: exp cannot overflow
    k3 = log_ratio.exp() - 1.0 - log_ratio  # [N], >= 0
    kl = torch.where(selected, w * k3, torch.zeros_like(p)).sum()
    truncated = (r.detach() > 1.0).to(p.dtype)  # [N]
    metrics = {
        "ratio:mean": _active_mean(r.detach(), active, 1.0),
        "clip_fraction:mean": _active_mean(truncated, active, 0.0),
        "kl:sum": kl.detach(),
    }
    return -policy.sum() + config[KL_COEFF] * kl, metrics


_IMPLS: Mapping[str, _LossImpl] = MappingProxyType(
    {
        "cross_entropy": _cross_entropy,
        "importance_sampling": _importance_sampling,
        "ppo": _ppo,
        "cispo": _cispo,
        "dro": _dro,
        "stable_reinforce": _stable_reinforce,
    }
)


def _datum_error(loss_fn: str, key: str, message: str) -> InvalidArgument:
    return InvalidArgument(f"{loss_fn}: {message}", reason="INVALID_DATUM", loss_fn=loss_fn, key=key)


def compute_loss(
    loss_fn: str, logprobs: torch.Tensor, inputs: Mapping[str, torch.Tensor], config: Mapping[str, float]
) -> LossResult:
    """The summed loss of `loss_fn` over N tokens and its metrics.

    logprobs: [N] target-token logprobs under the current policy. inputs: the loss's required inputs and any of
    its optional ones, each [N] (other keys, e.g. target_tokens, are ignored; a missing optional one takes
    default_input). config: loss_fn_config, resolved against the defaults.
    INVALID_DATUM when an input is missing or not shaped [N]; see `resolve_config` for config errors.
    """
    spec = _lookup(loss_fn)
    resolved = resolve_config(loss_fn, config)
    if logprobs.dim() != 1:
        raise _datum_error(loss_fn, "logprobs", f"logprobs must be 1-D [N], got {list(logprobs.shape)}")
    dtype = torch.promote_types(logprobs.dtype, torch.float32)
    p = logprobs.to(dtype)  # [N]
    cast: dict[str, torch.Tensor] = {}
    for key in spec.inputs:
        tensor = inputs.get(key)
        if tensor is None:
            raise _datum_error(loss_fn, key, f"missing loss_fn_inputs {key!r}")
        if tensor.shape != p.shape:
            raise _datum_error(loss_fn, key, f"{key} has shape {list(tensor.shape)}, logprobs has {list(p.shape)}")
        cast[key] = tensor.detach().to(device=p.device, dtype=dtype)  # [N]
    for key in spec.optional:
        tensor = inputs.get(key)
        if tensor is None:
            cast[key] = default_input(loss_fn, key, cast)
        elif tensor.shape != p.shape:
            raise _datum_error(loss_fn, key, f"{key} has shape {list(tensor.shape)}, logprobs has {list(p.shape)}")
        else:
            cast[key] = tensor.detach().to(device=p.device, dtype=dtype)  # [N]
    loss, extra = _IMPLS[loss_fn](p, cast, resolved)
    named = {"loss:sum": loss.detach(), **extra}
    values = torch.stack([value.to(dtype) for value in named.values()]).tolist()  # one device sync
    return LossResult(loss=loss, metrics=dict(zip(named, values, strict=True)))
