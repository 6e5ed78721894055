"""The tinker SDK's RestClient (0.38.0) against real processes: training runs with their user_metadata, checkpoints
listed, read, deleted, with TTLs and publish flags, each tenant seeing only its own; expired and deleted checkpoints
deleted for real (the trainer's saved state, the registry version) except a version an alias points to; and a
gateway on Redis killed mid-run and started again: the same SDK clients go on with the same model id and paths.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import tinker
from gatewayutil import KEY_A, KEY_B, base_url, floats, ints, start_gateway
from serverproc import ServerProcess, registry_store
from tinker import types

from opentinker.client import RegistryClient
from opentinker.registry.embedded_redis import EmbeddedRedis

TOKENS = [13, 27, 41, 55, 69, 83, 97, 111, 125, 139]
GC_SECONDS = "0.2"
# Deleted and expired checkpoints are collected within a fraction of a second here.
GATEWAY_FLAGS = ("--checkpoint-gc-seconds", GC_SECONDS)


def datum(shift: int = 0) -> types.Datum:
    tokens = [(t + shift) % 400 + 3 for t in TOKENS]
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": ints(tokens[1:]), "weights": floats([1.0] * (len(tokens) - 1))},
    )


def adapter_of(model_id: str, tenant: str = "gw-a") -> str:
    session, _, seq = model_id.split(":")
    return f"{tenant}/tinker-{session}-{seq}"


def saved_states(store: Path, adapter: str, label: str) -> list[Path]:
    """The trainer's saved states of ``adapter`` labelled ``label``, on disk in the shared artifact store."""
    found = []
    for meta in store.glob("sha256/*/state.json"):
        data = json.loads(meta.read_text())
        if data.get("adapter") == adapter and data.get("label") == label:
            found.append(meta.parent)
    return found


def eventually(check: Callable[[], bool], timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.1)


@pytest.fixture(scope="module")
def clients(gateway: ServerProcess) -> Iterator[tuple[tinker.ServiceClient, tinker.ServiceClient]]:
    a = tinker.ServiceClient(base_url=base_url(gateway), api_key=KEY_A)
    b = tinker.ServiceClient(base_url=base_url(gateway), api_key=KEY_B)
    yield a, b
    a.close("success").result()
    b.close("success").result()


def test_rest_routes_are_tenant_scoped(
    gateway: ServerProcess,
    clients: tuple[tinker.ServiceClient, tinker.ServiceClient],
    tiny_model: Path,
    registry_server: ServerProcess,
) -> None:
    a, _ = clients
    rest_a = tinker.RestClient(base_url=base_url(gateway), api_key=KEY_A)
    rest_b = tinker.RestClient(base_url=base_url(gateway), api_key=KEY_B)
    metadata = {"renderer_name": "qwen3", "recipe": "test"}
    training = a.create_lora_training_client(
        base_model=tiny_model.name, rank=4, seed=5, user_metadata=metadata
    ).result()
    training.forward_backward([datum()], "cross_entropy").result()
    training.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    state = training.save_state("s-1").result().path
    weights = training.save_weights_for_sampler("w-1").result().path

    # get_training_run (by id and by tinker path: the cookbook's renderer check on resume) and list_training_runs.
    run = rest_a.get_training_run(training.model_id).result()
    assert run.training_run_id == training.model_id and run.model_owner == "gw-a"
    assert run.base_model == str(tiny_model) and run.is_lora and run.lora_rank == 4 and not run.corrupted
    assert run.user_metadata == metadata
    assert run.last_checkpoint is not None and run.last_checkpoint.tinker_path == state
    assert run.last_sampler_checkpoint is not None and run.last_sampler_checkpoint.tinker_path == weights
    assert rest_a.get_training_run_by_tinker_path(state).result().training_run_id == training.model_id
    runs = rest_a.list_training_runs(limit=100).result()
    assert training.model_id in {r.training_run_id for r in runs.training_runs}
    assert runs.cursor.total_count >= 1 and runs.cursor.limit == 100

    # Checkpoints: per run, per tenant, weights_info.
    listed = rest_a.list_checkpoints(training.model_id).result().checkpoints
    assert [(c.checkpoint_id, c.checkpoint_type, c.tinker_path) for c in listed] == [
        ("weights/s-1", "training", state),
        ("sampler_weights/w-1", "sampler", weights),
    ]
    assert all((c.size_bytes or 0) > 0 and c.expires_at is None and not c.public for c in listed)
    mine = rest_a.list_user_checkpoints(limit=50).result()
    assert {state, weights} <= {c.tinker_path for c in mine.checkpoints}
    assert mine.cursor is not None and mine.cursor.total_count >= 2
    info = rest_a.get_weights_info_by_tinker_path(weights).result()
    assert info.base_model == str(tiny_model) and info.is_lora and info.lora_rank == 4
    assert (info.train_attn, info.train_mlp, info.train_unembed) == (True, True, True)  # the SDK's defaults

    # TTL set and removed; publish flags; a TTL out of range is a 400 that changes nothing.
    rest_a.set_checkpoint_ttl_from_tinker_path(state, 7200).result()
    (expiring,) = [c for c in rest_a.list_checkpoints(training.model_id).result().checkpoints if c.tinker_path == state]
    assert expiring.expires_at is not None and 7100 < expiring.expires_at.timestamp() - time.time() <= 7200
    with pytest.raises(tinker.BadRequestError):
        rest_a.set_checkpoint_ttl_from_tinker_path(state, 0).result()
    rest_a.set_checkpoint_ttl_from_tinker_path(state, None).result()
    rest_a.publish_checkpoint_from_tinker_path(weights).result()
    rest_a.publish_checkpoint_from_tinker_path(weights).result()  # again: no change (the SDK retries a 409)
    flags = {
        c.tinker_path: (c.public, c.expires_at) for c in rest_a.list_checkpoints(training.model_id).result().checkpoints
    }
    assert flags == {state: (False, None), weights: (True, None)}
    rest_a.unpublish_checkpoint_from_tinker_path(weights).result()

    # Tenant B reads A's run, checkpoints and paths as unknown, cannot delete or change them, and lists only its own.
    with pytest.raises(tinker.NotFoundError):
        rest_b.get_training_run(training.model_id).result()
    with pytest.raises(tinker.NotFoundError):
        rest_b.list_checkpoints(training.model_id).result()
    with pytest.raises(tinker.NotFoundError):
        rest_b.delete_checkpoint_from_tinker_path(state).result()
    with pytest.raises(tinker.NotFoundError):
        rest_b.set_checkpoint_ttl_from_tinker_path(weights, 3600).result()
    with pytest.raises(tinker.NotFoundError):
        rest_b.get_weights_info_by_tinker_path(weights).result()
    assert training.model_id not in {r.training_run_id for r in rest_b.list_training_runs().result().training_runs}
    assert state not in {c.tinker_path for c in rest_b.list_user_checkpoints().result().checkpoints}

    # Delete: the path goes at once; the trainer's saved state and the registry version follow (the version once
    # no alias points to it: w-1 is latest until the next save).
    store = registry_store(registry_server)
    assert len(saved_states(store, adapter_of(training.model_id), "s-1")) == 1
    rest_a.delete_checkpoint_from_tinker_path(state).result()
    rest_a.delete_checkpoint_from_tinker_path(weights).result()
    assert rest_a.list_checkpoints(training.model_id).result().checkpoints == []
    with pytest.raises(tinker.NotFoundError):
        rest_a.delete_checkpoint_from_tinker_path(state).result()
    with pytest.raises(tinker.RequestFailedError, match="unknown checkpoint"):
        a.create_training_client_from_state(state).result()
    eventually(lambda: not saved_states(store, adapter_of(training.model_id), "s-1"))
    with RegistryClient(registry_server.address) as registry:
        (w1,) = registry.list_versions(adapter_of(training.model_id))
        time.sleep(1.0)  # a few GC sweeps: w-1 is latest, so it stays
        assert not registry.get_version(w1.adapter, w1.number).artifact_deleted
        training.save_weights_for_sampler("w-2").result()  # latest moves on
        eventually(lambda: registry.get_version(w1.adapter, w1.number).artifact_deleted)
    # The path is free again for a new save.
    assert training.save_state("s-1").result().path == state


def test_ttl_expires_checkpoints_but_keeps_aliased_versions(
    gateway: ServerProcess,
    clients: tuple[tinker.ServiceClient, tinker.ServiceClient],
    tiny_model: Path,
    registry_server: ServerProcess,
) -> None:
    a, _ = clients
    rest = tinker.RestClient(base_url=base_url(gateway), api_key=KEY_A)
    training = a.create_lora_training_client(base_model=tiny_model.name, rank=4, seed=6).result()
    adapter = adapter_of(training.model_id)
    store = registry_store(registry_server)
    training.forward_backward([datum(1)], "cross_entropy").result()
    rolling = training.save_state("rolling", ttl_seconds=1).result().path
    kept = training.save_state("final").result().path
    old = training.save_weights_for_sampler("old", ttl_seconds=1).result().path
    pinned = training.save_weights_for_sampler("pinned", ttl_seconds=1).result().path
    newest = training.save_weights_for_sampler("newest", ttl_seconds=1).result().path  # latest points here
    with RegistryClient(registry_server.address) as registry:
        numbers = {v.number for v in registry.list_versions(adapter)}
        old_v, pinned_v, newest_v = sorted(numbers)
        registry.set_alias(adapter, "stable", pinned_v)

        def listed() -> set[str]:
            return {c.tinker_path for c in rest.list_checkpoints(training.model_id).result().checkpoints}

        # Expired: the rolling state (gone from disk) and the unaliased version; the aliased ones stay, listed.
        eventually(lambda: listed() == {kept, pinned, newest})
        assert rolling not in listed() and old not in listed()
        assert not saved_states(store, adapter, "rolling") and len(saved_states(store, adapter, "final")) == 1
        assert registry.get_version(adapter, old_v).artifact_deleted
        assert not registry.get_version(adapter, pinned_v).artifact_deleted
        assert not registry.get_version(adapter, newest_v).artifact_deleted
        sampled = a.create_sampling_client(model_path=pinned).result()  # still loadable while aliased
        assert sampled.sample(types.ModelInput.from_ints(TOKENS[:4]), 1, types.SamplingParams(max_tokens=2)).result()

        # Unaliased, they go at the next sweep.
        registry.delete_alias(adapter, "stable")
        training.save_weights_for_sampler("after").result()
        eventually(lambda: listed() == {kept, f"tinker://{training.model_id}/sampler_weights/after"})
        assert registry.get_version(adapter, pinned_v).artifact_deleted
        assert registry.get_version(adapter, newest_v).artifact_deleted
    with pytest.raises(tinker.BadRequestError):
        training.save_state("bad-ttl", ttl_seconds=-5).result()


@pytest.fixture(scope="module")
def gateway_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedRedis]:
    server = EmbeddedRedis(tmp_path_factory.mktemp("gateway-redis")).start()
    yield server
    server.stop()


def test_gateway_restart_mid_run(
    gateway: ServerProcess,
    gateway_redis: EmbeddedRedis,
    trainer_server: ServerProcess,
    sampler_server: ServerProcess,
    registry_server: ServerProcess,
    tiny_model: Path,
    tmp_path: Path,
) -> None:
    assert "in memory only" in gateway.log()  # the module's gateway has no --redis-url, and says so
    flags = ("--redis-url", gateway_redis.url, *GATEWAY_FLAGS)
    first = start_gateway(tmp_path, trainer_server, sampler_server, registry_server, *flags)
    port = first.address.rpartition(":")[2]
    service = tinker.ServiceClient(base_url=base_url(first), api_key=KEY_A)
    rest = tinker.RestClient(base_url=base_url(first), api_key=KEY_A)
    training = service.create_lora_training_client(
        base_model=tiny_model.name, rank=4, seed=7, user_metadata={"renderer_name": "role_colon"}
    ).result()
    before = [training.forward_backward([datum(2)], "cross_entropy").result().metrics["loss:sum"]]
    training.optim_step(types.AdamParams(learning_rate=5e-2)).result()
    state = training.save_state("before").result().path
    weights = training.save_weights_for_sampler("before").result().path
    expiring = training.save_state("short", ttl_seconds=3).result().path
    first.kill()  # SIGKILL: nothing is flushed on the way out

    second = start_gateway(tmp_path, trainer_server, sampler_server, registry_server, *flags, "--port", port)
    try:
        assert second.address == first.address and "restored" in second.log()
        # The same clients go on: the next seq_ids of the same model id, a save under the same run.
        for shift in (2, 2):
            before.append(training.forward_backward([datum(shift)], "cross_entropy").result().metrics["loss:sum"])
            training.optim_step(types.AdamParams(learning_rate=5e-2)).result()
        assert before[-1] < before[0], before  # the same adapter keeps learning
        after = training.save_weights_for_sampler("after").result().path
        assert after == f"tinker://{training.model_id}/sampler_weights/after"
        run = rest.get_training_run(training.model_id).result()
        assert run.user_metadata == {"renderer_name": "role_colon"}
        listed = {c.tinker_path for c in rest.list_checkpoints(training.model_id).result().checkpoints}
        assert {state, weights, after} <= listed
        # Old paths still resolve: resume from the state, sample the old weights.
        resumed = service.create_training_client_from_state_with_optimizer(state).result()
        assert resumed.get_info().lora_rank == 4
        sampler = service.create_sampling_client(model_path=weights).result()
        result = sampler.sample(types.ModelInput.from_ints(TOKENS[:4]), 1, types.SamplingParams(max_tokens=3))
        assert len(result.result().sequences[0].tokens) <= 3
        # The TTL set before the restart still expires the checkpoint.
        eventually(
            lambda: (
                expiring not in {c.tinker_path for c in rest.list_checkpoints(training.model_id).result().checkpoints}
            )
        )
        assert not saved_states(registry_store(registry_server), adapter_of(training.model_id), "short")
        service.close("success").result()
    finally:
        assert second.terminate() == 0, second.log()
