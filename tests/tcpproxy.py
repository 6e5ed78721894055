"""A TCP proxy in front of a test server, to take it away and bring it back (same port, same state behind it) or
to make it slow: ``down()`` refuses and cuts every connection, ``up()`` listens again, ``delay_s`` holds each
request (the first bytes a client sends after the server last answered) that long before passing it on, and
while ``cuts_left`` > 0 each answer to a GET is cut (both sockets closed) after ``cut_after`` bytes, the way a
flaky network or a store's load balancer breaks a download mid-body. ``heads`` keeps the start of each request."""

from __future__ import annotations

import contextlib
import socket
import threading
import time


class TcpProxy:
    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.delay_s = 0.0
        self.requests = 0  # requests passed on (or held) since start
        self.heads: list[str] = []  # the first bytes of each of those requests
        self.cut_after, self.cuts_left, self.cuts = 0, 0, 0
        self._lock = threading.Lock()
        self._connections: set[socket.socket] = set()
        self._listener: socket.socket | None = None
        self.port = 0
        self.up()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def up(self) -> None:
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen(64)
        self.port = listener.getsockname()[1]
        self._listener = listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()

    def down(self) -> None:
        """From now on connecting is refused, and every open connection is reset."""
        listener, self._listener = self._listener, None
        if listener is not None:
            listener.close()
        with self._lock:
            connections, self._connections = self._connections, set()
        for conn in connections:
            with contextlib.suppress(OSError):
                conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
                conn.close()

    def close(self) -> None:
        self.down()

    def _cut(self, answered: int) -> bool:
        with self._lock:
            if self.cuts_left <= 0 or answered <= self.cut_after:
                return False
            self.cuts_left, self.cuts = self.cuts_left - 1, self.cuts + 1
            return True

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return  # closed by down()
            try:
                server = socket.create_connection(("127.0.0.1", self.upstream_port))
            except OSError:
                client.close()
                continue
            with self._lock:
                self._connections |= {client, server}
            turn = {"client": True, "get": False, "sent": 0}  # the client speaks next: its bytes start a request
            threading.Thread(target=self._pump, args=(client, server, turn, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, turn, False), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket, turn: dict[str, int], from_client: bool) -> None:
        try:
            while data := source.recv(1 << 16):
                if from_client and turn["client"]:
                    turn.update(client=False, get=data.startswith(b"GET "), sent=0)
                    with self._lock:
                        self.requests += 1
                        self.heads.append(data[:2000].decode("latin-1"))
                    if self.delay_s:
                        time.sleep(self.delay_s)
                elif not from_client:
                    turn["client"] = True
                    if turn["get"] and self._cut(turn["sent"] + len(data)):
                        sink.sendall(data[: max(0, self.cut_after - turn["sent"])])
                        return  # the finally below closes both sockets mid-body
                    turn["sent"] += len(data)
                sink.sendall(data)
        except OSError:
            pass
        finally:
            for conn in (source, sink):
                with contextlib.suppress(OSError):
                    conn.shutdown(socket.SHUT_RDWR)
