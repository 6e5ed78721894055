"""The model's public name (weights/served_name.py): a hub id given as --model, else --served-model-name, else
the hub id config.json names, else a cache snapshot's hub id, else the directory as given; bad or conflicting names
are refused at startup in one line, before the model loads."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from hubcache import write_hub_cache
from serverproc import opentinker_command

from opentinker.rpc.process.startup import StartupError
from opentinker.rpc.serving.errors import InvalidArgument
from opentinker.weights.model_check import check_model
from opentinker.weights.served_name import served_model_name


def _model_dir(path: Path, config: dict[str, object] | None = None) -> Path:
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(config or {"model_type": "qwen3"}))
    return path


def test_a_hub_id_is_its_own_name(tmp_path: Path) -> None:
    snapshot = _model_dir(tmp_path / "snap")
    assert served_model_name("Qwen/Qwen3-4B-Instruct-2507", None, snapshot) == "Qwen/Qwen3-4B-Instruct-2507"
    assert served_model_name("Qwen/Qwen3-4B-Instruct-2507", "Qwen/Qwen3-4B-Instruct-2507", snapshot)


def test_a_directory_is_named_by_the_flag_then_its_config_then_its_cache_then_its_path(tmp_path: Path) -> None:
    plain = _model_dir(tmp_path / "my-model")
    assert served_model_name(str(plain), "acme/chat-7b", plain) == "acme/chat-7b"
    assert served_model_name(str(plain), None, plain) == str(plain)
    named = _model_dir(tmp_path / "ckpt", {"model_type": "qwen3", "_name_or_path": "Qwen/Qwen3-8B"})
    assert served_model_name(str(named), None, named) == "Qwen/Qwen3-8B"
    # A local path recorded by save_pretrained names no model.
    local = _model_dir(tmp_path / "local", {"_name_or_path": str(tmp_path / "my-model")})
    assert served_model_name(str(local), None, local) == str(local)
    source = _model_dir(tmp_path / "source")
    snapshot = write_hub_cache(source, tmp_path / "hf", "acme/tiny-chat")
    assert served_model_name(str(snapshot), None, snapshot) == "acme/tiny-chat"


@pytest.mark.parametrize("bad", ["", "has space", "/abs/path", "-dash", "x" * 201, "new\nline"])
def test_a_bad_served_name_is_refused(tmp_path: Path, bad: str) -> None:
    model = _model_dir(tmp_path / "m")
    with pytest.raises(InvalidArgument, match="served model name") as info:
        served_model_name(str(model), bad, model)
    assert info.value.reason == "INVALID_SERVED_NAME"


def test_a_served_name_other_than_the_hub_id_is_refused(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgument, match="differs from the hub id"):
        served_model_name("acme/tiny", "acme/other", _model_dir(tmp_path / "snap"))


def test_startup_checks_the_name_before_the_model_loads(tiny_model: Path) -> None:
    assert check_model(str(tiny_model), None, "acme/tiny") == tiny_model
    with pytest.raises(StartupError, match="served model name 'a b'"):
        check_model(str(tiny_model), None, "a b")


@pytest.mark.parametrize("server", ["trainer", "sampler"])
def test_serve_refuses_a_bad_name_in_one_line_exit_2(server: str, tiny_model: Path, tmp_path: Path) -> None:
    args = opentinker_command(
        server,
        "serve",
        "--model",
        str(tiny_model),
        "--registry",
        "127.0.0.1:1",
        "--store",
        str(tmp_path / "store"),
        "--port",
        "0",
        "--served-model-name",
        "a b",
    )
    result = subprocess.run(args, capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 2, result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert "served model name 'a b'" in line and "Traceback" not in result.stderr
