"""A virtualenv of its own with Thinking Machines' `tinker` SDK and `tinker-cookbook`, as a Tinker user has them,
built once and cached outside the repository (keyed on the pins), so the cookbook runs with its own dependencies
and never with ours.

`tinker-cookbook==0.6.1` requires `tml-renderers`, which the package index does not have (only its audio recipes
import it): the cookbook goes in with `--no-deps`, after its other requirements pinned below. torch goes in first
and pinned (TORCH_SPEC, as the Makefile's), so no requirement can pull another build.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

COOKBOOK = "tinker-cookbook==0.6.1"
# The cookbook's requirements (its METADATA) less tml-renderers, at versions that resolved together here.
REQUIREMENTS = (
    "tinker==0.38.0",
    "aiohttp==3.14.5",
    "anyio==4.16.0",
    "blobfile==3.3.0",
    "chz==0.4.0",
    "cloudpickle==3.1.3",
    "datasets==5.2.0",
    "huggingface-hub==2.4.0",
    "numpy==2.4.6",
    "pillow==13.0.0",
    "pydantic==2.14.4",
    "pyrage==1.4.0",
    "rich==15.0.0",
    "safetensors==0.8.0",
    "termcolor==3.3.0",
    "tiktoken==0.14.0",
    "tqdm==4.70.1",
    "transformers==5.24.0",
    # The math-rl extra: math_rl.train imports its grader, which needs them.
    "math-verify==0.9.0",
    "pylatexenc==2.11",
    "sympy==1.14.0",
)
# What the built environment must import (the recipes this suite runs).
PROBE = (
    "import tinker, tinker_cookbook.rl.train, tinker_cookbook.supervised.train, "
    "tinker_cookbook.recipes.math_rl.train, tinker_cookbook.recipes.multiplayer_rl.guess_number.train"
)
STAMP = ".opentinker-ready"


class IndexUnreachable(Exception):
    """The package index could not be reached: the one reason the cookbook suite skips."""


def torch_spec() -> str:
    return os.environ.get("TORCH_SPEC", "torch==2.13.0")


def venv_dir() -> Path:
    pins = "\n".join((sys.version.split()[0], torch_spec(), COOKBOOK, *REQUIREMENTS))
    digest = hashlib.sha256(pins.encode()).hexdigest()[:16]
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    return cache / "opentinker" / f"cookbook-venv-{digest}"


def cookbook_python() -> Path:
    """The cached environment's python, built first if missing. IndexUnreachable when the index cannot be
    reached; any other install failure raises RuntimeError with pip's output."""
    target = venv_dir()
    python = target / "bin" / "python"
    if (target / STAMP).is_file():
        return python
    _check_index()
    building = target.with_name(f"{target.name}.building-{os.getpid()}")
    shutil.rmtree(building, ignore_errors=True)
    subprocess.run([sys.executable, "-m", "venv", str(building)], check=True)
    pip = [str(building / "bin" / "python"), "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
    _run([*pip, torch_spec()])
    _run([*pip, torch_spec(), *REQUIREMENTS])  # torch restated: nothing may replace it
    _run([*pip, "--no-deps", COOKBOOK])
    _run([str(building / "bin" / "python"), "-c", PROBE])
    # Into place in one rename, so a half-built environment is never used (only `bin/python -m ...` is run from
    # it: its console scripts' shebangs still name the build directory).
    (building / STAMP).write_text("\n".join((torch_spec(), COOKBOOK, *REQUIREMENTS)) + "\n")
    try:
        building.rename(target)
    except OSError:  # another run finished first: use its copy
        shutil.rmtree(building, ignore_errors=True)
    return python


def _check_index() -> None:
    """The cookbook's own wheel, downloaded without its requirements: the cheapest proof the index answers. When
    pip fails, the index pages are asked directly: only an index that does not answer at all skips the suite."""
    probe = venv_dir().with_name("cookbook-index-probe")
    shutil.rmtree(probe, ignore_errors=True)
    result = subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "-d", str(probe), COOKBOOK],
        capture_output=True,
        text=True,
        timeout=300,
    )
    shutil.rmtree(probe, ignore_errors=True)
    if result.returncode == 0:
        return
    output = result.stdout + result.stderr
    last = (output.strip().splitlines() or ["(no output)"])[-1]
    listed = re.findall(r"Looking in indexes: (.+)", output)  # printed unless the index is the default one
    indexes = [url.strip() for line in listed for url in line.split(",")] or ["https://pypi.org/simple"]
    project = COOKBOOK.split("==", maxsplit=1)[0]
    if any(_answers(f"{url.rstrip('/')}/{project}/") for url in indexes if url.startswith(("http://", "https://"))):
        raise RuntimeError(f"pip could not fetch {COOKBOOK} from an index that answers: {last}")
    raise IndexUnreachable(f"the package index cannot be reached ({', '.join(indexes)}): {last}")


def _answers(url: str) -> bool:
    """Any HTTP reply, a 404 included, proves the index is reachable."""
    try:
        with urllib.request.urlopen(url, timeout=20):
            return True
    except urllib.error.HTTPError:
        return True
    except (OSError, ValueError):
        return False


def _run(args: list[str]) -> None:
    result = subprocess.run(args, capture_output=True, text=True, timeout=1800)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(args[3:])} failed:\n{result.stdout[-4000:]}\n{result.stderr[-4000:]}")
