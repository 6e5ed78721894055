"""The scalar fields of a /v1 body, each checked into its type and range (400 naming the field otherwise), and the
text a body holds, counted before anything renders it."""

from __future__ import annotations

from collections.abc import Mapping

from opentinker.gateway.openai.errors import invalid

Body = Mapping[str, object]


def text_size(value: object) -> int:
    """Characters of every string in a parsed body value (keys too): an upper bound on what a template renders
    from it, known before rendering anything."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, Mapping):
        return sum(len(str(k)) + text_size(v) for k, v in value.items())
    if isinstance(value, list | tuple):
        return sum(text_size(v) for v in value)
    return 0 if value is None else len(str(value))


def type_name(value: object) -> str:
    if value is None:
        return "null"
    return (
        "object"
        if isinstance(value, dict)
        else "array"
        if isinstance(value, list)
        else "string"
        if isinstance(value, str)
        else "boolean"
        if isinstance(value, bool)
        else "number"
    )


def integer(body: Body, name: str, low: int, high: int) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if not isinstance(value, int) or isinstance(value, bool):
        raise invalid(f"'{name}' must be an integer, got {type_name(value)}", name, "invalid_type")
    if not low <= value <= high:
        raise invalid(
            f"'{name}' must be in {low}..{high}, got {value if abs(value) < 10**20 else 'a huge number'}", name
        )
    return value


def number(body: Body, name: str, low: float, high: float, default: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, int | float) or isinstance(value, bool):
        raise invalid(f"'{name}' must be a number, got {type_name(value)}", name, "invalid_type")
    if not low <= value <= high:  # NaN fails this too; an int compares exactly (float() of 10**400 overflows)
        shown = value if isinstance(value, float) or abs(value) < 10**20 else "a huge number"
        raise invalid(f"'{name}' must be in {low:g}..{high:g}, got {shown}", name)
    return float(value)


def boolean(body: Body, name: str) -> bool:
    value = body.get(name, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise invalid(f"'{name}' must be a boolean, got {type_name(value)}", name, "invalid_type")
    return value


def string(body: Body, name: str, *, where: str = "", required: bool = False) -> str | None:
    value = body.get(name)
    if value is None:
        if required:
            raise invalid(f"'{where}{name}' is required", f"{where}{name}", "missing_required_parameter")
        return None
    if not isinstance(value, str):
        raise invalid(f"'{where}{name}' must be a string, got {type_name(value)}", f"{where}{name}", "invalid_type")
    return value


def obj(body: Body, name: str, *, where: str = "") -> dict[str, object]:
    value = body.get(name)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise invalid(f"'{where}{name}' must be an object, got {type_name(value)}", f"{where}{name}", "invalid_type")
    return value
