"""`opentinker registry import` / `export` as a user runs them (real CLI subprocesses) against hostile folders:
symlinked peft files, non-float dtypes and weights or a scaling beyond the one magnitude rule are refused on
import; an export into a symlink (dangling or to a directory) or a non-empty directory is refused. Each refusal
is one clean `error:` line, and nothing is published or written. (Issue "Noisy neighbours", cases 13 and 1.)"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
import torch
from registryutil import unique_name
from safetensors.torch import save_file
from serverproc import ServerProcess
from test_registry_cli import Cli, ok, run_cli

from opentinker.v1 import registry_pb2, registry_pb2_grpc


@pytest.fixture
def cli(registry_server: ServerProcess) -> Cli:
    return lambda *args: run_cli(*args, "--registry", registry_server.address)


MODULE = "base_model.model.model.layers.0.self_attn.q_proj"


def make_folder(directory: Path, *, alpha: float = 4.0, a: torch.Tensor | None = None) -> Path:
    """A minimal peft LoRA folder: rank 2 on one q_proj of 8 features."""
    directory.mkdir(parents=True)
    config = {"peft_type": "LORA", "r": 2, "lora_alpha": alpha, "target_modules": ["q_proj"], "bias": "none"}
    (directory / "adapter_config.json").write_text(json.dumps(config))
    generator = torch.Generator().manual_seed(3)
    tensors = {
        f"{MODULE}.lora_A.weight": a if a is not None else torch.randn(2, 8, generator=generator),
        f"{MODULE}.lora_B.weight": torch.randn(8, 2, generator=generator),
    }
    save_file(tensors, str(directory / "adapter_model.safetensors"))
    return directory


def one_line_error(result: object, expected: str) -> None:
    assert isinstance(result, subprocess.CompletedProcess)
    assert result.returncode == 1, (result.stdout, result.stderr)
    assert "Traceback" not in result.stderr + result.stdout, result.stderr
    assert len(result.stderr.splitlines()) == 1 and result.stderr.startswith("error: "), result.stderr
    assert expected in result.stderr, result.stderr


def _symlinked(name: str) -> Callable[[Path], Path]:
    def build(tmp: Path) -> Path:
        folder = make_folder(tmp / "adapter")
        elsewhere = tmp / "elsewhere"
        elsewhere.mkdir()
        (folder / name).rename(elsewhere / name)
        (folder / name).symlink_to(elsewhere / name)
        return folder

    return build


HOSTILE: dict[str, tuple[Callable[[Path], Path], str]] = {
    "config symlink": (_symlinked("adapter_config.json"), "adapter_config.json is a symlink"),
    "weights symlink": (_symlinked("adapter_model.safetensors"), "adapter_model.safetensors is a symlink"),
    "int64 weights": (
        lambda t: make_folder(t / "adapter", a=torch.ones(2, 8, dtype=torch.int64)),
        "has dtype I64 (LoRA weights must be one of F16, BF16, F32, F64)",
    ),
    "lora_alpha 1e38": (lambda t: make_folder(t / "adapter", alpha=1e38), "LoRA scaling 5e+37 (alpha / r) is beyond"),
    "weight 3e38": (
        lambda t: make_folder(t / "adapter", a=torch.full((2, 8), 3e38)),
        "lora_A.weight holds a weight of magnitude 3e+38, beyond the limit of 10000",
    ),
}


@pytest.mark.parametrize("case", list(HOSTILE))
def test_hostile_folders_are_refused_on_import(
    case: str, cli: Cli, registry: registry_pb2_grpc.RegistryServiceStub, tmp_path: Path
) -> None:
    build, expected = HOSTILE[case]
    name = unique_name("imp")
    one_line_error(cli("import", str(build(tmp_path)), name), expected)
    with pytest.raises(grpc.RpcError) as caught:  # nothing was created nor published
        registry.GetAdapter(registry_pb2.GetAdapterRequest(name=name))
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND


@pytest.fixture(scope="module")
def exported(registry_server: ServerProcess, tmp_path_factory: pytest.TempPathFactory) -> str:
    name = unique_name("exp")
    folder = make_folder(tmp_path_factory.mktemp("good") / "adapter")
    ok(run_cli("import", str(folder), name, "--registry", registry_server.address))
    return f"{name}@1"


def test_export_into_a_dangling_symlink_is_refused(exported: str, cli: Cli, tmp_path: Path) -> None:
    target = tmp_path / "out"
    target.symlink_to(tmp_path / "nowhere")
    one_line_error(cli("export", exported, str(target)), "is a symlink")
    assert target.is_symlink() and not (tmp_path / "nowhere").exists()


def test_export_into_a_symlink_to_a_directory_is_refused(exported: str, cli: Cli, tmp_path: Path) -> None:
    (tmp_path / "real").mkdir()
    target = tmp_path / "out"
    target.symlink_to(tmp_path / "real")
    one_line_error(cli("export", exported, str(target)), "is a symlink")
    assert list((tmp_path / "real").iterdir()) == []


def test_export_into_a_non_empty_directory_is_refused_and_a_new_one_works(
    exported: str, cli: Cli, tmp_path: Path
) -> None:
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "keep.txt").write_text("mine")
    one_line_error(cli("export", exported, str(tmp_path / "busy")), "exists and is not an empty directory")
    assert [p.name for p in (tmp_path / "busy").iterdir()] == ["keep.txt"]
    ok(cli("export", exported, str(tmp_path / "fresh")))
    assert sorted(p.name for p in (tmp_path / "fresh").iterdir()) == [
        "adapter_config.json",
        "adapter_model.safetensors",
    ]
