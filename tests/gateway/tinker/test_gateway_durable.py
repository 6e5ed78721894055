"""The gateway's state store and checkpoint table without servers: what Redis keeps reads back into the same tables
(a restored model expects the seq_id after the last one accepted), tombstones free a path at once, TTL bounds, and a
gateway whose Redis is unreachable refuses to start in one line."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from serverproc import opentinker_command

from opentinker.gateway.errors import GatewayError
from opentinker.gateway.tinker.checkpoints import MAX_TTL_SECONDS, Checkpoint, CheckpointTable, expiry
from opentinker.gateway.tinker.durable import RedisState, redacted
from opentinker.gateway.tinker.runs import TrainingRun, user_metadata
from opentinker.gateway.tinker.sessions import SamplingSession, Session
from opentinker.gateway.tinker.state import TinkerState
from opentinker.registry.embedded_redis import EmbeddedRedis
from opentinker.v1 import common_pb2

LORA = common_pb2.LoraConfig(rank=4, target_modules=["attn"])


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    server = EmbeddedRedis(tmp_path_factory.mktemp("durable-redis")).start()
    yield server.url
    server.stop()


def checkpoint(path: str, target: str, **kw: object) -> Checkpoint:
    return Checkpoint(path, "team-a", "state", target, LORA, "s1:train:0", **kw)  # type: ignore[arg-type]


def test_redis_state_reads_back_into_the_same_tables(redis_url: str) -> None:
    async def write_and_restore() -> TinkerState:
        store = RedisState(redis_url)
        await store.put_session(Session("s1", "team-a", "0.38.0"))
        await store.put_session(Session("s2", "team-a", "0.38.0", finished="expired"))
        await store.put_sampler(SamplingSession("s1:sample:0", "team-a", "s1", "team-a/x@3", "tiny", None))
        await store.put_run(TrainingRun("s1:train:0", "team-a", "s1", "team-a/tinker-s1-0", LORA, "tiny", {"k": "v"}))
        await store.put_run(TrainingRun("s2:train:0", "team-a", "s2", "team-a/tinker-s2-0", LORA, "tiny"))
        # The chunks of one forward_backward are recorded concurrently: the highest seq_id wins, in any order.
        await asyncio.gather(*(store.put_seq("s1:train:0", seq) for seq in (5, 7, 6)))
        await store.put_checkpoint(checkpoint("tinker://s1:train:0/weights/a", "sha256:1", expires_at=123.0))
        await store.put_checkpoint(checkpoint("tinker://s1:train:0/weights/b", "sha256:2", deleted=True, key="b#x"))
        saved = await store.load()
        await store.close()
        tinker = TinkerState()
        tinker.restore(saved)
        return tinker

    gateway = asyncio.run(write_and_restore())
    assert gateway.sessions.get("s1", "team-a").finished is None
    assert gateway.sessions.sampler("s1:sample:0", "team-a").reference == "team-a/x@3"
    run = gateway.runs.get("s1:train:0", "team-a")
    assert run.user_metadata == {"k": "v"} and run.lora == LORA and run.adapter == "team-a/tinker-s1-0"
    model = gateway.models.get("s1:train:0", "team-a")
    assert model.lane.next_seq == 8 and model.lora == LORA
    assert gateway.models.find("s2:train:0") is None  # an expired session's model stays a run only
    assert gateway.runs.get("s2:train:0", "team-a").base_model == "tiny"
    live = gateway.checkpoints.get("tinker://s1:train:0/weights/a", "team-a")
    assert live.expires_at == 123.0 and live.target == "sha256:1"
    assert not gateway.checkpoints.exists("tinker://s1:train:0/weights/b")  # a tombstone: hidden
    assert [c.key for c in gateway.checkpoints.due(now=0.0)] == ["b#x"]
    with pytest.raises(GatewayError) as other:
        gateway.runs.get("s1:train:0", "team-b")
    assert other.value.status == 404


def test_tombstones_free_the_path_and_shared_targets_are_kept() -> None:
    table = CheckpointTable()
    table.add(checkpoint("tinker://m/weights/a", "sha256:same"))
    table.add(checkpoint("tinker://m/weights/b", "sha256:same"))
    tombstone = table.retire("tinker://m/weights/a")
    assert tombstone is not None and tombstone.deleted and tombstone.key != tombstone.path
    assert not table.exists("tinker://m/weights/a") and [c.name for c in table.of_run("s1:train:0", "team-a")] == ["b"]
    assert table.due(now=0.0) == [tombstone]
    assert table.target_in_use(tombstone, now=0.0)  # b still stands for the same saved state
    assert table.retire("tinker://m/weights/a") is None


def test_ttl_and_metadata_bounds() -> None:
    assert expiry(None) is None and expiry(60, now=100.0) == 160.0
    for bad in (0, -1, MAX_TTL_SECONDS + 1, 1.5, True, "60"):
        with pytest.raises(ValueError, match="ttl_seconds"):
            expiry(bad)
    assert user_metadata({"a": "x", "n": 3, "f": True}) == {"a": "x", "n": "3", "f": "true"}
    bad_metadata: list[object] = [{"a": {"nested": 1}}, {str(i): "v" for i in range(65)}, ["a"], {"k" * 300: "v"}]
    for metadata in bad_metadata:
        with pytest.raises(GatewayError) as refused:
            user_metadata(metadata)
        assert refused.value.status == 400
    assert redacted("redis://user:secret@host:6380/0") == "redis://user:***@host:6380/0"


def test_gateway_refuses_to_start_when_its_redis_is_unreachable(tmp_path: Path) -> None:
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps({"keys": [{"key": "tml-a", "tenant": "team-a"}]}))
    args = opentinker_command(
        "gateway",
        "serve",
        "--trainer",
        "x:1",
        "--sampler",
        "x:2",
        "--registry",
        "x:3",
        "--keys-file",
        str(keys),
        "--port",
        "0",
        "--redis-url",
        "redis://:pw@127.0.0.1:1/0",
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("OPENTINKER_GATEWAY")}
    done = subprocess.run(args, capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 2, done.stderr
    assert "gateway state store Redis at redis://:***@127.0.0.1:1/0" in done.stderr and "pw" not in done.stderr
    assert "Traceback" not in done.stderr
