"""ESA against golden tables from the authors' index code, and the four capabilities against each other."""

import json
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from flexsparse import HybridAttention
from flexsparse.masks import ESA, Causal, Geometry, SinkWindow
from flexsparse.reference import attention as reference
from tests.esa_float_reference import esa_float_indices
from tests.test_hybrid_attention import ATOL, qkv
from tests.util import assert_pattern_consistent

GOLDEN = json.loads((Path(__file__).parent / "data" / "esa_golden.json").read_text())


@pytest.mark.parametrize("table", GOLDEN, ids=lambda t: f"S{t['seq_len']}-L{t['num_layers']}-H{t['num_heads']}-w{t['attn_length']}")
def test_matches_golden_tables(table):
    seq, heads = table["seq_len"], table["num_heads"]
    for layer, expected in enumerate(table["keys"]):
        dense = ESA(layer, table["num_layers"], table["attn_length"], heads).dense(Geometry(heads, seq))[0]
        for h in range(heads):
            for i in range(seq):
                assert dense[h, i].nonzero().flatten().tolist() == expected[h][i], (layer, h, i)


@pytest.mark.parametrize("layer", range(8))
def test_exact_integer_form_agrees_with_float32_on_paper_configuration(layer):
    """8 layers, 8 heads, attn_length 64 (the 131,072-token validation): first and last 2,048 queries."""
    positions = torch.cat([torch.arange(2048), torch.arange(131072 - 2048, 131072)])
    expected, _ = esa_float_indices(positions, layer, 8, 64, 8)
    assert torch.equal(ESA(layer, 8, 64, 8).indices(positions), expected)


def test_figure_configuration_12_layers_8_heads_w32():
    for layer in range(12):
        expected, _ = esa_float_indices(torch.arange(512), layer, 12, 32, 8)
        assert torch.equal(ESA(layer, 12, 32, 8).indices(torch.arange(512)), expected)


@given(
    layers=st.integers(1, 10), data=st.data(), heads=st.integers(1, 5), w=st.integers(1, 24),
    seq=st.integers(1, 120), extra=st.integers(0, 30), block=st.sampled_from([16, 32, 64]),
)
def test_four_capabilities_agree(layers, data, heads, w, seq, extra, block):
    layer = data.draw(st.integers(0, layers - 1))
    geo = Geometry(heads, seq, seq + extra, block_size=block)
    assert_pattern_consistent(ESA(layer, layers, w, heads), geo)


@given(layers=st.integers(1, 12), data=st.data(), heads=st.integers(1, 8), w=st.integers(1, 64))
def test_indices_are_distinct_and_in_range(layers, data, heads, w):
    layer = data.draw(st.integers(0, layers - 1))
    positions = torch.arange(0, 3000, 7)
    index = ESA(layer, layers, w, heads).indices(positions)
    assert (index.diff(dim=-1) > 0).all(), "indices of one query must strictly increase (no duplicates)"
    assert (index >= 0).all() and (index <= torch.clamp(positions, min=w - 1)[None, :, None]).all()


def test_first_layer_is_a_sliding_window_and_last_layer_spans_history():
    first = ESA(0, 4, 8, 2).dense(Geometry(2, 64))[0]
    assert torch.equal(first[0], SinkWindow(sink=0, window=8).dense(Geometry(1, 64))[0, 0])
    last = ESA(3, 4, 8, 2).indices(torch.tensor([63]))[0, 0]
    assert last[0] == 0 and last[-1] == 56  # dilated over the whole history with spacing 8


def test_edge_cases_single_layer_single_head():
    geo = Geometry(1, 37, block_size=16)
    dense = assert_pattern_consistent(ESA(0, 1, 5, 1), geo)
    assert dense[0, 0, 2].nonzero().flatten().tolist() == [0, 1, 2]  # i < w: the first w keys, causal


def test_hybrid_attention_with_esa_sink_window_and_full_heads():
    heads = 4
    patterns = {"full": Causal(), "ssa": SinkWindow(4, 16), "esa": ESA(2, 4, 8, heads)}
    attn = HybridAttention(heads, 2, 16, patterns, ["esa", "ssa"], block_size=16, backend="flex_eager")
    q, k, v = qkv(2, heads, 2, 90)
    modes = torch.tensor([[2, 0], [1, 2]])
    expected = reference(q, k, v, attn.reference_mask(q, k, modes))
    torch.testing.assert_close(attn(q, k, v, modes=modes), expected, atol=ATOL, rtol=0)
    esa_rows = attn.reference_mask(q, k, modes)[0, :2]
    assert torch.equal(esa_rows, patterns["esa"].dense(Geometry(heads, 90))[0, :2])
    # backward through the dense-mask path
    dense_attn = HybridAttention(heads, 2, 16, patterns, ["esa", "full"], block_size=16, backend="dense")
    q, k, v = qkv(1, heads, 2, 50, grad=True)
    out = dense_attn(q, k, v)
    q2, k2, v2 = (t.detach().clone().requires_grad_() for t in (q, k, v))
    ref = reference(q2, k2, v2, dense_attn.reference_mask(q2, k2))
    out.sum().backward()
    ref.sum().backward()
    for a, b in ((q, q2), (k, k2), (v, v2)):
        torch.testing.assert_close(a.grad, b.grad, atol=5e-5, rtol=0)


@pytest.mark.parametrize(
    "args,error,match",
    [
        ((4, 4, 8, 2), ValueError, "layer_idx"),
        ((-1, 4, 8, 2), ValueError, "layer_idx"),
        ((0, 0, 8, 2), ValueError, "num_layers"),
        ((0, 4, 0, 2), ValueError, "attn_length"),
        ((0, 4, 8, 0), ValueError, "num_heads"),
        ((0, 4, 8.0, 2), TypeError, "attn_length"),
    ],
)
def test_bad_arguments(args, error, match):
    with pytest.raises(error, match=match):
        ESA(*args)


def test_head_count_must_match_geometry():
    with pytest.raises(ValueError, match="num_heads=2"):
        ESA(0, 2, 4, 2).block_mask(Geometry(4, 32))
