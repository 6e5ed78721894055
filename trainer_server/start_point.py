"""Where a new adapter's weights come from (CreateAdapter), decided before anything is created.

A user must not be able to train fresh random weights under a name that has versions by accident (they would be
published as `latest`, parent 0). So attaching to an adapter with versions starts from its latest version: from the
full state --persist-state saved with that version when this trainer can load it (training continues bitwise), else
from the version's weights with a fresh optimizer. Fresh weights under an existing name need `fresh`.
"""

from __future__ import annotations

from dataclasses import dataclass

from opentinker.rpc.serving.errors import InvalidArgument
from opentinker.v1 import registry_pb2, trainer_pb2

# The sampler's default --max-rank (sampler_server/cli.py): a larger rank trains but could not be served.
DEFAULT_MAX_SERVING_RANK = 64


@dataclass(frozen=True, slots=True)
class StartPlan:
    """snapshot: load this version's weights; state_id: then load this saved state. at_version: the version a
    persisted state was saved with (its snapshot history continues from there). how: "init_from", "latest"."""

    snapshot: registry_pb2.Version | None = None
    state_id: str = ""
    at_version: registry_pb2.Version | None = None
    how: str = ""
    note: str = ""  # why a persisted state was not used


def check_start(request: trainer_pb2.TrainerServiceCreateAdapterRequest) -> None:
    """INVALID_ARGUMENT CONFLICTING_START for fresh together with another start point."""
    if request.fresh and (request.init_from or request.resume_state):
        other = "init_from" if request.init_from else "resume_state"
        raise InvalidArgument(
            f"fresh=true and {other} name two start points: pass one", reason="CONFLICTING_START", field="fresh"
        )


def check_serving_rank(rank: int, max_serving_rank: int) -> None:
    """INVALID_ARGUMENT RANK_NOT_SERVABLE for a rank no sampler of this deployment would load (0: no check)."""
    if max_serving_rank and rank > max_serving_rank:
        raise InvalidArgument(
            f"lora_config.rank {rank} is above the rank samplers serve ({max_serving_rank}, this trainer's "
            "--max-serving-rank, which should match the samplers' --max-rank): raise both to train it",
            reason="RANK_NOT_SERVABLE",
            field="lora_config.rank",
        )


def started_from(plan: StartPlan, seed: int, step: int) -> trainer_pb2.StartedFrom:
    """The reply's account of the start point; `step`: the adapter's step once started."""
    if plan.at_version is not None:
        v = plan.at_version
        return trainer_pb2.StartedFrom(
            kind=trainer_pb2.START_KIND_STATE,
            adapter=v.adapter,
            version=v.version,
            state_id=plan.state_id,
            description=f"state saved with {v.adapter}@{v.version} ({plan.how}): weights, optimizer, step {step}",
        )
    if plan.state_id:
        description = f"state {plan.state_id}: weights, optimizer, step {step}"
        return trainer_pb2.StartedFrom(
            kind=trainer_pb2.START_KIND_STATE, state_id=plan.state_id, description=description
        )
    if plan.snapshot is not None:
        v = plan.snapshot
        note = f"; {plan.note}" if plan.note else ""
        return trainer_pb2.StartedFrom(
            kind=trainer_pb2.START_KIND_VERSION,
            adapter=v.adapter,
            version=v.version,
            description=f"weights of {v.adapter}@{v.version} ({plan.how}), optimizer fresh{note}",
        )
    return trainer_pb2.StartedFrom(kind=trainer_pb2.START_KIND_FRESH, description=f"fresh weights (seed {seed})")
