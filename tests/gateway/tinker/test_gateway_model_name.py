"""The base model's public name through the unmodified tinker SDK: a trainer started from a directory with
--served-model-name, a sampler started by that hub id from a local Hugging Face cache. Both report the name; the
gateway lists it, answers to it (create_model, sampling) as well as to the trainer's path, refuses others naming
it, and get_info gives it as the model and tokenizer name, which the SDK loads offline from the cache."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import tinker
from gatewayutil import KEY_A, base_url, start_gateway
from hubcache import write_hub_cache
from serverproc import ServerProcess, start_sampler, start_trainer
from tinker import types

from opentinker.client import ServiceClient
from opentinker.v1 import sampler_pb2, sampler_pb2_grpc

HUB_ID = "acme/tiny-chat"


@pytest.fixture(scope="module")
def named(
    tiny_model: Path, registry_server: ServerProcess, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[ServerProcess, ServerProcess, ServerProcess, Path]]:
    root = tmp_path_factory.mktemp("model-name")
    hf_home = root / "hf-home"
    write_hub_cache(tiny_model, hf_home, HUB_ID)
    servers: list[ServerProcess] = []
    with pytest.MonkeyPatch.context() as env:
        env.setenv("HF_HOME", str(hf_home))  # the servers' hub cache; the sampler finds HUB_ID only there
        env.setenv("HF_HUB_OFFLINE", "1")
        env.chdir(root)
        try:
            servers.append(start_trainer(root / "trainer", tiny_model, registry_server, "--served-model-name", HUB_ID))
            servers.append(start_sampler(root / "sampler", Path(HUB_ID), registry_server))
            servers.append(start_gateway(root / "gateway", servers[0], servers[1], registry_server))
            yield servers[0], servers[1], servers[2], hf_home
        finally:
            for server in reversed(servers):
                server.terminate()


def _sampler_names(sampler: ServerProcess) -> tuple[str, str]:
    with grpc.insecure_channel(sampler.address) as channel:
        info = sampler_pb2_grpc.SamplerServiceStub(channel).GetSamplerInfo(sampler_pb2.GetSamplerInfoRequest())
    return info.base_model.model, info.base_model.served_name


def test_both_servers_report_the_public_name(
    named: tuple[ServerProcess, ServerProcess, ServerProcess, Path],
    registry_server: ServerProcess,
    tiny_model: Path,
    tmp_path: Path,
) -> None:
    trainer, sampler, _, _ = named
    with ServiceClient(trainer.address, sampler.address, registry_server.address) as service:
        info = service.get_trainer_info()
        assert (info.model, info.served_name) == (str(tiny_model), HUB_ID)
    assert _sampler_names(sampler) == (HUB_ID, HUB_ID)  # started by the hub id
    by_flag = start_sampler(tmp_path, tiny_model, registry_server, "--served-model-name", HUB_ID)
    try:
        assert _sampler_names(by_flag) == (str(tiny_model), HUB_ID)
    finally:
        by_flag.terminate()


def test_the_gateway_lists_and_answers_to_the_public_name(
    named: tuple[ServerProcess, ServerProcess, ServerProcess, Path], tiny_model: Path
) -> None:
    gateway = named[2]
    service = tinker.ServiceClient(base_url=base_url(gateway), api_key=KEY_A)
    try:
        capabilities = tinker.RestClient(base_url=base_url(gateway), api_key=KEY_A).get_server_capabilities().result()
        assert [m.model_name for m in capabilities.supported_models] == [HUB_ID]
        training = service.create_lora_training_client(base_model=HUB_ID, rank=4, seed=1).result()
        info = training.get_info()
        assert (info.model_data.model_name, info.model_data.tokenizer_id) == (HUB_ID, HUB_ID)
        # The trainer's own path and its last component still name it; any other org/name does not.
        service.create_lora_training_client(base_model=str(tiny_model), rank=4, seed=1).result()
        service.create_lora_training_client(base_model=tiny_model.name, rank=4, seed=1).result()
        with pytest.raises(tinker.RequestFailedError, match=f"'acme/other' is not served here.*'{HUB_ID}'"):
            service.create_lora_training_client(base_model="acme/other", rank=4).result()
        with pytest.raises(tinker.BadRequestError, match=f"'acme/other' is not served here.*'{HUB_ID}'"):
            service.create_sampling_client(base_model="acme/other").result()
        sampler = service.create_sampling_client(base_model=HUB_ID).result()
        prompt = types.ModelInput.from_ints([17, 42, 99, 7])
        result = sampler.sample(prompt, 1, types.SamplingParams(max_tokens=4, temperature=0.0)).result()
        assert len(result.sequences[0].tokens) == 4
    finally:
        service.close("success").result()


def test_the_sdk_loads_the_named_tokenizer_offline_from_the_cache(
    named: tuple[ServerProcess, ServerProcess, ServerProcess, Path], tiny_model: Path, tmp_path: Path
) -> None:
    """In a fresh process, as a user's script: HF_HOME is read when the hub client is first imported."""
    gateway, hf_home = named[2], named[3]
    script = (
        "import json, sys, tinker\n"
        f"service = tinker.ServiceClient(base_url={base_url(gateway)!r}, api_key={KEY_A!r})\n"
        f"tokenizer = service.create_lora_training_client(base_model={HUB_ID!r}, rank=4).result().get_tokenizer()\n"
        "print(json.dumps([tokenizer.name_or_path, tokenizer.encode('def add(a, b): return a + b')]))\n"
    )
    env = {**os.environ, "HF_HOME": str(hf_home), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=tmp_path, env=env, check=False
    )
    assert result.returncode == 0, result.stderr[-3000:]
    from transformers import AutoTokenizer

    name, ids = json.loads(result.stdout.strip().splitlines()[-1])
    assert name == HUB_ID
    assert ids == AutoTokenizer.from_pretrained(tiny_model).encode("def add(a, b): return a + b")
