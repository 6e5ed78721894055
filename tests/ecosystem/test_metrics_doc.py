"""docs/metrics.md lists exactly the `opentinker_*` metrics each running server exports, with their types and
labels: scraped from the real registry, trainer and sampler processes after some traffic."""

from __future__ import annotations

from pathlib import Path

import pytest
from metricsutil import DOC, documented, exported
from samplerutil import Sampler, score
from serverproc import ServerProcess
from trainerutil import Trainer, create, random_tokens


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
    expected = {name: row for name, row in documented().items() if server in row.servers and not row.bucket}
    undocumented = sorted(set(got) - set(expected))
    assert not undocumented, f"{server} exports {undocumented}, missing from docs/metrics.md"
    absent = sorted(set(expected) - set(got))
    assert not absent, f"docs/metrics.md lists {absent} for {server}, which it does not export"
    for name, (kind, labels) in got.items():
        assert kind == expected[name].kind, f"{name}: exported as {kind}, documented as {expected[name].kind}"
        assert labels <= expected[name].labels, f"{name}: labels {sorted(labels)} vs {sorted(expected[name].labels)}"
    assert "opentinker_rpc_requests_total" in got and got["opentinker_rpc_requests_total"][1] == {"method", "code"}


def test_every_documented_server_name_is_real() -> None:
    assert any(row.bucket for row in documented().values())  # the bucket store's rows parse too
    for name, row in documented().items():
        assert row.servers <= {"registry", "trainer", "sampler"}, name
        assert row.kind in {"counter", "gauge", "histogram", "summary", "info"}, name
    assert Path(DOC).read_text().count("| `opentinker_") == len(documented())
