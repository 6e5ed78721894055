"""The admin CLI over TLS with a token, against a registry behind TLS and bearer tokens: real
`opentinker registry ...` processes. With --ca-cert and a valid token the commands work; without --ca-cert, or
with a wrong token, they fail with one line on stderr that names the problem, and no traceback."""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from registryutil import unique_name
from serverproc import ROOT, ServerProcess, start_registry
from tlsutil import make_certificate, write_tokens

TENANT = "team-tls"


@dataclass(frozen=True)
class TlsRegistry:
    server: ServerProcess
    cert: Path
    token: str


@pytest.fixture(scope="module")
def tls_registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TlsRegistry]:
    workdir = tmp_path_factory.mktemp("tls-registry")
    cert, key = make_certificate(workdir)
    token = f"tok-{secrets.token_hex(12)}"
    tokens = write_tokens(workdir / "tokens.json", {token: (TENANT, "user")})
    server = start_registry(workdir, "--tokens-file", str(tokens), "--tls-cert", str(cert), "--tls-key", str(key))
    yield TlsRegistry(server, cert, token)
    server.terminate()


def opentinker(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OPENTINKER_")}
    env["COLUMNS"] = "200"
    return subprocess.run(
        [sys.executable, "-m", "opentinker.cli.main", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        cwd=ROOT,
    )


def one_clean_line(result: subprocess.CompletedProcess[str], code: str) -> str:
    assert result.returncode == 1, (result.args, result.stdout, result.stderr)
    assert "Traceback" not in result.stderr + result.stdout, result.stderr
    assert len(result.stderr.splitlines()) == 1, result.stderr
    assert result.stderr.startswith(f"error: {code}:"), result.stderr
    assert result.stdout == ""
    return result.stderr


def test_admin_commands_over_tls_with_a_token(tls_registry: TlsRegistry) -> None:
    address, cert, token = tls_registry.server.address, str(tls_registry.cert), tls_registry.token
    secure = ("--registry", address, "--ca-cert", cert, "--token", token)
    name = unique_name(f"{TENANT}/cli")

    created = opentinker("registry", "create", name, "--rank", "8", "--json", *secure)
    assert created.returncode == 0 and created.stderr == "", created.stderr
    assert json.loads(created.stdout)["adapter"]["name"] == name

    listed = opentinker("registry", "adapters", "--prefix", name, "--json", *secure)
    assert listed.returncode == 0, listed.stderr
    assert [a["name"] for a in json.loads(listed.stdout)] == [name]

    shown = opentinker("registry", "show", name, *secure)  # no version yet: a clean NOT_FOUND, over TLS
    assert "NOT_FOUND" in one_clean_line(shown, "NOT_FOUND")

    # The environment names the certificate and the token as well as the flags do.
    env = {**os.environ, "OPENTINKER_CA_CERT": cert, "OPENTINKER_TOKEN": token, "COLUMNS": "200"}
    table = subprocess.run(
        [sys.executable, "-m", "opentinker.cli.main", "registry", "adapters", "--prefix", name, "--registry", address],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert table.returncode == 0 and name in table.stdout, table.stderr

    status = opentinker("status", "--registry", address, "--ca-cert", cert, "--token", token)
    assert status.returncode == 0 and "SERVING" in status.stdout and name in status.stdout, status.stderr


def test_plaintext_against_tls_fails_naming_the_problem(tls_registry: TlsRegistry) -> None:
    address, token = tls_registry.server.address, tls_registry.token
    for command in (("adapters",), ("create", unique_name(f"{TENANT}/plain")), ("show", f"{TENANT}/x")):
        plain = opentinker("registry", *command, "--registry", address, "--token", token)
        assert "--ca-cert" in one_clean_line(plain, "UNAVAILABLE")


def test_a_wrong_token_fails_naming_the_problem(tls_registry: TlsRegistry) -> None:
    address, cert = tls_registry.server.address, str(tls_registry.cert)
    for token in ("tok-wrong", None):
        auth = ("--token", token) if token else ()
        result = opentinker("registry", "adapters", "--registry", address, "--ca-cert", cert, *auth)
        assert "token" in one_clean_line(result, "UNAUTHENTICATED").lower()


def test_a_missing_certificate_file_is_a_usage_error(tls_registry: TlsRegistry, tmp_path: Path) -> None:
    result = opentinker(
        "registry", "adapters", "--registry", tls_registry.server.address, "--ca-cert", str(tmp_path / "nope.pem")
    )
    assert result.returncode == 2 and "--ca-cert" in result.stderr and "Traceback" not in result.stderr
