"""The SDK stands alone: importing `opentinker.client` and every module in it loads no server package and not
the command line (which wires the servers: `opentinker.cli` is a composition root of its own)."""

from __future__ import annotations

import json
import subprocess
import sys

FORBIDDEN = ("registry", "trainer_server", "sampler_server", "gateway", "cli")

PROBE = """
import importlib, json, pkgutil, sys
import opentinker.client as sdk
modules = sorted(m.name for m in pkgutil.iter_modules(sdk.__path__, "opentinker.client."))
for name in modules:
    importlib.import_module(name)
print(json.dumps({"imported": modules, "loaded": sorted(sys.modules)}))
"""


def test_importing_the_sdk_loads_no_server_package() -> None:
    # A fresh interpreter: this test process has imported the servers already (fixtures, other tests).
    done = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert "opentinker.client.registry_client" in result["imported"]  # the walk found the modules
    leaked = [name for name in result["loaded"] if any(name.split(".")[:2] == ["opentinker", pkg] for pkg in FORBIDDEN)]
    assert leaked == []
