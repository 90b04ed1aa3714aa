"""Causal and SinkWindow: mask_mod, BlockMask, dense reference and attended counts agree."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from flexsparse.masks import EMPTY, FULL, PARTIAL, Causal, Geometry, SinkWindow
from tests.util import assert_pattern_consistent

SIZES = [1, 5, 16, 64, 100, 130]
BLOCKS = [16, 32, 64]


@pytest.mark.parametrize("seq", SIZES)
@pytest.mark.parametrize("block", BLOCKS)
def test_causal_exhaustive(seq, block):
    geo = Geometry(num_heads=2, q_len=seq, block_size=block)
    dense = assert_pattern_consistent(Causal(), geo)
    expected = torch.ones(seq, seq, dtype=torch.bool).tril()
    assert torch.equal(dense[0, 0], expected)


@pytest.mark.parametrize("seq", SIZES)
@pytest.mark.parametrize("block", BLOCKS)
@pytest.mark.parametrize("sink,window", [(0, 1), (4, 8), (16, 32), (3, 50), (200, 200)])
def test_sink_window_exhaustive(seq, block, sink, window):
    assert_pattern_consistent(SinkWindow(sink=sink, window=window), Geometry(2, seq, block_size=block))


def test_sink_window_matches_definition():
    """Query i sees k <= i with k < sink or i - k < window, written out pair by pair."""
    sink, window, seq = 3, 5, 20
    dense = SinkWindow(sink=sink, window=window).dense(Geometry(1, seq))[0, 0]
    for i in range(seq):
        for k in range(seq):
            assert bool(dense[i, k]) == (k <= i and (k < sink or i - k < window)), (i, k)


def test_block_granular_sink_window_counts_whole_units():
    dense = SinkWindow(sink=4, window=8, unit=4).dense(Geometry(1, 24))[0, 0]
    # Query 13 is in unit 3: it sees unit 0 (sink) and units 2-3 (two most recent units), causal in its own.
    assert dense[13].nonzero().flatten().tolist() == [0, 1, 2, 3, 8, 9, 10, 11, 12, 13]


def test_interior_tiles_are_marked_full():
    classes = SinkWindow(sink=64, window=512).block_classes(Geometry(1, 1024, block_size=64))[0, 0]
    assert classes[10, 5] == FULL  # inside the window
    assert classes[10, 0] == FULL  # the sink tile
    assert classes[10, 10] == PARTIAL  # the diagonal
    assert classes[15, 7] == PARTIAL  # window edge: queries 960-1023 reach back to keys 449-512
    assert classes[15, 3] == EMPTY  # out of reach
    assert (classes == FULL).sum() > (classes == PARTIAL).sum()


@given(
    q_len=st.integers(1, 160),
    extra_kv=st.integers(0, 70),
    sink=st.integers(0, 40),
    window=st.integers(1, 90),
    unit=st.sampled_from([1, 2, 8]),
    block=st.sampled_from([16, 32, 64, 128]),
)
def test_sink_window_property(q_len, extra_kv, sink, window, unit, block):
    sink, window = sink * unit, window * unit  # multiples of the unit
    geo = Geometry(num_heads=1, q_len=q_len, kv_len=q_len + extra_kv, block_size=block)
    assert_pattern_consistent(SinkWindow(sink=sink, window=window, unit=unit), geo)


@given(q_len=st.integers(1, 200), extra_kv=st.integers(0, 100), block=st.sampled_from([16, 32, 128]))
def test_causal_property(q_len, extra_kv, block):
    assert_pattern_consistent(Causal(), Geometry(1, q_len, q_len + extra_kv, block_size=block))


@pytest.mark.parametrize(
    "kwargs,error",
    [
        (dict(window=0), ValueError),
        (dict(window=-3), ValueError),
        (dict(sink=-1), ValueError),
        (dict(window=2.5), TypeError),
        (dict(sink=3, window=8, unit=4), ValueError),
        (dict(unit=0), ValueError),
    ],
)
def test_sink_window_rejects_bad_arguments(kwargs, error):
    with pytest.raises(error, match="|".join(kwargs)):
        SinkWindow(**kwargs)


@pytest.mark.parametrize(
    "kwargs", [dict(num_heads=0, q_len=4), dict(num_heads=1, q_len=0), dict(num_heads=1, q_len=8, kv_len=4)]
)
def test_geometry_rejects_bad_sizes(kwargs):
    with pytest.raises(ValueError, match="Geometry"):
        Geometry(**kwargs)
