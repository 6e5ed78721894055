"""What `registry rollback` adds when the rollback will not stick: a trainer publishing to the adapter moves
`latest` again at its next snapshot (SaveSnapshot moves `latest` unless skip_latest), so the operator is told
how to carry the rollback into training, and how to serve from an alias publishes never move."""

from __future__ import annotations

from opentinker.client import Version
from opentinker.weights.names import LATEST


def published_by_trainer(version: Version) -> bool:
    """A version a trainer's SaveSnapshot published (an import has neither a trainer step nor a parent)."""
    return version.lineage.trainer_step > 0 or version.lineage.parent_version > 0


def rollback_notice(
    name: str, alias: str, rolled_back_from: Version | None, to_version: int, serving_alias: str = LATEST
) -> str | None:
    """The warning for a rollback of `alias` away from `rolled_back_from`, or None when it sticks."""
    if alias != LATEST or rolled_back_from is None or not published_by_trainer(rolled_back_from):
        return None
    v = rolled_back_from
    if serving_alias != LATEST:  # bare names serve the operator's alias, which no snapshot moves
        return (
            f"note: {name}@{v.number} was published by a trainer: its next snapshot moves {LATEST} again. Bare "
            f"{name} serves @{serving_alias}, which this rollback did not move (roll that back with "
            f"--alias {serving_alias})."
        )
    return (
        f"note: {name}@{v.number} was published by a trainer (step {v.lineage.trainer_step}, "
        f"{v.published_by or 'unknown publisher'}): its next snapshot moves {LATEST} again, with parent "
        f"{v.number}. To carry the rollback into training: opentinker trainer reset {name} --to {to_version}. "
        f"To serve a version training does not move: opentinker registry alias set {name} stable {to_version} "
        f"&& opentinker registry alias serve {name} stable (bare {name} then follows stable)."
    )
