"""Client deadlines: the client gets DEADLINE_EXCEEDED and the server drops the work. The sampler's running
sequences fall back to zero long before they could have finished; a trainer ForwardBackward whose deadline
expired while it waited behind another adapter's job never runs (no gradients, no ledger entry), and one that
expired while it ran is undone (gradients, pending batches and dropout RNG as before it)."""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
from faultutil import ForkedServer, fork_sampler, fork_trainer, long_prompt, wait_for
from metricsutil import metric, scrape
from samplerutil import loaded, params, request, stats
from serverproc import ServerProcess, registry_store
from trainerutil import (
    artifact_dir,
    assert_same,
    assert_status,
    create,
    forward_backward,
    get_adapter,
    lora,
    optim_step,
    random_tokens,
    rpc_error,
    sft_batch,
    sft_datum,
    state_of,
)

from opentinker.v1 import sampler_pb2_grpc, trainer_pb2, trainer_pb2_grpc

TOKENS = 1000
STREAMS, SAMPLES = 4, 4


@dataclass
class Stack:
    trainer: trainer_pb2_grpc.TrainerServiceStub
    sampler: sampler_pb2_grpc.SamplerServiceStub
    trainer_metrics: str | None
    store: Path


@pytest.fixture(scope="module")
def stack(
    tiny_model: Path, registry_server: ServerProcess, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Stack]:
    workdir = tmp_path_factory.mktemp("deadlines")
    servers: list[ForkedServer] = []
    try:
        # One part per request (no micro-batching): the blocking job below must hold the compute thread whole.
        servers.append(
            fork_trainer(workdir / "trainer", tiny_model, registry_server, "--micro-batch-positions", str(1 << 17))
        )
        servers.append(fork_sampler(workdir / "sampler", tiny_model, registry_server))
        with grpc.insecure_channel(servers[0].address) as t, grpc.insecure_channel(servers[1].address) as s:
            yield Stack(
                trainer_pb2_grpc.TrainerServiceStub(t),
                sampler_pb2_grpc.SamplerServiceStub(s),
                servers[0].metrics_address,
                registry_store(registry_server),
            )
    finally:
        for server in servers:
            server.kill()


def test_sampler_deadline_exceeded_cancels_generation(stack: Stack, figure: Callable[[str, object], None]) -> None:
    sampler = stack.sampler
    prompt = long_prompt(sampler, "base", TOKENS)
    before = stats(sampler).tokens_generated
    codes: list[grpc.StatusCode] = []

    def stream() -> None:
        req = request("base", prompt, params(max_tokens=TOKENS), num_samples=SAMPLES)
        try:
            for _ in sampler.Sample(req, timeout=0.3):
                pass
        except grpc.RpcError as error:
            codes.append(error.code())

    threads = [threading.Thread(target=stream) for _ in range(STREAMS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert codes == [grpc.StatusCode.DEADLINE_EXCEEDED] * STREAMS
    assert wait_for(lambda: stats(sampler).running_requests == 0 and stats(sampler).waiting_requests == 0), stats(
        sampler
    )
    assert not any(a.active_requests for a in loaded(sampler).values())
    generated = stats(sampler).tokens_generated - before
    # Had the work gone on for nobody, all STREAMS * SAMPLES * TOKENS tokens would have been generated.
    assert generated < STREAMS * SAMPLES * TOKENS // 2, generated
    figure(
        "sampler streams past a 0.3 s deadline: tokens generated of requested",
        f"{generated} of {STREAMS * SAMPLES * TOKENS}",
    )


def test_expired_queued_forward_backward_never_runs(stack: Stack) -> None:
    trainer = stack.trainer
    blocker = create(trainer).name
    for size in (8, 32, 128):  # grow the blocking job until it outlasts the victim's deadline
        victim = create(trainer).name
        blocking = [sft_datum(random_tokens(seed, 512)) for seed in range(size)]
        request = trainer_pb2.ForwardBackwardRequest(adapter=blocker, datums=blocking, loss_fn="cross_entropy")
        busy = trainer.ForwardBackward.future(request, timeout=300)  # occupies the one compute thread
        # The victim must queue behind a job already running, not race the blocker's arrival.
        assert wait_for(functools.partial(on_compute_thread, stack, busy), timeout=30)
        code = grpc.StatusCode.OK
        try:
            forward_backward_with_deadline(trainer, victim)
        except grpc.RpcError as error:
            code = error.code()
        blocked = not busy.done()
        busy.result()
        if blocked:
            break
    assert blocked, "the blocking job never outlasted the victim's deadline"
    assert code == grpc.StatusCode.DEADLINE_EXCEEDED, code
    adapter = get_adapter(trainer, victim)
    assert adapter.pending_batches == 0 and adapter.step == 0  # the expired job was skipped, not run
    assert_status(rpc_error(optim_step, trainer, victim), grpc.StatusCode.FAILED_PRECONDITION, "NO_GRADIENTS")
    forward_backward(trainer, victim, sft_batch(seed=1))  # the adapter works normally afterwards
    assert get_adapter(trainer, victim).pending_batches == 1


def on_compute_thread(stack: Stack, job: grpc.Future[Any]) -> bool:
    """Whether the job has started (it may already have finished)."""
    return job.done() or metric(scrape(stack.trainer_metrics), "opentinker_trainer_jobs", state="running") == 1


def forward_backward_with_deadline(trainer: trainer_pb2_grpc.TrainerServiceStub, name: str) -> None:
    request = trainer_pb2.ForwardBackwardRequest(adapter=name, datums=sft_batch(seed=2), loss_fn="cross_entropy")
    trainer.ForwardBackward(request, timeout=0.2)


def test_forward_backward_expired_while_running_is_undone(stack: Stack) -> None:
    trainer = stack.trainer

    def undone() -> float:
        return metric(scrape(stack.trainer_metrics), "opentinker_trainer_cancelled_jobs_total", stage="undone")

    before_undone = undone()
    for size in (8, 32, 128, 256):  # grow the batch until it runs past the deadline
        name = create(trainer, config=lora(dropout=0.1)).name  # dropout: the RNG must be rewound too
        forward_backward(trainer, name, sft_batch(seed=1))
        before = state_of(trainer, stack.store, name)
        big = [sft_datum(random_tokens(seed, 512)) for seed in range(size)]
        try:
            trainer.ForwardBackward(
                trainer_pb2.ForwardBackwardRequest(adapter=name, datums=big, loss_fn="cross_entropy"), timeout=0.3
            )
        except grpc.RpcError as error:
            assert error.code() == grpc.StatusCode.DEADLINE_EXCEEDED, error
        else:
            continue  # finished in time: acknowledged, so it counts; try a bigger batch on a new adapter
        if not wait_for(lambda: undone() > before_undone, timeout=20):
            continue  # expired before it started: skipped (the queued case, tested above)
        get_adapter(trainer, name)  # queued behind the undo, so the undo is complete
        after = state_of(trainer, stack.store, name)
        assert_same(after.grads, before.grads, "grads")
        assert after.meta["ledger"] == before.meta["ledger"]
        rng = [(artifact_dir(stack.store, s.uri) / "rng.pt").read_bytes() for s in (before, after)]
        assert rng[0] == rng[1], "the dropout RNG was not rewound"
        assert get_adapter(trainer, name).pending_batches == 1
        return
    pytest.fail("no ForwardBackward ran past its deadline")
