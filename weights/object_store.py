"""One API over S3, Azure Blob, GCS and a local folder (obstore), keyed by a store URL.

``--store`` takes ``s3://bucket/prefix``, ``az://container/prefix``, ``gs://bucket/prefix``, ``file:///path`` or a
plain path. Credentials and endpoints come from the standard environment only (the AWS_*, AZURE_STORAGE_* and
GOOGLE_APPLICATION_CREDENTIALS / STORAGE_EMULATOR_HOST variables), so nothing secret is ever in a flag, a config
file or a log line: ``describe()`` names the URL, ``credential_env()`` says which variables are set, masked.

Every failure becomes one of our errors with the store's URL in its message: a missing key NotFound, refused or
wrong credentials PermissionDenied, anything else (unreachable, timed out, a 5xx) Unavailable. Calls are blocking
(obstore releases the GIL while it waits); callers on an event loop run them in a thread.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO, Final, Literal, TypeVar

import obstore
from obstore.exceptions import NotFoundError, PermissionDeniedError, UnauthenticatedError
from obstore.store import AzureStore, GCSStore, LocalStore, S3Store

if TYPE_CHECKING:
    from obstore import GetOptions, ObjectMeta  # typing only (in the stubs)
    from obstore.store import AzureConfig, BackoffConfig, ClientConfig, GCSCredential, RetryConfig

from opentinker.rpc.serving.errors import InvalidArgument, NotFound, PermissionDenied, ServiceError, Unavailable

Scheme = Literal["s3", "az", "gs", "file"]
_SCHEMES: Final[dict[str, Scheme]] = {"s3": "s3", "az": "az", "azure": "az", "gs": "gs", "gcs": "gs"}
_BUCKET: Final = re.compile(r"[a-z0-9][a-z0-9.\-_]{1,220}[a-z0-9]")
PART_BYTES: Final = 8 << 20  # multipart part size and ranged-read span: S3's minimum part is 5 MiB
PARALLEL: Final = 4
PARALLEL_FROM: Final = 1 << 30  # objects this large are read as PARALLEL ranged reads
PUT_ATTEMPTS: Final = 3
# The variables each backend reads; their values are never shown, only whether they are set.
CREDENTIAL_ENV: Final[dict[Scheme, tuple[str, ...]]] = {
    "s3": ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_REGION", "AWS_ENDPOINT_URL"),
    "az": ("AZURE_STORAGE_ACCOUNT_NAME", "AZURE_STORAGE_ACCOUNT_KEY", "AZURE_STORAGE_CONNECTION_STRING"),
    "gs": ("GOOGLE_APPLICATION_CREDENTIALS", "STORAGE_EMULATOR_HOST"),
    "file": (),
}
_SECRET_ENV: Final = frozenset(
    {"AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AZURE_STORAGE_ACCOUNT_KEY", "AZURE_STORAGE_CONNECTION_STRING"}
)
_T = TypeVar("_T")


@dataclass(frozen=True)
class StoreLocation:
    """Where a store lives: a bucket (container) and key prefix in the cloud, or a folder on this machine."""

    scheme: Scheme
    bucket: str  # "" for file
    prefix: str  # no leading or trailing "/"; for file, the absolute folder
    url: str  # canonical, printable: no secret is ever part of it

    @property
    def remote(self) -> bool:
        return self.scheme != "file"


@dataclass(frozen=True)
class ObjectInfo:
    key: str  # relative to the store's prefix
    size: int
    etag: str | None
    modified: float = 0.0  # last written, seconds since the epoch (the store's clock)


def parse_store_url(text: str) -> StoreLocation:
    """A store URL or a plain path; InvalidArgument naming what is wrong otherwise."""
    text = text.strip()
    if not text:
        raise InvalidArgument("the store is empty: give a path or s3://, az://, gs://, file:// URL", field="store")
    if "://" not in text:
        folder = Path(text).expanduser().resolve()
        return StoreLocation("file", "", str(folder), f"file://{folder}")
    scheme_text, rest = text.split("://", 1)
    if scheme_text == "file":
        if not rest.startswith("/"):
            raise InvalidArgument(f"{text!r}: a file:// URL needs an absolute path (file:///path)", field="store")
        folder = Path(rest).resolve()
        return StoreLocation("file", "", str(folder), f"file://{folder}")
    scheme = _SCHEMES.get(scheme_text.lower())
    if scheme is None:
        raise InvalidArgument(
            f"{text!r}: unknown store scheme {scheme_text!r} (s3://, az://, gs://, file:// or a path)", field="store"
        )
    if "@" in rest or "?" in rest or "#" in rest:
        # Credentials in the URL would end up in logs and --print-config: they belong in the environment.
        raise InvalidArgument(
            f"{scheme}:// URL: no credentials, query or fragment in it (credentials come from the environment)",
            field="store",
        )
    bucket, _, prefix = rest.partition("/")
    if not _BUCKET.fullmatch(bucket):
        raise InvalidArgument(f"{scheme}://{bucket}: not a valid bucket or container name", field="store")
    prefix = prefix.strip("/")
    if any(part in ("", ".", "..") for part in prefix.split("/")) and prefix:
        raise InvalidArgument(f"{scheme}://{bucket}/{prefix}: empty, '.' or '..' path segment", field="store")
    url = f"{scheme}://{bucket}/{prefix}" if prefix else f"{scheme}://{bucket}"
    return StoreLocation(scheme, bucket, prefix, url)


def credential_env(scheme: Scheme, environ: dict[str, str] | None = None) -> dict[str, str]:
    """The backend's credential variables that are set, for --print-config: secrets as '***', endpoints shown."""
    env = os.environ if environ is None else environ
    return {name: ("***" if name in _SECRET_ENV else env[name]) for name in CREDENTIAL_ENV[scheme] if env.get(name)}


def _connection_string(text: str) -> dict[str, str]:
    """AccountName, AccountKey and BlobEndpoint of an Azure connection string (the other fields are ignored)."""
    fields = dict(part.split("=", 1) for part in text.split(";") if "=" in part)
    return {key: fields[key] for key in ("AccountName", "AccountKey", "BlobEndpoint") if key in fields}


def _plain_http(endpoint: str | None) -> bool:
    return bool(endpoint) and str(endpoint).startswith("http://")


def _client_options(timeout_s: float) -> ClientConfig:
    return {"timeout": timedelta(seconds=timeout_s), "connect_timeout": timedelta(seconds=min(timeout_s, 5.0))}


def _retry_config(retries: int, budget_s: float) -> RetryConfig:
    backoff: BackoffConfig = {
        "init_backoff": timedelta(milliseconds=100),
        "max_backoff": timedelta(seconds=2),
        "base": 2,
    }
    return {"max_retries": retries, "retry_timeout": timedelta(seconds=budget_s), "backoff": backoff}


def _open(
    location: StoreLocation, options: ClientConfig, retry: RetryConfig
) -> S3Store | AzureStore | GCSStore | LocalStore:
    """The obstore store for a location, configured from the standard environment (read by obstore itself,
    except the two variables it does not know: an Azure connection string and a GCS emulator's address)."""
    prefix = location.prefix or None
    if location.scheme == "file":
        Path(location.prefix).mkdir(parents=True, exist_ok=True)
        return LocalStore(location.prefix, mkdir=True)
    if location.scheme == "s3":
        endpoint = os.environ.get("AWS_ENDPOINT_URL") or os.environ.get("AWS_ENDPOINT")
        return S3Store(
            location.bucket,
            prefix=prefix,
            client_options={**options, "allow_http": _plain_http(endpoint)},
            retry_config=retry,
        )
    if location.scheme == "az":
        fields = _connection_string(os.environ.get("AZURE_STORAGE_CONNECTION_STRING", ""))
        endpoint = fields.get("BlobEndpoint")
        config: AzureConfig = {}
        if "AccountName" in fields:
            config["account_name"] = fields["AccountName"]
        if "AccountKey" in fields:
            config["account_key"] = fields["AccountKey"]
        if endpoint:
            config["endpoint"] = endpoint
        store = AzureStore(
            location.bucket,
            prefix=prefix,
            client_options={**options, "allow_http": _plain_http(endpoint)},
            retry_config=retry,
            config=config,
        )
        return store
    emulator = os.environ.get("STORAGE_EMULATOR_HOST")
    if not emulator:
        return GCSStore(location.bucket, prefix=prefix, client_options=options, retry_config=retry)
    # An emulator takes no credentials; obstore would otherwise ask the metadata server for a token.
    return GCSStore(
        location.bucket,
        prefix=prefix,
        base_url=emulator if "://" in emulator else f"http://{emulator}",
        client_options={**options, "allow_http": True},
        retry_config=retry,
        credential_provider=_emulator_token,
    )


def _emulator_token() -> GCSCredential:
    return {"token": "emulator", "expires_at": None}


class ObjectStore:
    """The store at ``location``. Thread-safe: one instance serves every thread of a process."""

    def __init__(
        self, location: StoreLocation, *, timeout_s: float = 30.0, retries: int = 3, retry_budget_s: float = 15.0
    ) -> None:
        self.location = location
        self._timeout_s, self._retries, self._retry_budget_s = timeout_s, retries, retry_budget_s
        self._store = _open(location, _client_options(timeout_s), _retry_config(retries, retry_budget_s))

    def describe(self) -> str:
        return self.location.url

    def child(self, folder: str) -> ObjectStore:
        """The same store under ``<prefix>/<folder>`` (its own key space: what one lists the other never sees)."""
        loc = self.location
        prefix = f"{loc.prefix}/{folder}" if loc.prefix else folder
        url = f"file://{prefix}" if loc.scheme == "file" else f"{loc.scheme}://{loc.bucket}/{prefix}"
        location = StoreLocation(loc.scheme, loc.bucket, prefix, url)
        return ObjectStore(
            location, timeout_s=self._timeout_s, retries=self._retries, retry_budget_s=self._retry_budget_s
        )

    # -- calls ------------------------------------------------------------------------------------------

    def put_bytes(self, key: str, data: bytes) -> None:
        self._call(key, "put", lambda: obstore.put(self._store, key, data))

    def put_file(self, key: str, source: BinaryIO) -> None:
        """Uploads a seekable file; large files go up in PART_BYTES parts, PARALLEL at a time (multipart).

        Keys are content-addressed, so two writers of one key write the same bytes; but Azure's block lists
        are per blob, and the second writer's commit can fail when the first one's lands in between. Such a
        failed upload is repeated whole (at most PUT_ATTEMPTS times), and a reader verifies digests anyway."""
        start = source.tell()
        for attempt in range(1, PUT_ATTEMPTS + 1):
            source.seek(start)
            try:
                self._call(
                    key,
                    "put",
                    lambda: obstore.put(self._store, key, source, chunk_size=PART_BYTES, max_concurrency=PARALLEL),
                )
                return
            except Unavailable:
                if attempt == PUT_ATTEMPTS:
                    raise

    def get_bytes(self, key: str) -> bytes:
        return self._call(key, "get", lambda: bytes(obstore.get(self._store, key).bytes()))

    def get_range(self, key: str, start: int, end: int) -> bytes:
        """Bytes [start, end) of the object."""
        return self._call(key, "get", lambda: bytes(obstore.get_range(self._store, key, start=start, end=end)))

    def stream(self, key: str, size: int) -> Iterator[bytes]:
        """The object's ``size`` bytes in order, in chunks of about PART_BYTES: one streaming GET, the next
        chunk fetched in a thread while the caller handles this one. A stream that breaks is resumed where it
        stopped with a ranged GET (up to PUT_ATTEMPTS times). Objects of PARALLEL_FROM bytes or more are read as
        parallel ranged reads instead (iter_ranges): one connection to S3 carries about 100 MB/s."""
        if size >= PARALLEL_FROM:
            yield from self.iter_ranges(key, size)
            return
        if not size:
            yield self.get_bytes(key)
            return
        offset, resumes = 0, 0
        with ThreadPoolExecutor(1, thread_name_prefix="store-stream") as pool:
            while offset < size:
                chunks = self._open_stream(key, offset, size)
                try:
                    ahead = pool.submit(self._next_chunk, key, chunks)
                    while (chunk := ahead.result()) is not None:
                        ahead = pool.submit(self._next_chunk, key, chunks)
                        offset += len(chunk)
                        yield chunk
                except Unavailable:
                    resumes += 1
                    if resumes >= PUT_ATTEMPTS or offset >= size:
                        raise
                    continue
                if offset < size:
                    raise Unavailable(
                        f"{self.location.url}: get {key} ended after {offset} of {size} bytes",
                        reason="STORE_UNAVAILABLE",
                        store=self.location.url,
                    )

    def _next_chunk(self, key: str, chunks: Iterator[bytes]) -> bytes | None:
        return self._call(key, "get", lambda: next(chunks, None))

    def _open_stream(self, key: str, start: int, end: int) -> Iterator[bytes]:
        options: GetOptions = {"range": (start, end)}  # never more than the caller expects
        result = self._call(key, "get", lambda: obstore.get(self._store, key, options=options))
        return iter(result.stream(min_chunk_size=PART_BYTES))

    def iter_ranges(self, key: str, size: int, span: int = PART_BYTES) -> Iterator[bytes]:
        """The object's bytes in order, fetched as ranged reads PARALLEL at a time; at most PARALLEL + 1 spans
        are held in memory at once, so a 256 MiB file streams in about 40 MiB."""
        if size <= span:
            yield self.get_bytes(key) if size else b""
            return
        starts = list(range(0, size, span))
        with ThreadPoolExecutor(PARALLEL, thread_name_prefix="store-range") as pool:
            pending: deque[Future[bytes]] = deque()
            for start in starts[:PARALLEL]:
                pending.append(pool.submit(self.get_range, key, start, min(start + span, size)))
            for index in range(len(starts)):
                chunk = pending.popleft().result()
                following = index + PARALLEL
                if following < len(starts):
                    s = starts[following]
                    pending.append(pool.submit(self.get_range, key, s, min(s + span, size)))
                yield chunk

    def head(self, key: str) -> ObjectInfo | None:
        """The object's size and etag, or None when there is no such key."""
        try:
            meta = self._call(key, "head", lambda: obstore.head(self._store, key))
        except NotFound:
            return None
        return _info(key, meta)

    def list(self, prefix: str = "") -> list[ObjectInfo]:
        """Every object whose key starts with ``prefix`` (a folder-like prefix, "" for all), any order."""

        def collect() -> list[ObjectInfo]:
            found: list[ObjectInfo] = []
            for batch in obstore.list(self._store, prefix=prefix or None):
                found.extend(_info(str(m["path"]), m) for m in batch)
            return found

        return self._call(prefix or "/", "list", collect)

    def delete(self, key: str) -> None:
        """Removes the key; absent already is not an error (deletes are repeated by GC and migration)."""
        with contextlib.suppress(NotFound):
            self._call(key, "delete", lambda: obstore.delete(self._store, key))

    # -- errors -----------------------------------------------------------------------------------------

    def _call(self, key: str, action: str, fn: Callable[[], _T]) -> _T:
        try:
            return fn()
        except ServiceError:
            raise
        except (NotFoundError, FileNotFoundError):
            raise NotFound(f"{self.location.url}: no object {key}", reason="OBJECT_NOT_FOUND", key=key) from None
        except (PermissionDeniedError, UnauthenticatedError):
            raise PermissionDenied(
                f"{self.location.url}: {action} {key} refused: check the store's credentials in the environment",
                reason="STORE_PERMISSION_DENIED",
                store=self.location.url,
            ) from None
        except Exception as exc:  # obstore's GenericError and friends: network, timeouts, 5xx
            first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise Unavailable(
                f"{self.location.url}: {action} {key} failed: {first[:300]}",
                reason="STORE_UNAVAILABLE",
                store=self.location.url,
            ) from None


def _info(key: str, meta: ObjectMeta) -> ObjectInfo:
    modified = meta.get("last_modified")
    return ObjectInfo(key, int(meta["size"]), meta.get("e_tag"), modified.timestamp() if modified else 0.0)


def open_store(url: str, *, timeout_s: float = 30.0, retries: int = 3) -> ObjectStore:
    """The store a ``--store`` URL names (raises InvalidArgument on a malformed URL)."""
    return ObjectStore(parse_store_url(url), timeout_s=timeout_s, retries=retries)
