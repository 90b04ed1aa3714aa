"""The shapes compiled flex_attention runs at: length buckets and power-of-two batch parts.

Compiled flex_attention specialises on every tensor shape (``dynamic=False``, see
:mod:`flexsparse.runtime.compiled`), so traffic of every prompt length, batch size, padding width and decode
position would compile without end (and raise RecompileLimitError past ``MAX_COMPILED_VARIANTS``). Compiled
calls run at a bounded set of shapes instead:

* **keys** at ``block_size x 2^k`` tokens (the grid, :func:`is_kv_bucket`). A key length on the grid is taken
  as it is: a KV cache whose buffer capacity follows the grid is never copied;
* **queries**: a prefill's (as many as the keys) at the key bucket; fewer (decode, chunks) at the next power
  of two, at most the key bucket, so that short decode chunks stay short;
* **batch**: in power-of-two parts, largest first (``7 = 4 + 2 + 1``, :func:`batch_parts`); each part is a
  call of its own on views of q/k/v and its rows of the positions and modes (no copy, no padding rows).

Added query rows and key slots are padding: rows hold position -1 and slots the position ``span`` in the
call's :class:`~flexsparse.masks.geometry.Positions` (:meth:`~flexsparse.masks.geometry.Positions.padded`), so
no pattern attends them, their tiles are empty and skipped, and patterns that depend on the sequence end
(TriangleMix's last queries, XAttention's tables) see the real end. Real rows equal the exact-length run; the
price is copying q/k/v into the longer buffers (lengths off the grid) and one launch per batch part.

**Contiguous prefill** (no position tables) follows :data:`PREFILL_POLICY`:

* ``"grid"`` (default): a length on the grid runs as it is (positions as arithmetic, no copy); any other
  length runs at its bucket with position tables;
* ``"buckets"``: every length runs at its bucket with position tables, on the grid too (one variant less per
  bucket);
* ``"exact"``: every length runs as it is, one variant per length (unbounded: for workloads of a few fixed
  lengths, and for measuring).

Bound: per shape class (dtype, heads and head dim, the layer's patterns and modes, grad mode, kernel options)
the variants are at most (key buckets) x (query buckets: one for prefill, the powers of two decode and chunks
use) x (batch part sizes) x 3 layouts (positions as arithmetic: contiguous prefill on the grid; tables shared
by the batch; tables per batch element). Key buckets: ``log2(S_max / block_size) + 1`` (11 from 128 to 128K
tokens at block 128); part sizes: ``log2(B_max) + 1``. A one-layer model at block 16 serving 100 prompt
lengths, 40 generate() calls and padded batches of 2 to 8 compiles 20 variants (tests/test_traffic.py).
"""

from __future__ import annotations

from typing import Literal

from flexsparse.masks.geometry import Geometry, Positions

PrefillPolicy = Literal["grid", "buckets", "exact"]
PREFILL_POLICIES = ("grid", "buckets", "exact")

PREFILL_POLICY: PrefillPolicy = "grid"
"""How compiled flex runs contiguous prefill (see the module docstring). Change it process-wide with
``flexsparse.runtime.buckets.PREFILL_POLICY = "buckets"``; read on every call."""


def next_power_of_two(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def kv_bucket(kv_len: int, block_size: int) -> int:
    """Keys: ``block_size`` times a power of two, at least ``kv_len``."""
    return block_size * next_power_of_two(-(-kv_len // block_size))


def is_kv_bucket(kv_len: int, block_size: int) -> bool:
    """Whether compiled flex takes ``kv_len`` keys as they are (no copy into a longer buffer): ``kv_len`` is
    ``block_size x 2^k``. A cache sizes its buffers by this rule."""
    return kv_bucket(kv_len, block_size) == kv_len


def q_bucket(q_len: int, block_size: int) -> int:
    """Queries of a decode step or chunk: the next power of two (short decode chunks stay short)."""
    return next_power_of_two(q_len)


def compiled_lengths(q_len: int, kv_len: int, block_size: int) -> tuple[int, int]:
    """(queries, keys) a call of ``q_len`` queries against ``kv_len`` keys runs at: keys at their bucket; a
    prefill's queries (as many as keys) at the same length, fewer queries at :func:`q_bucket` capped there."""
    keys = kv_bucket(kv_len, block_size)
    queries = keys if q_len == kv_len else min(q_bucket(q_len, block_size), keys)
    return queries, keys


def batch_parts(batch: int) -> list[tuple[int, int]]:
    """``(start, size)`` of the power-of-two parts a batch runs in, largest first: 6 -> [(0, 4), (4, 2)]."""
    parts, start = [], 0
    for bit in reversed(range(batch.bit_length())):
        if batch >> bit & 1:
            parts.append((start, 1 << bit))
            start += 1 << bit
    return parts


def compiled_geometry(geo: Geometry) -> Geometry:
    """The geometry a compiled call of ``geo`` runs at: ``geo`` itself when it needs no padding (and, in the
    contiguous layout, :data:`PREFILL_POLICY` keeps it), else the bucketed lengths with padded position
    tables, kept in the state of ``geo``'s positions (for the contiguous layout built anew: cache the result)."""
    if PREFILL_POLICY not in PREFILL_POLICIES:
        raise ValueError(f"flexsparse.runtime.buckets.PREFILL_POLICY must be one of {PREFILL_POLICIES}, "
                         f"got {PREFILL_POLICY!r}")
    q_len, kv_len = compiled_lengths(geo.q_len, geo.kv_len, geo.block_size)
    on_grid = (q_len, kv_len) == (geo.q_len, geo.kv_len)
    if geo.is_contiguous:
        if PREFILL_POLICY == "exact" or (PREFILL_POLICY == "grid" and on_grid):
            return geo
        padded = Positions.contiguous(geo.q_len, geo.kv_len, geo.device).padded(q_len, kv_len)
    elif on_grid:
        return geo
    else:
        padded = geo.positions.state.bucketed(q_len, kv_len, lambda: geo.positions.padded(q_len, kv_len))
    return Geometry(geo.num_heads, q_len, kv_len, geo.block_size, geo.device, padded)
