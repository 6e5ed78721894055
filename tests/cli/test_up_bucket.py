"""`opentinker up --store s3://...` (Object store): one flag puts every server on the bucket, the trainer and the
sampler get caches under the workdir, and a save is pushed to the bucket and served from it; the file's own
folder store is overridden. Moto stands in for S3, reached through the standard environment only."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
from pathlib import Path

import pytest
from serverproc import opentinker_command
from storeservers import StoreServer
from test_up_stack import lines_of

from opentinker.client import LoraConfig, SamplingParams, ServiceClient
from opentinker.weights.artifact_manifest import MANIFEST_NAME
from opentinker.weights.artifact_remote import object_key
from opentinker.weights.object_store import ObjectStore, parse_store_url


def test_up_with_a_bucket_store(
    servers: dict[str, StoreServer], tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    moto = servers["s3"]
    url = moto.url("up")
    config = tmp_path / "stack.toml"
    folder = tmp_path / "folder-store"
    shared = f'port = 0\nmodel = "{tiny_model}"\ndevice = "cpu"\nstore = "{folder}"\n'
    config.write_text(shared + "[sampler]\nmax_slots = 4\nmax_seqs = 4\n")
    workdir = tmp_path / "run"
    process = subprocess.Popen(
        opentinker_command("up", "--config", str(config), "--workdir", str(workdir), "--json", "--store", url),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, **moto.env()},
    )
    assert process.stdout is not None
    lines = lines_of(process.stdout)
    try:
        try:
            first = json.loads(lines.get(timeout=280))
        except queue.Empty:
            process.kill()
            pytest.fail(f"opentinker up printed nothing: {process.communicate()}")
        assert first["event"] == "serving", first
        s = first["servers"]
        with ServiceClient(
            trainer=s["trainer"]["address"], sampler=s["sampler"]["address"], registry=s["registry"]["address"]
        ) as client:
            version = client.create_training_client("team-a/bucket", LoraConfig(rank=4)).save_snapshot()
            sampled = client.create_sampling_client("team-a/bucket@1").sample([5, 6, 7], SamplingParams(max_tokens=3))
            assert len(sampled.sequences[0].tokens) == 3
        for name, value in moto.env().items():
            monkeypatch.setenv(name, value)
        bucket = ObjectStore(parse_store_url(url))
        assert bucket.head(object_key(version.sha256, MANIFEST_NAME)) is not None
        assert not (folder / "sha256").exists()  # --store won over the file's folder
        for service in ("trainer", "sampler"):
            assert (workdir / service / "cache" / "sha256" / version.sha256).is_dir(), service
    finally:
        process.send_signal(signal.SIGINT)
        process.wait(60)
    assert process.returncode == 0, process.stderr.read() if process.stderr else ""
