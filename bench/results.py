"""Benchmark figures: every script records its figures here; `bench/results.json` collects them.

    record("P3 LoRA overhead", 0.965, target=0.90, comparison=">=", config={...}, unit="ratio")

merges one figure into the results file (by name; a re-run replaces it) and returns it. A figure without a
target is reported, not judged (`met` is null). `python bench/results.py [PATH]` prints the table.

The file (schema 1):

    {"schema": 1, "updated": ISO-8601 UTC, "run": {...run_all's configuration...},
     "figures": [{"name", "value", "unit", "target", "comparison", "met", "config", "script", "recorded_at"}]}

The results path is `bench/results.json`, or `$OPENTINKER_BENCH_RESULTS` when set (tests, ad-hoc runs).
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal

SCHEMA = 1
Comparison = Literal[">=", "<="]
ConfigValue = str | int | float | bool | None
Config = Mapping[str, ConfigValue]
DEFAULT_PATH = Path(__file__).resolve().parent / "results.json"


@dataclass(frozen=True, slots=True)
class Figure:
    name: str  # unique key, e.g. "P1 mixed-adapter efficiency"
    value: float
    unit: str  # "ratio", "ms", "tokens/s", ...
    target: float | None  # None: reported only
    comparison: Comparison
    met: bool | None  # None when there is no target
    config: dict[str, ConfigValue] = field(default_factory=dict)
    script: str = ""
    recorded_at: str = ""


def results_path() -> Path:
    return Path(os.environ.get("OPENTINKER_BENCH_RESULTS") or DEFAULT_PATH)


def is_met(value: float, target: float | None, comparison: Comparison) -> bool | None:
    if target is None:
        return None
    if not math.isfinite(value):
        return False  # a failed measurement never meets a target
    return value >= target if comparison == ">=" else value <= target


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def load(path: Path | None = None) -> dict[str, object]:
    path = path or results_path()
    if not path.exists():
        return {"schema": SCHEMA, "updated": "", "run": {}, "figures": []}
    data: dict[str, object] = json.loads(path.read_text())
    if data.get("schema") != SCHEMA:
        raise ValueError(f"{path}: schema {data.get('schema')!r}, expected {SCHEMA}")
    return data


def figures(path: Path | None = None) -> list[Figure]:
    raw = load(path)["figures"]
    assert isinstance(raw, list)
    return [Figure(**item) for item in raw]


def _write(path: Path, data: Mapping[str, object]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    tmp.replace(path)  # readers never see a half-written file


def record(
    name: str,
    value: float,
    *,
    target: float | None = None,
    comparison: Comparison = ">=",
    config: Config | None = None,
    unit: str = "ratio",
    path: Path | None = None,
) -> Figure:
    """Merges one figure into the results file (replacing a figure of the same name) and returns it."""
    path = path or results_path()
    value = float(value)
    figure = Figure(
        name=name,
        value=round(value, 4) if math.isfinite(value) else value,
        unit=unit,
        target=target,
        comparison=comparison,
        met=is_met(value, target, comparison),
        config=dict(config or {}),
        script=Path(sys.argv[0]).name,
        recorded_at=_now(),
    )
    data = load(path)
    kept = [f for f in figures(path) if f.name != name]
    data["figures"] = [asdict(f) for f in sorted([*kept, figure], key=lambda f: f.name)]
    data["updated"] = figure.recorded_at
    _write(path, data)
    return figure


def start_run(run: Config, path: Path | None = None) -> None:
    """A fresh results file for a whole run (no stale figures from an earlier one)."""
    _write(path or results_path(), {"schema": SCHEMA, "updated": _now(), "run": dict(run), "figures": []})


def update_run(values: Config, path: Path | None = None) -> None:
    """Adds to the run's configuration (e.g. each script's duration)."""
    path = path or results_path()
    data = load(path)
    run = data["run"]
    assert isinstance(run, dict)
    data["run"] = {**run, **values}
    _write(path, data)


def _fmt(value: float) -> str:
    if not math.isfinite(value):
        return str(value)
    return f"{value:.4g}" if abs(value) < 1000 else f"{value:.0f}"


def table(items: list[Figure]) -> str:
    """A plain-text table: figure, value, target, met."""
    rows = [("figure", "value", "target", "met")]
    for f in items:
        target = "" if f.target is None else f"{f.comparison} {_fmt(f.target)}"
        met = "" if f.met is None else ("yes" if f.met else "NO")
        unit = "" if f.unit == "ratio" else f" {f.unit}"
        rows.append((f.name, _fmt(f.value) + unit, target, met))
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    judged = [f for f in items if f.met is not None]
    lines.append(f"{sum(bool(f.met) for f in judged)}/{len(judged)} targets met")
    return "\n".join(lines)


def main() -> None:
    path = Path(sys.argv[1]) if len(sys.argv) > 1 else results_path()
    print(table(figures(path)))


if __name__ == "__main__":
    main()
