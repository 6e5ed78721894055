"""The engine in its own process (the CPU default): it serves exactly what an engine in the server process serves
(greedy and seeded tokens, logprobs, n samples on adapters), it dies with its server, and when it dies the open
streams end with INTERNAL and the server exits non-zero instead of hanging; and the engine process that keeps its
own copy of the adapter slots (as on CUDA) serves what one reading the shared pool serves."""

from __future__ import annotations

import concurrent.futures
import json
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import psutil
import pytest
from samplerutil import (
    Sampler,
    collect,
    greedy,
    max_diff,
    params,
    prompt,
    request,
    score,
    stats,
    trained_adapter,
    wait_until,
)
from serverproc import ServerProcess, start_sampler
from trainerutil import Trainer

from opentinker.v1 import sampler_pb2, sampler_pb2_grpc


def engine_processes(server: ServerProcess) -> list[psutil.Process]:
    children: list[psutil.Process] = psutil.Process(server.process.pid).children(recursive=True)
    return children


@pytest.fixture(scope="module")
def adapter(trainer: Trainer) -> str:
    """A trained adapter published as version 1."""
    name, _ = trained_adapter(trainer, seed=71)
    return f"{name}@1"


@pytest.fixture(scope="module")
def in_process_server(
    tiny_model: Path, registry_server: ServerProcess, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    server = start_sampler(
        tmp_path_factory.mktemp("in-process"), tiny_model, registry_server, "--max-slots", "2", "--no-engine-process"
    )
    yield server
    assert server.terminate() == 0, server.log()


def test_the_engine_process_serves_what_an_in_process_engine_serves(
    sampler_server: ServerProcess, sampler: Sampler, in_process_server: ServerProcess, adapter: str
) -> None:
    (engine,) = engine_processes(sampler_server)  # the session's sampler: default flags
    assert engine_processes(in_process_server) == []
    with grpc.insecure_channel(in_process_server.address) as channel:
        local = sampler_pb2_grpc.SamplerServiceStub(channel)
        for model in ("base", adapter):
            assert greedy(local, model, prompt(3)) == greedy(sampler, model, prompt(3))
            tokens = prompt(4, length=20)
            assert max_diff(score(local, model, tokens)[0], score(sampler, model, tokens)[0]) < 1e-5
        # Seeded sampling: the engine process makes each sample's generator from the seed the server drew.
        seeded = request(
            adapter,
            prompt(5),
            params(max_tokens=10, temperature=1.0, seed=11, logprobs=True),
            num_samples=3,
            prompt_logprobs=True,
        )
        ours, theirs = collect(sampler.Sample(seeded)), collect(local.Sample(seeded))
        assert sorted(ours.samples) == sorted(theirs.samples) == [0, 1, 2]
        assert [ours.samples[i].tokens for i in range(3)] == [theirs.samples[i].tokens for i in range(3)]
        assert len({tuple(s.tokens) for s in ours.samples.values()}) > 1  # each sample its own generator
        for a, b in ((ours.samples[i], theirs.samples[i]) for i in range(3)):
            assert max_diff(a.logprobs, b.logprobs) < 1e-5 and max_diff(a.prompt_logprobs, b.prompt_logprobs) < 1e-5
    assert engine.is_running()
    before = stats(sampler).tokens_generated
    greedy(sampler, "base", prompt(6), max_tokens=7)
    assert wait_until(lambda: stats(sampler).tokens_generated >= before + 7)  # counters come from the engine


def test_the_engine_process_dies_with_its_server(
    tiny_model: Path, registry_server: ServerProcess, tmp_path: Path
) -> None:
    server = start_sampler(tmp_path, tiny_model, registry_server, "--max-slots", "1")
    (engine,) = engine_processes(server)
    server.process.kill()  # SIGKILL: no chance to stop it
    server.process.wait(10)
    engine.wait(10)  # PR_SET_PDEATHSIG: raises psutil.TimeoutExpired if it outlived its server


def test_a_dead_engine_process_fails_open_streams_and_stops_the_server(
    tiny_model: Path, registry_server: ServerProcess, tmp_path: Path
) -> None:
    server = start_sampler(tmp_path, tiny_model, registry_server, "--max-slots", "1", "--max-len", "2048")
    (engine,) = engine_processes(server)
    with grpc.insecure_channel(server.address) as channel:
        stub = sampler_pb2_grpc.SamplerServiceStub(channel)
        stream = stub.Sample(request("base", prompt(1), params(max_tokens=2000)), timeout=60)
        first = next(stream)
        engine.send_signal(signal.SIGKILL)
        killed = time.monotonic()
        with pytest.raises(grpc.RpcError) as error:
            collect(stream, first)  # tokens already on their way may arrive before the failure
        assert error.value.code() == grpc.StatusCode.INTERNAL, error.value
        assert time.monotonic() - killed < 5
    assert server.process.wait(30) == 1  # shut down on its own, non-zero so that a supervisor restarts it
    assert "the sampler engine process exited" in server.log()
    info = sampler_pb2.GetSamplerInfoRequest()
    with grpc.insecure_channel(server.address) as channel, pytest.raises(grpc.RpcError):
        sampler_pb2_grpc.SamplerServiceStub(channel).GetSamplerInfo(info, timeout=2)


def test_an_engine_process_with_its_own_slot_copy_serves_what_the_shared_pool_serves(tiny_model: Path) -> None:
    """The CUDA engine process's path (`SlotMirror`: the slots copied to its device when a new version was written),
    on the CPU: a version loaded after it started and another written into the same slot later sample and score
    exactly as an engine reading the shared pool; a copy that missed the second write would sample the first."""
    script = Path(__file__).with_name("slot_mirror_check.py")
    proc = subprocess.run([sys.executable, str(script), str(tiny_model)], capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    x, y = results["x"], results["y"]
    assert x["slot"] == y["slot"] == 1  # y reused x's slot
    for case in (x, y):
        assert case["same_tokens"] and case["logprob_diff"] == 0.0 and case["score_diff"] == 0.0, case
    assert x["tokens"] != y["tokens"]  # two different versions: the check can tell a stale copy
    assert results["base_same"] and results["refs"] == 0


def test_a_stop_string_met_in_the_server_ends_the_sample_in_the_engine_process(
    sampler_server: ServerProcess, sampler: Sampler, tiny_model: Path
) -> None:
    """The server meets the stop string (it detokenizes); the engine process, which goes on generating until it
    hears, must end the sample there (EngineProcess.finish): the tokens it made since never reach the stream, and
    it does not run on to max_tokens. Four such requests at once, each with two samples."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    p = prompt(8)
    tokens = greedy(sampler, "base", p, 12)

    def text(n: int) -> str:
        return str(tokenizer.decode(tokens[:n], skip_special_tokens=True))

    k = next(
        k
        for k in range(2, 11)
        if (added := text(k + 1)[len(text(k)) :]).strip() and added not in text(k) and "\ufffd" not in text(k + 1)
    )
    stop = text(k + 1)[len(text(k)) :]
    before = stats(sampler).tokens_generated
    long = request("base", p, params(max_tokens=1500, stop_strings=[stop]), num_samples=2)
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda _: collect(sampler.Sample(long, timeout=120)), range(4)))
    for result in results:
        for sample in result.samples.values():
            assert sample.stop_reason == sampler_pb2.STOP_REASON_STOP_STRING and sample.tokens == tokens[: k + 1]
    assert wait_until(lambda: stats(sampler).running_requests == 0 and stats(sampler).waiting_requests == 0)
    generated = stats(sampler).tokens_generated - before
    assert generated < 8 * 1500 // 4, generated  # a few tokens past each stop, not 8 runs to max_tokens
