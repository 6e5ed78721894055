"""The defaults of the scheduler's and the service's per-tenant bounds (seats, queued samples, KV blocks) and of
the prompt tokens a tenant computes beside other tenants' decodes: the sampler's flags' defaults, from its size
and device (build.py)."""

from __future__ import annotations


def default_tenant_slots(max_seqs: int) -> int:
    """--max-seqs-per-tenant's default: 3/4 of the batch (at least 1), so a quarter is always left to others."""
    return max(1, max_seqs * 3 // 4)


def default_tenant_queue(max_waiting: int) -> int:
    """--max-queued-per-tenant's default: 3/4 of --max-waiting (at least 1). Equal to it, one tenant's flood would
    fill the sampler's whole waiting queue and every other tenant's Sample would be refused QUEUE_FULL."""
    return max(1, max_waiting * 3 // 4)


def default_tenant_blocks(num_blocks: int) -> int:
    """--max-kv-blocks-per-tenant's default: 3/4 of the pool (at least 1), as the seat cap's."""
    return max(1, num_blocks * 3 // 4)


def default_mixed_prefill_tokens(device_type: str) -> int:
    """--mixed-prefill-tokens' default. On the CPU a step's time grows with its tokens from the first one, a prompt
    token costing about what a decode row does (a step ~34 ms + ~2.7 ms per prompt token on the benchmark model):
    a 512-token chunk of one tenant's prompts made each of another tenant's decode steps 40x slower. Measured with
    bench/noisy_neighbours.py's logprobs flood, team-b's p99 during / alone: 6.7x at 32 tokens, 4.0x at 16, 3.6x
    at 8 (so what is left at 16 is mostly not the step's prompt tokens). At 16 a long prompt still prefills beside
    other tenants' decodes at ~60% of its unbounded rate, a step's fixed cost being shared by fewer tokens. On
    CUDA a step of a few hundred tokens costs little more than a decode step (the weights are read once either
    way): 0, the step's budget only."""
    return 16 if device_type == "cpu" else 0
