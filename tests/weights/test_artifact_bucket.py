"""A trainer's or sampler's bucket with its verified local cache, on every backend: pushes and pulls, the states'
own key space, least-recently-used eviction within --cache-max-bytes, a damaged cached copy fetched again, and
what --store means (a folder needs no bucket; a bucket needs a cache folder)."""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest

from opentinker.rpc.serving.errors import InvalidArgument, NotFound
from opentinker.weights import artifact_bucket
from opentinker.weights.artifact_bucket import Bucket, open_artifacts, store_environment
from opentinker.weights.artifact_manifest import parse_uri
from opentinker.weights.artifact_store import ArtifactStore
from opentinker.weights.object_store import ObjectStore


def _artifact(local: ArtifactStore, seed: int, size: int = 20_000) -> str:
    files = {
        "adapter_config.json": f'{{"r": {seed}}}'.encode(),
        "adapter_model.safetensors": random.Random(seed).randbytes(size),
    }
    return local.commit_files(files).uri


def test_pushed_artifact_is_pulled_into_another_cache(store: ObjectStore, tmp_path: Path) -> None:
    trainer = Bucket(store, ArtifactStore(tmp_path / "trainer-cache"))
    uri = _artifact(trainer.cache, 1)
    pushed = trainer.push(uri)
    assert pushed.bytes_sent == pushed.ref.size_bytes
    assert trainer.push(uri).bytes_sent == 0  # a retried save sends nothing again
    sampler = Bucket(store, ArtifactStore(tmp_path / "sampler-cache"))
    assert sampler.pull(uri) > 0
    assert sampler.cache.ref(uri) == trainer.cache.ref(uri)
    assert sampler.pull(uri) == 0  # cached
    assert (sampler.stats.pulls, sampler.stats.bytes_pulled > 0, trainer.stats.pushes) == (1, True, 2)


def test_states_have_their_own_key_space(store: ObjectStore, tmp_path: Path) -> None:
    """What the registry's sweep of unpublished snapshots lists (sha256/) never includes a saved state."""
    trainer = Bucket(store, ArtifactStore(tmp_path / "trainer-cache"))
    uri = _artifact(trainer.cache, 2)
    trainer.push(uri, "state")
    digest = parse_uri(uri)
    assert not [o for o in store.list("sha256/") if digest in o.key]
    assert [o for o in store.list("states/sha256/") if digest in o.key]
    other = Bucket(store, ArtifactStore(tmp_path / "other-cache"))
    with pytest.raises(NotFound):
        other.pull(uri)  # not a snapshot
    assert other.pull(uri, "state") > 0
    assert other.delete(uri, "state") > 0
    assert not store.list("states/sha256/" + digest)
    assert not other.cache.exists(uri)
    with pytest.raises(NotFound):
        Bucket(store, ArtifactStore(tmp_path / "third-cache")).pull(uri, "state")


def test_cache_evicts_least_recently_used_beyond_its_bound(
    store: ObjectStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(artifact_bucket, "HOLD_S", 0.0)
    source = Bucket(store, ArtifactStore(tmp_path / "source"))
    uris = [_artifact(source.cache, seed) for seed in (10, 11, 12)]
    for uri in uris:
        source.push(uri)
    one = source.cache.ref(uris[0]).size_bytes
    cache = Bucket(store, ArtifactStore(tmp_path / "bounded"), max_bytes=2 * one + one // 2)
    cache.pull(uris[0])
    cache.pull(uris[1])
    cache.pull(uris[0])  # used again: uris[1] is now the least recently used
    cache.pull(uris[2])
    assert [cache.cache.exists(u) for u in uris] == [True, False, True]
    assert cache.stats.evictions == 1 and cache.stats.cached_bytes <= cache.max_bytes
    assert cache.pull(uris[1]) > 0  # an evicted version is fetched again
    assert not cache.cache.exists(uris[0])
    # Recency survives a restart (the entries' mtimes): a new process evicts the oldest first too.
    again = Bucket(store, ArtifactStore(tmp_path / "bounded"), max_bytes=cache.max_bytes)
    again.pull(uris[0])
    assert [again.cache.exists(u) for u in uris] == [True, True, False]


def test_recently_used_entries_are_held(store: ObjectStore, tmp_path: Path) -> None:
    """A pull is read right after, in another thread: nothing used within HOLD_S is evicted under it."""
    source = Bucket(store, ArtifactStore(tmp_path / "source"))
    uris = [_artifact(source.cache, seed) for seed in (20, 21)]
    for uri in uris:
        source.push(uri)
    cache = Bucket(store, ArtifactStore(tmp_path / "bounded"), max_bytes=1)
    for uri in uris:
        cache.pull(uri)
    assert all(cache.cache.exists(u) for u in uris) and cache.stats.evictions == 0


def test_damaged_cached_copy_is_fetched_again(store: ObjectStore, tmp_path: Path) -> None:
    source = Bucket(store, ArtifactStore(tmp_path / "source"))
    uri = _artifact(source.cache, 30)
    source.push(uri)
    cache = Bucket(store, ArtifactStore(tmp_path / "cache"))
    cache.pull(uri)
    weights = cache.cache.path(uri) / "adapter_model.safetensors"
    data = bytearray(weights.read_bytes())
    data[100] ^= 0xFF
    weights.chmod(0o644)
    weights.write_bytes(bytes(data))
    assert cache.pull(uri) > 0
    assert cache.cache.ref(uri) == source.cache.ref(uri)


def test_what_store_names(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    local, bucket = open_artifacts(str(tmp_path / "artifacts"), None)
    assert bucket is None and local.root == tmp_path / "artifacts"
    local, bucket = open_artifacts(f"file://{tmp_path}/other", None)
    assert bucket is None and local.root == tmp_path / "other"
    with pytest.raises(InvalidArgument, match="--cache-dir"):
        open_artifacts("s3://some-bucket/prefix", None)
    local, bucket = open_artifacts("s3://some-bucket/prefix", tmp_path / "cache")
    assert bucket is not None and bucket.describe() == "s3://some-bucket/prefix" and local.root == tmp_path / "cache"
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "very-secret")
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
    shown = store_environment("s3://some-bucket/prefix")
    assert shown["AWS_SECRET_ACCESS_KEY"] == "***" and shown["AWS_ENDPOINT_URL"] == "http://127.0.0.1:9"
    assert store_environment(str(tmp_path)) == {}


def test_a_bucket_cache_writes_without_fsync(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The cache in front of a bucket skips fsync (the bucket is the durable copy; every cache read verifies);
    a plain --store folder, the only copy, still syncs every file and directory."""
    synced: list[int] = []
    real_fsync = os.fsync

    def counted_fsync(fd: int) -> None:
        synced.append(fd)
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", counted_fsync)
    cache, bucket = open_artifacts("s3://some-bucket/prefix", tmp_path / "cache")
    assert bucket is not None
    synced.clear()
    uri = _artifact(cache, 1)
    assert synced == [] and cache.ref(uri).uri == uri
    cache.delete(uri)
    assert synced == []
    folder, _ = open_artifacts(str(tmp_path / "artifacts"), None)
    synced.clear()
    _artifact(folder, 2)
    assert len(synced) >= 4  # two files, the manifest, their directories
