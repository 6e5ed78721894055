"""The benchmark suite's plumbing (bench/results.py, bench/workload.py) on tiny synthetic runs, so that
`make bench` cannot rot silently. No timings are asserted here: the figures themselves live in bench/."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from serverproc import ROOT

sys.path.insert(0, str(ROOT / "bench"))

import results
import workload

FIGURE_KEYS = {"name", "value", "unit", "target", "comparison", "met", "config", "script", "recorded_at"}


def test_record_merges_figures_by_name_and_judges_targets(tmp_path: Path) -> None:
    path = tmp_path / "results.json"
    results.start_run({"quick": True}, path)
    results.record("P9 speedup", 0.5, target=0.95, comparison=">=", config={"batch": 4}, path=path)
    results.record("P0 latency", 40.0, target=50, comparison="<=", unit="ms", path=path)
    results.record("P5 reported only", 3.0, path=path)
    results.record("P9 speedup", 0.97, target=0.95, comparison=">=", config={"batch": 8}, path=path)  # replaces
    results.record("P1 failed measurement", math.nan, target=1.0, path=path)
    results.update_run({"seconds total": 1.5}, path)

    data = json.loads(path.read_text())
    assert data["schema"] == results.SCHEMA and data["run"] == {"quick": True, "seconds total": 1.5}
    assert data["updated"].endswith("Z")
    items = {f["name"]: f for f in data["figures"]}
    assert [f["name"] for f in data["figures"]] == sorted(items)  # one entry per name, in P-number order
    assert all(set(f) == FIGURE_KEYS for f in data["figures"])
    assert items["P9 speedup"]["value"] == 0.97 and items["P9 speedup"]["met"] is True
    assert items["P9 speedup"]["config"] == {"batch": 8}
    assert items["P0 latency"]["met"] is True and items["P0 latency"]["unit"] == "ms"
    assert items["P5 reported only"]["met"] is None and items["P5 reported only"]["target"] is None
    assert items["P1 failed measurement"]["met"] is False  # NaN never meets a target

    table = results.table(results.figures(path))
    assert "2/3 targets met" in table
    rows = {line.split("  ")[0]: line for line in table.splitlines()}
    assert rows["P1 failed measurement"].endswith("NO") and rows["P9 speedup"].endswith("yes")
    assert rows["P0 latency"].split()[-1] == "yes" and "<= 50" in rows["P0 latency"]


@pytest.mark.parametrize(
    ("value", "target", "comparison", "met"),
    [
        (0.95, 0.95, ">=", True),
        (0.9499, 0.95, ">=", False),
        (1.10, 1.10, "<=", True),
        (1.2, 1.10, "<=", False),
        (0.0, 0.0, "<=", True),
        (1.0, 0.0, "<=", False),
        (5.0, None, ">=", None),
        (math.inf, 1.0, ">=", False),
    ],
)
def test_met_logic(value: float, target: float | None, comparison: results.Comparison, met: bool | None) -> None:
    assert results.is_met(value, target, comparison) is met


def test_a_benchmark_process_records_into_the_shared_file(tmp_path: Path) -> None:
    """Scripts run as child processes of run_all, all writing the file named by OPENTINKER_BENCH_RESULTS."""
    path = tmp_path / "out" / "results.json"
    script = tmp_path / "fake_bench.py"
    script.write_text(
        textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(ROOT / "bench")!r})
        from results import record
        record("P4 reload latency p50", 12.5, target=50, comparison="<=", unit="ms", config={{"reloads": 3}})
    """)
    )
    env = {"OPENTINKER_BENCH_RESULTS": str(path), "PATH": "/usr/bin:/bin"}
    subprocess.run([sys.executable, str(script)], env=env, check=True, timeout=60)
    (figure,) = results.figures(path)
    assert figure == results.Figure(
        "P4 reload latency p50", 12.5, "ms", 50, "<=", True, {"reloads": 3}, "fake_bench.py", figure.recorded_at
    )
    printed = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "results.py"), str(path)],
        check=True,
        capture_output=True,
        text=True,
        timeout=60,
    ).stdout
    assert "P4 reload latency p50" in printed and "12.5 ms" in printed and "1/1 targets met" in printed


def test_a_results_file_of_another_schema_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "results.json"
    path.write_text(json.dumps({"schema": 0, "figures": []}))
    with pytest.raises(ValueError, match="schema"):
        results.record("P1", 1.0, path=path)


def test_workload_shapes_match_the_sampler_model(tiny_model: Path) -> None:
    """The benchmarks size adapters (and P7's raw bytes) from the spec; they must match the served model."""
    import torch

    from opentinker.sampler_server.model.llama import LlamaForCausalLM

    config = json.loads((tiny_model / "config.json").read_text())
    spec = workload.ModelSpec(
        arch="qwen2",
        vocab_size=config["vocab_size"],
        hidden_size=config["hidden_size"],
        intermediate_size=config["intermediate_size"],
        num_hidden_layers=config["num_hidden_layers"],
        num_attention_heads=config["num_attention_heads"],
        num_key_value_heads=config["num_key_value_heads"],
    )
    runner = LlamaForCausalLM.from_pretrained(tiny_model, device=torch.device("cpu"), dtype=torch.float32)
    shapes = workload.linear_shapes(spec)
    served = runner.linear_shapes()
    # The benchmarks' adapters target attn + mlp: every projection the sampler serves, all but lm_head.
    assert served.pop("lm_head") == (spec.hidden_size, spec.vocab_size)
    assert shapes == served
    weights = workload.lora_weights(shapes, seed=1)
    assert sum((a.numel() + b.numel()) * 4 for a, b in weights.values()) == workload.raw_bytes(shapes)
    files = workload.peft_files(weights)
    assert json.loads(files["adapter_config.json"])["r"] == workload.RANK


def test_traffic_generators_are_seeded_and_shaped() -> None:
    draws = workload.zipf_draws(256, 20_000)
    assert draws == workload.zipf_draws(256, 20_000) and min(draws) >= 0 and max(draws) < 256
    top = sum(1 for d in draws if d < 64) / len(draws)
    assert abs(top - workload.zipf_mass(256, 64)) < 0.02
    arrivals = workload.poisson_arrivals(10.0, 5000)
    assert arrivals == sorted(arrivals) and abs(arrivals[-1] / 5000 - 0.1) < 0.01  # mean gap 1 / rate
    assert workload.percentile([3.0, 1.0, 2.0, 4.0], 50) == 2.0 and workload.percentile([1.0, 2.0], 99) == 2.0
    assert math.isnan(workload.percentile([], 50))
