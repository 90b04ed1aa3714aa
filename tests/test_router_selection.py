"""Static selectors: HSA discrepancy, retrieval score and layer entropy against literal references; the ranking."""

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from flexsparse.masks import Causal, Geometry, SinkWindow
from flexsparse.reference import attention as reference
from flexsparse.routers import (
    entropy_selection,
    hsa_discrepancy,
    hsa_selection,
    layer_entropy,
    retrieval_scores,
    retrieval_selection,
    select_modes,
)

SWA = SinkWindow(sink=2, window=6)


def calibration(batch=2, heads=4, kv_heads=2, seq=32, dim=8, model=24, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, seq, dim, generator=gen)
    k, v = (torch.randn(batch, kv_heads, seq, dim, generator=gen) for _ in range(2))
    o_proj = torch.randn(model, heads * dim, generator=gen) / math.sqrt(heads * dim)
    return q, k, v, o_proj


def literal_algorithm_1(q, k, v, o_proj, sparse):
    """For each KV head h: the layer output with h in the sparse pattern, the others full; the Frobenius norm of
    its change (float64, dense masks)."""
    batch, heads, seq, _ = q.shape
    kv_heads = k.shape[1]
    geo = Geometry(heads, seq)
    full_mask, sparse_mask = Causal().dense(geo)[0, 0], sparse.dense(geo)[0, 0]
    group = heads // kv_heads

    def layer_output(sparse_kv_head):
        mask = torch.stack([sparse_mask if h // group == sparse_kv_head else full_mask for h in range(heads)])
        out = reference(q.double(), k.double(), v.double(), mask[None])
        return out.permute(0, 2, 1, 3).reshape(batch, seq, -1) @ o_proj.double().T

    base = layer_output(None)
    return torch.stack([(layer_output(h) - base).norm() for h in range(kv_heads)])


@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (4, 4), (6, 2)])
def test_hsa_discrepancy_matches_algorithm_1(heads, kv_heads):
    q, k, v, o_proj = calibration(heads=heads, kv_heads=kv_heads)
    ours = hsa_discrepancy(q, k, v, o_proj, SWA, backend="dense", block_size=8)
    torch.testing.assert_close(ours.double(), literal_algorithm_1(q, k, v, o_proj, SWA), rtol=1e-4, atol=1e-6)


def test_hsa_discrepancy_ignores_padding_rows():
    q, k, v, o_proj = calibration(batch=1, seq=40)
    mask = torch.ones(1, 40, dtype=torch.bool)
    mask[0, :8] = False
    padded = hsa_discrepancy(q, k, v, o_proj, SWA, key_padding_mask=mask, backend="dense", block_size=8)
    alone = hsa_discrepancy(q[:, :, 8:], k[:, :, 8:], v[:, :, 8:], o_proj, SWA, backend="dense", block_size=8)
    torch.testing.assert_close(padded, alone, rtol=1e-4, atol=1e-6)


def test_hsa_selection_keeps_the_largest_discrepancies():
    discrepancy = torch.tensor([[0.1, 0.9, 0.5, 0.2, 0.8, 0.3, 0.4, 0.7],
                                [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0]])
    modes = hsa_selection(discrepancy, 0.75)
    assert modes[0] == ["sparse", "full", "sparse", "sparse", "full", "sparse", "sparse", "sparse"]
    assert modes[1] == ["sparse"] * 6 + ["full"] * 2
    assert [row.count("full") for row in hsa_selection(discrepancy, 1.0)] == [1, 1]  # at least one full head
    assert hsa_selection(discrepancy, 0.0) == [["full"] * 8] * 2
    kept = hsa_selection(torch.rand(4, 8), 0.75, keep_first_last_full=True, full=0, sparse=1)
    assert kept[0] == kept[3] == [0] * 8 and [row.count(0) for row in kept[1:3]] == [2, 2]


def reference_retrieval(q, k, needle, mask):
    batch, heads, seq, dim = q.shape
    group = heads // k.shape[1]
    out = torch.zeros(heads, dtype=torch.float64)
    for b in range(batch):
        real = mask[b].nonzero().flatten()
        last = int(real[-1])
        keys = k[b].double().repeat_interleave(group, 0)  # [H, S, d]
        scores = torch.einsum("hd,hsd->hs", q[b, :, last].double(), keys) / math.sqrt(dim)
        scores[:, ~mask[b]] = float("-inf")
        scores[:, last + 1:] = float("-inf")
        out += scores.softmax(-1)[:, needle[b]].sum(-1)
    return (out / batch).view(k.shape[1], group).mean(-1)


def test_retrieval_scores_match_reference():
    q, k, _, _ = calibration(batch=3, seq=20)
    needle = torch.zeros(3, 20, dtype=torch.bool)
    needle[0, 3:5], needle[1, 10], needle[2, 7:9] = True, True, True
    mask = torch.ones(3, 20, dtype=torch.bool)
    mask[1, :4] = False  # left padding
    mask[2, 15:] = False  # right padding: the last real token is 14
    ours = retrieval_scores(q, k, needle, key_padding_mask=mask)
    torch.testing.assert_close(ours.double(), reference_retrieval(q, k, needle, mask), rtol=1e-5, atol=1e-7)
    no_pad = torch.ones(3, 20, dtype=torch.bool)
    torch.testing.assert_close(retrieval_scores(q, k, needle).double(), reference_retrieval(q, k, needle, no_pad),
                               rtol=1e-5, atol=1e-7)


def test_retrieval_selection_is_model_wide():
    scores = torch.tensor([[0.9, 0.1], [0.8, 0.7], [0.2, 0.3]])
    assert retrieval_selection(scores, 0.5) == [["full", "sparse"], ["full", "full"], ["sparse", "sparse"]]
    # floor((1 - 0.3) * 6) = 4 full heads: the third layer keeps one only when asked, the rest by rank
    assert retrieval_selection(scores, 0.3) == [["full", "sparse"], ["full", "full"], ["sparse", "full"]]
    assert retrieval_selection(scores, 0.4) == [["full", "sparse"], ["full", "full"], ["sparse", "sparse"]]
    assert retrieval_selection(scores, 0.4, min_full_per_layer=1) == [["full", "sparse"], ["full", "sparse"],
                                                                        ["sparse", "full"]]


def reference_entropy(x, top_k=None):
    values = []
    for seq in x:
        s = torch.linalg.svdvals(seq.double()) ** 2
        lam = (s / s.sum()).sort(descending=True).values
        lam = lam if top_k is None else lam[:top_k]
        lam = lam[lam > 0]
        values.append(-(lam * lam.log()).sum())
    return torch.stack(values).mean()


@pytest.mark.parametrize("seq,dim", [(40, 12), (12, 40)])
def test_layer_entropy_matches_singular_values(seq, dim):
    x = torch.randn(3, seq, dim) @ torch.randn(dim, dim)
    torch.testing.assert_close(layer_entropy(x), reference_entropy(x))
    torch.testing.assert_close(layer_entropy(x, top_k=4), reference_entropy(x, top_k=4))
    torch.testing.assert_close(layer_entropy(x[0]), reference_entropy(x[:1]))


def test_layer_entropy_bounds_and_padding():
    isotropic = torch.linalg.qr(torch.randn(64, 16)).Q[None] * 3  # orthonormal columns: flat spectrum
    assert layer_entropy(isotropic).item() == pytest.approx(math.log(16))
    rank_one = torch.randn(1, 30, 1) * torch.randn(1, 1, 16)
    assert layer_entropy(rank_one).item() == pytest.approx(0.0, abs=1e-9)
    x = torch.randn(2, 20, 8)
    mask = torch.ones(2, 20, dtype=torch.bool)
    mask[0, :5] = False
    padded = x.clone()
    padded[0, :5] = 1e3  # padding values never count
    expected = (layer_entropy(x[0, 5:]) + layer_entropy(x[1])) / 2
    torch.testing.assert_close(layer_entropy(padded, key_padding_mask=mask), expected)


def test_entropy_selection_gives_whole_layers():
    modes = entropy_selection(torch.tensor([3.0, 1.0, 2.0, 0.5]), 0.5, num_kv_heads=3)
    assert modes == [["full"] * 3, ["sparse"] * 3, ["full"] * 3, ["sparse"] * 3]
    assert entropy_selection([3.0, 1.0, 2.0, 0.5], 0.75, 2, keep_first_last_full=True) == [
        ["full"] * 2, ["sparse"] * 2, ["sparse"] * 2, ["full"] * 2]


def test_selection_is_deterministic_with_ties_by_index():
    ties = torch.ones(3, 4)
    assert hsa_selection(ties, 0.5) == [["full", "full", "sparse", "sparse"]] * 3
    assert retrieval_selection(ties, 0.75) == [["full", "full", "full", "sparse"]] + [["sparse"] * 4] * 2
    q, k, v, o_proj = calibration(seed=3)
    first = hsa_discrepancy(q, k, v, o_proj, SWA, backend="dense", block_size=8)
    q2, k2, v2, o2 = calibration(seed=3)
    assert torch.equal(first, hsa_discrepancy(q2, k2, v2, o2, SWA, backend="dense", block_size=8))


@given(
    layers=st.integers(1, 5), units=st.integers(1, 6), rho=st.floats(0, 1), per_layer=st.booleans(),
    min_full=st.integers(0, 2), keep=st.booleans(), seed=st.integers(0, 1000),
)
def test_selection_invariants(layers, units, rho, per_layer, min_full, keep, seed):
    scores = torch.rand(layers, units, generator=torch.Generator().manual_seed(seed))
    min_full = min(min_full, units)
    modes = select_modes(scores, rho, per_layer=per_layer, min_full_per_layer=min_full, keep_first_last_full=keep)
    full = torch.tensor([[m == "full" for m in row] for row in modes])
    assert (full.sum(1) >= min_full).all()
    if keep:
        assert full[0].all() and full[-1].all()
    quota = math.floor((1 - rho) * (units if per_layer else layers * units) + 1e-9)
    if per_layer:
        assert (full.sum(1) >= quota).all()
    else:
        assert full.sum() >= quota
    free = [layer for layer in range(layers) if not (keep and layer in (0, layers - 1))]
    for layer in free:  # within a layer, every full unit outscores every sparse one
        kept, dropped = scores[layer][full[layer]], scores[layer][~full[layer]]
        if kept.numel() and dropped.numel():
            assert kept.min() >= dropped.max()
    if not per_layer and min_full == 0 and free:  # model-wide: the ranking alone decides the free layers
        kept, dropped = scores[free][full[free]], scores[free][~full[free]]
        if kept.numel() and dropped.numel():
            assert kept.min() >= dropped.max()


def test_bad_input():
    scores = torch.rand(2, 4)
    with pytest.raises(ValueError, match="rho"):
        hsa_selection(scores, 1.2)
    with pytest.raises(ValueError, match="rho"):
        retrieval_selection(scores, -0.1)
    with pytest.raises(ValueError, match="NaN"):
        hsa_selection(torch.tensor([[float("nan"), 1.0]]), 0.5)
    with pytest.raises(ValueError, match="min_full_per_layer"):
        select_modes(scores, 0.5, per_layer=True, min_full_per_layer=5)
    with pytest.raises(ValueError, match="num_kv_heads"):
        select_modes(scores, 0.5, per_layer=True, num_kv_heads=3)
    with pytest.raises(ValueError, match="full and sparse"):
        hsa_selection(scores, 0.5, full="a", sparse="a")
    q, k, v, o_proj = calibration()
    with pytest.raises(ValueError, match="o_proj_weight"):
        hsa_discrepancy(q, k, v, o_proj[:, :-1], SWA, backend="dense")
    with pytest.raises(ValueError, match="multiple"):
        hsa_discrepancy(q, k[:, :1].expand(2, 3, 32, 8), v, o_proj, SWA, backend="dense")
    with pytest.raises(ValueError, match="needle_mask"):
        retrieval_scores(q, k, torch.ones(2, 31, dtype=torch.bool))
    with pytest.raises(ValueError, match="top_k"):
        layer_entropy(torch.randn(4, 3), top_k=0)
    with pytest.raises(ValueError, match="hidden_states"):
        layer_entropy(torch.randn(4))
