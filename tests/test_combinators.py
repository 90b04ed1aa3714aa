"""Union, intersection, per-head and per-layer selection keep all four capabilities."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from flexsparse.masks import Causal, Geometry, Intersection, PerHead, PerLayer, SinkWindow, Union
from tests.util import assert_pattern_consistent

windows = st.builds(
    SinkWindow, sink=st.integers(0, 24), window=st.integers(1, 60)
)
patterns = st.one_of(st.just(Causal()), windows)


@given(a=patterns, b=patterns, seq=st.integers(1, 150), block=st.sampled_from([16, 32, 64]))
def test_union_and_intersection(a, b, seq, block):
    geo = Geometry(2, seq, block_size=block)
    union = assert_pattern_consistent(a | b, geo)
    inter = assert_pattern_consistent(a & b, geo)
    da, db = a.dense(geo), b.dense(geo)
    assert torch.equal(union, (da | db).expand_as(union))
    assert torch.equal(inter, (da & db).expand_as(inter))


@given(
    parts=st.lists(patterns, min_size=1, max_size=3),
    data=st.data(),
    seq=st.integers(1, 140),
    batch=st.integers(1, 3),
    block=st.sampled_from([16, 64]),
)
def test_per_head(parts, data, seq, batch, block):
    heads = 4
    per_batch = data.draw(st.booleans())
    shape = (batch, heads) if per_batch else (heads,)
    modes = torch.tensor(data.draw(st.lists(st.integers(0, len(parts) - 1), min_size=heads * (batch if per_batch else 1),
                                            max_size=heads * (batch if per_batch else 1)))).reshape(shape)
    pattern = PerHead(parts, modes)
    geo = Geometry(heads, seq, block_size=block)
    dense = assert_pattern_consistent(pattern, geo, batch=batch)
    rows = modes if per_batch else modes[None].expand(batch, heads)
    for b in range(batch):
        for h in range(heads):
            assert torch.equal(dense[b, h], parts[int(rows[b, h])].dense(geo)[0, 0])


def test_nested_combinations():
    pattern = PerHead([Causal(), SinkWindow(4, 8) | SinkWindow(0, 30), Intersection(Causal(), SinkWindow(2, 10))],
                      [0, 1, 2, 1])
    assert_pattern_consistent(pattern, Geometry(4, 77, block_size=16))


def test_per_layer_indexes_patterns():
    stack = PerLayer([Causal(), SinkWindow(4, 16)], [1, 1, 0])
    assert len(stack) == 3
    assert isinstance(stack[0], SinkWindow) and isinstance(stack[2], Causal)


def test_flags_for_full_attention():
    assert Causal().is_full and not SinkWindow().is_full
    assert (Causal() | SinkWindow()).is_full
    assert not (Causal() & SinkWindow()).is_full
    assert PerHead([Causal(), SinkWindow()], [0, 0]).is_full


@pytest.mark.parametrize(
    "build,error,match",
    [
        (lambda: PerHead([Causal()], [0, 1]), ValueError, "modes"),
        (lambda: PerHead([Causal()], [0.0]), TypeError, "modes"),
        (lambda: PerHead([], [0]), ValueError, "at least one"),
        (lambda: Union(Causal(), "causal"), TypeError, "Pattern"),
        (lambda: PerLayer([Causal()], [2]), ValueError, "layer modes"),
        (lambda: PerLayer([Causal()], []), ValueError, "layer mode"),
    ],
)
def test_bad_combinations(build, error, match):
    with pytest.raises(error, match=match):
        build()


def test_per_head_rejects_wrong_head_count():
    with pytest.raises(ValueError, match="heads"):
        PerHead([Causal(), SinkWindow()], [0, 1]).dense(Geometry(3, 8))
