"""Test access to the process launchers (the package's own, so tests start servers as users do)."""

from pathlib import Path

from opentinker.cli.launch import (
    ServerProcess,
    opentinker_command,
    registry_store,
    start_registry,
    start_sampler,
    start_trainer,
)

ROOT = Path(__file__).resolve().parent.parent

__all__ = [
    "ROOT",
    "ServerProcess",
    "opentinker_command",
    "registry_store",
    "start_registry",
    "start_sampler",
    "start_trainer",
]
