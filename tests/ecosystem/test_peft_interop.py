"""Peft interop: an adapter trained with peft elsewhere is imported into the registry and served by the sampler
with peft's logprobs; any version exports as a plain peft folder that `PeftModel.from_pretrained` loads.

(A trainer snapshot loading in peft with the trainer's logits is tested in
tests/trainer_server/test_trainer_training.py; not repeated here.)
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
from registryutil import unique_name
from samplerutil import Sampler, max_diff, score, snapshot
from serverproc import ROOT, ServerProcess, opentinker_command
from trainerutil import Trainer, create, forward, logprobs, lora, random_tokens, sft_batch, sft_datum, train_step
from typer.testing import CliRunner

from opentinker.cli.main import app
from opentinker.v1 import registry_pb2, registry_pb2_grpc
from opentinker.weights.base_model import model_digest
from opentinker.weights.peft_io import PeftFolderError, inspect_peft_folder

TOL = 1e-4
PROBES = [random_tokens(900 + i, 10 + 3 * i) for i in range(3)]


def base_model(model_dir: Path) -> Any:
    from transformers import AutoModelForCausalLM

    model: Any = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return model.eval()


def peft_logprobs(model: Any, tokens: Sequence[int]) -> list[float]:
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([list(tokens)])).logits[0].float()
    targets = torch.tensor(list(tokens[1:]))
    values: list[float] = logits[:-1].log_softmax(-1).gather(1, targets[:, None]).squeeze(1).tolist()
    return values


@pytest.fixture(scope="module")
def peft_adapter(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[list[float]]]:
    """A LoRA adapter trained with peft itself (a few AdamW steps on random tokens), saved with save_pretrained,
    and peft's logprobs on the probes."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(7)
    config = LoraConfig(
        r=4, lora_alpha=12, lora_dropout=0.0, target_modules=["q_proj", "v_proj", "down_proj"], task_type="CAUSAL_LM"
    )
    model = get_peft_model(base_model(tiny_model), config)
    model.train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=5e-2)
    for step in range(4):
        tokens = torch.tensor([random_tokens(800 + step, 16)])
        model(input_ids=tokens, labels=tokens).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.eval()
    directory = tmp_path_factory.mktemp("peft") / "adapter"
    model.save_pretrained(str(directory))
    return directory, [peft_logprobs(model, p) for p in PROBES]


def registry_cli(*args: str) -> Any:
    """`opentinker registry ARGS` in-process (the same typer app a user runs)."""
    with pytest.MonkeyPatch.context() as patch:
        for key in [k for k in os.environ if k.startswith("OPENTINKER_")]:
            patch.delenv(key)
        return CliRunner().invoke(app, ["registry", *args], env={"COLUMNS": "200"})


def test_imported_peft_adapter_is_served_with_peft_logprobs(
    peft_adapter: tuple[Path, list[list[float]]],
    tiny_model: Path,
    registry_server: ServerProcess,
    registry: registry_pb2_grpc.RegistryServiceStub,
    sampler: Sampler,
) -> None:
    directory, expected = peft_adapter
    name = unique_name("imported")
    # As a user runs it: a real subprocess, JSON out.
    result = subprocess.run(
        opentinker_command(
            "registry",
            "import",
            str(directory),
            name,
            "--base-model",
            str(tiny_model),
            "--alias",
            "stable",
            "--registry",
            registry_server.address,
            "--json",
        ),
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr
    version = json.loads(result.stdout)
    assert (version["adapter"], version["version"]) == (name, "1")
    assert version["lora_config"]["rank"] == 4 and version["lora_config"]["alpha"] == 12
    assert version["lora_config"]["target_modules"] == ["down_proj", "q_proj", "v_proj"]
    assert set(version["aliases"]) == {"latest", "stable"}
    lineage = version["lineage"]
    assert lineage["base_model_digest"] == model_digest(tiny_model)
    assert lineage.get("parent_version", "0") == "0"  # not trained from any earlier version
    [record] = lineage["batches"]
    assert record["loss_fn"] == "peft-import" and record["trace_ids"] == [f"import:{directory.resolve()}"]
    weights = (directory / "adapter_model.safetensors").read_bytes()
    assert record["digest"] == hashlib.sha256(weights).hexdigest()
    adapter = registry.GetAdapter(registry_pb2.GetAdapterRequest(name=name)).adapter
    assert adapter.labels["origin"] == "peft-import" and adapter.base_model_digest == model_digest(tiny_model)

    served = score(sampler, f"{name}@stable", *PROBES)
    for got, want in zip(served, expected, strict=True):
        assert max_diff(got, want) < TOL
    base = score(sampler, "base", *PROBES)
    assert max(max_diff(b, w) for b, w in zip(base, expected, strict=True)) > 10 * TOL  # the adapter matters

    # Export gives back the same files, loadable by peft.
    out = directory.parent / "exported"
    exported = registry_cli("export", f"{name}@1", str(out), "--registry", registry_server.address)
    assert exported.exit_code == 0, exported.output
    for file in ("adapter_config.json", "adapter_model.safetensors"):
        assert (out / file).read_bytes() == (directory / file).read_bytes()


def test_trainer_snapshot_exports_as_a_peft_folder(
    tiny_model: Path, registry_server: ServerProcess, trainer: Trainer, tmp_path: Path
) -> None:
    from peft import PeftModel

    name = create(trainer, seed=31, config=lora(rank=4, alpha=16.0), lr=5e-2).name
    for step in range(2):
        train_step(trainer, name, sft_batch(seed=310 + step))
    version = snapshot(trainer, name)
    out = tmp_path / "peft"
    result = registry_cli(
        "export", name, str(out), "--base-model-name", str(tiny_model), "--json", "--registry", registry_server.address
    )
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert summary["version"] == str(version.version) and summary["artifact_sha256"] == version.artifact_sha256
    assert json.loads((out / "adapter_config.json").read_text())["base_model_name_or_path"] == str(tiny_model)

    model = PeftModel.from_pretrained(base_model(tiny_model), str(out)).eval()
    for probe in PROBES:
        want = logprobs(forward(trainer, name, [sft_datum(probe)]))[0]
        assert max_diff(peft_logprobs(model, probe), want) < 1e-5


def test_export_refuses_a_non_empty_directory_and_unknown_versions(
    registry_server: ServerProcess, tmp_path: Path
) -> None:
    (tmp_path / "keep.txt").write_text("mine")
    busy = registry_cli("export", "whatever", str(tmp_path), "--registry", registry_server.address)
    assert busy.exit_code == 1 and "exists and is not an empty directory" in busy.output
    assert (tmp_path / "keep.txt").read_text() == "mine"
    missing = registry_cli("export", unique_name("nope"), str(tmp_path / "new"), "--registry", registry_server.address)
    assert missing.exit_code == 1 and "NOT_FOUND" in missing.output, missing.output
    assert not (tmp_path / "new").exists()


def _copy(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for file in src.iterdir():
        (dst / file.name).write_bytes(file.read_bytes())
    return dst


def _edit_config(directory: Path, **changes: object) -> None:
    path = directory / "adapter_config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))


def _edit_weights(directory: Path, edit: Any) -> None:
    from safetensors.torch import load_file, save_file

    tensors = load_file(directory / "adapter_model.safetensors")
    edit(tensors)
    save_file(tensors, directory / "adapter_model.safetensors")


def _rename_layer(tensors: dict[str, torch.Tensor]) -> None:
    for key in [k for k in tensors if ".layers.0." in k]:
        tensors[key.replace(".layers.0.", ".layers.9.")] = tensors.pop(key)


def _drop_b(tensors: dict[str, torch.Tensor]) -> None:
    del tensors[next(k for k in tensors if k.endswith("lora_B.weight"))]


def _widen(tensors: dict[str, torch.Tensor]) -> None:  # consistent rank, wrong input size for the base
    key = next(k for k in tensors if k.endswith("q_proj.lora_A.weight"))
    tensors[key] = torch.zeros(tensors[key].shape[0], tensors[key].shape[1] + 8)


def _nan(tensors: dict[str, torch.Tensor]) -> None:
    key = next(iter(tensors))
    tensors[key] = tensors[key].clone()
    tensors[key].view(-1)[0] = float("nan")


def _embed(tensors: dict[str, torch.Tensor]) -> None:
    tensors["base_model.model.lm_head.weight"] = torch.zeros(2, 2)


BAD_FOLDERS: dict[str, tuple[Callable[[Path], object], str]] = {
    "no weights": (lambda d: (d / "adapter_model.safetensors").unlink(), "missing adapter_model.safetensors"),
    "dora": (lambda d: _edit_config(d, use_dora=True), "DoRA is not supported"),
    "other peft type": (lambda d: _edit_config(d, peft_type="IA3"), "peft_type 'IA3' is not supported"),
    "rank mismatch": (lambda d: _edit_config(d, r=8), "does not match rank r=8"),
    "rank pattern": (lambda d: _edit_config(d, rank_pattern={"q_proj": 2}), "rank_pattern"),
    "modules_to_save": (lambda d: _edit_config(d, modules_to_save=["lm_head"]), "modules_to_save"),
    "bad json": (lambda d: (d / "adapter_config.json").write_text("{"), "adapter_config.json is not valid JSON"),
    "module not in base": (lambda d: _edit_weights(d, _rename_layer), "which base model"),
    "shape not of base": (lambda d: _edit_weights(d, _widen), "features but base model"),
    "lora_A without B": (lambda d: _edit_weights(d, _drop_b), "has lora_A but no lora_B"),
    "non-finite": (lambda d: _edit_weights(d, _nan), "non-finite"),
    "full weights": (lambda d: _edit_weights(d, _embed), "unexpected tensor"),
    "targets disagree": (lambda d: _edit_config(d, target_modules=["q_proj"]), "but target_modules is"),
}


@pytest.mark.parametrize("case", sorted(BAD_FOLDERS))
def test_bad_folders_are_refused_precisely(
    case: str, peft_adapter: tuple[Path, list[list[float]]], tiny_model: Path, tmp_path: Path
) -> None:
    spoil, message = BAD_FOLDERS[case]
    directory = _copy(peft_adapter[0], tmp_path / "adapter")
    spoil(directory)
    with pytest.raises(PeftFolderError) as error:
        inspect_peft_folder(directory, tiny_model)
    assert message in str(error.value) and str(directory) in str(error.value)


def test_refused_import_changes_nothing(
    peft_adapter: tuple[Path, list[list[float]]],
    tiny_model: Path,
    tmp_path: Path,
    registry_server: ServerProcess,
    registry: registry_pb2_grpc.RegistryServiceStub,
) -> None:
    directory = _copy(peft_adapter[0], tmp_path / "adapter")
    _edit_config(directory, use_dora=True)
    name = unique_name("refused")
    result = registry_cli(
        "import", str(directory), name, "--base-model", str(tiny_model), "--registry", registry_server.address
    )
    assert result.exit_code == 1 and "error: " in result.output and "DoRA" in result.output, result.output
    assert "Traceback" not in result.output
    with pytest.raises(grpc.RpcError) as error:
        registry.GetAdapter(registry_pb2.GetAdapterRequest(name=name))
    assert error.value.code() == grpc.StatusCode.NOT_FOUND

    # Another base model: the adapter that exists for the tiny model refuses it.
    good = _copy(peft_adapter[0], tmp_path / "good")
    address = registry_server.address
    first = registry_cli("import", str(good), name, "--base-model", str(tiny_model), "--registry", address)
    assert first.exit_code == 0, first.output
    other_base = tmp_path / "other-base"
    other_base.mkdir()
    for file in tiny_model.iterdir():
        if file.is_file():
            (other_base / file.name).write_bytes(file.read_bytes())
    (other_base / "config.json").write_text((tiny_model / "config.json").read_text().replace("{", '{"x": 1,', 1))
    second = registry_cli(
        "import", str(good), name, "--base-model", str(other_base), "--registry", registry_server.address
    )
    assert second.exit_code == 1 and "belongs to base model" in second.output, second.output
    versions = registry.ListVersions(registry_pb2.ListVersionsRequest(adapter=name)).versions
    assert [v.version for v in versions] == [1]
