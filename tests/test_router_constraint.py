"""MSR / ESR per sequence (against HybridAttention's own stats) and the Lagrangian sparsity regulariser."""

import pytest
import torch

from flexsparse import HybridAttention
from flexsparse.masks import Causal, Geometry, Positions, SinkWindow
from flexsparse.metrics import model_sparsity_ratio
from flexsparse.routers import (
    SparsityConstraint,
    attended_pairs,
    causal_pairs,
    esr,
    msr,
    relaxed_decisions,
)

PATTERNS = {"full": Causal(), "ssa": SinkWindow(sink=2, window=6)}


def test_msr_is_the_metric_per_sequence_and_differentiable():
    logits = torch.randn(3, 4, 5, 2, requires_grad=True)  # [B, L, H_kv, 2]
    weights = relaxed_decisions(logits, generator=torch.Generator().manual_seed(0))
    sparse = weights[..., 1]
    per_sequence = msr(sparse)
    for b in range(3):
        assert per_sequence[b] == model_sparsity_ratio(sparse[b] > 0.5)
    layers = [sparse[:, i] for i in range(4)]
    assert torch.equal(msr(layers), per_sequence)
    per_sequence.sum().backward()
    assert logits.grad.abs().sum() > 0
    layer_decisions = [torch.tensor([[1.0], [0.0]]), torch.tensor([[1.0], [1.0]])]  # a layer router: G = 1
    assert msr(layer_decisions).tolist() == [1.0, 0.5]


def test_attended_pairs_closed_form():
    geo = Geometry(4, 20)
    causal = causal_pairs(geo)
    assert causal.tolist() == [210.0]
    assert attended_pairs(Causal(), geo, 2).tolist() == [[210.0, 210.0]]
    window = sum(min(i + 1, 2 + 6) if i >= 2 + 6 else i + 1 for i in range(20))  # sink 2 + window 6 from i = 8
    assert attended_pairs(SinkWindow(sink=2, window=6), geo, 2).tolist() == [[float(window)] * 2]


def test_esr_matches_hybrid_attention_stats():
    attn = HybridAttention(4, 2, 8, PATTERNS, backend="dense", block_size=8)
    seq = 24
    q, k, v = torch.randn(1, 4, seq, 8), torch.randn(1, 2, seq, 8), torch.randn(1, 2, seq, 8)
    geo = Geometry(4, seq, block_size=8)
    full = attended_pairs(PATTERNS["full"], geo, 2)
    sparse = attended_pairs(PATTERNS["ssa"], geo, 2)
    for modes in ([0, 1], [1, 1], [0, 0]):
        attn(q, k, v, modes=torch.tensor([modes]))
        weights = torch.tensor([modes], dtype=torch.float32)
        torch.testing.assert_close(esr(weights, full, sparse, causal_pairs(geo)), attn.last_stats.esr.reshape(1))
        assert msr(weights)[0] == attn.last_stats.msr


def test_esr_with_padding_per_sequence():
    seq = 24
    mask = torch.ones(2, seq, dtype=torch.bool)
    mask[1, :10] = False
    geo = Geometry(4, seq, block_size=8, positions=Positions.from_padding_mask(mask, seq))
    full, sparse = (attended_pairs(p, geo, 2) for p in PATTERNS.values())  # [2, 2]
    weights = torch.tensor([[1.0, 0.0], [1.0, 1.0]])
    values = esr(weights, full, sparse, causal_pairs(geo))
    attn = HybridAttention(4, 2, 8, PATTERNS, backend="dense", block_size=8)
    for b, length in ((0, seq), (1, seq - 10)):
        x = torch.randn(1, 4, length, 8)
        attn(x, x[:, :2], x[:, :2], modes=weights[b:b + 1].long())
        torch.testing.assert_close(values[b], attn.last_stats.esr)


def test_esr_gradient():
    full = torch.tensor([[100.0, 100.0]], dtype=torch.float64)
    sparse = torch.tensor([[40.0, 70.0]], dtype=torch.float64)
    weights = torch.rand(3, 4, 2, dtype=torch.float64, requires_grad=True)  # [B, L, G]
    value = esr(weights, full, sparse, 100.0)
    (grad,) = torch.autograd.grad(value.sum(), weights)
    step = torch.zeros_like(weights)
    step[1, 2, 1] = 0.05  # central difference (ESR is float32, as the metric returns it)
    numeric = (esr(weights + step, full, sparse, 100.0) - esr(weights - step, full, sparse, 100.0)).sum() / 0.1
    assert grad[1, 2, 1].item() == pytest.approx(numeric.item(), abs=1e-5)
    assert grad[1, 2, 1].item() == pytest.approx(0.3 / 8)
    assert grad[0].abs().sum() > 0 and grad[0, 0, 0].item() == pytest.approx(0.6 / 8)
    expected = (weights * torch.tensor([0.6, 0.3], dtype=torch.float64)).mean((1, 2))
    torch.testing.assert_close(value.double(), expected, atol=1e-6, rtol=1e-6)


def test_constraint_value_per_task():
    constraint = SparsityConstraint({"qa": 0.7, "summ": 1.0, "code": 1.0}, seed=0)
    with torch.no_grad():
        constraint.lambda_1.copy_(torch.tensor([0.1, 0.2, 0.3]))
        constraint.lambda_2.copy_(torch.tensor([1.0, 2.0, 3.0]))
    sparsity = torch.tensor([0.5, 0.9, 0.8, 0.6])
    value = constraint(sparsity, ["qa", "qa", "summ", "qa"])
    qa = [0.1 * abs(s - 0.7) + 1.0 * (s - 0.7) ** 2 for s in (0.5, 0.9, 0.6)]
    summ = 0.2 * 0.2 + 2.0 * 0.04
    assert value.item() == pytest.approx((sum(qa) / 3 + summ) / 2, rel=1e-6)  # mean over the tasks present
    signed = SparsityConstraint({"qa": 0.7}, linear="signed", init="zeros")
    with torch.no_grad():
        signed.lambda_1.fill_(0.5)
    assert signed(torch.tensor([0.5]), torch.tensor([0])).item() == pytest.approx(0.5 * -0.2)


def test_multipliers_ascend_and_router_descends():
    """One maximising step moves the multipliers up with the violation; the sparsity gradient points at the target."""
    constraint = SparsityConstraint.from_categories(robust=["summ"], sensitive=["qa"], seed=1)
    assert constraint.targets.tolist() == pytest.approx([1.0, 0.7])
    before = [p.detach().clone() for p in (constraint.lambda_1, constraint.lambda_2)]
    sparsity = torch.tensor([0.4, 0.9], requires_grad=True)  # summ below 1.0, qa above 0.7
    loss = constraint(sparsity, ["summ", "qa"])
    loss.backward()
    torch.optim.SGD(constraint.parameters(), lr=0.1, maximize=True).step()
    assert (constraint.lambda_1 > before[0]).all() and (constraint.lambda_2 > before[1]).all()
    assert sparsity.grad[0] < 0 and sparsity.grad[1] > 0  # descending moves summ up, qa down


def test_signed_multiplier_follows_the_sign_of_the_violation():
    constraint = SparsityConstraint({"a": 0.5, "b": 0.5}, linear="signed", init="zeros")
    constraint(torch.tensor([0.8, 0.1]), ["a", "b"]).backward()
    assert constraint.lambda_1.grad[0] > 0 and constraint.lambda_1.grad[1] < 0


def test_initialisation_as_the_authors():
    first = SparsityConstraint({"a": 1.0, "b": 0.7, "c": 0.7}, seed=5)
    second = SparsityConstraint({"a": 1.0, "b": 0.7, "c": 0.7}, seed=5)
    for p, q in zip(first.parameters(), second.parameters()):
        assert torch.equal(p, q) and (p >= 0).all() and (p < 0.5).all()
    zeros = SparsityConstraint({"a": 1.0}, init="zeros")
    assert zeros.lambda_1.item() == 0 and zeros.lambda_2.item() == 0
    assert first.config() == {"targets": {"a": 1.0, "b": pytest.approx(0.7), "c": pytest.approx(0.7)},
                               "linear": "abs", "init": "uniform"}


def test_bad_input():
    with pytest.raises(ValueError, match=r"targets\['qa'\]"):
        SparsityConstraint({"qa": 1.5})
    with pytest.raises(ValueError, match=r"targets\['qa'\]"):
        SparsityConstraint({"qa": -0.1})
    with pytest.raises(TypeError, match="targets"):
        SparsityConstraint({})
    with pytest.raises(ValueError, match="linear"):
        SparsityConstraint({"qa": 0.7}, linear="square")
    with pytest.raises(ValueError, match="both robust and sensitive"):
        SparsityConstraint.from_categories(robust=["x"], sensitive=["x"])
    constraint = SparsityConstraint({"qa": 0.7, "summ": 1.0})
    with pytest.raises(ValueError, match=r"unknown task names \['chat'\]"):
        constraint(torch.tensor([0.5]), ["chat"])
    with pytest.raises(ValueError, match="tasks indices"):
        constraint(torch.tensor([0.5]), torch.tensor([2]))
    with pytest.raises(ValueError, match="sequences"):
        constraint(torch.tensor([0.5, 0.2]), ["qa"])
    with pytest.raises(ValueError, match="num_kv_heads"):
        attended_pairs(Causal(), Geometry(4, 8), 3)
    with pytest.raises(ValueError, match="sparse_weights"):
        msr(torch.zeros(3))
