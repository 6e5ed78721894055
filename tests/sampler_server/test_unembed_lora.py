"""Adapters with LoRA on the unembedding (lm_head), through real trainer, registry and sampler processes: the trainer's
logprobs, the sampler's (scored, prompt logprobs, greedy decode) and peft's on the exported folder agree in fp32 to
1e-5, for the untied tiny model and a tied one (qwen3 copy: lm_head's weight is the embedding, which stays frozen);
a version exports as a peft folder and imports back (`registry import`, shapes checked against the tied
checkpoint, which stores no lm_head.weight); an adapter peft saved with its default full copy of lm_head imports
when the copy is the base model's (left out of the artifact) and is refused otherwise."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from registryutil import unique_name
from safetensors.torch import load_file, save_file
from serverproc import ServerProcess, start_sampler, start_trainer
from typer.testing import CliRunner

from opentinker.cli.main import app
from opentinker.client import AdamParams, Datum, LoraConfig, ModelInput, SamplingParams, ServiceClient
from opentinker.client.tiny_model import make_family_model
from opentinker.weights.model_config import load_config

TOL = 1e-5
LM_A, LM_B = "base_model.model.lm_head.lora_A.weight", "base_model.model.lm_head.lora_B.weight"


def tokens_of(seed: int, length: int) -> list[int]:
    return torch.randint(3, 500, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def datum(tokens: list[int]) -> Datum:
    return Datum(
        ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)},
    )


def hf(model_dir: Path, adapter: Path | None = None) -> Any:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model: Any = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return (model if adapter is None else PeftModel.from_pretrained(model, str(adapter))).eval()


def hf_logprobs(model: Any, tokens: list[int]) -> list[float]:
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([tokens])).logits[0].float()
    values: list[float] = logits[:-1].log_softmax(-1).gather(1, torch.tensor(tokens[1:])[:, None])[:, 0].tolist()
    return values


def hf_greedy(model: Any, prompt: list[int], count: int) -> list[int]:
    tokens = list(prompt)
    with torch.no_grad():
        for _ in range(count):
            tokens.append(int(model(input_ids=torch.tensor([tokens])).logits[0, -1].argmax()))
    return tokens[len(prompt) :]


def max_diff(a: list[float] | tuple[float, ...], b: list[float] | tuple[float, ...]) -> float:
    assert len(a) == len(b)
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


def registry_cli(*args: str) -> Any:
    with pytest.MonkeyPatch.context() as patch:
        for key in [k for k in os.environ if k.startswith("OPENTINKER_")]:
            patch.delenv(key)
        return CliRunner().invoke(app, ["registry", *args], env={"COLUMNS": "200"})


@pytest.fixture(scope="module", params=["untied", "tied"])
def stack(
    request: pytest.FixtureRequest,
    tiny_model: Path,
    trainer_server: ServerProcess,
    sampler_server: ServerProcess,
    registry_server: ServerProcess,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[Path, ServiceClient]]:
    """The session's servers on the untied tiny model, or a trainer and a sampler of their own on a tied copy."""
    if request.param == "untied":
        with ServiceClient(trainer_server.address, sampler_server.address, registry_server.address) as service:
            yield tiny_model, service
        return
    workdir = tmp_path_factory.mktemp("unembed-tied")
    model = make_family_model(workdir / "qwen3", "qwen3", seed=6)
    assert load_config(model).tie_word_embeddings
    trainer = start_trainer(workdir / "trainer", model, registry_server)
    try:
        sampler = start_sampler(workdir / "sampler", model, registry_server)
        try:
            with ServiceClient(trainer.address, sampler.address, registry_server.address) as service:
                yield model, service
        finally:
            sampler.terminate()
    finally:
        trainer.terminate()


def trained(service: ServiceClient, targets: tuple[str, ...], folder: Path) -> tuple[str, Any]:
    """A fresh adapter on `targets`, 3 steps, snapshotted (its reference and training client); its artifact
    downloaded into `folder`."""
    name = unique_name("unembed")
    training = service.create_training_client(name, LoraConfig(rank=4, alpha=8.0, target_modules=targets), seed=4)
    for step in range(3):
        training.forward_backward([datum(tokens_of(50 + step, 40))])
        training.optim_step(AdamParams(learning_rate=5e-2))
    version = training.save_snapshot()
    service.registry_client().download_artifact(version.artifact_uri, folder)
    return version.reference, training


@pytest.mark.parametrize("targets", [("all-linear", "lm_head"), ("lm_head",)])
def test_trainer_sampler_and_peft_agree(
    stack: tuple[Path, ServiceClient], targets: tuple[str, ...], tmp_path: Path
) -> None:
    model_dir, service = stack
    config = load_config(model_dir)
    reference, training = trained(service, targets, tmp_path / "peft")
    tensors = load_file(tmp_path / "peft" / "adapter_model.safetensors")
    assert tensors[LM_A].shape == (4, config.hidden_size) and tensors[LM_B].shape == (config.vocab_size, 4)
    assert tensors[LM_B].abs().max().item() > 0  # trained: B started at zero
    leaves = {key.split(".lora_")[0].rsplit(".", 1)[-1] for key in tensors}
    assert leaves == (
        {"lm_head"}
        if targets == ("lm_head",)
        else {"lm_head", "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    )
    assert not any("embed_tokens" in key for key in tensors)  # tied or not, the input embedding is not trained
    adapter_config = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    assert "lm_head" in adapter_config["target_modules"]

    probe = tokens_of(7, 48)
    peft_model = hf(model_dir, tmp_path / "peft")
    want = hf_logprobs(peft_model, probe)
    assert max_diff(training.forward([datum(probe)]).logprobs[0], want) <= TOL, "trainer vs peft"
    sampling = service.create_sampling_client(reference)
    assert max_diff(sampling.compute_logprobs(probe), want) <= TOL, "sampler vs peft"
    prompt = probe[:12]
    result = sampling.sample(prompt, SamplingParams(max_tokens=10, temperature=0.0), prompt_logprobs=True)
    assert result.prompt_logprobs is not None and max_diff(result.prompt_logprobs, want[:11]) <= TOL
    (sequence,) = result.sequences
    assert list(sequence.tokens) == hf_greedy(peft_model, prompt, 10)[: len(sequence.tokens)]
    assert len(sequence.tokens) == 10 or sequence.stop_reason == "stop_token"

    # lm_head's LoRA matters in all three: peft without its two tensors gives other logprobs.
    if targets == ("lm_head",):
        assert max_diff(want, hf_logprobs(hf(model_dir), probe)) > 1e-3
    else:
        without = tmp_path / "without-lm-head"
        without.mkdir()
        save_file({k: v for k, v in tensors.items() if k not in (LM_A, LM_B)}, without / "adapter_model.safetensors")
        others = [t for t in adapter_config["target_modules"] if t != "lm_head"]
        (without / "adapter_config.json").write_text(json.dumps({**adapter_config, "target_modules": others}))
        assert max_diff(want, hf_logprobs(hf(model_dir, without), probe)) > 1e-3


def test_peft_export_and_import_round_trip(
    stack: tuple[Path, ServiceClient], registry_server: ServerProcess, tmp_path: Path
) -> None:
    model_dir, service = stack
    reference, _ = trained(service, ("attn", "lm_head"), tmp_path / "artifact")
    address = registry_server.address
    out = tmp_path / "exported"
    exported = registry_cli("export", reference, str(out), "--base-model-name", str(model_dir), "--registry", address)
    assert exported.exit_code == 0, exported.output
    probe = tokens_of(8, 32)
    want = hf_logprobs(hf(model_dir, out), probe)
    assert max_diff(service.create_sampling_client(reference).compute_logprobs(probe), want) <= TOL

    again = unique_name("reimported")
    imported = registry_cli("import", str(out), again, "--base-model", str(model_dir), "--registry", address, "--json")
    assert imported.exit_code == 0, imported.output
    version = json.loads(imported.stdout)
    assert "lm_head" in version["lora_config"]["target_modules"]
    served = service.create_sampling_client(f"{again}@{version['version']}").compute_logprobs(probe)
    assert max_diff(served, want) <= TOL


def test_peft_folders_with_peft_s_full_lm_head_copy(
    stack: tuple[Path, ServiceClient], registry_server: ServerProcess, tmp_path: Path
) -> None:
    """peft's save_pretrained stores the whole base lm_head (save_embedding_layers="auto") next to its LoRA. Checked
    against the base model, a copy equal to it is left out of the import and the adapter serves peft's logprobs;
    one that differs is refused; with no base model to compare with it is refused, naming the option that leaves
    it out. Saved with save_embedding_layers=False, the folder imports as it is."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    model_dir, service = stack
    torch.manual_seed(3)
    model = get_peft_model(hf(model_dir), PeftLoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "lm_head"]))
    with torch.no_grad():
        for parameter in (p for n, p in model.named_parameters() if "lora_B" in n):
            parameter.normal_(0, 0.05)
    probe = tokens_of(9, 24)
    want = hf_logprobs(model.eval(), probe)
    address = registry_server.address

    def import_folder(folder: Path, name: str, *base: str) -> Any:
        return registry_cli("import", str(folder), name, *base, "--registry", address, "--json")

    model.save_pretrained(str(tmp_path / "default"))
    copy_key = "base_model.model.lm_head.base_layer.weight"
    assert copy_key in load_file(tmp_path / "default" / "adapter_model.safetensors")  # peft's own default
    name = unique_name("peft-lm-head")
    imported = import_folder(tmp_path / "default", name, "--base-model", str(model_dir))
    assert imported.exit_code == 0, imported.output
    version = json.loads(imported.stdout)
    served = service.create_sampling_client(f"{name}@{version['version']}").compute_logprobs(probe)
    assert max_diff(served, want) <= TOL
    stored = tmp_path / "stored"
    service.registry_client().download_artifact(version["artifact_uri"], stored)
    assert copy_key not in load_file(stored / "adapter_model.safetensors")  # left out: the base model has it

    # No base model to compare with (the config names none that exists here): refused, saying what to do.
    unchecked = tmp_path / "unchecked"
    shutil.copytree(tmp_path / "default", unchecked)
    config_path = unchecked / "adapter_config.json"
    config_path.write_text(json.dumps({**json.loads(config_path.read_text()), "base_model_name_or_path": "elsewhere"}))
    refused = import_folder(unchecked, unique_name("refused"))
    assert refused.exit_code == 1 and "save_embedding_layers=False" in refused.output, refused.output
    assert "Traceback" not in refused.output

    # A copy that is not the base model's output layer (trained or resized): refused.
    changed = tmp_path / "changed"
    shutil.copytree(tmp_path / "default", changed)
    tensors = load_file(changed / "adapter_model.safetensors")
    tensors[copy_key] = tensors[copy_key] * 1.01
    save_file(tensors, changed / "adapter_model.safetensors")
    refused = import_folder(changed, unique_name("refused"), "--base-model", str(model_dir))
    assert refused.exit_code == 1 and "differs from base model" in refused.output, refused.output

    model.save_pretrained(str(tmp_path / "lora-only"), save_embedding_layers=False)
    name = unique_name("peft-lm-head")
    imported = import_folder(tmp_path / "lora-only", name)  # base_model_name_or_path is the local model
    assert imported.exit_code == 0, imported.output
    served = service.create_sampling_client(f"{name}@{json.loads(imported.stdout)['version']}").compute_logprobs(probe)
    assert max_diff(served, want) <= TOL
