"""The budgeted choice of one attention option per KV head: a multiple-choice knapsack with up to two budgets.

Every KV head (of every layer) takes one option (full attention, a sink + window, XAttention at a threshold, ...).
Option ``o`` of head ``h`` costs ``costs[kind][h, o]`` of each cost kind, as a fraction of what a full head costs
(``"tiles"``: the share of the causal attention tiles it computes at the budget's length; ``"kv"``: the share of a
full head's KV-cache bytes it keeps), and is predicted to raise the objective by ``loss[h, o]`` (additive over
heads). A configuration costs the mean over heads of each kind; a :class:`Budget` bounds that mean, for one kind or
both (a fraction in (0, 1]).

:func:`solve` is greedy:

1. every head starts at its lowest-loss option (the cheapest of equal losses);
2. while a budget is exceeded, it takes the move (one head to another option) with the lowest added loss per unit
   of *useful* saving: the saving on each exceeded budget, capped at that budget's excess, summed over them. A move
   may not raise an exceeded budget nor push another past its limit. With one budget the moves walk each head's
   lower convex hull of (cost, loss), as the classic greedy for the multiple-choice knapsack does;
3. with every budget met it spends the slack: the move that lowers the loss most per unit of added cost among
   those that keep every budget, until none is left. The result is maximal: no single head can take a
   lower-loss option within the budget.

:func:`sweep` solves a list of budgets and keeps the predicted frontier monotone (a budget that admits a smaller
budget's choice takes it where that one predicts less loss); :func:`envelope` does the same for any measured
values. A budget the options cannot reach is a ValueError naming the cheapest cost they reach.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from flexsparse.validation import as_float

KINDS = ("tiles", "kv")
"""Cost kinds a budget may bound: attention tiles computed and KV-cache bytes kept (fractions of full)."""

KIND_WORDS = {"tiles": "causal attention tiles", "kv": "KV-cache bytes"}
_TOLERANCE = 1e-6  # per head: costs are sums of (possibly float32) fractions


@dataclass(frozen=True)
class Budget:
    """Upper bounds on a configuration's mean cost per KV head: ``tiles`` (share of the causal tiles computed)
    and/or ``kv`` (share of a full cache's bytes kept), each a fraction in (0, 1] or None (not bounded)."""

    tiles: float | None = None
    kv: float | None = None

    def __post_init__(self) -> None:
        for kind in KINDS:
            value = getattr(self, kind)
            if value is not None:
                value = as_float(f"{kind} budget", value)
                if not 0.0 < value <= 1.0:
                    raise ValueError(f"the {kind} budget must be a fraction in (0, 1] of a full model's "
                                     f"{KIND_WORDS[kind]}, got {value}")
                object.__setattr__(self, kind, value)
        if self.tiles is None and self.kv is None:
            raise ValueError("a budget needs tiles and/or kv (fractions in (0, 1])")

    def limits(self) -> dict[str, float]:
        """The bounded kinds and their limits."""
        return {kind: getattr(self, kind) for kind in KINDS if getattr(self, kind) is not None}

    def scaled(self, factor: float) -> Budget:
        """Every limit times ``factor`` (> 0), capped at 1."""
        factor = as_float("factor", factor, positive=True)
        return Budget(**{kind: min(1.0, round(value * factor, 12)) for kind, value in self.limits().items()})

    def admits(self, costs: Mapping[str, float]) -> bool:
        """Whether mean costs per kind meet every limit."""
        return all(costs[kind] <= limit + _TOLERANCE for kind, limit in self.limits().items())

    def __str__(self) -> str:
        return ", ".join(f"{kind} <= {limit:.4g}" for kind, limit in self.limits().items())


@dataclass(frozen=True)
class Choice:
    """One option index per head (long, the shape of ``loss`` without its last dimension), its predicted loss
    (the sum over heads) and its mean cost per kind."""

    options: Tensor
    loss: float
    costs: dict[str, float]


def _check(loss: Tensor, costs: Mapping[str, Tensor]) -> tuple[Tensor, dict[str, Tensor]]:
    """``loss`` and ``costs`` as float64 ``[N, O]`` (the leading dimensions flattened)."""
    if not isinstance(loss, Tensor) or loss.dim() < 2 or loss.shape[-1] < 1:
        raise ValueError(f"loss must be a tensor [..., options], got {getattr(loss, 'shape', type(loss).__name__)}")
    if not bool(torch.isfinite(loss).all()):
        raise ValueError("loss must be finite")
    if not isinstance(costs, Mapping) or not costs:
        raise TypeError("costs must map cost kinds to tensors of loss's shape")
    flat = {}
    for kind, cost in costs.items():
        if kind not in KINDS:
            raise ValueError(f"cost kinds must be of {KINDS}, got {kind!r}")
        if not isinstance(cost, Tensor) or cost.shape != loss.shape:
            raise ValueError(f"costs[{kind!r}] must be a tensor of loss's shape {tuple(loss.shape)}, got "
                             f"{getattr(cost, 'shape', type(cost).__name__)}")
        if not bool(((cost >= 0) & (cost <= 1)).all()):
            raise ValueError(f"costs[{kind!r}] must be fractions of a full head in [0, 1]")
        flat[kind] = cost.detach().double().reshape(-1, loss.shape[-1]).cpu()
    return loss.detach().double().reshape(-1, loss.shape[-1]).cpu(), flat


def cheapest(costs: Mapping[str, Tensor], kind: str) -> float:
    """The lowest mean cost of ``kind`` any choice reaches (every head at its cheapest option of that kind)."""
    return float(costs[kind].double().reshape(-1, costs[kind].shape[-1]).min(-1).values.mean())


def _picked(values: Tensor, choice: Tensor) -> Tensor:
    return values.gather(1, choice[:, None])[:, 0]


def solve(loss: Tensor, costs: Mapping[str, Tensor], budget: Budget) -> Choice:
    """The greedy choice (see the module docstring) of one option per head.

    ``loss`` ``[..., O]``: predicted objective increase of each head's options; ``costs``: kind -> ``[..., O]``
    fractions of a full head (every kind ``budget`` bounds, others are reported only). Returns a :class:`Choice`
    whose mean costs meet ``budget``; a ValueError when the options cannot reach it.
    """
    if not isinstance(budget, Budget):
        raise TypeError(f"budget must be a Budget, got {type(budget).__name__}")
    flat_loss, flat_costs = _check(loss, costs)
    limits = budget.limits()
    missing = [kind for kind in limits if kind not in flat_costs]
    if missing:
        raise ValueError(f"the budget bounds {missing} but costs has no such kind")
    for kind, limit in limits.items():
        floor = cheapest(flat_costs, kind)
        if floor > limit + _TOLERANCE:
            raise ValueError(f"the {kind} budget {limit:.4g} is below the cheapest these options reach "
                             f"({floor:.4f} of a full model's {KIND_WORDS[kind]}); raise it or add cheaper options")
    heads = flat_loss.shape[0]
    caps = {kind: limit * heads for kind, limit in limits.items()}
    bounded = {kind: flat_costs[kind] for kind in limits}
    tolerance = _TOLERANCE * heads
    # 1. the lowest loss per head, the cheapest (summed over kinds) among equal losses
    lowest = flat_loss == flat_loss.min(-1, keepdim=True).values
    choice = torch.where(lowest, sum(flat_costs.values()), math.inf).argmin(-1)

    def moves() -> tuple[Tensor, dict[str, Tensor], dict[str, float]]:
        """Added loss ``[N, O]``, saving per bounded kind ``[N, O]`` and the used sums, for every move."""
        added = flat_loss - _picked(flat_loss, choice)[:, None]
        saving = {kind: _picked(cost, choice)[:, None] - cost for kind, cost in bounded.items()}
        used = {kind: float(_picked(cost, choice).sum()) for kind, cost in bounded.items()}
        return added, saving, used

    # 2. meet the budgets
    while True:
        added, saving, used = moves()
        excess = {kind: used[kind] - caps[kind] for kind in bounded}
        if all(value <= tolerance for value in excess.values()):
            break
        useful = torch.zeros_like(flat_loss)
        allowed = torch.ones_like(flat_loss, dtype=torch.bool)
        for kind, value in excess.items():
            if value > tolerance:
                useful += saving[kind].clamp(max=value)
                allowed &= saving[kind] >= -tolerance
            else:
                allowed &= used[kind] - saving[kind] <= caps[kind] + tolerance
        allowed &= useful > tolerance
        if not bool(allowed.any()):
            reached = ", ".join(f"{kind} {used[kind] / heads:.4f}" for kind in bounded)
            raise ValueError(f"no choice of these options found that meets {budget} together (stuck at {reached});"
                             " loosen a budget or add options")
        ratio = torch.where(allowed, added / useful.clamp(min=tolerance), math.inf)
        head = int(ratio.min(-1).values.argmin())
        choice[head] = int(ratio[head].argmin())
    # 3. spend the slack
    while True:
        added, saving, used = moves()
        allowed = added < -tolerance
        extra = torch.zeros_like(flat_loss)
        for kind in bounded:
            allowed &= used[kind] - saving[kind] <= caps[kind] + tolerance
            extra += (-saving[kind]).clamp(min=0)
        if not bool(allowed.any()):
            break
        gain = torch.where(allowed, -added / extra.clamp(min=tolerance), -math.inf)
        head = int(gain.max(-1).values.argmax())
        choice[head] = int(gain[head].argmax())
    return _result(choice, flat_loss, flat_costs, loss.shape[:-1])


def _result(choice: Tensor, flat_loss: Tensor, flat_costs: Mapping[str, Tensor], shape) -> Choice:
    mean_costs = {kind: float(_picked(cost, choice).mean()) for kind, cost in flat_costs.items()}
    return Choice(choice.reshape(shape).clone(), float(_picked(flat_loss, choice).sum()), mean_costs)


def evaluate_choice(options: Tensor, loss: Tensor, costs: Mapping[str, Tensor]) -> Choice:
    """The predicted loss and mean costs of a given choice ``options`` (long, ``loss``'s shape without its last
    dimension)."""
    flat_loss, flat_costs = _check(loss, costs)
    if not isinstance(options, Tensor) or options.shape != loss.shape[:-1]:
        raise ValueError(f"options must be a tensor of shape {tuple(loss.shape[:-1])}")
    choice = options.reshape(-1).long().cpu()
    if bool(((choice < 0) | (choice >= flat_loss.shape[1])).any()):
        raise ValueError(f"options must be indices in [0, {flat_loss.shape[1]})")
    return _result(choice, flat_loss, flat_costs, loss.shape[:-1])


def envelope(budgets: Sequence[Budget], costs: Sequence[Mapping[str, float]], values: Sequence[float]) -> list[int]:
    """For each budget, the index of the configuration of lowest value among those whose ``costs`` meet it
    (configuration i has ``costs[i]`` and ``values[i]``); -1 where none does. A larger budget never gets a higher
    value than a smaller one: the frontier is monotone."""
    if len(costs) != len(values):
        raise ValueError(f"costs ({len(costs)}) and values ({len(values)}) must have one entry per configuration")
    picks = []
    for budget in budgets:
        fitting = [i for i, cost in enumerate(costs) if budget.admits(cost)]
        picks.append(min(fitting, key=lambda i: (values[i], i)) if fitting else -1)
    return picks


def sweep(loss: Tensor, costs: Mapping[str, Tensor], budgets: Sequence[Budget]) -> list[Choice]:
    """:func:`solve` at every budget, then each budget takes the lowest predicted loss among the choices that
    meet it (so a larger budget never predicts more loss than a smaller one)."""
    solved = [solve(loss, costs, budget) for budget in budgets]
    picks = envelope(budgets, [c.costs for c in solved], [c.loss for c in solved])
    return [solved[i] for i in picks]
