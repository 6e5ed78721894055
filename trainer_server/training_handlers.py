"""TrainerService handlers for training: ForwardBackward and Forward (datums converted to records and validated
into a batch, run as micro-batches on the adapter's lane) and OptimStep."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable
from typing import Any

from opentinker.rpc.serving.errors import ResourceExhausted
from opentinker.trainer_server.adapter_config import check_adam
from opentinker.trainer_server.admission import queued
from opentinker.trainer_server.batch import Batch, build_batch, split_batch
from opentinker.trainer_server.forward_backward import GradientMark, StepOutput
from opentinker.trainer_server.handler_base import Context
from opentinker.trainer_server.losses import resolve_config
from opentinker.trainer_server.micro_batch import merge_outputs, release_after
from opentinker.trainer_server.pool_handlers import PoolHandlers
from opentinker.trainer_server.wire import adam_of, datums_of, loss_outputs
from opentinker.v1 import common_pb2, trainer_pb2


class TrainingHandlers(PoolHandlers):
    def _batch(self, datums: Iterable[common_pb2.Datum], loss_fn: str, config: dict[str, float]) -> Batch:
        base = self.trainer.base
        batch = build_batch(
            datums_of(datums),
            loss_fn,
            vocab_size=base.vocab_size,
            max_positions=base.max_positions,
            pad_id=self.trainer.pad_id,
            max_batch_positions=self.max_batch_positions,
        )
        if batch.num_tokens > self.max_batch_tokens:
            raise ResourceExhausted(
                f"batch has {batch.num_tokens} tokens; the limit is {self.max_batch_tokens}",
                reason="BATCH_TOO_LARGE",
                field="datums",
            )
        return batch

    @queued
    async def ForwardBackward(self, request: trainer_pb2.ForwardBackwardRequest, context: Context) -> Any:
        name = request.adapter
        epoch = await self._training(name)  # 0: not a pool adapter
        config = resolve_config(request.loss_fn, dict(request.loss_fn_config))
        batch = await asyncio.to_thread(self._batch, request.datums, request.loss_fn, config)
        trace_ids = list(request.trace_ids)
        saved = await self._autosave_if_due(name, epoch)

        parts = split_batch(batch, self.micro_batch_positions)

        # One micro-batch per turn of the lane; the first takes the undo mark, the last records the request's batch
        # in the ledger and reads the step (in the adapter's lane: after the reply, a pipelined OptimStep may run).
        def part(index: int) -> Callable[[], tuple[GradientMark | None, StepOutput, int]]:
            def run() -> tuple[GradientMark | None, StepOutput, int]:
                if index == 0:
                    self.pool.check(name)  # still this trainer's, now that its turn came
                mark = self.trainer.gradient_mark(name) if index == 0 else None
                output = self.trainer.accumulate(name, parts[index], request.loss_fn, config)
                release_after(parts[index])
                if index < len(parts) - 1:
                    return mark, output, 0
                self.trainer.record_batch(name, batch, request.loss_fn, trace_ids)
                return mark, output, self.trainer.get(name).step + 1

            return run

        def undo(done: list[tuple[GradientMark | None, StepOutput, int]]) -> None:
            mark = done[0][0]
            assert mark is not None
            self.trainer.undo_forward_backward(name, mark)

        done = await self.scheduler.run_parts(name, [part(i) for i in range(len(parts))], undo=undo)
        result, step = merge_outputs(parts, [output for _, output, _ in done]), done[-1][2]
        return trainer_pb2.ForwardBackwardResponse(
            loss_fn_outputs=loss_outputs(result),
            metrics=result.metrics,
            batch_digest=batch.digest,
            step=step,
            saved_state_id=saved,
        )

    @queued
    async def Forward(self, request: trainer_pb2.ForwardRequest, context: Context) -> Any:
        name = self._known(request.adapter)
        loss_fn = request.loss_fn or "cross_entropy"
        config = resolve_config(loss_fn, dict(request.loss_fn_config))
        batch = await asyncio.to_thread(self._batch, request.datums, loss_fn, config)
        parts = split_batch(batch, self.micro_batch_positions)

        def part(index: int) -> Callable[[], StepOutput]:
            def run() -> StepOutput:
                output = self.trainer.forward(name, parts[index], loss_fn, config)
                release_after(parts[index])
                return output

            return run

        outputs = await self.scheduler.run_parts(name, [part(i) for i in range(len(parts))])
        result = merge_outputs(parts, outputs)
        return trainer_pb2.ForwardResponse(loss_fn_outputs=loss_outputs(result), metrics=result.metrics)

    @queued
    async def OptimStep(self, request: trainer_pb2.OptimStepRequest, context: Context) -> Any:
        name = request.adapter
        await self._training(name)
        adam = adam_of(request.adam_params) if request.HasField("adam_params") else None
        if adam is not None:
            check_adam(adam)

        def step_once() -> tuple[int, dict[str, float]]:
            self.pool.check(name)
            return self.trainer.optim_step(name, adam)

        step, metrics = await self.scheduler.run(name, step_once)
        return trainer_pb2.OptimStepResponse(step=step, metrics=metrics)
