"""Host and wall time per call of a CUDA callable, shared by the bench/profile_*.py scripts."""

import time

import torch


def host_and_wall_us(fn, calls: int) -> tuple[float, float]:
    """(host us, wall us) per call of ``fn`` run back to back: host stops before the final synchronise, wall after."""
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    host = (time.perf_counter() - start) / calls
    torch.cuda.synchronize()
    wall = (time.perf_counter() - start) / calls
    return host * 1e6, wall * 1e6
