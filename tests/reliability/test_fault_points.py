"""rpc/process/faults.py itself: the spec grammar, no effect unless armed, and death by SIGKILL at exactly the nth
time the armed point is reached (in a child process, with the scope naming the operation)."""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest

from opentinker.rpc.process import faults

CHILD = """
import sys
from opentinker.rpc.process import faults
hook = faults.configure()
assert hook is faults.fault_point
for i in range(5):
    faults.fault_point("file_written:a")  # unscoped: a different name
    with faults.scope("save_state"):
        faults.fault_point("file_written:a")
    print(i, flush=True)
"""


@pytest.mark.parametrize(
    ("spec", "parsed"),
    [
        ("save_state/file_written:state.json", ("save_state/file_written:state.json", 1)),
        ("save_state/file_written:state.json:3", ("save_state/file_written:state.json", 3)),
        ("save_snapshot/before_publish", ("save_snapshot/before_publish", 1)),
        ("x:2", ("x", 2)),
    ],
)
def test_spec_grammar(spec: str, parsed: tuple[str, int]) -> None:
    assert faults.parse(spec) == parsed


def test_nth_must_be_positive() -> None:
    with pytest.raises(ValueError, match="nth must be >= 1"):
        faults.parse("x:0")


def test_unarmed_points_do_nothing() -> None:
    assert faults.configure({}) is None
    with faults.scope("save_state"):
        faults.fault_point("temp_created")  # would SIGKILL this test process if it were armed


def test_armed_point_kills_at_the_nth_hit() -> None:
    env = {faults.ENV_VAR: "save_state/file_written:a:3"}
    done = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == -signal.SIGKILL, done.stderr
    assert done.stdout.split() == ["0", "1"]  # died inside the third iteration, at the scoped point
