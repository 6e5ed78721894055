"""The `opentinker` console script, run as users run it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from opentinker.client.tiny_model import model_files_digest


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "opentinker.cli.main", *args], capture_output=True, text=True, timeout=300
    )


def test_make_tiny_model_cli_round_trip(tmp_path: Path) -> None:
    for arch in ("qwen2", "llama"):
        result = run_cli("make-tiny-model", str(tmp_path / arch), "--arch", arch, "--seed", "3")
        assert result.returncode == 0, result.stderr
        assert f"wrote {arch} model" in result.stdout
    again = run_cli("make-tiny-model", str(tmp_path / "again"), "--arch", "llama", "--seed", "3")
    assert again.returncode == 0, again.stderr
    assert model_files_digest(tmp_path / "again") == model_files_digest(tmp_path / "llama")
    assert model_files_digest(tmp_path / "qwen2") != model_files_digest(tmp_path / "llama")


def test_bad_arch_is_a_usage_error(tmp_path: Path) -> None:
    result = run_cli("make-tiny-model", str(tmp_path / "x"), "--arch", "gpt2")
    assert result.returncode == 2
    assert "arch must be qwen2 or llama" in result.stderr
    assert "Traceback" not in result.stderr
