"""docs/metrics.md lists exactly the `opentinker_*` metrics each running server exports, with their types and
labels: scraped from the real registry, trainer and sampler processes after some traffic."""

from __future__ import annotations

import re
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest
from samplerutil import Sampler, score
from serverproc import ROOT, ServerProcess
from trainerutil import Trainer, create, random_tokens

DOC = ROOT / "docs" / "metrics.md"
ROW = re.compile(r"^\| `(opentinker_[a-z0-9_]+)` \| (\w+) \|([^|]*)\| ([^|]+) \|")
# prometheus_client adds a `<name>_created` gauge family next to every counter and histogram.
CREATED = re.compile(r"_created$")


@dataclass(frozen=True)
class Documented:
    kind: str
    labels: frozenset[str]
    servers: frozenset[str]


def documented() -> dict[str, Documented]:
    rows: dict[str, Documented] = {}
    for line in DOC.read_text().splitlines():
        match = ROW.match(line)
        if match:
            name, kind, labels, servers = match.groups()
            assert name not in rows, f"{name} listed twice"
            rows[name] = Documented(
                kind,
                frozenset(x.strip(" `") for x in labels.split(",") if x.strip(" `")),
                frozenset(x.strip() for x in servers.split(",")),
            )
    assert rows, f"no metric rows parsed from {DOC}"
    return rows


def exported(metrics_address: str) -> dict[str, tuple[str, set[str]]]:
    """`opentinker_*` families on the endpoint: name -> (type, label names seen on its samples)."""
    body = urllib.request.urlopen(f"http://{metrics_address}/metrics", timeout=10).read().decode()
    families: dict[str, tuple[str, set[str]]] = {}
    for line in body.splitlines():
        if line.startswith("# TYPE opentinker_"):
            _, _, name, kind = line.split()
            if not (CREATED.search(name) and kind == "gauge"):
                families[name] = (kind, set())
    for line in body.splitlines():
        if line.startswith("opentinker_"):
            sample = line.split("{", 1)[0].split(" ", 1)[0]
            family = next((f for f in families if sample == f or sample.startswith(f + "_")), None)
            if family is not None and "{" in line:
                labels = re.findall(r'([a-zA-Z_][a-zA-Z0-9_]*)="', line.split("{", 1)[1])
                families[family][1].update(label for label in labels if label not in ("le", "quantile"))
    return families


@pytest.fixture(scope="module")
def servers(
    registry_server: ServerProcess,
    trainer_server: ServerProcess,
    sampler_server: ServerProcess,
    trainer: Trainer,
    sampler: Sampler,
) -> dict[str, ServerProcess]:
    # Some traffic, so that labelled families have samples whose labels can be checked.
    create(trainer, seed=3)
    score(sampler, "base", random_tokens(5, 6))
    return {"registry": registry_server, "trainer": trainer_server, "sampler": sampler_server}


@pytest.mark.parametrize("server", ["registry", "trainer", "sampler"])
def test_metrics_doc_matches_what_the_server_exports(server: str, servers: dict[str, ServerProcess]) -> None:
    address = servers[server].metrics_address
    assert address is not None
    got = exported(address)
    expected = {name: row for name, row in documented().items() if server in row.servers}
    undocumented = sorted(set(got) - set(expected))
    assert not undocumented, f"{server} exports {undocumented}, missing from docs/metrics.md"
    absent = sorted(set(expected) - set(got))
    assert not absent, f"docs/metrics.md lists {absent} for {server}, which it does not export"
    for name, (kind, labels) in got.items():
        assert kind == expected[name].kind, f"{name}: exported as {kind}, documented as {expected[name].kind}"
        assert labels <= expected[name].labels, f"{name}: labels {sorted(labels)} vs {sorted(expected[name].labels)}"
    assert "opentinker_rpc_requests_total" in got and got["opentinker_rpc_requests_total"][1] == {"method", "code"}


def test_every_documented_server_name_is_real() -> None:
    for name, row in documented().items():
        assert row.servers <= {"registry", "trainer", "sampler"}, name
        assert row.kind in {"counter", "gauge", "histogram", "summary", "info"}, name
    assert Path(DOC).read_text().count("| `opentinker_") == len(documented())
