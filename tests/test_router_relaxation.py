"""Gumbel-softmax, the straight-through decision, inference decisions and temperature schedules."""

import math

import pytest
import torch

from flexsparse.routers import (
    CosineAnneal,
    ExponentialDecay,
    decisions,
    gumbel_noise,
    relaxed_decisions,
    schedule_from_dict,
)


def test_hard_forward_is_exactly_one_hot():
    logits = torch.randn(64, 8, 2) * 3
    weights = relaxed_decisions(logits, 1.3, generator=torch.Generator().manual_seed(0))
    assert set(weights.unique().tolist()) <= {0.0, 1.0}
    assert torch.equal(weights.sum(-1), torch.ones(64, 8))


def test_straight_through_gradient_is_the_soft_gradient():
    logits = torch.randn(5, 4, 2, dtype=torch.float64, requires_grad=True)
    noise = gumbel_noise((5, 4, 2), generator=torch.Generator().manual_seed(1)).double()
    upstream = torch.randn(5, 4, 2, dtype=torch.float64)
    hard = relaxed_decisions(logits, 0.7, gumbel=noise)
    (grad_hard,) = torch.autograd.grad((hard * upstream).sum(), logits)
    soft = relaxed_decisions(logits, 0.7, hard=False, gumbel=noise)
    (grad_soft,) = torch.autograd.grad((soft * upstream).sum(), logits)
    assert torch.equal(hard, torch.nn.functional.one_hot(soft.argmax(-1), 2).double())
    torch.testing.assert_close(grad_hard, grad_soft, rtol=0, atol=1e-15)
    assert grad_hard.abs().sum() > 0


def test_soft_path_finite_differences():
    logits = torch.randn(3, 4, 2, dtype=torch.float64, requires_grad=True)
    noise = gumbel_noise((3, 4, 2), generator=torch.Generator().manual_seed(2)).double()
    assert torch.autograd.gradcheck(lambda x: relaxed_decisions(x, 0.8, hard=False, gumbel=noise), (logits,))
    tau = torch.tensor(1.2, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x, t: relaxed_decisions(x, t, hard=False, gumbel=noise), (logits, tau))


def test_gumbel_max_frequencies_match_softmax():
    """argmax(logits + Gumbel) picks channel c with probability softmax(logits)[c], at any temperature."""
    logits = torch.tensor([[0.0, 0.0], [1.0, -0.5], [-2.0, 0.3]])
    samples = relaxed_decisions(logits.expand(40000, 3, 2), 1.5, generator=torch.Generator().manual_seed(3))
    frequency = samples.mean(0)
    torch.testing.assert_close(frequency, logits.softmax(-1), atol=0.012, rtol=0)


def test_inference_is_deterministic_argmax():
    logits = torch.tensor([[0.3, 0.1], [0.1, 0.3], [0.2, 0.2]])
    weights = relaxed_decisions(logits, noise=False)
    assert torch.equal(weights, torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 0.0]]))  # a tie goes to full
    assert torch.equal(decisions(logits), torch.tensor([False, True, False]))
    assert torch.equal(relaxed_decisions(logits, 0.1, noise=False), weights)


def test_seeded_noise_is_reproducible():
    logits = torch.randn(4, 8, 2)
    first = relaxed_decisions(logits, hard=False, generator=torch.Generator().manual_seed(7))
    second = relaxed_decisions(logits, hard=False, generator=torch.Generator().manual_seed(7))
    assert torch.equal(first, second)
    assert torch.isfinite(gumbel_noise((100000,), generator=torch.Generator().manual_seed(0))).all()


def test_cosine_anneal_follows_the_authors_schedule():
    schedule = CosineAnneal(total_steps=300)
    assert schedule.anneal_steps == 180
    for step in (0, 1, 45, 90, 179):
        expected = 1.0 + 0.25 * (1 + math.cos(math.pi * step / 180))
        assert schedule(step) == pytest.approx(expected, abs=1e-12)
    assert schedule(0) == 1.5 and schedule(90) == pytest.approx(1.25) and schedule(180) == 1.0
    assert schedule(10_000) == 1.0
    values = [schedule(s) for s in range(301)]
    assert all(a >= b for a, b in zip(values, values[1:]))
    assert CosineAnneal(total_steps=7, fraction=0.6).anneal_steps == 5  # ceil(4.2)


def test_exponential_decay_is_eq_14():
    literal = ExponentialDecay(initial=2.0, minimum=0.5, rate=0.6)
    assert literal(0) == 2.0
    assert literal(1) == pytest.approx(2.0 * math.exp(-0.6))
    assert literal(3) == 0.5  # 2 e^-1.8 = 0.33 is below the floor
    spread = ExponentialDecay(initial=1.5, minimum=0.1, step_scale=300)
    assert spread(300) == pytest.approx(1.5 * math.exp(-0.6))


def test_schedule_configs_round_trip():
    for schedule in (CosineAnneal(100, start=2.0, end=0.5, fraction=0.3), ExponentialDecay(step_scale=50)):
        config = schedule.as_dict()
        assert schedule_from_dict(config) == schedule
        assert all(isinstance(v, (str, int, float)) for v in config.values())


def test_bad_input():
    with pytest.raises(ValueError, match="tau"):
        relaxed_decisions(torch.zeros(2, 2), 0.0)
    with pytest.raises(ValueError, match="logits"):
        relaxed_decisions(torch.zeros(2, 3))
    with pytest.raises(ValueError, match="gumbel"):
        relaxed_decisions(torch.zeros(2, 2), gumbel=torch.zeros(3, 2))
    with pytest.raises(ValueError, match="total_steps"):
        CosineAnneal(0)
    with pytest.raises(ValueError, match="fraction"):
        CosineAnneal(10, fraction=1.5)
    with pytest.raises(ValueError, match="step"):
        CosineAnneal(10)(-1)
    with pytest.raises(ValueError, match="minimum"):
        ExponentialDecay(minimum=0)
    with pytest.raises(ValueError, match="kind"):
        schedule_from_dict({"kind": "linear"})
