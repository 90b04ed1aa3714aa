"""flexsparse's sparse KV cache as a transformers ``Cache``: per layer and head group, a store that keeps only
the keys its heads' patterns can attend (:mod:`flexsparse.cache`), and decode steps as executor calls
(:mod:`flexsparse.runtime.decode`).

Per layer the KV heads are grouped by :func:`~flexsparse.integrations.layer.cache_groups`: each group is one store
(every key, or a sink + window ring) and one decoder. A forward goes:

* ``update`` (transformers calls it before the attention function): the new keys and values are recorded for the
  attention function, and the stores make room for them;
* the attention function (which alone receives the forward's padding) calls :meth:`SparseKVLayer.attend`:

  - a prefill runs the layer's plan over the prompt, then each store keeps what it needs;
  - a one-token step builds each store's :class:`~flexsparse.cache.views.StepView` (shared by the forward's
    layers) and runs the executors :func:`~flexsparse.runtime.decode.plan_decode` chooses: one fused launch that
    writes and attends (on CUDA), or each group's decoder after the store took the new token (SDPA for stores
    read whole, ESA's gather); heads no executor decodes run the layer's plan over their whole store;
  - a chunk of several tokens runs the layer's plan over each store and the new tokens.

Capacities: with a known maximum length (``generate()`` passes its own; ``SparseKVCache(model, max_length=...)``)
a store's first allocation holds it exactly (a ring: at most ``sink + window``); without one, and past it, stores
grow on a grid of 16 steps per power of two (:func:`~flexsparse.cache.capacity.grown_capacity`), and stores the
plan reads under compiled flex on its buckets (one compiled variant per bucket). Memory per layer with no such
stores is ``2 B d bytes (H_every S + H_ring min(S, sink + window))`` exactly (:func:`kv_memory_formula`), and an
all-full model's cache has the size of a DynamicCache.

Device-side steps (for CUDA graphs, :mod:`flexsparse.integrations.graph_decode`): after
:meth:`SparseKVCache.start_device_steps`, one-token steps read each store's bounds from a
:class:`~flexsparse.cache.device_steps.DeviceSteps` computed on the device: a recorded step serves step after step.

Decoding uses the modes the cache was built with (converting again invalidates the cache). Routed layers choose
modes per sequence, so every head needs every key: the cache refuses them (``generate()`` keeps a DynamicCache).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch
from torch import Tensor
from transformers.cache_utils import Cache, CacheLayerMixin

from flexsparse.cache import (DeviceSteps, HeadIndex, KVStore, PaddingLayout, RingStore, StepView, StepViews, StoreKind,
                              make_store)
from flexsparse.integrations.forward_mask import ForwardMask
from flexsparse.integrations.layer import SparseAttentionLayer, sparse_layers
from flexsparse.masks import Positions
from flexsparse.runtime.buckets import kv_bucket
from flexsparse.runtime.decode import DecodeCall, DecodePlan, GroupStep, assemble_heads, plan_decode
from flexsparse.validation import as_int

_COMPILED_BACKENDS = ("auto", "flex")  # backends whose plans run compiled flex over a whole store


class SparseKVLayer(CacheLayerMixin):
    """One layer of a :class:`SparseKVCache`: its head groups' stores, and its steps through the executors."""

    is_compileable = False
    is_croppable = False
    is_sliding = False

    def __init__(self, layer: SparseAttentionLayer, max_length: int | None = None,
                 one_launch_decode: bool | None = None, views: StepViews | None = None) -> None:
        super().__init__()
        self.layer = layer
        self.max_length = max_length
        self.one_launch_decode = one_launch_decode
        """None: one fused launch per step where the kernels are preferred (CUDA); True: wherever they run (the
        Triton interpreter too); False: never."""
        self.views = StepViews() if views is None else views
        self.tokens = 0
        self.layout = PaddingLayout.NONE  # of the tokens so far (read at prefill; padding later makes it OTHER)
        bucket = None
        if layer.options["backend"] in _COMPILED_BACKENDS:
            bucket = partial(kv_bucket, block_size=layer.options["block_size"])
        self.groups = layer.groups
        self.stores: list[KVStore] = [make_store(group.pattern, group.kv_heads, max_length,
                                                 bucket if group.decoder is None else None) for group in self.groups]
        self.q_heads = [HeadIndex(group.q_heads(layer.group_size)) for group in self.groups]
        ranges = [heads.slice for heads in self.q_heads]
        self.heads_in_order = all(r is not None for r in ranges) and all(
            a.stop == b.start for a, b in zip(ranges, ranges[1:]))
        self._parts = [(heads, store, group.pattern, tuple(layer.first_kv_head + h for h in group.kv_heads))
                       for heads, store, group in zip(self.q_heads, self.stores, self.groups)]
        self.device_steps: DeviceSteps | None = None  # set while the cache runs device-side steps
        self._fused = next((e for e in layer.attention.executors if e.fuses_decode), None)
        self._plans: dict[tuple, DecodePlan] = {}

    def lazy_initialization(self, key_states: Tensor, value_states: Tensor) -> None:
        self.batch, self.dtype, self.device = key_states.shape[0], key_states.dtype, key_states.device
        self.is_initialized = True

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs) -> tuple[Tensor, Tensor]:
        """Record new keys/values ``[B, H_kv, q, d]`` for the attention function, which writes them into the
        stores where the forward's padding puts them and attends; the stores make room now. Returns them."""
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
        for store in self.stores:
            store.reserve(key_states, self.tokens)
        return key_states, value_states

    def attend(self, q: Tensor, key: Tensor, value: Tensor, mask: ForwardMask | None, scale: float | None) -> Tensor:
        """Attention output ``[B, H, q, d]`` of the recorded update (``mask``: the forward's padding)."""
        layer, q_len = self.layer, q.shape[2]
        past = self.tokens - q_len
        if mask is None:
            mask = ForwardMask(None, q.shape[0], q_len, self.tokens, q.device)
        if (mask.q_len, mask.kv_len) != (q_len, self.tokens):
            raise ValueError(f"layer {layer.layer_idx}: the mask covers {mask.q_len} queries of {mask.kv_len} "
                             f"tokens, the cache has {q_len} new of {self.tokens}")
        if self.device_steps is not None:
            return self._device_step(q, key, value, scale)
        if past == 0:
            return self._prefill(q, key, value, mask, scale)
        if self.layout is not PaddingLayout.OTHER and mask.new_tokens_padded():
            self.layout = PaddingLayout.OTHER  # padding among new tokens: position masks from now on
        views = self.views.for_forward(mask, self.layout)
        if q_len == 1:
            return self._step(q, key, value, mask, views, past, scale)
        results = [self._chunk(index, q, key, value, mask, views, past, scale) for index in range(len(self.stores))]
        return assemble_heads(results, self.q_heads, self.heads_in_order, q.shape[1])

    def _prefill(self, q: Tensor, key: Tensor, value: Tensor, mask: ForwardMask, scale: float | None) -> Tensor:
        """Every head over the prompt (the layer's plan), then each store keeps what it needs."""
        out = self.layer.attention(q, key, value, positions=mask.positions(), scale=scale)
        self.layout = PaddingLayout(mask.padding_layout())  # read with positions(): no extra sync
        views = self.views.for_forward(mask, self.layout)
        for store in self.stores:
            if isinstance(store, RingStore):
                store.rewrite(key, value, views.ring_positions(store, q.shape[2]), mask.new_positions(),
                              mask.real_counts(0), mask.span)
            else:
                store.write(key, value, 0)
        return out

    def _step(self, q: Tensor, key: Tensor, value: Tensor, mask: ForwardMask, views: StepViews, past: int,
              scale: float | None) -> Tensor:
        """A one-token step: each store's view, then the executors the decode plan names."""
        call = self._call_with_views(q, key, value, scale, [views.step(store, past) for store in self.stores])
        plan = self._plan(call)
        if plan.fused is not None:
            return plan.fused.decode(call)
        results = []
        for index, (decoder, group) in enumerate(zip(plan.per_group, call.groups)):
            if decoder is None or not decoder.writes_new_token:
                _write_step(group.store, group.view, key, value)
            if decoder is None:  # no executor decodes these heads: the layer's plan over the whole store
                results.append(self._plan_over_store(index, q, mask, scale))
            else:
                results.append(decoder.decode(call.only(index)))
        return assemble_heads(results, self.q_heads, self.heads_in_order, q.shape[1])

    def _plan(self, call: DecodeCall) -> DecodePlan:
        """The decode plan of a step like ``call`` (kept per layout, batch and length octave: the executors' decode
        costs are all linear in the slots read)."""
        key = (self.layout, self.batch, self.tokens.bit_length())  # one device and dtype per cache
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plans[key] = plan_decode(self.layer.attention.executors, call)
        return plan

    def _plan_over_store(self, index: int, q: Tensor, mask: ForwardMask, scale: float | None) -> Tensor:
        """The group's query heads over its whole store (empty slots masked by their positions)."""
        store = self.stores[index]
        return self.layer.attention(self.q_heads[index].pick(q), store.keys, store.values,
                                    positions=mask.positions_in(store.capacity),
                                    kv_heads=self.groups[index].kv_heads, scale=scale)

    def _chunk(self, index: int, q: Tensor, key: Tensor, value: Tensor, mask: ForwardMask, views: StepViews,
               past: int, scale: float | None) -> Tensor:
        """Several new tokens: the group's heads in their own patterns over the store and the new tokens."""
        store, group, q_group = self.stores[index], self.groups[index], self.q_heads[index].pick(q)
        if not isinstance(store, RingStore):
            store.write(key, value, past)
            if group.decoder is None:
                return self._plan_over_store(index, q, mask, scale)
            tokens = past + key.shape[2]  # the forward's own positions: no empty slot
            return self.layer.attention(q_group, store.keys[:, :, :tokens], store.values[:, :, :tokens],
                                        positions=mask.table_positions(), kv_heads=group.kv_heads, scale=scale)
        # the ring as it was and the new tokens, in the heads' own pattern, then the ring is rewritten
        table = mask.table_positions()
        positions = Positions(table.q, torch.cat([views.ring_positions(store, past), mask.new_positions().int()], 1),
                              mask.span)
        keys = torch.cat([store.keys, store.heads.pick(key)], 2)
        values = torch.cat([store.values, store.heads.pick(value)], 2)
        out = self.layer.attention(q_group, keys, values, positions=positions, kv_heads=group.kv_heads, scale=scale)
        store.rewrite(key, value, views.ring_positions(store, past + key.shape[2]), mask.new_positions(),
                      mask.real_counts(past), mask.span)
        return out

    def _device_step(self, q: Tensor, key: Tensor, value: Tensor, scale: float | None) -> Tensor:
        """A one-token step whose bounds the device computed (the fused executor: the refusal checked it)."""
        if q.shape[2] != 1:
            raise ValueError(f"{self.layer.where}: the sparse KV cache runs device-side steps of one token, got "
                             f"{q.shape[2]}; call stop_device_steps() before other forwards")
        return self._fused.decode(self._call_with_views(q, key, value, scale, [
            self.device_steps.view(store) for store in self.stores]))

    def _call_with_views(self, q: Tensor, key: Tensor, value: Tensor, scale: float | None,
                         views: list[StepView]) -> DecodeCall:
        return DecodeCall(q, key, value, tuple(GroupStep(heads, store, view, pattern, layer_heads)
                                               for (heads, store, pattern, layer_heads), view in zip(self._parts, views)),
                          scale, self.one_launch_decode)

    def room(self) -> int | float:
        """The most tokens the stores hold without growing (inf: full rings only, which never grow)."""
        return min((store.capacity for store in self.stores if store.capacity != store.fixed_size),
                   default=float("inf"))

    def device_steps_refusal(self) -> str | None:
        """Why this layer cannot run device-side steps (None: it can): they need a prefilled cache, a fused decode
        executor that takes the layer's step, and no padding but a left-padded prompt."""
        if not self.is_initialized or self.tokens == 0 or any(store.keys is None for store in self.stores):
            return "the cache holds no prompt yet (device-side steps follow a prefill)"
        if self.layout is PaddingLayout.OTHER:
            return ("the cache holds padding other than a left-padded prompt (a right-padded prompt or padding "
                    "after it), which decodes through position masks")
        fused = self._fused
        probe_views = []
        for store in self.stores:
            zeros = torch.zeros(self.batch, dtype=torch.long, device=self.device)
            probe_views.append(StepView(store.capacity, zeros, zeros, zeros))
        q = torch.empty(self.batch, self.layer.attention.num_heads, 1, self.layer.attention.head_dim,
                        dtype=self.dtype, device=self.device)
        kv = q[:, :self.layer.attention.num_kv_heads]
        if fused is None or not fused.accepts_decode(self._call_with_views(q, kv, kv, None, probe_views)):
            return (f"no executor runs its decode step as one kernel call on {self.device}: that needs heads whose "
                    "decode reads every earlier key or a sink and window, in at most two groups of consecutive "
                    "heads, a head dim the decode kernel takes, and CUDA (or the Triton interpreter with "
                    "one_launch_decode=True)")
        return None

    # ----- transformers' Cache protocol ---------------------------------------------------------------------

    def get_seq_length(self) -> int:
        return self.tokens

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.tokens + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def memory_bytes(self) -> int:
        return sum(store.memory_bytes() for store in self.stores)

    def used_bytes(self) -> int:
        """Bytes of the slots that hold a token."""
        return sum(store.used_bytes(self.tokens) for store in self.stores)

    def reset(self) -> None:
        self.tokens = 0
        self.layout = PaddingLayout.NONE
        self.device_steps = None
        for store in self.stores:
            store.reset()

    def _check_buffers_stay(self, what: str) -> None:
        if self.device_steps is not None:
            raise ValueError(f"{self.layer.where}: {what} replaces the sparse KV cache's buffers, which its "
                             "device-side steps (a captured decode graph) hold; call stop_device_steps() first")

    def reorder_cache(self, beam_idx: Tensor) -> None:
        self._check_buffers_stay("reorder_cache (beam search)")
        for store in self.stores:
            store.map_batch(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._check_buffers_stay("batch_repeat_interleave")
        self.batch *= repeats
        for store in self.stores:
            store.map_batch(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: Tensor) -> None:
        self._check_buffers_stay("batch_select_indices")
        for store in self.stores:
            store.map_batch(lambda t: t[indices])
        self.batch = next((s.keys.shape[0] for s in self.stores if s.keys is not None), self.batch)

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("flexsparse's sparse KV cache cannot be cropped (its ring buffers drop old keys); "
                                  "use a DynamicCache for assisted decoding")


def _write_step(store: KVStore, view: StepView, key: Tensor, value: Tensor) -> None:
    """The new token into its slot: the same slot in every row when the host knows it, else per row."""
    if view.rows is None:
        store.write(key, value, view.host_slot)
    else:
        store.write_rows(key, value, view.rows, view.slot)


class SparseKVCache(Cache):
    """The sparse KV cache of a converted model. A converted model's ``generate()`` builds one by itself
    (:func:`~flexsparse.integrations.transformers.sparse_generate_cache`); to pass one, give it as generate()'s or
    the model's cache argument (``past_key_values=``, ``cache=`` from transformers 5.24:
    :func:`~flexsparse.integrations.transformers.cache_argument`). ``max_length``: the most tokens the cache will
    hold, if known (sizes buffers).
    ``one_launch_decode``: decode heads whose stores are read whole with one kernel call per layer and step
    (:class:`~flexsparse.runtime.fused_decode.FusedDecodeExecutor`): None (default) on CUDA, True also under the
    Triton interpreter, False never."""

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
        views = StepViews()  # shared by the layers: a forward's views are built once
        super().__init__(layers=[SparseKVLayer(layer, max_length, one_launch_decode, views) for layer in layers])

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
            if any(layer.layout is not PaddingLayout.NONE for layer in layers):
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
        rings = {(store.sink, store.window, store.capacity) for layer in layers for store in layer.stores
                 if isinstance(store, RingStore)}
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
    (the growth grid), except stores the layer's plan reads whole under compiled flex (flex buckets)."""
    layers = sparse_layers(model)
    if not layers:
        raise ValueError("kv_memory_formula needs a model converted with flexsparse.convert")
    itemsize = torch.empty((), dtype=dtype).element_size()
    total = 0
    for layer in layers:
        kept = 0
        for group in layer.groups:
            ring = group.store_kind is StoreKind.RING
            kept += len(group.kv_heads) * (min(length, group.pattern.sink + group.pattern.window) if ring else length)
        total += 2 * batch * layer.attention.head_dim * itemsize * kept
    return total
