"""A base model named by its hub id, found only in the local Hugging Face cache (HF_HUB_OFFLINE=1), as most users
start a server: the trainer and the sampler must fingerprint it the same way, or no snapshot can be sampled.

The cache is laid out as the hub client writes it (tests/hubcache.py).
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from hubcache import REVISION, write_hub_cache
from serverproc import ServerProcess, opentinker_command, start_registry, start_sampler, start_trainer

from opentinker.client import AdamParams, Datum, LoraConfig, ModelInput, SamplingParams, ServiceClient
from opentinker.weights.base_model import model_digest

HUB_ID = "acme/tiny"


@pytest.fixture(scope="module")
def hub_home(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    hf_home = tmp_path_factory.mktemp("hf-home")
    write_hub_cache(tiny_model, hf_home, HUB_ID)
    saved = {key: os.environ.get(key) for key in ("HF_HOME", "HF_HUB_OFFLINE")}
    os.environ.update(HF_HOME=str(hf_home), HF_HUB_OFFLINE="1")  # inherited by the server processes below
    yield hf_home
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def test_a_hub_id_resolves_to_the_cached_snapshot_with_the_directory_fingerprint(
    hub_home: Path, tiny_model: Path
) -> None:
    # In a fresh process, as a server resolves it: the hub client reads HF_HOME when it is first imported.
    probe = (
        "from opentinker.weights.base_model import model_digest, resolve_model_dir; "
        f"d = resolve_model_dir({HUB_ID!r}); print(d.name, (d / 'config.json').is_symlink(), model_digest(d))"
    )
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True)
    assert result.stdout.split() == [REVISION, "True", model_digest(tiny_model)]


@pytest.fixture(scope="module")
def hub_servers(hub_home: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServerProcess, ...]]:
    workdir = tmp_path_factory.mktemp("hub-e2e")
    registry = start_registry(workdir / "registry")
    servers: list[ServerProcess] = [registry]
    try:
        # The cwd has no ./acme/tiny folder: the servers can only find the model through the hub cache.
        servers.append(start_trainer(workdir / "trainer", Path(HUB_ID), registry))
        servers.append(start_sampler(workdir / "sampler", Path(HUB_ID), registry))
        yield tuple(servers)
    finally:
        for server in reversed(servers):
            server.terminate()


def train_snapshot_and_sample(service: ServiceClient, tiny_model: Path) -> None:
    """Trains "hub/tiny" 3 steps, snapshots it and samples that version: the trained weights must be served."""
    rng = random.Random(0)
    tokens = [rng.randrange(1, 500) for _ in range(16)]
    datum = Datum(
        model_input=ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)},
    )
    info = service.get_trainer_info()
    assert (info.model, info.model_digest, info.served_name) == (HUB_ID, model_digest(tiny_model), HUB_ID)
    training = service.create_training_client("hub/tiny", LoraConfig(rank=4), seed=1)
    for _ in range(3):
        training.forward_backward([datum], "cross_entropy")
        training.optim_step(AdamParams(learning_rate=5e-2))
    version = training.save_snapshot()
    greedy = SamplingParams(max_tokens=6, temperature=0.0)
    tuned = service.create_sampling_client(version.reference).sample(tokens[:8], greedy)
    base = service.create_sampling_client("base").sample(tokens[:8], greedy)
    (sample,) = tuned.sequences
    assert sample.version.exact == version.reference == f"hub/tiny@{version.number}"
    assert len(sample.tokens) == 6
    assert sample.tokens != base.sequences[0].tokens  # the trained weights were served, not the base model


def test_train_snapshot_and_sample_a_version_of_a_hub_id_model(
    hub_servers: tuple[ServerProcess, ...], tiny_model: Path
) -> None:
    registry, trainer, sampler = hub_servers
    with ServiceClient(trainer=trainer.address, sampler=sampler.address, registry=registry.address) as service:
        train_snapshot_and_sample(service, tiny_model)


def test_opentinker_up_with_a_hub_id_model(hub_home: Path, tiny_model: Path, tmp_path: Path) -> None:
    config = tmp_path / "stack.toml"
    config.write_text(f'model = "{HUB_ID}"\nport = 0\ndevice = "cpu"\n[registry]\ndata_dir = "{tmp_path}/data"\n')
    up = subprocess.Popen(
        opentinker_command("up", "--config", str(config), "--workdir", str(tmp_path / "run"), "--json"),
        stdout=subprocess.PIPE,
        text=True,
        cwd=tmp_path,  # no ./acme/tiny here: only the hub cache has it
    )
    try:
        assert up.stdout is not None
        first = json.loads(up.stdout.readline() or "{}")
        assert first.get("event") == "serving", first
        address = {name: server["address"] for name, server in first["servers"].items()}
        with ServiceClient(address["trainer"], address["sampler"], address["registry"]) as service:
            train_snapshot_and_sample(service, tiny_model)
        up.send_signal(signal.SIGTERM)
        assert up.wait(timeout=120) == 0
    finally:
        if up.poll() is None:
            up.kill()
            up.wait()
