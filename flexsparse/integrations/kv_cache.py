"""A transformers ``Cache`` that keeps, per layer and head group, only the keys its heads' patterns can attend.

Per layer, the KV heads are grouped by :func:`~flexsparse.integrations.layer.cache_groups`, as the layer's executors
say (:meth:`~flexsparse.runtime.executors.Executor.cache_kind`); decode steps run through the group's executor:

* heads that keep every token, slot t holding token t (``[B, H_group, capacity, d]``):

  - "full": heads whose decode query attends every earlier key (full causal, XAttention, TriangleMix). A decode
    step attends the filled slots (below); a chunk of several tokens runs the heads' own patterns over them;
  - an executor's own kind, e.g. "esa" (one group per ESA mode): a decode step runs the executor's
    ``decode_step`` (ESA's gathers the new token's ``attn_length`` keys from the filled slots: its Triton kernel
    on CUDA, its PyTorch form elsewhere); chunks as above;
  - "keep" (other patterns: combinations, SinkWindow with ``unit > 1``, ...): every call runs the layer's
    executors over the whole buffer; under compiled flex its capacity is a flex bucket
    (:func:`~flexsparse.runtime.buckets.kv_bucket`), so compiled flex never copies it;

* token-exact SinkWindow heads ("ring") keep ``sink + window`` slots (fewer for a shorter generation): slot ``p``
  for a position ``p < sink``, slot ``sink + (p - sink) % window`` after it, per sequence, so a left-padded
  sequence's sink is its first real tokens. A decode step writes the new token into its slot (one indexed write,
  the oldest window key leaves) and attends every filled slot as full attention: the ring holds exactly the keys
  the pattern attends. A chunk of several tokens attends the ring and the chunk in the heads' own pattern, then
  rewrites it.

Capacities. With a known maximum length (``generate()`` passes its own; ``SparseKVCache(model, max_length=...)``)
a buffer's first allocation holds it exactly (a ring: at most ``sink + window``). Without one (a cache built by
hand), and past it, buffers grow on a grid of 16 steps per power of two (:func:`grown_capacity`): multiples of 16
slots, less than 1/16 above the tokens held past 256 tokens. Growing copies the buffer once (fewer than 32 slots
per new token, amortised; a generation from n to 2n tokens crosses at most 17 capacities) and recompiles nothing:
no decode path of full, ESA and ring heads runs compiled flex or depends on a capacity's value (SDPA, the decode
kernels and ESA's kernel are Triton or eager, specialised on a capacity's divisibility by 16 at most). "keep" groups under compiled flex are the exception: their capacities are
flex buckets (powers of two today, up to 2x the tokens), one compiled variant per bucket a generation crosses.
:meth:`SparseKVCache.memory_report` gives the allocated bytes beside the bytes of the tokens held.

Decode of full and ring heads needs no mask while the cache's padding has one of two layouts (read at prefill
with the padding check's one host sync; whether a forward's new tokens hold padding is read once per forward for
all layers, none without a padding mask, and generate() syncs every step anyway):

* no padding (a prompt without padding; generate() marks every new token real): every head attends its first
  filled slots, plain SDPA over a prefix of the buffer, GQA without a K/V copy (the flash kernel; cuDNN's would
  build a graph for every new length);
* a left-padded prompt: row b's real tokens are the last ``real_b`` slots of a full buffer and the first
  ``min(real_b, capacity)`` slots of its ring, so each head attends one slot range per row, bounds on the device:
  :func:`~flexsparse.kernels.decode.ranged_decode_attention` on CUDA (head dims up to 256), its PyTorch form
  on the CPU (and wherever triton is missing).

On CUDA (by default; ``one_launch_decode=True`` also under the Triton interpreter, ``False`` never), when a
layer's heads form at most two such groups of consecutive heads, the whole step is one call,
:class:`~flexsparse.kernels.decode.DecodeStep` (prepared once per layer for its buffers): it writes the new token
into both groups' buffers and attends both (two launches of the compiled kernels, no per-group copies, no cat).
On an H100 at 131,072 cached tokens it is faster than the per-group calls and than all-full SDPA at batch 1
and 8, left-padded too (the README's decode table, docs/notes/transformers.md; ``python bench/speed/hf_bench.py
--parts decode``).

Any other padding (a right-padded prompt, padding in a chunk or a decode token) sends decode from then on through
position masks: SDPA with a boolean mask over the filled slots for full and ring heads, ESA's gather with the
positions for ESA heads.

Each group runs as one call per step: no per-head loop, no host sync (slots and positions are computed on the
device from the padding mask, once per forward for all layers). Memory per layer is ``2 x B x d x bytes x`` the
groups' slots; with generate()'s maximum length ``S`` and no "keep" heads under compiled flex that is the formula
``2 B d bytes (H_every S + H_ring min(S, sink + window))`` exactly (:func:`kv_memory_formula`; ``H_every``: full,
XAttention, TriangleMix and ESA heads), and an all-full model's cache has the size of a DynamicCache.

Device-side steps (for CUDA graphs, :mod:`flexsparse.integrations.graph_decode`): after
:meth:`SparseKVCache.start_device_steps`, one-token steps of a cache whose every layer takes the one-launch step
(layouts "none" and "left") read each group's lo/hi/slot from static buffers of a :class:`DeviceSteps` (shared by
the layers), which :meth:`DeviceSteps.begin_step` computes on the device from device counters and then advances:
no tensor of such a step depends on a host int, so a recorded step serves step after step.

Decoding uses the modes the cache was built with (the layer's modes at prefill; converting again invalidates the
cache). Modes chosen per call and per sequence (a router) need every key in every head: such layers must use a
DynamicCache (the cache refuses routed models; ``generate()`` keeps its DynamicCache for them).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor
from transformers.cache_utils import Cache, CacheLayerMixin

from flexsparse.integrations.forward_mask import ForwardMask
from flexsparse.integrations.layer import CacheGroup, SparseAttentionLayer, sparse_layers
from flexsparse.kernels.availability import kernels_preferred_on, kernels_run_on
from flexsparse.kernels.decode_reference import MAX_HEAD_DIM, DecodeGroup
from flexsparse.masks import Positions, SinkWindow
from flexsparse.runtime.buckets import kv_bucket
from flexsparse.validation import as_int

if TYPE_CHECKING:
    from flexsparse.kernels.decode import DecodeStep


GROWTH_STEPS = 16
"""Capacities a buffer grows through per power of two (see :func:`grown_capacity`)."""
GROWTH_MIN_STEP = 16
"""The smallest growth step in slots (and the multiple every grown capacity is)."""


def grown_capacity(tokens: int) -> int:
    """The capacity a buffer grows to for holding ``tokens``: the next multiple of ``max(16, 2^e / 32)`` slots,
    for ``2^(e-1) < tokens <= 2^e``, i.e. one of 16 steps per power of two. Past 256 tokens it exceeds ``tokens``
    by less than 1/16 (6.25%); a generation from ``n`` to ``2n`` tokens crosses at most 17 capacities."""
    tokens = as_int("tokens", tokens, minimum=1)
    step = max(GROWTH_MIN_STEP, (1 << (tokens - 1).bit_length()) // (2 * GROWTH_STEPS))
    return -(-tokens // step) * step


def ring_slot_of(positions: Tensor, sink: int, window: int) -> Tensor:
    """Ring slot of each position (any int tensor): ``p`` in the sink, ``sink + (p - sink) % window`` after."""
    return torch.where(positions < sink, positions, sink + torch.remainder(positions - sink, window))


def ring_slot_positions(counts: Tensor, sink: int, window: int, capacity: int, span: int) -> Tensor:
    """Position held by each ring slot once ``counts`` (int64 ``[B']``) real tokens were written, int32
    ``[B', capacity]``; ``span`` marks an empty slot. A window slot holds the latest position of its residue."""
    slot = torch.arange(capacity, device=counts.device)[None]
    last = counts[:, None] - 1
    in_sink = torch.where(slot < counts[:, None], slot, span)
    offset = slot - sink
    latest = sink + offset + torch.div(last - sink - offset, window, rounding_mode="floor") * window
    in_window = torch.where(last >= sink + offset, latest, span)
    return torch.where(slot < sink, in_sink, in_window).to(torch.int32)


class _Counts:
    """The int64 sequence ``0, 1, 2, ...`` on each device, shared by a cache's layers: a decode step's per-row
    constants (a slot, a length) are stride-0 views into it, so making them launches no kernel. Grows by doubling
    (8 bytes per token of the longest generation)."""

    def __init__(self) -> None:
        self._on: dict[torch.device, Tensor] = {}

    def constant(self, mask: ForwardMask, value: int) -> Tensor:
        """``value`` for every row: int64 ``[B]`` on the mask's device (a read-only view, made once per forward:
        shared by its layers)."""
        return mask.state.constant(value, lambda: self._view(mask, value))

    def _view(self, mask: ForwardMask, value: int) -> Tensor:
        table = self._on.get(mask.device)
        if table is None or value >= table.shape[0]:
            size = max(4096, 2 * value + 2, 0 if table is None else 2 * table.shape[0])
            table = self._on[mask.device] = torch.arange(size, dtype=torch.long, device=mask.device)
        return table.as_strided((mask.batch,), (0,), value)


def _per_row(mask: ForwardMask, values: Tensor) -> Tensor:
    """``[B']`` values (B' = 1 when shared by the batch) as ``[B]``."""
    return values if values.shape[0] == mask.batch else values.expand(mask.batch).contiguous()


class _HeadIndex:
    """Some heads of a ``[B, heads, ...]`` tensor: a slice when contiguous (a view), else an index tensor kept per
    device (indexing a CUDA tensor with a Python list copies the list to the device and syncs the host)."""

    def __init__(self, heads: Sequence[int]) -> None:
        heads = list(heads)
        self.slice = slice(heads[0], heads[-1] + 1) if heads == list(range(heads[0], heads[-1] + 1)) else None
        self.heads = heads
        self._on: dict[torch.device, Tensor] = {}

    def _tensor(self, device: torch.device) -> Tensor:
        found = self._on.get(device)
        if found is None:
            found = self._on[device] = torch.tensor(self.heads, dtype=torch.long, device=device)
        return found

    def pick(self, t: Tensor) -> Tensor:
        return t[:, self.slice] if self.slice is not None else t.index_select(1, self._tensor(t.device))

    def put(self, out: Tensor, values: Tensor) -> None:
        if self.slice is not None:
            out[:, self.slice] = values
        else:
            out.index_copy_(1, self._tensor(out.device), values)


class _GroupCache:
    """One group's buffers and how its heads attend (subclasses: every key, or a ring)."""

    def __init__(self, group: CacheGroup, group_size: int, counts: _Counts, max_length: int | None) -> None:
        self.group = group
        self.counts = counts
        self.max_length = max_length
        self.kv_index = _HeadIndex(group.kv_heads)
        self.q_index = _HeadIndex(group.q_heads(group_size))
        self.keys: Tensor | None = None
        self.values: Tensor | None = None

    def pick_q(self, q: Tensor) -> Tensor:
        return self.q_index.pick(q)

    def pick_kv(self, t: Tensor) -> Tensor:
        return self.kv_index.pick(t)

    @property
    def capacity(self) -> int:
        return 0 if self.keys is None else self.keys.shape[2]

    def memory_bytes(self) -> int:
        if self.keys is None:
            return 0
        return (self.keys.numel() + self.values.numel()) * self.keys.element_size()

    def used_bytes(self, tokens: int) -> int:
        """Bytes of the slots that hold one of ``tokens`` tokens (per sequence, padding included)."""
        if self.keys is None:
            return 0
        batch, heads, _, dim = self.keys.shape
        return 2 * batch * heads * min(tokens, self.capacity) * dim * self.keys.element_size()

    def _wanted(self, tokens: int, largest: int | None = None) -> int:
        """The capacity to allocate for ``tokens`` (at most ``largest``): the maximum length on the first
        allocation, when known; else, and past it, the growth grid."""
        if self.keys is None and self.max_length is not None:
            wanted = max(tokens, self.max_length)
        else:
            wanted = grown_capacity(tokens)
        return wanted if largest is None else min(largest, wanted)

    def _allocate(self, like: Tensor, capacity: int) -> None:
        shape = (like.shape[0], len(self.group.kv_heads), capacity, like.shape[3])
        keys = like.new_zeros(shape)
        values = like.new_zeros(shape)
        if self.keys is not None:  # growing: keep what is cached
            keys[:, :, : self.capacity] = self.keys
            values[:, :, : self.capacity] = self.values
        self.keys, self.values = keys, values

    def map_batch(self, fn) -> None:
        if self.keys is not None:
            self.keys, self.values = fn(self.keys), fn(self.values)

    def attend_ranges(self, q: Tensor, lo: Tensor, hi: Tensor, scale: float | None) -> Tensor:
        """One query per sequence against slots ``lo[b] <= slot < hi[b]`` (``[B]`` on the device), every one a key
        it attends (the group executor's ``decode_ranges``)."""
        return self.group.executor.decode_ranges(self.pick_q(q), self.keys, self.values, lo, hi, scale)

    def attend_filled(self, q: Tensor, filled: int, scale: float | None) -> Tensor:
        """One query per sequence against the first ``filled`` slots, every one a key it attends (the group
        executor's ``decode_prefix``)."""
        return self.group.executor.decode_prefix(self.pick_q(q), self.keys, self.values, filled, scale)

    def attend_visible(self, q: Tensor, filled: int, visible: tuple[Tensor, Tensor], scale: float | None) -> Tensor:
        """One query per sequence against the first ``filled`` slots, those marked in ``visible`` (from
        :func:`_visible`; the group executor's ``decode_masked``); a padding query's row is 0."""
        allowed, empty = visible
        return self.group.executor.decode_masked(self.pick_q(q), self.keys, self.values, filled, allowed, empty,
                                                 scale)


def _visible(mask: ForwardMask, kv_positions: Tensor) -> tuple[Tensor, Tensor]:
    """Which slots a one-token step's query may read: bool ``[B', S]`` (slot positions ``kv_positions`` int
    ``[B', S]`` at most the query's position; every slot a key the query's pattern attends), and bool ``[B', 1]``
    for queries that read none (padding: their row is 0; slot 0 stands in, so SDPA gives no NaN). Callers keep it
    in the forward's state (shared by its layers)."""
    allowed = kv_positions <= mask.table_positions().q  # [B', S] against [B', 1]
    empty = ~allowed.any(-1, keepdim=True)
    first = torch.arange(allowed.shape[-1], device=allowed.device) == 0
    return allowed | (empty & first), empty


def _left_ranges(mask: ForwardMask, tokens: int) -> Tensor:
    """First slot of each row's real tokens among ``tokens`` slots after a left-padded prompt, int64 ``[B]``
    (once per forward)."""
    return mask.state.left_ranges(tokens, lambda: tokens - _per_row(mask, mask.real_counts(tokens)))


class _EveryKey(_GroupCache):
    """Heads that keep every token: slot t holds token t."""

    def reserve(self, like: Tensor, tokens: int) -> None:
        """Room for ``tokens``: the maximum length on the first allocation when known, else the growth grid."""
        if tokens > self.capacity:
            self._allocate(like, self._wanted(tokens))

    def write(self, key: Tensor, value: Tensor, past: int) -> None:
        end = past + key.shape[2]
        self.keys[:, :, past:end] = self.pick_kv(key)
        self.values[:, :, past:end] = self.pick_kv(value)

    def attend_chunk(self, layer: SparseAttentionLayer, q: Tensor, mask: ForwardMask, tokens: int,
                     scale: float | None) -> Tensor:
        """Several new tokens against the ``tokens`` filled slots, in the heads' own patterns (the forward's
        positions: no empty slot, so the call is the one a forward without a cache makes for these heads)."""
        return layer.attention(self.pick_q(q), self.keys[:, :, :tokens], self.values[:, :, :tokens],
                               positions=mask.table_positions(), kv_heads=self.group.kv_heads, scale=scale)


class _AttendAll(_EveryKey):
    """"full" heads: a decode step attends every filled slot of a real token (no mask without padding or after a
    left-padded prompt; SDPA with a position mask otherwise)."""

    def step_group(self, mask: ForwardMask, past: int, layout: str) -> DecodeGroup:
        """The new token (position ``past``) goes to slot ``past``; it attends every real slot up to it: all of
        them without padding, a row's last ``real_b`` slots after a left-padded prompt."""
        tokens = past + 1
        if layout == "none":
            lo = self.counts.constant(mask, 0)
        else:
            lo = _left_ranges(mask, tokens)
        return DecodeGroup(self.keys, self.values, self.group.kv_heads[0], lo, self.counts.constant(mask, tokens),
                           self.counts.constant(mask, past))

    def attend(self, layer: SparseAttentionLayer, q: Tensor, key: Tensor, value: Tensor, mask: ForwardMask,
               past: int, scale: float | None, decode: str | None = None) -> Tensor:
        self.write(key, value, past)
        tokens = past + key.shape[2]
        if decode == "none":  # slots 0..past are the tokens, all attended
            return self.attend_filled(q, tokens, scale)
        if decode == "left":  # a row's real tokens are its last slots
            return self.attend_ranges(q, _left_ranges(mask, tokens), self.counts.constant(mask, tokens), scale)
        if key.shape[2] == 1:  # any padding: the slots of real tokens up to the query's position
            visible = mask.state.visible(("every key", tokens), lambda: _visible(mask, mask.table_positions().kv))
            return self.attend_visible(q, tokens, visible, scale)
        return self.attend_chunk(layer, q, mask, tokens, scale)


class _OwnDecode(_EveryKey):
    """Heads of one pattern whose executor decodes them itself (ESA's: its gather reads the new token's
    ``attn_length`` keys from the filled slots, the Triton kernel on CUDA, its PyTorch form elsewhere)."""

    def __init__(self, group: CacheGroup, group_size: int, counts: _Counts, max_length: int | None) -> None:
        super().__init__(group, group_size, counts, max_length)
        self._global_heads: tuple[int, ...] | None = None

    def attend(self, layer: SparseAttentionLayer, q: Tensor, key: Tensor, value: Tensor, mask: ForwardMask,
               past: int, scale: float | None, decode: str | None = None) -> Tensor:
        self.write(key, value, past)
        tokens = past + key.shape[2]
        if key.shape[2] > 1:
            return self.attend_chunk(layer, q, mask, tokens, scale)
        q_positions = key_slots = None
        if decode != "none":  # padding: query positions and the slot of each key position, shared by the layers
            table = mask.table_positions()
            q_positions = table.q
            key_slots = mask.state.cache_key_slots(tokens, lambda: table.key_slots()[:, :table.span].to(torch.int32))
        return self.group.executor.decode_step(self.pick_q(q), self.keys[:, :, :tokens], self.values[:, :, :tokens],
                                               self.group.pattern, self._layer_heads(layer), scale,
                                               q_positions=q_positions, key_slots=key_slots)

    def _layer_heads(self, layer: SparseAttentionLayer) -> tuple[int, ...]:
        """The group's KV heads in the layer's global numbering (a tensor-parallel rank's start added), once."""
        if self._global_heads is None:
            self._global_heads = tuple(layer.first_kv_head + head for head in self.group.kv_heads)
        return self._global_heads


class _FlexKeys(_EveryKey):
    """"keep" heads (other patterns): every call runs the layer's executors over the whole buffer, its empty slots
    masked by their positions; ``bucketed`` (under compiled flex): capacities on the flex buckets instead of the
    growth grid, so compiled flex runs the buffer without a copy (one compiled variant per bucket)."""

    def __init__(self, group: CacheGroup, group_size: int, counts: _Counts, max_length: int | None,
                 bucketed: bool, block_size: int) -> None:
        super().__init__(group, group_size, counts, max_length)
        self.bucketed, self.block_size = bucketed, block_size

    def reserve(self, like: Tensor, tokens: int) -> None:
        if tokens > self.capacity:
            wanted = self._wanted(tokens)
            self._allocate(like, kv_bucket(wanted, self.block_size) if self.bucketed else wanted)

    def attend(self, layer: SparseAttentionLayer, q: Tensor, key: Tensor, value: Tensor, mask: ForwardMask,
               past: int, scale: float | None, decode: str | None = None) -> Tensor:
        self.write(key, value, past)
        return layer.attention(self.pick_q(q), self.keys, self.values, positions=mask.positions_in(self.capacity),
                               kv_heads=self.group.kv_heads, scale=scale)


class _Ring(_GroupCache):
    """Token-exact SinkWindow heads: ``sink + window`` slots (fewer for a shorter generation)."""

    def __init__(self, group: CacheGroup, group_size: int, counts: _Counts, max_length: int | None) -> None:
        super().__init__(group, group_size, counts, max_length)
        window: SinkWindow = group.window
        self.sink, self.window = window.sink, window.window
        self.full_size = self.sink + self.window

    def reserve(self, like: Tensor, tokens: int) -> None:
        """Room for ``tokens``, at most ``sink + window`` slots. Below that the ring has not wrapped (slot p holds
        position p), so growing keeps the filled slots where they are."""
        if tokens <= self.capacity or self.capacity == self.full_size:
            return
        self._allocate(like, self._wanted(tokens, self.full_size))

    def _slot_positions(self, mask: ForwardMask, tokens: int) -> Tensor:
        sink, window, capacity = self.sink, self.window, self.capacity
        return mask.state.ring_positions(sink, window, capacity, tokens, lambda: ring_slot_positions(
            mask.real_counts(tokens), sink, window, capacity, mask.span))

    def rewrite(self, key: Tensor, value: Tensor, mask: ForwardMask, past: int) -> None:
        """Write the new tokens that stay into their slots (prefill and chunks; every slot is rewritten)."""
        span, q_len = mask.span, key.shape[2]
        after = self._slot_positions(mask, past + q_len).long()  # [B', R]
        new_positions = mask.new_positions()  # [B', q]
        ordered = torch.where(new_positions < span, new_positions, -1).cummax(-1).values
        rows = max(ordered.shape[0], after.shape[0])  # B' is 1 for tables shared by the batch (no padding)
        ordered, after = ordered.expand(rows, -1).contiguous(), after.expand(rows, -1)
        token = torch.searchsorted(ordered, after.contiguous()).clamp(max=q_len - 1)  # the new token at that position
        from_new = (after >= mask.real_counts(past)[:, None]) & (after < span)
        batch, heads, _, dim = self.keys.shape
        index = token[:, None, :, None].expand(batch, heads, self.capacity, dim)
        keep = from_new[:, None, :, None]
        self.keys = torch.where(keep, self.pick_kv(key).gather(2, index), self.keys)
        self.values = torch.where(keep, self.pick_kv(value).gather(2, index), self.values)

    def step_group(self, mask: ForwardMask, past: int, layout: str) -> DecodeGroup:
        """The new token goes to its ring slot (known on the host without padding, per row after a left-padded
        prompt); it attends a row's filled slots, the first ``min(real tokens, capacity)``."""
        tokens = past + 1
        if layout == "none":
            slot = self.counts.constant(mask, past if past < self.sink else
                                        self.sink + (past - self.sink) % self.window)
            filled = self.counts.constant(mask, min(tokens, self.capacity))
        else:
            counts = _per_row(mask, mask.real_counts(tokens))
            slot = mask.state.ring_step_slot(self.sink, self.window,
                                             lambda: ring_slot_of(counts - 1, self.sink, self.window))
            filled = mask.state.ring_filled(tokens, self.capacity, lambda: counts.clamp(max=self.capacity))
        return DecodeGroup(self.keys, self.values, self.group.kv_heads[0], self.counts.constant(mask, 0), filled, slot)

    def write_one(self, key: Tensor, value: Tensor, mask: ForwardMask, tokens: int, real: bool = False) -> None:
        """Decode: the new token into its slot (``real``: it is known to be a real token). A padding token goes
        to the next position's slot, whose key no query of this step reads (its query is padding) and the next
        real token overwrites."""
        def build() -> tuple[Tensor, Tensor]:
            new_real = 1 if real else (mask.new_positions()[:, 0] < mask.span).long()
            slot = ring_slot_of(_per_row(mask, mask.real_counts(tokens) - new_real), self.sink, self.window)
            return torch.arange(key.shape[0], device=key.device), slot

        rows, slot = mask.state.ring_write_slot(self.sink, self.window, build)  # every layer writes there
        self.keys[rows, :, slot] = self.pick_kv(key)[:, :, 0]
        self.values[rows, :, slot] = self.pick_kv(value)[:, :, 0]

    def attend(self, layer: SparseAttentionLayer, q: Tensor, key: Tensor, value: Tensor, mask: ForwardMask,
               past: int, scale: float | None, decode: str | None = None) -> Tensor:
        tokens = past + key.shape[2]
        if decode == "none":  # token t is position t: its slot is known on the host, the filled slots are a prefix
            slot = past if past < self.sink else self.sink + (past - self.sink) % self.window
            self.keys[:, :, slot] = self.pick_kv(key)[:, :, 0]
            self.values[:, :, slot] = self.pick_kv(value)[:, :, 0]
            return self.attend_filled(q, min(tokens, self.capacity), scale)
        if decode == "left":  # a row's ring holds its first min(real tokens, capacity) slots
            self.write_one(key, value, mask, tokens, real=True)
            filled = mask.state.ring_filled(tokens, self.capacity, lambda: _per_row(
                mask, mask.real_counts(tokens)).clamp(max=self.capacity))
            return self.attend_ranges(q, self.counts.constant(mask, 0), filled, scale)
        if key.shape[2] == 1:  # decode: write, then attend every filled slot (they are the pattern's keys)
            self.write_one(key, value, mask, tokens)
            visible = mask.state.visible(("ring", self.sink, self.window, self.capacity, tokens),
                                         lambda: _visible(mask, self._slot_positions(mask, tokens)))
            return self.attend_visible(q, self.capacity, visible, scale)
        # a chunk: the ring as it was and the new tokens, in the heads' own pattern, then the ring is rewritten
        q_group, table = self.pick_q(q), mask.table_positions()
        before = self._slot_positions(mask, past)
        positions = Positions(table.q, torch.cat([before, mask.new_positions().int()], 1), mask.span)
        keys = torch.cat([self.keys, self.pick_kv(key)], 2)
        values = torch.cat([self.values, self.pick_kv(value)], 2)
        out = layer.attention(q_group, keys, values, positions=positions, kv_heads=self.group.kv_heads, scale=scale)
        self.rewrite(key, value, mask, past)
        return out


class DeviceSteps:
    """A :class:`SparseKVCache`'s decode-step state on the device, shared by its layers (its device-step mode, see
    :meth:`SparseKVCache.start_device_steps`).

    Counters, int64 on the cache's device: ``tokens`` ``[1]``, the slots each row filled before the next step
    (padding included); ``real`` ``[B]``, the real tokens of each row among them; ``next_positions`` ``[B, 1]``,
    the next step's position ids. :meth:`begin_step` computes a step's static buffers from them -- the model's
    ``position_ids`` ``[B, 1]`` and ``cache_position`` ``[1]``, each group's lo/hi/slot ``[B]`` -- and advances
    them by one token, all on the device: a recorded step reads and advances the same tensors at every replay.
    """

    def __init__(self, tokens: int, real: Tensor, positions: Tensor, rings: set[tuple[int, int, int]]) -> None:
        device, batch = real.device, real.shape[0]
        self.tokens = torch.full((1,), tokens, dtype=torch.long, device=device)
        self.real = real.to(torch.long).clone()
        self.next_positions = positions.to(device, torch.long).contiguous().clone()
        self.position_ids = self.next_positions.clone()
        self.cache_position = self.tokens.clone()
        self.ring_params = sorted(rings)  # (sink, window, capacity) per ring shape
        self._every = torch.zeros(3, batch, dtype=torch.long, device=device)  # lo, hi, slot of "full" groups
        self._rings = torch.zeros(max(1, len(self.ring_params)), 3, batch, dtype=torch.long, device=device)
        self._ring_index = {key: r for r, key in enumerate(self.ring_params)}
        self._launch = None
        if kernels_preferred_on(device):  # one launch instead of a dozen tiny ops (flexsparse.kernels.decode_steps)
            from flexsparse.kernels.decode_steps import step_bounds_launch  # triton: imported where it runs

            self._launch = step_bounds_launch(batch, len(self.ring_params))
            self._ring_table = torch.tensor(self.ring_params or [(0, 1, 0)], dtype=torch.long, device=device)

    def begin_step(self) -> None:
        """This step's buffers from the counters, then the counters one token on (device work only: no host int
        enters a tensor, no sync): one kernel on CUDA, PyTorch ops elsewhere."""
        if self._launch is not None:
            self._launch(self.tokens, self.real, self.next_positions, self._every, self._rings, self._ring_table,
                         self.position_ids, self.cache_position)
            return
        self.step_with_torch()

    def step_with_torch(self) -> None:
        """:meth:`begin_step` as PyTorch ops (the path off CUDA; the kernel's reference)."""
        lo, hi, slot = self._every
        torch.sub(self.tokens, self.real, out=lo)  # a row's real tokens are its last slots (every slot: "none")
        hi.copy_(self.tokens + 1)
        slot.copy_(self.tokens)
        for r, (sink, window, capacity) in enumerate(self.ring_params):  # ring lo stays 0
            torch.clamp(self.real + 1, max=capacity, out=self._rings[r, 1])
            self._rings[r, 2].copy_(ring_slot_of(self.real, sink, window))  # the new token is real token `real`
        self.position_ids.copy_(self.next_positions)
        self.cache_position.copy_(self.tokens)
        self.tokens += 1
        self.real += 1
        self.next_positions += 1

    def group(self, group: _GroupCache) -> DecodeGroup:
        """The step's :class:`DecodeGroup` of one group's buffers (its bounds: static buffers of this state)."""
        if isinstance(group, _Ring):
            bounds = self._rings[self._ring_index[(group.sink, group.window, group.capacity)]]
        else:
            bounds = self._every
        return DecodeGroup(group.keys, group.values, group.group.kv_heads[0], *bounds.unbind(0))


class SparseKVLayer(CacheLayerMixin):
    """One layer of a :class:`SparseKVCache`: its head groups' buffers."""

    is_compileable = False
    is_croppable = False
    is_sliding = False

    def __init__(self, layer: SparseAttentionLayer, max_length: int | None = None,
                 one_launch_decode: bool | None = None, counts: _Counts | None = None) -> None:
        super().__init__()
        self.layer = layer
        self.max_length = max_length
        counts = _Counts() if counts is None else counts
        self.tokens = 0
        self.layout = "none"  # padding of the tokens so far: "none", "left" (a left-padded prompt) or "other"
        options = layer.options
        compiled = options["backend"] in ("auto", "flex")
        self.groups: list[_GroupCache] = []
        for group in layer.groups:
            if group.kind == "keep":
                self.groups.append(_FlexKeys(group, layer.group_size, counts, max_length, compiled,
                                             options["block_size"]))
            else:
                buffers = {"ring": _Ring, "full": _AttendAll}.get(group.kind, _OwnDecode)
                self.groups.append(buffers(group, layer.group_size, counts, max_length))
        ranges = [group.q_index.slice for group in self.groups]
        self.heads_in_order = all(r is not None for r in ranges) and all(
            a.stop == b.start for a, b in zip(ranges, ranges[1:]))
        fits_kernel = layer.attention.head_dim <= MAX_HEAD_DIM and len(self.groups) <= 2 and all(
            group.group.kind in ("full", "ring") and group.kv_index.slice is not None for group in self.groups)
        self._decode_step: DecodeStep | None = None  # the one-launch step prepared for the current buffers
        self.device_steps: DeviceSteps | None = None  # set while the cache runs device-side steps
        self.one_launch_decode = one_launch_decode if fits_kernel else False
        """Whether a decode step runs as one kernel call: None on CUDA, True where the kernels run, False never
        (False also when the layer does not fit the kernel: more than two full or ring groups of consecutive heads,
        or a head dim it does not take)."""

    def lazy_initialization(self, key_states: Tensor, value_states: Tensor) -> None:
        self.batch, self.dtype, self.device = key_states.shape[0], key_states.dtype, key_states.device
        self.is_initialized = True

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs) -> tuple[Tensor, Tensor]:
        """Record new keys/values ``[B, H_kv, q, d]`` for the attention function, which writes them into the
        groups and attends; returns them unchanged."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if not self.layer.attached:
            raise ValueError(f"{self.layer.where}: this cache was built for an earlier conversion of the model "
                             "(convert or revert ran since); start a new cache")
        if key_states.shape[0] != self.batch or key_states.dtype != self.dtype:
            raise ValueError(f"{self.layer.where}: the sparse KV cache holds batch {self.batch} {self.dtype}, got keys "
                             f"of batch {key_states.shape[0]} {key_states.dtype}")
        if key_states.shape[1] != self.layer.attention.num_kv_heads:
            raise ValueError(f"{self.layer.where}: keys have {key_states.shape[1]} heads, the layer has "
                             f"{self.layer.attention.num_kv_heads} KV heads")
        if self.device_steps is not None and self.tokens + key_states.shape[2] > self.room():
            raise ValueError(f"{self.layer.where}: the sparse KV cache's buffers hold {self.room()} tokens, a "
                             f"device-side step would cache token {self.tokens + key_states.shape[2]} (its static "
                             "buffers cannot grow); size the cache with a larger max_length")
        self.layer.stage(self, key_states, value_states)
        self.tokens += key_states.shape[2]
        for group in self.groups:
            group.reserve(key_states, self.tokens)
        return key_states, value_states

    def attend(self, q: Tensor, key: Tensor, value: Tensor, mask: ForwardMask | None, scale: float | None) -> Tensor:
        """Attention output ``[B, H, q, d]`` of the staged update: every group as one call."""
        layer, q_len = self.layer, q.shape[2]
        past = self.tokens - q_len
        if mask is None:
            mask = ForwardMask(None, q.shape[0], q_len, self.tokens, q.device)
        if (mask.q_len, mask.kv_len) != (q_len, self.tokens):
            raise ValueError(f"layer {layer.layer_idx}: the mask covers {mask.q_len} queries of {mask.kv_len} "
                             f"tokens, the cache has {q_len} new of {self.tokens}")
        if self.device_steps is not None:
            if q_len != 1:
                raise ValueError(f"{layer.where}: the sparse KV cache runs device-side steps of one token, got "
                                 f"{q_len}; call stop_device_steps() before other forwards")
            return self._one_launch(q, key, value, [self.device_steps.group(group) for group in self.groups], scale)
        if past == 0:  # prefill: every head over the prompt, then the groups keep what they need
            out = layer.attention(q, key, value, positions=mask.positions(), scale=scale)
            self.layout = mask.padding_layout()  # kept with positions(): no extra sync
            for group in self.groups:
                group.write(key, value, 0) if isinstance(group, _EveryKey) else group.rewrite(key, value, mask, 0)
            return out
        # Decode reads slot ranges without masks while the padding so far is "none" or "left" (see the module
        # docstring); padding among new tokens sends this and later steps to the position masks.
        if self.layout != "other" and mask.new_tokens_padded():
            self.layout = "other"
        decode = self.layout if q_len == 1 and self.layout != "other" else None
        if decode is not None and self._one_launch_on(q.device):
            return self._one_launch(q, key, value, [group.step_group(mask, past, decode) for group in self.groups],
                                    scale)
        results = [group.attend(layer, q, key, value, mask, past, scale, decode) for group in self.groups]
        if len(results) == 1:
            return results[0]
        if self.heads_in_order:  # the groups' query heads are consecutive ranges, in order: one copy
            return torch.cat(results, 1)
        out = q.new_empty(q.shape)
        for group, result in zip(self.groups, results):
            group.q_index.put(out, result)
        return out

    def _one_launch(self, q: Tensor, key: Tensor, value: Tensor, groups: list[DecodeGroup],
                    scale: float | None) -> Tensor:
        """The step as one :class:`~flexsparse.kernels.decode.DecodeStep` call (prepared again when the buffers or
        the bounds' layout change)."""
        step = self._decode_step
        if step is None or not step.accepts(q, key, value, groups, scale):
            from flexsparse.kernels.decode import DecodeStep  # triton: imported where it runs

            step = self._decode_step = DecodeStep(q, key, value, groups, scale)
        return step(q, key, value, groups)

    def room(self) -> int | float:
        """The most tokens the buffers hold without growing (inf: a full ring, which never grows)."""
        return min((group.capacity for group in self.groups
                    if not (isinstance(group, _Ring) and group.capacity == group.full_size)), default=float("inf"))

    def device_steps_refusal(self) -> str | None:
        """Why this layer cannot run device-side steps (None: it can): they need a prefilled cache, at most two
        groups of full or sink + window heads, consecutive, on the one-launch step, and no padding but a
        left-padded prompt."""
        kinds = sorted({group.group.kind for group in self.groups} - {"full", "ring"})
        if kinds:
            return (f"its {', '.join(map(repr, kinds))} heads decode through their own executors; device-side "
                    "steps take full and token-exact SinkWindow heads only")
        if not self.is_initialized or self.tokens == 0 or any(group.keys is None for group in self.groups):
            return "the cache holds no prompt yet (device-side steps follow a prefill)"
        if not self._one_launch_on(self.device):
            return (f"its decode steps do not run as one kernel call on {self.device} (they need CUDA or the "
                    "Triton interpreter with one_launch_decode not False, at most two groups of consecutive heads "
                    f"and a head dim up to {MAX_HEAD_DIM})")
        if self.layout == "other":
            return ("the cache holds padding other than a left-padded prompt (a right-padded prompt or padding "
                    "after it), which decodes through position masks")
        return None

    def _one_launch_on(self, device: torch.device) -> bool:
        """Whether this layer's decode steps on ``device`` run as one kernel call (see ``one_launch_decode``)."""
        if self.one_launch_decode is None:
            return kernels_preferred_on(device)
        return self.one_launch_decode and kernels_run_on(device)

    # ----- transformers' Cache protocol ---------------------------------------------------------------------

    def get_seq_length(self) -> int:
        return self.tokens

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.tokens + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def memory_bytes(self) -> int:
        return sum(group.memory_bytes() for group in self.groups)

    def used_bytes(self) -> int:
        """Bytes of the slots that hold a token."""
        return sum(group.used_bytes(self.tokens) for group in self.groups)

    def reset(self) -> None:
        self.tokens = 0
        self.layout = "none"
        self._decode_step = None
        self.device_steps = None
        for group in self.groups:
            group.keys = group.values = None

    def _check_buffers_stay(self, what: str) -> None:
        if self.device_steps is not None:
            raise ValueError(f"{self.layer.where}: {what} replaces the sparse KV cache's buffers, which its "
                             "device-side steps (a captured decode graph) hold; call stop_device_steps() first")

    def reorder_cache(self, beam_idx: Tensor) -> None:
        self._check_buffers_stay("reorder_cache (beam search)")
        for group in self.groups:
            group.map_batch(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._check_buffers_stay("batch_repeat_interleave")
        self.batch *= repeats
        for group in self.groups:
            group.map_batch(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: Tensor) -> None:
        self._check_buffers_stay("batch_select_indices")
        for group in self.groups:
            group.map_batch(lambda t: t[indices])
        self.batch = next((g.keys.shape[0] for g in self.groups if g.keys is not None), self.batch)

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("flexsparse's sparse KV cache cannot be cropped (its ring buffers drop old keys); "
                                  "use a DynamicCache for assisted decoding")


class SparseKVCache(Cache):
    """The sparse KV cache of a converted model. A converted model's ``generate()`` builds one by itself
    (:func:`~flexsparse.integrations.transformers.sparse_generate_cache`); to pass one, give it as generate()'s or
    the model's cache argument (``past_key_values=``, ``cache=`` from transformers 5.24:
    :func:`~flexsparse.integrations.transformers.cache_argument`). ``max_length``: the most tokens the cache will
    hold, if known (sizes buffers).
    ``one_launch_decode``: decode full and sink+window heads with one kernel call per layer and step (see the
    module docstring): None (default) on CUDA, True also under the Triton interpreter, False never."""

    def __init__(self, model: torch.nn.Module, max_length: int | None = None,
                 one_launch_decode: bool | None = None) -> None:
        layers = sparse_layers(model)
        if not layers:
            raise ValueError("SparseKVCache needs a model converted with flexsparse.convert")
        routed = [layer.layer_idx for layer in layers if layer.router is not None]
        if routed:
            raise ValueError(f"SparseKVCache cannot serve routed layers {routed}: their modes are chosen per "
                             "sequence, so every head needs every key; use a DynamicCache (generate() picks one "
                             "by itself)")
        max_length = None if max_length is None else as_int("max_length", max_length, minimum=1)
        if one_launch_decode is not None and not isinstance(one_launch_decode, bool):
            raise TypeError(f"one_launch_decode must be a bool or None, got {type(one_launch_decode).__name__}")
        counts = _Counts()  # shared by the layers
        super().__init__(layers=[SparseKVLayer(layer, max_length, one_launch_decode, counts) for layer in layers])

    def update(self, key_states: Tensor, value_states: Tensor, layer_idx: int, *args, **kwargs):
        return self.layers[layer_idx].update(key_states, value_states)

    def start_device_steps(self, attention_mask: Tensor | None = None,
                           position_ids: Tensor | None = None) -> DeviceSteps:
        """Run the following one-token steps from device-side state (for CUDA graphs,
        :mod:`~flexsparse.integrations.graph_decode`); returns it, a :class:`DeviceSteps` shared by the layers.

        Each step then calls :meth:`DeviceSteps.begin_step` before the model's forward, gives the model its
        ``position_ids`` (and ``cache_position``), and every layer's step reads its groups' bounds from it; the
        forward's mask is not read (pass ``attention_mask=None``: every new token is real, as in generate()).
        ``attention_mask``: the 2-D padding mask ``[B, >= tokens]`` of the cached tokens (needed after a
        left-padded prompt; None: no padding). ``position_ids``: the next step's, ``[B, 1]`` (generate()'s;
        None: the cache length, the model's own default); later steps count on by one. Host-side state (each
        layer's ``tokens``) still advances per step: by the forward, or by :meth:`replayed_step` for a step that
        ran without Python. ValueError naming the layer and why when a layer cannot (ESA or other heads with
        their own decode, a routed layer, padding other than a left-padded prompt, no prompt cached, no one-launch
        step on the device); :meth:`stop_device_steps` returns to the host-driven steps.
        """
        layers: list[SparseKVLayer] = self.layers
        for layer in layers:
            reason = layer.device_steps_refusal()
            if reason is not None:
                raise ValueError(f"{layer.layer.where} cannot run device-side decode steps: {reason}")
        tokens = {layer.tokens for layer in layers}
        if len(tokens) != 1:
            raise ValueError(f"the cache's layers hold different token counts {sorted(tokens)}; device-side steps "
                             "start between forwards")
        (tokens,) = tokens
        first = layers[0]
        batch, device = first.batch, first.device
        if attention_mask is None:
            if any(layer.layout != "none" for layer in layers):
                raise ValueError("the cache holds a left-padded prompt: start_device_steps needs its attention_mask "
                                 f"[{batch}, >= {tokens}]")
            real = torch.full((batch,), tokens, dtype=torch.long, device=device)
        else:
            if not isinstance(attention_mask, Tensor) or attention_mask.dim() != 2 or \
                    attention_mask.shape[0] != batch or attention_mask.shape[1] < tokens:
                raise ValueError(f"attention_mask must be a 2-D tensor [{batch}, >= {tokens}] (the cached tokens' "
                                 f"padding mask), got {getattr(attention_mask, 'shape', type(attention_mask).__name__)}")
            real = attention_mask[:, :tokens].to(device=device, dtype=torch.bool).sum(-1)
        if position_ids is None:
            positions = torch.full((batch, 1), tokens, dtype=torch.long, device=device)
        elif not isinstance(position_ids, Tensor) or position_ids.dim() != 2 or \
                position_ids.shape[0] not in (1, batch) or position_ids.shape[1] != 1:
            raise ValueError(f"position_ids must be a tensor [{batch}, 1] (the next step's), got "
                             f"{getattr(position_ids, 'shape', type(position_ids).__name__)}")
        else:
            positions = position_ids.expand(batch, 1)
        rings = {(group.sink, group.window, group.capacity) for layer in layers for group in layer.groups
                 if isinstance(group, _Ring)}
        steps = DeviceSteps(tokens, real, positions, rings)
        for layer in layers:
            layer.device_steps = steps
        return steps

    def stop_device_steps(self) -> None:
        """Back to host-driven decode steps (the host-side state is current: every step advanced it)."""
        for layer in self.layers:
            layer.device_steps = None

    def replayed_step(self) -> None:
        """Record one one-token step that ran without Python (a CUDA graph's replay): every layer's token count
        advances by one, as the step's forward would have advanced it."""
        for layer in self.layers:
            layer.tokens += 1

    def room(self) -> int | float:
        """The most tokens per row the buffers hold without growing (the least of the layers')."""
        return min((layer.room() for layer in self.layers), default=float("inf"))

    def memory_bytes(self) -> int:
        """Bytes held by every layer's key and value buffers (allocated capacity)."""
        return sum(layer.memory_bytes() for layer in self.layers)

    def memory_report(self) -> KVMemoryReport:
        """The allocated bytes beside the bytes of the tokens held (see :class:`KVMemoryReport`)."""
        return KVMemoryReport(tokens=max((layer.tokens for layer in self.layers), default=0),
                              used_bytes=sum(layer.used_bytes() for layer in self.layers),
                              allocated_bytes=self.memory_bytes())


@dataclass(frozen=True)
class KVMemoryReport:
    """What a :class:`SparseKVCache` holds. ``tokens``: tokens per sequence cached (padding included, as a
    DynamicCache counts them); ``used_bytes``: bytes of the buffer slots that hold one of them (every token of
    every-key heads, ``min(tokens, sink + window)`` of ring heads: :func:`kv_memory_formula` at ``tokens``);
    ``allocated_bytes``: the buffers' bytes (:meth:`SparseKVCache.memory_bytes`), the room for later tokens
    included."""

    tokens: int
    used_bytes: int
    allocated_bytes: int

    @property
    def overhead(self) -> float:
        """Allocated bytes beyond the used ones, as a fraction of the used ones (0.05: 5% more; 0 when empty)."""
        return self.allocated_bytes / self.used_bytes - 1 if self.used_bytes else 0.0


def kv_memory_formula(model: torch.nn.Module, batch: int, length: int, dtype: torch.dtype) -> int:
    """KV bytes a converted model's cache needs for ``batch`` sequences of ``length`` tokens: per layer
    ``2 B d bytes (H_every S + sum over rings H_ring min(S, sink + window))`` (the issue's formula), where every
    head that is not a token-exact SinkWindow keeps all ``S`` tokens. A :class:`SparseKVCache` allocates exactly
    this when ``S`` is its known maximum length (generate()'s), and at most 1/16 more past 256 tokens without one
    (the growth grid), except "keep" heads under compiled flex (flex buckets; see the module docstring)."""
    layers = sparse_layers(model)
    if not layers:
        raise ValueError("kv_memory_formula needs a model converted with flexsparse.convert")
    itemsize = torch.empty((), dtype=dtype).element_size()
    total = 0
    for layer in layers:
        kept = 0
        for group in layer.groups:
            window = group.window
            kept += len(group.kv_heads) * (min(length, window.sink + window.window) if window else length)
        total += 2 * batch * layer.attention.head_dim * itemsize * kept
    return total
