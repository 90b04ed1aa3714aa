"""Stacks of layers as the verifier reads them: one Pattern per layer, its union over heads."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from flexsparse.heads import per_query_head
from flexsparse.masks.base import Pattern
from flexsparse.masks.combine import PerHead, PerLayer
from flexsparse.validation import as_int

MAX_SEQ_LEN = 2**30 - 1  # positions are int32 in the hot path


def layer_pattern(layer) -> Pattern:
    """The pattern whose union over heads is one layer's information flow.

    ``layer``: a Pattern, a list of per-head Patterns, a HybridAttention (its default modes) or a
    (HybridAttention, modes) pair.
    """
    from flexsparse.attention import HybridAttention

    modes = None
    if isinstance(layer, tuple) and len(layer) == 2 and isinstance(layer[0], HybridAttention):
        layer, modes = layer
    if isinstance(layer, HybridAttention):
        modes = layer.default_modes if modes is None else torch.as_tensor(modes).cpu()
        if modes.dim() == 2:
            if modes.shape[0] != 1:
                raise ValueError("verify one batch element at a time: pass modes of shape [H_kv]")
            modes = modes[0]
        if modes.shape != (layer.num_kv_heads,):
            raise ValueError(f"modes must have shape [{layer.num_kv_heads}], got {tuple(modes.shape)}")
        patterns = list(layer.patterns.values())
        if any(p.is_dynamic for p in patterns):
            raise ValueError("content-dependent patterns (XA) have no fixed receptive field; resolve them on q/k "
                             "first (pattern.resolve(q, k)) and verify the resolved pattern")
        return PerHead(patterns, per_query_head(modes, layer.num_heads // layer.num_kv_heads, dim=0))
    if isinstance(layer, Pattern):
        if layer.is_dynamic:
            raise ValueError(f"{layer!r} is content-dependent; verify pattern.resolve(q, k) instead")
        return layer
    if isinstance(layer, Sequence) and layer and all(isinstance(p, Pattern) for p in layer):
        return PerHead(list(layer), list(range(len(layer))))
    raise TypeError(f"a layer must be a Pattern, a list of per-head Patterns or a HybridAttention, got {layer!r}")


def stack_patterns(layers) -> list[Pattern]:
    """One pattern per layer from a sequence of layers (see :func:`layer_pattern`), a Pattern or a PerLayer."""
    if isinstance(layers, (Pattern, PerLayer)):
        layers = [layers] if isinstance(layers, Pattern) else list(layers)
    if not isinstance(layers, Sequence) or isinstance(layers, (str, bytes)):
        raise TypeError(f"layers must be a sequence of layers, got {type(layers).__name__}")
    if len(layers) == 0:
        raise ValueError("layers is empty: give at least one layer")
    return [layer_pattern(layer) for layer in layers]


def check_seq_len(seq_len: object, name: str = "seq_len") -> int:
    return as_int(name, seq_len, minimum=1, maximum=MAX_SEQ_LEN)
