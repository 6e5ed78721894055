"""The object store failing under a running system (S3 on moto, IAM enforced): the trainer and the sampler reach it
through their own TCP proxies, which a test takes down, brings back or slows to 2 s per request.

- Store down for the trainer: SaveSnapshot is UNAVAILABLE naming the store (no secret), nothing is published,
  the adapter keeps its weights, and the same save succeeds once the store is back.
- Store down for the sampler: loaded versions are still served (health SERVING, its opentinker.store NOT_SERVING,
  also in `opentinker status`), the hot reload of a new one is retried (store
  status and metrics say so), and it is served once the store is back.
- Wrong credentials: PERMISSION_DENIED naming the store, never the secret; nothing published.
- A slow store: one tenant's save and hot reload wait on it; the other tenant's training and sampling do not.
"""

from __future__ import annotations

import json
import secrets
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from metricsutil import metric, scrape
from registryutil import unique_name
from samplerutil import Sampler, greedy, loaded, prompt, train, wait_until
from serverproc import ServerProcess, start_registry, start_sampler, start_trainer
from storeservers import StoreServer
from tcpproxy import TcpProxy
from tlsutil import Bearer, write_tokens
from trainerutil import Trainer, assert_status, create, get_adapter, rpc_error, sft_batch, train_step

from opentinker.cli.status import show_status
from opentinker.v1 import registry_pb2, registry_pb2_grpc, sampler_pb2, sampler_pb2_grpc, trainer_pb2, trainer_pb2_grpc
from opentinker.weights.artifact_bucket import STORE_HEALTH
from opentinker.weights.object_store import ObjectStore, parse_store_url

PRINCIPALS = {"team-a": "user", "team-b": "user", "svc": "admin"}
SECRET_KEY = "AWS_SECRET_ACCESS_KEY"
SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING


def _health(server: ServerProcess, service: str = "") -> int:
    """What the standard health service says of the server ("") or of its store (STORE_HEALTH), as a prober asks."""
    with grpc.insecure_channel(server.address) as channel:
        request = health_pb2.HealthCheckRequest(service=service)
        status: int = health_pb2_grpc.HealthStub(channel).Check(request, timeout=10).status
        return status


@dataclass
class StoreStack:
    url: str
    env: dict[str, str]
    to_trainer: TcpProxy  # the trainer's way to the store
    to_sampler: TcpProxy
    registry_server: ServerProcess
    trainer_server: ServerProcess
    sampler_server: ServerProcess
    tokens: dict[str, str]
    tokens_file: Path
    channels: list[grpc.Channel]

    def _channel(self, server: ServerProcess, who: str) -> grpc.Channel:
        channel = grpc.intercept_channel(grpc.insecure_channel(server.address), Bearer(self.tokens[who]))
        self.channels.append(channel)
        return channel

    def trainer(self, who: str) -> Trainer:
        return trainer_pb2_grpc.TrainerServiceStub(self._channel(self.trainer_server, who))

    def sampler(self, who: str) -> Sampler:
        return sampler_pb2_grpc.SamplerServiceStub(self._channel(self.sampler_server, who))

    def registry(self, who: str) -> registry_pb2_grpc.RegistryServiceStub:
        return registry_pb2_grpc.RegistryServiceStub(self._channel(self.registry_server, who))


@pytest.fixture(scope="module")
def stack(
    servers: dict[str, StoreServer], tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[StoreStack]:
    moto = servers["s3"]
    root = tmp_path_factory.mktemp("store-faults")
    tokens = {who: f"tok-{who}-{secrets.token_hex(8)}" for who in PRINCIPALS}
    tokens_file = write_tokens(root / "tokens.json", {tokens[w]: (w, role) for w, role in PRINCIPALS.items()})
    url = moto.url("faults")
    to_trainer, to_sampler = TcpProxy(moto.port), TcpProxy(moto.port)
    auth = ("--tokens-file", str(tokens_file))
    registry_server = start_registry(root / "registry", "--store", url, *auth, env=moto.env())
    started = [registry_server]
    try:
        service = (*auth, "--registry-token", tokens["svc"], "--store", url)
        trainer_server = start_trainer(
            root / "trainer",
            tiny_model,
            registry_server,
            *service,
            "--cache-dir",
            str(root / "tc"),
            env={**moto.env(), "AWS_ENDPOINT_URL": to_trainer.endpoint},
        )
        started.append(trainer_server)
        sampler_server = start_sampler(
            root / "sampler",
            tiny_model,
            registry_server,
            *service,
            "--cache-dir",
            str(root / "sc"),
            "--follow",
            "team-*",
            env={**moto.env(), "AWS_ENDPOINT_URL": to_sampler.endpoint},
        )
        started.append(sampler_server)
        built = StoreStack(
            url,
            moto.env(),
            to_trainer,
            to_sampler,
            registry_server,
            trainer_server,
            sampler_server,
            tokens,
            tokens_file,
            [],
        )
        yield built
        for channel in built.channels:
            channel.close()
    finally:
        for server in reversed(started):
            assert server.terminate() == 0, server.log()
        to_trainer.close()
        to_sampler.close()


def _published(stack: StoreStack, who: str, name: str) -> list[int]:
    response = stack.registry(who).ListVersions(registry_pb2.ListVersionsRequest(adapter=name))
    return sorted(v.version for v in response.versions)


def _save(trainer: Trainer, name: str) -> registry_pb2.Version:
    response: trainer_pb2.SaveSnapshotResponse = trainer.SaveSnapshot(
        trainer_pb2.SaveSnapshotRequest(adapter=name), timeout=120
    )
    return response.version


def _store_status(sampler: Sampler) -> sampler_pb2.StoreStatus:
    response: sampler_pb2.GetStatsResponse = sampler.GetStats(sampler_pb2.GetStatsRequest())
    return response.store


def test_store_down_for_the_trainer_fails_the_save_and_the_retry_publishes(stack: StoreStack) -> None:
    trainer = stack.trainer("team-a")
    name = create(trainer, f"team-a/{unique_name('down')}", seed=600).name
    train(trainer, name, seed=600, steps=1)
    before = get_adapter(trainer, name)
    stack.to_trainer.down()
    try:
        error = rpc_error(_save, trainer, name)
        assert_status(error, grpc.StatusCode.UNAVAILABLE, "STORE_UNAVAILABLE")
        assert stack.url in (error.details() or "")
        assert stack.env[SECRET_KEY] not in (error.details() or "")
        assert _published(stack, "team-a", name) == []
        after = get_adapter(trainer, name)
        assert (after.step, after.last_snapshot_version) == (before.step, before.last_snapshot_version)
        assert wait_until(lambda: _health(stack.trainer_server, STORE_HEALTH) == NOT_SERVING, timeout=10)
        assert _health(stack.trainer_server) == SERVING  # the trainer itself still trains
    finally:
        stack.to_trainer.up()
    # Seen back by the health probe alone, before any call of ours reaches the store.
    assert wait_until(lambda: _health(stack.trainer_server, STORE_HEALTH) == SERVING, timeout=10)
    version = _save(trainer, name)  # the same weights, saved again
    assert version.version == 1 and version.lineage.trainer_step == before.step
    assert _published(stack, "team-a", name) == [1]
    metrics = scrape(stack.trainer_server.metrics_address)
    assert metric(metrics, "opentinker_trainer_store_failures_total", reason="STORE_UNAVAILABLE") >= 1
    assert metric(metrics, "opentinker_trainer_store_up") == 1


def test_store_down_for_the_sampler_keeps_serving_and_catches_up(
    stack: StoreStack, capsys: pytest.CaptureFixture[str]
) -> None:
    trainer, sampler, admin = stack.trainer("team-a"), stack.sampler("team-a"), stack.sampler("svc")
    name = create(trainer, f"team-a/{unique_name('catch')}", seed=610).name
    train(trainer, name, seed=610, steps=1)
    _save(trainer, name)
    first = greedy(sampler, name, prompt(610))
    assert f"{name}@1" in loaded(admin)
    stack.to_sampler.down()
    try:
        train(trainer, name, seed=611, steps=2)
        assert _save(trainer, name).version == 2  # the trainer's way to the store is up
        assert wait_until(lambda: not _store_status(admin).reachable, timeout=30), "the failed reload is not shown"
        status = _store_status(admin)
        assert status.url == stack.url and status.failures_total >= 1 and status.last_error
        assert greedy(sampler, f"{name}@1", prompt(610)) == first  # what is loaded is still served
        assert f"{name}@2" not in loaded(admin)
        metrics = scrape(stack.sampler_server.metrics_address)
        assert metric(metrics, "opentinker_sampler_store_up") == 0
        assert wait_until(lambda: _health(stack.sampler_server, STORE_HEALTH) == NOT_SERVING, timeout=10)
        assert _health(stack.sampler_server) == SERVING  # a load balancer keeps sending: it still serves
        assert show_status(None, None, stack.sampler_server.address, stack.tokens["svc"], as_json=True)
        shown = json.loads(capsys.readouterr().out)["servers"]["sampler"]
        assert (shown["health"], shown["store_health"]) == ("SERVING", "NOT_SERVING")
    finally:
        stack.to_sampler.up()
    assert wait_until(lambda: _health(stack.sampler_server, STORE_HEALTH) == SERVING, timeout=10)
    assert wait_until(lambda: f"{name}@2" in loaded(admin), timeout=30), "the hot reload did not catch up"
    assert _store_status(admin).reachable
    assert _store_status(sampler).url == ""  # a tenant is not told about the store


def test_wrong_credentials_are_permission_denied_and_never_shown(
    stack: StoreStack, tiny_model: Path, tmp_path: Path
) -> None:
    wrong = "wrong-secret-" + secrets.token_hex(8)
    server = start_trainer(
        tmp_path / "trainer",
        tiny_model,
        stack.registry_server,
        "--tokens-file",
        str(stack.tokens_file),
        "--registry-token",
        stack.tokens["svc"],
        "--store",
        stack.url,
        "--cache-dir",
        str(tmp_path / "cache"),
        env={**stack.env, SECRET_KEY: wrong},
    )
    try:
        with grpc.intercept_channel(grpc.insecure_channel(server.address), Bearer(stack.tokens["team-a"])) as channel:
            trainer = trainer_pb2_grpc.TrainerServiceStub(channel)
            name = create(trainer, f"team-a/{unique_name('creds')}", seed=620).name
            train(trainer, name, seed=620, steps=1)
            error = rpc_error(_save, trainer, name)
            assert_status(error, grpc.StatusCode.PERMISSION_DENIED, "STORE_PERMISSION_DENIED")
            assert stack.url in (error.details() or "") and wrong not in (error.details() or "")
            assert _published(stack, "team-a", name) == []
    finally:
        assert server.terminate() == 0, server.log()
    assert wrong not in server.log()


def test_slow_store_holds_back_only_the_tenant_that_waits_on_it(stack: StoreStack) -> None:
    """team-a saves (and its sampler reload follows) through a store answering each request after 2 s; team-b
    trains and samples its loaded version meanwhile, and is done while team-a's save is still waiting."""
    a_trainer, b_trainer = stack.trainer("team-a"), stack.trainer("team-b")
    b_sampler = stack.sampler("team-b")
    a_name = create(a_trainer, f"team-a/{unique_name('slow')}", seed=630).name
    b_name = create(b_trainer, f"team-b/{unique_name('steady')}", seed=631).name
    train(a_trainer, a_name, seed=630, steps=1)
    train(b_trainer, b_name, seed=631, steps=1)
    _save(b_trainer, b_name)
    b_reference = greedy(b_sampler, f"{b_name}@1", prompt(631))
    stack.to_trainer.delay_s = stack.to_sampler.delay_s = 2.0
    saved: list[registry_pb2.Version] = []
    requests_before = stack.to_trainer.requests
    a_save = threading.Thread(target=lambda: saved.append(_save(a_trainer, a_name)))
    try:
        a_save.start()
        assert wait_until(lambda: stack.to_trainer.requests > requests_before, timeout=30)
        for step in range(2):
            train_step(b_trainer, b_name, sft_batch(seed=632 + step))
        assert greedy(b_sampler, f"{b_name}@1", prompt(631)) == b_reference
        assert a_save.is_alive(), "team-a's save did not wait on the slow store (the test shows nothing)"
    finally:
        a_save.join(120)
        stack.to_trainer.delay_s = stack.to_sampler.delay_s = 0.0
    assert saved and saved[0].version == 1


def test_trainer_killed_mid_push_publishes_nothing(
    stack: StoreStack, tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SIGKILL while the snapshot's objects are going up (a store answering each request after 1 s): no version
    appears, and what reached the bucket has no manifest, so no publish can ever name it."""
    for key, value in stack.env.items():
        monkeypatch.setenv(key, value)
    bucket = ObjectStore(parse_store_url(stack.url))

    def manifests() -> set[str]:
        return {o.key for o in bucket.list("sha256/") if o.key.endswith("/manifest.json")}

    before = manifests()
    proxy = TcpProxy(int(stack.env["AWS_ENDPOINT_URL"].rsplit(":", 1)[1]))
    proxy.delay_s = 1.0
    server = start_trainer(
        tmp_path / "trainer",
        tiny_model,
        stack.registry_server,
        "--tokens-file",
        str(stack.tokens_file),
        "--registry-token",
        stack.tokens["svc"],
        "--store",
        stack.url,
        "--cache-dir",
        str(tmp_path / "cache"),
        env={**stack.env, "AWS_ENDPOINT_URL": proxy.endpoint},
    )
    try:
        with grpc.intercept_channel(grpc.insecure_channel(server.address), Bearer(stack.tokens["team-a"])) as channel:
            trainer = trainer_pb2_grpc.TrainerServiceStub(channel)
            name = create(trainer, f"team-a/{unique_name('killed')}", seed=640).name
            train(trainer, name, seed=640, steps=1)
            save = trainer.SaveSnapshot.future(trainer_pb2.SaveSnapshotRequest(adapter=name), timeout=120)
            assert wait_until(lambda: proxy.requests >= 2, timeout=60), "the push never started"
            server.kill()
            with pytest.raises(grpc.RpcError):
                save.result()
        assert _published(stack, "team-a", name) == []
        assert manifests() == before
    finally:
        server.kill()
        proxy.close()
