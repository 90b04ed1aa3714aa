"""Receptive-field ("attention hole") verifier and causality checker.

Information flows from key k to query q in a layer when any head lets q attend k; every position also keeps its
own state (the residual path). After layers 1..l, query q is *connected* to the set C_l(q) of input positions:
``C_0(p) = {p}`` and ``C_l(q) = union of C_{l-1}(k) over k in A_l(q) + {q}``. A stack is hole-free when
``C_L(q) = [0, q]`` for every q.

:func:`receptive_field` computes every C_l(q) exactly, for all queries, as sorted interval lists. A set is held as
its last interval ``[lo(q), q]`` plus "extra" intervals below it (most sets have none). A layer's keys come as
ascending runs of consecutive positions (``Pattern.union_key_runs``, slot-major ``[R, P]``); the union of
``[lo(k), k]`` over a run ``a..b`` is the single interval ``[min lo(a..b), b]`` because each of those intervals
ends at its own k (a sparse-table range minimum, or just ``lo(a)`` when lo is non-decreasing, which is checked
per layer). Gaps between runs come from a suffix minimum over the slots; queries whose keys' union is one interval
touching their own are finished elementwise, the rest (and all extras) are sorted and merged. Positions whose set
is already ``[0, q]`` stay complete (the residual path) and are skipped in later layers.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from flexsparse.masks.base import EMPTY, FULL, Geometry, Pattern
from flexsparse.masks.combine import PerHead, PerLayer

_BIG = 2**31 - 1  # positions are int32 in the hot path (seq_len < 2**30)
_WORK_PER_CHUNK = 1 << 21  # run slots per chunk of queries (bounds memory)


@dataclass
class ReceptiveFieldReport:
    """What :func:`receptive_field` found for a stack of layers over ``seq_len`` positions."""

    seq_len: int
    num_layers: int
    hole_free: bool
    first_hole: tuple[int, int] | None
    """(query, key): the smallest query with an unreachable key k <= query, and its smallest such key."""
    coverage: list[float] = field(default_factory=list)
    """Fraction of causal (query, key) pairs connected after each layer."""
    complete_depth: int | None = None
    """Layers after which every query reaches every earlier key (None if never)."""

    def __str__(self) -> str:
        lines = [f"receptive field over {self.seq_len:,} positions, {self.num_layers} layers: "
                 + ("hole-free" if self.hole_free else f"HOLE at query {self.first_hole[0]}, key {self.first_hole[1]}")]
        for depth, cov in enumerate(self.coverage, 1):
            lines.append(f"  after layer {depth:>3}: {cov:8.4%} of causal pairs connected")
        if self.complete_depth is not None:
            lines.append(f"  complete after {self.complete_depth} layer(s)")
        return "\n".join(lines)


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
        kv_modes = layer.default_modes if modes is None else torch.as_tensor(modes).cpu()
        if kv_modes.dim() == 2:
            if kv_modes.shape[0] != 1:
                raise ValueError("verify one batch element at a time: pass modes of shape [H_kv]")
            kv_modes = kv_modes[0]
        if kv_modes.shape != (layer.num_kv_heads,):
            raise ValueError(f"modes must have shape [{layer.num_kv_heads}], got {tuple(kv_modes.shape)}")
        patterns = list(layer.patterns.values())
        if any(p.is_dynamic for p in patterns):
            raise ValueError("content-dependent patterns (XA) have no fixed receptive field; resolve them on q/k "
                             "first (pattern.resolve(q, k)) and verify the resolved pattern")
        return PerHead(patterns, kv_modes.repeat_interleave(layer.num_heads // layer.num_kv_heads))
    if isinstance(layer, Pattern):
        if layer.is_dynamic:
            raise ValueError(f"{layer!r} is content-dependent; verify pattern.resolve(q, k) instead")
        return layer
    if isinstance(layer, Sequence) and layer and all(isinstance(p, Pattern) for p in layer):
        return PerHead(list(layer), list(range(len(layer))))
    raise TypeError(f"a layer must be a Pattern, a list of per-head Patterns or a HybridAttention, got {layer!r}")


def _stack(layers) -> list[Pattern]:
    if isinstance(layers, (Pattern, PerLayer)):
        layers = [layers] if isinstance(layers, Pattern) else list(layers)
    if not isinstance(layers, Sequence) or isinstance(layers, (str, bytes)):
        raise TypeError(f"layers must be a sequence of layers, got {type(layers).__name__}")
    if len(layers) == 0:
        raise ValueError("layers is empty: give at least one layer")
    return [layer_pattern(layer) for layer in layers]


def _check_seq_len(seq_len: int) -> None:
    if not isinstance(seq_len, int) or isinstance(seq_len, bool):
        raise TypeError(f"seq_len must be an int, got {type(seq_len).__name__}")
    if not 0 < seq_len < 2**30:
        raise ValueError(f"seq_len must be in [1, 2**30), got {seq_len}")


class _SparseTableMin:
    """Range minimum over an int64 vector in O(1) per query after O(n log n) preprocessing."""

    def __init__(self, values: Tensor) -> None:
        self.levels = [values]
        width = 1
        while 2 * width <= values.numel():
            prev = self.levels[-1]
            self.levels.append(torch.minimum(prev[:-width], prev[width:]))
            width *= 2

    def query(self, first: Tensor, last: Tensor) -> Tensor:
        """min(values[first..last]) elementwise; requires first <= last."""
        length = last - first + 1
        level = torch.floor(torch.log2(length.double())).long()
        result = torch.empty_like(first)
        for j in torch.unique(level).tolist():
            sel = level == j
            table = self.levels[j]
            result[sel] = torch.minimum(table[first[sel]], table[last[sel] - (1 << j) + 1])
        return result


@dataclass
class _Connectivity:
    """C(p) for every position: the last interval [lo[p], p] plus extra intervals (CSR over positions)."""

    lo: Tensor
    extra_ptr: Tensor
    extra_first: Tensor
    extra_last: Tensor
    size: Tensor  # |C(p)|

    @classmethod
    def initial(cls, seq_len: int, device: torch.device) -> _Connectivity:
        positions = torch.arange(seq_len, device=device, dtype=torch.int32)
        zeros = torch.zeros(seq_len + 1, dtype=torch.long, device=device)
        empty = torch.empty(0, dtype=torch.int32, device=device)
        return cls(positions.clone(), zeros, empty, empty, torch.ones(seq_len, dtype=torch.long, device=device))

    @property
    def complete(self) -> Tensor:
        return (self.lo == 0) & (self.extra_ptr[1:] == self.extra_ptr[:-1])


def _group_intervals(first: Tensor, last: Tensor, lo_min: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Union of intervals [lo_min_i, last_i] per row for ascending runs ``[G, P, R]``.

    Returns (row mask of emitted intervals, their first, their last), all ``[G, P, R]``.
    """
    valid = first <= last
    lo_min = torch.where(valid, lo_min, _BIG)
    suffix_min = lo_min.flip(-1).cummin(-1).values.flip(-1)
    next_min = torch.cat([suffix_min[..., 1:], torch.full_like(suffix_min[..., :1], _BIG)], -1)
    group_last = valid & (next_min > last + 1)
    prev_last = torch.cat([torch.ones_like(group_last[..., :1]), group_last[..., :-1]], -1)
    group_first = valid & prev_last
    slots = torch.arange(first.shape[-1], device=first.device).expand_as(first)
    first_slot = torch.where(group_first, slots, -1).cummax(-1).values.clamp(min=0)
    return group_last, suffix_min.gather(-1, first_slot), last


def _merge(query: Tensor, first: Tensor, last: Tensor, num_queries: int):
    """Merge intervals by query (0..num_queries-1): sorted, disjoint, non-adjacent. Returns CSR pieces."""
    query, first, last = query.long(), first.long(), last.long()
    span = 2**60 // max(num_queries, 1)
    order = torch.argsort(query * span + first)
    query, first, last = query[order], first[order], last[order]
    shifted_last = query * span + last
    reach = shifted_last.cummax(0).values
    opens = torch.ones_like(query, dtype=torch.bool)
    opens[1:] = (query[1:] != query[:-1]) | (query[1:] * span + first[1:] > reach[:-1] + 1)
    group = opens.cumsum(0) - 1
    n = int(group[-1]) + 1
    out_query = query[opens]
    out_first = first[opens]
    out_last = torch.full((n,), -1, dtype=last.dtype, device=last.device).scatter_reduce(
        0, group, last, "amax", include_self=True)
    counts = torch.bincount(out_query, minlength=num_queries)
    return out_query, out_first, out_last, counts


def _union_of_runs(first: Tensor, last: Tensor, lo_min: Tensor, monotone: bool) -> tuple[Tensor, Tensor, Tensor]:
    """Intervals of the union of [lo_min_i, last_i] over each row's ascending runs, slot-major ``[R, N]``.

    Returns (row in 0..N-1, first, last) of the emitted intervals. Rows whose union is one interval (the common
    case) are finished in one reverse pass over the slots; only rows with a gap are grouped run by run.
    ``monotone``: lo_min never decreases along valid runs, so each suffix minimum is the run's own lo_min and
    every pass is elementwise.
    """
    valid = first <= last
    suffix_min = torch.where(valid, lo_min, _BIG)
    top = last.masked_fill(~valid, -1).amax(0)
    if monotone:
        # valid runs come first, so a valid run after a slot means that slot is valid too
        has_gap = (valid[1:] & (suffix_min[1:] > last[:-1] + 1)).any(0)
    else:
        has_gap = torch.zeros_like(valid[0])
        for slot in range(suffix_min.shape[0] - 2, -1, -1):  # in place, slot-major: fast and flip-free
            has_gap |= valid[slot + 1] & (suffix_min[slot + 1] > last[slot] + 1)
            torch.minimum(suffix_min[slot], suffix_min[slot + 1], out=suffix_min[slot])
    row_ids = torch.arange(valid.shape[1], device=first.device)
    one = valid[0] & ~has_gap
    out_rows, out_first, out_last = [row_ids[one]], [suffix_min[0][one]], [top[one]]
    if bool(has_gap.any()):
        rows_t = lambda t: t[:, has_gap].T
        emitted, e_first, e_last = _group_intervals(rows_t(first), rows_t(last), rows_t(lo_min))
        owner = row_ids[has_gap][:, None].expand_as(emitted)
        out_rows.append(owner[emitted])
        out_first.append(e_first[emitted])
        out_last.append(e_last[emitted])
    return torch.cat(out_rows), torch.cat(out_first), torch.cat(out_last)


def _extra_intervals(state: _Connectivity, run_owner: Tensor, run_first: Tensor, run_last: Tensor):
    """(owner, first, last) of the extra intervals of every position with extras inside each run."""
    with_extras = torch.nonzero(state.extra_ptr[1:] > state.extra_ptr[:-1]).flatten()
    lo_i = torch.searchsorted(with_extras, run_first)
    hits = torch.searchsorted(with_extras, run_last, right=True) - lo_i
    run = torch.repeat_interleave(torch.arange(hits.numel(), device=hits.device), hits)
    position = with_extras[lo_i[run] + _ranks(hits)]
    n_extra = state.extra_ptr[position + 1] - state.extra_ptr[position]
    which = torch.repeat_interleave(torch.arange(position.numel(), device=hits.device), n_extra)
    index = state.extra_ptr[position][which] + _ranks(n_extra)
    return run_owner[run][which], state.extra_first[index], state.extra_last[index]


def _ranks(counts: Tensor) -> Tensor:
    """0..c-1 for each count c, concatenated."""
    total = int(counts.sum())
    return torch.arange(total, device=counts.device) - torch.repeat_interleave(counts.cumsum(0) - counts, counts)


def _layer_step(state: _Connectivity, pattern: Pattern, seq_len: int, device: torch.device) -> _Connectivity:
    heads = pattern.required_heads or 1
    geo = Geometry(heads, seq_len, device=device)
    active = torch.nonzero(~state.complete).flatten().to(torch.int32)
    if active.numel() == 0:
        return state
    monotone = bool((state.lo[1:] >= state.lo[:-1]).all())  # then a run's minimum is at its first key
    rmq = None if monotone else _SparseTableMin(state.lo)
    has_extras = state.extra_first.numel() > 0
    new_lo, new_size = state.lo.clone(), state.size.clone()
    pieces_q, pieces_f, pieces_l = [], [], []
    probe, _ = pattern.union_key_runs(geo, active[:1])
    chunk = max(1, _WORK_PER_CHUNK // probe.shape[0])  # probe: [R, 1]
    for start in range(0, active.numel(), chunk):
        rows = active[start : start + chunk]
        n_rows = rows.numel()
        first, last = (t.to(torch.int32) for t in pattern.union_key_runs(geo, rows))  # [R, P], slot-major
        valid = first <= last
        lo_min = state.lo[torch.where(valid, first, 0)]  # exact for single-key runs and monotone lo
        longer = valid & (last > first)
        if not monotone and bool(longer.any()):
            lo_min[longer] = rmq.query(first[longer], last[longer])
        query, i_first, i_last = _union_of_runs(first, last, lo_min, monotone)
        local = torch.arange(n_rows, device=device)
        own_lo = state.lo[rows]
        # Fast path: no extras anywhere, and the keys' union is at most one interval touching [lo(q), q].
        intervals = torch.bincount(query, minlength=n_rows)
        single = intervals == 1
        keys_first = torch.zeros_like(own_lo).index_put_((query,), i_first)  # meaningful where single
        keys_last = torch.full_like(own_lo, -2).index_put_((query,), i_last)
        touches = keys_last >= own_lo - 1
        done = (intervals == 0) | (single & touches)
        if has_extras:
            done[:] = False
        lowest = torch.where(single, torch.minimum(keys_first, own_lo), own_lo)
        new_lo[rows[done]] = lowest[done]
        new_size[rows[done]] = (rows[done] - lowest[done] + 1).long()
        general = ~done
        if not bool(general.any()):
            continue
        keep = general[query]
        q_parts, f_parts, l_parts = [query[keep], local[general]], [i_first[keep], own_lo[general]], \
            [i_last[keep], rows[general]]
        if has_extras:  # runs (and the query itself) pass on the extra intervals of positions inside them
            run_owner = torch.cat([local.expand_as(first)[valid], local])
            extra = _extra_intervals(state, run_owner, torch.cat([first[valid], rows]), torch.cat([last[valid], rows]))
            for part, piece in zip((q_parts, f_parts, l_parts), extra):
                part.append(piece)
        out_q, out_f, out_l, counts = _merge(torch.cat(q_parts), torch.cat(f_parts), torch.cat(l_parts), n_rows)
        gen_rows = local[counts > 0]
        counts = counts[gen_rows]
        ends = counts.cumsum(0) - 1  # the last interval of each query ends at the query itself
        new_lo[rows[gen_rows]] = out_f[ends].to(torch.int32)
        size = torch.zeros(n_rows, dtype=torch.long, device=device).index_add_(0, out_q, out_l - out_f + 1)
        new_size[rows[gen_rows]] = size[gen_rows]
        is_extra = torch.ones_like(out_q, dtype=torch.bool)
        is_extra[ends] = False
        pieces_q.append(rows[out_q[is_extra]].long())
        pieces_f.append(out_f[is_extra].to(torch.int32))
        pieces_l.append(out_l[is_extra].to(torch.int32))
    if not pieces_q:  # every set is a single interval: no extras
        return _Connectivity(new_lo, torch.zeros_like(state.extra_ptr), state.extra_first[:0], state.extra_last[:0],
                             new_size)
    q_all, f_all, l_all = torch.cat(pieces_q), torch.cat(pieces_f), torch.cat(pieces_l)
    order = torch.argsort(q_all * (seq_len + 1) + f_all)
    q_all, f_all, l_all = q_all[order], f_all[order], l_all[order]
    ptr = torch.zeros(seq_len + 1, dtype=torch.long, device=device)
    ptr[1:] = torch.bincount(q_all, minlength=seq_len).cumsum(0)
    return _Connectivity(new_lo, ptr, f_all, l_all, new_size)


def _first_hole(state: _Connectivity) -> tuple[int, int] | None:
    incomplete = torch.nonzero(~state.complete).flatten()
    if incomplete.numel() == 0:
        return None
    q = int(incomplete[0])
    if state.extra_ptr[q + 1] > state.extra_ptr[q]:
        first, last = int(state.extra_first[state.extra_ptr[q]]), int(state.extra_last[state.extra_ptr[q]])
    else:
        first, last = int(state.lo[q]), q
    return (q, 0) if first > 0 else (q, last + 1)


def receptive_field(
    layers,
    seq_len: int,
    *,
    device: str | torch.device | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> ReceptiveFieldReport:
    """Exact receptive field of a stack of layers over ``seq_len`` positions, for every query.

    ``layers``: a sequence whose items are Patterns (one per layer, union over heads), per-head lists of
    Patterns, HybridAttention modules (their default modes) or (HybridAttention, modes) pairs; or a PerLayer.
    ``progress(done, total)`` is called after each layer.
    """
    _check_seq_len(seq_len)
    patterns = _stack(layers)
    device = torch.device(device or "cpu")
    state = _Connectivity.initial(seq_len, device)
    causal_pairs = seq_len * (seq_len + 1) / 2
    coverage, complete_depth = [], None
    for depth, pattern in enumerate(patterns, 1):
        if complete_depth is None:
            state = _layer_step(state, pattern, seq_len, device)
            if bool(state.complete.all()):
                complete_depth = depth
        coverage.append(float(state.size.sum()) / causal_pairs)
        if progress:
            progress(depth, len(patterns))
    hole = _first_hole(state)
    return ReceptiveFieldReport(seq_len, len(patterns), hole is None, hole, coverage, complete_depth)


def receptive_field_bruteforce(layers, seq_len: int) -> ReceptiveFieldReport:
    """The same report from dense boolean reachability matrices: O(L * S^3), for tests at small sizes."""
    _check_seq_len(seq_len)
    patterns = _stack(layers)
    reach = torch.eye(seq_len, dtype=torch.bool)
    causal = torch.ones(seq_len, seq_len, dtype=torch.bool).tril()
    coverage, complete_depth = [], None
    for depth, pattern in enumerate(patterns, 1):
        geo = Geometry(pattern.required_heads or 1, seq_len)
        step = pattern.dense(geo)[0].any(0) | torch.eye(seq_len, dtype=torch.bool)
        reach = (step.double() @ reach.double()) > 0
        coverage.append(float(reach.sum()) / float(causal.sum()))
        if complete_depth is None and torch.equal(reach, causal):
            complete_depth = depth
    missing = causal & ~reach
    hole = None
    if missing.any():
        q = int(missing.any(1).nonzero()[0])
        hole = (q, int(missing[q].nonzero()[0]))
    return ReceptiveFieldReport(seq_len, len(patterns), hole is None, hole, coverage, complete_depth)


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
    _check_seq_len(seq_len)
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
