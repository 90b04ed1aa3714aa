"""Patterns over position tables (padded batches, decode, caches): every capability agrees with the others, and a
padded sequence's mask equals the mask of the same sequence alone."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from flexsparse.masks import (
    ESA,
    BlockTable,
    Causal,
    Geometry,
    PerHead,
    Positions,
    SinkWindow,
    TriangleMix,
)
from tests.util import assert_pattern_consistent

HEADS = 4


def patterns():
    table = torch.rand(1, HEADS, 8, 8, generator=torch.Generator().manual_seed(3)) > 0.4
    return {
        "causal": Causal(),
        "sink_window": SinkWindow(sink=3, window=7),
        "sink_window_unit": SinkWindow(sink=4, window=8, unit=4),
        "esa": ESA(2, 4, 6, HEADS),
        "esa_layer0": ESA(0, 4, 6, HEADS),
        "triangle": TriangleMix(sink=2, window=5, last_q=4),
        "union": SinkWindow(0, 3) | ESA(3, 4, 4, HEADS),
        "intersection": SinkWindow(2, 9) & TriangleMix(1, 4, 3),
        "per_head": PerHead([Causal(), SinkWindow(1, 4)], [0, 1, 1, 0]),
        "block_table": BlockTable(table, 16),
    }


@st.composite
def padding_masks(draw, max_batch=3, max_len=60):
    """bool [B, KV]: per row left padding, right padding, or real tokens scattered with holes."""
    batch = draw(st.integers(1, max_batch))
    kv_len = draw(st.integers(1, max_len))
    rows = []
    for _ in range(batch):
        kind = draw(st.sampled_from(["left", "right", "holes", "none"]))
        length = draw(st.integers(0, kv_len))
        if kind == "holes":
            seed = draw(st.integers(0, 2**16))
            rows.append(torch.rand(kv_len, generator=torch.Generator().manual_seed(seed)) > 0.3)
        elif kind == "none":
            rows.append(torch.ones(kv_len, dtype=torch.bool))
        else:
            real = torch.arange(kv_len) < length
            rows.append(real.flip(0) if kind == "left" else real)
    return torch.stack(rows)


def test_positions_from_padding_mask():
    mask = torch.tensor([[False, False, True, True, True], [True, True, True, False, False]])
    pos = Positions.from_padding_mask(mask, q_len=2)
    assert pos.kv.tolist() == [[5, 5, 0, 1, 2], [0, 1, 2, 5, 5]]
    assert pos.q.tolist() == [[1, 2], [-1, -1]]
    assert pos.sequence_ends().tolist() == [3, 3]
    assert pos.key_slots()[:, :3].tolist() == [[2, 3, 4], [0, 1, 2]]


def test_positions_reject_bad_tables():
    with pytest.raises(ValueError, match="int32"):
        Positions(torch.zeros(1, 3), torch.zeros(1, 3, dtype=torch.int32), 3)
    with pytest.raises(TypeError, match="bool"):
        Positions.from_padding_mask(torch.ones(2, 4), 2)
    with pytest.raises(ValueError, match="q_len"):
        Positions.from_padding_mask(torch.ones(2, 4, dtype=torch.bool), 5)
    with pytest.raises(ValueError, match="cover"):
        Geometry(2, 3, 4, positions=Positions.contiguous(2, 4))


@pytest.mark.parametrize("name", list(patterns()))
@given(mask=padding_masks(), cut=st.data(), block=st.sampled_from([8, 16]))
def test_capabilities_agree_on_position_tables(name, mask, cut, block):
    """mask_mod, the block mask the kernel computes, the dense reference and attended counts agree."""
    pattern = patterns()[name]
    q_len = cut.draw(st.integers(1, mask.shape[1]))
    geo = Geometry(HEADS, q_len, mask.shape[1], block, positions=Positions.from_padding_mask(mask, q_len))
    if name == "block_table" and geo.span > 8 * 16:
        return
    assert_pattern_consistent(pattern, geo, batch=mask.shape[0])


@pytest.mark.parametrize("name", list(patterns()))
@given(mask=padding_masks(max_len=50), block=st.sampled_from([8, 16]))
def test_a_padded_sequence_sees_what_it_sees_alone(name, mask, block):
    """Real rows and real keys of each padded sequence carry the contiguous pattern of that sequence alone;
    padding queries attend nothing and padding keys are never attended."""
    pattern = patterns()[name]
    kv_len = mask.shape[1]
    geo = Geometry(HEADS, kv_len, kv_len, block, positions=Positions.from_padding_mask(mask, kv_len))
    dense = pattern.dense(geo).expand(mask.shape[0], HEADS, kv_len, kv_len)
    for b, real in enumerate(mask):
        n = int(real.sum())
        assert not dense[b][:, ~real].any() and not dense[b][:, :, ~real].any()
        if n == 0:
            continue
        alone = pattern.dense(Geometry(HEADS, n, block_size=block))[0].expand(HEADS, n, n)
        assert torch.equal(dense[b][:, real][:, :, real], alone)


@pytest.mark.parametrize("name", list(patterns()))
def test_decode_rows_are_the_last_rows_of_prefill(name):
    """A chunk of the last queries against all keys sees what those rows see in a full prefill."""
    pattern = patterns()[name]
    full = pattern.dense(Geometry(HEADS, 100, block_size=16)).expand(1, HEADS, 100, 100)
    for q_len in (1, 7, 64):
        contiguous = pattern.dense(Geometry(HEADS, q_len, 100, block_size=16))
        tables = pattern.dense(Geometry(HEADS, q_len, 100, 16, positions=Positions.contiguous(q_len, 100)))
        assert torch.equal(contiguous.expand_as(full[:, :, -q_len:]), full[:, :, -q_len:])
        assert torch.equal(tables.expand_as(full[:, :, -q_len:]), full[:, :, -q_len:])


def test_a_ring_buffer_cache_whose_slots_are_not_positions():
    """Keys in a rotated buffer: the mask follows positions, not slots."""
    window = SinkWindow(sink=2, window=4)
    kv = torch.tensor([[0, 1, 8, 9, 6, 7]], dtype=torch.int32)  # sink 0-1, then a ring holding 6..9
    geo = Geometry(1, 1, 6, 4, positions=Positions(torch.tensor([[9]], dtype=torch.int32), kv, 10))
    assert window.dense(geo)[0, 0, 0].tolist() == [True, True, True, True, True, True]
    assert_pattern_consistent(window, geo)
    early = Geometry(1, 1, 6, 4, positions=Positions(torch.tensor([[7]], dtype=torch.int32), kv, 10))
    assert window.dense(early)[0, 0, 0].tolist() == [True, True, False, False, True, True]


def test_dense_references_cost_q_times_kv_not_kv_squared():
    """One query against a million keys: a kv x kv matrix would need a terabyte."""
    for pattern in (SinkWindow(4, 32), SinkWindow(4, 32, unit=4), Causal(), TriangleMix(4, 32, 8)):
        dense = pattern.dense(Geometry(1, 1, 1 << 20))
        assert dense.shape[-2:] == (1, 1 << 20)
        assert int(dense.sum()) == int(pattern.attended(Geometry(1, 1, 1 << 20)).sum())
