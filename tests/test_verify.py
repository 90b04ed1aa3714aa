"""Receptive-field verifier (against brute force) and causality checker."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from flexsparse import HybridAttention
from flexsparse.masks import ESA, Causal, Geometry, Pattern, PerHead, PerLayer, SinkWindow
from flexsparse.masks.base import classify
from flexsparse.verify import causal, receptive_field, receptive_field_bruteforce

HEADS = 3


def head_patterns():
    """Patterns a head of a small model may follow (ESA over the model's 3 heads)."""
    return st.one_of(
        st.just(Causal()),
        st.builds(SinkWindow, sink=st.integers(0, 6), window=st.integers(1, 12)),
        st.builds(lambda l, n, w: ESA(min(l, n - 1), n, w, HEADS), st.integers(0, 5), st.integers(1, 6),
                  st.integers(1, 8)),
    )


def layers():
    """A layer: one pattern for all heads, or one pattern per head (as a list)."""
    simple = st.one_of(st.just(Causal()), st.builds(SinkWindow, sink=st.integers(0, 6), window=st.integers(1, 12)))
    return st.one_of(simple, st.lists(simple, min_size=2, max_size=3),
                     st.lists(head_patterns(), min_size=HEADS, max_size=HEADS).map(lambda ps: PerHead(ps, range(HEADS))))


@given(stack=st.lists(layers(), min_size=1, max_size=4), seq_len=st.integers(1, 90))
def test_agrees_with_brute_force(stack, seq_len):
    fast = receptive_field(stack, seq_len)
    slow = receptive_field_bruteforce(stack, seq_len)
    assert fast.hole_free == slow.hole_free
    assert fast.first_hole == slow.first_hole
    assert fast.coverage == pytest.approx(slow.coverage, abs=1e-12)
    assert fast.complete_depth == slow.complete_depth


@given(depth=st.integers(1, 4), window=st.integers(2, 10), extra=st.integers(2, 30))
def test_finds_the_hole_of_stacked_sliding_windows(depth, window, extra):
    """Each window layer reaches window - 1 further back; past depth * (window - 1) key 0 is out of reach."""
    reach = depth * (window - 1)
    report = receptive_field([SinkWindow(sink=0, window=window)] * depth, reach + extra)
    assert not report.hole_free
    assert report.first_hole == (reach + 1, 0)
    assert report.complete_depth is None


def test_a_sink_opens_a_path_to_the_sink_only():
    """Query 8 of two sink-1 window-4 layers reaches key 0 (sink) and keys 2..8 (two windows), not key 1."""
    report = receptive_field([SinkWindow(sink=1, window=4)] * 2, 200)
    assert report.first_hole == (8, 1) == receptive_field_bruteforce([SinkWindow(sink=1, window=4)] * 2, 200).first_hole


def test_a_full_layer_on_top_completes_the_field_and_reports_depth():
    report = receptive_field([SinkWindow(sink=0, window=4), Causal()], 200)
    assert report.hole_free and report.complete_depth == 2
    assert report.coverage[-1] == 1.0 and report.coverage[0] < 0.05


def test_esa_paper_stack_is_hole_free_at_8k():
    """The 131,072-token validation (8 layers, 8 heads, attn_length 64) at 8,192 tokens; full size in bench/."""
    report = receptive_field([ESA(layer, 8, 64, 8) for layer in range(8)], 8192)
    assert report.hole_free and report.first_hole is None
    assert report.complete_depth is not None and report.complete_depth <= 8
    assert all(a <= b for a, b in zip(report.coverage, report.coverage[1:]))


def test_accepts_hybrid_attention_layers_routed_modes_and_per_layer_stacks():
    patterns = {"full": Causal(), "ssa": SinkWindow(sink=0, window=4)}
    sparse = HybridAttention(4, 2, 8, patterns, ["ssa", "ssa"])
    mixed = HybridAttention(4, 2, 8, patterns, ["full", "ssa"])
    assert not receptive_field([sparse, sparse], 40).hole_free
    assert receptive_field([sparse, mixed], 40).hole_free
    assert receptive_field([sparse, (sparse, torch.tensor([0, 1]))], 40).hole_free
    per_layer = PerLayer([Causal(), SinkWindow(0, 4)], [1, 1, 0])
    assert receptive_field(per_layer, 40) .complete_depth == 3


@pytest.mark.parametrize(
    "layers_arg,seq_len,error,match",
    [
        ([], 10, ValueError, "empty"),
        ([Causal()], 0, ValueError, "seq_len"),
        ([Causal()], -5, ValueError, "seq_len"),
        ([Causal()], 2.5, TypeError, "seq_len"),
        (["causal"], 10, TypeError, "layer"),
        ("causal", 10, TypeError, "layers"),
    ],
)
def test_bad_arguments(layers_arg, seq_len, error, match):
    with pytest.raises(error, match=match):
        receptive_field(layers_arg, seq_len)


def test_report_prints_readably():
    text = str(receptive_field([SinkWindow(0, 3)] * 2, 10))
    assert "HOLE at query 5, key 0" in text and "after layer   2" in text


# ----- causality -------------------------------------------------------------------------------------------


class PeeksAhead(Pattern):
    """A broken pattern for the checker to catch: query i also sees key i + 1."""

    def mask_mod(self, geo):
        return lambda b, h, q, k: (k <= q + 1)

    def block_classes(self, geo):
        q_first, q_last = geo.q_tile_bounds()
        kv_first, kv_last = geo.kv_tile_bounds()
        return classify(full=kv_last <= q_first, empty=kv_first > q_last + 1)

    def dense(self, geo):
        return torch.ones(geo.q_len, geo.kv_len, dtype=torch.bool).tril(1)[None, None]


@given(
    pattern=st.one_of(head_patterns(), st.builds(SinkWindow, sink=st.integers(0, 40), window=st.integers(1, 300))),
    seq_len=st.integers(1, 300),
    block=st.sampled_from([16, 64, 128]),
)
def test_every_shipped_pattern_is_causal(pattern, seq_len, block):
    assert causal(pattern, seq_len, block_size=block)


def test_checker_catches_a_pattern_that_peeks_ahead():
    report = causal(PeeksAhead(), 100, block_size=16)
    assert not report
    assert report.first_violation == (0, 0, 1)


def test_checker_accepts_hybrid_configurations():
    attn = HybridAttention(4, 2, 8, {"full": Causal(), "esa": ESA(1, 3, 8, 4)}, ["esa", "full"])
    assert causal(attn, 333, block_size=32)
    assert causal((attn, torch.tensor([1, 1])), 100, block_size=16)


def test_verifier_dense_size_guard():
    with pytest.raises(ValueError, match="dense reference"):
        Geometry(1, 1 << 15).dense_grid()
