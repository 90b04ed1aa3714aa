"""What every router shares: the MLP shapes, the routing call, plain-dict configs, and :class:`Routing`, the
decision of one layer for one batch.

A router is an ``nn.Module`` whose ``forward(states, key_padding_mask=None)`` gives logits (channel 0 full,
channel 1 sparse) and whose :meth:`Router.route` turns them into a :class:`Routing`: in training mode sampled with
Gumbel noise and straight-through hard weights, in eval mode the deterministic argmax. ``Routing.modes()`` is
what :class:`~flexsparse.HybridAttention` takes per call; ``Routing.sparse_weight`` is what the training path
(:mod:`flexsparse.routers.mixing`) and the sparsity constraint (:mod:`flexsparse.routers.constraint`) use.

Initialisation: every linear layer draws its weight from N(0, 0.02) with a zero bias. That is what the authors'
models end up with (their router modules are re-initialised by transformers' ``_init_weights`` with
``initializer_range`` 0.02; the ``reset_parameters`` with a biased last layer in their router classes is never
called in Elastic's code and is not called on the router in Flux's). Logits start near 0: both modes equally
likely.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from flexsparse.kernels.availability import kernel_unavailable, kernels_preferred_on
from flexsparse.routers.pooling import (
    DEFAULT_POOL_SIZE,
    Boundary,
    boundary_positions,
    check_boundary,
    gather_pool,
)
from flexsparse.routers.relaxation import FULL, SPARSE, relaxed_decisions
from flexsparse.validation import as_float, as_int

DEFAULT_INIT_STD = 0.02


def mlp(widths: Sequence[int]) -> nn.Sequential:
    """Linear layers through ``widths`` with SiLU between them (none after the last)."""
    layers: list[nn.Module] = []
    for i, (n_in, n_out) in enumerate(zip(widths[:-1], widths[1:])):
        if i:
            layers.append(nn.SiLU())
        layers.append(nn.Linear(n_in, n_out))
    return nn.Sequential(*layers)


@dataclass
class Routing:
    """One layer's routing for one batch.

    ``logits`` ``[B, G, 2]`` and ``weights`` ``[B, G, 2]`` (full, sparse): G is the number of KV heads for a head
    router and 1 for a layer router (its decision covers every head). In training the weights are one-hot in the
    forward pass with the gradient of the Gumbel-softmax probabilities (or the soft probabilities with
    ``hard=False``); in eval they are the one-hot argmax without gradient.
    """

    logits: Tensor
    weights: Tensor
    full_mode: int
    sparse_mode: int
    _modes: Tensor | None = field(default=None, repr=False)
    """int64 ``[B, G]``: the modes the fused inference kernel wrote with the weights (None: :meth:`modes` derives
    them from the weights)."""

    @property
    def fused(self) -> bool:
        """Whether the fused inference kernel made this routing (its modes written by the kernel)."""
        return self._modes is not None

    @property
    def sparse_weight(self) -> Tensor:
        """Weight of sparse attention, ``[B, G]`` (exactly 0/1 in the forward pass when hard; differentiable)."""
        return self.weights[..., SPARSE]

    @property
    def is_sparse(self) -> Tensor:
        """The hard decision, bool ``[B, G]`` (a tie goes to full)."""
        return self.weights[..., SPARSE] > self.weights[..., FULL]

    def modes(self, num_kv_heads: int | None = None) -> Tensor:
        """Per-call modes for HybridAttention, int64 ``[B, H_kv]``: ``sparse_mode`` or ``full_mode`` per KV head.

        ``num_kv_heads`` expands a layer router's single decision (G = 1) to every KV head; for a head router it
        must equal G when given. A fused routing returns the modes its kernel wrote, expanded for a layer router
        (a view: do not write to it).
        """
        shape = None  # [B, H_kv] to expand a layer router's decision to
        if num_kv_heads is not None:
            num_kv_heads = as_int("num_kv_heads", num_kv_heads, minimum=1)
            batch, groups = self.weights.shape[:2]
            if groups == 1:
                shape = (batch, num_kv_heads)
            elif groups != num_kv_heads:
                raise ValueError(f"num_kv_heads ({num_kv_heads}) differs from the router's {groups} KV heads")
        if self._modes is not None:
            return self._modes if shape is None else self._modes.expand(shape)
        decision = self.is_sparse if shape is None else self.is_sparse.expand(shape)
        full = torch.full_like(decision, self.full_mode, dtype=torch.long)
        return torch.where(decision, self.sparse_mode, full)


_REGISTRY: dict[str, type[Router]] = {}


def registered_routers() -> Mapping[str, type[Router]]:
    """Every registered router class by its ``kind`` (a read-only view that follows new registrations)."""
    return MappingProxyType(_REGISTRY)


def router_class(kind: str) -> type[Router]:
    """The router class registered under ``kind``; a ValueError lists the known kinds."""
    if not isinstance(kind, str) or kind not in _REGISTRY:
        raise ValueError(f"unknown router kind {kind!r}; known: {sorted(_REGISTRY)}")
    return _REGISTRY[kind]


def _register(cls: type[Router]) -> None:
    """Register ``cls`` under its own ``kind``; another class with a taken kind is a ValueError (the same class
    defined again, its module reloaded, replaces it)."""
    taken = _REGISTRY.get(cls.kind)
    if taken is not None and (taken.__module__, taken.__qualname__) != (cls.__module__, cls.__qualname__):
        raise ValueError(f"router kind {cls.kind!r} of {cls.__module__}.{cls.__qualname__} is taken by "
                         f"{taken.__module__}.{taken.__qualname__}; give the class another kind")
    _REGISTRY[cls.kind] = cls


class Router(nn.Module):
    """Base class: pooled per-head states -> logits -> :class:`Routing`.

    A subclass builds ``task_mlp`` (two linear layers) and ``router_mlp`` (three, the last one 2 wide) with
    :func:`mlp`, and ``forward(states, key_padding_mask=None, *, boundary=None)`` feeds them the pooled states
    (:meth:`pool`), averaged over heads first when ``average_heads``. In eval mode without gradients,
    ``route(..., fused=True)`` runs all of it in one fused Triton launch (:mod:`flexsparse.kernels.router_infer`).

    Args:
        head_dim: d of the states the router reads.
        pool_size: P of :func:`~flexsparse.routers.pooling.boundary_pool`.
        full_mode: index of the full-attention pattern in the layer's HybridAttention patterns.
        sparse_mode: index of the sparse pattern.
        init_std: standard deviation of the initial linear weights (biases start at 0).
        check_finite: make :meth:`route` refuse NaN/inf logits (NaN/inf in the states at the pooled tokens, or in
            the weights) on every device, at one host sync per call. On a CPU they are always refused (no device
            to wait for); on CUDA, without it, NaN logits give an undefined decision (the hot path never syncs).
            A runtime setting (also an attribute), not part of :meth:`config`.
    """

    kind: ClassVar[str] = ""
    """The name configs and ``convert(..., router=kind)`` use; a subclass that sets its own is registered under it
    (:func:`router_class`)."""
    average_heads: ClassVar[bool] = False
    """Whether the pooled heads are averaged into one MLP input per sequence (one decision for every head)."""
    config_keys: ClassVar[tuple[str, ...]] = ("head_dim", "pool_size", "full_mode", "sparse_mode", "init_std")
    """The constructor arguments :meth:`config` writes (the attributes of those names) and a config must name."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls.__dict__.get("kind"):
            _register(cls)

    def __init__(self, head_dim: int, pool_size: int = DEFAULT_POOL_SIZE, *, full_mode: int = 0,
                 sparse_mode: int = 1, init_std: float = DEFAULT_INIT_STD, check_finite: bool = False) -> None:
        super().__init__()
        self.head_dim = as_int("head_dim", head_dim, minimum=1)
        self.pool_size = as_int("pool_size", pool_size, minimum=1)
        self.full_mode = as_int("full_mode", full_mode, minimum=0)
        self.sparse_mode = as_int("sparse_mode", sparse_mode, minimum=0)
        if self.full_mode == self.sparse_mode:
            raise ValueError(f"full_mode and sparse_mode must differ, both are {self.full_mode}")
        self.init_std = as_float("init_std", init_std, positive=True)
        if not isinstance(check_finite, bool):
            raise TypeError(f"check_finite must be a bool, got {type(check_finite).__name__}")
        self.check_finite = check_finite
        self._fused_workspace = None  # the fused kernel's scratch (RouterWorkspace), made at its first launch
        self._fused_linears: tuple[nn.Linear, ...] | None = None  # found at the first fused_layers() call

    def reset_parameters(self) -> None:
        """N(0, init_std) weights and zero biases in every linear layer."""
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=self.init_std)
                nn.init.zeros_(module.bias)

    def check_states(self, states: Tensor, name: str) -> None:
        """``states`` must be ``[B, S, H, head_dim]`` floating point, B and S >= 1."""
        if not isinstance(states, Tensor):
            raise TypeError(f"{name} must be a tensor [B, S, H, {self.head_dim}], got {type(states).__name__}")
        if states.dim() != 4:
            raise ValueError(f"{name} must be 4-D [B, S, H, head_dim], got shape {tuple(states.shape)}")
        if states.shape[0] == 0 or states.shape[1] == 0:
            raise ValueError(f"{name} must hold B >= 1 sequences of S >= 1 tokens, got shape {tuple(states.shape)}")
        if not states.dtype.is_floating_point:
            raise TypeError(f"{name} must be floating point, got {states.dtype}")
        if states.shape[-1] != self.head_dim:
            raise ValueError(f"{name} has head_dim {states.shape[-1]}, the router was built for "
                             f"head_dim={self.head_dim}")

    def _check_logits(self, logits: Tensor, states: Tensor, key_padding_mask: Tensor | None,
                      boundary: Boundary | None) -> None:
        """Refuse NaN/inf logits where that costs no device sync (CPU) or ``check_finite`` asks; say why."""
        if not (self.check_finite or logits.device.type == "cpu") or bool(torch.isfinite(logits).all()):
            return
        with torch.no_grad():
            pooled = self.pool(states, None if boundary is not None else key_padding_mask, boundary)
        if not bool(torch.isfinite(pooled).all()):
            rows = (~torch.isfinite(pooled)).flatten(1).any(1).nonzero().flatten().tolist()
            raise ValueError(f"the states the router pools hold NaN or inf (sequences {rows})")
        raise ValueError("the router's logits are NaN or inf although the pooled states are finite (its weights "
                         "hold NaN/inf, or its MLP overflows in its dtype)")

    def boundary(self, states: Tensor, key_padding_mask: Tensor | None = None,
                 boundary: Boundary | None = None) -> Boundary:
        """Where this router pools ``states`` ``[B, S, H, d]``: ``boundary`` (checked) when given, else the
        :func:`~flexsparse.routers.pooling.boundary_positions` of ``key_padding_mask``."""
        if boundary is None:
            return boundary_positions(key_padding_mask, states.shape[0], states.shape[1], self.pool_size,
                                      states.device)
        if key_padding_mask is not None:
            raise ValueError("pass key_padding_mask or a boundary computed from it, not both")
        check_boundary(boundary, states.shape[0], states.shape[1], states.device, self.pool_size)
        return boundary

    def pool(self, states: Tensor, key_padding_mask: Tensor | None = None, boundary: Boundary | None = None,
             name: str = "states") -> Tensor:
        """Boundary-pooled ``states``: ``[B, S, H, head_dim]`` -> ``[B, H, head_dim]`` in the states' dtype."""
        self.check_states(states, name)
        return gather_pool(states, self.boundary(states, key_padding_mask, boundary))

    def fused_layers(self) -> list[tuple[Tensor, Tensor | None]]:
        """(weight, bias) of the linear layers of ``task_mlp`` then ``router_mlp``, in order: what the fused
        kernel reads (five layers with biases in the built-in routers). The layers are found once: replacing a
        submodule of the MLPs after the first call is not seen (replacing or converting their parameters is)."""
        if self._fused_linears is None:
            self._fused_linears = tuple(m for part in (self.task_mlp, self.router_mlp) for m in part
                                        if isinstance(m, nn.Linear))
        return [(m.weight, m.bias) for m in self._fused_linears]

    def route(self, states: Tensor, key_padding_mask: Tensor | None = None, *, boundary: Boundary | None = None,
              tau: float | Tensor = 1.0, hard: bool = True, generator: torch.Generator | None = None,
              fused: bool | None = None) -> Routing:
        """Logits and weights for one layer. Training mode: Gumbel noise at temperature ``tau`` and
        straight-through hard weights (``hard=False``: soft weights). Eval mode: the deterministic argmax.

        ``boundary``: the pooled slots, precomputed once per forward for every layer (instead of
        ``key_padding_mask``). ``fused``: the fused Triton kernel, in eval mode without gradients (one launch:
        the same logits to float32 rounding, the same weights and modes, the modes written by the kernel:
        ``Routing.fused``). None (default): on CUDA where it can run, else the torch path; True: always (on CPU
        under ``TRITON_INTERPRET=1``), ValueError where it cannot; False: the torch path. On an H100 the fused
        call, host time included, is several times faster than the torch path (``bench/suites/test_router_bench.py``;
        timings in docs/notes/routers.md).

        NaN/inf logits (from NaN/inf states at the pooled tokens, or weights) raise a ValueError on a CPU, and
        on every device with ``check_finite`` (one host sync per call).
        """
        if fused or (fused is None and kernels_preferred_on(states.device)):
            routing = self._route_fused(states, key_padding_mask, boundary)
            if isinstance(routing, Routing):
                self._check_logits(routing.logits, states, key_padding_mask, boundary)
                return routing
            if fused:
                raise ValueError(f"route(fused=True): {routing}")
        logits = self(states, key_padding_mask, boundary=boundary)
        logits = logits.reshape(logits.shape[0], -1, 2)
        self._check_logits(logits, states, key_padding_mask, boundary)
        if self.training:
            weights = relaxed_decisions(logits, tau, hard=hard, noise=True, generator=generator)
        else:
            weights = relaxed_decisions(logits.detach(), hard=True, noise=False).detach()
        return Routing(logits, weights, self.full_mode, self.sparse_mode)

    def _route_fused(self, states: Tensor, key_padding_mask: Tensor | None,
                     boundary: Boundary | None) -> Routing | str:
        """The fused kernel's routing, or why it cannot run (then :meth:`route` takes the torch path or raises)."""
        if self.training:
            return "the router is in training mode (Gumbel sampling and gradients run in torch)"
        self.check_states(states, "states")
        if torch.is_grad_enabled() and (states.requires_grad or any(p.requires_grad for p in self.parameters())):
            return "gradients are enabled and required (run under torch.no_grad() or inference_mode())"
        reason = kernel_unavailable(states.device)
        if reason is not None:
            return reason
        from flexsparse.kernels import router_infer  # triton: imported where it runs
        layers = self.fused_layers()
        reason = router_infer.fused_support(states, layers)
        if reason is not None:
            return reason
        found = self.boundary(states, key_padding_mask, boundary)
        if self._fused_workspace is None:
            self._fused_workspace = router_infer.RouterWorkspace()
        logits, weights, modes = router_infer.fused_routing(
            states, found.positions, found.weights, layers, average_heads=self.average_heads,
            full_mode=self.full_mode, sparse_mode=self.sparse_mode, workspace=self._fused_workspace)
        return Routing(logits, weights, self.full_mode, self.sparse_mode, modes)

    def config(self) -> dict:
        """Plain-dict config; :meth:`Router.from_config` rebuilds the module (weights come from the state_dict)."""
        return {"kind": self.kind, **{key: getattr(self, key) for key in self.config_keys}}

    @staticmethod
    def from_config(config: dict) -> Router:
        """The router a :meth:`config` dict describes (freshly initialised). It must name every key of the
        class's ``config_keys`` (a ValueError names the missing ones) and no key the constructor does not take."""
        if not isinstance(config, dict):
            raise TypeError(f"config must be a dict, got {type(config).__name__}")
        cls = router_class(config.get("kind"))
        fields = {k: v for k, v in config.items() if k != "kind"}
        known = set(inspect.signature(cls.__init__).parameters) - {"self"}
        unknown = sorted(set(fields) - known)
        if unknown:
            raise ValueError(f"config has keys {unknown} that a {cls.__name__} does not take; known: {sorted(known)}")
        missing = [key for key in cls.config_keys if key not in fields]
        if missing:
            raise ValueError(f"config of a {cls.kind!r} router lacks {missing}: a config names every argument "
                             f"{list(cls.config_keys)}, so that it loads as it was saved")
        return cls(**fields)

    def extra_repr(self) -> str:
        return (f"head_dim={self.head_dim}, pool_size={self.pool_size}, full_mode={self.full_mode}, "
                f"sparse_mode={self.sparse_mode}")
