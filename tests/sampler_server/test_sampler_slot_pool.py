"""SlotPool in isolation: reserve/fill/lookup, mixed ranks zero-padded, LRU eviction of idle slots only, pins and
references that block eviction (NO_FREE_SLOT), unload while in use, slot 0 no-ops, scaling zeroed on free."""

from __future__ import annotations

import json
import os

import pytest
import torch

from opentinker.rpc.serving.errors import ResourceExhausted
from opentinker.sampler_server.slot_pool import SlotPool, VersionKey

SHAPES = {"layers.0.q_proj": (8, 6), "layers.0.down_proj": (5, 8)}  # module: (d_in, d_out)
MAX_RANK = 4


def make_pool(max_slots: int = 3) -> SlotPool:
    return SlotPool(SHAPES, max_slots=max_slots, max_rank=MAX_RANK, device=torch.device("cpu"))


def weights(rank: int, seed: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    return {
        m: (torch.randn(rank, d_in, generator=generator), torch.randn(d_out, rank, generator=generator))
        for m, (d_in, d_out) in SHAPES.items()
    }


def load(pool: SlotPool, key: VersionKey, rank: int = 2, scaling: float = 2.0) -> int:
    index = pool.reserve(key)
    pool.fill(index, weights(rank, seed=hash(key) % 1000), rank=rank, scaling=scaling, artifact_sha256=f"sha-{key}")
    return index


def test_reserve_fill_lookup() -> None:
    pool = make_pool()
    assert pool.capacity == 3 and pool.used() == 0
    index = pool.reserve(("a", 1))
    assert index != 0
    assert pool.lookup(("a", 1)) is None  # reserved but still loading: invisible
    assert pool.used() == 1
    w = weights(2, seed=1)
    pool.fill(index, w, rank=2, scaling=4.0, artifact_sha256="abc")
    assert pool.lookup(("a", 1)) == index
    assert pool.lookup(("a", 2)) is None  # a version is its own key: no stale reuse across versions
    slot = pool.slots[index]
    assert (slot.rank, slot.scaling, slot.artifact_sha256, slot.loading) == (2, 4.0, "abc", False)
    assert float(pool.scaling[index]) == 4.0
    for module, (a, b) in w.items():
        assert torch.equal(pool.a[module][index, :2], a)
        assert torch.equal(pool.b[module][index, :, :2], b)
    assert pool.ranks() == [s.rank for s in pool.slots]


def test_different_ranks_coexist_zero_padded() -> None:
    pool = make_pool()
    low = pool.reserve(("low", 1))
    pool.fill(low, weights(1, seed=2), rank=1, scaling=1.0, artifact_sha256="")
    full = pool.reserve(("full", 1))
    w_full = weights(MAX_RANK, seed=3)
    pool.fill(full, w_full, rank=MAX_RANK, scaling=0.5, artifact_sha256="")
    # Refill the max-rank slot's neighbour with garbage first, then the low-rank one: padding must be zeros.
    garbage = pool.reserve(("garbage", 1))
    pool.fill(garbage, weights(MAX_RANK, seed=4), rank=MAX_RANK, scaling=1.0, artifact_sha256="")
    assert pool.unload(("garbage", 1)) is True
    again = pool.reserve(("low", 2))
    assert again == garbage  # the freed slot is reused
    w_low = weights(1, seed=5)
    pool.fill(again, w_low, rank=1, scaling=1.0, artifact_sha256="")
    assert pool.ranks()[low] == 1 and pool.ranks()[full] == MAX_RANK and pool.ranks()[again] == 1
    for module, (a, b) in w_low.items():
        assert torch.equal(pool.a[module][again, :1], a)
        assert torch.equal(pool.b[module][again, :, :1], b)
        assert not pool.a[module][again, 1:].any()  # stale rows of the previous occupant are gone
        assert not pool.b[module][again, :, 1:].any()
        assert torch.equal(pool.a[module][full], w_full[module][0])
    assert not any(t[0].any() for t in pool.a.values()) and float(pool.scaling[0]) == 0.0  # slot 0 stays zero


def test_lru_eviction_of_idle_slots() -> None:
    pool = make_pool(max_slots=3)
    first, second, third = load(pool, ("a", 1)), load(pool, ("b", 1)), load(pool, ("c", 1))
    # Use them in the order a, c, b (acquire+release touches last_used): a is now least recently used.
    for index in (first, third, second):
        pool.acquire(index)
        pool.release(index)
    pool.acquire(first)
    pool.release(first)  # now c is the least recently used
    index = pool.reserve(("d", 1))
    assert index == third and pool.evictions == 1
    assert pool.lookup(("c", 1)) is None
    assert pool.lookup(("a", 1)) == first and pool.lookup(("b", 1)) == second


def test_pinned_and_in_use_slots_are_never_evicted() -> None:
    pool = make_pool(max_slots=3)
    pinned, busy, idle = load(pool, ("pinned", 1)), load(pool, ("busy", 1)), load(pool, ("idle", 1))
    pool.set_pinned(pinned, True)
    pool.acquire(busy)
    # Make the idle slot the most recently used one: it is still the only candidate.
    pool.acquire(idle)
    pool.release(idle)
    assert pool.reserve(("new", 1)) == idle
    pool.abandon(idle)  # load failed: back to free, nothing visible
    assert pool.lookup(("new", 1)) is None and pool.lookup(("idle", 1)) is None
    loaded = load(pool, ("new", 1))
    pool.acquire(loaded)
    with pytest.raises(ResourceExhausted) as caught:
        pool.reserve(("one-more", 1))
    assert caught.value.reason == "NO_FREE_SLOT"
    # Nothing changed: the pinned and busy versions are still served.
    assert pool.lookup(("pinned", 1)) == pinned and pool.lookup(("busy", 1)) == busy
    assert pool.lookup(("new", 1)) == loaded
    # A slot being loaded is not evictable either.
    pool.release(loaded)
    reserved = pool.reserve(("loading", 1))
    assert reserved == loaded
    with pytest.raises(ResourceExhausted):
        pool.reserve(("another", 1))
    # Releasing the busy slot makes it the candidate.
    pool.release(busy)
    assert pool.reserve(("another", 1)) == busy
    assert pool.lookup(("pinned", 1)) == pinned


def test_unload_while_in_use_frees_at_last_release() -> None:
    pool = make_pool()
    index = load(pool, ("a", 1))
    pool.acquire(index)
    pool.acquire(index)
    assert pool.unload(("a", 1)) is False
    assert pool.lookup(("a", 1)) is None  # new requests do not pick a retiring version
    assert pool.slots[index].key == ("a", 1) and float(pool.scaling[index]) != 0.0  # running requests keep it
    pool.release(index)
    assert pool.slots[index].key == ("a", 1)
    pool.release(index)
    assert pool.slots[index].key is None and pool.used() == 0
    assert pool.unload(("a", 1)) is None
    assert pool.unload(("never", 1)) is None


def test_reload_while_old_slot_retires() -> None:
    """Same key loaded again while its old slot drains: the new slot serves; the old one's free keeps it."""
    pool = make_pool()
    old = load(pool, ("a", 1))
    pool.acquire(old)
    assert pool.unload(("a", 1)) is False
    new = load(pool, ("a", 1))
    assert new != old and pool.lookup(("a", 1)) == new
    pool.release(old)
    assert pool.slots[old].key is None
    assert pool.lookup(("a", 1)) == new


def test_slot_zero_acquire_release_are_no_ops() -> None:
    pool = make_pool()
    for _ in range(3):
        pool.acquire(0)
    pool.release(0)
    pool.release(0)
    pool.release(0)
    pool.release(0)  # more releases than acquires: still nothing
    assert pool.slots[0].refs == 0 and pool.total_refs() == 0
    assert pool.slots[0].key is None and float(pool.scaling[0]) == 0.0


def test_scaling_zeroed_on_free() -> None:
    pool = make_pool()
    index = load(pool, ("a", 1), scaling=3.0)
    assert float(pool.scaling[index]) == 3.0
    assert pool.unload(("a", 1)) is True
    assert float(pool.scaling[index]) == 0.0 and pool.slots[index].scaling == 0.0
    busy = load(pool, ("b", 1), scaling=5.0)
    pool.acquire(busy)
    pool.unload(("b", 1))
    assert float(pool.scaling[busy]) == 5.0
    pool.release(busy)
    assert float(pool.scaling[busy]) == 0.0
    # A reserved slot has scaling 0 until it is filled, and again after an abandoned load.
    reserved = pool.reserve(("d", 1))
    assert float(pool.scaling[reserved]) == 0.0
    pool.abandon(reserved)
    assert float(pool.scaling[reserved]) == 0.0
    # An evicted slot's scaling is zeroed as soon as it is reserved for the next version.
    full = [load(pool, (f"e{i}", 1), scaling=7.0) for i in range(pool.capacity)]
    evicted = pool.reserve(("f", 1))
    assert evicted == full[0] and float(pool.scaling[evicted]) == 0.0


def test_over_release_is_caught() -> None:
    pool = make_pool()
    index = load(pool, ("a", 1))
    pool.acquire(index)
    pool.release(index)
    with pytest.raises(AssertionError):
        pool.release(index)


def test_evicting_a_duplicate_keeps_the_served_copy() -> None:
    """Two loads of one key (the first one's request was cancelled mid-copy): evicting the stale copy must not
    drop the lookup entry of the copy that serves."""
    pool = make_pool(max_slots=3)
    stale = pool.reserve(("a", 1))
    fresh = pool.reserve(("a", 1))
    pool.fill(fresh, weights(2, seed=1), rank=2, scaling=1.0, artifact_sha256="")
    pool.fill(stale, weights(2, seed=1), rank=2, scaling=1.0, artifact_sha256="")  # finishes last
    pool.fill(fresh, weights(2, seed=1), rank=2, scaling=1.0, artifact_sha256="")  # ... or first: either serves
    assert pool.lookup(("a", 1)) == fresh
    pool.acquire(fresh)  # the served copy is busy; the stale one is the only idle candidate
    load(pool, ("b", 1))
    assert pool.reserve(("c", 1)) == stale
    assert pool.lookup(("a", 1)) == fresh


def test_a_shared_pool_shows_a_forked_process_the_versions_loaded_after_the_fork() -> None:
    pool = SlotPool(SHAPES, max_slots=2, max_rank=MAX_RANK, device=torch.device("cpu"), shared=True)
    assert all(not t.any() for t in (*pool.a.values(), *pool.b.values(), pool.scaling, pool.tensors.ranks))
    go_read, go_write = os.pipe()
    answer_read, answer_write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the "engine process": reads what the parent loads after the fork
        os.read(go_read, 1)
        seen = [float(t.sum()) for t in (*pool.a.values(), *pool.b.values(), pool.scaling, pool.tensors.ranks)]
        os.write(answer_write, json.dumps(seen).encode())
        os._exit(0)
    index = load(pool, ("a", 1), rank=3, scaling=1.5)
    os.write(go_write, b"x")
    seen = json.loads(os.read(answer_read, 1 << 16))
    os.waitpid(pid, 0)
    expected = [float(t.sum()) for t in (*pool.a.values(), *pool.b.values(), pool.scaling, pool.tensors.ranks)]
    assert seen == expected and pool.tensors.ranks.tolist()[index] == 3 and pool.scaling[index] == 1.5


def test_a_slot_reused_by_a_version_with_fewer_modules_keeps_none_of_the_previous_occupant_s() -> None:
    pool = make_pool(max_slots=1)
    load(pool, ("both", 1), rank=MAX_RANK)
    only_q = {m: w for m, w in weights(2, seed=9).items() if m == "layers.0.q_proj"}
    index = pool.reserve(("only-q", 1))  # evicts "both" from the one slot
    pool.fill(index, only_q, rank=2, scaling=1.0, artifact_sha256="")
    assert not pool.a["layers.0.down_proj"][index].any() and not pool.b["layers.0.down_proj"][index].any()
    assert torch.equal(pool.a["layers.0.q_proj"][index, :2], only_q["layers.0.q_proj"][0])
    assert not pool.a["layers.0.q_proj"][index, 2:].any() and not pool.b["layers.0.q_proj"][index, :, 2:].any()


def _rss() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_a_module_no_loaded_version_uses_costs_no_memory() -> None:
    """The shared slots are an anonymous mapping: the pages of a module (here a 64 MiB-per-slot lm_head) that no
    version targets are never written, so never committed; before, every load zeroed every module's rows."""
    vocab = 1 << 20
    shapes = {**SHAPES, "lm_head": (16, vocab)}
    pool = SlotPool(shapes, max_slots=2, max_rank=16, device=torch.device("cpu"), shared=True)
    before = _rss()
    for key in (("a", 1), ("b", 1)):
        index = pool.reserve(key)
        pool.fill(index, weights(2, seed=1), rank=2, scaling=1.0, artifact_sha256="")  # no lm_head
    assert _rss() - before < 16 << 20, (_rss() - before) >> 20
    with_head = {**weights(2, seed=2), "lm_head": (torch.ones(2, 16), torch.ones(vocab, 2))}
    index = pool.reserve(("c", 1))  # evicts the least recently loaded
    pool.fill(index, with_head, rank=2, scaling=1.0, artifact_sha256="")
    assert float(pool.b["lm_head"][index].sum()) == 2 * vocab
