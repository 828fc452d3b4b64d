"""Typed getters for a JSON body's fields: a number or an integer in a range (given, or the
field's row of `fields.RANGES`), a boolean. A value of the wrong type or out of range is a
400 naming the field; absent or null is the default."""

from __future__ import annotations

import math
from typing import Any

from .errors import bad_field as _bad
from .errors import shown
from .fields import RANGES


def number_field(body: dict, name: str, default: float, lo: float, hi: float) -> float:
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _bad(name, f"expected a number, got {shown(value)}")
    if not (isinstance(value, int) or math.isfinite(value)) or not lo <= value <= hi:
        # as floats: the table writes 0 and 2 (as the OpenAPI document does); a number is read
        raise _bad(name, f"must be between {float(lo)} and {float(hi)}, got {shown(value)}")
    return float(value)


def integer_field(body: dict, name: str, default: int | None, lo: int, hi: int) -> int | None:
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise _bad(name, f"expected an integer, got {shown(value)}")
    if not lo <= value <= hi:
        raise _bad(name, f"must be between {lo} and {hi}, got {shown(value)}")
    return value


def boolean_field(body: dict, name: str, default: bool) -> bool:
    value = body.get(name, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise _bad(name, f"expected true or false, got {shown(value)}")
    return value


def ranged_field(body: dict, name: str, default: float | None, max_context: int = 0) -> Any:
    """A numeric field in the type and bounds of its row of `RANGES`; `max_context` is the
    upper bound of a field bounded by the context."""
    spec = RANGES[name]
    read = integer_field if spec.type == "integer" else number_field
    return read(body, name, default, *spec.bounds(max_context))
