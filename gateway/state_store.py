"""What the gateway's two Redis stores share (tinker/durable.py's tables, episodes.py's captured episodes): the key
prefix of one gateway deployment and the 503 a failed Redis call answers."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator

import redis

from opentinker.gateway.errors import GatewayError
from opentinker.rpc.serving import request_ids

log = logging.getLogger(__name__)

PREFIX = "otgw:"  # the registry's keys are under ``ot:``: one gateway deployment per Redis


@contextlib.asynccontextmanager
async def unavailable() -> AsyncIterator[None]:
    """A Redis failure inside as a retryable 503 naming the request id (the log has the address and the error)."""
    try:
        yield
    except redis.RedisError as exc:
        # The exception's text names the Redis address: the log has it, under the request id the client gets.
        request_id = request_ids.current.get() or request_ids.new_request_id()
        log.warning("state store call failed (request %s): %s: %s", request_id, type(exc).__name__, exc)
        raise GatewayError(
            503,
            "STATE_STORE_UNAVAILABLE",
            "the gateway's state store is unavailable; retry shortly, and if it "
            f"persists ask the operator to check the gateway's Redis (request {request_id})",
            retry=True,
        ) from None
