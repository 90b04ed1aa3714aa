"""Bad arguments fail at once with a clear error naming them; limits are the documented ones; NaN handling."""

import numpy as np
import pytest
import torch

from flexsparse import HybridAttention
from flexsparse.masks import ESA, BlockTable, Causal, Geometry, PerHead, PerLayer, SinkWindow, XAttention
from flexsparse.reference import attention as reference
from tests.test_hybrid_attention import qkv

pytestmark = pytest.mark.filterwarnings("ignore:.*flex_attention called without torch.compile.*")

PATTERNS = {"full": Causal(), "ssa": SinkWindow(sink=2, window=8)}


def test_default_modes_must_be_one_per_kv_head():
    for bad in (torch.tensor([[0, 1], [1, 0]]), torch.tensor(1)):
        with pytest.raises(ValueError, match=r"default modes must be one per KV head"):
            HybridAttention(4, 2, 16, PATTERNS, bad)
    attn = HybridAttention(4, 2, 16, PATTERNS)
    with pytest.raises(ValueError, match=r"forward\(modes=...\)"):
        attn.set_modes(torch.tensor([[0, 1]]))


def test_flex_eager_refuses_cpu_backward_up_front():
    attn = HybridAttention(2, 2, 16, PATTERNS, backend="flex_eager")
    q, k, v = qkv(1, 2, 2, 40, grad=True)
    with pytest.raises(ValueError, match="flex_eager.*no backward on CPU"):
        attn(q, k, v)


def test_dense_backend_honours_max_dense_len_at_any_head_count():
    """32 heads at S=3000 used to exceed the dense mask budget although S < max_dense_len; rows are chunked."""
    attn = HybridAttention(32, 8, 4, PATTERNS, ["ssa"] * 8, backend="dense")
    q, k, v = qkv(1, 32, 8, 3000, dim=4)
    out = attn(q, k, v)
    rows = slice(2990, 3000)
    expected = reference(q[:, :, rows], k, v, attn.reference_mask(q[:, :, rows], k))
    torch.testing.assert_close(out[:, :, rows], expected, atol=2e-5, rtol=0)


def test_union_and_intersection_have_closed_forms_at_long_lengths():
    """attended and key_runs through runs, not dense masks: a million-token query row costs nothing."""
    geo = Geometry(4, 1, 1 << 20)
    union = SinkWindow(4, 32) | ESA(3, 8, 16, 4)
    inter = SinkWindow(4, 4096) & ESA(3, 8, 16, 4)
    both = union.attended(geo)
    assert both.shape == (1, 4, 1) and (both >= 36).all() and (both <= 36 + 16).all()
    assert (inter.attended(geo) <= 16).all()
    small = Geometry(4, 300)
    for pattern in (union, inter):
        assert torch.equal(pattern.attended(small).expand(1, 4, 300), pattern.dense(small).sum(-1))


def test_last_stats_of_a_long_union_layer():
    attn = HybridAttention(4, 2, 8, {"mixed": SinkWindow(4, 16) | ESA(1, 4, 8, 4)}, backend="flex_eager")
    q, k, v = qkv(1, 4, 2, 2048, dim=8)
    attn(q, k, v)
    attn._last = (Geometry(4, 1 << 16), *attn._last[1:])  # the stats of a 64K-token call, without running it
    assert 0.99 < attn.last_stats.as_dict()["esr"] < 1


@pytest.mark.parametrize("table_block,error,match", [(0, ValueError, "table_block must be >= 1"),
                                                      (-64, ValueError, "table_block must be >= 1"),
                                                      (64.0, TypeError, "table_block must be an int")])
def test_block_table_rejects_bad_blocks(table_block, error, match):
    with pytest.raises(error, match=match):
        BlockTable(torch.ones(1, 1, 2, 2, dtype=torch.bool), table_block)


def test_mode_lists_reject_floats_and_empty():
    with pytest.raises(TypeError, match=r"modes\[0\] must be an int"):
        PerLayer([Causal(), SinkWindow(1, 4)], [1.9, 0.2])
    with pytest.raises(ValueError, match="got none"):
        PerHead([Causal()], [])


def test_esa_head_count_is_checked_at_construction():
    with pytest.raises(ValueError, match="defined for 8 query heads, the layer has num_heads=4"):
        HybridAttention(4, 2, 16, {"esa": ESA(0, 2, 8, 8)})


def test_scale_must_be_finite_and_positive():
    for bad in (float("nan"), float("inf"), 0.0, -1.0):
        with pytest.raises(ValueError, match="scale"):
            HybridAttention(4, 2, 16, PATTERNS, scale=bad)
    attn = HybridAttention(4, 2, 16, PATTERNS, backend="flex_eager")
    with pytest.raises(ValueError, match="scale"):
        attn(*qkv(1, 4, 2, 8), scale=float("nan"))


def test_numpy_integers_are_accepted():
    attn = HybridAttention(np.int64(4), np.int64(2), np.int32(16), PATTERNS, [np.int64(0), 1],
                           block_size=np.int64(16), backend="flex_eager")
    assert attn(*qkv(1, 4, 2, 20)).shape == (1, 4, 20, 16)
    assert SinkWindow(np.int64(2), np.int16(8)).window == 8
    assert Geometry(np.int64(2), np.int64(10)).q_len == 10


def test_unused_xa_pattern_never_estimates():
    """A pattern set that contains XA whose modes do not use it: no estimator in prefill, decode, or stats."""
    xa = XAttention(0.9, stride=8, block_size=32)
    xa.select = lambda *a, **k: pytest.fail("the estimator ran for an unused XA pattern")
    attn = HybridAttention(4, 2, 16, dict(PATTERNS, xa=xa), ["full", "ssa"], block_size=32, backend="flex_eager",
                           plan="split")
    q, k, v = qkv(1, 4, 2, 64)
    attn(q, k, v)
    assert attn.last_stats.as_dict()["msr"] == 0.5
    attn(q[:, :, -1:], k, v)
    attn.last_stats.as_dict()


def test_xa_heads_decode_as_full_attention():
    attn = HybridAttention(4, 2, 16, {"xa": XAttention(0.5, stride=8, block_size=32)}, block_size=32,
                           backend="flex_eager")
    q, k, v = qkv(1, 4, 2, 64)
    full = HybridAttention(4, 2, 16, Causal(), block_size=32, backend="flex_eager")
    torch.testing.assert_close(attn(q[:, :, -3:], k, v), full(q[:, :, -3:], k, v), atol=1e-6, rtol=0)


@pytest.mark.parametrize("name", ["q", "k", "v"])
def test_check_finite_names_the_tensor(name):
    attn = HybridAttention(4, 2, 16, PATTERNS, backend="flex_eager", check_finite=True)
    inputs = dict(zip("qkv", qkv(1, 4, 2, 16)))
    inputs[name][0, 0, 3, 2] = float("nan")
    with pytest.raises(ValueError, match=f"{name} contains NaN or inf"):
        attn(inputs["q"], inputs["k"], inputs["v"])


@pytest.mark.parametrize("backend", ["flex_eager", "dense"])
def test_nan_in_values_gives_nan_rows_on_the_uncompiled_backends(backend):
    """Documented behaviour without check_finite: a NaN value makes every row of its heads NaN (masked keys get
    weight 0, and 0 x NaN is NaN); other KV heads are unaffected."""
    attn = HybridAttention(2, 2, 16, {"ssa": SinkWindow(0, 4)}, backend=backend)
    q, k, v = qkv(1, 2, 2, 16)
    v[0, 0, 5] = float("nan")
    out = attn(q, k, v)
    assert out[0, 0].isnan().all() and not out[0, 1].isnan().any()
