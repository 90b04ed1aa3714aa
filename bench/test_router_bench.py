"""pytest-benchmark: router overhead at inference on a CUDA GPU, per layer (issue 11's goal: < 0.05 ms per layer;
Elastic Attention reports 0.196 ms).

One prefill's routing of one layer: ``router.route(states, mask)`` in eval mode on bf16 states ``[1, S, H, 128]``
(key states of 8 KV heads for the head router, query states of 32 heads for the layer router) with a padding
mask, then ``routing.modes(8)``. Pooling reads 2P = 200 tokens per sequence; the only pass over all S tokens is
the running count of the boolean mask (skipped here when no mask is given: ``mask=none``), so the time should not
grow with S. Each round is one synchronised call (host overhead included).

    pytest bench/test_router_bench.py --benchmark-only --benchmark-group-by=param:kind
"""

import pytest
import torch

from flexsparse.routers import HeadRouter, LayerRouter

pytestmark = pytest.mark.gpu

KV_HEADS, HEADS, HEAD_DIM = 8, 32, 128


@pytest.fixture(autouse=True)
def needs_cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")


@pytest.mark.parametrize("mask", ["padding", "none"])
@pytest.mark.parametrize("length", [8192, 131072, 1048576], ids=["8K", "128K", "1M"])
@pytest.mark.parametrize("kind", ["head", "layer"])
def test_routing_per_layer(benchmark, kind, length, mask):
    router = (HeadRouter if kind == "head" else LayerRouter)(HEAD_DIM).cuda().eval()
    heads = KV_HEADS if kind == "head" else HEADS
    states = torch.randn(1, length, heads, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    padding = torch.ones(1, length, dtype=torch.bool, device="cuda") if mask == "padding" else None

    def run():
        with torch.no_grad():
            router.route(states, padding).modes(KV_HEADS)
        torch.cuda.synchronize()

    run()
    benchmark.extra_info.update(device=torch.cuda.get_device_name(), kind=kind, length=length, mask=mask)
    benchmark.pedantic(run, rounds=50, warmup_rounds=5)
