"""The fleet router's rule (client/fleet_router.py, docs/fleet.md): the rendezvous score as documented, adapter
concentration, bounded load under one hot adapter, minimal movement when a replica leaves, and the replicas
that are never chosen (draining, another base)."""

from __future__ import annotations

import hashlib
import random
import threading
from collections import Counter
from contextlib import ExitStack
from dataclasses import replace

import pytest
from fleetutil import BASE
from fleetutil import replica as _replica

from opentinker.client.fleet_router import FleetRouter, hash_order, load_bound, score

FLEET = [_replica(f"10.0.0.{i}:7101") for i in range(1, 4)]


def test_the_score_is_the_documented_one() -> None:
    # docs/fleet.md gives this vector for other implementations (the Go example checks the same one).
    assert score("team-a/agent", "10.0.0.1:7101") == 12088528084577892006
    digest = hashlib.sha256(b"team-b/x\n[::1]:9000").digest()
    assert score("team-b/x", "[::1]:9000") == int.from_bytes(digest[:8], "big")


def test_an_idle_router_sends_each_adapter_to_its_first_replica_in_hash_order() -> None:
    router = FleetRouter()
    for n in range(12):
        adapter = f"team/a{n}"
        first = router.route(adapter, FLEET, BASE)[0]
        assert first == hash_order(adapter, FLEET)[0]
        assert router.route(adapter, list(reversed(FLEET)), BASE)[0] == first  # the listing's order does not matter
    homes = Counter(router.route(f"team/a{n}", FLEET, BASE)[0].address for n in range(300))
    assert len(homes) == 3 and min(homes.values()) > 60  # spread over the fleet, not piled on one


def test_a_request_passes_a_replica_only_when_that_one_is_at_the_bound() -> None:
    """400 requests over 12 adapters at random, up to 12 in flight: every replica before the chosen one in the
    adapter's hash order held the bound or more, and the chosen one held less."""
    router = FleetRouter()
    rng = random.Random(7)
    adapters = [f"team/a{n}" for n in range(12)]
    spilled = 0
    with ExitStack() as held:
        open_requests: list[ExitStack] = []
        for _ in range(400):
            adapter = rng.choice(adapters)
            counts = router.in_flight()
            bound = load_bound(sum(counts.values()), len(FLEET), router.eps)
            chosen = router.route(adapter, FLEET, BASE)[0]
            order = [r.address for r in hash_order(adapter, FLEET)]
            passed = order[: order.index(chosen.address)]
            assert all(counts.get(a, 0) >= bound for a in passed) and counts.get(chosen.address, 0) < bound
            spilled += bool(passed)
            request = ExitStack()
            assert request.enter_context(router.placed(adapter, FLEET, BASE)) == chosen
            open_requests.append(request)
            if len(open_requests) > 12:
                open_requests.pop(rng.randrange(len(open_requests))).close()
        for request in open_requests:
            held.push(request)
    assert 0 < spilled < 200  # the bound was met now and then, and most requests went home
    assert router.in_flight() == {}


@pytest.mark.parametrize("eps", [0.25, 0.5])
def test_a_hot_adapter_spills_within_the_load_bound(eps: float) -> None:
    router = FleetRouter(eps)
    with ExitStack() as held:
        for _ in range(60):
            held.enter_context(router.placed("team/hot", FLEET, BASE))
        counts = router.in_flight()
    assert sum(counts.values()) == 60 and len(counts) >= 2  # it spilled
    assert max(counts.values()) <= (1 + eps) * 60 / 3 + 1, counts
    assert counts[hash_order("team/hot", FLEET)[0].address] == max(counts.values())  # its home is fullest
    assert load_bound(0, 3, 0.25) == 1 and load_bound(59, 3, 0.25) == 25


def test_a_leaving_replica_moves_only_the_adapters_it_held() -> None:
    router = FleetRouter()
    adapters = [f"team/a{n}" for n in range(200)]
    before = {a: router.route(a, FLEET, BASE)[0].address for a in adapters}
    gone = FLEET[1].address
    after = {a: router.route(a, [FLEET[0], FLEET[2]], BASE)[0].address for a in adapters}
    moved = {a for a in adapters if before[a] != after[a]}
    assert moved == {a for a in adapters if before[a] == gone}
    for adapter in moved:  # each to its second choice: what a retry or a continued stream uses
        assert after[adapter] == router.route(adapter, FLEET, BASE)[1].address


def test_draining_replicas_and_other_bases_are_never_chosen() -> None:
    router = FleetRouter()
    fleet = [
        replace(FLEET[0], state="draining"),
        _replica("10.0.0.9:7101", base="other-base"),
        FLEET[2],
    ]
    for n in range(50):
        assert [r.address for r in router.route(f"team/a{n}", fleet, BASE)] == [FLEET[2].address]
    assert router.route("team/a1", [fleet[0], fleet[1]], BASE) == []
    trainer = replace(FLEET[1], role="trainer")
    assert router.route("team/a1", [trainer], BASE) == []


def test_base_model_requests_go_to_the_least_loaded() -> None:
    router = FleetRouter()
    fleet = [_replica("a:1", waiting=5), _replica("b:1", waiting=0), _replica("c:1", waiting=2)]
    assert [r.address for r in router.route(None, fleet, BASE)] == ["b:1", "c:1", "a:1"]
    with router.placed(None, fleet[1:2], BASE), router.placed(None, fleet[1:2], BASE):
        assert router.route(None, fleet, BASE)[0].address == "c:1"  # this router's own requests count first
    with pytest.raises(ValueError):
        FleetRouter(eps=0)


def test_requests_placed_at_the_same_moment_see_each_other() -> None:
    """60 threads place a request for one hot adapter at once and hold it: choosing and counting are one step,
    so the bound holds as it does one at a time; a skipped replica is never chosen, and none left is None."""
    router = FleetRouter()
    start, placed_all, release = threading.Barrier(60), threading.Barrier(61), threading.Event()
    chosen: list[str] = []

    def place() -> None:
        start.wait(10)
        with router.placed("team/hot", FLEET, BASE, skip={FLEET[0].address}) as replica:
            assert replica is not None
            chosen.append(replica.address)
            placed_all.wait(10)
            release.wait(10)  # held until the counts are read

    threads = [threading.Thread(target=place) for _ in range(60)]
    for thread in threads:
        thread.start()
    placed_all.wait(10)
    counts = router.in_flight()
    release.set()
    for thread in threads:
        thread.join(10)
    assert len(chosen) == 60 and FLEET[0].address not in chosen
    assert sum(counts.values()) == 60 and max(counts.values()) <= load_bound(59, 2, router.eps), counts
    with router.placed("team/hot", FLEET, BASE, skip={r.address for r in FLEET}) as nothing:
        assert nothing is None
    assert router.in_flight() == {}
