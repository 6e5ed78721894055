"""One AdamW step over an adapter's accumulated gradients: clip, step, check the weights' magnitudes (undone
bitwise when they break the rule, step_guard.py), then move the pending batches into the ledger."""

from __future__ import annotations

import torch

from opentinker.rpc.serving.errors import FailedPrecondition
from opentinker.trainer_server.adapter import AdapterState
from opentinker.trainer_server.adapter_config import AdamParams
from opentinker.trainer_server.step_guard import check_weights, mark_step, undo_step


def optim_step(state: AdapterState, adam: AdamParams | None) -> tuple[int, dict[str, float]]:
    """The adapter's new step and the step's metrics; adam: the request's own (checked by the service), else
    the adapter's."""
    params = adam if adam is not None else state.adam
    if not state.ledger.pending or not state.has_gradients():
        raise FailedPrecondition(
            f"no gradients accumulated for {state.name!r} since its last optim_step: call forward_backward first",
            reason="NO_GRADIENTS",
            adapter=state.name,
        )
    mark = mark_step(state)  # before clipping, which scales the gradients in place
    grads = [p.grad for p in state.params if p.grad is not None]
    grad_norm = float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])))
    if params.grad_clip_norm > 0:
        torch.nn.utils.clip_grad_norm_(state.params, params.grad_clip_norm)
    for group in state.optimizer.param_groups:
        group.update(
            lr=params.learning_rate,
            betas=(params.beta1, params.beta2),
            eps=params.eps,
            weight_decay=params.weight_decay,
        )
    what = f"OptimStep (learning_rate {params.learning_rate:g}) was undone"
    try:
        try:
            state.optimizer.step()
        except RuntimeError as exc:  # e.g. "value cannot be converted to type float without overflow"
            if "overflow" not in str(exc):
                raise
            raise FailedPrecondition(
                f"{what}: the update overflows ({exc})", reason="WEIGHTS_OUT_OF_RANGE", adapter=state.name
            ) from None
        check_weights(state, what)
    except BaseException:
        undo_step(state, mark)  # weights, gradients, moments and hyperparameters as before the call
        raise
    del mark
    state.optimizer.zero_grad(set_to_none=True)
    state.step += 1
    for record in state.ledger.pending:
        state.ledger.tokens_trained += record.num_tokens
        state.ledger.datums_trained += record.num_datums
    state.ledger.batches.extend(state.ledger.pending)
    state.ledger.pending.clear()
    return state.step, {"grad_norm:value": grad_norm, "learning_rate:value": params.learning_rate}
