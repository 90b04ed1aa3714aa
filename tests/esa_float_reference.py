"""ESA indices computed the way the authors' code does: float32 tensors and torch.round.

A direct re-implementation (for tests and golden tables) of the index construction in
HighCWu/elastic-sparse-attention; flexsparse.masks.ESA computes the same thing in exact integer arithmetic.
"""

from __future__ import annotations

import torch


def esa_float_indices(positions, layer_idx, num_layers, attn_length, num_heads):
    """(indices [H, len(positions), w] int64, causal mask [H, len(positions), w] bool) for absolute query positions."""
    positions = torch.as_tensor(positions)
    end = torch.maximum(torch.tensor(attn_length - 1), positions)
    alpha = layer_idx / (num_layers - 1 if num_layers > 1 else 1)
    length = end + 1
    span = attn_length * (1 - alpha) + length * alpha  # float32 tensor
    start = (end + 1 - span).round().clamp(min=0).long()
    spacing = (end + 1 - start) / attn_length
    steps = torch.arange(attn_length + 1)
    oversized = start[:, None] + (steps[None, :] * spacing[:, None]).round().long()
    base, shifted = oversized[:, :attn_length], oversized[:, 1:] - 1
    if num_heads > 1:
        weight = (torch.arange(num_heads) / (num_heads - 1)).view(-1, 1, 1)
    else:
        weight = torch.zeros(num_heads).view(-1, 1, 1)
    mixed = base[None].float() * (1 - weight) + shifted[None].float() * weight
    indices = mixed.round().long()
    return indices, indices <= positions.view(1, -1, 1)
