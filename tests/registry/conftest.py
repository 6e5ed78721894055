"""Fixtures of the artifact store tests (test_artifacts, test_artifact_writer)."""

from __future__ import annotations

from pathlib import Path

import pytest
from artifactutil import write_peft_folder

from opentinker.weights.artifact_store import ArtifactStore


@pytest.fixture
def store(tmp_path: Path) -> ArtifactStore:
    return ArtifactStore(tmp_path / "store")


@pytest.fixture
def peft_dir(tmp_path: Path) -> Path:
    return write_peft_folder(tmp_path / "adapter")
