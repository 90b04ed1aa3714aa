"""Argument checks shared by the whole library: one place decides what an int or a float argument may be.

Every public constructor and function checks its arguments with these, so a bad value fails at once with a
``TypeError`` (wrong kind) or ``ValueError`` (wrong value) that names the argument.
"""

from __future__ import annotations

import math
import numbers


def as_int(name: str, value: object, minimum: int | None = None, maximum: int | None = None) -> int:
    """``value`` as a Python int: any integral number (int, numpy integer), never bool, float or str."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    value = int(value)
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{name} must be <= {maximum}, got {value}")
    return value


def as_float(name: str, value: object, minimum: float | None = None, maximum: float | None = None,
             positive: bool = False) -> float:
    """``value`` as a finite Python float (ints allowed, bool and str not); optionally bounded or > 0."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number, got {type(value).__name__} {value!r}")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    if positive and value <= 0:
        raise ValueError(f"{name} must be > 0, got {value}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{name} must be <= {maximum}, got {value}")
    return value


def as_int_list(name: str, values: object) -> list[int]:
    """A sequence of ints (each checked with :func:`as_int`); floats such as 1.9 are refused, not truncated."""
    if isinstance(values, (str, bytes)) or not hasattr(values, "__iter__"):
        raise TypeError(f"{name} must be a sequence of ints, got {type(values).__name__}")
    return [as_int(f"{name}[{i}]", v) for i, v in enumerate(values)]
