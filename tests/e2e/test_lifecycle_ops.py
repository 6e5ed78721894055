"""Trainer operations and rollback that sticks, on one trainer (tokens on): reset loads an older version into the
live adapter (next snapshot's parent: that version; optimizer fresh or kept, as stated); init_from records its
source version and adapter; a rank samplers cannot serve is refused at CreateAdapter; the `opentinker trainer`
commands are tenant-scoped with precise exit codes; `registry rollback` of a trained adapter's latest says that the
trainer's next snapshot moves it again, with the command that carries the rollback into training."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from lifecycle_util import ADAM, LORA, Stack, batch, fresh, probe, start_stack, train
from serverproc import ServerProcess
from trainerutil import read_state

from opentinker.client import LoraConfig, OpenTinkerError


@dataclass
class Ops:
    stack: Stack
    trainer: ServerProcess


@pytest.fixture(scope="module")
def ops(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Ops]:
    stack = start_stack(tmp_path_factory.mktemp("lifecycle-ops"), tiny_model)
    try:
        trainer = stack.start_trainer("trainer")
    except BaseException:
        stack.registry.terminate()
        raise
    yield Ops(stack, trainer)
    assert {"trainer": trainer.terminate(), "registry": stack.registry.terminate()} == {"trainer": 0, "registry": 0}


def test_reset_to_an_older_version_then_train(ops: Ops) -> None:
    name = fresh("team-a")
    with ops.stack.client(ops.trainer, "team-a") as a:
        training = a.create_training_client(name, LORA, adam=ADAM, seed=1)
        logprobs = {}
        for version in (1, 2, 3):
            train(training, version - 1, version)
            assert training.save_snapshot().number == version
            logprobs[version] = probe(training)
        training.forward_backward(batch(9))  # pending gradients: dropped by the reset
        reset = training.reset("1")
        assert (reset.adapter, reset.version, reset.optimizer_kept) == (name, 1, False)
        assert reset.info.step == 3 and reset.info.pending_batches == 0 and reset.info.last_snapshot_version == 1
        assert probe(training) == logprobs[1]
        optimizer = read_state(ops.stack.store, training.save_state().state_id).optimizer
        assert optimizer["state"] == {}  # fresh moments
        train(training, 3, 4)
        v4 = training.save_snapshot()
        assert (v4.number, v4.lineage.parent_version) == (4, 1)
        # keep_optimizer: the moments stay; the next snapshot's parent is the alias's version.
        a.registry_client().set_alias(name, "stable", 2)
        kept = a.reset_training_adapter(name, "stable", keep_optimizer=True)
        assert (kept.version, kept.optimizer_kept) == (2, True)
        assert read_state(ops.stack.store, training.save_state().state_id).optimizer["state"]
        assert probe(training) == logprobs[2]
        train(training, 4, 5)
        assert training.save_snapshot().lineage.parent_version == 2


def test_reset_refusals_change_nothing(ops: Ops) -> None:
    name, other = fresh("team-a"), fresh("team-a", "wide")
    with ops.stack.client(ops.trainer, "team-a") as a, ops.stack.client(ops.trainer, "team-b") as b:
        training = a.create_training_client(name, LORA, adam=ADAM, seed=2)
        train(training, 0, 1)
        training.save_snapshot()
        wide = a.create_training_client(other, LoraConfig(rank=2), adam=ADAM, seed=2)
        wide.save_snapshot()
        before = probe(training)
        cases = {
            "9": (grpc.StatusCode.NOT_FOUND, "VERSION_NOT_FOUND"),
            "nope": (grpc.StatusCode.NOT_FOUND, "ALIAS_NOT_FOUND"),
            f"{other}@1": (grpc.StatusCode.FAILED_PRECONDITION, "INCOMPATIBLE_SNAPSHOT"),
            "team-b/x@1": (grpc.StatusCode.PERMISSION_DENIED, "PERMISSION_DENIED"),
        }
        for to, want in cases.items():
            with pytest.raises(OpenTinkerError) as refused:
                training.reset(to)
            assert (refused.value.code, refused.value.reason) == want, to
        with pytest.raises(OpenTinkerError) as denied:
            b.reset_training_adapter(name, "1")
        assert denied.value.code == grpc.StatusCode.PERMISSION_DENIED
        assert probe(training) == before and training.get_info().last_snapshot_version == 1


def test_init_from_records_the_source_version_and_adapter(ops: Ops) -> None:
    source, fork = fresh("team-a", "src"), fresh("team-a", "fork")
    with ops.stack.client(ops.trainer, "team-a") as a:
        training = a.create_training_client(source, LORA, adam=ADAM, seed=3)
        for version in (1, 2):
            train(training, version - 1, version)
            training.save_snapshot()
        at_v2 = probe(training)
        forked = a.create_training_client(fork, LORA, adam=ADAM, seed=4, init_from=f"{source}@2")
        started = forked.started_from
        assert started is not None and (started.kind, started.adapter, started.version) == ("version", source, 2)
        assert probe(forked) == at_v2
        train(forked, 2, 3)
        first = forked.save_snapshot()
        assert (first.number, first.lineage.parent_version, first.lineage.parent_adapter) == (1, 2, source)
        chain = a.registry_client().get_lineage(f"{fork}@1")
        assert [(v.adapter, v.number) for v in chain] == [(fork, 1), (source, 2), (source, 1)]
        second = forked.save_snapshot()
        assert (second.lineage.parent_version, second.lineage.parent_adapter) == (1, "")


def test_rank_above_the_serving_limit_is_refused(ops: Ops) -> None:
    name = fresh("team-a", "wide")
    with ops.stack.client(ops.trainer, "team-a") as a:
        with pytest.raises(OpenTinkerError) as refused:
            a.create_training_client(name, LoraConfig(rank=128))
        assert (refused.value.code, refused.value.reason) == (grpc.StatusCode.INVALID_ARGUMENT, "RANK_NOT_SERVABLE")
        assert "--max-serving-rank" in refused.value.message and "--max-rank" in refused.value.message
        with pytest.raises(OpenTinkerError) as missing:
            a.registry_client().get_adapter(name)  # nothing was created
        assert missing.value.reason == "ADAPTER_NOT_FOUND"
        assert a.create_training_client(name, LoraConfig(rank=64)).started_from is not None  # the limit itself


def test_trainer_commands_are_tenant_scoped(ops: Ops) -> None:
    stack, address = ops.stack, ops.trainer.address
    a_name, b_name = fresh("team-a", "cli"), fresh("team-b", "cli")
    with stack.client(ops.trainer, "team-a") as a, stack.client(ops.trainer, "team-b") as b:
        training = a.create_training_client(a_name, LORA, adam=ADAM, seed=6)
        for version in (1, 2):
            train(training, version - 1, version)
            training.save_snapshot()
        b.create_training_client(b_name, LORA, adam=ADAM, seed=6)

    listed = stack.cli("team-b", "trainer", "adapters", "--trainer", address, "--json")
    assert listed.returncode == 0, listed.stderr
    assert [entry["name"] for entry in json.loads(listed.stdout)] == [b_name]
    assert json.loads(listed.stdout)[0]["step"] == 0  # zeros are printed, not dropped

    shown = stack.cli("team-a", "trainer", "show", a_name, "--trainer", address, "--json")
    assert shown.returncode == 0, shown.stderr
    assert {k: json.loads(shown.stdout)[k] for k in ("name", "step", "last_snapshot_version")} == {
        "name": a_name,
        "step": 2,
        "last_snapshot_version": 2,
    }

    reset = stack.cli("team-a", "trainer", "reset", a_name, "--to", "1", "--trainer", address)
    assert reset.returncode == 0, reset.stderr
    assert f"weights of {a_name}@1 loaded, optimizer fresh" in reset.stdout
    assert f"the next snapshot's parent is {a_name}@1" in reset.stdout
    kept = stack.cli(
        "team-a", "trainer", "reset", a_name, "--to", "@2", "--keep-optimizer", "--trainer", address, "--json"
    )
    assert kept.returncode == 0 and json.loads(kept.stdout)["optimizer_kept"] is True, kept.stderr

    saved = stack.cli("team-a", "trainer", "save-state", a_name, "--trainer", address, "--json")
    assert saved.returncode == 0 and json.loads(saved.stdout)["state_id"].startswith("sha256:"), saved.stderr

    for args in (("show", a_name), ("reset", a_name, "--to", "1"), ("delete", a_name), ("save-state", a_name)):
        denied = stack.cli("team-b", "trainer", *args, "--trainer", address)
        assert denied.returncode == 1 and denied.stdout == "", denied
        assert denied.stderr.startswith("error: PERMISSION_DENIED") and denied.stderr.count("\n") == 1, denied.stderr

    deleted = stack.cli("team-a", "trainer", "delete", a_name, "--trainer", address)
    assert deleted.returncode == 0 and "registry versions kept" in deleted.stdout, deleted.stderr
    gone = stack.cli("team-a", "trainer", "show", a_name, "--trainer", address)
    assert gone.returncode == 1 and gone.stderr.startswith("error: NOT_FOUND") and "[ADAPTER_NOT_FOUND]" in gone.stderr
    bad = stack.cli("team-a", "trainer", "reset", a_name)  # --to is required: a usage error
    assert bad.returncode == 2


def test_registry_rollback_says_the_trainer_moves_latest_again(ops: Ops) -> None:
    name = fresh("team-a", "roll")
    stack = ops.stack
    with stack.client(ops.trainer, "team-a") as a:
        training = a.create_training_client(name, LORA, adam=ADAM, seed=7)
        for version in (1, 2, 3):
            train(training, version - 1, version)
            training.save_snapshot()
    rolled = stack.cli("team-a", "registry", "rollback", name, "--to", "1", "--registry", stack.registry.address)
    assert rolled.returncode == 0, rolled.stderr
    assert f"{name}@latest: 3 -> 1" in rolled.stdout
    assert "next snapshot moves latest again" in rolled.stderr
    assert f"opentinker trainer reset {name} --to 1" in rolled.stderr
    assert f"opentinker registry alias set {name} stable 1" in rolled.stderr
    # Following the advice: the reset carries the rollback into training; the next snapshot's parent is 1.
    with stack.client(ops.trainer, "team-a") as a:
        a.reset_training_adapter(name, "1")
        snapshot = a.training_client(name).save_snapshot()
        assert (snapshot.number, snapshot.lineage.parent_version) == (4, 1)
    # An alias nobody publishes to: no notice.
    with stack.client(ops.trainer, "team-a") as a:
        a.registry_client().set_alias(name, "stable", 3)
        a.registry_client().set_alias(name, "stable", 4)
    quiet = stack.cli("team-a", "registry", "rollback", name, "--alias", "stable", "--registry", stack.registry.address)
    assert quiet.returncode == 0 and quiet.stderr == "", quiet.stderr


def test_serving_alias_makes_bare_names_follow_stable(ops: Ops) -> None:
    """`registry alias serve NAME stable`: the SDK's bare reference follows stable, training keeps moving latest,
    and a rollback of latest says bare names are not affected."""
    name = fresh("team-a", "serve")
    stack = ops.stack
    registry = ("--registry", stack.registry.address)
    with stack.client(ops.trainer, "team-a") as a:
        training = a.create_training_client(name, LORA, adam=ADAM, seed=8)
        for version in (1, 2):
            train(training, version - 1, version)
            training.save_snapshot()
        a.registry_client().set_alias(name, "stable", 1)
    unset = stack.cli("team-a", "registry", "alias", "serve", name, "canary", *registry)
    assert unset.returncode == 1 and unset.stderr.count("\n") == 1 and "alias canary" in unset.stderr, unset.stderr
    served = stack.cli("team-a", "registry", "alias", "serve", name, "stable", *registry, "--json")
    assert served.returncode == 0, served.stderr
    assert json.loads(served.stdout) | {"event_id": ""} == {
        "previous_alias": "latest",
        "alias": "stable",
        "version": "1",
        "event_id": "",
    }
    assert stack.cli("team-b", "registry", "alias", "serve", name, "latest", *registry).returncode == 1
    with stack.client(ops.trainer, "team-a") as a:
        assert a.registry_client().resolve(name).number == 1  # the SDK's default reference: stable
        train(a.training_client(name), 2, 3)
        assert a.training_client(name).save_snapshot().number == 3
        assert a.registry_client().resolve(name).number == 1
        assert a.registry_client().get_adapter(name).serving_alias == "stable"
    shown = stack.cli("team-a", "registry", "show", name, *registry)
    assert f"{name} -> {name}@1 (bare name: serving alias stable)" in shown.stdout, shown.stdout
    listed = stack.cli("team-a", "registry", "adapters", "--prefix", name, *registry)
    assert "stable->1 (serving)" in listed.stdout, listed.stdout
    rolled = stack.cli("team-a", "registry", "rollback", name, *registry)
    assert rolled.returncode == 0 and f"{name}@latest: 3 -> 2" in rolled.stdout, rolled.stderr
    assert f"Bare {name} serves @stable, which this rollback did not move" in rolled.stderr, rolled.stderr
    busy = stack.cli("team-a", "registry", "alias", "rm", name, "stable", *registry)
    assert busy.returncode == 1 and "is the serving alias" in busy.stderr, busy.stderr
    back = stack.cli("team-a", "registry", "alias", "serve", name, "latest", *registry)
    assert back.returncode == 0 and f"{name} serves @latest (v2) to bare names (was @stable)" in back.stdout
