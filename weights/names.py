"""Adapter names, aliases and references: the one parser every component uses.

name       "tenant/name" or "name"; each part [a-z0-9][a-z0-9._-]{0,62}
alias      [a-z][a-z0-9._-]{0,62} (never a number, so "name@7" is always a version)
reference  "name" (= name@<serving alias>, latest unless the operator set one), "name@alias", "name@N",
           or "base" (no LoRA)
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from opentinker.rpc.serving.errors import InvalidArgument

_PART = r"[a-z0-9][a-z0-9._-]{0,62}"
_NAME_RE = re.compile(rf"^{_PART}(/{_PART})?$")
_ALIAS_RE = re.compile(r"^[a-z][a-z0-9._-]{0,62}$")
LATEST = "latest"
BASE = "base"


@dataclass(frozen=True, slots=True)
class Reference:
    """A parsed reference: exactly one of alias / version is set, unless it is the base model. A bare name
    parses as alias latest with `bare` set: resolvers that know the adapter's serving alias use that instead."""

    adapter: str
    alias: str | None = None
    version: int | None = None
    bare: bool = False

    @property
    def is_base(self) -> bool:
        return self.adapter == BASE and self.alias is None and self.version is None

    def __str__(self) -> str:
        if self.is_base:
            return BASE
        if self.version is not None:
            return f"{self.adapter}@{self.version}"
        return f"{self.adapter}@{self.alias}"


def check_adapter_name(name: str) -> str:
    if not _NAME_RE.match(name):
        raise InvalidArgument(
            f"invalid adapter name {name!r}: expected 'name' or 'tenant/name', each part matching "
            "[a-z0-9][a-z0-9._-]{0,62}",
            reason="INVALID_ADAPTER_NAME",
            name=name,
        )
    if name == BASE:
        raise InvalidArgument("'base' is reserved for the base model", reason="INVALID_ADAPTER_NAME", name=name)
    return name


def check_alias(alias: str) -> str:
    if not _ALIAS_RE.match(alias):
        raise InvalidArgument(
            f"invalid alias {alias!r}: expected [a-z][a-z0-9._-]{{0,62}}", reason="INVALID_ALIAS", alias=alias
        )
    return alias


def tenant_of(name: str) -> str:
    return name.split("/", 1)[0] if "/" in name else ""


def parse_reference(text: str) -> Reference:
    if text == BASE:
        return Reference(BASE)
    name, sep, suffix = text.partition("@")
    if not sep:
        return Reference(check_adapter_name(name), alias=LATEST, bare=True)
    check_adapter_name(name)
    if suffix.isascii() and suffix.isdigit():  # "²".isdigit() holds, and int("²") raises
        version = int(suffix)
        if version < 1:
            raise InvalidArgument(f"invalid reference {text!r}: versions start at 1", reason="INVALID_REFERENCE")
        return Reference(name, version=version)
    if not _ALIAS_RE.match(suffix):
        raise InvalidArgument(
            f"invalid reference {text!r}: expected name, name@alias or name@N", reason="INVALID_REFERENCE"
        )
    return Reference(name, alias=suffix)
