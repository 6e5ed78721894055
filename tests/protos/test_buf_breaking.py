"""buf breaking catches incompatible proto changes, and protos/buf-check.sh (`make protos-check`) finds the
base branch to compare against: local main, else origin/main, else it says it skipped (or fails on demand)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PROTO_DIR = ROOT / "protos"
BUF = shutil.which("buf") or str(Path(sys.executable).parent / "buf")

pytestmark = pytest.mark.skipif(not Path(BUF).exists(), reason="buf not installed (PyPI package buf-bin, dev extra)")


def copy_protos(dest: Path) -> Path:
    """The .proto files, buf.yaml and the check script, without the generated code."""
    shutil.copytree(PROTO_DIR, dest, ignore=shutil.ignore_patterns("*.py", "*.pyi", "py.typed", "__pycache__"))
    return dest


def edit(proto: Path, old: str, new: str) -> None:
    text = proto.read_text()
    assert text.count(old) == 1, f"{old!r} not found once in {proto.name}"
    proto.write_text(text.replace(old, new))


def buf_breaking(head: Path, base: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([BUF, "breaking", str(head), "--against", str(base)], capture_output=True, text=True)


@pytest.fixture
def base_and_head(tmp_path: Path) -> tuple[Path, Path]:
    return copy_protos(tmp_path / "base"), copy_protos(tmp_path / "head")


def test_unchanged_and_comment_only_edits_pass(base_and_head: tuple[Path, Path]) -> None:
    base, head = base_and_head
    assert buf_breaking(head, base).returncode == 0
    edit(
        head / "opentinker/v1/registry.proto",
        "  // Adapters visible to the caller",
        "  // All adapters visible to the caller",
    )
    result = buf_breaking(head, base)
    assert result.returncode == 0, result.stdout + result.stderr


def test_removed_field_is_breaking(base_and_head: tuple[Path, Path]) -> None:
    base, head = base_and_head
    edit(head / "opentinker/v1/registry.proto", "  string description = 11;\n", "")
    result = buf_breaking(head, base)
    assert result.returncode != 0
    assert 'field "11" with name "description" on message "Adapter" was deleted' in result.stdout


def test_renamed_rpc_is_breaking(base_and_head: tuple[Path, Path]) -> None:
    base, head = base_and_head
    edit(head / "opentinker/v1/sampler.proto", "rpc ComputeLogprobs(", "rpc ScoreTokens(")
    result = buf_breaking(head, base)
    assert result.returncode != 0
    assert '"ComputeLogprobs" on service "SamplerService" was deleted' in result.stdout


def test_changed_field_type_is_breaking(base_and_head: tuple[Path, Path]) -> None:
    base, head = base_and_head
    edit(head / "opentinker/v1/common.proto", "  uint32 rank = 1;", "  uint64 rank = 1;")
    result = buf_breaking(head, base)
    assert result.returncode != 0
    assert '"rank" on message "LoraConfig" changed type' in result.stdout


# The script against throwaway git repositories holding a copy of protos/.

GIT_ENV = {
    **os.environ,
    "GIT_AUTHOR_NAME": "t",
    "GIT_AUTHOR_EMAIL": "t@example.com",
    "GIT_COMMITTER_NAME": "t",
    "GIT_COMMITTER_EMAIL": "t@example.com",
    "GIT_CONFIG_GLOBAL": os.devnull,
    "GIT_CONFIG_NOSYSTEM": "1",
}


def git(repo: Path, *args: str) -> str:
    result = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, env=GIT_ENV)
    assert result.returncode == 0, result.stderr
    return result.stdout


def check(repo: Path, **env: str) -> subprocess.CompletedProcess[str]:
    script = repo / "protos" / "buf-check.sh"
    # The caller's PROTOS_* settings (CI exports PROTOS_BASE_REQUIRED=1) must not leak into these cases.
    inherited = {key: value for key, value in os.environ.items() if not key.startswith("PROTOS_")}
    return subprocess.run([str(script)], capture_output=True, text=True, env={**inherited, "BUF": BUF, **env})


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    """A repository whose main branch holds today's protos, with a branch `feature` checked out."""
    repo = tmp_path / "repo"
    repo.mkdir()
    git(repo, "init", "-q", "-b", "main")
    copy_protos(repo / "protos")
    git(repo, "add", "protos")
    git(repo, "commit", "-q", "-m", "protos")
    git(repo, "checkout", "-q", "-b", "feature")
    return repo


def break_contract(repo: Path) -> None:
    """Deletes TrainingAdapter.seed (field 4)."""
    seed = "  uint64 seed = 4;\n  // Optimizer steps"
    edit(repo / "protos/opentinker/v1/trainer.proto", seed, "  // Optimizer steps")


def test_script_compares_with_local_main(repo: Path) -> None:
    result = check(repo)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "against refs/heads/main" in result.stdout
    break_contract(repo)  # uncommitted edits count: they are what would be committed next
    result = check(repo)
    assert result.returncode != 0
    assert 'field "4" with name "seed" on message "TrainingAdapter" was deleted' in result.stdout


def test_script_on_main_itself_checks_uncommitted_edits(repo: Path) -> None:
    git(repo, "checkout", "-q", "main")
    assert check(repo).returncode == 0
    break_contract(repo)
    assert check(repo).returncode != 0


def test_script_falls_back_to_origin_main(repo: Path, tmp_path: Path) -> None:
    clone = tmp_path / "clone"
    git(tmp_path, "clone", "-q", "--branch", "feature", str(repo), str(clone))
    assert "main" not in git(clone, "branch", "--list", "main")  # no local main, only origin/main
    break_contract(clone)
    result = check(clone)
    assert result.returncode != 0
    assert "against refs/remotes/origin/main" in result.stdout


def test_script_without_a_base_says_it_skipped_or_fails_on_demand(repo: Path) -> None:
    git(repo, "branch", "-q", "-D", "main")
    break_contract(repo)
    skipped = check(repo)
    assert skipped.returncode == 0, skipped.stdout + skipped.stderr
    assert "no 'main' or 'origin/main'" in skipped.stdout and "SKIPPED" in skipped.stdout
    required = check(repo, PROTOS_BASE_REQUIRED="1")
    assert required.returncode != 0
    assert "no 'main' or 'origin/main'" in required.stderr


def test_script_lint_failure_fails(repo: Path) -> None:
    with (repo / "protos/opentinker/v1/common.proto").open("a") as handle:
        handle.write("message bad_name {}\n")
    result = check(repo)
    assert result.returncode != 0
    assert 'Message name "bad_name" should be PascalCase' in result.stdout
