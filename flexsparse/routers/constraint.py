"""The sparsity constraint of router training: MSR and ESR per sequence, and the Lagrangian regulariser (seed 000,
Eq. 4, 5 and 8; seed 003, Eq. 6).

MSR and ESR here are the library's definitions (:mod:`flexsparse.metrics`) applied per sequence to the routers'
*weights* instead of booleans: with straight-through weights the value is the hard decisions' ratio and the
gradient flows through the soft probabilities; with soft weights it is the expected ratio (Flux's ``E[1 - pi]``).
ESR uses each pattern's attended (query, key) pair counts (``Pattern.attended``), computed once per geometry:
the expected attended pairs of a head are ``(1 - w) * pairs_full + w * pairs_sparse``, linear in its sparse
weight ``w``.

:class:`SparsityConstraint` holds, per task, a target sparsity and the two Lagrange multipliers. Choices:

* The linear term is ``lambda_1 * |MSR - t|`` by default, as in both authors' codes; Eq. 8 prints
  ``lambda_1 * (MSR - t)`` (``linear="signed"``). With multipliers initialised positive, the signed term first
  pushes a task *away* from a target it is below (e.g. robust tasks at t = 1.0) until lambda_1 has ascended
  through zero; the absolute term pulls towards the target from the start.
* Multipliers start uniform in [0, 0.5) per task, as the authors' per-task multipliers do (``init="zeros"``: 0,
  PruLong's choice, the natural pair of ``linear="signed"``).
* Per-task aggregation as in the authors' code: the mean over a batch's sequences of each task present, then the
  mean over the tasks present (no host sync).
* The multipliers are maximised: put ``constraint.parameters()`` in an optimizer group with ``maximize=True``
  (AdamW lr 1e-3 in both papers); the router parameters are minimised as usual.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Literal

import torch
from torch import Tensor, nn

from flexsparse.masks.base import Pattern
from flexsparse.masks.geometry import Geometry
from flexsparse.metrics import effective_sparsity_ratio, model_sparsity_ratio
from flexsparse.validation import as_float, as_int

ROBUST_TARGET = 1.0
"""Target MSR of sparsity-robust tasks (summarization, code, in-context learning): seed 000, Section 4."""
SENSITIVE_TARGET = 0.7
"""Target MSR of sparsity-sensitive tasks (single- and multi-document QA)."""


def _as_weights(sparse_weights: Tensor | Sequence[Tensor]) -> Tensor:
    """``[B, N]``: every (layer, head) sparse weight of each sequence, from a tensor ``[B, ...]`` or a sequence
    of per-layer tensors ``[B, G_l]``."""
    if isinstance(sparse_weights, Tensor):
        parts = [sparse_weights]
    elif isinstance(sparse_weights, Sequence) and sparse_weights and all(isinstance(t, Tensor)
                                                                        for t in sparse_weights):
        parts = list(sparse_weights)
    else:
        raise TypeError("sparse_weights must be a tensor [B, ...] or a non-empty sequence of tensors [B, G]")
    batch = parts[0].shape[0] if parts[0].dim() else None
    for t in parts:
        if t.dim() < 2 or t.shape[0] != batch:
            raise ValueError(f"sparse_weights must be [B, ...] with one batch size, got shapes "
                             f"{[tuple(p.shape) for p in parts]}")
    return torch.cat([t.reshape(batch, -1).float() for t in parts], dim=1)


def msr(sparse_weights: Tensor | Sequence[Tensor]) -> Tensor:
    """Model sparsity ratio per sequence, float32 ``[B]``: the mean sparse weight over all (layer, KV head) slots.

    ``sparse_weights``: ``[B, L, G]`` or a list of per-layer ``[B, G]`` (``Routing.sparse_weight``); a layer
    router's G = 1 counts each layer once.
    """
    weights = _as_weights(sparse_weights)
    return torch.func.vmap(model_sparsity_ratio)(weights)


def attended_pairs(pattern: Pattern, geo: Geometry, num_kv_heads: int) -> Tensor:
    """(query, key) pairs ``pattern`` attends per KV head, float64 ``[B', H_kv]`` (B' is 1 unless ``geo`` has
    per-sequence positions, e.g. from a padding mask). A per-query-head pattern counts the mean of each KV head's
    query heads. Content-dependent patterns (XA) must be resolved on q/k first (``pattern.resolve``)."""
    if not isinstance(pattern, Pattern):
        raise TypeError(f"pattern must be a flexsparse Pattern, got {type(pattern).__name__}")
    if pattern.is_dynamic:
        raise ValueError(f"{pattern!r} depends on q/k: resolve it first (pattern.resolve(q, k, geo))")
    num_kv_heads = as_int("num_kv_heads", num_kv_heads, minimum=1)
    if geo.num_heads % num_kv_heads:
        raise ValueError(f"geo.num_heads ({geo.num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    pairs = pattern.attended(geo).double().sum(-1)  # [B', H']
    if pairs.shape[1] == 1:
        return pairs.expand(pairs.shape[0], num_kv_heads)
    return pairs.view(pairs.shape[0], num_kv_heads, -1).mean(-1)


def causal_pairs(geo: Geometry) -> Tensor:
    """(query, key) pairs of full causal attention, float64 ``[B']`` (real queries only)."""
    return (geo.q_positions() + 1).clamp(min=0).sum(-1).double()


def esr(sparse_weights: Tensor, full_pairs: Tensor, sparse_pairs: Tensor, causal: Tensor | float) -> Tensor:
    """Effective sparsity ratio per sequence, float32 ``[B]``.

    Args:
        sparse_weights: ``[B, L, G]`` (or ``[B, G]`` for one layer) sparse weights.
        full_pairs, sparse_pairs: attended pairs of the full and sparse pattern (:func:`attended_pairs`),
            broadcastable to ``sparse_weights`` (e.g. ``[L, G]``, ``[G]``, or ``[B, 1, G]`` per sequence).
        causal: pairs of causal attention, a number or ``[B]`` (:func:`causal_pairs`).
    """
    if not isinstance(sparse_weights, Tensor) or sparse_weights.dim() < 2:
        raise ValueError("sparse_weights must be a tensor [B, L, G] or [B, G]")
    weights = sparse_weights.double()
    expected = (1.0 - weights) * full_pairs + weights * sparse_pairs
    expected = expected.reshape(expected.shape[0], -1)
    causal = torch.as_tensor(causal, dtype=torch.float64, device=expected.device).clamp(min=1)
    causal = causal.reshape(-1).expand(expected.shape[0])
    return torch.func.vmap(effective_sparsity_ratio)(expected, causal)


class SparsityConstraint(nn.Module):
    """Per-task targets and Lagrange multipliers; ``forward(sparsity, tasks)`` gives the regulariser.

    Args:
        targets: task name -> target sparsity in [0, 1] (the order fixes the task indices).
        linear: "abs" (the authors' code) or "signed" (Eq. 8 as printed) linear term.
        init: "uniform" (U[0, 0.5), the authors' code) or "zeros".
        seed: seeds the uniform initialisation (None: torch's global generator).

    ``forward(sparsity, tasks)``: ``sparsity`` ``[B]`` per-sequence MSR (or ESR) with gradient, ``tasks`` names
    (a sequence of B strings) or an int tensor ``[B]`` of task indices -> a 0-d regulariser
    ``lambda_1[t] * L(d) + lambda_2[t] * d ** 2`` with ``d = sparsity - target[t]``, averaged per task, then over
    the tasks present.
    """

    def __init__(self, targets: Mapping[str, float], *, linear: Literal["abs", "signed"] = "abs",
                 init: Literal["uniform", "zeros"] = "uniform", seed: int | None = None) -> None:
        super().__init__()
        if not isinstance(targets, Mapping) or not targets:
            raise TypeError("targets must be a non-empty mapping of task name -> target sparsity")
        for name in targets:
            if not isinstance(name, str) or not name:
                raise TypeError(f"targets keys must be non-empty task names (str), got {name!r}")
        if linear not in ("abs", "signed"):
            raise ValueError(f"linear must be 'abs' or 'signed', got {linear!r}")
        if init not in ("uniform", "zeros"):
            raise ValueError(f"init must be 'uniform' or 'zeros', got {init!r}")
        self.task_names = list(targets)
        values = [as_float(f"targets[{name!r}]", t, minimum=0.0, maximum=1.0) for name, t in targets.items()]
        self.linear, self.init = linear, init
        self.register_buffer("targets", torch.tensor(values, dtype=torch.float32))
        self.lambda_1 = nn.Parameter(torch.zeros(len(values)))
        self.lambda_2 = nn.Parameter(torch.zeros(len(values)))
        self.reset_parameters(seed)

    @classmethod
    def from_categories(cls, robust: Sequence[str] = (), sensitive: Sequence[str] = (), *,
                        robust_target: float = ROBUST_TARGET, sensitive_target: float = SENSITIVE_TARGET,
                        **kwargs) -> SparsityConstraint:
        """Targets by category: ``robust_target`` (1.0) for sparsity-robust tasks, ``sensitive_target`` (0.7) for
        sparsity-sensitive ones."""
        for name, names in (("robust", robust), ("sensitive", sensitive)):
            if isinstance(names, str) or not isinstance(names, Sequence):
                raise TypeError(f"{name} must be a sequence of task names, got {type(names).__name__}")
        overlap = set(robust) & set(sensitive)
        if overlap:
            raise ValueError(f"tasks {sorted(overlap)} are both robust and sensitive")
        targets = {**{t: robust_target for t in robust}, **{t: sensitive_target for t in sensitive}}
        return cls(targets, **kwargs)

    @torch.no_grad()
    def reset_parameters(self, seed: int | None = None) -> None:
        """Multipliers to their initial values (``init``)."""
        if self.init == "zeros":
            self.lambda_1.zero_()
            self.lambda_2.zero_()
            return
        generator = None if seed is None else torch.Generator().manual_seed(as_int("seed", seed))
        for p in (self.lambda_1, self.lambda_2):
            p.copy_(torch.rand(p.shape, generator=generator) * 0.5)

    def task_ids(self, tasks: Sequence[str] | Tensor, device: torch.device | None = None) -> Tensor:
        """Task indices, int64 ``[B]``, from names or an index tensor (checked on the host only for names)."""
        device = self.targets.device if device is None else device
        if isinstance(tasks, Tensor):
            if tasks.dtype.is_floating_point or tasks.dtype == torch.bool or tasks.dim() != 1:
                raise TypeError(f"tasks must be an int tensor [B] of task indices, got {tasks.dtype} "
                                f"{tuple(tasks.shape)}")
            return tasks.to(device=device, dtype=torch.long)
        if isinstance(tasks, str) or not isinstance(tasks, Sequence):
            raise TypeError(f"tasks must be a sequence of task names or an int tensor, got {type(tasks).__name__}")
        unknown = sorted({t for t in tasks if t not in self.task_names}, key=str)
        if unknown:
            raise ValueError(f"tasks holds unknown task names {unknown}; known: {self.task_names}")
        return torch.tensor([self.task_names.index(t) for t in tasks], dtype=torch.long, device=device)

    def per_task_mean(self, values: Tensor, task_ids: Tensor) -> tuple[Tensor, Tensor]:
        """Mean of ``values`` ``[B]`` per task and the number of sequences per task (as floats), both ``[T]``
        (0 where absent)."""
        tasks = len(self.task_names)
        count = values.new_zeros(tasks).index_add(0, task_ids, torch.ones_like(values))  # bincount syncs on CUDA
        total = values.new_zeros(tasks).index_add(0, task_ids, values)
        return total / count.clamp(min=1), count

    def forward(self, sparsity: Tensor, tasks: Sequence[str] | Tensor) -> Tensor:
        if not isinstance(sparsity, Tensor) or sparsity.dim() != 1:
            raise ValueError("sparsity must be a tensor [B] (per-sequence MSR or ESR)")
        ids = self.task_ids(tasks, sparsity.device)
        if ids.shape[0] != sparsity.shape[0]:
            raise ValueError(f"tasks names {ids.shape[0]} sequences, sparsity has {sparsity.shape[0]}")
        if ids.device.type == "cpu":
            if ids.numel() and not bool(((ids >= 0) & (ids < len(self.task_names))).all()):
                raise ValueError(f"tasks indices must lie in [0, {len(self.task_names)}), got {ids.tolist()}")
        else:  # no host sync on the training step
            torch._assert_async(((ids >= 0) & (ids < len(self.task_names))).all(),
                                "flexsparse: task index out of range")
        gap = sparsity.float() - self.targets[ids]
        linear = gap.abs() if self.linear == "abs" else gap
        per_sequence = self.lambda_1[ids] * linear + self.lambda_2[ids] * gap.square()
        task_mean, count = self.per_task_mean(per_sequence, ids)
        present = (count > 0).to(task_mean.dtype)
        return (task_mean * present).sum() / present.sum().clamp(min=1)

    def config(self) -> dict:
        """Plain-dict config (multiplier values live in the state_dict)."""
        targets = dict(zip(self.task_names, self.targets.tolist()))
        return {"targets": targets, "linear": self.linear, "init": self.init}

    def extra_repr(self) -> str:
        return f"targets={dict(zip(self.task_names, self.targets.tolist()))}, linear={self.linear!r}"
