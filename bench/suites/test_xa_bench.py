"""pytest-benchmark of XAttention's whole cost on a CUDA GPU: the fused estimator + selection, the selection alone,
and the flex execution of the resolved block table, beside SDPA and flex causal at the same length.

Inputs come from :mod:`flexsparse.synthetic` (sinks, windows, needles, per-head differences), so the densities are
those of peaked attention, not of random q/k. Each round is one synchronised call.

    pytest bench/suites/test_xa_bench.py --benchmark-only --benchmark-group-by=param:seq
"""

import pytest
import torch
import torch.nn.functional as F

from flexsparse.masks import BlockTable, Causal, Geometry
from flexsparse.masks.xa_selection import estimate_and_select, select_blocks
from flexsparse.runtime.compiled import run_flex
from flexsparse.synthetic import synthetic_attention_inputs

pytestmark = pytest.mark.gpu

HEADS, KV_HEADS, DIM, STRIDE, BLOCK = 32, 8, 128, 16, 128
SEQS = [32768, 131072]
_inputs = {}


def _qkv(seq):
    if seq not in _inputs:
        _inputs.clear()  # one length at a time (1.5 GiB at 128K)
        _inputs[seq] = synthetic_attention_inputs(1, HEADS, KV_HEADS, seq, DIM, seed=0, device="cuda",
                                                  dtype=torch.bfloat16).qkv
    return _inputs[seq]


def _timed(benchmark, fn, rounds=10):
    def run():
        fn()
        torch.cuda.synchronize()

    run()  # compile
    benchmark.pedantic(run, rounds=rounds, warmup_rounds=2)


def _threshold():
    return torch.full((HEADS,), 0.9, device="cuda")


@pytest.mark.parametrize("seq", SEQS)
def test_xa_estimate_and_select(benchmark, seq):
    q, k, _ = _qkv(seq)
    threshold = _threshold()
    table = estimate_and_select(q, k, threshold, STRIDE, BLOCK)
    blocks = table.shape[-1]
    benchmark.extra_info.update(device=torch.cuda.get_device_name(),
                                density=float(table.sum()) / (HEADS * blocks * (blocks + 1) / 2))
    _timed(benchmark, lambda: estimate_and_select(q, k, threshold, STRIDE, BLOCK))


@pytest.mark.parametrize("seq", SEQS)
def test_xa_selection_alone(benchmark, seq):
    from flexsparse.kernels.xa_estimate import antidiagonal_block_mass

    q, k, _ = _qkv(seq)
    mass, threshold = antidiagonal_block_mass(q, k, STRIDE, BLOCK), _threshold()
    _timed(benchmark, lambda: select_blocks(mass, threshold, q_len=seq, kv_len=seq, block_size=BLOCK))


@pytest.mark.parametrize("seq", SEQS)
def test_flex_xa_resolved(benchmark, seq):
    """Attention over the resolved table (BlockMask built once, as a layer would per input)."""
    q, k, v = _qkv(seq)
    table = estimate_and_select(q, k, _threshold(), STRIDE, BLOCK)
    block_mask = BlockTable(table, BLOCK).block_mask(Geometry(HEADS, seq, seq, BLOCK, q.device))
    blocks = table.shape[-1]
    benchmark.extra_info.update(density=float(table.sum()) / (HEADS * blocks * (blocks + 1) / 2))
    _timed(benchmark, lambda: run_flex(q, k, v, block_mask, DIM**-0.5), rounds=5)


@pytest.mark.parametrize("seq", SEQS)
def test_xa_block_mask_build(benchmark, seq):
    q, k, _ = _qkv(seq)
    table = estimate_and_select(q, k, _threshold(), STRIDE, BLOCK)
    geometry = Geometry(HEADS, seq, seq, BLOCK, q.device)
    _timed(benchmark, lambda: BlockTable(table, BLOCK).block_mask(geometry))


@pytest.mark.parametrize("seq", SEQS)
def test_flex_causal(benchmark, seq):
    q, k, v = _qkv(seq)
    block_mask = Causal().block_mask(Geometry(HEADS, seq, seq, BLOCK, q.device))
    _timed(benchmark, lambda: run_flex(q, k, v, block_mask, DIM**-0.5), rounds=5)


@pytest.mark.parametrize("seq", SEQS)
def test_sdpa_causal(benchmark, seq):
    q, k, v = _qkv(seq)
    _timed(benchmark, lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True), rounds=5)
