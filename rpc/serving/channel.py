"""Every client channel is built here: plaintext, or TLS verified against PEM root certificates; sync or
grpc.aio; with the 64 MiB message limits the servers accept; and the bearer header that carries a token."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Final

import grpc
import grpc.aio

# Batches and their per-token outputs can be large; the servers accept up to 64 MiB messages.
MAX_MESSAGE_BYTES: Final = 64 << 20
CHANNEL_OPTIONS: Final = (
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
)
Options = Sequence[tuple[str, int]]


def _credentials(ca_cert: Path) -> grpc.ChannelCredentials:
    return grpc.ssl_channel_credentials(root_certificates=ca_cert.read_bytes())


def open_channel(address: str, ca_cert: Path | None = None, options: Options = CHANNEL_OPTIONS) -> grpc.Channel:
    """A plaintext channel, or TLS verified against the PEM root certificates in ca_cert."""
    if ca_cert is None:
        return grpc.insecure_channel(address, options=list(options))
    return grpc.secure_channel(address, _credentials(ca_cert), options=list(options))


def open_aio_channel(
    address: str,
    ca_cert: Path | None = None,
    options: Options = CHANNEL_OPTIONS,
    interceptors: Sequence[grpc.aio.ClientInterceptor] = (),
) -> grpc.aio.Channel:
    """As open_channel, for grpc.aio: open it inside the event loop that will use it."""
    if ca_cert is None:
        return grpc.aio.insecure_channel(address, options=list(options), interceptors=list(interceptors))
    creds = _credentials(ca_cert)
    return grpc.aio.secure_channel(address, creds, options=list(options), interceptors=list(interceptors))


def bearer_metadata(token: str | None) -> list[tuple[str, str]]:
    """The call metadata that presents ``token`` (``authorization: Bearer <token>``); empty without one."""
    return [("authorization", f"Bearer {token}")] if token else []
