"""README's quickstart is examples/quickstart.py; this test runs that file as it is, with the `opentinker`
command on PATH as after `pip install`, so what newcomers copy cannot rot."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = ROOT / "examples" / "quickstart.py"


def test_readme_shows_the_quickstart_file_as_it_is() -> None:
    readme = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", readme, flags=re.DOTALL)
    assert QUICKSTART.read_text() in blocks


def test_quickstart_trains_two_tenants_samples_the_saved_version_and_rolls_back(tmp_path: Path) -> None:
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    result = subprocess.run(
        [sys.executable, str(QUICKSTART), str(tmp_path / "run")],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
        env={**os.environ, "PATH": path},
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    out = result.stdout
    saved = re.findall(r"saved (\S+)@(\d+) \(loss before the step ([\d.]+)\)", out)
    for adapter in ("team-a/chat", "team-b/chat"):
        own = [(int(n), float(loss)) for name, n, loss in saved if name == adapter]
        assert [n for n, _ in own] == [1, 2, 3], (adapter, out)
        assert own[-1][1] < own[0][1], (adapter, own)  # training moved the weights the right way
    assert "sampled from team-a/chat@3" in out
    assert "rolled back team-a/chat@latest: 3 -> 2" in out
    assert "now sampling from team-a/chat@2" in out
    # `up` stopped every server it started.
    leftovers = [p for p in psutil.process_iter(["cmdline"]) if str(tmp_path) in " ".join(p.info["cmdline"] or [])]
    assert not leftovers, [p.info["cmdline"] for p in leftovers]
