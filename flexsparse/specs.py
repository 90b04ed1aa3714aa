"""Patterns from short text specs, for the command line and JSON configs.

A spec is ``name`` or ``name:key=value,key=value``, e.g. ``causal``, ``sink_window:sink=128,window=2048`` or
``esa:num_layers=8,attn_length=64,num_heads=8``: ``name`` is a registered ``Pattern.name``
(:func:`flexsparse.masks.registered_patterns`) and the keys are its constructor's arguments. A layer of per-head
patterns joins specs with ``+``. In a stack, a pattern that takes a ``layer_idx`` (ESA) and whose spec leaves it
out takes its position in the stack.

Every problem with a spec is a ValueError whose message quotes the spec.
"""

from __future__ import annotations

import inspect

from flexsparse.masks import Pattern, registered_patterns
from flexsparse.validation import as_int

PATTERNS = registered_patterns()
"""Spec name -> pattern class: the pattern registry (a read-only view; a new Pattern subclass with its own
``name`` appears here)."""


def _number(text: str, key: str, spec: str) -> int | float:
    try:
        return float(text) if "." in text else int(text)
    except ValueError:
        raise ValueError(f"the value of {key!r} must be a number, got {text!r} in spec {spec!r}") from None


def split_spec(spec: str) -> tuple[str, dict[str, int | float]]:
    """``name[:key=value,...]`` -> (name, {key: int or float}), without checking the name."""
    if not isinstance(spec, str):
        raise ValueError(f"a pattern spec must be a string, got {spec!r}")
    name, _, args = spec.strip().partition(":")
    kwargs: dict[str, int | float] = {}
    for item in filter(None, args.split(",")):
        key, eq, value = item.partition("=")
        if not eq:
            raise ValueError(f"spec arguments are key=value, got {item!r} in {spec!r}")
        kwargs[key.strip()] = _number(value.strip(), key.strip(), spec)
    return name, kwargs


def parse_pattern(spec: str, layer_idx: int | None = None) -> Pattern:
    """One pattern from ``name[:key=value,...]`` (values are ints or floats); ``layer_idx`` goes to a pattern that
    takes one when the spec does not give it."""
    name, kwargs = split_spec(spec)
    if name not in PATTERNS:
        raise ValueError(f"unknown pattern {name!r} in spec {spec!r}; known: {sorted(PATTERNS)}")
    cls = PATTERNS[name]
    takes_layer_idx = "layer_idx" in inspect.signature(cls).parameters
    from_stack = layer_idx is not None and takes_layer_idx and "layer_idx" not in kwargs
    if from_stack:
        kwargs["layer_idx"] = layer_idx
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as err:
        hint = ""
        if from_stack and "layer_idx" in str(err):
            hint = (f" (in a stack, {cls.__name__} layers take their position as layer_idx: num_layers must cover "
                    "the stack)")
        raise ValueError(f"bad arguments in spec {spec!r}: {err}{hint}") from err


def parse_layer(spec: str | list[str], layer_idx: int) -> Pattern | list[Pattern]:
    """A layer: one spec, or per-head specs (a list, or specs joined with '+')."""
    if isinstance(spec, str):
        parts = spec.split("+")
    elif isinstance(spec, list) and spec:
        parts = spec
    else:
        raise ValueError(f"a layer spec must be a string or a non-empty list of strings, got {spec!r}")
    patterns = [parse_pattern(p, layer_idx) for p in parts]
    return patterns[0] if len(patterns) == 1 else patterns


def parse_stack(specs: list[str | list[str]], repeat: int = 1) -> list[Pattern | list[Pattern]]:
    """Layers from specs, the list repeated ``repeat`` times; ESA layers are numbered by stack position."""
    try:
        repeat = as_int("repeat", repeat, minimum=1)
    except TypeError as err:
        raise ValueError(str(err)) from None
    full = list(specs) * repeat
    return [parse_layer(spec, index) for index, spec in enumerate(full)]
