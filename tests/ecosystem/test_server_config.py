"""Server flags from the command line, `OPENTINKER_<SERVER>_<FLAG>` and a TOML `--config` file, in that order
of precedence, checked on the real `serve` commands with `--print-config` (which starts nothing)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from opentinker.cli.main import app
from opentinker.rpc.process.cli_options import server_options
from opentinker.rpc.process.config import SHARED_KEYS, ServeCommand

# Every OPENTINKER_* variable of the test process is dropped, so the machine's environment cannot leak in.
SERVERS = ("registry", "trainer", "sampler", "gateway")
REQUIRED = {
    "registry": [],
    "trainer": ["--model", "m", "--store", "s"],
    "sampler": ["--model", "m", "--store", "s"],
    "gateway": ["--trainer", "t:1", "--sampler", "s:1", "--registry", "r:1"],
}
CONFIG = """\
log_level = "DEBUG"        # shared: every server
max-message-mb = 16        # shared, dash spelling
host = "127.0.0.1"
registry_token = "shared-token"

[registry]
port = 7100
events_maxlen = 500

[trainer]
port = 7101
max_resident_adapters = 3
registry = "10.0.0.1:7070"

[sampler]
port = 7102
max-slots = 7
follow = ["team-a/*", "b"]
insecure_public = true
registry = "10.0.0.1:7070"

[gateway]
port = 7103
max_tenant_result_bytes = 5000
seq-window = 8
trainer = "10.0.0.2:7071"
"""


def resolved(server: str, *args: str, env: dict[str, str] | None = None) -> dict[str, Any]:
    """The `--print-config` JSON of `opentinker SERVER serve ARGS`."""
    result = invoke(server, "--print-config", *args, env=env)
    assert result.exit_code == 0, result.output
    value: dict[str, Any] = json.loads(result.stdout)
    return value


def invoke(server: str, *args: str, env: dict[str, str] | None = None) -> Any:
    runner = CliRunner()
    with pytest.MonkeyPatch.context() as patch:
        for key in [k for k in os.environ if k.startswith("OPENTINKER_")]:
            patch.delenv(key)
        return runner.invoke(app, [server, "serve", *REQUIRED[server], *args], env={"COLUMNS": "200", **(env or {})})


@pytest.fixture(scope="module")
def config_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("config") / "stack.toml"
    path.write_text(CONFIG)
    return path


def test_defaults_without_config(tmp_path: Path) -> None:
    got = resolved("sampler", "--registry", "r:1")
    assert got["values"]["max_slots"] == 32 and got["sources"]["max_slots"] == "default"
    assert got["values"]["max_message_mb"] == 64
    assert got["sources"]["registry"] == "command line"


def test_config_file_sections_and_shared_keys(config_file: Path) -> None:
    registry = resolved("registry", "--config", str(config_file))
    trainer = resolved("trainer", "--config", str(config_file))
    sampler = resolved("sampler", "--config", str(config_file))
    for got in (registry, trainer, sampler):
        assert got["values"]["log_level"] == "DEBUG" and got["sources"]["log_level"] == "config"
        assert got["values"]["max_message_mb"] == 16
    assert [g["values"]["port"] for g in (registry, trainer, sampler)] == [7100, 7101, 7102]
    assert registry["values"]["events_maxlen"] == 500
    assert "registry_token" not in registry["values"]  # shared keys go only to servers that have the flag
    assert trainer["values"]["max_resident_adapters"] == 3 and trainer["values"]["registry_token"] == "shared-token"
    assert sampler["values"]["max_slots"] == 7 and sampler["values"]["insecure_public"] is True
    assert sampler["values"]["follow"] == ["team-a/*", "b"]


@pytest.mark.parametrize("server", SERVERS)
def test_command_line_beats_env_beats_file_beats_default(server: str, config_file: Path) -> None:
    flag, env = "--port", f"OPENTINKER_{server.upper()}_PORT"
    extra = [] if server == "registry" else ["--registry", "r:1"]
    from_file = resolved(server, "--config", str(config_file), *extra)
    assert from_file["sources"]["port"] == "config"
    from_env = resolved(server, "--config", str(config_file), *extra, env={env: "7200"})
    assert (from_env["values"]["port"], from_env["sources"]["port"]) == (7200, "env")
    from_cli = resolved(server, "--config", str(config_file), flag, "7300", *extra, env={env: "7200"})
    assert (from_cli["values"]["port"], from_cli["sources"]["port"]) == (7300, "command line")
    # Env without a file, and the config file itself named by env.
    assert resolved(server, *extra, env={env: "7201"})["values"]["port"] == 7201
    by_env = resolved(server, *extra, env={f"OPENTINKER_{server.upper()}_CONFIG": str(config_file)})
    assert by_env["sources"]["port"] == "config"


def test_env_scheme_is_per_server_and_precise_name_wins(config_file: Path) -> None:
    env = {
        "OPENTINKER_SAMPLER_MAX_SLOTS": "5",
        "OPENTINKER_TRAINER_MAX_SLOTS": "9",
        "OPENTINKER_SAMPLER_INSECURE_PUBLIC": "false",
        "OPENTINKER_SAMPLER_FOLLOW": "x y",
        "OPENTINKER_REGISTRY": "legacy:1",
        "OPENTINKER_SAMPLER_REGISTRY": "precise:2",
    }
    got = resolved("sampler", "--config", str(config_file), env=env)
    assert got["values"]["max_slots"] == 5
    assert got["values"]["insecure_public"] is False  # env beats the file's true
    assert got["values"]["follow"] == ["x", "y"]
    assert got["values"]["registry"] == "precise:2"
    legacy = resolved("trainer", "--model", "m", env={"OPENTINKER_REGISTRY": "legacy:1"})
    assert legacy["values"]["registry"] == "legacy:1"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[sampler]\nmax_slot = 3\n", "unknown key(s) ['max_slot'] in [sampler]"),
        ("[samplr]\nport = 1\n", "unknown section [samplr]"),
        ("max_slots = 3\n", "'max_slots' is not a shared key"),
        ("port = \n", "is not valid TOML"),
        ("[up]\nworkdirs = 'x'\n", "unknown key(s) ['workdirs'] in [up]"),
    ],
)
def test_bad_config_files_are_refused_with_the_key(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(text)
    result = invoke("sampler", "--registry", "r:1", "--config", str(path), "--print-config")
    assert result.exit_code == 2, result.output
    assert message in " ".join(result.output.replace("│", " ").split()), result.output
    assert "Traceback" not in result.output


def test_bad_value_types_name_the_flag(tmp_path: Path) -> None:
    path = tmp_path / "types.toml"
    path.write_text('[registry]\nport = "seventy"\n')
    result = invoke("registry", "--config", str(path), "--print-config")
    assert result.exit_code == 2 and "port" in result.output, result.output


def test_shared_keys_are_flags_of_some_server() -> None:
    import typer.main

    root: Any = typer.main.get_command(app)
    flags: set[str] = set()
    for server in SERVERS:
        serve = root.commands[server].commands["serve"]
        assert isinstance(serve, ServeCommand) and serve.section == server
        flags |= serve.configurable()
    assert flags >= SHARED_KEYS, SHARED_KEYS - flags


def test_max_message_mb_reaches_the_server_options() -> None:
    options = server_options("127.0.0.1", 0, 0, None, False, None, None, None, 8)
    assert options.max_message_bytes == 8 << 20
    assert server_options("127.0.0.1", 0, 0, None, False, None, None, None).max_message_bytes == 64 << 20
    assert resolved("registry", "--max-message-mb", "128")["values"]["max_message_mb"] == 128
    assert invoke("registry", "--max-message-mb", "0", "--print-config").exit_code == 2


def test_burst_wait_is_a_bounded_sampler_flag() -> None:
    assert resolved("sampler", "--registry", "r:1", "--burst-wait-ms", "5")["values"]["burst_wait_ms"] == 5.0
    assert invoke("sampler", "--registry", "r:1", "--burst-wait-ms", "-1", "--print-config").exit_code == 2


def test_engine_process_is_on_off_or_the_device_default() -> None:
    assert resolved("sampler", "--registry", "r:1")["values"]["engine_process"] is None  # CPU: on, CUDA: off
    assert resolved("sampler", "--registry", "r:1", "--no-engine-process")["values"]["engine_process"] is False
    assert resolved("sampler", "--registry", "r:1", "--engine-process")["values"]["engine_process"] is True


# --- the gateway: every flag in --print-config, settable from [gateway] and OPENTINKER_GATEWAY_* ---------------


def test_gateway_prints_every_flag_with_the_defaults_of_its_config() -> None:
    import typer.main

    from opentinker.gateway.config import GatewayConfig

    got = resolved("gateway")
    root: Any = typer.main.get_command(app)
    serve = root.commands["gateway"].commands["serve"]
    assert isinstance(serve, ServeCommand) and serve.section == "gateway"
    assert set(got["values"]) == serve.configurable()
    defaults = GatewayConfig()
    for name in GatewayConfig.__dataclass_fields__:  # every bound is a flag, with the same default
        assert got["values"][name] == getattr(defaults, name), name
        assert got["sources"][name] == "default"
    assert got["values"]["max_tenant_result_bytes"] == 1 << 30
    assert got["sources"]["trainer"] == "command line"


def test_gateway_flags_come_from_its_section_shared_keys_and_env(config_file: Path) -> None:
    got = resolved("gateway", "--config", str(config_file))
    assert (got["values"]["port"], got["sources"]["port"]) == (7103, "config")
    assert got["values"]["max_tenant_result_bytes"] == 5000 and got["values"]["seq_window"] == 8
    assert got["values"]["log_level"] == "DEBUG" and got["sources"]["log_level"] == "config"  # shared
    assert got["values"]["trainer"] == "t:1"  # the command line beats the file
    env = {"OPENTINKER_GATEWAY_MAX_TENANT_RESULT_BYTES": "0", "OPENTINKER_GATEWAY_CONFIG": str(config_file)}
    by_env = resolved("gateway", env=env)
    assert (by_env["values"]["max_tenant_result_bytes"], by_env["sources"]["max_tenant_result_bytes"]) == (0, "env")
    assert by_env["values"]["seq_window"] == 8
    legacy = invoke("gateway", "--print-config", env={"OPENTINKER_SAMPLER": "legacy:2"})
    assert json.loads(legacy.stdout)["values"]["sampler"] == "s:1"
    runner = CliRunner()
    with pytest.MonkeyPatch.context() as patch:
        for key in [k for k in os.environ if k.startswith("OPENTINKER_")]:
            patch.delenv(key)
        older = runner.invoke(
            app,
            ["gateway", "serve", "--trainer", "t:1", "--registry", "r:1", "--print-config"],
            env={"OPENTINKER_SAMPLER": "legacy:2"},
        )
    assert older.exit_code == 0, older.output
    assert json.loads(older.stdout)["values"]["sampler"] == "legacy:2"  # the older variable still works


def test_gateway_config_typos_and_bad_bounds_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "typo.toml"
    path.write_text("[gateway]\nmax_tenant_results_bytes = 3\n")
    result = invoke("gateway", "--config", str(path), "--print-config")
    assert result.exit_code == 2 and "max_tenant_results_bytes" in result.output, result.output
    negative = invoke("gateway", "--max-tenant-result-bytes", "-1", "--print-config")
    assert negative.exit_code == 2 and "--max-tenant-result-bytes" in negative.output, negative.output


@pytest.mark.parametrize("server", ["registry", "trainer", "sampler"])
def test_a_bucket_store_shows_its_credentials_masked(server: str, tmp_path: Path) -> None:
    path = tmp_path / "stack.toml"
    cache = 'cache_dir = "/var/cache/ot"\n'
    path.write_text(f"[trainer]\n{cache}[sampler]\n{cache}")
    env = {"AWS_ACCESS_KEY_ID": "AKIDEXAMPLE", "AWS_SECRET_ACCESS_KEY": "s3cr3t-value", "AWS_REGION": "eu-west-1"}
    args = ["--config", str(path), "--store", "s3://models/team"]
    got = resolved(server, *args, *([] if server == "registry" else ["--registry", "r:1"]), env=env)
    assert got["values"]["store"] == "s3://models/team"
    shown = got["environment"]
    assert shown["AWS_SECRET_ACCESS_KEY"] == "***" and shown["AWS_ACCESS_KEY_ID"] == "AKIDEXAMPLE"
    assert shown["AWS_REGION"] == "eu-west-1" and "AWS_SESSION_TOKEN" not in shown
    assert "s3cr3t-value" not in json.dumps(got)
    if server != "registry":
        assert got["values"]["cache_dir"] == "/var/cache/ot" and got["sources"]["cache_dir"] == "config"


@pytest.mark.parametrize("server", ["trainer", "sampler"])
def test_cache_max_bytes_takes_a_size_with_a_unit(server: str, tmp_path: Path) -> None:
    def size(*args: str) -> int:
        got: int = resolved(server, "--registry", "r:1", *args)["values"]["cache_max_bytes"]
        return got

    assert size() == 0  # no bound
    assert size("--cache-max-bytes", "20GiB") == 20 << 30
    assert size("--cache-max-bytes", "512mb") == 512 * 10**6
    assert size("--cache-max-bytes", "1.5G") == 1_500_000_000
    assert size("--cache-max-bytes", "4096") == 4096
    path = tmp_path / "stack.toml"
    path.write_text(f'[{server}]\ncache_max_bytes = "2 TiB"\n')
    assert size("--config", str(path)) == 2 << 40
    path.write_text(f"[{server}]\ncache_max_bytes = 1000\n")  # a plain number of bytes in the file
    assert size("--config", str(path)) == 1000
    for bad in ("-1", "12XB", "nan", "inf", "GiB"):
        result = invoke(server, "--registry", "r:1", "--cache-max-bytes", bad, "--print-config")
        assert result.exit_code == 2 and "is not a size" in result.output, (bad, result.output)
