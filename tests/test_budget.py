"""The budgeted choice of one option per KV head (flexsparse.eval.budget) on synthetic losses and costs.

Checks: budgets outside (0, 1] are refused; a choice meets every budget it is given (one kind, the other, both)
and is maximal (no single head can take a lower-loss option within the budget); with one budget and losses convex in
the cost, it equals the exhaustive optimum; the swept frontier is monotone; a budget below the cheapest reachable
cost is refused with the cost it would need, and two budgets the options cannot meet together are refused.
"""

import itertools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flexsparse.eval.budget import Budget, cheapest, envelope, evaluate_choice, solve, sweep

# option 0: full (no loss); then cheaper options with more loss
TILES = torch.tensor([1.0, 0.6, 0.35, 0.2, 0.1, 0.3, 0.15])
KV = torch.tensor([1.0, 0.5, 0.25, 0.12, 0.06, 1.0, 1.0])  # the last two: XAttention-like (all KV, few tiles)


def _instance(seed: int, heads: int = 12):
    """Losses ``[heads, 7]`` increasing as options get cheaper, per head scales; costs per kind."""
    generator = torch.Generator().manual_seed(seed)
    scale = torch.rand(heads, 1, generator=generator) * 2
    steps = torch.rand(heads, 4, generator=generator).cumsum(-1)
    xa = torch.rand(heads, 2, generator=generator) * 3
    loss = torch.cat([torch.zeros(heads, 1), steps, xa], -1) * scale
    costs = {"tiles": TILES.expand(heads, -1).clone(), "kv": KV.expand(heads, -1).clone()}
    return loss, costs


def _brute_force(loss, costs, budget):
    """The exhaustive optimum's loss (every combination of options, vectorised)."""
    heads, count = loss.shape
    combos = torch.tensor(list(itertools.product(range(count), repeat=heads)))  # [C, heads]
    rows = torch.arange(heads)
    total = loss.double()[rows, combos].sum(-1)
    fits = torch.ones(len(combos), dtype=torch.bool)
    for kind, limit in budget.limits().items():
        fits &= costs[kind].double()[rows, combos].mean(-1) <= limit + 1e-9
    return float(total[fits].min())


@pytest.mark.parametrize("bad", [0.0, -0.1, 1.5, math.inf])
def test_budgets_outside_zero_one_are_refused(bad):
    with pytest.raises(ValueError, match="tiles budget"):
        Budget(tiles=bad)
    with pytest.raises(ValueError, match="kv budget"):
        Budget(tiles=0.5, kv=bad)
    with pytest.raises(ValueError, match="tiles and/or kv"):
        Budget()
    with pytest.raises(TypeError, match="kv budget"):
        Budget(kv="0.5")


@pytest.mark.parametrize("budget", [Budget(tiles=0.45), Budget(kv=0.3), Budget(tiles=0.4, kv=0.5),
                                    Budget(tiles=1.0), Budget(tiles=0.1, kv=0.06)])
@pytest.mark.parametrize("seed", range(4))
def test_the_choice_meets_each_budget_and_is_maximal(budget, seed):
    loss, costs = _instance(seed)
    found = solve(loss, costs, budget)
    assert budget.admits(found.costs)
    recomputed = evaluate_choice(found.options, loss, costs)
    assert recomputed.costs == pytest.approx(found.costs) and recomputed.loss == pytest.approx(found.loss)
    # maximal: no single head moves to a lower-loss option that keeps every budget
    for head in range(loss.shape[0]):
        for option in range(loss.shape[1]):
            if loss[head, option] < loss[head, found.options[head]] - 1e-9:
                moved = found.options.clone()
                moved[head] = option
                assert not budget.admits(evaluate_choice(moved, loss, costs).costs)
    if budget.tiles == 1.0:
        assert found.loss == 0 and bool((found.options == 0).all())


def test_both_budgets_bind_where_each_alone_would_not_suffice():
    loss, costs = _instance(7)
    tiles_only = solve(loss, costs, Budget(tiles=0.3))
    both = solve(loss, costs, Budget(tiles=0.3, kv=0.3))
    assert tiles_only.costs["kv"] > 0.3  # XAttention-like options keep every key
    assert both.costs["kv"] <= 0.3 + 1e-9 and both.costs["tiles"] <= 0.3 + 1e-9
    assert both.loss >= tiles_only.loss


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000), limit=st.floats(0.12, 0.95))
def test_one_budget_with_convex_losses_is_the_exhaustive_optimum_up_to_one_head(seed, limit):
    """With one budget and each head's loss convex in its cost, the greedy is within one head's move of the
    optimum: its loss is at most the optimum's plus the largest single step it could have avoided."""
    generator = torch.Generator().manual_seed(seed)
    heads = 4
    tiles = torch.tensor([1.0, 0.5, 0.25, 0.1]).expand(heads, -1)
    slopes = torch.rand(heads, 1, generator=generator) + 0.1
    loss = slopes * torch.tensor([0.0, 0.5, 1.5, 3.0])  # convex in the cost
    costs = {"tiles": tiles.clone()}
    budget = Budget(tiles=limit)
    found = solve(loss, costs, budget)
    optimum = _brute_force(loss, costs, budget)
    assert budget.admits(found.costs)
    assert found.loss >= optimum - 1e-9
    assert found.loss <= optimum + float(loss.diff(dim=-1).max()) + 1e-9


def test_two_budgets_match_the_exhaustive_optimum_on_small_instances():
    for seed in range(3):
        loss, costs = _instance(seed, heads=4)
        loss, costs = loss[:, [0, 1, 3, 5]], {k: c[:, [0, 1, 3, 5]] for k, c in costs.items()}
        budget = Budget(tiles=0.45, kv=0.7)
        found = solve(loss, costs, budget)
        optimum = _brute_force(loss, costs, budget)
        assert budget.admits(found.costs)
        assert found.loss <= optimum * 1.5 + 1e-9  # greedy, not exact: close on these


def test_the_swept_frontier_is_monotone():
    loss, costs = _instance(3, heads=30)
    budgets = [Budget(tiles=t, kv=min(1.0, 1.2 * t)) for t in (0.12, 0.2, 0.3, 0.45, 0.6, 0.8, 1.0)]
    choices = sweep(loss, costs, budgets)
    losses = [c.loss for c in choices]
    assert losses == sorted(losses, reverse=True)
    assert losses[-1] == 0.0
    for budget, choice in zip(budgets, choices):
        assert budget.admits(choice.costs)
    # the envelope of measured values: a larger budget takes a smaller one's configuration when it measures better
    picks = envelope(budgets[:3], [{"tiles": 0.15, "kv": 0.1}, {"tiles": 0.25, "kv": 0.2}], [2.0, 3.0])
    assert picks == [-1, 0, 0]


def test_an_unreachable_budget_is_refused_with_the_cheapest_cost():
    loss, costs = _instance(0)
    assert cheapest(costs, "tiles") == pytest.approx(0.1)
    with pytest.raises(ValueError, match=r"tiles budget 0\.05 is below the cheapest these options reach \(0\.1000"):
        solve(loss, costs, Budget(tiles=0.05))
    with pytest.raises(ValueError, match="kv budget"):
        solve(loss, costs, Budget(kv=0.05))
    # each budget alone is reachable, both together are not: the cheap-tile options keep every key
    loss2 = torch.zeros(2, 3)
    costs2 = {"tiles": torch.tensor([[1.0, 0.1, 0.9]] * 2), "kv": torch.tensor([[1.0, 1.0, 0.1]] * 2)}
    with pytest.raises(ValueError, match="no choice of these options found that meets"):
        solve(loss2, costs2, Budget(tiles=0.2, kv=0.2))
    with pytest.raises(ValueError, match="bounds"):
        solve(loss, {"tiles": costs["tiles"]}, Budget(kv=0.5))
    with pytest.raises(ValueError, match="finite"):
        solve(torch.full((2, 3), math.nan), {"tiles": torch.ones(2, 3)}, Budget(tiles=0.5))
    with pytest.raises(ValueError, match=r"fractions of a full head"):
        solve(torch.zeros(2, 3), {"tiles": torch.full((2, 3), 2.0)}, Budget(tiles=0.5))


def test_layer_shaped_inputs_give_layer_shaped_choices():
    loss, costs = _instance(1, heads=12)
    shaped = solve(loss.view(4, 3, -1), {k: c.view(4, 3, -1) for k, c in costs.items()}, Budget(tiles=0.4))
    flat = solve(loss, costs, Budget(tiles=0.4))
    assert shaped.options.shape == (4, 3)
    assert torch.equal(shaped.options.flatten(), flat.options)


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), tiles=st.floats(0.05, 1.0), kv=st.floats(0.05, 1.0) | st.none())
def test_any_solved_choice_meets_its_budgets(seed, tiles, kv):
    generator = torch.Generator().manual_seed(seed)
    heads, count = 9, 5
    loss = torch.rand(heads, count, generator=generator)
    loss[:, 0] = 0  # full: no loss, full cost
    costs = {kind: torch.rand(heads, count, generator=generator) for kind in ("tiles", "kv")}
    for cost in costs.values():
        cost[:, 0] = 1
    budget = Budget(tiles=tiles, kv=kv)
    try:
        found = solve(loss, costs, budget)
    except ValueError as error:
        assert "below the cheapest" in str(error) or "no choice of these options found" in str(error)
        return
    assert budget.admits(found.costs)
    assert found.loss == pytest.approx(float(loss.gather(1, found.options[:, None]).sum()))
