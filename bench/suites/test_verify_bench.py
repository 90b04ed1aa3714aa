"""Receptive-field verifier at scale, on the CPU: time per stack and length, peak memory in extra_info.

    pytest bench/suites/test_verify_bench.py --benchmark-only          # every case, 1,048,576 tokens included
    pytest bench/suites/test_verify_bench.py                            # 131,072 and 262,144 tokens only

The 1,048,576-token cases run only with --benchmark-only. On a 2-core CPU every case together takes about 11
minutes; without them, 4-12 minutes (4.3 minutes of CPU time, 12 minutes on a busy machine).

Stacks: the ESA paper's validation (8 layers x 8 heads, attn_length 64; its first hole is query 201,553, key
201,425), sink+window (8 layers of sink 128 + window 2,048: first hole 16,505, key 128), and two per-head mixes:
6 ESA heads + 2 sink+window heads per layer, and HybridAttention with 32 query / 8 KV heads (6 ESA, 2 SSA).
Peak memory is the process's resident-set high-water mark (ru_maxrss), so run one case per process for a clean
number (``-k``); the verifier's own allocations stay well under it.
"""

import resource

import pytest
import torch

from flexsparse import HybridAttention
from flexsparse.masks import ESA, SinkWindow
from flexsparse.verify import max_hole_free_length, receptive_field

PAPER_FIRST_HOLE = (201553, 201425)


def esa_paper():
    return [ESA(layer, 8, 64, 8) for layer in range(8)]


def sink_window():
    return [SinkWindow(128, 2048)] * 8


def mixed_heads():
    ssa = SinkWindow(128, 2048)
    return [[ESA(layer, 8, 64, 8)] * 6 + [ssa] * 2 for layer in range(8)]


def hybrid_gqa():
    layers = []
    for layer in range(8):
        patterns = {"esa": ESA(layer, 8, 64, 32), "ssa": SinkWindow(128, 2048)}
        layers.append(HybridAttention(32, 8, 128, patterns, ["esa"] * 6 + ["ssa"] * 2))
    return layers


STACKS = {"esa_paper": esa_paper, "sink_window": sink_window, "mixed_heads": mixed_heads, "hybrid_gqa": hybrid_gqa}
EXPECTED_HOLE = {"esa_paper": PAPER_FIRST_HOLE, "sink_window": (16505, 128), "mixed_heads": None,
                 "hybrid_gqa": None}
ONE_MILLION = 1 << 20


@pytest.fixture(autouse=True)
def _one_million_only_with_benchmark_only(request):
    params = getattr(request.node, "callspec", None)
    if params and params.params.get("seq_len") == ONE_MILLION and not request.config.getoption("benchmark_only"):
        pytest.skip("1,048,576-token cases run with --benchmark-only")


def _peak_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


@pytest.mark.parametrize("stop_at_first_hole", [False, True], ids=["report", "first_hole"])
@pytest.mark.parametrize("seq_len", [1 << 17, 1 << 18, ONE_MILLION])
@pytest.mark.parametrize("stack", list(STACKS))
def test_receptive_field(benchmark, stack, seq_len, stop_at_first_hole):
    layers = STACKS[stack]()
    report = benchmark.pedantic(receptive_field, args=(layers, seq_len),
                                kwargs=dict(stop_at_first_hole=stop_at_first_hole), rounds=1, iterations=1)
    benchmark.extra_info.update(hole_free=report.hole_free, first_hole=report.first_hole,
                                positions_done=report.positions_done, stopped_early=report.stopped_early,
                                peak_rss_gib=round(_peak_gib(), 3), threads=torch.get_num_threads())
    expected = EXPECTED_HOLE[stack]
    assert report.first_hole == (expected if expected and expected[0] < seq_len else None)


@pytest.mark.parametrize("stack", ["esa_paper", "sink_window"])
def test_max_hole_free_length(benchmark, stack):
    result = benchmark.pedantic(max_hole_free_length, args=(STACKS[stack](),), rounds=1, iterations=1)
    benchmark.extra_info.update(length=result.length, peak_rss_gib=round(_peak_gib(), 3))
    assert result.first_hole == EXPECTED_HOLE[stack] and result.length == EXPECTED_HOLE[stack][0]
