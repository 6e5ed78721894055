"""Gateway pieces both surfaces share, without servers: API keys, JSON body bounds, log lines a client cannot forge."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
from pathlib import Path

import pytest
from serverproc import opentinker_command

from opentinker.gateway.auth import KeysFileError, KeyStore
from opentinker.gateway.errors import GatewayError


def test_keys_map_to_tenants_and_tokens(tmp_path: Path) -> None:
    path = tmp_path / "keys.json"
    digest = hashlib.sha256(b"tml-hashed").hexdigest()
    path.write_text(
        json.dumps(
            {"keys": [{"key": "tml-a", "tenant": "team-a", "token": "s3"}, {"key_sha256": digest, "tenant": "b"}]}
        )
    )
    keys = KeyStore.from_file(path)
    a, b = keys.lookup("tml-a"), keys.lookup("tml-hashed")
    assert a is not None and (a.tenant, a.token) == ("team-a", "s3")
    assert b is not None and (b.tenant, b.token) == ("b", None)
    assert keys.lookup("tml-other") is None and keys.lookup("sk-a") is None
    spec = KeyStore.from_spec("tml-x=team-x:tok, tml-y=team-y")
    x, y = spec.lookup("tml-x"), spec.lookup("tml-y")
    assert x is not None and x.token == "tok" and y is not None and y.token is None
    for bad in (
        {"keys": [{"key": "sk-nope", "tenant": "t"}]},
        {"keys": [{"key": "tml-k", "tenant": "Bad/Tenant"}]},
        {},
    ):
        path.write_text(json.dumps(bad))
        with pytest.raises(KeysFileError):
            KeyStore.from_file(path)


def test_gateway_refuses_to_start_without_keys(tmp_path: Path) -> None:
    args = opentinker_command("gateway", "serve", "--trainer", "x:1", "--sampler", "x:2", "--registry", "x:3")
    env = {k: v for k, v in os.environ.items() if not k.startswith("OPENTINKER_GATEWAY_KEYS")}
    done = subprocess.run(args, capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 2 and "no API keys" in done.stderr


def test_json_bodies_are_bounded_before_handlers_see_them() -> None:
    from opentinker.gateway.bodies import parse_json

    def code(raw: bytes) -> str:
        with pytest.raises(GatewayError) as caught:
            parse_json(raw, max_bytes=1 << 20, max_string=8)
        return caught.value.code

    ok = {"a": [1, {"b": "12345678"}]}
    assert parse_json(json.dumps(ok).encode(), max_bytes=1 << 20, max_string=8) == ok
    assert code(b"[" * 100_000 + b"]" * 100_000) == "JSON_TOO_DEEP"
    assert code(b'{"a":' * 40 + b"1" + b"}" * 40) == "JSON_TOO_DEEP"
    assert code(b'{"a": NaN}') == code(b'{"a": -Infinity}') == "MALFORMED_JSON"
    assert code(b'{"a": "123456789"}') == code(b'{"123456789": 1}') == "STRING_TOO_LONG"
    assert code(b"\xff{}") == code(b"[1]") == "MALFORMED_JSON"
    assert code(b" " * (2 << 20)) == "BODY_TOO_LARGE"


def test_client_strings_cannot_forge_log_lines() -> None:
    import logging

    from opentinker.gateway.logsafe import FORMAT, SafeFormatter

    forged = "0.38.0\n2026-01-01 00:00:00,000 ERROR opentinker.gateway: forged\r\x1b[2J\u2028"
    record = logging.LogRecord("opentinker.gateway", logging.WARNING, __file__, 1, "sdk %s", (forged,), None)
    text = SafeFormatter(FORMAT).format(record)
    assert "\n" not in text and "\r" not in text and "\x1b" not in text and "\u2028" not in text
    assert "\\x0a2026-01-01" in text and "\\u2028" in text
    try:
        raise ValueError(forged)
    except ValueError:
        import sys

        failed = logging.LogRecord("opentinker.gateway", logging.ERROR, __file__, 1, "boom", (), sys.exc_info())
    lines = SafeFormatter(FORMAT).format(failed).splitlines()
    assert all(line.startswith("    | ") for line in lines[1:]) and len(lines) > 2
