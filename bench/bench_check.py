"""`make bench-check`: the quick P1, P2a and P3 of this tree against a base build, alternating in one run.

Each side runs `bench/sampler_multilora.py --quick` in a fresh process, base and head taking turns (base, head,
head, base, ...), so that machine noise falls on both alike; then the medians of each side's figures are
compared. The check fails (exit 1) when a ratio of the head is more than `--tolerance` (5 %) below the base's:

    P1   decode tokens/s, rows on distinct adapters / on one adapter
    P3   decode tokens/s, one adapter / base model
    P2a  peft generate(adapter_names) wall / ours, end to end

It also prints each side's absolute decode tokens/s (those move with the machine, so they are shown, not judged).

The base is a git ref checked out into a temporary worktree; its packages are imported through a link tree on
PYTHONPATH (which comes before the editable install). By default it is the upstream's merge base when the
branch has one, else HEAD when the working tree changes code, else HEAD~1: "the build before this change".
The head is the working tree as it is, uncommitted changes included, or `--head REF`. `--script head` runs the
head's bench script against the base's code too, for comparing across a change of the bench script itself
(the bisect of a regression: `--base A --head B` over the commits between).

    .venv/bin/python bench/bench_check.py [--base REF] [--head REF] [--rounds N] [--tolerance F] [--full]
                                          [--script own|head]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("client", "rpc", "weights", "registry", "trainer_server", "sampler_server", "gateway", "cli")
JUDGED = {  # figure key in the script's --json output -> label
    "p1_mixed_over_single": "P1 distinct / one adapter",
    "p3_single_over_base": "P3 one adapter / base",
    "p2a_peft_mixed_over_ours": "P2a peft mixed / ours",
}


@dataclass(frozen=True, slots=True)
class Build:
    name: str  # "base" or "head"
    tree: Path  # the checkout whose code runs
    script: Path  # the bench script it runs
    pythonpath: Path | None  # a link tree making `opentinker.*` this tree's code; None: the editable install


def git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, check=True, capture_output=True, text=True).stdout.strip()


def default_base() -> tuple[str, str]:
    """(ref, why) of the build this change is compared with."""
    upstream = subprocess.run(
        ["git", "rev-parse", "--abbrev-ref", "@{upstream}"], cwd=ROOT, capture_output=True, text=True, check=False
    )
    if upstream.returncode == 0:
        base = git("merge-base", "HEAD", upstream.stdout.strip())
        if base != git("rev-parse", "HEAD"):
            return base, f"merge base with {upstream.stdout.strip()}"
    dirty = git("status", "--porcelain", "--untracked-files=no", "--", *PACKAGES, "protos", "bench")
    if dirty:
        return "HEAD", "the working tree changes code: HEAD is the build before it"
    return "HEAD~1", "the working tree is HEAD: its parent is the build before it"


def link_tree(tree: Path, into: Path) -> Path:
    """into/opentinker/<package> -> tree/<package> (and v1 -> the generated protos), as `make linktree` does."""
    package = into / "opentinker"
    package.mkdir(parents=True)
    for name in PACKAGES:
        if (tree / name).is_dir():
            (package / name).symlink_to(tree / name)
    (package / "v1").symlink_to(tree / "protos" / "opentinker" / "v1")
    return into


@contextmanager
def checkout(ref: str, work: Path, name: str) -> Iterator[Path]:
    tree = work / name
    git("worktree", "add", "--detach", "--force", str(tree), ref)
    try:
        yield tree
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=ROOT, capture_output=True, check=False)


def run_once(build: Build, work: Path, index: int, *, full: bool) -> dict[str, object]:
    out = work / f"{build.name}-{index}.json"
    env = {**os.environ, "OPENTINKER_BENCH_RESULTS": str(work / f"{build.name}-{index}-results.json")}
    if build.pythonpath is not None:
        env["PYTHONPATH"] = str(build.pythonpath)
    command = [sys.executable, str(build.script), *([] if full else ["--quick"]), "--json", str(out)]
    done = subprocess.run(command, cwd=build.script.parent, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"bench-check: the {build.name} run failed ({build.tree}):\n{done.stderr[-3000:]}")
    figures: dict[str, object] = json.loads(out.read_text())
    return figures


def median_of(runs: list[dict[str, object]], key: str) -> float | None:
    values = [float(v) for run in runs if isinstance(v := run.get(key), int | float)]
    return statistics.median(values) if values else None


def decode_rates(runs: list[dict[str, object]]) -> dict[str, float]:
    rates: dict[str, list[float]] = {}
    for run in runs:
        per = run.get("decode_tokens_per_s")
        if isinstance(per, dict):
            for name, value in per.items():
                rates.setdefault(name, []).append(float(value))
    return {name: statistics.median(values) for name, values in rates.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", help="git ref of the base build (default: see above)")
    parser.add_argument("--head", help="git ref of the head build (default: the working tree)")
    parser.add_argument("--rounds", type=int, default=3, help="runs per side (default 3)")
    parser.add_argument("--tolerance", type=float, default=0.05, help="largest drop of a ratio (default 0.05)")
    parser.add_argument("--full", action="store_true", help="the full-size runs (~5 min each) instead of --quick")
    parser.add_argument(
        "--script",
        choices=("own", "head"),
        default="own",
        help="each build runs its own bench script (default), or both the head's",
    )
    args = parser.parse_args()
    base_ref, why = (args.base, "--base") if args.base else default_base()
    base_rev = git("rev-parse", "--short", base_ref)
    head_label = git("rev-parse", "--short", args.head) if args.head else "the working tree"
    print(f"bench-check: base {base_ref} ({base_rev}; {why}) against {head_label}", flush=True)
    with tempfile.TemporaryDirectory(prefix="ot-bench-check-") as tmp:
        work = Path(tmp)
        with checkout(base_rev, work, "base") as base_tree, _head_tree(args.head, work) as head_tree:
            head_script = head_tree / "bench" / "sampler_multilora.py"
            head = Build(
                "head", head_tree, head_script, None if args.head is None else link_tree(head_tree, work / "head-link")
            )
            base_script = head_script if args.script == "head" else base_tree / "bench" / "sampler_multilora.py"
            base = Build("base", base_tree, base_script, link_tree(base_tree, work / "base-link"))
            runs: dict[str, list[dict[str, object]]] = {"base": [], "head": []}
            for index in range(args.rounds):
                order = (base, head) if index % 2 == 0 else (head, base)
                for build in order:
                    runs[build.name].append(run_once(build, work, index, full=args.full))
                    print(f"  round {index + 1}/{args.rounds}: {build.name} done", flush=True)
    failed = report(runs, args.tolerance)
    sys.exit(1 if failed else 0)


@contextmanager
def _head_tree(ref: str | None, work: Path) -> Iterator[Path]:
    if ref is None:
        yield ROOT
        return
    with checkout(git("rev-parse", "--short", ref), work, "head") as tree:
        yield tree


def report(runs: dict[str, list[dict[str, object]]], tolerance: float) -> list[str]:
    """Prints the table; returns the labels of the figures that dropped by more than the tolerance."""
    print(
        f"\n  {'figure (median of ' + str(len(runs['head'])) + ' runs each)':<40} {'base':>8} {'head':>8} "
        f"{'head/base':>10}"
    )
    failed: list[str] = []
    for key, label in JUDGED.items():
        old, new = median_of(runs["base"], key), median_of(runs["head"], key)
        if old is None or new is None:
            print(f"  {label:<40} {'-':>8} {'-':>8}   (not reported by both builds)")
            continue
        change = new / old
        verdict = "ok" if change >= 1 - tolerance else f"DROPPED more than {tolerance:.0%}"
        if change < 1 - tolerance:
            failed.append(label)
        print(f"  {label:<40} {old:8.3f} {new:8.3f} {change:10.3f}  {verdict}")
    old_rates, new_rates = decode_rates(runs["base"]), decode_rates(runs["head"])
    for name in sorted(old_rates.keys() & new_rates.keys()):
        change = new_rates[name] / old_rates[name]
        print(
            f"  {'decode tokens/s, ' + name:<40} {old_rates[name]:8.1f} {new_rates[name]:8.1f} {change:10.3f}"
            "  (absolute: shown, not judged)"
        )
    print(
        f"\nbench-check: {'FAILED: ' + ', '.join(failed) if failed else 'no ratio dropped by more than '}"
        f"{'' if failed else f'{tolerance:.0%}'}"
    )
    return failed


if __name__ == "__main__":
    main()
