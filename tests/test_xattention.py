"""XAttention (XA) selection and TriangleMix (TA)."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from flexsparse import HybridAttention
from flexsparse.kernels.xa_estimate import antidiagonal_block_mass
from flexsparse.masks import BlockTable, Causal, Geometry, SinkWindow, TriangleMix, XAttention
from flexsparse.masks.xa_selection import select_blocks
from flexsparse.reference import attention as reference
from flexsparse.verify import causal, receptive_field
from tests.test_hybrid_attention import ATOL, qkv
from tests.util import assert_key_runs_match_dense, assert_pattern_consistent


def literal_block_mass(q, k, stride, block):
    """XAttention's scoring written out: antidiagonal sums of stride x stride tiles, softmax per tile row."""
    batch, heads, seq, dim = q.shape
    k = k.repeat_interleave(heads // k.shape[1], dim=1)
    tiles = -(-seq // stride)
    scores = torch.full((batch, heads, tiles, tiles), float("-inf"))
    for i in range(tiles):
        for j in range(i + 1):  # causal at tile level
            total = torch.zeros(batch, heads)
            for t in range(stride):
                qi, kj = i * stride + stride - 1 - t, j * stride + t
                if qi < seq and kj < seq:
                    total += (q[:, :, qi] * k[:, :, kj]).sum(-1)
            scores[:, :, i, j] = total / dim**0.5 / stride
    probs = torch.softmax(scores, -1)
    blocks = -(-seq // block)
    per = block // stride
    out = torch.zeros(batch, heads, blocks, blocks)
    for i in range(tiles):
        if i * stride >= seq:
            continue
        for j in range(i + 1):
            out[:, :, i // per, j // per] += probs[:, :, i, j]
    return out


@pytest.mark.parametrize("seq,stride,block", [(64, 4, 16), (100, 8, 32), (37, 4, 16), (128, 16, 32)])
def test_estimator_matches_the_literal_scoring(seq, stride, block):
    q, k, _ = qkv(2, 4, 2, seq)
    torch.testing.assert_close(antidiagonal_block_mass(q, k, stride, block), literal_block_mass(q, k, stride, block),
                               atol=1e-5, rtol=1e-5)


@given(seed=st.integers(0, 10_000), threshold=st.floats(0.05, 1.0), blocks=st.integers(1, 8))
def test_selection_reaches_the_threshold_with_the_fewest_blocks(seed, threshold, blocks):
    gen = torch.Generator().manual_seed(seed)
    mass = torch.rand(1, 2, blocks, blocks, generator=gen) ** 4
    keep = select_blocks(mass, torch.full((2,), threshold), rule="minimal")
    causal_mask = torch.ones(blocks, blocks, dtype=torch.bool).tril()
    row_mass = (mass * causal_mask).sum(-1)
    kept = (mass * keep).sum(-1)
    assert (kept >= threshold * row_mass - 1e-9).all()
    assert not (keep & ~causal_mask).any()
    assert keep[..., 0].all() and keep.diagonal(dim1=-2, dim2=-1).all()
    # fewest: dropping the lightest kept block that is not forced falls below the threshold
    forced = (torch.arange(blocks)[None, :] == 0) | torch.eye(blocks, dtype=torch.bool)
    optional = keep & ~forced
    lightest = torch.where(optional, mass, float("inf")).min(-1).values
    has = optional.any(-1)
    assert ((kept - lightest)[has] < threshold * row_mass[has] + 1e-9).all()


def test_threshold_one_and_short_sequences_are_full_causal_attention():
    q, k, _ = qkv(1, 2, 2, 96)
    table = XAttention(1.0, stride=4, block_size=16).select(q, k)
    assert torch.equal(table[0, 0], torch.ones(6, 6, dtype=torch.bool).tril())
    short = XAttention(0.1, stride=4, block_size=16).select(*qkv(1, 2, 2, 16)[:2])
    assert short.all()


def test_planted_needle_block_is_kept():
    """One key matches the late queries strongly: its block survives a low threshold."""
    gen = torch.Generator().manual_seed(3)
    seq, dim = 256, 32
    q = torch.randn(1, 1, seq, dim, generator=gen) * 0.1
    k = torch.randn(1, 1, seq, dim, generator=gen) * 0.1
    needle = torch.randn(dim, generator=gen)
    k[0, 0, 70] = needle * 4  # in key block 2 (of 32 tokens)
    q[0, 0, 200:] = needle * 4
    table = XAttention(0.5, stride=4, block_size=32).select(q, k)
    assert table[0, 0, 200 // 32 :, 2].all()
    assert not table[0, 0, 200 // 32 :, 3:6].all()  # ... while ordinary blocks are dropped


def test_resolved_pattern_is_consistent_and_causal():
    q, k, _ = qkv(2, 4, 2, 150)
    pattern = XAttention(0.7, stride=8, block_size=32).resolve(q, k)
    assert_pattern_consistent(pattern, Geometry(4, 150, block_size=32), batch=2)
    assert_pattern_consistent(pattern, Geometry(4, 150, block_size=16), batch=2)
    assert causal(XAttention(0.7, stride=8, block_size=32).resolve(q[:1], k[:1]), 150, block_size=32)


def test_per_head_thresholds():
    q, k, _ = qkv(1, 2, 1, 128)
    table = XAttention([0.2, 1.0], stride=4, block_size=16).select(q, k)
    assert table[0, 1].sum() == 36 and table[0, 0].sum() < 36


def test_hybrid_fa_ssa_xa_matches_the_reference_forward_and_backward():
    patterns = {"full": Causal(), "ssa": SinkWindow(4, 16), "xa": XAttention(0.6, stride=4, block_size=32)}
    attn = HybridAttention(4, 2, 16, patterns, ["xa", "ssa"], block_size=32, backend="flex_eager")
    q, k, v = qkv(2, 4, 2, 130)
    for modes in (None, torch.tensor([[2, 0], [1, 2]])):
        expected = reference(q, k, v, attn.reference_mask(q, k, modes))
        torch.testing.assert_close(attn(q, k, v, modes=modes), expected, atol=ATOL, rtol=0)
    assert 0 < attn.last_stats.esr < 1
    dense = HybridAttention(4, 2, 16, patterns, ["xa", "full"], block_size=32, backend="dense")
    q, k, v = qkv(1, 4, 2, 96, grad=True)
    q2, k2, v2 = (t.detach().clone().requires_grad_() for t in (q, k, v))
    dense(q, k, v).sum().backward()
    reference(q2, k2, v2, dense.reference_mask(q2, k2)).sum().backward()
    for a, b in ((q, q2), (k, k2), (v, v2)):
        torch.testing.assert_close(a.grad, b.grad, atol=5e-5, rtol=0)


@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        (dict(threshold=0.0), ValueError, "threshold"),
        (dict(threshold=1.5), ValueError, "threshold"),
        (dict(threshold=[0.5, -0.1]), ValueError, "threshold"),
        (dict(threshold="high"), TypeError, "threshold"),
        (dict(stride=0), ValueError, "stride"),
        (dict(stride=5), ValueError, "divide"),
        (dict(block_size=24, stride=4), ValueError, "multiple of 16"),
        (dict(stride=2.0), TypeError, "stride"),
    ],
)
def test_xattention_rejects_bad_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        XAttention(**kwargs)


@pytest.mark.parametrize(
    "q_shape,k_shape,match",
    [
        ((1, 4, 64, 16), (1, 3, 64, 16), "multiple"),
        ((1, 4, 64, 16), (1, 2, 60, 16), "must not exceed kv_len"),
        ((1, 4, 64, 16), (1, 2, 64, 8), "head_dim"),
        ((4, 64, 16), (1, 2, 64, 16), "4-D"),
    ],
)
def test_xattention_rejects_mismatched_q_k(q_shape, k_shape, match):
    with pytest.raises(ValueError, match=match):
        XAttention(stride=4, block_size=16).select(torch.randn(q_shape), torch.randn(k_shape))


def test_xattention_has_no_static_mask():
    with pytest.raises(ValueError, match="resolve"):
        XAttention().dense(Geometry(1, 16))
    with pytest.raises(ValueError, match="content-dependent"):
        receptive_field([XAttention()], 16)


# ----- TriangleMix -----------------------------------------------------------------------------------------


@given(q_len=st.integers(1, 150), extra=st.integers(0, 40), sink=st.integers(0, 10), window=st.integers(1, 40),
       last_q=st.integers(1, 60), block=st.sampled_from([16, 32, 64]))
def test_triangle_mix_capabilities_agree(q_len, extra, sink, window, last_q, block):
    pattern = TriangleMix(sink=sink, window=window, last_q=last_q)
    geo = Geometry(1, q_len, q_len + extra, block_size=block)
    assert_pattern_consistent(pattern, geo)
    assert_key_runs_match_dense(pattern, geo)
    assert causal(pattern, q_len + extra, block_size=block)


def test_triangle_mix_shape():
    dense = TriangleMix(sink=2, window=4, last_q=3).dense(Geometry(1, 12))[0, 0]
    assert dense[8].nonzero().flatten().tolist() == [0, 1, 5, 6, 7, 8]  # sink + window
    assert dense[9, :10].all() and not dense[9, 10:].any()  # the last 3 queries see everything before them
    assert dense[11].all()


def test_triangle_mix_in_a_hybrid_layer():
    patterns = {"full": Causal(), "ta": TriangleMix(sink=4, window=8, last_q=16)}
    attn = HybridAttention(4, 2, 16, patterns, ["ta", "full"], block_size=16, backend="flex_eager")
    q, k, v = qkv(1, 4, 2, 77)
    torch.testing.assert_close(attn(q, k, v), reference(q, k, v, attn.reference_mask(q, k)), atol=ATOL, rtol=0)


@pytest.mark.parametrize("kwargs", [dict(last_q=0), dict(window=0), dict(sink=-2)])
def test_triangle_mix_rejects_bad_arguments(kwargs):
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        TriangleMix(**kwargs)


def test_chunked_prefill_estimates_the_chunk_and_decode_runs_full():
    """A chunk of >= block_size queries gets its own bottom-right estimate (rows from its first query); fewer
    queries (decode) run full causal attention."""
    q, k, v = qkv(1, 4, 2, 150, seed=4)
    xa = XAttention(0.6, stride=8, block_size=32)
    chunk = xa.resolve(q[:, :, -70:], k)
    assert isinstance(chunk, BlockTable) and chunk.q_start == 80
    assert_pattern_consistent(chunk, Geometry(4, 70, 150, block_size=32))
    assert_pattern_consistent(chunk, Geometry(4, 70, 150, block_size=16))
    assert isinstance(xa.resolve(q[:, :, -5:], k), Causal)
    attn = HybridAttention(4, 2, 16, {"xa": xa}, block_size=32, backend="flex_eager")
    out = attn(q[:, :, -70:], k, v)
    expected = reference(q[:, :, -70:], k, v, attn.reference_mask(q[:, :, -70:], k))
    torch.testing.assert_close(out, expected, atol=ATOL, rtol=0)


@pytest.mark.parametrize("padded", [False, True])
def test_a_subset_of_kv_heads_runs_xa_with_its_own_thresholds(padded):
    """kv_heads= (a cache group, a Ulysses or tensor-parallel rank): XA is resolved on the subset's q/k with
    the subset's per-head thresholds, and its rows equal those heads of the whole-layer call."""
    gen = torch.Generator().manual_seed(11)
    q, k, v = (torch.randn(2, h, 160, 16, generator=gen) for h in (8, 4, 4))
    thresholds = [0.3, 0.5, 0.7, 0.9, 0.95, 0.6, 0.4, 0.8]
    attn = HybridAttention(8, 4, 16, {"full": Causal(), "xa": XAttention(thresholds, stride=4, block_size=32)},
                           modes=["xa", "full", "xa", "xa"], block_size=32, backend="dense")
    mask = None
    if padded:
        mask = torch.ones(2, 160, dtype=torch.bool)
        mask[1, :37] = False
    whole = attn(q, k, v, key_padding_mask=mask)
    heads = [2, 3]
    part = attn(q[:, 4:8], k[:, heads], v[:, heads], key_padding_mask=mask, kv_heads=heads)
    torch.testing.assert_close(part, whole[:, 4:8], atol=1e-5, rtol=1e-5)
    table = XAttention(thresholds, stride=4, block_size=32).select(q[:, 4:8], k[:, heads],
                                                                   query_heads=torch.arange(4, 8))
    alone = XAttention(thresholds[4:8], stride=4, block_size=32).select(q[:, 4:8], k[:, heads])
    assert torch.equal(table, alone)
