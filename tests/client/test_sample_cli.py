"""`opentinker sample`: streams a completion from the session sampler to the terminal, errors as one line."""

from __future__ import annotations

import subprocess
import sys

import pytest
from registryutil import unique_name
from serverproc import ServerProcess


def sample(sampler: ServerProcess, *args: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "opentinker.cli.main", "sample", *args, "--sampler", sampler.address]
    return subprocess.run(command, capture_output=True, text=True, timeout=60)


def test_sample_streams_a_greedy_completion(sampler_server: ServerProcess) -> None:
    done = sample(sampler_server, "base", "hello", "--max-tokens", "5", "--temperature", "0")
    assert done.returncode == 0, done.stderr
    assert done.stderr.strip().splitlines()[-1] == "[base, stop: length]"
    assert done.stdout  # the text (possibly only replacement characters: the tiny model's weights are random)
    again = sample(sampler_server, "base", "hello", "--max-tokens", "5", "--temperature", "0")
    assert again.stdout == done.stdout  # greedy: the same completion


def test_sample_reports_errors_without_a_traceback(sampler_server: ServerProcess) -> None:
    done = sample(sampler_server, unique_name("missing"), "hello", "--max-tokens", "5")
    assert done.returncode == 1
    assert done.stderr.startswith("error: NOT_FOUND") and "ADAPTER_NOT_FOUND" in done.stderr
    assert "Traceback" not in done.stderr and done.stdout == ""
    done = sample(sampler_server, "base", "hello", "--top-p", "1.5")
    assert done.returncode == 1 and done.stderr.startswith("error: INVALID_ARGUMENT"), done.stderr


@pytest.mark.parametrize("option", [("--top-k", "-1"), ("--seed", "-1"), ("--max-tokens", "0")])
def test_sample_rejects_out_of_range_options(sampler_server: ServerProcess, option: tuple[str, str]) -> None:
    # Negative values do not fit the request's unsigned fields (they crashed with a ValueError traceback),
    # and max_tokens 0 would silently mean the server's default: a usage error instead.
    done = sample(sampler_server, "base", "hello", *option)
    assert done.returncode == 2, done.stderr
    assert "ValueError" not in done.stderr and option[0] in done.stderr
