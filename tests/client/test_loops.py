"""The training loops (opentinker.client.loops) against the session trainer, sampler and registry: RL of two
adapters at once, exact-version sampling, lineage and metrics files, a learning check, SFT and multi-agent RL."""

from __future__ import annotations

import asyncio
import itertools
import json
import statistics
from collections.abc import Iterator, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from loopsutil import _FirstToken, _ScriptedSampler, _ScriptedService, _service, _TwoTurns
from registryutil import unique_name
from serverproc import ServerProcess

from opentinker.client import AdamParams, LoraConfig, Renderer, ServiceClient
from opentinker.client.loops import (
    SFTStepMetrics,
    StepMetrics,
    train_multi_agent_rl,
    train_multi_agent_rl_async,
    train_rl,
    train_rl_async,
    train_sft,
)
from opentinker.client.tasks import TINY_MODEL_SAMPLING, DigitsTask, EchoGame, ShortAnswerTask

RANK8 = LoraConfig(rank=8)
ADAM = AdamParams(learning_rate=3e-2)


@pytest.fixture(scope="module")
def addresses(
    trainer_server: ServerProcess, sampler_server: ServerProcess, registry_server: ServerProcess
) -> dict[str, str]:
    return {"trainer": trainer_server.address, "sampler": sampler_server.address, "registry": registry_server.address}


@pytest.fixture(scope="module")
def service(addresses: dict[str, str]) -> Iterator[ServiceClient]:
    with _client(addresses) as client:
        yield client


def _client(addresses: dict[str, str]) -> ServiceClient:
    return ServiceClient(trainer=addresses["trainer"], sampler=addresses["sampler"], registry=addresses["registry"])


def _check_run(history: list[StepMetrics], adapter: str, steps: int, trajectories: int) -> None:
    assert [m.step for m in history] == list(range(1, steps + 1))
    for previous, current in itertools.pairwise(history):
        # Each step samples the exact version the previous step saved.
        assert current.version_sampled == previous.version_saved
    for m in history:
        assert m.adapter == adapter
        assert m.num_trajectories == len(m.trace_ids) == trajectories
        assert 0.0 <= m.mean_reward <= 1.0 and m.seconds > 0
        if m.num_datums:
            assert m.version_saved == m.version_sampled + 1
        else:  # every group tied: nothing trained, nothing saved
            assert m.version_saved == m.version_sampled


def test_train_rl_async_two_adapters_at_once(
    addresses: dict[str, str], service: ServiceClient, renderer: Renderer, tmp_path: Path
) -> None:
    names = [unique_name("rl-digits"), unique_name("rl-short")]
    factories = [DigitsTask.factory(renderer), ShortAnswerTask.factory(renderer, budget=12)]
    paths = [tmp_path / "digits.jsonl", tmp_path / "short.jsonl"]

    async def both() -> list[list[StepMetrics]]:
        async with _client(addresses) as client:
            runs = [
                train_rl_async(
                    client,
                    name,
                    factory,
                    steps=3,
                    group_size=4,
                    groups_per_step=2,
                    sampling=TINY_MODEL_SAMPLING,
                    adam=ADAM,
                    lora=LoraConfig(rank=4),
                    metrics_path=path,
                    seed=7,
                )
                for name, factory, path in zip(names, factories, paths, strict=True)
            ]
            return list(await asyncio.gather(*runs))

    histories = asyncio.run(both())
    registry = service.registry_client()
    for name, history, path in zip(names, histories, paths, strict=True):
        _check_run(history, name, steps=3, trajectories=8)
        # The adapter's version 1 is the snapshot saved before step 1.
        assert history[0].version_sampled == 1

        lines = [json.loads(line) for line in path.read_text().splitlines()]
        assert len(lines) == 3
        assert [line["step"] for line in lines] == [1, 2, 3]
        assert lines[-1]["mean_reward"] == pytest.approx(history[-1].mean_reward)
        assert {"loss", "version_sampled", "version_saved", "num_datums", "seconds"} <= set(lines[0])

        # The lineage of the last version lists every trained step's rollouts.
        last = history[-1].version_saved
        chain = registry.get_lineage(f"{name}@{last}")
        assert [v.number for v in chain] == list(range(last, 0, -1))
        traced = {t for version in chain for batch in version.lineage.batches for t in batch.trace_ids}
        for m in history:
            if m.num_datums:
                assert set(m.trace_ids) <= traced
                assert all(t.startswith(f"{name}:") and f":s{m.step}:" in t for t in m.trace_ids)
        # Each version's batches hold the rollouts of the step that produced it.
        by_version = {v.number: v for v in chain}
        for m in history:
            if m.num_datums:
                batch_ids = [t for b in by_version[m.version_saved].lineage.batches for t in b.trace_ids]
                assert batch_ids == list(m.trace_ids)


def test_digits_reward_rises(service: ServiceClient, renderer: Renderer, tmp_path: Path) -> None:
    """The learning check: 12 steps of DigitsTask on the tiny random model (usually ~0.02 -> ~0.95)."""
    history = train_rl(
        service,
        unique_name("rl-learn"),
        DigitsTask.factory(renderer),
        steps=12,
        group_size=8,
        groups_per_step=4,
        sampling=replace(TINY_MODEL_SAMPLING, seed=11),
        adam=ADAM,
        lora=RANK8,
        metrics_path=tmp_path / "learn.jsonl",
    )
    _check_run(history, history[0].adapter, steps=12, trajectories=32)
    rewards = [m.mean_reward for m in history]
    print("digits reward curve:", " ".join(f"{r:.2f}" for r in rewards))
    first, last = statistics.mean(rewards[:3]), statistics.mean(rewards[-3:])
    assert last > first + 0.3, rewards
    assert len((tmp_path / "learn.jsonl").read_text().splitlines()) == 12


def test_train_sft_loss_falls(service: ServiceClient, renderer: Renderer, tmp_path: Path) -> None:
    conversations = [
        [{"role": "user", "content": f"What is {a}+{b}?"}, {"role": "assistant", "content": f"{a}+{b}={a + b}"}]
        for a, b in [(1, 2), (3, 4), (5, 6), (7, 8), (2, 9), (4, 4)]
    ]
    name = unique_name("sft")
    history = train_sft(
        service,
        name,
        conversations,
        steps=8,
        batch_size=3,
        adam=AdamParams(learning_rate=1e-2),
        lora=RANK8,
        renderer=renderer,
        train_on="last_assistant",
        save_every=4,
        metrics_path=tmp_path / "sft.jsonl",
    )
    assert [m.step for m in history] == list(range(1, 9))
    assert all(isinstance(m, SFTStepMetrics) and m.num_datums == 3 and m.num_tokens > 0 for m in history)
    assert [m.epoch for m in history] == [1, 1, 2, 2, 3, 3, 4, 4]  # 6 examples, batches of 3
    assert [m.version_saved for m in history] == [0, 0, 0, 1, 0, 0, 0, 2]  # every 4 steps and at the end
    losses = [m.loss for m in history]
    print("sft loss curve:", " ".join(f"{x:.3f}" for x in losses))
    assert statistics.mean(losses[-2:]) < statistics.mean(losses[:2]) - 0.2, losses
    assert len((tmp_path / "sft.jsonl").read_text().splitlines()) == 8

    registry = service.registry_client()
    assert registry.resolve(f"{name}@latest").number == history[-1].version_saved
    chain = registry.get_lineage(f"{name}@{history[-1].version_saved}")
    traced = [t for v in chain for b in v.lineage.batches for t in b.trace_ids]
    assert len(traced) == 8 * 3 and all(t.startswith(f"{name}:") for t in traced)


def test_train_multi_agent_rl_trains_each_role(service: ServiceClient, renderer: Renderer) -> None:
    adapters = {"speaker": unique_name("echo-sp"), "listener": unique_name("echo-li")}
    histories = train_multi_agent_rl(
        service,
        adapters,
        EchoGame.factory(renderer),
        steps=2,
        group_size=4,
        groups_per_step=2,
        sampling=TINY_MODEL_SAMPLING,
        adam=ADAM,
        lora=LoraConfig(rank=4),
    )
    assert set(histories) == {"speaker", "listener"}
    for role, history in histories.items():
        _check_run(history, adapters[role], steps=2, trajectories=8)
        assert all(t.endswith(f"/{role}") for m in history for t in m.trace_ids)
    # Both roles get the listener's echo score.
    assert [m.mean_reward for m in histories["speaker"]] == [m.mean_reward for m in histories["listener"]]


# The sync and async twins run one core: against scripted clients they make the same calls and return the same
# metrics (no servers needed).


def _without_seconds(history: Sequence[StepMetrics]) -> list[StepMetrics]:
    return [replace(m, seconds=0.0) for m in history]


def test_train_rl_twins_make_the_same_calls(tmp_path: Path) -> None:
    kwargs: dict[str, Any] = {
        "steps": 3,
        "group_size": 3,
        "groups_per_step": 2,
        "adam": ADAM,
        "lora": RANK8,
        "seed": 4,
        "run_id": "r",
    }
    sync_service, async_service = _ScriptedService(), _ScriptedService()
    sync = train_rl(_service(sync_service), "t/a", _FirstToken, metrics_path=tmp_path / "sync.jsonl", **kwargs)
    concurrent = asyncio.run(
        train_rl_async(_service(async_service), "t/a", _FirstToken, metrics_path=tmp_path / "async.jsonl", **kwargs)
    )
    assert _without_seconds(sync) == _without_seconds(concurrent)
    assert sync_service.log == async_service.log  # one adapter: the same calls in the same order
    assert [m.version_sampled for m in sync] == [1, 2, 3] and all(
        m.num_datums == 4 for m in sync
    )  # advantage 0 dropped
    assert sync_service.log[0] == ("create_training_client", "t/a", RANK8, 4)
    lines = [
        [{k: v for k, v in json.loads(line).items() if k != "seconds"} for line in p.read_text().splitlines()]
        for p in (tmp_path / "sync.jsonl", tmp_path / "async.jsonl")
    ]
    assert lines[0] == lines[1] and len(lines[0]) == 3


def test_train_multi_agent_rl_twins_make_the_same_calls() -> None:
    adapters = {"a": "t/ra", "b": "t/rb"}
    kwargs: dict[str, Any] = {"steps": 2, "group_size": 3, "groups_per_step": 1, "adam": ADAM, "seed": 1, "run_id": "m"}
    sync_service, async_service = _ScriptedService(), _ScriptedService()
    sync = train_multi_agent_rl(_service(sync_service), adapters, _TwoTurns, **kwargs)
    concurrent = asyncio.run(train_multi_agent_rl_async(_service(async_service), adapters, _TwoTurns, **kwargs))
    assert {role: _without_seconds(h) for role, h in sync.items()} == {
        role: _without_seconds(h) for role, h in concurrent.items()
    }
    for adapter in adapters.values():  # the roles' calls interleave differently; each adapter's are the same
        assert sync_service.by_adapter(adapter) == async_service.by_adapter(adapter)
    assert [m.version_saved for m in sync["a"]] == [2, 3]


def test_train_rl_twins_raise_the_same_error() -> None:
    kwargs: dict[str, Any] = {"steps": 1, "group_size": 2, "groups_per_step": 1}
    with pytest.raises(ValueError, match="at least 1"):
        train_rl(_service(_ScriptedService()), "t/a", _FirstToken, steps=0)
    with pytest.raises(ValueError, match="at least 1"):
        asyncio.run(train_rl_async(_service(_ScriptedService()), "t/a", _FirstToken, steps=0))

    class WrongVersion(_ScriptedService):
        def create_sampling_client(self, reference: str) -> _ScriptedSampler:
            return _ScriptedSampler("t/a@99", self.log)

    message = r"sampled from t/a@99, not t/a@1"
    with pytest.raises(RuntimeError, match=message):
        train_rl(_service(WrongVersion()), "t/a", _FirstToken, **kwargs)
    with pytest.raises(RuntimeError, match=message):
        asyncio.run(train_rl_async(_service(WrongVersion()), "t/a", _FirstToken, **kwargs))
