"""Reading a server's Prometheus endpoint in tests."""

from __future__ import annotations

import urllib.request


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
