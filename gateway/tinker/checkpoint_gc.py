"""Checkpoint TTLs and deletes made real: what an expired or deleted ``tinker://`` path stood for is deleted from
the server that holds it, every --checkpoint-gc-seconds.

- a saved state (``weights/``): the trainer's DeleteState;
- sampler weights (``sampler_weights/``): the registry's DeleteVersion (the artifact goes; the version record and
  its lineage stay). A version an alias points to (``latest`` after the newest save, or any alias set by hand) is
  kept: an expired path stays listed and loadable, a deleted one stays hidden, until the alias moves on; the next
  sweep after that deletes it.

Expiry times are in the gateway's state store, so with --redis-url a restart changes nothing; without, a restart
forgets the paths and their TTLs (the states and versions stay). A target another live path still stands for
(identical saved states share one content id) is left alone.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

import grpc

from opentinker.client.errors import OpenTinkerError
from opentinker.gateway.state import Gateway
from opentinker.gateway.tinker.checkpoints import Checkpoint
from opentinker.gateway.tinker.state import TinkerState
from opentinker.v1 import registry_pb2, trainer_pb2

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Collected:
    deleted: int  # targets deleted (or found gone)
    kept: int  # aliased versions kept for now
    failed: int  # to be retried at the next sweep


async def _delete_target(gw: Gateway, checkpoint: Checkpoint) -> None:
    principal = gw.keys.principal_of_tenant(checkpoint.tenant)
    backend = gw.backends.for_token(principal.token if principal is not None else None)
    if checkpoint.kind == "state":
        request = trainer_pb2.DeleteStateRequest(state_id=checkpoint.target)
        await backend.trainer.unary_async("DeleteState", request, trainer_pb2.DeleteStateResponse)
        return
    adapter, _, number = checkpoint.target.rpartition("@")
    delete = registry_pb2.DeleteVersionRequest(adapter=adapter, version=int(number))
    await backend.registry.unary_async("DeleteVersion", delete, registry_pb2.DeleteVersionResponse)


async def collect(gateway: Gateway, gw: TinkerState, now: float | None = None) -> Collected:
    now = time.time() if now is None else now
    deleted = kept = failed = 0
    for checkpoint in gw.checkpoints.due(now):
        if not gw.checkpoints.target_in_use(checkpoint, now):
            try:
                await _delete_target(gateway, checkpoint)
            except OpenTinkerError as exc:
                if exc.reason == "VERSION_ALIASED":
                    kept += 1
                    continue
                if exc.code != grpc.StatusCode.NOT_FOUND:  # NOT_FOUND: gone already
                    log.warning("could not delete %s (%s): %s", checkpoint.path, checkpoint.target, exc)
                    failed += 1
                    continue
        await gw.durable.drop_checkpoint(checkpoint.key)
        gw.checkpoints.remove(checkpoint.key)
        deleted += 1
    return Collected(deleted, kept, failed)


async def run_collector(gateway: Gateway, gw: TinkerState) -> None:
    """Collects until cancelled; a sweep that fails is logged and the next one runs."""
    while True:
        await asyncio.sleep(gw.config.checkpoint_gc_seconds)
        try:
            collected = await collect(gateway, gw)
        except Exception:
            log.exception("checkpoint collection failed")
            continue
        if collected.deleted or collected.failed:
            log.info(
                "checkpoints: %d deleted, %d kept while aliased, %d to retry",
                collected.deleted,
                collected.kept,
                collected.failed,
            )
