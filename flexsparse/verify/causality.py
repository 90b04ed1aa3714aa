"""Causality checker: does what the kernel computes ever let a query see a later key?"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flexsparse.masks.base import EMPTY, FULL, Geometry
from flexsparse.verify.layers import check_seq_len, layer_pattern


@dataclass
class CausalityReport:
    """Whether a pattern lets a query attend a later key, and the first (head, query, key) that does."""

    causal: bool
    first_violation: tuple[int, int, int] | None

    def __bool__(self) -> bool:
        return self.causal


def causal(layer, seq_len: int, *, kv_len: int | None = None, block_size: int = 128) -> CausalityReport:
    """Check that what the kernel computes (FULL tiles, and mask_mod on listed tiles) never sees the future.

    Exact and O(S * block_size): only tiles holding some pair with key > query can violate causality; FULL ones
    do at once, PARTIAL ones are evaluated pair by pair with the pattern's mask_mod.
    """
    seq_len = check_seq_len(seq_len)
    pattern = layer_pattern(layer)
    geo = Geometry(pattern.required_heads or 1, seq_len, kv_len or seq_len, block_size)
    classes = pattern.block_classes(geo)
    q_first, _ = geo.q_tile_bounds()
    _, kv_last = geo.kv_tile_bounds()
    risky = (classes != EMPTY) & (kv_last > q_first)  # [B', H', QB, KB]
    mask_mod = pattern.mask_mod(geo)
    violations = []
    for b, h, qb, kb in risky.nonzero().tolist():
        q_idx = torch.arange(qb * block_size, min((qb + 1) * block_size, geo.q_len))[:, None]
        kv_idx = torch.arange(kb * block_size, min((kb + 1) * block_size, geo.kv_len))[None, :]
        future = kv_idx > q_idx + geo.offset
        if classes[b, h, qb, kb] == FULL:
            allowed = torch.ones_like(future)
        else:
            allowed = mask_mod(torch.tensor(b), torch.tensor(h), q_idx, kv_idx).expand_as(future)
        bad = (allowed & future).nonzero()
        if bad.numel():
            violations.append((h, int(q_idx[bad[0, 0], 0]), int(kv_idx[0, bad[0, 1]])))
    if not violations:
        return CausalityReport(True, None)
    return CausalityReport(False, min(violations, key=lambda v: (v[1], v[2], v[0])))
