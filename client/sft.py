"""Supervised fine-tuning on the SDK: cross-entropy steps over conversations (rendered by a Renderer) or
ready-made datums, a snapshot at the end (and every ``save_every`` steps)."""

from __future__ import annotations

import random
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, cast

from rich.progress import Progress

from opentinker.client.datum import Datum
from opentinker.client.progress import append_jsonl, progress_display
from opentinker.client.renderer import Renderer, TrainOn
from opentinker.client.service_client import ServiceClient
from opentinker.client.training_client import TrainingClient
from opentinker.client.training_types import AdamParams, LoraConfig

__all__ = ["Conversation", "SFTStepMetrics", "train_sft"]

Conversation = Sequence[Mapping[str, str]]


@dataclass(frozen=True, slots=True)
class SFTStepMetrics:
    """One supervised step: ``loss`` is the mean cross-entropy per trained token ("loss:sum" / "weights:sum"),
    ``loss_sum`` the batch's summed loss; ``version_saved`` the version saved after this step (0: none)."""

    step: int
    epoch: int
    loss: float
    loss_sum: float
    num_datums: int
    num_tokens: float
    version_saved: int
    seconds: float
    adapter: str = ""
    trace_ids: tuple[str, ...] = field(default=(), repr=False)

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        del out["trace_ids"]
        return out


def _sft_datums(
    data: Sequence[Conversation] | Sequence[Datum], renderer: Renderer | None, train_on: TrainOn
) -> list[Datum]:
    datums: list[Datum] = []
    for i, item in enumerate(data):
        if isinstance(item, Datum):
            datums.append(item)
            continue
        if renderer is None:
            raise ValueError(f"data[{i}] is a conversation: pass renderer= to render it")
        datums.append(renderer.sft_datum(cast("Conversation", item), train_on))
    return datums


def _batches(count: int, batch_size: int, steps: int | None, epochs: int, seed: int) -> list[tuple[int, list[int]]]:
    """(epoch, datum indices) per step: each epoch a fresh shuffle cut into batches of ``batch_size``."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be at least 1, got {batch_size}")
    if steps is None and epochs < 1:
        raise ValueError(f"epochs must be at least 1, got {epochs}")
    if steps is not None and steps < 1:
        raise ValueError(f"steps must be at least 1, got {steps}")
    plan: list[tuple[int, list[int]]] = []
    epoch = 0
    while (steps is None and epoch < epochs) or (steps is not None and len(plan) < steps):
        order = list(range(count))
        random.Random(seed + epoch).shuffle(order)
        for start in range(0, count, batch_size):
            plan.append((epoch + 1, order[start : start + batch_size]))
        epoch += 1
    return plan if steps is None else plan[:steps]


def train_sft(
    service: ServiceClient,
    adapter: str,
    data: Sequence[Conversation] | Sequence[Datum],
    *,
    steps: int | None = None,
    epochs: int = 1,
    batch_size: int = 8,
    adam: AdamParams | None = None,
    lora: LoraConfig | None = None,
    renderer: Renderer | None = None,
    train_on: TrainOn = "all_assistant",
    save_every: int = 0,
    seed: int = 0,
    training_client: TrainingClient | None = None,
    metrics_path: Path | str | None = None,
    progress: bool | Progress = False,
    run_id: str | None = None,
) -> list[SFTStepMetrics]:
    """Supervised fine-tuning (cross_entropy) of ``adapter`` on ``data``: chat conversations (rendered with
    ``renderer``, weights per ``train_on``) or Datums. ``epochs`` passes over the data in shuffled batches of
    ``batch_size``, or exactly ``steps`` steps when given (the data repeats as needed). Saves a snapshot every
    ``save_every`` steps (0: never) and after the last step. Creates the adapter (``lora``, ``seed``) unless
    ``training_client`` is given. Trace ids: ``{adapter}:{run_id}:sft:{index of the example}``."""
    datums = _sft_datums(data, renderer, train_on)
    if not datums:
        raise ValueError("no training data")
    plan = _batches(len(datums), batch_size, steps, epochs, seed)
    training = training_client or service.create_training_client(adapter, lora, seed=seed)
    run_id = run_id or uuid.uuid4().hex[:8]
    path = Path(metrics_path) if metrics_path is not None else None
    history: list[SFTStepMetrics] = []
    with progress_display(progress) as display:
        task = display.add_task(f"sft {training.adapter}", total=len(plan), info="") if display else None
        started = time.perf_counter()
        for step, (epoch, indices) in enumerate(plan, start=1):
            trace_ids = [f"{training.adapter}:{run_id}:sft:{i}" for i in indices]
            output = training.forward_backward([datums[i] for i in indices], "cross_entropy", trace_ids=trace_ids)
            training.optim_step(adam)
            saved = 0
            if step == len(plan) or (save_every > 0 and step % save_every == 0):
                saved = training.save_snapshot(metrics={"loss": output.loss}).number
            tokens = output.metrics.get("weights:sum", 0.0)
            now = time.perf_counter()
            metrics = SFTStepMetrics(
                step=step,
                epoch=epoch,
                loss=output.loss / tokens if tokens > 0 else 0.0,
                loss_sum=output.loss,
                num_datums=len(indices),
                num_tokens=tokens,
                version_saved=saved,
                seconds=now - started,
                adapter=training.adapter,
                trace_ids=tuple(trace_ids),
            )
            started = now
            history.append(metrics)
            append_jsonl(path, metrics.as_dict())
            if display is not None and task is not None:
                display.update(task, advance=1, info=f"loss {metrics.loss:.3f}")
    return history
