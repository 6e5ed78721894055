"""Numeric fields of JSON bodies, checked against their ranges before anything is built from them.

A number out of range (or of the wrong type) is the caller's error: 400 INVALID_FIELD naming the field and the
range, never an OverflowError or a protobuf ValueError later (which would answer 500 and be retried).
Ranges follow what the value becomes: a uint32 or uint64 field of a request, a float32, a sampler limit.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from opentinker.gateway.errors import bad_request

INT32_MAX = 2**31 - 1
INT64_MAX = 2**63 - 1
UINT64_MAX = 2**64 - 1
FLOAT32_MAX = 3.4028234663852886e38


def _invalid(name: str, message: str) -> Exception:
    return bad_request(f"{name} {message}", "INVALID_FIELD")


def integer(
    body: Mapping[str, object], name: str, low: int, high: int, *, default: int | None = None, where: str = ""
) -> int | None:
    """An integer in ``low..high`` (an integral JSON float such as 5.0 counts); ``default`` when absent."""
    label = f"{where}{name}"
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, float) and value.is_integer() and abs(value) <= 2**63:
        value = int(value)
    if not isinstance(value, int) or isinstance(value, bool):
        raise _invalid(label, f"must be an integer in {low}..{high}, got {type(value).__name__}")
    if not low <= value <= high:
        shown = str(value) if abs(value) < 10**30 else f"a {len(str(abs(value)))}-digit number"
        raise _invalid(label, f"must be in {low}..{high}, got {shown}")
    return value


def number(
    body: Mapping[str, object],
    name: str,
    low: float = -FLOAT32_MAX,
    high: float = FLOAT32_MAX,
    *,
    default: float | None = None,
    where: str = "",
) -> float | None:
    """A finite number in ``low..high`` (float32 range unless narrower); ``default`` when absent."""
    label = f"{where}{name}"
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, int | float) or isinstance(value, bool):
        raise _invalid(label, f"must be a number, got {type(value).__name__}")
    if isinstance(value, int) and abs(value) > 2**128:
        raise _invalid(label, f"must be in {low:g}..{high:g}")
    result = float(value)
    if not math.isfinite(result) or not low <= result <= high:
        raise _invalid(label, f"must be a finite number in {low:g}..{high:g}, got {result:g}")
    return result


def boolean(body: Mapping[str, object], name: str, *, default: bool = False, where: str = "") -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise _invalid(f"{where}{name}", f"must be true or false, got {type(value).__name__}")
    return value


def mapping(body: Mapping[str, object], name: str, *, where: str = "") -> dict[str, object]:
    """An object field ({} when absent)."""
    value = body.get(name)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise _invalid(f"{where}{name}", f"must be an object, got {type(value).__name__}")
    return value


def required_integer(body: Mapping[str, object], name: str, low: int, high: int) -> int:
    value = integer(body, name, low, high)
    if value is None:
        raise bad_request(f"{name} is required", "MISSING_FIELD")
    return value
