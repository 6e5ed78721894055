"""Artifacts pushed to and pulled from every object-store backend: the manifest goes up last, a repeated push
sends nothing, an unfinished upload is invisible, and a changed, truncated or missing object is refused with
DATA_LOSS or NOT_FOUND while the local store keeps nothing of it."""

from __future__ import annotations

import io
import os
from collections.abc import Callable
from pathlib import Path

import pytest

from opentinker.rpc.serving.errors import DataLoss, NotFound
from opentinker.weights.artifact_manifest import MANIFEST_NAME, parse_uri
from opentinker.weights.artifact_remote import check_remote, object_key, pull, push
from opentinker.weights.artifact_store import ArtifactStore
from opentinker.weights.object_store import PART_BYTES, ObjectStore


def _artifact(local: ArtifactStore, seed: int, big: bool = False) -> str:
    rng = __import__("random").Random(seed)
    files = {
        "adapter_config.json": f'{{"r": {seed}}}'.encode(),
        "adapter_model.safetensors": rng.randbytes(PART_BYTES + 4321 if big else 50_000),
        "nested/extra.bin": rng.randbytes(17),
    }
    return local.commit_files(files).uri


def test_push_check_pull_round_trip(store: ObjectStore, tmp_path: Path) -> None:
    source = ArtifactStore(tmp_path / "trainer")
    uri = _artifact(source, 1, big=True)
    pushed = push(source, store, uri)
    assert pushed.bytes_sent == pushed.ref.size_bytes
    assert check_remote(store, uri) == pushed.ref
    assert push(source, store, uri).bytes_sent == 0  # idempotent: a second push copies 0
    cache = ArtifactStore(tmp_path / "sampler")
    assert pull(store, cache, uri) == pushed.ref.size_bytes - len((source.path(uri) / MANIFEST_NAME).read_bytes())
    assert cache.ref(uri) == source.ref(uri)
    for entry in source.manifest(uri):
        assert (cache.path(uri) / entry.path).read_bytes() == (source.path(uri) / entry.path).read_bytes()
    assert pull(store, cache, uri) == 0  # cached: nothing moves


def test_an_upload_without_its_manifest_is_invisible(store: ObjectStore, tmp_path: Path) -> None:
    """A trainer killed before the manifest went up: the payload is in the bucket, the artifact is not."""
    source = ArtifactStore(tmp_path / "trainer")
    uri = _artifact(source, 2)
    digest = parse_uri(uri)
    for entry in source.manifest(uri):
        store.put_bytes(object_key(digest, entry.path), (source.path(uri) / entry.path).read_bytes())
    with pytest.raises(NotFound) as caught:
        check_remote(store, uri)
    assert caught.value.reason == "ARTIFACT_NOT_FOUND"
    with pytest.raises(NotFound):
        pull(store, ArtifactStore(tmp_path / "sampler"), uri)
    # The finished push resumes: only the manifest is sent.
    assert push(source, store, uri).bytes_sent == len((source.path(uri) / MANIFEST_NAME).read_bytes())
    check_remote(store, uri)


def test_a_changed_byte_is_data_loss_and_leaves_nothing(store: ObjectStore, tmp_path: Path) -> None:
    source = ArtifactStore(tmp_path / "trainer")
    damaged, intact = _artifact(source, 3), _artifact(source, 4)
    push(source, store, damaged)
    push(source, store, intact)
    key = object_key(parse_uri(damaged), "adapter_model.safetensors")
    data = bytearray(store.get_bytes(key))
    data[len(data) // 2] ^= 0x01
    store.put_bytes(key, bytes(data))
    check_remote(store, damaged)  # same size: only the readers' hashing can tell, and must
    cache = ArtifactStore(tmp_path / "sampler")
    with pytest.raises(DataLoss) as caught:
        pull(store, cache, damaged)
    assert caught.value.reason == "DIGEST_MISMATCH"
    assert not cache.exists(damaged)
    pull(store, cache, intact)  # another version is unaffected
    assert cache.ref(intact) == source.ref(intact)


def test_truncated_or_missing_objects_are_refused(store: ObjectStore, tmp_path: Path) -> None:
    source = ArtifactStore(tmp_path / "trainer")
    uri = _artifact(source, 5, big=True)
    push(source, store, uri)
    digest = parse_uri(uri)
    key = object_key(digest, "adapter_model.safetensors")
    whole = store.get_bytes(key)
    store.put_file(key, io.BytesIO(whole[:-10]))
    with pytest.raises(DataLoss, match=r"adapter_model\.safetensors"):
        check_remote(store, uri)
    cache = ArtifactStore(tmp_path / "sampler")
    with pytest.raises(DataLoss):
        pull(store, cache, uri)
    assert not cache.exists(uri)
    store.put_file(key, io.BytesIO(whole))
    store.delete(object_key(digest, "nested/extra.bin"))
    with pytest.raises(NotFound, match=r"nested/extra\.bin"):
        check_remote(store, uri)
    assert not cache.exists(uri)


def test_a_manifest_that_does_not_hash_to_its_key_is_data_loss(store: ObjectStore, tmp_path: Path) -> None:
    source = ArtifactStore(tmp_path / "trainer")
    uri = _artifact(source, 6)
    push(source, store, uri)
    other = _artifact(source, 7)
    push(source, store, other)
    # Swap in another artifact's (valid) manifest: well-formed, but not the one the digest names.
    store.put_bytes(
        object_key(parse_uri(uri), MANIFEST_NAME), store.get_bytes(object_key(parse_uri(other), MANIFEST_NAME))
    )
    with pytest.raises(DataLoss, match="does not hash to its digest"):
        check_remote(store, uri)
    with pytest.raises(DataLoss):
        pull(store, ArtifactStore(tmp_path / "sampler"), uri)


def test_bytes_sent_count_only_what_was_missing(store: ObjectStore, tmp_path: Path) -> None:
    source = ArtifactStore(tmp_path / "trainer")
    uri = _artifact(source, 8)
    digest = parse_uri(uri)
    weights = (source.path(uri) / "adapter_model.safetensors").read_bytes()
    store.put_bytes(object_key(digest, "adapter_model.safetensors"), weights)
    sent = push(source, store, uri).bytes_sent
    assert sent == source.ref(uri).size_bytes - len(weights)
    assert os.path.basename(object_key(digest, "x")) == "x"


def _count_gets(store: ObjectStore, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The keys this store is asked for, whole (get_bytes) or ranged (get_range), in call order."""
    asked: list[str] = []
    for name in ("get_bytes", "get_range"):
        original = getattr(store, name)

        def counted(key: str, *args: int, _original: Callable[..., bytes] = original, _name: str = name) -> bytes:
            asked.append(f"{_name}:{os.path.basename(key)}")
            return _original(key, *args)

        monkeypatch.setattr(store, name, counted)
    return asked


def test_guessed_files_come_with_the_manifest(
    store: ObjectStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A small artifact's expected files are fetched whole alongside its manifest, and land as the same cache
    entry; a guess that is not in the artifact changes nothing, and a large artifact is not guessed at."""
    source = ArtifactStore(tmp_path / "trainer")
    uri, big = _artifact(source, 9), _artifact(source, 10, big=True)
    push(source, store, uri)
    push(source, store, big)
    guess = ("adapter_config.json", "adapter_model.safetensors", "not_there.bin")
    asked = _count_gets(store, monkeypatch)
    cache = ArtifactStore(tmp_path / "sampler", durable=False)
    fetched = pull(store, cache, uri, guess=guess, size_hint=source.ref(uri).size_bytes)
    assert cache.ref(uri) == source.ref(uri)
    assert fetched == source.ref(uri).size_bytes - len((source.path(uri) / MANIFEST_NAME).read_bytes())
    # The guessed files are read whole, once; only the unguessed one is a ranged read.
    assert sorted(a for a in asked if a.startswith("get_range")) == ["get_range:extra.bin"]
    assert asked.count("get_bytes:adapter_model.safetensors") == 1
    asked.clear()
    pull(store, cache, big, guess=guess, size_hint=source.ref(big).size_bytes)
    assert cache.ref(big) == source.ref(big)
    assert not any(a.startswith("get_bytes:adapter") for a in asked)  # too large to guess at: streamed


def test_a_guessed_file_of_another_size_is_data_loss(store: ObjectStore, tmp_path: Path) -> None:
    source = ArtifactStore(tmp_path / "trainer")
    uri = _artifact(source, 11)
    push(source, store, uri)
    key = object_key(parse_uri(uri), "adapter_model.safetensors")
    store.put_bytes(key, store.get_bytes(key) + b"tail")  # a whole-object GET sees the extra bytes
    cache = ArtifactStore(tmp_path / "sampler", durable=False)
    with pytest.raises(DataLoss, match=r"adapter_model\.safetensors is 50004 bytes") as caught:
        pull(store, cache, uri, guess=("adapter_model.safetensors",), size_hint=source.ref(uri).size_bytes)
    assert caught.value.reason == "DIGEST_MISMATCH"
    assert not cache.exists(uri)
