"""The artifact store's chunked writer, crash safety (fault points, SIGKILL), deletion and concurrent commits."""

from __future__ import annotations

import hashlib
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
from artifactutil import assert_data_loss, folder_bytes, objects, temp_entries

from opentinker.rpc.serving.errors import FailedPrecondition, InvalidArgument, NotFound
from opentinker.weights.artifact_manifest import (
    MANIFEST_NAME,
    ArtifactRef,
)
from opentinker.weights.artifact_store import ArtifactStore

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
