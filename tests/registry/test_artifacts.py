"""The content-addressed artifact store: round trips, verification on read, URIs and path rules."""

from __future__ import annotations

import hashlib
import json
import os
import struct
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
import torch
from artifactutil import assert_data_loss, folder_bytes, objects, temp_entries, write_peft_folder
from safetensors.torch import load_file

from opentinker.rpc.serving.errors import DataLoss, InvalidArgument, NotFound
from opentinker.weights.artifact_manifest import (
    MANIFEST_NAME,
    ArtifactFile,
    check_artifact_path,
    parse_uri,
)
from opentinker.weights.artifact_store import ArtifactStore

# -- round trips ---------------------------------------------------------------------------------------------


def test_commit_dir_round_trip(store: ArtifactStore, peft_dir: Path) -> None:
    ref = store.commit_dir(peft_dir)
    assert ref.uri == f"sha256:{ref.sha256}"
    assert len(ref.sha256) == 64

    directory = store.path(ref.uri)
    assert directory == store.root / "sha256" / ref.sha256
    stored = folder_bytes(directory)
    manifest_bytes = stored.pop(MANIFEST_NAME)
    assert stored == folder_bytes(peft_dir)
    assert hashlib.sha256(manifest_bytes).hexdigest() == ref.sha256
    assert ref.size_bytes == sum(map(len, stored.values())) + len(manifest_bytes)

    original = load_file(str(peft_dir / "adapter_model.safetensors"))
    loaded = load_file(str(directory / "adapter_model.safetensors"))
    assert original.keys() == loaded.keys()
    assert all(torch.equal(original[key], loaded[key]) for key in original)

    # The manifest is canonical JSON with the files sorted by path.
    document = json.loads(manifest_bytes)
    assert manifest_bytes == (json.dumps(document, sort_keys=True, separators=(",", ":")) + "\n").encode()
    assert document["format"] == 1
    assert [entry["path"] for entry in document["files"]] == [
        "adapter_config.json",
        "adapter_model.safetensors",
    ]
    assert store.manifest(ref.uri) == [
        ArtifactFile(name, hashlib.sha256(data).hexdigest(), len(data)) for name, data in sorted(stored.items())
    ]
    assert store.ref(ref.sha256) == ref
    assert store.exists(ref.uri)
    assert temp_entries(store) == []


def test_same_content_twice_is_one_artifact(store: ArtifactStore, peft_dir: Path, tmp_path: Path) -> None:
    first = store.commit_dir(peft_dir)
    second = store.commit_dir(peft_dir)
    copy = write_peft_folder(tmp_path / "copy")  # same seed: same bytes, different folder
    third = store.commit_dir(copy)
    assert first == second == third
    assert objects(store) == [first.sha256]
    assert temp_entries(store) == []

    other = store.commit_dir(write_peft_folder(tmp_path / "other", seed=1))
    assert other.sha256 != first.sha256
    assert objects(store) == sorted([first.sha256, other.sha256])


def test_commit_files_matches_commit_dir(store: ArtifactStore, peft_dir: Path) -> None:
    from_dir = store.commit_dir(peft_dir)
    from_files = store.commit_files(folder_bytes(peft_dir))
    assert from_files == from_dir


def test_nested_paths_and_empty_files(store: ArtifactStore, tmp_path: Path) -> None:
    src = tmp_path / "nested"
    (src / "sub" / "deeper").mkdir(parents=True)
    (src / "top.bin").write_bytes(b"top")
    (src / "sub" / "manifest.json").write_bytes(b"only reserved at the top level")
    (src / "sub" / "deeper" / "empty").write_bytes(b"")
    ref = store.commit_dir(src)
    assert [entry.path for entry in store.manifest(ref.uri)] == [
        "sub/deeper/empty",
        "sub/manifest.json",
        "top.bin",
    ]
    assert store.commit_files(folder_bytes(src)) == ref
    directory = store.path(ref.uri)
    assert (directory / "sub" / "deeper" / "empty").read_bytes() == b""


def test_iter_chunks_streams_every_file(store: ArtifactStore) -> None:
    files = {"a.bin": os.urandom(100), "b/empty": b"", "c.txt": b"hello"}
    ref = store.commit_files(files)
    received: dict[str, bytearray] = {}
    counts: dict[str, int] = {}
    for entry, chunk in store.iter_chunks(ref.uri, chunk_size=7):
        assert len(chunk) <= 7
        received.setdefault(entry.path, bytearray()).extend(chunk)
        counts[entry.path] = counts.get(entry.path, 0) + 1
    assert {path: bytes(data) for path, data in received.items()} == files
    assert counts == {"a.bin": 15, "b/empty": 1, "c.txt": 1}
    with pytest.raises(InvalidArgument):
        store.iter_chunks(ref.uri, chunk_size=0)


# -- verification ------------------------------------------------------------------------------------------


def flip_tensor_bit(directory: Path) -> None:
    path = directory / "adapter_model.safetensors"
    data = bytearray(path.read_bytes())
    (header_size,) = struct.unpack("<Q", data[:8])
    data[8 + header_size + 5] ^= 0x01  # inside the tensor data region: the header stays valid
    path.write_bytes(bytes(data))


def truncate(directory: Path) -> None:
    path = directory / "adapter_model.safetensors"
    path.write_bytes(path.read_bytes()[:-1])


def delete_file(directory: Path) -> None:
    (directory / "adapter_config.json").unlink()


def add_extra_file(directory: Path) -> None:
    (directory / "README.md").write_text("not in the manifest")


def add_extra_dir(directory: Path) -> None:
    (directory / "stray").mkdir()


def tamper_manifest(directory: Path) -> None:
    path = directory / MANIFEST_NAME
    document = json.loads(path.read_bytes())
    document["files"][0]["size"] += 1
    path.write_bytes((json.dumps(document, sort_keys=True, separators=(",", ":")) + "\n").encode())


def reformat_manifest(directory: Path) -> None:
    path = directory / MANIFEST_NAME
    path.write_text(json.dumps(json.loads(path.read_bytes()), indent=2))


def delete_manifest(directory: Path) -> None:
    (directory / MANIFEST_NAME).unlink()


def swap_in_symlink(directory: Path) -> None:
    target = directory.parent.parent / "outside.json"
    target.write_bytes((directory / "adapter_config.json").read_bytes())
    (directory / "adapter_config.json").unlink()
    (directory / "adapter_config.json").symlink_to(target)


@pytest.mark.parametrize(
    "corrupt",
    [
        flip_tensor_bit,
        truncate,
        delete_file,
        add_extra_file,
        add_extra_dir,
        tamper_manifest,
        reformat_manifest,
        delete_manifest,
        swap_in_symlink,
    ],
)
def test_corruption_is_data_loss(store: ArtifactStore, peft_dir: Path, corrupt: Callable[[Path], None]) -> None:
    ref = store.commit_dir(peft_dir)
    corrupt(store.path(ref.uri))
    error = assert_data_loss(lambda: store.path(ref.uri))
    assert error.metadata["uri"] == ref.uri
    assert_data_loss(lambda: store.manifest(ref.uri))
    assert_data_loss(lambda: store.ref(ref.uri))
    assert_data_loss(lambda: store.iter_chunks(ref.uri))  # before the first chunk
    assert store.exists(ref.uri)  # present but unusable

    # Committing the same content again repairs the stored copy.
    assert store.commit_dir(peft_dir) == ref
    assert folder_bytes(store.path(ref.uri)).keys() == {*folder_bytes(peft_dir), MANIFEST_NAME}
    assert temp_entries(store) == []


def test_corruption_while_streaming_is_data_loss(store: ArtifactStore, peft_dir: Path) -> None:
    ref = store.commit_dir(peft_dir)
    chunks = store.iter_chunks(ref.uri, chunk_size=64)  # verified here
    flip_tensor_bit(store.root / "sha256" / ref.sha256)
    with pytest.raises(DataLoss) as caught:
        list(chunks)
    assert caught.value.reason == "DIGEST_MISMATCH"


def test_unknown_digest_is_not_found(store: ArtifactStore) -> None:
    uri = "sha256:" + "ab" * 32
    for call in (store.path, store.manifest, store.ref, store.iter_chunks):
        with pytest.raises(NotFound) as caught:
            call(uri)
        assert caught.value.reason == "ARTIFACT_NOT_FOUND"
        assert caught.value.code == grpc.StatusCode.NOT_FOUND
    assert not store.exists(uri)


def test_parse_uri() -> None:
    digest = "0123456789abcdef" * 4
    assert parse_uri(f"sha256:{digest}") == digest
    assert parse_uri(digest) == digest
    assert parse_uri(digest.upper()) == digest
    for bad in ["", "sha256:", digest[:-1], digest + "0", f"md5:{digest}", f"sha256:{digest}\n", "z" * 64]:
        with pytest.raises(InvalidArgument) as caught:
            parse_uri(bad)
        assert caught.value.reason == "INVALID_ARTIFACT_URI"
        assert caught.value.code == grpc.StatusCode.INVALID_ARGUMENT


def test_store_methods_reject_bad_uris(store: ArtifactStore) -> None:
    for call in (store.path, store.manifest, store.exists, store.delete, store.iter_chunks):
        with pytest.raises(InvalidArgument) as caught:
            call("sha256:../../etc")
        assert caught.value.reason == "INVALID_ARTIFACT_URI"


BAD_PATHS = ["", "/abs", "../up", "a/../b", "a//b", "a/./b", "a/", "a\\b", "x\nnl", MANIFEST_NAME, "a" * 256]


@pytest.mark.parametrize("bad", BAD_PATHS)
def test_bad_paths_are_rejected(store: ArtifactStore, bad: str) -> None:
    with pytest.raises(InvalidArgument) as caught:
        check_artifact_path(bad)
    assert caught.value.reason == "INVALID_ARTIFACT_PATH"
    with pytest.raises(InvalidArgument) as caught:
        store.commit_files({"ok.bin": b"x", bad: b"y"})
    assert caught.value.reason == "INVALID_ARTIFACT_PATH"
    with store.begin() as writer, pytest.raises(InvalidArgument) as caught:
        writer.add_file(bad, 1, hashlib.sha256(b"y").hexdigest())
    assert caught.value.reason == "INVALID_ARTIFACT_PATH"
    assert objects(store) == []
    assert temp_entries(store) == []


def test_overlapping_paths_are_rejected(store: ArtifactStore) -> None:
    with pytest.raises(InvalidArgument) as caught:
        store.commit_files({"a": b"file", "a/b": b"a is a directory here"})
    assert caught.value.reason == "INVALID_ARTIFACT_PATH"
    assert objects(store) == []


def test_commit_dir_rejects_symlinks_and_empty_sources(store: ArtifactStore, peft_dir: Path, tmp_path: Path) -> None:
    (peft_dir / "link.json").symlink_to(peft_dir / "adapter_config.json")
    with pytest.raises(InvalidArgument) as caught:
        store.commit_dir(peft_dir)
    assert caught.value.reason == "INVALID_ARTIFACT_SOURCE"
    (peft_dir / "link.json").unlink()
    (peft_dir / "linked_dir").symlink_to(tmp_path, target_is_directory=True)
    with pytest.raises(InvalidArgument):
        store.commit_dir(peft_dir)

    (tmp_path / "empty").mkdir()
    with pytest.raises(InvalidArgument) as caught:
        store.commit_dir(tmp_path / "empty")
    assert caught.value.reason == "EMPTY_ARTIFACT"
    with pytest.raises(InvalidArgument) as caught:
        store.commit_dir(tmp_path / "missing")
    assert caught.value.reason == "INVALID_ARTIFACT_SOURCE"
    with pytest.raises(InvalidArgument):
        store.commit_files({})
    assert objects(store) == []
    assert temp_entries(store) == []
