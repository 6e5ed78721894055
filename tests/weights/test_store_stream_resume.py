"""A GET whose connection breaks mid-body is resumed by a ranged GET where it stopped (ObjectStore.stream),
against moto behind a TCP proxy that cuts responses: what a flaky network or a store's load balancer does."""

from __future__ import annotations

import hashlib
import itertools
import os
import re
from collections.abc import Iterator

import pytest
from storeservers import StoreServer
from tcpproxy import TcpProxy

from opentinker.weights.object_store import PART_BYTES, ObjectStore, parse_store_url


@pytest.fixture
def proxy(servers: dict[str, StoreServer], monkeypatch: pytest.MonkeyPatch) -> Iterator[TcpProxy]:
    moto = servers["s3"]
    cutter = TcpProxy(moto.port)
    cutter.cut_after = PART_BYTES // 2  # mid-chunk; three cuts fit in the object
    for name, value in moto.env().items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{cutter.port}")
    yield cutter
    cutter.close()


@pytest.mark.parametrize("cuts", [1, 3])
def test_a_stream_cut_mid_body_resumes_with_a_ranged_get_and_yields_every_byte_once(
    cuts: int, proxy: TcpProxy, servers: dict[str, StoreServer]
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
    gets = [r for r in proxy.heads if r.startswith("GET ")]
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
