"""The gateway's stability records: scoped to tenant and session, kept a TTL after their last use (each use
restarts it), dropped with their session, bounded per tenant (least recently used first)."""

from __future__ import annotations

import pytest

from opentinker.gateway.errors import RequestFailed
from opentinker.gateway.tinker.stability import StabilityRecords


def test_records_are_scoped_to_their_tenant_and_session() -> None:
    records = StabilityRecords()
    records.record("a", "s1", [1, 2, 3], {"x:0": ([4, 5], [-0.1, -0.2])}, now=0.0)
    found = records.lookup("a", "s1", ["x:0", "nope"], now=1.0)
    assert list(found) == ["x:0"]
    assert found["x:0"].tokens.tolist() == [4, 5] and found["x:0"].prompt.tolist() == [1, 2, 3]
    assert found["x:0"].logprobs.tolist() == pytest.approx([-0.1, -0.2])
    assert records.lookup("a", "s2", ["x:0"], now=1.0) == {}  # another session of the same tenant
    assert records.lookup("b", "s1", ["x:0"], now=1.0) == {}  # another tenant
    assert records.held("a") == 5 and records.held("b") == 0


def test_each_use_restarts_the_ttl_and_sweeps_drop_the_stale() -> None:
    records = StabilityRecords(ttl_seconds=10.0)
    records.record("a", "s", [1], {"used": ([2], [-1.0]), "idle": ([3], [-1.0])}, now=0.0)
    assert list(records.lookup("a", "s", ["used"], now=8.0)) == ["used"]
    assert list(records.lookup("a", "s", ["used", "idle"], now=15.0)) == ["used"]  # idle is past its TTL
    assert records.expire(now=15.0) == 1
    assert len(records) == 1 and records.held("a") == 2
    assert records.expire(now=30.0) == 1
    assert len(records) == 0 and records.held("a") == 0


def test_records_go_with_their_session() -> None:
    records = StabilityRecords()
    records.record("a", "gone", [1], {"g:0": ([2], [-1.0])}, now=0.0)
    records.record("a", "kept", [1], {"k:0": ([2], [-1.0])}, now=0.0)
    assert records.expire(now=1.0, sessions={"gone"}) == 1
    assert list(records.lookup("a", "kept", ["k:0"], now=1.0)) == ["k:0"]


def test_a_tenant_holds_a_bounded_number_of_tokens_oldest_use_dropped_first() -> None:
    records = StabilityRecords(max_tenant_tokens=10)
    records.record("a", "s", [1, 1], {"one": ([2, 2], [-1.0, -1.0])}, now=0.0)  # 4 tokens
    records.record("a", "s", [1, 1], {"two": ([2, 2], [-1.0, -1.0])}, now=1.0)  # 8
    records.lookup("a", "s", ["one"], now=2.0)  # "two" is now the least recently used
    records.record("b", "t", [1] * 9, {"big": ([2], [-1.0])}, now=2.0)  # another tenant's bound is its own
    records.record("a", "s", [1, 1], {"three": ([2, 2], [-1.0, -1.0])}, now=3.0)  # 12 > 10: "two" goes
    assert set(records.lookup("a", "s", ["one", "two", "three"], now=4.0)) == {"one", "three"}
    assert records.held("a") == 8 and records.held("b") == 10


def test_a_sampler_answer_with_mismatched_lengths_is_a_server_error() -> None:
    with pytest.raises(RequestFailed) as info:
        StabilityRecords().record("a", "s", [1], {"x": ([2, 3], [-1.0])})
    assert info.value.category == "server"
