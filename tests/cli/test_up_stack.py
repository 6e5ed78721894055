"""`opentinker up` with only a tokens file, and `opentinker status --workdir` on it (issue Lifecycle, items 4 and
6): `up` provisions the servers' service token itself (0600 files, never on a command line), team-a's calls work
end to end while team-b sees none of it, a second `up` on the workdir exits 2 and the first keeps serving, and
`status` finds the stack from the workdir, prints every field with --json and full tables when piped."""

from __future__ import annotations

import json
import os
import queue
import signal
import stat
import subprocess
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import psutil
import pytest
from serverproc import opentinker_command

from opentinker.client import LoraConfig, OpenTinkerError, RegistryClient, SamplingParams, ServiceClient

TOKENS = {"team-a": "tok-team-a-3f1c", "team-b": "tok-team-b-9e2d"}
# A name wider than any 80-column table: a piped status must print it whole.
LONG = "team-a/" + "a-rather-long-adapter-name-" * 2 + "end"


@dataclass
class UpStack:
    process: subprocess.Popen[str]
    lines: queue.Queue[str]
    workdir: Path
    servers: dict[str, Any]


def lines_of(stream: IO[str]) -> queue.Queue[str]:
    lines: queue.Queue[str] = queue.Queue()

    def pump() -> None:
        for line in stream:
            lines.put(line)

    threading.Thread(target=pump, daemon=True).start()
    return lines


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}  # piped, no width given: rich's 80 columns
    return subprocess.run(opentinker_command(*args), capture_output=True, text=True, timeout=120, env=env)


@pytest.fixture(scope="module")
def stack(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[UpStack]:
    root = tmp_path_factory.mktemp("up-tokens")
    tokens_file = root / "tokens.json"
    tokens_file.write_text(json.dumps({"tokens": [{"token": t, "tenant": who} for who, t in TOKENS.items()]}))
    config = root / "stack.toml"
    # Tokens for every server and nothing else: no registry_token anywhere.
    config.write_text(
        f'port = 0\nmodel = "{tiny_model}"\ndevice = "cpu"\ntokens_file = "{tokens_file}"\n'
        "[sampler]\nmax_slots = 4\nmax_seqs = 4\n"
    )
    workdir = root / "run"
    process = subprocess.Popen(
        opentinker_command("up", "--config", str(config), "--workdir", str(workdir), "--json"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert process.stdout is not None
    lines = lines_of(process.stdout)
    try:
        first = json.loads(lines.get(timeout=280))
    except queue.Empty:
        process.kill()
        pytest.fail(f"opentinker up printed nothing: {process.communicate()}")
    assert first["event"] == "serving", first
    yield UpStack(process, lines, workdir, first["servers"])
    if process.poll() is None:  # a test failed before stopping it
        process.kill()
        process.wait()
        for info in first["servers"].values():
            if psutil.pid_exists(info["pid"]):
                psutil.Process(info["pid"]).kill()


def test_up_with_only_a_tokens_file_works_end_to_end(stack: UpStack) -> None:
    s = stack.servers
    with ServiceClient(
        trainer=s["trainer"]["address"],
        sampler=s["sampler"]["address"],
        registry=s["registry"]["address"],
        token=TOKENS["team-a"],
        timeout=120,
    ) as client:
        training = client.create_training_client("team-a/chat", LoraConfig(rank=4))
        version = training.save_snapshot()  # the trainer published through the registry with the service token
        assert (version.adapter, version.number) == ("team-a/chat", 1)
        sampled = client.create_sampling_client("team-a/chat@1").sample([5, 6, 7], SamplingParams(max_tokens=3, seed=1))
        assert len(sampled.sequences[0].tokens) == 3
        training_b = ServiceClient(trainer=s["trainer"]["address"], token=TOKENS["team-b"], timeout=60)
    # team-b: its own adapter works, team-a's is invisible to it.
    with training_b, RegistryClient(s["registry"]["address"], TOKENS["team-b"], timeout=60) as registry_b:
        training_b.create_training_client("team-b/own", LoraConfig(rank=4)).save_snapshot()
        assert [a.name for a in registry_b.list_adapters()] == ["team-b/own"]
        with pytest.raises(OpenTinkerError) as refused:
            registry_b.get_adapter("team-a/chat")
        assert refused.value.code.name == "PERMISSION_DENIED"


def test_the_service_token_is_private_and_never_on_a_command_line(stack: UpStack) -> None:
    token_file, tokens_copy = stack.workdir / "service-token", stack.workdir / "tokens.json"
    for path in (token_file, tokens_copy):
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
    token = token_file.read_text().strip()
    assert token not in tokens_copy.read_text()  # the copy holds its digest only
    for info in stack.servers.values():
        assert token not in " ".join(psutil.Process(info["pid"]).cmdline())


def test_status_json_of_the_up_stack_has_every_field(stack: UpStack) -> None:
    with RegistryClient(stack.servers["registry"]["address"], TOKENS["team-a"], timeout=60) as registry:
        registry.create_adapter("team-a/empty")  # no versions: every count is 0, and still printed
    result = cli("status", "--workdir", str(stack.workdir), "--json")
    assert result.returncode == 0, result.stderr
    document = json.loads(result.stdout)
    servers = document["servers"]
    assert {name: servers[name]["health"] for name in servers} == dict.fromkeys(
        ("registry", "trainer", "sampler"), "SERVING"
    )
    adapters = {a["name"]: a for a in servers["registry"]["adapters"]}
    assert int(adapters["team-a/empty"]["version_count"]) == 0 and int(adapters["team-a/chat"]["version_count"]) >= 1
    assert adapters["team-a/empty"]["aliases"] == {} and adapters["team-a/empty"]["labels"] == {}
    trained = {a["name"]: a for a in servers["trainer"]["adapters"]}
    for key in ("step", "tokens_trained", "pending_batches", "last_snapshot_version", "resident"):
        assert key in trained["team-a/chat"], (key, trained["team-a/chat"])
    assert servers["trainer"]["info"]["base_model"]["architecture"] == "qwen2"
    stats = servers["sampler"]["stats"]
    for key in (
        "slots_used",
        "slots_total",
        "running_requests",
        "waiting_requests",
        "recent_reloads",
        "reload_failures_total",
    ):
        assert key in stats, (key, stats)
    assert stats["slots_total"] == 4


def test_registry_json_of_an_adapter_without_versions_has_version_count_0(stack: UpStack) -> None:
    address = stack.servers["registry"]["address"]
    created = cli("registry", "create", "team-a/fresh", "--registry", address, "--token", TOKENS["team-a"], "--json")
    assert created.returncode == 0, created.stderr
    listed = cli("registry", "adapters", "--registry", address, "--token", TOKENS["team-a"], "--json")
    assert listed.returncode == 0, listed.stderr
    fresh = next(a for a in json.loads(listed.stdout) if a["name"] == "team-a/fresh")
    assert int(fresh["version_count"]) == 0 and int(fresh["latest_version"]) == 0


def test_piped_status_tables_are_whole_and_reloads_have_their_own_table(stack: UpStack) -> None:
    s = stack.servers
    with ServiceClient(trainer=s["trainer"]["address"], token=TOKENS["team-a"], timeout=120) as client:
        client.create_training_client(LONG, LoraConfig(rank=4)).save_snapshot()  # the sampler follows it: reload
    with ServiceClient(sampler=s["sampler"]["address"], token=TOKENS["team-a"], timeout=120) as client:
        client.create_sampling_client(LONG).sample([5, 6], SamplingParams(max_tokens=1, seed=1))
    result = cli("status", "--workdir", str(stack.workdir))
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert LONG in out and f"{LONG}@1" in out  # whole, though far wider than 80 columns
    slots, _, reloads = out.partition("reloads")
    slot_rows = slots.split("sampler: slots", 1)[1]
    assert " ms " not in slot_rows and "reload" not in slot_rows  # no latency in the slots' columns
    assert f"{LONG}@1" in reloads and " ms " in reloads


def test_a_second_up_on_the_same_workdir_exits_2_and_the_first_keeps_serving(stack: UpStack, tmp_path: Path) -> None:
    config = tmp_path / "other.toml"
    config.write_text("port = 0\n")
    result = cli("up", "--config", str(config), "--workdir", str(stack.workdir))
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"opentinker up: workdir {stack.workdir} is in use by another `opentinker up` (pid {stack.process.pid}); "
        "stop it or pass another --workdir"
    ]
    assert stack.process.poll() is None
    again = cli("status", "--workdir", str(stack.workdir), "--json")
    assert again.returncode == 0, again.stderr
    assert all(v["health"] == "SERVING" for v in json.loads(again.stdout)["servers"].values())


def test_stopping_up_removes_its_stack_file(stack: UpStack) -> None:
    stack.process.send_signal(signal.SIGTERM)
    assert stack.process.wait(timeout=120) == 0, stack.process.communicate()
    last = json.loads(stack.lines.get(timeout=10))
    assert last == {"event": "stopped", "exit_codes": {"registry": 0, "trainer": 0, "sampler": 0}}, last
    assert not (stack.workdir / "stack.json").exists()
    result = cli("status", "--workdir", str(stack.workdir))
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"opentinker status: no stack.json in {stack.workdir}: no `opentinker up` runs there; pass --workdir, or "
        "--registry/--trainer/--sampler"
    ]
