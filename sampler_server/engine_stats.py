"""`EngineStats`: the engine's counters (tokens, steps, prompt tokens by where their K/V came from, KV blocks),
plain values so that the engine process can send them with each report."""

from __future__ import annotations

from dataclasses import dataclass, field

from opentinker.sampler_server.tenant_stats import RATE_WINDOW, tokens_per_second


@dataclass(slots=True)
class EngineStats:
    tokens_generated: int = 0
    steps: int = 0
    prompt_tokens_computed: int = 0  # prompt tokens run through a prefill forward
    prompt_tokens_shared: int = 0  # prompt tokens whose K/V a sample copied from another sample of its request
    prompt_tokens_cached: int = 0  # prompt tokens whose K/V were found in the prefix cache
    recent: list[tuple[float, int]] = field(default_factory=list)  # (time, tokens) of recent decode steps
    non_finite_failures: int = 0  # requests ended because their adapter made their logits non-finite
    blocks_total: int = 0  # KV-cache blocks sequences may hold
    block_size: int = 0  # tokens per block
    blocks_used: int = 0  # held by at least one sequence
    preemptions: int = 0  # running sequences sent back to the queue for want of blocks
    blocks_cached: int = 0  # full blocks in the prefix cache (held or idle)
    blocks_evicted: int = 0  # idle cached blocks taken for new tokens

    def tokens_per_second(self, window: float = RATE_WINDOW) -> float:
        return tokens_per_second(self.recent, window)
