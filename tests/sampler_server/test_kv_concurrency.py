"""The paged KV cache's memory figure: in the KV budget of the slot design it replaced (max_seqs slots of
max_len tokens), the real BlockManager and Scheduler hold at least 3x as many sequences of Zipf-distributed
lengths up to the context at once. A count, not a timing (bench/kv_concurrency.py; prefix_cache.py prints it)."""

from __future__ import annotations

import sys

from serverproc import ROOT

sys.path.insert(0, str(ROOT / "bench"))

import kv_concurrency


def test_the_paged_cache_holds_at_least_3x_the_slot_designs_sequences() -> None:
    for max_seqs, max_len, seed in ((16, 4096, 0), (8, 2048, 1), (32, 8192, 2)):
        result = kv_concurrency.measure(max_seqs=max_seqs, max_len=max_len, seed=seed)
        print(kv_concurrency.report(result))
        assert result.ratio >= 3, kv_concurrency.report(result)
        # Every admitted sequence holds exactly its own blocks, and the pool is full up to the next one's need.
        assert result.blocks_used <= result.blocks_total
        assert result.blocks_used > result.blocks_total - max_len // 16


def test_uniform_full_length_sequences_gain_nothing() -> None:
    # The contrast that makes the figure able to fail: sequences that all fill the context fit no better paged.
    lengths = kv_concurrency.zipf_lengths(64, 2048, exponent=60.0, unit=2047)
    assert set(lengths) == {2047}
    result = kv_concurrency.measure(max_seqs=8, max_len=2048, lengths=lengths)
    assert result.paged_sequences == result.slot_sequences == 8
