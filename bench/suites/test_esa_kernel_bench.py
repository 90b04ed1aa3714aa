"""pytest-benchmark of the ESA Triton kernel beside SDPA causal (CUDA only): forward and forward+backward.

B=1, 32 query / 8 KV heads, d=128, bf16, ESA layer 4 of 8 with attn_length 64 (issue 12's shapes). Each round is
one synchronised call, host overhead included.

    pytest bench/suites/test_esa_kernel_bench.py --benchmark-only --benchmark-group-by=param:seq,param:step
"""

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")
from flexsparse.kernels.esa import esa_attention  # noqa: E402
from flexsparse.kernels.esa_index import EsaIndexRule  # noqa: E402

pytestmark = pytest.mark.gpu

HEADS, KV_HEADS, DIM = 32, 8, 128
RULE = EsaIndexRule(4, 8, 64, HEADS)
SEQS = [8192, 32768, 131072]


def _inputs(seq, grad):
    make = lambda h: torch.randn(1, h, seq, DIM, device="cuda", dtype=torch.bfloat16, requires_grad=grad)
    return make(HEADS), make(KV_HEADS), make(KV_HEADS)


def _esa(q, k, v):
    return esa_attention(q, k, v, RULE)


def _sdpa(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


def _run(benchmark, attention, seq, step):
    q, k, v = _inputs(seq, grad=step == "fwd+bwd")
    grad_out = torch.randn_like(q)

    def call():
        if step == "fwd":
            with torch.no_grad():
                attention(q, k, v)
        else:
            q.grad = k.grad = v.grad = None
            attention(q, k, v).backward(grad_out)
        torch.cuda.synchronize()

    call()  # compile / autotune
    rounds = 10 if seq < 131072 or attention is _esa else 3
    benchmark.extra_info.update(device=torch.cuda.get_device_name(), seq=seq, step=step)
    benchmark.pedantic(call, rounds=rounds, warmup_rounds=1)


@pytest.mark.parametrize("step", ["fwd", "fwd+bwd"])
@pytest.mark.parametrize("seq", SEQS)
def test_esa_kernel(benchmark, seq, step):
    _run(benchmark, _esa, seq, step)


@pytest.mark.parametrize("step", ["fwd", "fwd+bwd"])
@pytest.mark.parametrize("seq", SEQS)
def test_sdpa_causal(benchmark, seq, step):
    _run(benchmark, _sdpa, seq, step)
