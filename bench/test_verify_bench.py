"""Receptive-field verifier speed on the ESA paper's validation: 131,072 tokens, 8 layers x 8 heads, w = 64.

    pytest bench/test_verify_bench.py --benchmark-only
"""

import pytest
import torch

from flexsparse.masks import ESA
from flexsparse.verify import receptive_field


@pytest.mark.parametrize("seq_len", [32768, 131072])
def test_esa_paper_stack(benchmark, seq_len):
    layers = [ESA(layer, 8, 64, 8) for layer in range(8)]
    report = benchmark.pedantic(receptive_field, args=(layers, seq_len), rounds=1, iterations=1)
    benchmark.extra_info.update(hole_free=report.hole_free, complete_depth=report.complete_depth,
                                threads=torch.get_num_threads())
    assert report.hole_free
