"""Learned routers inside a converted transformers model: one router per layer, fed by capture hooks, deciding each
sequence's modes at prefill; decode steps reuse the decision.

* **Which router**: ``convert(..., router="head" | "layer" | factory, router_options=...)`` builds one
  :class:`~flexsparse.routers.HeadRouter` / :class:`~flexsparse.routers.LayerRouter` per layer (``router_options``:
  ``pool_size``, ``init_std``, and ``full`` / ``sparse``, the pattern names, by default the first full pattern and
  the first other one), or calls ``factory(layer_idx)`` for a Router (None: that layer is not routed). The router
  is ``module.flexsparse.router``: its weights are saved with ``save_config``, its config in the JSON.
* **What it reads**: a forward hook on the attention module's ``k_norm`` (``q_norm`` for a layer router) when it
  has one, else on ``k_proj`` (``q_proj``), records the states before RoPE and after any norm, reshaped to
  ``[B, S, H, d]`` and detached (routers do not train the model). The hooks are removed by ``revert``.
* **When it decides**: a forward whose queries are all the keys (prefill, training) routes from its states and
  the pooling mask (the forward's padding mask, or :func:`pooling_mask`'s), and runs the layer with the routing's
  per-sequence modes ``[B, H_kv]`` (one HybridAttention call), or in training with gradients the straight-through
  mix of full and sparse outputs (:func:`~flexsparse.routers.routed_attention`). A forward with fewer queries than
  keys (decode with a cache) reuses the last prefill's modes: the router never sees decode tokens.
* **Fused inference**: eval-mode routing on CUDA runs the fused Triton kernel (one launch per layer instead of
  ~200 aten calls; several times faster on an H100, host time included: docs/notes/routers.md);
  :func:`fused_routers` forces it on (the interpreter too) or off.
* **Tensor parallelism**: on a rank of a model sharded by heads, a head router decides the rank's KV heads from
  their key states; a layer router decides from every head's pooled query states, gathered over the
  tensor-parallel group (:meth:`~flexsparse.distributed.TensorParallelLayer.router_states`): the decisions of one
  process, on every rank.
* **Caches**: per-sequence modes need every key in every head, so routed models decode with a ``DynamicCache``
  (``generate()`` keeps the one it builds; :class:`~flexsparse.SparseKVCache` refuses routed models).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager

import torch
from torch import Tensor, nn

from flexsparse.integrations.forward_mask import ForwardMask
from flexsparse.integrations.layer import RouterSettings, SparseAttentionLayer, sparse_layers
from flexsparse.masks import Pattern
from flexsparse.routers import (
    Boundary,
    HeadRouter,
    Router,
    Routing,
    boundary_positions,
    registered_routers,
    routed_attention,
)
from flexsparse.validation import as_float

_OPTION_KEYS = ("pool_size", "init_std", "full", "sparse")

RouterFactory = Callable[[int], Router | None]


# ----- building the routers ----------------------------------------------------------------------------------------

def _mode_index(patterns: Mapping[str, Pattern], name: str, value: object, layer: int) -> int:
    names = list(patterns)
    if isinstance(value, str) and value in patterns:
        return names.index(value)
    raise ValueError(f"router_options[{name!r}] must name a pattern of layer {layer} ({names}), got {value!r}")


def _default_modes(patterns: Mapping[str, Pattern], layer: int) -> tuple[int, int]:
    """The first full pattern and the first other one."""
    full = [i for i, p in enumerate(patterns.values()) if p.is_full and not p.is_dynamic]
    other = [i for i, p in enumerate(patterns.values()) if not (p.is_full and not p.is_dynamic)]
    if not full or not other:
        raise ValueError(f"layer {layer}: a router needs a full and a sparse pattern, got {list(patterns)}; name "
                         "them with router_options={'full': ..., 'sparse': ...}")
    return full[0], other[0]


def router_factory(router: str | RouterFactory, router_options: Mapping | None,
                   patterns: list[Mapping[str, Pattern]], head_dims: list[int]) -> RouterFactory:
    """``convert``'s ``router`` and ``router_options`` as a function ``layer_idx -> Router | None``."""
    if isinstance(router, Router):
        raise TypeError("router must be 'head', 'layer' or a function layer_idx -> Router (one router per layer), "
                        f"got a {type(router).__name__} instance")
    if callable(router):
        if router_options is not None:
            raise TypeError("router_options go with router='head' or 'layer'; a router factory builds its routers "
                            "itself")
        return router
    kinds = registered_routers()
    if not isinstance(router, str) or router not in kinds:
        raise ValueError(f"router must be one of {sorted(kinds)} or a function layer_idx -> Router, got {router!r}")
    if not isinstance(router_options, (Mapping, type(None))):
        raise TypeError(f"router_options must be a dict, got {type(router_options).__name__}")
    options = dict(router_options or {})
    unknown = sorted(set(options) - set(_OPTION_KEYS))
    if unknown:
        raise ValueError(f"router_options has unknown keys {unknown}; known: {list(_OPTION_KEYS)}")
    cls = kinds[router]

    def build(layer: int) -> Router:
        names = patterns[layer]
        if "full" in options and "sparse" in options:
            full = sparse = None
        else:
            full, sparse = _default_modes(names, layer)
        if "full" in options:
            full = _mode_index(names, "full", options["full"], layer)
        if "sparse" in options:
            sparse = _mode_index(names, "sparse", options["sparse"], layer)
        kwargs = {k: options[k] for k in ("pool_size", "init_std") if k in options}
        return cls(head_dims[layer], full_mode=full, sparse_mode=sparse, **kwargs)

    return build


def check_router(router: object, layer: int, where: str, head_dim: int, patterns: Mapping[str, Pattern]) -> None:
    """A factory's router must be a Router for this layer's head_dim whose modes index its patterns."""
    if router is None:
        return
    if not isinstance(router, Router):
        raise TypeError(f"router for {where} must be a flexsparse.routers.Router or None, got "
                        f"{type(router).__name__}")
    if router.head_dim != head_dim:
        raise ValueError(f"router for {where} has head_dim={router.head_dim}, the layer has head_dim={head_dim}")
    for name in ("full_mode", "sparse_mode"):
        if getattr(router, name) >= len(patterns):
            raise ValueError(f"router for {where} has {name}={getattr(router, name)}, the layer has "
                             f"{len(patterns)} patterns ({list(patterns)})")


# ----- capture ---------------------------------------------------------------------------------------------------

def capture_source(module: nn.Module, router: Router, where: str) -> nn.Module:
    """The submodule whose output the router reads: ``k_norm`` / ``k_proj`` (head), ``q_norm`` / ``q_proj``."""
    prefix = "k" if isinstance(router, HeadRouter) else "q"
    for name in (f"{prefix}_norm", f"{prefix}_proj"):
        found = getattr(module, name, None)
        if isinstance(found, nn.Module):
            return found
    raise ValueError(f"{where} has no {prefix}_norm or {prefix}_proj module: a {type(router).__name__} cannot read "
                     "its states")


def attach_router(module: nn.Module, state: SparseAttentionLayer, settings: RouterSettings, where: str) -> None:
    """Hook the router's state capture onto the attention module (states ``[B, S, H, d]``, detached)."""
    source = capture_source(module, state.router, where)
    head_dim = state.attention.head_dim

    def record(_module: nn.Module, _inputs: tuple, output: Tensor) -> None:
        state.captured = output.detach().reshape(output.shape[0], output.shape[1], -1, head_dim)

    state.settings = settings
    state.hooks.append(source.register_forward_hook(record))


# ----- the routed layer ----------------------------------------------------------------------------------------

def forward_boundary(router: Router, states: Tensor, mask: ForwardMask | None, pool_mask: Tensor | None) -> Boundary:
    """Where ``router`` pools ``states`` ``[B, S, H, d]`` in this forward: the boundary of ``pool_mask`` (bool
    ``[B, S]``) when set, else of the forward's padding. It depends on the mask alone, so it is computed once per
    forward and pool size, kept in the :class:`ForwardMask`'s state (with the pooling mask it was computed from)."""
    padding = pool_mask if pool_mask is not None else (None if mask is None else mask.padding)
    batch, seq = states.shape[:2]
    if mask is None:
        return boundary_positions(padding, batch, seq, router.pool_size, states.device)
    return mask.state.router_boundary(router.pool_size, batch, seq, states.device, pool_mask,
                                      lambda: boundary_positions(padding, batch, seq, router.pool_size, states.device))


def routed_layer_attention(layer: SparseAttentionLayer, query: Tensor, key: Tensor, value: Tensor,
                           mask: ForwardMask | None, scale: float | None) -> Tensor:
    """A routed layer's attention, ``[B, H, S_q, d]``: route at prefill, reuse the prefill's modes at decode."""
    attn = layer.attention
    states, layer.captured = layer.captured, None
    positions = None if mask is None else mask.positions()
    where = layer.where
    if query.shape[2] == key.shape[2]:
        if states is None or states.shape[0] != query.shape[0] or states.shape[1] != query.shape[2]:
            raise ValueError(f"{where}: the router's states were not captured in this forward (the model did not "
                             "call the hooked projection before attention)")
        settings = layer.settings
        boundary = forward_boundary(layer.router, states, mask, settings.pool_mask)
        states, boundary = layer.router_states(states, boundary)  # under tensor parallelism: see its layer
        fused = False if layer.router.training else settings.fused  # training: torch (noise, gradients)
        try:
            routing = layer.router.route(states, boundary=boundary, tau=settings.tau, hard=settings.hard,
                                         generator=settings.generator, fused=fused)
        except ValueError as error:
            raise ValueError(f"{where}: {error}") from None
        layer.routing = routing
        layer.prefill_modes = routing.modes(attn.num_kv_heads)
        return routed_attention(attn, query, key, value, routing, positions=positions, scale=scale)
    modes = layer.prefill_modes
    if modes is None or modes.shape[0] != query.shape[0]:
        raise ValueError(f"{where}: a decode step (or a chunk after a prefix) needs the prefill's routing of the "
                         "same batch; routed layers must see the whole prompt in one forward first")
    return attn(query, key, value, modes=modes, positions=positions, scale=scale)


# ----- the model's routers ---------------------------------------------------------------------------------------

def routed_layers(model: nn.Module) -> list[SparseAttentionLayer]:
    """The converted layers of ``model`` that carry a router, in layer order."""
    return [layer for layer in sparse_layers(model) if layer.router is not None]


def _settings(model: nn.Module, caller: str) -> tuple[list[SparseAttentionLayer], RouterSettings]:
    layers = routed_layers(model)
    if not layers:
        raise ValueError(f"{caller}: the model has no routers (flexsparse.convert(model, ..., router=...))")
    return layers, layers[0].settings


def router_parameters(model: nn.Module) -> list[nn.Parameter]:
    """Every router parameter of a converted model."""
    layers, _ = _settings(model, "router_parameters")
    return [p for layer in layers for p in layer.router.parameters()]


def last_routings(model: nn.Module) -> list[Routing]:
    """Each routed layer's routing of the last prefill or training forward (``sparse_weight`` ``[B, G]``)."""
    layers, _ = _settings(model, "last_routings")
    missing = [layer.layer_idx for layer in layers if layer.routing is None]
    if missing:
        raise ValueError(f"layers {missing} have not routed yet: run a forward first")
    return [layer.routing for layer in layers]


@contextmanager
def training(model: nn.Module, tau: float = 1.0, *, hard: bool = True,
             generator: torch.Generator | None = None) -> Iterator[RouterSettings]:
    """Routers in training mode inside the block (Gumbel-softmax at temperature ``tau``, straight-through hard
    weights, full and sparse outputs mixed), every other module in eval mode (no dropout); the previous modes and
    settings come back on exit. Yields the shared :class:`RouterSettings` (set ``settings.tau`` per step)."""
    layers, settings = _settings(model, "training")
    tau = as_float("tau", tau, positive=True)
    modes = {module: module.training for module in model.modules()}
    saved = (settings.tau, settings.hard, settings.generator)
    model.eval()
    for layer in layers:
        layer.router.train()
    settings.tau, settings.hard, settings.generator = tau, bool(hard), generator
    try:
        yield settings
    finally:
        settings.tau, settings.hard, settings.generator = saved
        for module, was_training in modes.items():
            module.training = was_training


@contextmanager
def fused_routers(model: nn.Module, enabled: bool = True) -> Iterator[None]:
    """Inside the block the routers of ``model`` decide in eval mode through the fused Triton kernel (CUDA, or the
    interpreter) when ``enabled``, through torch when not: the same modes either way. Outside it they use the
    kernel on CUDA where it can run. Enabled, a forward where it cannot run (gradients required, no triton, a CPU
    tensor without the interpreter) raises a ValueError naming the layer and the reason."""
    _, settings = _settings(model, "fused_routers")
    if not isinstance(enabled, bool):
        raise TypeError(f"enabled must be a bool, got {type(enabled).__name__}")
    saved, settings.fused = settings.fused, enabled
    try:
        yield
    finally:
        settings.fused = saved


@contextmanager
def pooling_mask(model: nn.Module, pool_mask: Tensor | None) -> Iterator[None]:
    """The routers pool the tokens ``pool_mask`` marks (bool ``[B, S]``, e.g. the prompt of prompt + answer
    training sequences) in the forwards inside the block, instead of the padding mask."""
    _, settings = _settings(model, "pooling_mask")
    if pool_mask is not None and (not isinstance(pool_mask, Tensor) or pool_mask.dim() != 2):
        raise ValueError(f"pool_mask must be a bool tensor [B, S], got "
                         f"{tuple(pool_mask.shape) if isinstance(pool_mask, Tensor) else type(pool_mask).__name__}")
    saved, settings.pool_mask = settings.pool_mask, None if pool_mask is None else pool_mask.bool()
    try:
        yield
    finally:
        settings.pool_mask = saved
