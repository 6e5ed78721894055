"""Server flags from the environment and from a TOML file, implemented once for every `... serve` command.

Every flag `--some-flag` of `opentinker <server> serve` is also read from

1. the environment: `OPENTINKER_<SERVER>_<SOME_FLAG>` (e.g. `OPENTINKER_SAMPLER_MAX_SLOTS=16`); a few older
   names stay accepted after it (`OPENTINKER_REGISTRY`, `OPENTINKER_REGISTRY_TOKEN`, ...);
2. a TOML file (`--config FILE`, or `OPENTINKER_<SERVER>_CONFIG` / `OPENTINKER_CONFIG`): keys at the top level
   are shared by all servers (a server takes those it has), keys in `[registry]`, `[trainer]`, `[sampler]`,
   `[gateway]` apply to that server and win over shared ones; `[up]` is read by `opentinker up` only.

Precedence: command line > environment > config file > built-in default. Keys are flag names with `_` or
`-`; an unknown section or key is an error, so a typo never goes unnoticed. `--print-config` prints the
resolved flags with the source of each as JSON and exits without starting anything.
"""

from __future__ import annotations

import json
import os
import sys
import tomllib
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, ClassVar

import typer
from typer._click.core import Context as ClickContext  # typer's own click, which its commands run on
from typer.core import TyperCommand, TyperOption

ENV_PREFIX = "OPENTINKER"
SERVER_SECTIONS = ("registry", "trainer", "sampler")  # the gRPC servers `opentinker up` starts
GATEWAY_SECTION = "gateway"  # `opentinker gateway serve` reads [gateway] (and the shared keys it has)
CONFIG_SECTIONS = (*SERVER_SECTIONS, GATEWAY_SECTION)
UP_SECTION = "up"
UP_KEYS = frozenset({"workdir", "services"})
# Top-level keys: flags that at least one server takes and that make sense to share (a test keeps this honest).
SHARED_KEYS = frozenset(
    {
        "host",
        "port",
        "metrics_port",
        "tokens_file",
        "insecure_public",
        "tls_cert",
        "tls_key",
        "log_level",
        "max_message_mb",
        "model",
        "store",
        "registry_token",
        "registry_ca",
        "device",
        "dtype",
    }
)
# Options that describe the invocation rather than the server: no env var, no config key.
_NOT_CONFIGURABLE = frozenset({"config_file", "print_config", "help"})
_SOURCE_NAMES = {"COMMANDLINE": "command line", "ENVIRONMENT": "env", "DEFAULT_MAP": "config", "DEFAULT": "default"}


class ConfigError(ValueError):
    """A config file that cannot be used, with the file and key in the message."""


def env_name(section: str, flag: str) -> str:
    """`OPENTINKER_SAMPLER_MAX_SLOTS` for the sampler's --max-slots."""
    return f"{ENV_PREFIX}_{section.upper()}_{flag.replace('-', '_').upper()}"


def _key(raw: str) -> str:
    return raw.replace("-", "_")


def read_config(path: Path) -> dict[str, Any]:
    """The TOML file as a dict, with keys normalized to flag names; sections and shared keys checked."""
    try:
        data = tomllib.loads(path.read_text())
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror or exc}") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"config file {path} is not valid TOML: {exc}") from None
    config: dict[str, Any] = {}
    for raw, value in data.items():
        key = _key(raw)
        if isinstance(value, dict):
            if key not in (*CONFIG_SECTIONS, UP_SECTION):
                raise ConfigError(
                    f"{path}: unknown section [{raw}]; sections are {', '.join(f'[{s}]' for s in CONFIG_SECTIONS)}"
                    f" and [{UP_SECTION}]"
                )
            config[key] = {_key(k): v for k, v in value.items()}
        elif key not in SHARED_KEYS:
            raise ConfigError(
                f"{path}: {raw!r} is not a shared key; put it under [registry], [trainer] or [sampler] "
                f"(shared keys: {', '.join(sorted(SHARED_KEYS))})"
            )
        else:
            config[key] = value
    unknown_up = set(config.get(UP_SECTION, {})) - UP_KEYS
    if unknown_up:
        raise ConfigError(f"{path}: unknown key(s) {sorted(unknown_up)} in [{UP_SECTION}]; known: {sorted(UP_KEYS)}")
    return config


def section_values(config: Mapping[str, Any], section: str, known: set[str], path: Path) -> dict[str, Any]:
    """The values one server takes from the file: its shared keys, overridden by its own section."""
    own: dict[str, Any] = dict(config.get(section, {}))
    unknown = sorted(set(own) - known)
    if unknown:
        raise ConfigError(f"{path}: unknown key(s) {unknown} in [{section}]; known: {sorted(known)}")
    shared = {k: v for k, v in config.items() if not isinstance(v, dict) and k in known}
    return {**shared, **own}


def resolve_value(config: Mapping[str, Any], section: str, flag: str, default: Any = None) -> Any:
    """One flag as a server started from this config (and this environment) will see it, for `opentinker up`."""
    env = os.environ.get(env_name(section, flag))
    if env:
        return env
    own = config.get(section, {})
    if flag in own:
        return own[flag]
    return config.get(flag, default)


class ServeCommand(TyperCommand):
    """A `serve` command whose options also come from `OPENTINKER_<SECTION>_<FLAG>` and the config file."""

    section: ClassVar[str] = ""
    # What --print-config adds as "environment": variables the flags' values make the server read (a store's
    # credentials, masked); given by the server, which knows what its flags mean.
    environment: ClassVar[Callable[[Mapping[str, Any]], dict[str, str]] | None] = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        for param in self.params:
            if not isinstance(param, TyperOption) or param.name is None:
                continue
            own = [env_name(self.section, param.name)]
            if param.name == "config_file":  # --config: OPENTINKER_<SECTION>_CONFIG, then OPENTINKER_CONFIG
                own = [env_name(self.section, "config"), f"{ENV_PREFIX}_CONFIG"]
            elif param.name in _NOT_CONFIGURABLE:
                continue
            older = [param.envvar] if isinstance(param.envvar, str) else list(param.envvar or [])
            names = [*own, *(e for e in older if e not in own)]  # the precise name wins
            param.envvar = names[0] if len(names) == 1 else names
            param.show_envvar = True

    def configurable(self) -> set[str]:
        return {p.name for p in self.params if p.name and p.name not in _NOT_CONFIGURABLE}

    def invoke(self, ctx: ClickContext) -> Any:
        if ctx.params.get("print_config"):
            print_config(ctx, self.configurable(), type(self).environment)
            return None
        from opentinker.rpc.process.startup import startup_errors

        # Every server's startup errors the same way: one line, exit 2 for configuration errors (startup.py).
        with startup_errors(self.section, str(ctx.params.get("log_level") or "INFO")):
            return super().invoke(ctx)


def serve_command(
    section: str, environment: Callable[[Mapping[str, Any]], dict[str, str]] | None = None
) -> type[ServeCommand]:
    """The command class for `opentinker <section> serve` (pass as `cls=` to `app.command`)."""
    if section not in CONFIG_SECTIONS:
        raise ValueError(f"unknown server section {section!r}")
    attributes = {"section": section, "environment": staticmethod(environment) if environment else None}
    return type(f"{section.capitalize()}ServeCommand", (ServeCommand,), attributes)


def load_config_file(ctx: typer.Context, value: Path | None) -> Path | None:
    """Eager callback of --config: the file's values become the defaults of every other option."""
    command = ctx.command
    if value is None or not isinstance(command, ServeCommand):
        return value
    try:
        values = section_values(read_config(value), command.section, command.configurable(), value)
    except ConfigError as exc:
        raise typer.BadParameter(str(exc), param_hint="--config") from None
    ctx.default_map = {**(ctx.default_map or {}), **values}
    return value


def _jsonable(value: object) -> object:
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    return value


def print_config(
    ctx: ClickContext, names: set[str], environment: Callable[[Mapping[str, Any]], dict[str, str]] | None = None
) -> None:
    """`{"values": {flag: value}, "sources": {flag: "command line" | "env" | "config" | "default"},
    "environment": {variable: value or "***"}}`."""
    values = {n: _jsonable(ctx.params.get(n)) for n in sorted(names)}
    sources = {}
    for name in sorted(names):
        source = ctx.get_parameter_source(name)
        sources[name] = _SOURCE_NAMES.get(source.name, source.name.lower()) if source is not None else "default"
    report: dict[str, Any] = {"values": values, "sources": sources}
    if environment is not None:
        report["environment"] = environment(ctx.params)
    json.dump(report, sys.stdout, indent=2, sort_keys=True)
    sys.stdout.write("\n")
