"""`make go-check`: start a registry (embedded Redis), a trainer and a sampler on a tiny model as real
processes, run the Go example against them, stop everything. Exits with the Go program's status."""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

from opentinker.cli.launch import ServerProcess, start_registry, start_sampler, start_trainer
from opentinker.client.tiny_model import TinyModelSpec, make_tiny_model

BINARY = Path(__file__).resolve().parents[2] / "build" / "go" / "bin" / "opentinker-go-example"


def main() -> int:
    if not BINARY.exists():
        print(f"{BINARY} is missing: run examples/go/build.sh first", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="opentinker-go-") as tmp:
        workdir = Path(tmp)
        model = make_tiny_model(workdir / "tiny-qwen2", TinyModelSpec(arch="qwen2", seed=0))
        servers: list[ServerProcess] = []
        try:
            registry = start_registry(workdir / "registry")
            servers.append(registry)
            servers.append(start_trainer(workdir / "trainer", model, registry))
            servers.append(start_sampler(workdir / "sampler", model, registry))
            addresses = dict(zip(("registry", "trainer", "sampler"), (s.address for s in servers), strict=True))
            print(" ".join(f"{name} {address}" for name, address in addresses.items()), flush=True)
            flags = [f"--{name}={address}" for name, address in addresses.items()]
            code = subprocess.run([str(BINARY), *flags], check=False, timeout=120).returncode
            if code != 0:
                for server in servers:
                    print(server.log()[-4000:], file=sys.stderr)
            return code
        finally:
            for server in reversed(servers):
                server.terminate()


if __name__ == "__main__":
    sys.exit(main())
