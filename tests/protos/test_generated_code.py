"""The committed generated code is what `make protos` produces, every proto compiles, buf lint passes."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PROTO_DIR = ROOT / "protos"
PROTOS = sorted((PROTO_DIR / "opentinker" / "v1").glob("*.proto"))


def generate(out: Path, protos: list[Path]) -> None:
    from grpc_tools import protoc

    args = ["protoc", f"-I{PROTO_DIR}", f"--python_out={out}", f"--pyi_out={out}", f"--grpc_python_out={out}"]
    # grpc_tools bundles the well-known types (google/protobuf/*.proto).
    args.append(f"-I{Path(protoc.__file__).parent / '_proto'}")
    code = protoc.main([*args, *(str(p.relative_to(PROTO_DIR)) for p in protos)])
    assert code == 0, f"protoc failed for {protos}"


def test_all_four_protos_exist() -> None:
    assert [p.name for p in PROTOS] == ["common.proto", "registry.proto", "sampler.proto", "trainer.proto"]


def test_committed_code_matches_fresh_generation(tmp_path: Path) -> None:
    generate(tmp_path, PROTOS)
    fresh = sorted((tmp_path / "opentinker" / "v1").iterdir())
    assert fresh, "protoc generated nothing"
    stale = [
        f.name
        for f in fresh
        if not (PROTO_DIR / "opentinker" / "v1" / f.name).exists()
        or (PROTO_DIR / "opentinker" / "v1" / f.name).read_bytes() != f.read_bytes()
    ]
    assert not stale, f"generated code is stale, run `make protos`: {stale}"


@pytest.mark.parametrize("proto", PROTOS, ids=lambda p: p.name)
def test_each_proto_compiles_alone(proto: Path, tmp_path: Path) -> None:
    generate(tmp_path, [proto])


def test_generated_modules_import_and_define_services() -> None:
    from opentinker.v1 import registry_pb2, sampler_pb2, trainer_pb2

    services = {
        registry_pb2.DESCRIPTOR.services_by_name["RegistryService"],
        trainer_pb2.DESCRIPTOR.services_by_name["TrainerService"],
        sampler_pb2.DESCRIPTOR.services_by_name["SamplerService"],
    }
    methods = {s.name: {m.name for m in s.methods} for s in services}
    assert {"PublishVersion", "WatchEvents", "Rollback", "GetLineage", "GarbageCollect"} <= methods["RegistryService"]
    assert {"ForwardBackward", "OptimStep", "SaveSnapshot", "SaveState", "LoadState"} <= methods["TrainerService"]
    assert {"Sample", "ComputeLogprobs", "LoadAdapter", "ListLoaded", "GetStats"} <= methods["SamplerService"]
    assert registry_pb2.DESCRIPTOR.GetOptions().go_package.endswith(";opentinkerv1")


def test_buf_lint() -> None:
    buf = shutil.which("buf") or str(Path(sys.executable).parent / "buf")
    if not Path(buf).exists():
        pytest.skip("buf not installed (PyPI package buf-bin, in the dev extra)")
    result = subprocess.run([buf, "lint"], cwd=PROTO_DIR, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
