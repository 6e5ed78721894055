"""The prefix cache's figures in a real sampler with tenants: GetStats gives a tenant's caller its own Sample
prompts' tokens by source (cached, computed, shared) and nothing of another tenant's; an admin sees every
caller's. A ComputeLogprobs of a conversation so far registers its blocks: the tenant's next Sample extending it
finds them, another tenant's does not. `opentinker status` prints the "KV cache" line from these figures."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from samplerutil import params, prompt, request, wait_until
from serverproc import ServerProcess, start_sampler
from trainerutil import model_input

from opentinker.v1 import sampler_pb2, sampler_pb2_grpc

TOKENS = {"admin": "tok-cb-admin", "team-a": "tok-cb-a", "team-b": "tok-cb-b"}
TEXT = prompt(8811, length=70)  # four full blocks and 6 tokens


@pytest.fixture(scope="module")
def server(
    tiny_model: Path, registry_server: ServerProcess, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    workdir = tmp_path_factory.mktemp("cachebench-sampler")
    tokens = workdir / "tokens.json"
    entries = [{"token": t, "tenant": n, "role": "admin" if n == "admin" else "user"} for n, t in TOKENS.items()]
    tokens.write_text(json.dumps({"tokens": entries}))
    proc = start_sampler(
        workdir, tiny_model, registry_server, "--num-blocks", "64", "--max-len", "256", "--tokens-file", str(tokens)
    )
    yield proc
    assert proc.terminate() == 0, proc.log()


@pytest.fixture(scope="module")
def sampler(server: ServerProcess) -> Iterator[sampler_pb2_grpc.SamplerServiceStub]:
    with grpc.insecure_channel(server.address) as channel:
        yield sampler_pb2_grpc.SamplerServiceStub(channel)


def auth(who: str) -> list[tuple[str, str]]:
    return [("authorization", f"Bearer {TOKENS[who]}")]


def sample(sampler: sampler_pb2_grpc.SamplerServiceStub, who: str, tokens: list[int], n: int = 1) -> list[int]:
    messages = sampler.Sample(
        request("base", tokens, params(max_tokens=4), num_samples=n), metadata=auth(who), timeout=60
    )
    return [t for m in messages for t in m.tokens]


def own(sampler: sampler_pb2_grpc.SamplerServiceStub, who: str) -> tuple[int, int, int]:
    s = sampler.GetStats(sampler_pb2.GetStatsRequest(), metadata=auth(who), timeout=30)
    return s.own_prompt_tokens_cached, s.own_prompt_tokens_computed, s.own_prompt_tokens_shared


def run_status(address: str, who: str) -> str:
    result = subprocess.run(
        [sys.executable, "-m", "opentinker.cli.main", "status", "--sampler", address, "--token", TOKENS[who]],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "COLUMNS": "200"},
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def test_each_tenant_sees_its_own_prompt_tokens_by_source(
    server: ServerProcess, sampler: sampler_pb2_grpc.SamplerServiceStub
) -> None:
    sample(sampler, "team-a", TEXT)
    assert wait_until(lambda: own(sampler, "team-a") == (0, 70, 0)), own(sampler, "team-a")
    sample(sampler, "team-a", TEXT, n=2)  # 4 blocks cached, 6 tokens computed, the 2nd sample shares the prompt
    assert wait_until(lambda: own(sampler, "team-a") == (64, 76, 70)), own(sampler, "team-a")
    sample(sampler, "team-b", TEXT)  # its own salt: finds nothing of team-a's
    assert wait_until(lambda: own(sampler, "team-b") == (0, 70, 0)), own(sampler, "team-b")
    assert own(sampler, "team-a") == (64, 76, 70)  # untouched by team-b's request
    assert own(sampler, "admin") == (64, 146, 70)  # every caller's
    engine = sampler.GetStats(sampler_pb2.GetStatsRequest(), metadata=auth("admin"), timeout=30)
    assert (engine.prompt_tokens_cached, engine.prompt_tokens_computed) == (64, 146)
    tenant = sampler.GetStats(sampler_pb2.GetStatsRequest(), metadata=auth("team-b"), timeout=30)
    assert tenant.prompt_tokens_cached == 0 and tenant.kv_blocks_total == 0  # engine-wide stays hidden

    admin_view, tenant_view = run_status(server.address, "admin"), run_status(server.address, "team-a")
    line = next(x for x in admin_view.splitlines() if x.startswith("KV cache:"))
    assert "of 64 (16 tokens each)" in line and "hit rate 30% of 210 prompt tokens" in line, line
    assert "0 preemptions" in line
    line = next(x for x in tenant_view.splitlines() if x.startswith("KV cache:"))
    assert line.strip() == "KV cache: hit rate 46% of 140 prompt tokens", line


def test_a_score_registers_blocks_the_next_turn_finds(sampler: sampler_pb2_grpc.SamplerServiceStub) -> None:
    turn = prompt(8812, length=50)  # a prompt and its completion: three full blocks and 2 tokens
    scored = sampler.ComputeLogprobs(
        sampler_pb2.ComputeLogprobsRequest(model="base", inputs=[model_input(turn)]),
        metadata=auth("team-a"),
        timeout=60,
    )
    assert len(scored.results[0].logprobs) == len(turn) - 1
    before_a, before_b = own(sampler, "team-a"), own(sampler, "team-b")
    assert before_a[:2] == (64, 76)  # a score is no prompt: not counted
    sample(sampler, "team-b", [*turn, 5, 6])  # another tenant's next turn: not its blocks
    assert wait_until(lambda: own(sampler, "team-b")[1] == before_b[1] + 52), own(sampler, "team-b")
    assert own(sampler, "team-b")[0] == before_b[0]
    sample(sampler, "team-a", [*turn, 5, 6])  # the scoring tenant's next turn: 3 blocks from the score
    assert wait_until(lambda: own(sampler, "team-a")[0] == before_a[0] + 48), own(sampler, "team-a")
    assert own(sampler, "team-a")[1] == before_a[1] + 4
