"""Trainer gauges for Prometheus, read from the trainer's adapter table at scrape time."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Protocol

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from opentinker.weights.artifact_bucket import Bucket, store_metrics


class _Adapter(Protocol):
    @property
    def resident(self) -> bool: ...

    @property
    def num_parameters(self) -> int: ...


class _Trainer(Protocol):
    @property
    def adapters(self) -> Mapping[str, _Adapter]: ...

    @property
    def bucket(self) -> Bucket | None: ...


class _Scheduler(Protocol):
    @property
    def queued(self) -> int: ...

    @property
    def running(self) -> int: ...


class TrainerCollector(Collector):
    def __init__(self, trainer: _Trainer, scheduler: _Scheduler) -> None:
        self.trainer = trainer
        self.scheduler = scheduler

    def collect(self) -> Iterator[Metric]:
        adapters = list(self.trainer.adapters.values())  # one C-level copy: safe against concurrent inserts
        count = GaugeMetricFamily(
            "opentinker_trainer_adapters", "Adapters held, by residency on the device", labels=["residency"]
        )
        count.add_metric(["resident"], sum(1 for a in adapters if a.resident))
        count.add_metric(["offloaded"], sum(1 for a in adapters if not a.resident))
        yield count
        yield GaugeMetricFamily(
            "opentinker_trainer_lora_parameters",
            "LoRA parameters of all adapters held",
            value=sum(a.num_parameters for a in adapters),
        )
        jobs = GaugeMetricFamily(
            "opentinker_trainer_jobs", "Requests on the compute thread or waiting for it", labels=["state"]
        )
        jobs.add_metric(["running"], self.scheduler.running)
        jobs.add_metric(["queued"], self.scheduler.queued)
        yield jobs
        yield from store_metrics("trainer", self.trainer.bucket)
