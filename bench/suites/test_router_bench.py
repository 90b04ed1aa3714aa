"""pytest-benchmark: router overhead at inference on a CUDA GPU, per layer (issue 11's goal: < 0.05 ms per layer;
Elastic Attention reports 0.196 ms).

One prefill's routing of one layer: ``router.route(states, boundary=slots)`` in eval mode on bf16 states
``[1, S, H, 128]`` (key states of 8 KV heads for the head router, query states of 32 heads for the layer router)
with the pooled slots computed once per forward, then ``routing.modes(8)``, through torch and through the fused
kernel (``fused=True``); and the per-forward cost of the slots (the only pass over all S tokens: the running count
of the boolean mask). Pooling reads 2P = 200 tokens per sequence, so the time should not grow with S. Each round
is one synchronised call (host overhead included).

    pytest bench/suites/test_router_bench.py --benchmark-only --benchmark-group-by=param:kind
"""

import pytest
import torch

from flexsparse.routers import HeadRouter, LayerRouter, boundary_positions

pytestmark = pytest.mark.gpu

KV_HEADS, HEADS, HEAD_DIM = 8, 32, 128


@pytest.fixture(autouse=True)
def needs_cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")


@pytest.mark.parametrize("path", ["torch", "fused"])
@pytest.mark.parametrize("length", [8192, 131072, 1048576], ids=["8K", "128K", "1M"])
@pytest.mark.parametrize("kind", ["head", "layer"])
def test_routing_per_layer(benchmark, kind, length, path):
    """One layer's routing with the pooled slots computed once per forward (as a converted model does)."""
    router = (HeadRouter if kind == "head" else LayerRouter)(HEAD_DIM).cuda().eval()
    heads = KV_HEADS if kind == "head" else HEADS
    states = torch.randn(1, length, heads, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    slots = boundary_positions(torch.ones(1, length, dtype=torch.bool, device="cuda"), 1, length, 100, "cuda")

    def run():
        with torch.no_grad():
            router.route(states, boundary=slots, fused=path == "fused").modes(KV_HEADS)
        torch.cuda.synchronize()

    run()
    benchmark.extra_info.update(device=torch.cuda.get_device_name(), kind=kind, length=length, path=path)
    benchmark.pedantic(run, rounds=50, warmup_rounds=5)


@pytest.mark.parametrize("length", [8192, 131072, 1048576], ids=["8K", "128K", "1M"])
def test_pooled_slots_per_forward(benchmark, length):
    """The pooled slots from a padding mask: once per forward, shared by every routed layer."""
    mask = torch.ones(1, length, dtype=torch.bool, device="cuda")

    def run():
        boundary_positions(mask, 1, length, 100, "cuda")
        torch.cuda.synchronize()

    run()
    benchmark.extra_info.update(device=torch.cuda.get_device_name(), length=length)
    benchmark.pedantic(run, rounds=50, warmup_rounds=5)
