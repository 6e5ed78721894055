"""The Go example (examples/go) built from the .proto files with Debian's Go toolchain, run against real
registry, trainer and sampler processes; what it prints is checked against the servers from Python."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
from registryutil import unique_name
from serverproc import ROOT, ServerProcess

from opentinker.client import ServiceClient
from opentinker.client.fleet_router import FleetRouter
from opentinker.v1 import common_pb2, registry_pb2, registry_pb2_grpc, sampler_pb2, sampler_pb2_grpc

GOCODE = Path("/usr/share/gocode/src")
NEEDED_TOOLS = ["go", "protoc", "protoc-gen-go", "protoc-gen-go-grpc"]
NEEDED_PACKAGES = [
    "google.golang.org/grpc",
    "google.golang.org/protobuf",
    "google.golang.org/genproto/googleapis/rpc/errdetails",
]
MISSING = [t for t in NEEDED_TOOLS if shutil.which(t) is None]
MISSING += [p for p in NEEDED_PACKAGES if not (GOCODE / p).is_dir()]

pytestmark = pytest.mark.skipif(
    bool(MISSING), reason=f"Go toolchain missing ({', '.join(MISSING)}): run examples/go/install-deps.sh (Debian 12)"
)

BINARY = ROOT / "build" / "go" / "bin" / "opentinker-go-example"


@pytest.fixture(scope="module")
def go_example() -> Path:
    """Stubs generated from the current protos and the example built (GOPATH mode, no module proxy)."""
    build = subprocess.run([str(ROOT / "examples/go/build.sh")], capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stdout + build.stderr
    return BINARY


def run_example(binary: Path, adapter: str, *servers: ServerProcess) -> list[str]:
    flags = [f"--{n}={s.address}" for n, s in zip(("registry", "trainer", "sampler"), servers, strict=True)]
    result = subprocess.run([str(binary), *flags, f"--adapter={adapter}"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout.splitlines()


def line(lines: list[str], pattern: str) -> re.Match[str]:
    found = [m for m in map(re.compile(pattern).fullmatch, lines) if m]
    assert len(found) == 1, f"expected one line matching {pattern!r} in:\n" + "\n".join(lines)
    return found[0]


def test_go_client_trains_publishes_samples_and_decodes_errors(
    go_example: Path,
    registry_server: ServerProcess,
    trainer_server: ServerProcess,
    sampler_server: ServerProcess,
    registry: registry_pb2_grpc.RegistryServiceStub,
    sampler: sampler_pb2_grpc.SamplerServiceStub,
) -> None:
    adapter = unique_name("go")
    lines = run_example(go_example, adapter, registry_server, trainer_server, sampler_server)
    a = re.escape(adapter)

    line(lines, rf"adapter created {a} rank 8 parameters [1-9]\d*")
    loss = float(line(lines, r"loss (\S+) over 2 datums \(loss:sum\) batch [0-9a-f]{64}")[1])
    assert loss > 0
    line(lines, r"step 1")
    published = line(lines, rf"version (\d+) of {a} sha256 ([0-9a-f]{{64}}) aliases \[latest\]")
    number, sha256 = int(published[1]), published[2]
    sampled = line(lines, rf"sampled 8 tokens from {a}@{number} stop STOP_REASON_LENGTH tokens \[([\d ]+)\]")
    go_tokens = [int(t) for t in sampled[1].split()]
    line(lines, rf"event EVENT_TYPE_VERSION_PUBLISHED {a} version {number} aliases map\[latest:{number}\] id \S+")
    line(lines, r"error OptimStep code FailedPrecondition reason NO_GRADIENTS domain opentinker .*")
    line(lines, r"error GetVersion code NotFound reason VERSION_NOT_FOUND domain opentinker .*")
    assert lines[-1] == "ok"

    # What Go reported is what the registry recorded: the version, its artifact and its lineage.
    version = registry.GetVersion(registry_pb2.GetVersionRequest(adapter=adapter, version=number)).version
    assert version.artifact_sha256 == sha256
    assert version.lineage.trainer_step == 1
    assert [list(b.trace_ids) for b in version.lineage.batches] == [["go-example"]]

    # The same greedy request from Python gets the same tokens from the same version.
    prompt = common_pb2.ModelInput(
        chunks=[common_pb2.ModelInputChunk(encoded_text=common_pb2.EncodedTextChunk(tokens=[1, 5, 9, 13]))]
    )
    request = sampler_pb2.SampleRequest(
        model=f"{adapter}@{number}",
        prompt=prompt,
        sampling_params=sampler_pb2.SamplingParams(temperature=0.0, max_tokens=8),
    )
    messages = list(sampler.Sample(request))
    assert [t for m in messages for t in m.tokens] == go_tokens
    assert {(m.version.adapter, m.version.version) for m in messages} == {(adapter, number)}


def test_go_client_routes_by_the_fleet_rule_from_list_replicas(
    go_example: Path,
    registry_server: ServerProcess,
    trainer_server: ServerProcess,
    sampler_server: ServerProcess,
) -> None:
    """--sampler=fleet: the Go port of the routing rule (examples/go/route.go, unit-tested by `go test` in
    build.sh against docs/fleet.md's test vector) picks the replica Python's FleetRouter picks."""
    adapter = unique_name("gofleet")
    flags = [f"--registry={registry_server.address}", f"--trainer={trainer_server.address}", "--sampler=fleet"]
    result = subprocess.run(
        [str(go_example), *flags, f"--adapter={adapter}"], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    routed = line(lines, rf"routed {re.escape(adapter)} to (\S+) of \d+ replicas")[1]
    line(lines, rf"sampled 8 tokens from {re.escape(adapter)}@\d+ stop STOP_REASON_LENGTH tokens \[[\d ]+\]")
    with ServiceClient(registry=registry_server.address) as client:
        replicas = client.registry_client().list_replicas("sampler")
        base = client.registry_client().get_adapter(adapter).base_model_digest
    assert routed == FleetRouter().route(adapter, replicas, base)[0].address
    assert routed == sampler_server.address  # the session's only sampler of this base


def test_go_client_reports_an_unreachable_server(go_example: Path) -> None:
    # Nothing listens on port 1: the example must fail with a message, not hang or claim success.
    dead = "127.0.0.1:1"
    result = subprocess.run(
        [str(go_example), f"--registry={dead}", f"--trainer={dead}", f"--sampler={dead}", "--timeout=1s"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 1
    assert "go example failed: dial 127.0.0.1:1" in result.stderr
    assert "ok" not in result.stdout.splitlines()
