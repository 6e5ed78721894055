"""A trainer restart loses nothing trained: after SIGTERM or SIGKILL in the middle of a run, attaching to the
adapter starts from its latest version (the next forward is that version's, its next snapshot's parent is that
version); fresh weights under the existing name need fresh=True; with --persist-state the attach resumes the full
state and training continues bitwise as an uninterrupted run. team-b's adapter on the same trainer comes back as
its own, untouched by team-a's restart traffic. Real processes, tokens on."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from lifecycle_util import ADAM, LORA, Stack, batch, fresh, probe, start_stack, train
from serverproc import ServerProcess
from trainerutil import assert_same_training, read_state

from opentinker.client import OpenTinkerError

N, M = 3, 2  # steps before the last snapshot, steps after the restart
SEED = 5


@pytest.fixture(scope="module")
def stack(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    stack = start_stack(tmp_path_factory.mktemp("lifecycle-restart"), tiny_model)
    yield stack
    assert stack.registry.terminate() == 0, stack.registry.log()


def stop(trainer: ServerProcess, how: signal.Signals) -> None:
    if how is signal.SIGKILL:
        trainer.kill()
        assert trainer.process.returncode == -signal.SIGKILL
    else:
        assert trainer.terminate() == 0, trainer.log()


@pytest.mark.parametrize("how", [signal.SIGTERM, signal.SIGKILL], ids=["sigterm", "sigkill"])
def test_attach_after_restart_starts_from_the_latest_version(stack: Stack, how: signal.Signals) -> None:
    a_name, b_name = fresh("team-a"), fresh("team-b")
    first = stack.start_trainer(f"first-{how.name}")
    try:
        with stack.client(first, "team-a") as a, stack.client(first, "team-b") as b:
            training = a.create_training_client(a_name, LORA, adam=ADAM, seed=SEED)
            assert training.started_from is not None and training.started_from.kind == "fresh"
            b_training = b.create_training_client(b_name, LORA, adam=ADAM, seed=SEED + 1)
            train(training, 0, 1)
            assert training.save_snapshot().number == 1
            train(training, 1, N)
            v2 = training.save_snapshot()
            at_v2 = probe(training)
            train(b_training, 0, 2)
            b_v1 = b_training.save_snapshot()
            b_at_v1 = probe(b_training)
            train(training, N, N + 1)  # trained after the last snapshot: lost with the process
            assert probe(training) != at_v2
    finally:
        stop(first, how)

    second = stack.start_trainer(f"second-{how.name}")
    try:
        with stack.client(second, "team-a") as a, stack.client(second, "team-b") as b:
            # Without attach_existing: refused, and the answer says how to continue.
            with pytest.raises(OpenTinkerError) as refused:
                a.create_training_client(a_name, LORA, adam=ADAM, seed=SEED)
            assert (refused.value.code, refused.value.reason) == (grpc.StatusCode.ALREADY_EXISTS, "ADAPTER_EXISTS")
            assert "attach_existing" in refused.value.message and "fresh" in refused.value.message
            # fresh together with init_from names two start points.
            with pytest.raises(OpenTinkerError) as conflicting:
                a.create_training_client(a_name, LORA, attach_existing=True, fresh=True, init_from=f"{a_name}@1")
            assert (conflicting.value.code, conflicting.value.reason) == (
                grpc.StatusCode.INVALID_ARGUMENT,
                "CONFLICTING_START",
            )

            training = a.create_training_client(a_name, LORA, adam=ADAM, seed=SEED, attach_existing=True)
            started = training.started_from
            assert started is not None
            assert (started.kind, started.adapter, started.version) == ("version", a_name, v2.number)
            assert f"{a_name}@{v2.number}" in started.description and "optimizer fresh" in started.description
            assert probe(training) == at_v2  # exactly the latest version's logprobs, not fresh weights
            info = training.get_info()
            assert (info.last_snapshot_version, info.parent_adapter, info.step) == (v2.number, "", N)
            train(training, N, N + 1)
            v3 = training.save_snapshot()
            assert (v3.number, v3.lineage.parent_version, v3.lineage.trainer_step) == (3, v2.number, N + 1)
            assert v3.lineage.tokens_trained == v2.lineage.tokens_trained + 2 * 11  # totals go on

            # team-b's adapter comes back as its own latest version.
            b_training = b.create_training_client(b_name, LORA, adam=ADAM, seed=SEED + 1, attach_existing=True)
            assert b_training.started_from is not None and b_training.started_from.version == b_v1.number
            assert probe(b_training) == b_at_v1
            # team-b cannot see, reset or delete team-a's adapter; its own list holds only its own.
            assert [i.name for i in b.list_training_adapters()] == [b_name]
            for call in (lambda: b.reset_training_adapter(a_name, "1"), lambda: b.delete_training_adapter(a_name)):
                with pytest.raises(OpenTinkerError) as denied:
                    call()
                assert denied.value.code == grpc.StatusCode.PERMISSION_DENIED
            assert a.get_training_adapter(a_name).step == N + 1  # from v2 (step N), one more; untouched by team-b

            # Fresh weights under the existing name: only with fresh=True, and its snapshot's parent is 0.
            a.delete_training_adapter(a_name)
            training = a.create_training_client(a_name, LORA, adam=ADAM, seed=SEED, attach_existing=True, fresh=True)
            assert training.started_from is not None and training.started_from.kind == "fresh"
            assert probe(training) != at_v2
            train(training, 0, 1)
            assert training.save_snapshot().lineage.parent_version == 0
    finally:
        assert second.terminate() == 0, second.log()


def test_persist_state_resumes_bitwise_after_sigkill(stack: Stack) -> None:
    """--persist-state saves the full state with each snapshot; after a SIGKILL, attaching resumes it: the next
    steps' losses and gradient norms, and the final weights and AdamW moments, equal an uninterrupted run's."""
    name, reference = fresh("team-a", "persist"), fresh("team-a", "reference")
    first = stack.start_trainer("persist-first", "--persist-state")
    try:
        with stack.client(first, "team-a") as a:
            training = a.create_training_client(name, LORA, adam=ADAM, seed=SEED)
            before = train(training, 0, N)
            training.forward_backward(batch(N))  # pending gradients at the snapshot: part of the state
            snapshot = training.save_snapshot()
            assert snapshot.lineage.state_id.startswith("sha256:")
            assert read_state(stack.store, snapshot.lineage.state_id).meta["owner"] == "team-a"
            train(training, N + 1, N + 2)  # lost with the process
    finally:
        stop(first, signal.SIGKILL)

    second = stack.start_trainer("persist-second", "--persist-state")
    try:
        with stack.client(second, "team-a") as a, stack.client(second, "team-b") as b:
            # team-b knows the state id (it is in the lineage team-a can read) but cannot load it: not a bearer key.
            with pytest.raises(OpenTinkerError) as stolen:
                b.create_training_client(fresh("team-b"), LORA, adam=ADAM, resume_state=snapshot.lineage.state_id)
            assert (stolen.value.code, stolen.value.reason) == (grpc.StatusCode.NOT_FOUND, "STATE_NOT_FOUND")

            training = a.create_training_client(name, LORA, adam=ADAM, seed=SEED, attach_existing=True)
            started = training.started_from
            assert started is not None
            assert (started.kind, started.version, started.state_id) == ("state", 1, snapshot.lineage.state_id)
            info = training.get_info()
            assert (info.step, info.pending_batches, info.last_snapshot_version) == (N, 1, 1)
            first_step = training.optim_step().metrics["grad_norm:value"]  # the gradients from before the kill
            after = train(training, N + 1, N + 1 + M)
            resumed_snapshot = training.save_snapshot()
            assert resumed_snapshot.lineage.parent_version == 1
            assert len(resumed_snapshot.lineage.batches) == M + 1  # the stepped pending batch and M more

            uninterrupted = a.create_training_client(reference, LORA, adam=ADAM, seed=SEED)
            want = train(uninterrupted, 0, N + 1 + M)
            assert want[:N] == before
            assert [want[N][1], *want[N + 1 :]] == [first_step, *after]  # bitwise: exact floats
            got_state = read_state(stack.store, training.save_state().state_id)
            want_state = read_state(stack.store, uninterrupted.save_state().state_id)
            assert_same_training(got_state, want_state)  # weights, gradients, AdamW moments, step
    finally:
        assert second.terminate() == 0, second.log()
