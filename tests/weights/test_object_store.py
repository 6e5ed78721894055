"""One conformance suite for every object-store backend, against real servers on loopback: a local folder, moto
(S3, IAM enforced) and Azurite (Azure Blob). Each backend must put, get, head, list, delete, upload multipart,
read ranges, survive two writers of one key at once, and tell a missing key from refused credentials from an
unreachable store, without a secret in any message."""

from __future__ import annotations

import io
import os
import threading
from pathlib import Path

import pytest
from storeservers import StoreServer, free_port

from opentinker.rpc.serving.errors import InvalidArgument, NotFound, PermissionDenied, Unavailable
from opentinker.weights.object_store import PART_BYTES, ObjectStore, credential_env, parse_store_url


def test_put_get_head_list_delete(store: ObjectStore) -> None:
    store.put_bytes("a/one.bin", b"first")
    store.put_bytes("a/two.bin", b"second!")
    store.put_bytes("b/three.bin", b"")
    assert store.get_bytes("a/one.bin") == b"first"
    assert store.get_bytes("b/three.bin") == b""
    head = store.head("a/two.bin")
    assert head is not None and head.size == 7
    assert store.head("a/absent.bin") is None
    assert sorted(o.key for o in store.list("a/")) == ["a/one.bin", "a/two.bin"]
    assert sorted((o.key, o.size) for o in store.list()) == [("a/one.bin", 5), ("a/two.bin", 7), ("b/three.bin", 0)]
    store.put_bytes("a/one.bin", b"replaced")
    assert store.get_bytes("a/one.bin") == b"replaced"
    store.delete("a/one.bin")
    store.delete("a/one.bin")  # a repeated delete is not an error
    assert store.head("a/one.bin") is None
    assert [o.key for o in store.list("a/")] == ["a/two.bin"]


def test_multipart_upload_and_ranged_reads(store: ObjectStore) -> None:
    data = os.urandom(2 * PART_BYTES + 12345)  # three parts, the last one short
    store.put_file("big/blob", io.BytesIO(data))
    head = store.head("big/blob")
    assert head is not None and head.size == len(data)
    assert store.get_range("big/blob", PART_BYTES - 3, PART_BYTES + 5) == data[PART_BYTES - 3 : PART_BYTES + 5]
    assert b"".join(store.iter_ranges("big/blob", len(data), span=1 << 20)) == data
    assert b"".join(store.iter_ranges("big/blob", len(data))) == data
    chunks = list(store.stream("big/blob", len(data)))  # one streaming GET, read ahead
    assert b"".join(chunks) == data and len(chunks) >= 2
    assert b"".join(store.stream("big/blob", PART_BYTES)) == data[:PART_BYTES]  # never past what was asked


def test_stream_of_a_shorter_object_fails_instead_of_ending_early(store: ObjectStore) -> None:
    store.put_bytes("short", b"x" * 1000)
    with pytest.raises(Unavailable):
        b"".join(store.stream("short", 5000))


def test_two_writers_of_one_key_leave_whole_bytes(store: ObjectStore) -> None:
    """Content-addressed keys: two trainers may upload the same digest at once; either write wins, whole."""
    data = os.urandom(PART_BYTES + 999)
    errors: list[BaseException] = []

    def write() -> None:
        try:
            store.put_file("sha256/same", io.BytesIO(data))
        except BaseException as exc:
            errors.append(exc)

    writers = [threading.Thread(target=write) for _ in range(2)]
    for writer in writers:
        writer.start()
    for writer in writers:
        writer.join()
    assert not errors
    assert store.get_bytes("sha256/same") == data


def test_missing_key_is_not_found(store: ObjectStore) -> None:
    with pytest.raises(NotFound) as caught:
        store.get_bytes("never/written")
    assert caught.value.reason == "OBJECT_NOT_FOUND"
    assert store.location.url in caught.value.message
    with pytest.raises(NotFound):
        store.get_range("never/written", 0, 4)


@pytest.mark.parametrize("backend", ["s3", "az"])
def test_wrong_credentials_are_permission_denied_and_never_printed(
    backend: str, servers: dict[str, StoreServer], monkeypatch: pytest.MonkeyPatch
) -> None:
    server = servers[backend]
    secret = "s3cr3t-SENTINEL-do-not-print"
    for name, value in server.env().items():
        monkeypatch.setenv(name, value)
    if backend == "s3":
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret)
    else:
        good = server.env()["AZURE_STORAGE_CONNECTION_STRING"]
        wrong_key = "AccountKey=" + "QUJD" * 22 + ";"  # valid base64, not the account's key
        monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", _replace_key(good, wrong_key) + f"Note={secret};")
    store = ObjectStore(parse_store_url(server.url("denied")), retries=0, retry_budget_s=2)
    with pytest.raises(PermissionDenied) as caught:
        store.get_bytes("anything")
    assert caught.value.reason == "STORE_PERMISSION_DENIED"
    assert server.url("denied") in caught.value.message
    assert secret not in caught.value.message and secret not in str(caught.value.metadata)
    assert secret not in store.describe()
    shown = credential_env(parse_store_url(server.url("denied")).scheme)
    assert secret not in str(shown) and "***" in shown.values()


def _replace_key(connection: str, key_field: str) -> str:
    return "".join(
        part + ";" if not part.startswith("AccountKey=") else key_field for part in connection.split(";") if part
    )


@pytest.mark.parametrize("url", ["s3://opentinker-test/x", "az://opentinker-test/x", "gs://opentinker-test/x"])
def test_unreachable_store_is_unavailable(url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    monkeypatch.setenv("AWS_ENDPOINT_URL", dead)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "id")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "key")
    monkeypatch.setenv("AWS_REGION", "us-east-1")
    monkeypatch.setenv(
        "AZURE_STORAGE_CONNECTION_STRING",
        f"AccountName=devstoreaccount1;AccountKey={'QUJD' * 22};BlobEndpoint={dead}/devstoreaccount1;",
    )
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", dead)
    store = ObjectStore(parse_store_url(url), retries=0, retry_budget_s=1, timeout_s=2)
    with pytest.raises(Unavailable) as caught:
        store.put_bytes("k", b"v")
    assert caught.value.reason == "STORE_UNAVAILABLE"
    assert caught.value.message.startswith(url)


@pytest.mark.parametrize(
    ("text", "scheme", "bucket", "prefix"),
    [
        ("s3://my-bucket/some/prefix/", "s3", "my-bucket", "some/prefix"),
        ("az://container", "az", "container", ""),
        ("gs://bucket.name/p", "gs", "bucket.name", "p"),
        ("gcs://bucket/p", "gs", "bucket", "p"),
    ],
)
def test_store_urls(text: str, scheme: str, bucket: str, prefix: str) -> None:
    location = parse_store_url(text)
    assert (location.scheme, location.bucket, location.prefix) == (scheme, bucket, prefix)
    assert location.remote


def test_plain_paths_and_file_urls_are_local(tmp_path: Path) -> None:
    for text in (str(tmp_path / "a"), f"file://{tmp_path / 'a'}"):
        location = parse_store_url(text)
        assert location.scheme == "file" and not location.remote
        assert location.prefix == str((tmp_path / "a").resolve())


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("", "empty"),
        ("ftp://host/x", "unknown store scheme"),
        ("s3://key:secret@bucket/x", "no credentials"),
        ("s3://B/x", "not a valid bucket"),
        ("s3://bucket/a//b", "path segment"),
        ("s3://bucket/../b", "path segment"),
        ("file://relative/x", "absolute path"),
    ],
)
def test_bad_store_urls_say_what_is_wrong(text: str, says: str) -> None:
    with pytest.raises(InvalidArgument, match=says):
        parse_store_url(text)
