"""A big request as micro-batches: the parts run as separate turns of the compute lane (other adapters' jobs run
between them), their gradients accumulate in the adapter's buffers, and their outputs merge into the one
answer of the request (batch.py split_batch: each part is what a request of its datums would compute)."""

from __future__ import annotations

from collections.abc import Sequence

from opentinker.rpc.process.memory import release_freed_memory
from opentinker.trainer_server.batch import Batch, active_tokens
from opentinker.trainer_server.forward_backward import StepOutput

# Padded positions per micro-batch by default: a request beyond runs in parts, so the compute thread is never
# held by one request for more than about this much work (a cookbook 64 x 2048 batch: 32 parts). 4096, not 16384:
# bench/micro_batch_cost.py on the quick model (CPU) found no throughput cost (a dense 8 x 2,047 batch 0.91x the
# time of one 16,384-position part) and a 4x shorter hold of the thread (0.94 s instead of 3.9 s).
DEFAULT_MICRO_BATCH_POSITIONS = 1 << 12
# After a (micro-)batch this big, freed activations are handed back to the OS (malloc_trim): glibc keeps the
# compute thread's heap at its high-water mark otherwise (tests/reliability/test_noisy_trainer.py: +190 MiB kept
# after 12,000 padded positions on the tiny model, none after the trim). Smaller ones are not worth the walk.
TRIM_POSITIONS = 1 << 10


def release_after(batch: Batch) -> None:
    if batch.padded_positions >= TRIM_POSITIONS:
        release_freed_memory()


def merge_outputs(parts: Sequence[Batch], outputs: Sequence[StepOutput]) -> StepOutput:
    """The request's answer: logprobs in datum order; ":sum" metrics added; ":mean" metrics weighted by each
    part's active tokens (the loss's own default when no part has any)."""
    logprobs = [row for output in outputs for row in output.logprobs]
    metrics: dict[str, float] = {}
    weights = [active_tokens(part) for part in parts]
    for key in outputs[0].metrics:
        values = [output.metrics[key] for output in outputs]
        if key.endswith(":mean"):
            total = sum(weights)
            metrics[key] = sum(v * w for v, w in zip(values, weights, strict=True)) / total if total else values[0]
        else:
            metrics[key] = sum(values)
    return StepOutput(logprobs, metrics)
