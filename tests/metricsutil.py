"""Reading a server's Prometheus endpoint in tests, and docs/metrics.md's table of what each server exports."""

from __future__ import annotations

import re
import urllib.request
from dataclasses import dataclass
from pathlib import Path


def scrape(metrics_address: str | None) -> str:
    assert metrics_address is not None, "the server runs without a metrics endpoint"
    with urllib.request.urlopen(f"http://{metrics_address}/metrics", timeout=10) as response:
        text: str = response.read().decode()
    return text


def metric(text: str, name: str, **labels: str) -> float:
    """The value of one Prometheus sample (0 when absent)."""
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        key, _, value = line.rpartition(" ")
        metric_name, _, label_text = key.partition("{")
        if metric_name != name:
            continue
        got = ",".join(sorted(label_text.rstrip("}").split(","))) if label_text else ""
        if got == want:
            return float(value)
    return 0.0


DOC = Path(__file__).resolve().parent.parent / "docs" / "metrics.md"
ROW = re.compile(r"^\| `(opentinker_[a-z0-9_]+)` \| (\w+) \|([^|]*)\| ([^|]+) \|")
BUCKET_ONLY = "(bucket store)"
# prometheus_client adds a `<name>_created` gauge family next to every counter and histogram.
CREATED = re.compile(r"_created$")


@dataclass(frozen=True)
class Documented:
    kind: str
    labels: frozenset[str]
    servers: frozenset[str]
    bucket: bool  # exported only with a bucket --store (the servers column says "(bucket store)")


def documented() -> dict[str, Documented]:
    rows: dict[str, Documented] = {}
    for line in DOC.read_text().splitlines():
        match = ROW.match(line)
        if match:
            name, kind, labels, servers = match.groups()
            assert name not in rows, f"{name} listed twice"
            bucket = BUCKET_ONLY in servers
            rows[name] = Documented(
                kind,
                frozenset(x.strip(" `") for x in labels.split(",") if x.strip(" `")),
                frozenset(x.strip() for x in servers.replace(BUCKET_ONLY, "").split(",")),
                bucket,
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
