"""`make demo` runs `opentinker demo`; this test runs that same command so the demo cannot silently rot."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from pathlib import Path


def test_demo_runs_end_to_end(tmp_path: Path) -> None:
    out = tmp_path / "demo_out"
    result = subprocess.run(
        [sys.executable, "-m", "opentinker.cli.main", "demo", "--workdir", str(tmp_path / "data"), "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "COLUMNS": "200"},
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "demo finished" in result.stdout
    assert "what the adapters learned" in result.stdout and "rollback team-a/digits@latest" in result.stdout
    assert (out / "curves.png").stat().st_size > 10_000
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    adapters = {r["adapter"] for r in records}
    assert adapters == {
        "team-a/digits",
        "team-b/short",
        "team-c/vowels",
        "team-d/chat",
        "team-e/speaker",
        "team-e/listener",
    }
    # Every RL step sampled the version its previous step saved.
    for adapter in adapters - {"team-d/chat"}:
        steps = [r for r in records if r["adapter"] == adapter]
        for before, after in itertools.pairwise(steps):
            if before["version_saved"]:
                assert after["version_sampled"] == before["version_saved"]

    # Every single-agent RL adapter's reward rises and the SFT loss falls (the demo's sampling is seeded).
    def series(adapter: str, key: str) -> list[float]:
        return [r[key] for r in records if r["adapter"] == adapter]

    for adapter in ("team-a/digits", "team-b/short", "team-c/vowels"):
        rewards = series(adapter, "mean_reward")
        assert sum(rewards[-3:]) / 3 > sum(rewards[:3]) / 3 + 0.1, (adapter, rewards)
    losses = series("team-d/chat", "loss")
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3, losses
    # The servers shut down cleanly.
    assert result.stdout.count("(exit 0)") == 3
