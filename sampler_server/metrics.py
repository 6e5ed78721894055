"""Sampler gauges and counters for Prometheus, read from the engine at scrape time (no bookkeeping on the
decode path): queue depth and slot use are what a load balancer or autoscaler in front of samplers needs."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from opentinker.sampler_server.engine_api import EngineAPI
from opentinker.weights.artifact_bucket import Bucket, store_metrics


class _Pool(Protocol):
    @property
    def capacity(self) -> int: ...

    def used(self) -> int: ...


class _Loader(Protocol):
    @property
    def pool(self) -> _Pool: ...

    @property
    def loads(self) -> int: ...

    @property
    def load_failures(self) -> int: ...

    @property
    def bucket(self) -> Bucket | None: ...


class SamplerCollector(Collector):
    def __init__(self, engine: EngineAPI, loader: _Loader) -> None:
        self.engine = engine
        self.pool = loader.pool
        self.loader = loader

    def collect(self) -> Iterator[Metric]:
        engine = self.engine
        yield GaugeMetricFamily(
            "opentinker_sampler_running_sequences", "Sequences being decoded now", value=engine.num_running
        )
        yield GaugeMetricFamily(
            "opentinker_sampler_waiting_sequences", "Sequences queued for admission", value=engine.num_waiting
        )
        yield GaugeMetricFamily(
            "opentinker_sampler_slots_used", "Adapter slots holding a version", value=self.pool.used()
        )
        yield GaugeMetricFamily(
            "opentinker_sampler_slots_total", "Adapter slots (--max-slots)", value=self.pool.capacity
        )
        yield CounterMetricFamily(
            "opentinker_sampler_tokens_generated", "Tokens sampled since start", value=engine.stats.tokens_generated
        )
        prompt = CounterMetricFamily(
            "opentinker_sampler_prompt_tokens",
            "Prompt tokens prefilled, by where their K/V came from",
            labels=["source"],
        )
        prompt.add_metric(["computed"], engine.stats.prompt_tokens_computed)
        prompt.add_metric(["cached"], engine.stats.prompt_tokens_cached)
        prompt.add_metric(["shared"], engine.stats.prompt_tokens_shared)
        yield prompt
        stats = engine.stats
        blocks = GaugeMetricFamily(
            "opentinker_sampler_kv_blocks",
            "KV-cache blocks: free, used (held by a sequence), cached (holding a prefix-cache block, held or idle)",
            labels=["state"],
        )
        blocks.add_metric(["free"], stats.blocks_total - stats.blocks_used)
        blocks.add_metric(["used"], stats.blocks_used)
        blocks.add_metric(["cached"], stats.blocks_cached)
        yield blocks
        looked_up = stats.prompt_tokens_cached + stats.prompt_tokens_computed
        yield GaugeMetricFamily(
            "opentinker_sampler_prefix_cache_hit_ratio",
            "Of the prompt tokens that needed "
            "K/V since start (cached or computed), the fraction found in the prefix cache",
            value=stats.prompt_tokens_cached / looked_up if looked_up else 0.0,
        )
        yield CounterMetricFamily(
            "opentinker_sampler_kv_blocks_evicted",
            "Idle prefix-cache blocks evicted (LRU) for new tokens",
            value=stats.blocks_evicted,
        )
        yield CounterMetricFamily(
            "opentinker_sampler_preemptions",
            "Running sequences sent back to the queue to recompute later because the KV-cache blocks ran out",
            value=stats.preemptions,
        )
        yield CounterMetricFamily(
            "opentinker_sampler_non_finite_requests",
            "Requests ended (FAILED_PRECONDITION NON_FINITE_OUTPUT) because their adapter made their logits inf or NaN",
            value=engine.stats.non_finite_failures,
        )
        loads = CounterMetricFamily(
            "opentinker_sampler_adapter_loads", "Adapter versions loaded into a slot", labels=["result"]
        )
        loads.add_metric(["ok"], self.loader.loads)
        loads.add_metric(["failed"], self.loader.load_failures)
        yield loads
        yield from store_metrics("sampler", self.loader.bucket)
