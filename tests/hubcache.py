"""A model directory laid out as the Hugging Face hub client caches it: `hub/models--org--name/snapshots/<rev>/`
with each file a symlink into `blobs/`, and `refs/main` naming the revision."""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

REVISION = "0123456789abcdef0123456789abcdef01234567"


def write_hub_cache(model_dir: Path, hf_home: Path, hub_id: str, revision: str = REVISION) -> Path:
    """`model_dir` as the hub client caches `hub_id`; returns the snapshot directory."""
    repo = hf_home / "hub" / ("models--" + hub_id.replace("/", "--"))
    snapshot = repo / "snapshots" / revision
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(revision)
    for path in sorted(model_dir.iterdir()):
        if path.is_file():
            blob = repo / "blobs" / hashlib.sha256(path.read_bytes()).hexdigest()
            shutil.copyfile(path, blob)
            (snapshot / path.name).symlink_to(os.path.relpath(blob, snapshot))
    return snapshot
