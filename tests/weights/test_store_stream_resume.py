"""A GET whose connection breaks mid-body is resumed by a ranged GET where it stopped (ObjectStore.stream),
against moto behind a TCP proxy that cuts one response: what a flaky network or a store's load balancer does."""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import os
import re
import socket
import threading
from collections.abc import Iterator

import pytest
from storeservers import StoreServer

from opentinker.weights.object_store import PART_BYTES, ObjectStore, parse_store_url


class CuttingProxy:
    """Forwards TCP connections to a server; while ``cuts_left`` > 0, each response to a GET is cut (both
    sockets closed) after ``cut_after`` bytes. Records the head of every request it forwards."""

    def __init__(self, upstream_port: int, cut_after: int) -> None:
        self.upstream_port, self.cut_after = upstream_port, cut_after
        self.cuts_left = 0
        self.cuts = 0
        self.requests: list[str] = []
        self._lock = threading.Lock()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.upstream_port))
            state = {"get": False, "sent": 0}
            threading.Thread(target=self._up, args=(client, upstream, state), daemon=True).start()
            threading.Thread(target=self._down, args=(upstream, client, state), daemon=True).start()

    def _up(self, client: socket.socket, upstream: socket.socket, state: dict[str, int]) -> None:
        while data := _recv(client):
            if re.match(rb"(GET|PUT|POST|HEAD|DELETE) ", data):
                with self._lock:
                    self.requests.append(data[:2000].decode("latin-1"))
                state["get"], state["sent"] = data.startswith(b"GET "), 0
            upstream.sendall(data)
        _close(client, upstream)

    def _down(self, upstream: socket.socket, client: socket.socket, state: dict[str, int]) -> None:
        while data := _recv(upstream):
            with self._lock:
                cut = self.cuts_left > 0 and state["get"] and state["sent"] + len(data) > self.cut_after
                if cut:
                    self.cuts_left, self.cuts = self.cuts_left - 1, self.cuts + 1
            if cut:
                client.sendall(data[: self.cut_after - state["sent"]])
                _close(client, upstream)
                return
            state["sent"] += len(data)
            client.sendall(data)
        _close(client, upstream)

    def close(self) -> None:
        self._listener.close()


def _recv(sock: socket.socket) -> bytes:
    try:
        return sock.recv(1 << 16)
    except OSError:
        return b""


def _close(*sockets: socket.socket) -> None:
    for sock in sockets:
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)
        sock.close()


@pytest.fixture
def proxy(servers: dict[str, StoreServer], monkeypatch: pytest.MonkeyPatch) -> Iterator[CuttingProxy]:
    moto = servers["s3"]
    cutter = CuttingProxy(moto.port, cut_after=PART_BYTES // 2)  # mid-chunk; three cuts fit in the object
    for name, value in moto.env().items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{cutter.port}")
    yield cutter
    cutter.close()


@pytest.mark.parametrize("cuts", [1, 3])
def test_a_stream_cut_mid_body_resumes_with_a_ranged_get_and_yields_every_byte_once(
    cuts: int, proxy: CuttingProxy, servers: dict[str, StoreServer]
) -> None:
    store = ObjectStore(parse_store_url(servers["s3"].url(f"stream-resume-{cuts}")), retries=1, retry_budget_s=5)
    data = os.urandom(3 * PART_BYTES + 12345)  # three full chunks and a short one
    store.put_bytes("object", data)
    proxy.cuts_left = cuts
    streamed = hashlib.sha256()
    total = 0
    for chunk in store.stream("object", len(data)):
        streamed.update(chunk)
        total += len(chunk)
    assert proxy.cuts == cuts
    assert total == len(data) and streamed.hexdigest() == hashlib.sha256(data).hexdigest()
    gets = [r for r in proxy.requests if r.startswith("GET ")]
    starts = [int(m.group(1)) for r in gets if (m := re.search(r"(?im)^range: bytes=(\d+)-", r))]
    # Each GET after a cut asks for the rest. The client library resumes a broken body itself, from where the
    # bytes stopped (further on than the GET before); when its retries are spent, stream() resumes from the end
    # of the last chunk it handed out (a chunk boundary), so it refetches at most the chunk in flight and never
    # hands a byte out twice.
    assert len(starts) == cuts + 1 and starts[0] == 0, gets
    boundary = 0
    for earlier, later in itertools.pairwise(starts):
        assert later > earlier or (later % PART_BYTES == 0 and later >= boundary), starts
        if later % PART_BYTES == 0:
            boundary = later
