"""examples/agent_rl.py as it is (the openai SDK agent, capture, train_on_episodes, hot reload), with the
`opentinker` command on PATH: each iteration plays on the version the previous one saved, and the mean reward of
the last iterations is clearly above that of the first."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "agent_rl.py"


def test_agent_rl_example_improves_its_mean_reward(tmp_path: Path) -> None:
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    result = subprocess.run(
        [sys.executable, str(EXAMPLE), "--run-dir", str(tmp_path / "run"), "--iterations", "10", "--json"],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
        env={**os.environ, "PATH": path},
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    lines = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert [line["iteration"] for line in lines] == list(range(10)), result.stdout
    rewards = [line["mean_reward"] for line in lines]
    print("agent_rl reward curve:", " ".join(f"{r:.2f}" for r in rewards))
    first, last = statistics.mean(rewards[:2]), statistics.mean(rewards[-2:])
    assert last > first + 0.3, rewards
    # Every game of an iteration after the first ran on a version training saved (hot reload onto @latest).
    saved = [line["saved"] for line in lines]
    for before, line in zip(saved, lines[1:], strict=False):
        if before is not None:
            assert f"team-a/guesser@{before}" in line["played_by"], lines
