"""`opentinker registry ...` admin commands, run as a user runs them, against a real registry process."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import grpc
import pytest
from registryutil import create_adapter, publish, unique_name
from serverproc import ROOT, ServerProcess

from opentinker.rpc.serving.errors import error_info
from opentinker.v1 import registry_pb2, registry_pb2_grpc

Stub = registry_pb2_grpc.RegistryServiceStub
Cli = Callable[..., subprocess.CompletedProcess[str]]


@pytest.fixture
def cli(registry_server: ServerProcess) -> Cli:
    """Run `opentinker registry ARGS --registry ADDR` in a subprocess; returns the CompletedProcess."""

    def run(*args: str, address: str | None = None) -> subprocess.CompletedProcess[str]:
        return run_cli(*args, "--registry", address or registry_server.address)

    return run


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("OPENTINKER_REGISTRY", "OPENTINKER_TOKEN")}
    env["COLUMNS"] = "200"  # rich wraps tables at 80 columns when stdout is not a terminal
    return subprocess.run(
        [sys.executable, "-m", "opentinker.cli.main", "registry", *args],
        capture_output=True,
        text=True,
        timeout=30,
        env=env,
        cwd=ROOT,
    )


def ok(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode == 0, (result.args, result.stdout, result.stderr)
    assert result.stderr == "", result.stderr
    return result.stdout


def ok_json(result: subprocess.CompletedProcess[str]) -> Any:
    return json.loads(ok(result))


def failed(result: subprocess.CompletedProcess[str], code: str, reason: str | None = None) -> str:
    """A clean failure: exit 1, one `error: CODE: ... [REASON]` line on stderr, no traceback."""
    assert result.returncode == 1, (result.args, result.stdout, result.stderr)
    assert result.stderr.startswith(f"error: {code}:"), result.stderr
    assert len(result.stderr.splitlines()) == 1, result.stderr
    assert "Traceback" not in result.stderr + result.stdout, result.stderr
    if reason is not None:
        assert f"[{reason}]" in result.stderr, result.stderr
    return result.stderr


def aliases(stub: Stub, name: str) -> dict[str, int]:
    adapter = stub.GetAdapter(registry_pb2.GetAdapterRequest(name=name)).adapter
    return dict(adapter.aliases)


def resolve(stub: Stub, reference: str) -> int:
    number: int = stub.Resolve(registry_pb2.ResolveRequest(reference=reference)).version.version
    return number


def test_adapters_and_versions(cli: Cli, registry: Stub) -> None:
    name = unique_name("cli")
    create_adapter(registry, name)
    publish(registry, name)
    publish(registry, name, parent=1, aliases=("stable",))
    publish(registry, name, parent=2)

    listed = ok_json(cli("adapters", "--prefix", name, "--json"))
    assert [a["name"] for a in listed] == [name]
    assert {k: int(v) for k, v in listed[0]["aliases"].items()} == {"latest": 3, "stable": 2}
    assert int(listed[0]["latest_version"]) == 3 and int(listed[0]["version_count"]) == 3
    table = ok(cli("adapters", "--prefix", name))
    assert name in table and "latest->3" in table and "stable->2" in table

    versions = ok_json(cli("versions", name, "--json"))
    assert [int(v["version"]) for v in versions] == [3, 2, 1]
    assert [v.get("aliases", []) for v in versions] == [["latest"], ["stable"], []]
    table = ok(cli("versions", name))
    rows = [line for line in table.splitlines() if "local" in line]  # one row per version, "by local"
    assert [row.split()[1] for row in rows] == ["3", "2", "1"]
    assert "latest" in rows[0] and "stable" in rows[1]


def test_show_human_and_json(cli: Cli, registry: Stub) -> None:
    name = unique_name("cli")
    create_adapter(registry, name)
    publish(registry, name, aliases=("stable",))
    publish(registry, name, parent=1)

    out = ok(cli("show", f"{name}@stable"))
    assert out.splitlines()[0] == f"{name}@stable -> {name}@1"
    shown = ok_json(cli("show", name, "--json"))
    assert shown["adapter"] == name and int(shown["version"]) == 2
    assert shown["aliases"] == ["latest"] and shown["artifact_uri"].startswith("sha256:")


def test_versions_show_and_lineage_print_metrics_targets_and_what_is_hidden(cli: Cli, registry: Stub) -> None:
    name = unique_name("cli")
    create_adapter(registry, name)
    traces = [f"trace-{i}" for i in range(6)]
    metrics = {"loss:sum": 12.5, "weights:sum": 5.0}
    publish(registry, name)
    publish(
        registry,
        name,
        parent=1,
        lineage=registry_pb2.Lineage(metrics=metrics, batches=[registry_pb2.BatchRecord(digest="d", trace_ids=traces)]),
    )

    table = ok(cli("versions", name, "--limit", "1"))
    assert "loss:sum=12.5" in table and "weights:sum=5" in table
    assert "1 of 2 versions shown" in table
    assert "versions shown" not in ok(cli("versions", name))
    shown = ok(cli("show", name))
    assert "targets all-linear" in shown and "[]" not in shown  # the adapter's default: every linear module
    assert "metrics    loss:sum=12.5, weights:sum=5" in shown
    lineage = ok(cli("lineage", name))
    assert "trace-0, trace-1, trace-2, trace-3 (+2 more" in lineage and "trace-4" not in lineage

    fork = unique_name("cli")  # a fork of name@2 (init_from), with the trainer's persisted state
    create_adapter(registry, fork)
    publish(registry, fork, parent=2, lineage=registry_pb2.Lineage(parent_adapter=name, state_id="state-7"))
    shown = ok(cli("show", fork))
    assert f"parent     {name}@2" in shown and "state      state-7" in shown
    assert f"{name}@2" in ok(cli("versions", fork))


def test_alias_set_compare_and_set_and_rm(cli: Cli, registry: Stub) -> None:
    name = unique_name("cli")
    create_adapter(registry, name)
    publish(registry, name)
    publish(registry, name, parent=1)

    out = ok(cli("alias", "set", name, "stable", "1", "--expect", "0"))  # 0: the alias must not exist
    assert f"{name}@stable: - -> 1" in out
    assert aliases(registry, name) == {"latest": 2, "stable": 1}

    stale = cli("alias", "set", name, "stable", "2", "--expect", "0")
    failed(stale, "FAILED_PRECONDITION", "VERSION_CONFLICT")
    assert stale.stdout == ""
    assert aliases(registry, name) == {"latest": 2, "stable": 1}  # did not move

    out = ok(cli("alias", "rm", name, "stable"))
    assert f"removed {name}@stable (was 1)" in out
    assert aliases(registry, name) == {"latest": 2}


def test_rollback_previous_and_explicit(cli: Cli, registry: Stub) -> None:
    name = unique_name("cli")
    create_adapter(registry, name)
    for parent in range(3):
        publish(registry, name, parent=parent)

    # The versions carry trainer steps, as a trainer's snapshots do: the rollback says the next one moves latest.
    rolled = cli("rollback", name)
    assert rolled.returncode == 0 and f"{name}@latest: 3 -> 2" in rolled.stdout, rolled.stderr
    assert "its next snapshot moves latest again" in rolled.stderr
    assert resolve(registry, name) == 2
    back = json.loads(cli("rollback", name, "--to", "1", "--json").stdout)
    assert back["alias"] == "latest" and (int(back["from_version"]), int(back["to_version"])) == (2, 1)
    assert resolve(registry, name) == 1


def test_lineage_newest_first(cli: Cli, registry: Stub) -> None:
    name = unique_name("cli")
    create_adapter(registry, name)
    for parent in range(3):
        publish(registry, name, parent=parent)

    chain = ok_json(cli("lineage", name, "--json"))
    assert [int(v["version"]) for v in chain] == [3, 2, 1]
    assert [int(v["lineage"].get("parent_version", 0)) for v in chain] == [2, 1, 0]
    assert {v["adapter"] for v in chain} == {name}


def test_watch_from_event_id(cli: Cli, registry: Stub) -> None:
    name = unique_name("cli")
    created = registry.CreateAdapter(registry_pb2.CreateAdapterRequest(name=name))
    published = [publish(registry, name, parent=parent) for parent in range(3)]

    result = cli("watch", "--from", created.event_id, "--adapter", name, "--count", "3", "--json")
    lines = ok(result).splitlines()
    assert len(lines) == 3, lines
    events = [json.loads(line)["event"] for line in lines]
    assert [e["type"] for e in events] == ["EVENT_TYPE_VERSION_PUBLISHED"] * 3
    assert [int(e["version"]) for e in events] == [1, 2, 3]
    assert [e["event_id"] for e in events] == [p.event_id for p in published]
    assert {e["adapter"] for e in events} == {name}

    lines = ok(cli("watch", "--from", created.event_id, "--adapter", name, "--count", "1")).splitlines()
    assert len(lines) == 1
    assert lines[0].startswith(published[0].event_id)
    assert "VERSION_PUBLISHED" in lines[0] and f"{name} v1" in lines[0]


def test_gc_dry_run_then_collect(cli: Cli, registry: Stub) -> None:
    name = unique_name("cli")
    create_adapter(registry, name)
    for parent in range(3):
        publish(registry, name, parent=parent)

    dry = ok_json(cli("gc", "--keep", "1", "--adapter", name, "--dry-run", "--json"))
    assert sorted(int(c["version"]) for c in dry["collected"]) == [1, 2]
    assert {c["adapter"] for c in dry["collected"]} == {name}
    untouched = registry.GetVersion(registry_pb2.GetVersionRequest(adapter=name, version=1)).version
    assert not untouched.artifact_deleted

    out = ok(cli("gc", "--keep", "1", "--adapter", name))
    assert f"collected {name}@2" in out and f"collected {name}@1" in out and "2 versions" in out
    versions = ok_json(cli("versions", name, "--json"))
    assert {int(v["version"]): v.get("artifact_deleted", False) for v in versions} == {
        3: False,
        2: True,
        1: True,
    }


def test_create_and_delete(cli: Cli, registry: Stub) -> None:
    name = unique_name("cli")
    created = ok_json(cli("create", name, "--rank", "16", "--target", "attn", "--json"))
    assert created["adapter"]["name"] == name and created["event_id"]
    adapter = registry.GetAdapter(registry_pb2.GetAdapterRequest(name=name)).adapter
    assert adapter.lora_config.rank == 16 and list(adapter.lora_config.target_modules) == ["attn"]

    out = ok(cli("delete", name))
    assert out.startswith(f"deleted {name} (event ")
    with pytest.raises(grpc.RpcError) as caught:
        registry.GetAdapter(registry_pb2.GetAdapterRequest(name=name))
    info = error_info(caught.value)
    assert info is not None and info.reason == "ADAPTER_NOT_FOUND"


def test_errors_are_one_line_without_traceback(cli: Cli) -> None:
    missing = unique_name("cli")
    stderr = failed(cli("versions", missing), "NOT_FOUND", "ADAPTER_NOT_FOUND")
    assert missing in stderr
    failed(cli("show", f"{missing}@"), "INVALID_ARGUMENT", "INVALID_REFERENCE")
    # A bound socket that never listens: connections to its port are refused, and no one can take it.
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
        failed(cli("adapters", address=f"127.0.0.1:{port}"), "UNAVAILABLE")
