"""Where a router's per-layer time goes on a CUDA GPU: host time per call, wall time per call back to back, and the
kernels' own GPU time (torch.profiler). bf16 states, B = 1, d = 128, P = 100; head router on 8 KV heads, layer
router on 32 query heads; fused kernel and torch path; 8K, 128K and 1M tokens.

    python bench/profiles/router_host.py
"""

import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))  # the checkout's flexsparse, and bench.common

from bench.common import host_and_wall_us  # noqa: E402
from flexsparse.routers import HeadRouter, LayerRouter, boundary_positions  # noqa: E402


def times(fn, calls: int = 200) -> tuple[float, float, float]:
    """(host us, wall us per call back to back, GPU kernel us per call) of ``fn``."""
    host, wall = host_and_wall_us(fn, calls)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(50):
            fn()
        torch.cuda.synchronize()
    gpu = sum(event.device_time_total for event in prof.key_averages()) / 50
    return host, wall, gpu


def main() -> None:
    for kind, cls, heads in (("head", HeadRouter, 8), ("layer", LayerRouter, 32)):
        router = cls(128, 100).cuda().eval()
        for length in (8192, 131072, 1048576):
            states = torch.randn(1, length, heads, 128, device="cuda", dtype=torch.bfloat16)
            mask = torch.ones(1, length, dtype=torch.bool, device="cuda")
            slots = boundary_positions(mask, 1, length, 100, "cuda")
            with torch.no_grad():
                for fused in (True, False):
                    host, wall, gpu = times(
                        lambda: router.route(states, boundary=slots, fused=fused).modes(8))  # noqa: B023
                    print(f"{kind} {length} fused={fused}: host {host:.1f} us, wall/call {wall:.1f} us, "
                          f"GPU kernels {gpu:.1f} us")


if __name__ == "__main__":
    main()
