"""`opentinker sample`: streams a completion from the session sampler to the terminal, errors as one line."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from registryutil import unique_name
from serverproc import ServerProcess

from opentinker.client import Renderer, SamplingClient, SamplingParams


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
    # The penalties and the salt reach the sampler, which checks them.
    for option in (("--frequency-penalty", "2.5"), ("--presence-penalty", "-3"), ("--cache-salt", "s" * 257)):
        done = sample(sampler_server, "base", "hello", *option)
        assert done.returncode == 1 and done.stderr.startswith("error: INVALID_ARGUMENT"), (option, done.stderr)


def test_sample_penalties_change_a_greedy_completion(sampler_server: ServerProcess) -> None:
    plain = sample(sampler_server, "base", "hello", "--max-tokens", "12", "--temperature", "0")
    penalized = sample(
        sampler_server,
        "base",
        "hello",
        "--max-tokens",
        "12",
        "--temperature",
        "0",
        "--frequency-penalty",
        "2",
        "--presence-penalty",
        "2",
        "--cache-salt",
        "mine",
    )
    assert plain.returncode == penalized.returncode == 0, (plain.stderr, penalized.stderr)
    # Greedy on a tiny random model repeats itself; a penalty of 2 per use forbids the repeats.
    assert penalized.stdout != plain.stdout


@pytest.mark.parametrize("option", [("--top-k", "-1"), ("--seed", "-1"), ("--max-tokens", "0")])
def test_sample_rejects_out_of_range_options(sampler_server: ServerProcess, option: tuple[str, str]) -> None:
    # Negative values do not fit the request's unsigned fields (they crashed with a ValueError traceback),
    # and max_tokens 0 would silently mean the server's default: a usage error instead.
    done = sample(sampler_server, "base", "hello", *option)
    assert done.returncode == 2, done.stderr
    assert "ValueError" not in done.stderr and option[0] in done.stderr


def test_sample_chat_renders_the_prompt_with_the_chat_template(sampler_server: ServerProcess, tiny_model: Path) -> None:
    # The same tokens the SDK's Renderer gives an RL or SFT loop, sampled with the same seed: the same text.
    renderer = Renderer.from_pretrained(tiny_model)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
    # Greedy: with the tiny model's random weights, a seeded draw is nearly the same whatever the prompt.
    params = SamplingParams(max_tokens=6, temperature=0.0, stop_token_ids=renderer.stop_token_ids)
    with SamplingClient(sampler_server.address, "base") as client:
        expected = client.sample(renderer.prompt_tokens(messages), params).sequences[0]
        plain = client.sample("hello", params).sequences[0]
    done = sample(
        sampler_server, "base", "hello", "--chat", "--system", "be brief", "--max-tokens", "6", "--temperature", "0"
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == renderer.tokenizer.decode(list(expected.tokens))
    assert expected.tokens != plain.tokens  # the template made a difference
    assert done.stderr.strip().splitlines()[-1] == f"[base, stop: {expected.stop_reason}]"


def test_sample_chat_without_a_local_tokenizer_is_one_line(sampler_server: ServerProcess, tmp_path: Path) -> None:
    done = sample(sampler_server, "base", "hello", "--chat", "--tokenizer", str(tmp_path))
    assert done.returncode == 2 and done.stderr.startswith("error: --chat needs the model's tokenizer"), done.stderr
    assert "Traceback" not in done.stderr and "--tokenizer" in done.stderr
    done = sample(sampler_server, "base", "hello", "--system", "x")
    assert done.returncode == 2 and "--chat" in done.stderr
