"""pytest-benchmark suite of attention configurations on a CUDA GPU (the full matrix is `flexsparse bench`).

Each round is one synchronised call: latency, host overhead included (``flexsparse bench`` reports steady-state
time per call, with host work overlapping the GPU).

    pytest bench/suites/test_attention_bench.py --benchmark-only --benchmark-group-by=param:seq
"""

import pytest
import torch
import torch.nn.functional as F

from flexsparse import HybridAttention
from flexsparse.masks import ESA, Causal, SinkWindow

pytestmark = pytest.mark.gpu

HEADS, KV_HEADS, DIM = 32, 8, 128
PATTERNS = {"full": Causal(), "ssa": SinkWindow(128, 2048), "esa": ESA(4, 8, 64, HEADS)}
CONFIGS = {
    "flex causal": (["full"] * 8, "fused"),
    "ssa": (["ssa"] * 8, "fused"),
    "hybrid 0.75 fused": (["full"] * 2 + ["ssa"] * 6, "fused"),
    "hybrid 0.75 split": (["full"] * 2 + ["ssa"] * 6, "split"),
    "esa": (["esa"] * 8, "fused"),
}


def _inputs(seq):
    make = lambda h: torch.randn(1, h, seq, DIM, device="cuda", dtype=torch.bfloat16)
    return make(HEADS), make(KV_HEADS), make(KV_HEADS)


def _timed(benchmark, fn):
    def run():
        fn()
        torch.cuda.synchronize()

    run()  # compile
    benchmark.pedantic(run, rounds=10, warmup_rounds=2)


@pytest.mark.parametrize("seq", [8192, 32768])
def test_sdpa_causal(benchmark, seq):
    q, k, v = _inputs(seq)
    _timed(benchmark, lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True))


@pytest.mark.parametrize("seq", [8192, 32768])
@pytest.mark.parametrize("config", CONFIGS)
def test_hybrid_attention(benchmark, seq, config):
    modes, plan = CONFIGS[config]
    attn = HybridAttention(HEADS, KV_HEADS, DIM, PATTERNS, modes, backend="flex", plan=plan)
    q, k, v = _inputs(seq)
    benchmark.extra_info.update(device=torch.cuda.get_device_name(), modes=modes, plan=plan)
    _timed(benchmark, lambda: attn(q, k, v))
