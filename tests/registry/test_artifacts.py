"""The content-addressed artifact store: round trips, verification, crash safety and concurrency."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import struct
import subprocess
import sys
import textwrap
import threading
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
import torch
from safetensors.torch import load_file, save_file

from opentinker.rpc.serving.errors import DataLoss, FailedPrecondition, InvalidArgument, NotFound
from opentinker.weights.artifact_manifest import (
    MANIFEST_NAME,
    ArtifactFile,
    ArtifactRef,
    check_artifact_path,
    parse_uri,
)
from opentinker.weights.artifact_store import ArtifactStore

CONFIG = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]}


def write_peft_folder(folder: Path, seed: int = 0) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(seed)
    tensors = {
        "base_model.model.layers.0.q_proj.lora_A.weight": torch.randn(4, 32, generator=generator),
        "base_model.model.layers.0.q_proj.lora_B.weight": torch.randn(32, 4, generator=generator),
    }
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps(CONFIG, indent=2))
    return folder


def folder_bytes(folder: Path) -> dict[str, bytes]:
    return {path.relative_to(folder).as_posix(): path.read_bytes() for path in folder.rglob("*") if path.is_file()}


def objects(store: ArtifactStore) -> list[str]:
    return sorted(os.listdir(store.root / "sha256"))


def temp_entries(store: ArtifactStore) -> list[str]:
    return sorted(os.listdir(store.root / "tmp"))


@pytest.fixture
def store(tmp_path: Path) -> ArtifactStore:
    return ArtifactStore(tmp_path / "store")


@pytest.fixture
def peft_dir(tmp_path: Path) -> Path:
    return write_peft_folder(tmp_path / "adapter")


def assert_data_loss(call: Callable[[], object]) -> DataLoss:
    with pytest.raises(DataLoss) as caught:
        call()
    assert caught.value.reason == "DIGEST_MISMATCH"
    assert caught.value.code == grpc.StatusCode.DATA_LOSS
    assert caught.value.to_status().code == grpc.StatusCode.DATA_LOSS.value[0]
    return caught.value


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


# -- the chunked writer ------------------------------------------------------------------------------------


def upload(writer_files: dict[str, bytes], store: ArtifactStore, chunk: int = 10) -> ArtifactRef:
    with store.begin() as writer:
        for path, data in writer_files.items():
            writer.add_file(path, len(data), hashlib.sha256(data).hexdigest())
            for start in range(0, len(data), chunk):
                writer.write(data[start : start + chunk])
        return writer.commit()


def test_writer_happy_path(store: ArtifactStore, peft_dir: Path) -> None:
    files = folder_bytes(peft_dir)
    ref = upload(dict(reversed(list(files.items()))), store, chunk=333)  # upload order does not matter
    assert ref == store.commit_dir(peft_dir)
    assert folder_bytes(store.path(ref.uri)).keys() == {*files, MANIFEST_NAME}
    assert upload({"empty": b"", "x": b"1"}, store).size_bytes > 1
    assert temp_entries(store) == []


def test_writer_wrong_sha_is_data_loss_and_leaves_nothing(store: ArtifactStore) -> None:
    writer = store.begin()
    assert len(temp_entries(store)) == 2  # the temp dir and its lock
    writer.add_file("a.bin", 6, hashlib.sha256(b"expected").hexdigest())
    writer.write(b"abc")
    assert_data_loss(lambda: writer.write(b"def"))  # the file's last byte triggers the check
    writer.abort()  # idempotent; the failure already cleaned up
    assert objects(store) == []
    assert temp_entries(store) == []
    with pytest.raises(FailedPrecondition):
        writer.write(b"more")


@pytest.mark.parametrize("mistake", ["too_long", "too_short", "extra_after_full"])
def test_writer_size_mismatch_is_data_loss(store: ArtifactStore, mistake: str) -> None:
    data = b"0123456789"
    writer = store.begin()
    if mistake == "too_long":
        writer.add_file("a", 5, hashlib.sha256(data[:5]).hexdigest())
        assert_data_loss(lambda: writer.write(data))
    elif mistake == "too_short":
        writer.add_file("a", 10, hashlib.sha256(data).hexdigest())
        writer.write(data[:9])
        assert_data_loss(writer.commit)
    else:
        writer.add_file("a", 10, hashlib.sha256(data).hexdigest())
        writer.write(data)
        assert_data_loss(lambda: writer.write(b"!"))
    assert objects(store) == []
    assert temp_entries(store) == []


def test_writer_bad_requests_leave_it_usable(store: ArtifactStore) -> None:
    with store.begin() as writer:
        with pytest.raises(FailedPrecondition):
            writer.write(b"no file yet")
        with pytest.raises(InvalidArgument):
            writer.commit()  # no files
        with pytest.raises(InvalidArgument):
            writer.add_file("a", -1, "0" * 64)
        with pytest.raises(InvalidArgument):
            writer.add_file("a", 1, "not hex")
        writer.add_file("a", 1, hashlib.sha256(b"x").hexdigest())
        with pytest.raises(InvalidArgument):
            writer.add_file("a", 1, hashlib.sha256(b"x").hexdigest())  # a repeat is rejected...
        writer.write(b"x")  # ...and the writer carries on
        ref = writer.commit()
    assert store.path(ref.uri)
    assert temp_entries(store) == []


def test_writer_context_manager_aborts_on_error(store: ArtifactStore) -> None:
    with pytest.raises(RuntimeError), store.begin() as writer:
        writer.add_file("a", 3, hashlib.sha256(b"abc").hexdigest())
        writer.write(b"ab")
        raise RuntimeError("client went away")
    assert objects(store) == []
    assert temp_entries(store) == []


# -- crash safety ------------------------------------------------------------------------------------------


def test_cleanup_temp_removes_crash_leftovers_only(store: ArtifactStore) -> None:
    crashed = store.root / "tmp" / "0123abcd"
    (crashed / "sub").mkdir(parents=True)
    (crashed / "sub" / "partial.safetensors").write_bytes(b"half")
    (store.root / "tmp" / "0123abcd.lock").write_bytes(b"")  # its owner died: nobody holds the flock
    (store.root / "tmp" / "deadbeef.lock").write_bytes(b"")  # died before creating its directory
    (store.root / "tmp" / "nolock").mkdir()

    live = store.begin()  # a live writer in this process: its lock is held
    live.add_file("a", 1, hashlib.sha256(b"a").hexdigest())
    assert store.cleanup_temp() == 3
    assert len(temp_entries(store)) == 2
    live.write(b"a")
    ref = live.commit()
    assert store.path(ref.uri)
    assert store.cleanup_temp() == 0
    assert temp_entries(store) == []


def test_fault_points_in_order(tmp_path: Path) -> None:
    points: list[str] = []
    store = ArtifactStore(tmp_path / "store", fault_hook=points.append)
    ref = store.commit_files({"b.bin": b"b", "a.json": b"{}"})
    assert points == [
        "temp_created",
        "file_written:a.json",
        "file_written:b.bin",
        "manifest_written",
        "before_rename",
        "after_rename",
    ]
    points.clear()
    assert store.commit_files({"a.json": b"{}", "b.bin": b"b"}) == ref
    assert points[-2:] == ["before_rename", "already_committed"]
    points.clear()
    assert store.delete(ref.uri) == ref.size_bytes
    assert points == ["delete_renamed"]


@pytest.mark.parametrize("point", ["file_written:a.json", "manifest_written", "before_rename"])
def test_failure_before_rename_leaves_nothing_visible(tmp_path: Path, point: str) -> None:
    def hook(name: str) -> None:
        if name == point:
            raise RuntimeError(f"injected at {name}")

    store = ArtifactStore(tmp_path / "store", fault_hook=hook)
    files = {"a.json": b"{}", "b.bin": b"b"}
    with pytest.raises(RuntimeError):
        store.commit_files(files)
    expected = ArtifactStore(tmp_path / "elsewhere").commit_files(files)
    assert not store.exists(expected.uri)
    assert objects(store) == []
    assert temp_entries(store) == []  # the failed writer cleaned up after itself
    plain = ArtifactStore(tmp_path / "store")
    assert plain.commit_files(files) == expected
    assert plain.path(expected.uri)


CRASHING_WRITER = textwrap.dedent(
    """
    import os, signal, sys
    from pathlib import Path
    from opentinker.weights.artifact_store import ArtifactStore

    def hook(point: str) -> None:
        if point == sys.argv[2]:
            os.kill(os.getpid(), signal.SIGKILL)

    store = ArtifactStore(Path(sys.argv[1]), fault_hook=hook)
    store.commit_files({"adapter_config.json": b"{}", "adapter_model.safetensors": b"w" * 5000})
    """
)


@pytest.mark.parametrize(
    ("point", "visible"),
    [
        ("temp_created", False),
        ("file_written:adapter_model.safetensors", False),
        ("manifest_written", False),
        ("before_rename", False),
        ("after_rename", True),
    ],
)
def test_sigkill_at_each_point(tmp_path: Path, point: str, visible: bool) -> None:
    root = tmp_path / "store"
    result = subprocess.run([sys.executable, "-c", CRASHING_WRITER, str(root), point], timeout=60)
    assert result.returncode == -signal.SIGKILL
    store = ArtifactStore(root)
    files = {"adapter_config.json": b"{}", "adapter_model.safetensors": b"w" * 5000}
    # Every crash leaves one slot behind: its temp dir and/or its lock file (after the rename, only the lock).
    assert store.cleanup_temp() == 1
    assert temp_entries(store) == []
    assert len(objects(store)) == (1 if visible else 0)
    ref = store.commit_files(files)
    assert store.exists(ref.uri)
    assert store.path(ref.uri)


# -- deletion and concurrency ------------------------------------------------------------------------------


def test_delete_returns_bytes_and_is_idempotent(store: ArtifactStore, peft_dir: Path) -> None:
    ref = store.commit_dir(peft_dir)
    assert store.delete(ref.uri) == ref.size_bytes
    assert not store.exists(ref.uri)
    assert store.delete(ref.uri) == 0
    assert store.delete(ref.sha256) == 0
    with pytest.raises(NotFound):
        store.path(ref.uri)
    assert objects(store) == []
    assert temp_entries(store) == []
    assert store.commit_dir(peft_dir) == ref


def test_concurrent_identical_commits(store: ArtifactStore, peft_dir: Path) -> None:
    files = folder_bytes(peft_dir)
    workers = 4
    barrier = threading.Barrier(workers)

    def hook(point: str) -> None:
        if point == "before_rename":
            barrier.wait(timeout=10)  # every writer renames at the same moment

    racing = ArtifactStore(store.root, fault_hook=hook)
    results: list[ArtifactRef] = []
    errors: list[BaseException] = []

    def commit(index: int) -> None:
        try:
            if index % 2:
                results.append(racing.commit_dir(peft_dir))
            else:
                results.append(racing.commit_files(files))
        except BaseException as error:
            errors.append(error)

    threads = [threading.Thread(target=commit, args=(index,)) for index in range(workers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert errors == []
    assert len(results) == workers
    assert len(set(results)) == 1
    assert objects(store) == [results[0].sha256]
    assert temp_entries(store) == []
    assert folder_bytes(store.path(results[0].uri)).keys() == {*files, MANIFEST_NAME}
