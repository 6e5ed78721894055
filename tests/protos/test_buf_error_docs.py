"""Every RPC documents its errors in the .proto comments ("Errors: CODE (REASON, ...)"), read back from the
descriptor set `buf build` writes with source info; every code is a gRPC code and every reason one the
servers raise."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from google.protobuf import descriptor_pb2

ROOT = Path(__file__).resolve().parents[2]
BUF = shutil.which("buf") or str(Path(sys.executable).parent / "buf")
SERVER_CODE = ["registry", "rpc", "weights", "trainer_server", "sampler_server"]
# One "CODE (REASON, REASON)" clause of an Errors: line.
CLAUSE = re.compile(r"([A-Z_]+) \(([A-Z_, ]+)\)")

pytestmark = pytest.mark.skipif(not Path(BUF).exists(), reason="buf not installed (PyPI package buf-bin, dev extra)")


def rpc_comments(tmp_path: Path) -> dict[str, str]:
    """The leading comment of every RPC in protos/, by "Service.Method"."""
    image = tmp_path / "image.binpb"
    subprocess.run([BUF, "build", str(ROOT / "protos"), "--as-file-descriptor-set", "-o", str(image)], check=True)
    files = descriptor_pb2.FileDescriptorSet.FromString(image.read_bytes()).file
    comments: dict[str, str] = {}
    for file in files:
        if not file.name.startswith("opentinker/"):
            continue
        # Source path [6, s, 2, m]: FileDescriptorProto.service[s].method[m].
        by_path = {tuple(loc.path): loc.leading_comments for loc in file.source_code_info.location}
        for s, service in enumerate(file.service):
            for m, method in enumerate(service.method):
                comments[f"{service.name}.{method.name}"] = by_path.get((6, s, 2, m), "")
    return comments


def documented_errors(comment: str) -> list[tuple[str, list[str]]]:
    text = " ".join(comment.split())
    _, found, errors = text.partition("Errors: ")
    assert found, "no 'Errors:' line"
    if errors.startswith("none beyond those of every RPC"):
        return []
    clauses = [(code, [r.strip() for r in reasons.split(",")]) for code, reasons in CLAUSE.findall(errors)]
    assert clauses, f"no 'CODE (REASON, ...)' clause in {errors!r}"
    return clauses


def raised_reasons() -> set[str]:
    """Reasons the server code can put in an ErrorInfo: reason="X", default reasons, Lua error replies."""
    reasons: set[str] = set()
    for package in SERVER_CODE:
        for path in (ROOT / package).rglob("*.py"):
            text = path.read_text()
            reasons.update(re.findall(r'reason="([A-Z_]+)"', text))
            reasons.update(re.findall(r'default_reason(?:: str)? = "([A-Z_]+)"', text))
            reasons.update(re.findall(r"error_reply\('([A-Z_]+) ", text))
    return reasons


def test_every_rpc_documents_its_errors(tmp_path: Path) -> None:
    comments = rpc_comments(tmp_path)
    assert {"RegistryService.CreateAdapter", "TrainerService.OptimStep", "SamplerService.Sample"} <= set(comments)
    codes = {c.name for c in grpc.StatusCode}
    known = raised_reasons()
    assert {"NO_GRADIENTS", "VERSION_CONFLICT", "PERMISSION_DENIED"} <= known  # the scan itself works
    problems = []
    for rpc, comment in sorted(comments.items()):
        try:
            clauses = documented_errors(comment)
        except AssertionError as error:
            problems.append(f"{rpc}: {error}")
            continue
        for code, reasons in clauses:
            if code not in codes:
                problems.append(f"{rpc}: {code} is not a gRPC status code")
            problems += [f"{rpc}: reason {r} is raised nowhere in {SERVER_CODE}" for r in reasons if r not in known]
    assert not problems, "\n".join(problems)


def test_a_missing_errors_line_is_reported() -> None:
    with pytest.raises(AssertionError, match="no 'Errors:' line"):
        documented_errors(" Moves an alias.\n")
    assert documented_errors(" Errors: INVALID_ARGUMENT (A, B),\n   NOT_FOUND (C).\n") == [
        ("INVALID_ARGUMENT", ["A", "B"]),
        ("NOT_FOUND", ["C"]),
    ]
