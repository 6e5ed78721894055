"""deploy/haproxy in front of one registry and three sampler processes on loopback, with Debian's haproxy (make
haproxy installs it) and `opentinker fleet haproxy --watch` writing its server list: the SDK's
x-opentinker-adapter header keeps each adapter on one replica, a hot adapter spills within the balance factor,
and a draining replica leaves the list before it stops."""

from __future__ import annotations

import concurrent.futures
import os
import shutil
import signal
import subprocess
import threading
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
import typer
from fleetutil import BASE, replica
from registryutil import create_adapter, publish_lora, unique_name
from samplerutil import prompt, wait_until
from serverproc import ROOT, ServerProcess, opentinker_command, start_registry, start_sampler
from storeservers import free_port

from opentinker.cli.fleet_haproxy import backend_section, fleet_base, server_id, write_if_changed
from opentinker.client import SamplingParams, ServiceClient
from opentinker.client.sampling_client import adapter_header
from opentinker.v1 import registry_pb2_grpc, sampler_pb2, sampler_pb2_grpc

pytestmark = pytest.mark.skipif(shutil.which("haproxy") is None, reason="haproxy missing: run `make haproxy`")

SAMPLERS = 3
ADAPTERS = 12
GREEDY = SamplingParams(max_tokens=4, temperature=0.0)


@dataclass
class Balanced:
    registry: ServerProcess
    samplers: list[ServerProcess]
    adapters: list[str]
    address: str  # HAProxy's
    servers_file: Path


def servers_in_text(section: str) -> list[str]:
    return sorted(line.split()[2] for line in section.splitlines() if line.startswith("    server "))


def servers_in(path: Path) -> list[str]:
    """The addresses `opentinker fleet haproxy` listed in ``path``."""
    return servers_in_text(path.read_text() if path.exists() else "")


def through(address: str) -> bool:
    with grpc.insecure_channel(address) as channel:
        try:
            sampler_pb2_grpc.SamplerServiceStub(channel).GetStats(sampler_pb2.GetStatsRequest(), timeout=2)
        except grpc.RpcError:
            return False
    return True


@pytest.fixture(scope="module")
def balanced(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Balanced]:
    work = tmp_path_factory.mktemp("haproxy")
    with ExitStack() as stack:
        registry = start_registry(work / "registry")
        stack.callback(registry.terminate)
        flags = ("--heartbeat-s", "0.2", "--max-slots", "16", "--max-seqs", "32")
        samplers = []
        for i in range(SAMPLERS):
            samplers.append(start_sampler(work / f"sampler-{i}", tiny_model, registry, *flags))
            stack.callback(samplers[-1].kill)
        with grpc.insecure_channel(registry.address) as channel:
            stub = registry_pb2_grpc.RegistryServiceStub(channel)
            adapters = [unique_name(f"hap{i}") for i in range(ADAPTERS)]
            for i, name in enumerate(adapters):
                create_adapter(stub, name)
                publish_lora(stub, tiny_model, name, seed=700 + i)
        servers_file, pid_file = work / "samplers.cfg", work / "haproxy.pid"
        watch = ["--out", str(servers_file), "--watch", "--pid-file", str(pid_file)]
        address = f"127.0.0.1:{free_port()}"
        env = {**os.environ, "OPENTINKER_HAPROXY_BIND": address, "OPENTINKER_HAPROXY_STATS": str(work / "stats.sock")}
        config = ["-f", str(ROOT / "deploy/haproxy/haproxy.cfg"), "-f", str(servers_file)]
        log = stack.enter_context((work / "processes.log").open("ab"))
        watcher = stack.enter_context(
            subprocess.Popen(
                opentinker_command("fleet", "haproxy", "--registry", registry.address, *watch), stdout=log, stderr=log
            )
        )
        stack.callback(watcher.terminate)
        assert wait_until(lambda: len(servers_in(servers_file)) == SAMPLERS, timeout=30), (
            work / "processes.log"
        ).read_text()
        check = subprocess.run(["haproxy", "-c", *config], capture_output=True, text=True, env=env)
        assert check.returncode == 0, check.stdout + check.stderr
        haproxy = stack.enter_context(
            subprocess.Popen(["haproxy", "-W", "-db", *config, "-p", str(pid_file)], stdout=log, stderr=log, env=env)
        )
        stack.callback(haproxy.terminate)
        assert wait_until(lambda: through(address), timeout=20), (work / "processes.log").read_text()
        yield Balanced(registry, samplers, adapters, address, servers_file)


def served_by(client: ServiceClient, model: str, seed: int, params: SamplingParams = GREEDY) -> str:
    (replica,) = client.create_sampling_client(model).sample(prompt(seed), params).sequences[0].replicas
    return replica


def test_the_adapter_header_keeps_each_adapter_on_one_replica(balanced: Balanced) -> None:
    with ServiceClient(sampler=balanced.address) as client:
        homes: dict[str, set[str]] = {}
        for round_ in range(3):
            for i, name in enumerate(balanced.adapters):
                homes.setdefault(name, set()).add(served_by(client, f"{name}@1", i + round_))
    assert all(len(replicas) == 1 for replicas in homes.values()), homes
    assert len(set().union(*homes.values())) > 1  # the adapters are spread over the fleet
    # Without the header (a raw stub) HAProxy balances round robin: the same adapter reaches several replicas.
    with grpc.insecure_channel(balanced.address) as channel:
        stub = sampler_pb2_grpc.SamplerServiceStub(channel)
        request = sampler_pb2.SampleRequest(model=f"{balanced.adapters[0]}@1", prompt_text="hi")
        request.sampling_params.max_tokens = 1
        bare = {list(stub.Sample(request, timeout=30))[-1].replica for _ in range(SAMPLERS * 2)}
    assert len(bare) > 1, bare


def test_a_hot_adapter_spills_within_the_balance_factor(balanced: Balanced) -> None:
    """24 streams of one adapter at once: HAProxy's bounded load (1.25 x the average in flight) sends some of
    them past the adapter's home replica; none fails."""
    hot = balanced.adapters[3]
    long = SamplingParams(max_tokens=48, temperature=0.0)
    start = threading.Barrier(24)

    def one(seed: int) -> str:
        with ServiceClient(sampler=balanced.address) as client:
            start.wait(30)
            return served_by(client, f"{hot}@1", seed, long)

    with concurrent.futures.ThreadPoolExecutor(24) as pool:
        counts = Counter(pool.map(one, range(24)))
    assert len(counts) > 1, counts  # spilled
    assert max(counts.values()) <= -(-24 * 125 // (100 * SAMPLERS)) + 1, counts  # ceil(1.25 x 8) + 1


def test_a_draining_replica_leaves_the_list_and_gets_no_new_request(balanced: Balanced) -> None:
    with ServiceClient(sampler=balanced.address) as client:
        before = {name: served_by(client, f"{name}@1", i) for i, name in enumerate(balanced.adapters)}
    victim = next(s for s in balanced.samplers if s.address in before.values())
    began = time.monotonic()
    victim.process.send_signal(signal.SIGTERM)
    assert wait_until(lambda: victim.address not in servers_in(balanced.servers_file), timeout=10)
    left_after = time.monotonic() - began
    assert victim.process.wait(30) == 0
    time.sleep(0.5)  # the reloaded worker has taken the listener
    with ServiceClient(sampler=balanced.address) as client:
        after = {name: served_by(client, f"{name}@1", i) for i, name in enumerate(balanced.adapters)}
    assert victim.address not in after.values()
    # Only the victim's adapters moved: the others keep their replica (consistent hashing, stable server ids).
    assert all(after[n] == before[n] for n in balanced.adapters if before[n] != victim.address), (before, after)
    print(f"draining replica off HAProxy's list {left_after:.2f} s after SIGTERM")


def test_the_server_list_holds_serving_replicas_of_one_base_with_ids_that_do_not_move(tmp_path: Path) -> None:
    fleet = [replica("10.0.0.1:7101"), replica("10.0.0.2:7101"), replica("10.0.0.3:7101", state="draining")]
    fleet.append(replica("10.0.0.4:7101", base="other-base"))
    section = backend_section(fleet, BASE)
    assert servers_in_text(section) == ["10.0.0.1:7101", "10.0.0.2:7101"]
    # A replica's id (its place on HAProxy's ring) depends on its address only, not on who else is listed.
    alone = backend_section(fleet[1:2], BASE)
    line = next(line for line in section.splitlines() if "10.0.0.2:7101" in line)
    assert line in alone.splitlines()
    with pytest.raises(typer.BadParameter, match="2 bases"):
        fleet_base(fleet, "")
    assert fleet_base(fleet[:3], "") == BASE
    assert fleet_base(fleet, "other-base") == "other-base"
    assert server_id("a", set()) != server_id("b", set())
    taken: set[int] = set()
    assert server_id("a", taken) != server_id("a", taken)  # a collision takes the next free id
    out = tmp_path / "samplers.cfg"
    assert write_if_changed(out, section) and not write_if_changed(out, section)


def test_sampler_calls_carry_the_adapter_header_without_the_version() -> None:
    assert adapter_header("team/agent@7") == (("x-opentinker-adapter", "team/agent"),)
    assert adapter_header("team/agent@latest") == adapter_header("team/agent")
    assert adapter_header("base") == adapter_header("") == ()
    assert adapter_header("agent\u00e9@1") == ()  # not a header value: the sampler's own error reaches the caller
