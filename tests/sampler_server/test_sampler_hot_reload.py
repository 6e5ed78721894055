"""Hot reload: the sampler follows the registry's events and serves new versions without a restart."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import grpc
import torch
from registryutil import unique_name, upload
from safetensors.torch import save
from samplerutil import greedy, loaded, prompt, request, run, snapshot, stats, train, trained_adapter, wait_until
from serverproc import ServerProcess, start_registry, start_sampler

from opentinker.v1 import registry_pb2, registry_pb2_grpc, sampler_pb2_grpc, trainer_pb2_grpc

Sampler = sampler_pb2_grpc.SamplerServiceStub
Registry = registry_pb2_grpc.RegistryServiceStub
Trainer = trainer_pb2_grpc.TrainerServiceStub
Q0 = "model.layers.0.self_attn.q_proj"  # tiny qwen2: 64 -> 64


def lora_files(rank: int, seed: int) -> dict[str, bytes]:
    """A peft-format artifact with random weights on one module (not all-zero, so it changes outputs)."""
    generator = torch.Generator().manual_seed(seed)
    tensors = {
        f"base_model.model.{Q0}.lora_A.weight": torch.randn(rank, 64, generator=generator) * 0.5,
        f"base_model.model.{Q0}.lora_B.weight": torch.randn(64, rank, generator=generator) * 0.5,
    }
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": ["q_proj"]}
    return {"adapter_config.json": json.dumps(config).encode(), "adapter_model.safetensors": bytes(save(tensors))}


def publish_files(registry: Registry, name: str, files: dict[str, bytes]) -> registry_pb2.Version:
    uri = upload(registry, files)
    response = registry.PublishVersion(registry_pb2.PublishVersionRequest(adapter=name, artifact_uri=uri))
    version: registry_pb2.Version = response.version
    return version


def serving(sampler: Sampler, name: str, alias: str = "latest") -> int | None:
    for key, adapter in loaded(sampler).items():
        if key.startswith(f"{name}@") and alias in adapter.serving_aliases:
            return int(adapter.version.version)
    return None


def test_new_version_is_served_after_publish_and_rollback_takes_effect(
    trainer: Trainer, sampler: Sampler, registry: Registry
) -> None:
    name, v1 = trained_adapter(trainer, seed=501)
    p = prompt(501)
    assert run(sampler, request(name, p)).versions[0] == (name, 1)  # traffic: the sampler now follows it
    train(trainer, name, seed=502, steps=2)
    v2 = snapshot(trainer, name)
    assert wait_until(lambda: serving(sampler, name) == v2.version, timeout=20), loaded(sampler)
    assert run(sampler, request(name, p)).versions[0] == (name, 2)
    reloads = [r for r in stats(sampler).recent_reloads if r.adapter == name and r.to_version == 2]
    assert reloads and reloads[-1].ok and reloads[-1].from_version == 1 and reloads[-1].latency_seconds > 0
    # An operator rolls back through the registry: the sampler switches without a restart.
    registry.Rollback(registry_pb2.RollbackRequest(adapter=name))
    assert wait_until(lambda: serving(sampler, name) == v1.version, timeout=20), loaded(sampler)
    assert run(sampler, request(name, p)).versions[0] == (name, 1)


def test_bare_name_follows_the_serving_alias(trainer: Trainer, sampler: Sampler, registry: Registry) -> None:
    """The operator serves `stable`: bare-name requests follow it (a rollback of stable sticks) while training
    keeps moving latest; `latest` as serving alias restores the default."""
    name, _ = trained_adapter(trainer, seed=505)
    p = prompt(505)
    train(trainer, name, seed=506, steps=2)
    assert snapshot(trainer, name).version == 2
    registry.SetAlias(registry_pb2.SetAliasRequest(adapter=name, alias="stable", version=1))
    served = registry.SetServingAlias(registry_pb2.SetServingAliasRequest(adapter=name, alias="stable"))
    assert (served.previous_alias, served.alias, served.version) == ("latest", "stable", 1)
    # Not seen by this sampler before: the registry resolves the bare name to stable.
    first = run(sampler, request(name, p))
    assert first.versions[0] == (name, 1) and first.only.tokens == greedy(sampler, f"{name}@1", p)
    assert run(sampler, request(f"{name}@latest", p)).versions[0] == (name, 2)
    # Training publishes v3: latest moves, bare names stay on stable.
    train(trainer, name, seed=507, steps=2)
    assert snapshot(trainer, name).version == 3
    assert wait_until(lambda: serving(sampler, name) == 3, timeout=20), loaded(sampler)
    assert run(sampler, request(name, p)).versions[0] == (name, 1)
    # The operator promotes, then rolls back stable: bare names follow each move, no trainer undoes it.
    registry.SetAlias(registry_pb2.SetAliasRequest(adapter=name, alias="stable", version=3))
    assert wait_until(lambda: run(sampler, request(name, p)).versions[0] == (name, 3), timeout=20)
    registry.Rollback(registry_pb2.RollbackRequest(adapter=name, alias="stable"))
    assert wait_until(lambda: run(sampler, request(name, p)).versions[0] == (name, 1), timeout=20)
    train(trainer, name, seed=508, steps=1)
    assert snapshot(trainer, name).version == 4
    assert wait_until(lambda: serving(sampler, name) == 4, timeout=20), loaded(sampler)
    assert run(sampler, request(name, p)).versions[0] == (name, 1)
    # Back to the default: bare names serve latest again.
    registry.SetServingAlias(registry_pb2.SetServingAliasRequest(adapter=name, alias="latest"))
    assert wait_until(lambda: run(sampler, request(name, p)).versions[0] == (name, 4), timeout=20)


def test_version_that_fails_to_load_never_replaces_the_served_one(
    trainer: Trainer, sampler: Sampler, registry: Registry
) -> None:
    name, _ = trained_adapter(trainer, seed=503)
    p = prompt(503)
    before = greedy(sampler, name, p)
    failures = stats(sampler).reload_failures_total
    # Rank 128 is above the session sampler's --max-rank 64: a valid artifact this sampler cannot serve.
    bad = publish_files(registry, name, lora_files(rank=128, seed=1))
    assert wait_until(lambda: stats(sampler).reload_failures_total > failures, timeout=20)
    assert serving(sampler, name) == 1
    result = run(sampler, request(name, p))
    assert result.versions[0] == (name, 1) and result.only.tokens == before
    failed = [r for r in stats(sampler).recent_reloads if r.adapter == name and r.to_version == bad.version]
    assert failed and not failed[-1].ok and "rank 128" in failed[-1].error


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_restarts_converge_to_the_registry(tiny_model: Path, tmp_path: Path) -> None:
    """Sampler killed while versions are published; registry restarted: nothing is missed."""
    port = free_port()
    registry_dir = tmp_path / "registry"
    registry_proc = start_registry(registry_dir, "--port", str(port))
    follow = ["--follow", "hr-*"]
    sampler_proc: ServerProcess | None = None
    try:
        registry = registry_pb2_grpc.RegistryServiceStub(grpc.insecure_channel(registry_proc.address))
        name = unique_name("hr")
        registry.CreateAdapter(registry_pb2.CreateAdapterRequest(name=name))
        publish_files(registry, name, lora_files(4, seed=1))
        sampler_proc = start_sampler(tmp_path / "sampler", tiny_model, registry_proc, *follow)
        sampler = sampler_pb2_grpc.SamplerServiceStub(grpc.insecure_channel(sampler_proc.address))
        assert wait_until(lambda: serving(sampler, name) == 1, timeout=20), loaded(sampler)
        # Kill the sampler; publish while it is down; a new sampler converges to the registry's map.
        sampler_proc.kill()
        publish_files(registry, name, lora_files(4, seed=2))
        publish_files(registry, name, lora_files(4, seed=3))
        registry.SetAlias(registry_pb2.SetAliasRequest(adapter=name, alias="stable", version=2))
        sampler_proc = start_sampler(tmp_path / "sampler2", tiny_model, registry_proc, *follow)
        sampler = sampler_pb2_grpc.SamplerServiceStub(grpc.insecure_channel(sampler_proc.address))
        assert wait_until(lambda: serving(sampler, name) == 3 and serving(sampler, name, "stable") == 2, timeout=30)
        # Restart the registry on the same address: the sampler reconnects and resumes from its last event.
        assert registry_proc.terminate() == 0
        registry_proc = start_registry(registry_dir, "--port", str(port))
        registry = registry_pb2_grpc.RegistryServiceStub(grpc.insecure_channel(registry_proc.address))
        publish_files(registry, name, lora_files(4, seed=4))
        assert wait_until(lambda: serving(sampler, name) == 4, timeout=30), loaded(sampler)
        assert run(sampler, request(name, prompt(1))).versions[0] == (name, 4)
        # The old versions' slots were released once nothing served them.
        assert f"{name}@1" not in loaded(sampler)
    finally:
        if sampler_proc is not None:
            sampler_proc.kill()
        registry_proc.terminate()
