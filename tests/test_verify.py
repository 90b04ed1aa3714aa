"""Receptive-field verifier and hole horizon (against brute force, and closed forms), causality checker."""

import contextlib
from unittest import mock

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from flexsparse import HybridAttention
from flexsparse.masks import (
    ESA,
    BlockTable,
    Causal,
    Geometry,
    Pattern,
    PerHead,
    PerLayer,
    SinkWindow,
    TriangleMix,
)
from flexsparse.masks.base import classify
from flexsparse.verify import (
    HoleFreeLength,
    causal,
    field,
    layer_pattern,
    layer_step,
    max_hole_free_length,
    receptive_field,
    receptive_field_bruteforce,
)
from flexsparse.verify.growing import BLOCK, RangeExtremum
from flexsparse.verify.intervals import merge_intervals
from flexsparse.verify.middles import Middles
from flexsparse.verify.sources import prefix_consistency_problem

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


@contextlib.contextmanager
def tiny_batches():
    """Rounds of a few positions and batches of a few queries and intervals: many rounds, cut batches, layers
    running ahead of each other, exactly as beyond the hole horizon at full size."""
    with mock.patch.multiple(field, FIRST_CHUNK=3, MIN_CHUNK=1, MAX_CHUNK=9, STEP_WORK=6), \
            mock.patch.multiple(layer_step, QUERIES_PER_BATCH=5, RUN_SLOTS_PER_BATCH=24, INTERVALS_PER_BATCH=6):
        yield


@given(stack=st.lists(layers(), min_size=1, max_size=4), seq_len=st.integers(1, 90), tiny=st.booleans())
def test_agrees_with_brute_force(stack, seq_len, tiny):
    with tiny_batches() if tiny else contextlib.nullcontext():
        fast = receptive_field(stack, seq_len)
    slow = receptive_field_bruteforce(stack, seq_len)
    assert fast.hole_free == slow.hole_free
    assert fast.first_hole == slow.first_hole
    assert fast.coverage == pytest.approx(slow.coverage, abs=1e-12)
    assert fast.complete_depth == slow.complete_depth
    assert fast.stopped_early is None and fast.positions_done == seq_len


@given(stack=st.lists(layers(), min_size=1, max_size=4), seq_len=st.integers(1, 90), tiny=st.booleans(),
       work_limit=st.sampled_from([0, 5, 50]))
def test_stopping_early_keeps_the_first_hole_exact(stack, seq_len, tiny, work_limit):
    """Stopping at the first hole, or once the complete report costs more than work_limit: hole_free and
    first_hole stay exact, and the report says what it did not compute."""
    slow = receptive_field_bruteforce(stack, seq_len)
    with tiny_batches() if tiny else contextlib.nullcontext():
        first = receptive_field(stack, seq_len, stop_at_first_hole=True)
        limited = receptive_field(stack, seq_len, work_limit=work_limit)
    for report in (first, limited):
        assert (report.hole_free, report.first_hole) == (slow.hole_free, slow.first_hole)
        if report.stopped_early is None:
            assert report.coverage == pytest.approx(slow.coverage, abs=1e-12)
            assert report.complete_depth == slow.complete_depth and report.positions_done == seq_len
        else:
            assert report.coverage is None and "stopped early" in str(report)
            assert report.positions_done < seq_len
            assert report.complete_depth is None
            if not report.hole_free:
                assert report.first_hole[0] < report.positions_done


def test_stops_right_after_the_first_hole_far_below_the_length():
    """Two window-8 layers: the hole is at query 15; at 2**29 tokens only the first round is computed."""
    report = receptive_field([SinkWindow(sink=0, window=8)] * 2, 2**29, stop_at_first_hole=True)
    assert report.first_hole == (15, 0) and report.coverage is None
    assert report.positions_done <= field.FIRST_CHUNK and "stop_at_first_hole" in str(report)


def test_work_limit_stops_the_complete_report_beyond_the_hole_horizon():
    """ESA's top layers over fragmented sets cost many intervals past the hole; the limit stops them there."""
    stack = [ESA(layer, 3, 4, 2) for layer in range(3)]
    with tiny_batches():  # rounds of a few positions, as a long sequence has them
        exact = receptive_field(stack, 400, work_limit=None)
        limited = receptive_field(stack, 400, work_limit=10)
    assert not exact.hole_free and exact.stopped_early is None
    assert limited.first_hole == exact.first_hole
    assert limited.stopped_early and "work_limit=10" in limited.stopped_early
    assert exact.first_hole == receptive_field_bruteforce(stack, 400).first_hole


def test_a_layer_attending_every_key_makes_the_answer_certain():
    stack = [SinkWindow(0, 4), SinkWindow(0, 4), [SinkWindow(0, 2), Causal()], SinkWindow(0, 2)]
    quick = receptive_field(stack, 10**6, stop_at_first_hole=True)
    assert quick.hole_free and quick.first_hole is None and quick.coverage is None
    assert "layer 3 attends every earlier key" in str(quick) and "complete depth not computed" in str(quick)
    full, slow = receptive_field(stack, 300), receptive_field_bruteforce(stack, 300)
    assert full.hole_free and full.complete_depth == slow.complete_depth == 3 and full.stopped_early is None
    assert full.coverage == pytest.approx(slow.coverage, abs=1e-12)


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


@given(depth=st.integers(1, 8), window=st.integers(2, 1000), sink=st.integers(0, 200))
def test_hole_horizon_of_stacked_sink_windows_in_closed_form(depth, window, sink):
    """C_L(q) = [0, sink) + [q - L (window - 1), q]: the first hole is query sink + L (window - 1) + 1, key sink,
    at every length past it (here 2**24 tokens, computed only up to the hole); lengths up to that query's
    position are hole-free."""
    horizon = sink + depth * (window - 1) + 1
    stack = [SinkWindow(sink=sink, window=window)] * depth
    report = receptive_field(stack, 1 << 24, stop_at_first_hole=True)
    assert report.first_hole == (horizon, sink)
    assert max_hole_free_length(stack) == HoleFreeLength(horizon, 1 << 22, (horizon, sink))


@given(windows=st.lists(st.integers(1, 2000), min_size=1, max_size=6))
def test_hole_horizon_of_unequal_windows_in_closed_form(windows):
    """Windows add up: layers of window w_l reach sum(w_l - 1) back."""
    horizon = sum(w - 1 for w in windows) + 1
    stack = [SinkWindow(sink=0, window=w) for w in windows]
    assert receptive_field(stack, 1 << 20, stop_at_first_hole=True).first_hole == (horizon, 0)
    assert int(max_hole_free_length(stack, limit=1 << 20)) == horizon


def prefix_consistent_layers():
    simple = st.one_of(st.just(Causal()), st.builds(SinkWindow, sink=st.integers(0, 4), window=st.integers(1, 9)))
    esa = st.builds(lambda l, n, w: ESA(min(l, n - 1), n, w, HEADS), st.integers(0, 4), st.integers(1, 5),
                    st.integers(1, 6))
    per_head = st.lists(st.one_of(simple, esa), min_size=HEADS, max_size=HEADS).map(lambda ps: PerHead(ps, range(HEADS)))
    return st.one_of(st.builds(SinkWindow, sink=st.integers(0, 4), window=st.integers(1, 9)), esa, per_head,
                     st.lists(simple.filter(lambda p: not isinstance(p, Causal)), min_size=2, max_size=2))


@given(stack=st.lists(prefix_consistent_layers(), min_size=1, max_size=3), limit=st.integers(1, 48),
       tiny=st.booleans())
def test_max_hole_free_length_agrees_with_brute_force_at_every_length(stack, limit, tiny):
    hole_free = [receptive_field_bruteforce(stack, n).hole_free for n in range(1, limit + 1)]
    expected = next((n for n, ok in enumerate(hole_free) if not ok), limit)  # lengths 1..expected are hole-free
    assert not any(hole_free[expected:])  # and no longer one is: hole-freeness is a prefix of lengths
    with tiny_batches() if tiny else contextlib.nullcontext():
        result = max_hole_free_length(stack, limit=limit)
    assert result.length == expected and result.limit == limit
    if expected < limit:
        assert result.first_hole == receptive_field_bruteforce(stack, expected + 1).first_hole
        assert result.first_hole[0] == expected and "hole-free up to" in str(result)
    else:
        assert result.first_hole is None and result.reached_limit
        assert result.every_length or "limit" in str(result)


@given(layer=prefix_consistent_layers(), short=st.integers(1, 60), extra=st.integers(0, 60))
def test_accepted_patterns_are_prefix_consistent(layer, short, extra):
    """The premise of max_hole_free_length: a query's keys are the same at every length that holds it."""
    pattern = layer_pattern(layer)
    assert prefix_consistency_problem(pattern) is None
    heads = pattern.required_heads or 1
    at_short = pattern.dense(Geometry(heads, short))[0]
    at_long = pattern.dense(Geometry(heads, short + extra))[0][:, :short]  # the same queries, every key
    assert torch.equal(at_long[..., :short], at_short) and not at_long[..., short:].any()


def test_max_hole_free_length_refuses_length_dependent_patterns():
    """TriangleMix's full band is the last queries, so a query's keys change with the length."""
    mix = TriangleMix(sink=0, window=2, last_q=4)
    assert not torch.equal(mix.dense(Geometry(1, 10))[0, 0], mix.dense(Geometry(1, 20))[0, 0, :10, :10])
    with pytest.raises(ValueError, match="layer 2: TriangleMix"):
        max_hole_free_length([SinkWindow(0, 4), mix])
    table = BlockTable(torch.ones(1, 1, 2, 2, dtype=torch.bool), 16)
    with pytest.raises(ValueError, match="BlockTable"):
        max_hole_free_length([table])
    with pytest.raises(ValueError, match="limit"):
        max_hole_free_length([SinkWindow(0, 4)], limit=0)


def test_max_hole_free_length_with_a_full_layer_is_unbounded():
    result = max_hole_free_length([SinkWindow(0, 4), [Causal(), SinkWindow(0, 4)]], limit=1000)
    assert result.every_length and result.length == 1000 and "every length" in str(result)


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


@given(seq_len=st.integers(1, 120), modes=st.lists(st.integers(0, 2), min_size=2, max_size=2),
       depth=st.integers(1, 3))
def test_hybrid_layers_mixing_esa_window_and_full_heads_agree_with_brute_force(seq_len, modes, depth):
    stack = []
    for layer in range(depth):
        patterns = {"esa": ESA(layer, depth, 4, 4), "ssa": SinkWindow(1, 5), "full": Causal()}
        stack.append((HybridAttention(4, 2, 8, patterns, ["esa", "ssa"]), torch.tensor(modes)))
    fast, slow = receptive_field(stack, seq_len), receptive_field_bruteforce(stack, seq_len)
    assert (fast.first_hole, fast.complete_depth) == (slow.first_hole, slow.complete_depth)
    assert fast.coverage == pytest.approx(slow.coverage, abs=1e-12)


@given(values=st.lists(st.integers(-1000, 1000), min_size=1, max_size=300),
       pieces=st.lists(st.integers(1, 80), min_size=1, max_size=10), data=st.data())
def test_range_extremum_grows_and_answers_like_a_scan(values, pieces, data):
    tables = {"min": RangeExtremum("min", torch.device("cpu")), "max": RangeExtremum("max", torch.device("cpu"))}
    filled, cuts = 0, iter(pieces)
    while filled < len(values):
        step = min(next(cuts, 4 * BLOCK), len(values) - filled)
        for table in tables.values():
            table.append(torch.tensor(values[filled : filled + step], dtype=torch.int32))
        filled += step
        firsts = data.draw(st.lists(st.integers(0, filled - 1), min_size=1, max_size=20))
        lasts = [data.draw(st.integers(f, filled - 1)) for f in firsts]
        for name, table in tables.items():
            got = table.query(torch.tensor(firsts), torch.tensor(lasts)).tolist()
            scan = min if name == "min" else max
            assert got == [scan(values[f : l + 1]) for f, l in zip(firsts, lasts)]


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


@given(data=st.data(), size=st.integers(1, 700))
def test_middle_blocks_give_the_union_of_every_position_in_a_run(data, size):
    """Runs read merged unions over aligned blocks of 8**j positions; they must equal the positions' own."""
    counts = torch.tensor(data.draw(st.lists(st.integers(0, 3), min_size=size, max_size=size)))
    first = torch.randint(0, 1000, (int(counts.sum()),))
    last = first + torch.randint(0, 5, first.shape)
    middles, done = Middles(torch.device("cpu")), 0
    while done < size:  # appended in uneven pieces, as rounds do
        step = min(data.draw(st.integers(1, 300)), size - done)
        begin, end = int(counts[:done].sum()), int(counts[: done + step].sum())
        middles.append(counts[done : done + step], first[begin:end], last[begin:end])
        done += step
    a = torch.tensor(data.draw(st.lists(st.integers(0, size - 1), min_size=1, max_size=8)))
    b = torch.tensor([data.draw(st.integers(int(x), size - 1)) for x in a])
    run, level, block, _ = middles.pieces(a, b)
    got = merge_intervals(*(t.long() for t in middles.gather(run, level, block)), a.numel())
    owner = torch.repeat_interleave(torch.arange(size), counts)
    runs = [(owner >= x) & (owner <= y) for x, y in zip(a.tolist(), b.tolist())]
    row = torch.cat([torch.full((int(r.sum()),), i) for i, r in enumerate(runs)])
    want = merge_intervals(row, torch.cat([first[r] for r in runs]), torch.cat([last[r] for r in runs]), a.numel())
    for g, w in zip(got, want):
        assert torch.equal(g, w)


def test_report_prints_readably():
    text = str(receptive_field([SinkWindow(0, 3)] * 2, 10))
    assert "HOLE at query 5, key 0" in text and "after layer   2" in text and "stopped" not in text


def test_refuses_patterns_that_see_the_future():
    with pytest.raises(ValueError, match="query 1 attend key 2 after it.*causal"):
        receptive_field([PeeksAhead()], 20)


@pytest.mark.parametrize("arg,value,error", [("work_limit", -1, ValueError), ("work_limit", 2.5, TypeError)])
def test_bad_limits(arg, value, error):
    with pytest.raises(error, match=arg):
        receptive_field([Causal()], 10, **{arg: value})


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
