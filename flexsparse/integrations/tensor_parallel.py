"""Tensor-parallel inference through transformers' own tensor parallelism (``from_pretrained(...,
distributed_config=DistributedConfig(tp_plan="auto"))``; transformers 5.17-5.24 also take ``tp_plan="auto"``
directly, deprecated).

transformers shards ``q_proj``, ``k_proj`` and ``v_proj`` column-wise over the P ranks of its ``"tp"`` mesh: rank
r holds the contiguous KV heads ``r*H_kv/P .. (r+1)*H_kv/P - 1`` and their query heads (query head ``h*G + i``
goes with KV head h, G = H / H_kv), and its attention function receives only those heads. :func:`convert`
(``flexsparse.convert``) detects such a model (:func:`tensor_parallel_rank`) and gives each attention module a
:class:`TensorParallelLayer`: the layer's :class:`~flexsparse.HybridAttention` over every head, with the global
per-KV-head modes (the same modes as on one device; patterns with per-head data such as ESA see their global head
indices), run on the rank's heads through its ``kv_heads`` argument (:class:`RankAttention`). A
:class:`~flexsparse.SparseKVCache` of the model then holds the rank's heads only.

Routers (``convert(..., router=...)``) run on every rank with the same weights (convert broadcasts them from the
group's first rank). A head router decides each KV head from that head's key states alone: each rank routes its
own heads from its own states, the decisions the single-process model makes for them. A router that averages the
heads (the layer router) pools each rank's heads, all-gathers the pooled ``[B, H/P, d]`` states over the group
(:meth:`TensorParallelLayer.router_states`; never the sequence) and decides from every head, the same decision on
every rank.

:func:`rank_tiles` counts the attention tiles each rank computes for given modes: per-rank cost, for balancing
the full heads across the ranks (:func:`~flexsparse.routers.selection.select_modes` with ``tp_size``).
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping, Sequence

import torch
import torch.distributed as dist
from torch import Tensor, nn

from flexsparse.attention import HybridAttention
from flexsparse.integrations.layer import SparseAttentionLayer, cache_groups
from flexsparse.masks import Pattern
from flexsparse.masks.geometry import Geometry, Positions
from flexsparse.routers import Boundary, HeadRouter, Router, gather_pool
from flexsparse.runtime.modes import mode_index
from flexsparse.validation import as_int


def rank_kv_heads(num_kv_heads: int, tp_size: int, rank: int, where: str = "the layer") -> range:
    """The contiguous KV heads tensor-parallel rank ``rank`` of ``tp_size`` holds (transformers' column-wise
    sharding of k_proj/v_proj). ValueError when ``num_kv_heads`` is not divisible by ``tp_size``."""
    num_kv_heads = as_int("num_kv_heads", num_kv_heads, minimum=1)
    tp_size = as_int("tp_size", tp_size, minimum=1)
    rank = as_int("rank", rank, minimum=0, maximum=tp_size - 1)
    if num_kv_heads % tp_size:
        raise ValueError(f"{where} has {num_kv_heads} KV heads, not divisible by the tensor-parallel size "
                         f"{tp_size}: every rank must hold whole KV heads (run on a number of ranks that divides "
                         f"{num_kv_heads})")
    share = num_kv_heads // tp_size
    return range(rank * share, (rank + 1) * share)


def _tensor_parallel_mesh(model: nn.Module):
    """The 1-D ``"tp"`` device mesh of a model transformers sharded (``tp_plan``, size above 1), else None."""
    size = getattr(model, "tp_size", None)
    if size is None:
        size = getattr(model, "_tp_size", None)
    if size is None or int(size) <= 1:
        return None
    mesh = getattr(model, "_device_mesh", None)
    if mesh is None:
        raise ValueError(f"the model reports tensor-parallel size {size} but has no device mesh (_device_mesh); "
                         "load it with from_pretrained(..., distributed_config=DistributedConfig("
                         "tp_plan='auto')) under torch.distributed")
    names = mesh.mesh_dim_names or ()
    tp_mesh = mesh if mesh.ndim == 1 else mesh["tp"] if "tp" in names else None
    if tp_mesh is None or tp_mesh.size() != int(size):
        raise ValueError(f"cannot find the tensor-parallel dimension of size {size} in the model's device mesh "
                         f"{mesh} (dimensions {names})")
    return tp_mesh


def tensor_parallel_rank(model: nn.Module) -> tuple[int, int] | None:
    """``(rank, size)`` of ``model`` in its tensor-parallel group when transformers sharded it (``tp_plan``, size
    above 1), else None. Read from ``model.tp_size`` (``_tp_size`` where the property is missing) and the rank's
    coordinate on the ``"tp"`` dimension of ``model._device_mesh`` (a 1-D mesh, or a named dimension of a larger
    one)."""
    tp_mesh = _tensor_parallel_mesh(model)
    return None if tp_mesh is None else (tp_mesh.get_local_rank(), tp_mesh.size())


def tensor_parallel_group(model: nn.Module) -> dist.ProcessGroup | None:
    """The process group of ``model``'s tensor-parallel ranks (its ranks in the order of their KV heads), or None
    when the model is not sharded (see :func:`tensor_parallel_rank`)."""
    tp_mesh = _tensor_parallel_mesh(model)
    return None if tp_mesh is None else tp_mesh.get_group()


def check_tensor_parallel_router(router: Router | None, where: str) -> None:
    """ValueError for a router a tensor-parallel rank cannot run: only per-KV-head routers from key states
    (:class:`~flexsparse.routers.HeadRouter`) and routers that average the heads (``average_heads``) are
    supported."""
    per_kv_head = isinstance(router, HeadRouter)
    if router is None or per_kv_head or router.average_heads:
        return
    raise ValueError(f"router for {where} ({type(router).__name__}) neither decides each KV head from its own key "
                     "states (HeadRouter) nor averages the heads (average_heads); under tensor parallelism "
                     "flexsparse runs only those two kinds")


def broadcast_routers(layers: Sequence[SparseAttentionLayer], group: dist.ProcessGroup) -> None:
    """Give every rank of ``group`` the routers' weights of its first rank (parameters and buffers, in place), so
    that all ranks decide alike whatever each initialised. One broadcast per tensor, at convert time."""
    source = dist.get_global_rank(group, 0)
    with torch.no_grad():
        for layer in layers:
            if layer.router is not None:
                for tensor in (*layer.router.parameters(), *layer.router.buffers()):
                    dist.broadcast(tensor.data, source, group=group)


def _local_rows(weight: Tensor) -> int:
    """Rows of a projection weight this rank holds (a DTensor's local shard, or the plain local tensor)."""
    to_local = getattr(weight, "to_local", None)
    return (to_local() if callable(to_local) else weight).shape[0]


def check_sharded_heads(module: nn.Module, num_kv_heads: int, head_dim: int, tp_size: int, where: str) -> None:
    """ValueError unless ``module``'s k_proj holds ``num_kv_heads / tp_size`` heads on this rank (column-wise
    sharding, as transformers' tensor-parallel plans of Llama-style models do)."""
    k_proj = getattr(module, "k_proj", None)
    weight = getattr(k_proj, "weight", None)
    if not isinstance(weight, Tensor):
        raise ValueError(f"{where} has no k_proj weight: flexsparse cannot tell which KV heads this "
                         "tensor-parallel rank holds (it supports models with q_proj/k_proj/v_proj sharded "
                         "column-wise)")
    rows = _local_rows(weight)
    if rows * tp_size != num_kv_heads * head_dim:
        raise ValueError(f"{where}: this rank's k_proj holds {rows} rows, expected {num_kv_heads} KV heads x "
                         f"head_dim {head_dim} / tensor-parallel size {tp_size} = "
                         f"{num_kv_heads * head_dim // tp_size} (k_proj must be sharded column-wise)")


class RankAttention(nn.Module):
    """A :class:`~flexsparse.HybridAttention` layer run on one tensor-parallel rank's contiguous KV heads.

    ``layer`` describes every head (its default modes are the global ones); ``kv_heads`` are the rank's (a
    ``range``). ``num_heads`` / ``num_kv_heads`` are the rank's counts and ``forward`` takes the rank's q
    ``[B, H/P, S_q, d]`` and k/v ``[B, H_kv/P, S_kv, d]`` like a HybridAttention of that size: ``kv_heads=``
    (local indices, ascending) runs some of them; per-call ``modes`` (a name or index for every head, or a list /
    int tensor ``[H_kv/P]`` or ``[B, H_kv/P]``) describe the rank's heads. Output ``[B, H/P, S_q, d]``.
    """

    def __init__(self, layer: HybridAttention, kv_heads: range) -> None:
        super().__init__()
        if not isinstance(layer, HybridAttention):
            raise TypeError(f"layer must be a flexsparse.HybridAttention, got {type(layer).__name__}")
        if not isinstance(kv_heads, range):
            raise TypeError(f"kv_heads must be a range of KV heads, got {type(kv_heads).__name__}")
        if not len(kv_heads) or kv_heads.step != 1 or kv_heads.start < 0 or kv_heads.stop > layer.num_kv_heads:
            raise ValueError(f"kv_heads must be a non-empty range of the layer's {layer.num_kv_heads} KV heads, "
                             f"got {kv_heads!r}")
        self.layer = layer
        self.kv_heads = kv_heads
        self.num_kv_heads = len(kv_heads)
        self.num_heads = self.num_kv_heads * (layer.num_heads // layer.num_kv_heads)
        self.head_dim = layer.head_dim
        self.patterns, self.pattern_names = layer.patterns, layer.pattern_names
        self._global_modes = tuple(layer.default_modes.tolist())
        self._global_heads: dict[tuple, tuple[int, ...]] = {}  # local kv_heads -> the layer's indices
        self._fill: dict[torch.device, Tensor] = {}  # the layer's default modes per device (mode tensors' filler)

    @property
    def executors(self) -> list:
        """The layer's executors (a sparse KV cache decodes the rank's heads through them)."""
        return self.layer.executors

    def forward(self, q: Tensor, k: Tensor, v: Tensor, modes: Tensor | Sequence[str | int] | str | int | None = None,
                *, key_padding_mask: Tensor | None = None, positions: Positions | None = None,
                scale: float | None = None, kv_heads: Sequence[int] | None = None) -> Tensor:
        return self.layer(q, k, v, self._layer_modes(modes), key_padding_mask=key_padding_mask,
                          positions=positions, scale=scale, kv_heads=self._layer_heads(kv_heads))

    def _layer_heads(self, kv_heads: Sequence[int] | None) -> tuple[int, ...]:
        key = None if kv_heads is None else tuple(kv_heads)
        found = self._global_heads.get(key)
        if found is None:
            local = range(self.num_kv_heads) if key is None else key
            first = self.kv_heads.start
            found = tuple(first + as_int("kv_heads entry", h, minimum=0, maximum=self.num_kv_heads - 1)
                          for h in local)
            self._global_heads[key] = found
        return found

    def _layer_modes(self, modes):
        """Per-call modes of the rank's heads as modes of every head of the layer (the other heads keep their
        default modes; the layer runs only the rank's)."""
        if modes is None or isinstance(modes, (str, numbers.Integral)):
            return modes
        first, stop = self.kv_heads.start, self.kv_heads.stop
        if isinstance(modes, Tensor):
            if modes.dim() not in (1, 2) or modes.shape[-1] != self.num_kv_heads:
                raise ValueError(f"modes must have shape [{self.num_kv_heads}] or [B, {self.num_kv_heads}] (this "
                                 f"rank's KV heads {first}..{stop - 1}), got {tuple(modes.shape)}")
            fill = self._fill.get(modes.device)
            if fill is None:
                fill = self._fill[modes.device] = torch.tensor(self._global_modes, device=modes.device)
            before, after = fill[:first], fill[stop:]
            if modes.dim() == 2:
                before, after = before.expand(modes.shape[0], -1), after.expand(modes.shape[0], -1)
            return torch.cat([before.to(modes.dtype), modes, after.to(modes.dtype)], -1)
        if isinstance(modes, (list, tuple)):
            if len(modes) != self.num_kv_heads:
                raise ValueError(f"modes must have one entry per KV head of this rank ({self.num_kv_heads}: heads "
                                 f"{first}..{stop - 1}), got {len(modes)}")
            return [*self._global_modes[:first], *modes, *self._global_modes[stop:]]
        raise TypeError(f"modes must be a pattern name or index, a list of them or an int tensor, got "
                        f"{type(modes).__name__}")

    @property
    def last_stats(self):
        """The layer's :attr:`~flexsparse.HybridAttention.last_stats` of the last call (the rank's heads)."""
        return self.layer.last_stats

    def extra_repr(self) -> str:
        return f"kv_heads={self.kv_heads.start}..{self.kv_heads.stop - 1} of {self.layer.num_kv_heads}"


class TensorParallelLayer(SparseAttentionLayer):
    """A converted attention module's state on one tensor-parallel rank: ``modes`` are the layer's global
    per-KV-head modes (as on one device; ``mode_names`` too), ``attention`` a :class:`RankAttention` over the
    rank's ``kv_heads``, and ``groups`` the sparse KV cache's grouping of the rank's heads only (local indices;
    ``first_kv_head`` is the layer index of local head 0). ``group``: the tensor-parallel process group, through
    which a head-averaging ``router`` sees every head's pooled states (:meth:`router_states`)."""

    def __init__(self, layer_idx: int, path: str, num_heads: int, num_kv_heads: int, head_dim: int,
                 patterns: Mapping[str, Pattern], modes: Sequence[int], *, kv_heads: range, block_size: int,
                 backend: str, plan: str, group: dist.ProcessGroup | None = None,
                 router: Router | None = None, kernel_options: dict | None = None) -> None:
        check_tensor_parallel_router(router, f"layer {layer_idx}")
        if router is not None and router.average_heads and group is None:
            raise ValueError(f"a {type(router).__name__} averages every head: a tensor-parallel rank needs the "
                             "process group (group=) to gather the other ranks' pooled states")
        super().__init__(layer_idx, path, num_heads, num_kv_heads, head_dim, patterns, modes,
                         block_size=block_size, backend=backend, plan=plan, router=router,
                         kernel_options=kernel_options)
        self.kv_heads = kv_heads
        self.first_kv_head = kv_heads.start
        self.group = group
        self.attention = RankAttention(self.attention, kv_heads)
        self.groups = cache_groups(list(self.patterns.values()), [self.modes[h] for h in kv_heads],
                                   self.attention.executors)

    def router_states(self, states: Tensor, boundary: Boundary) -> tuple[Tensor, Boundary]:
        """What the router reads from the rank's captured ``states`` ``[B, S, H/P, d]`` (or ``H_kv/P``).

        A head router: the rank's states as they are (it decides each of the rank's KV heads from its own
        states). A head-averaging router: every head's pooled states, as one token ``[B, 1, H, d]`` with a
        boundary that pools that token alone (weight 1, so pooling returns it exactly): the rank pools its heads
        (``[B, H/P, d]``, the states' dtype, as the router pools them) and all-gathers them over the group in
        rank order, which is head order. Every rank then decides from the pooled states the single-process router
        computes.
        """
        if not self.router.average_heads:
            return states, boundary
        mine = gather_pool(states, boundary).contiguous()  # [B, H/P, d]
        every = [torch.empty_like(mine) for _ in range(dist.get_world_size(self.group))]
        dist.all_gather(every, mine, group=self.group)
        pooled = torch.cat(every, dim=1)[:, None]  # [B, 1, H, d]
        batch, slots = boundary.positions.shape
        weights = torch.zeros(batch, slots, dtype=torch.float32, device=states.device)
        weights[:, 0] = 1.0
        return pooled, Boundary(torch.zeros_like(boundary.positions), weights, 1)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, kv_heads={self.kv_heads.start}..{self.kv_heads.stop - 1}"


# ----- per-rank cost ------------------------------------------------------------------------------------------


def _tiles_per_query_head(pattern: Pattern, geo: Geometry) -> Tensor:
    """Tiles (partial and full) each query head of ``pattern`` computes, int64 ``[H]``."""
    mask = pattern.block_mask(geo)
    tiles = mask.kv_num_blocks.sum(-1)
    if mask.full_kv_num_blocks is not None:
        tiles = tiles + mask.full_kv_num_blocks.sum(-1)
    return tiles[0].long().expand(geo.num_heads)


def rank_tiles(patterns: Mapping[str, Pattern] | Sequence[Mapping[str, Pattern]],
               modes: Sequence[Sequence[str | int]], num_heads: int, length: int, tp_size: int, *,
               block_size: int = 128) -> Tensor:
    """Attention tiles each tensor-parallel rank computes in a causal prefill of ``length`` tokens (no padding):
    int64 ``[P, L]``, rank r's KV heads being the r-th contiguous block of ``H_kv / P``.

    ``patterns``: name -> Pattern for every layer, or one mapping per layer; ``modes``: per layer, the global
    per-KV-head pattern names or indices (as convert takes them); ``num_heads``: query heads per layer. A tile is a
    ``block_size`` x ``block_size`` block of one query head's scores with any attended key (full causal tiles
    included); a rank's time is roughly proportional to its tiles, so the slowest rank's sum over layers bounds a
    layer-synchronous forward. Content-dependent patterns (XAttention) have no tile count before they see q/k:
    ValueError.
    """
    length = as_int("length", length, minimum=1)
    tp_size = as_int("tp_size", tp_size, minimum=1)
    num_heads = as_int("num_heads", num_heads, minimum=1)
    layers = len(modes)
    per_layer = [patterns] * layers if isinstance(patterns, Mapping) else list(patterns)
    if len(per_layer) != layers:
        raise ValueError(f"patterns has {len(per_layer)} per-layer entries, modes {layers} layers")
    geo = Geometry(num_heads, length, length, block_size)
    result = torch.zeros(tp_size, layers, dtype=torch.long)
    for index, (layer_modes, layer_patterns) in enumerate(zip(modes, per_layer)):
        names = list(layer_patterns)
        kv = len(layer_modes)
        heads = rank_kv_heads(kv, tp_size, 0, f"layer {index}")
        if num_heads % kv:
            raise ValueError(f"num_heads ({num_heads}) must be a multiple of layer {index}'s {kv} KV heads")
        group = num_heads // kv
        tiles: dict[int, Tensor] = {}
        for head, mode in enumerate(layer_modes):
            mode = mode_index(names, mode, f"modes for layer {index}, KV head {head}")
            if mode not in tiles:
                pattern = layer_patterns[names[mode]]
                if pattern.is_dynamic:
                    raise ValueError(f"layer {index}: pattern {names[mode]!r} depends on q/k (its tiles are not "
                                     "known before a call)")
                tiles[mode] = _tiles_per_query_head(pattern, geo)
            result[head // len(heads), index] += tiles[mode][head * group:(head + 1) * group].sum()
    return result
