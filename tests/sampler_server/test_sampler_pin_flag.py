"""--max-pinned-per-tenant (issue 33, item 3): a bound above --max-slots is a configuration error, refused in one
line before the model loads (0 is the way to say "no limit")."""

from __future__ import annotations

import subprocess
from pathlib import Path

from serverproc import opentinker_command


def test_a_pin_limit_beyond_the_slots_is_one_line(tiny_model: Path, tmp_path: Path) -> None:
    args = opentinker_command(
        "sampler",
        "serve",
        "--model",
        str(tiny_model),
        "--registry",
        "127.0.0.1:1",
        "--store",
        str(tmp_path / "s"),
        "--device",
        "cpu",
        "--port",
        "0",
        "--max-slots",
        "4",
        "--max-pinned-per-tenant",
        "5",
    )
    result = subprocess.run(args, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    lines = (result.stdout + result.stderr).strip().splitlines()
    assert lines == [
        "opentinker sampler: invalid value for --max-pinned-per-tenant: 5 is more than --max-slots (4); "
        "0 means no limit"
    ]
