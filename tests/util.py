"""Test helpers: evaluate a pattern's mask_mod and BlockMask on the full (q, kv) grid, for comparison with dense."""

from __future__ import annotations

import torch
from torch import Tensor

from flexsparse.masks import Geometry, Pattern


def mask_mod_grid(pattern: Pattern, geo: Geometry, batch: int = 1) -> Tensor:
    """mask_mod evaluated at every (b, h, q, kv): bool [batch, H, Q, KV]."""
    mod = pattern.mask_mod(geo)
    b = torch.arange(batch, device=geo.device)[:, None, None, None]
    h = torch.arange(geo.num_heads, device=geo.device)[None, :, None, None]
    q = torch.arange(geo.q_len, device=geo.device)[None, None, :, None]
    k = torch.arange(geo.kv_len, device=geo.device)[None, None, None, :]
    out = mod(b, h, q, k)
    return out.expand(batch, geo.num_heads, geo.q_len, geo.kv_len)


def block_mask_grid(pattern: Pattern, geo: Geometry, batch: int = 1) -> Tensor:
    """What the kernel computes: full tiles all True, partial tiles mask_mod, other tiles False."""
    bm = pattern.block_mask(geo)
    mods = mask_mod_grid(pattern, geo, batch)
    tiles_partial = _tiles(bm.kv_num_blocks, bm.kv_indices, geo)
    tiles_full = _tiles(bm.full_kv_num_blocks, bm.full_kv_indices, geo)
    bs = geo.block_size
    expand = lambda t: t.repeat_interleave(bs, -2).repeat_interleave(bs, -1)[..., : geo.q_len, : geo.kv_len]
    partial, full = expand(tiles_partial), expand(tiles_full)
    assert not (partial & full).any(), "a tile is both partial and full"
    return full | (partial & mods)


def _tiles(num: Tensor, idx: Tensor, geo: Geometry) -> Tensor:
    """Bool [B, H, QB, KB] of the tiles listed by (num, idx)."""
    slot = torch.arange(idx.shape[-1], device=idx.device)
    listed = slot < num[..., None].long()  # [B, H, QB, slots]
    kb = torch.arange(geo.num_kv_blocks, device=idx.device)
    return ((idx[..., :, None].long() == kb) & listed[..., :, None]).any(-2)


def assert_pattern_consistent(pattern: Pattern, geo: Geometry, batch: int = 1) -> Tensor:
    """The four capabilities agree: mask_mod, block mask, dense reference and attended counts. Returns dense."""
    dense = pattern.dense(geo).expand(batch, geo.num_heads, geo.q_len, geo.kv_len)
    mods = mask_mod_grid(pattern, geo, batch)
    assert torch.equal(mods, dense), f"{pattern!r}: mask_mod differs from dense at {_first_diff(mods, dense)}"
    kernel = block_mask_grid(pattern, geo, batch)
    assert torch.equal(kernel, dense), f"{pattern!r}: block mask differs from dense at {_first_diff(kernel, dense)}"
    counts = pattern.attended(geo).expand(batch, geo.num_heads, geo.q_len)
    assert torch.equal(counts, dense.sum(-1)), f"{pattern!r}: attended counts differ from dense"
    return dense


def _first_diff(a: Tensor, b: Tensor) -> tuple[int, ...]:
    return tuple(int(i) for i in (a != b).nonzero()[0])


def runs_to_rows(first: Tensor, last: Tensor, kv_len: int) -> Tensor:
    """Boolean rows [..., KV] from runs [..., R] (the inverse of key_runs, for tests)."""
    keys = torch.arange(kv_len, device=first.device)
    return ((keys >= first[..., None]) & (keys <= last[..., None])).any(-2)


def assert_key_runs_match_dense(pattern: Pattern, geo: Geometry) -> None:
    """key_runs: runs ascending, disjoint, non-empty ones first, and together exactly the dense rows."""
    positions = geo.q_positions()[0]
    first, last = (t.permute(1, 2, 0) for t in pattern.key_runs(geo, positions))  # [H', P, R]
    dense = pattern.dense(geo)[0]
    rows = runs_to_rows(first, last, geo.kv_len)
    assert torch.equal(rows.expand_as(dense), dense), f"{pattern!r}: key_runs differ from dense"
    empty = first > last
    assert not (empty[..., :-1] & ~empty[..., 1:]).any(), "empty runs must come last"
    both = ~empty[..., :-1] & ~empty[..., 1:]
    assert (first[..., 1:] > last[..., :-1])[both].all(), "runs must ascend without overlap"
