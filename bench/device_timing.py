"""What the per-device table benchmarks (dense_kernels.py, esa_crossover.py, flex_backends.py) share: a run's time
budget and the median time of a call."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch


class Deadline:
    """The run's time budget: measurements start only before it passes."""

    def __init__(self, seconds: float) -> None:
        self.end = time.perf_counter() + seconds

    def passed(self) -> bool:
        return time.perf_counter() > self.end


def timed_ms(fn: Callable[[], object], budget_s: float, device: torch.device | None = None) -> tuple[float, int]:
    """(median ms, calls timed) of ``fn`` after one warm-up call: at least 3 calls, more while they fit
    ``budget_s``, at most 25. CUDA events on a CUDA device (the default), the host clock on a CPU."""
    on_cuda = device is None or device.type == "cuda"
    fn()
    if on_cuda:
        torch.cuda.synchronize()
    times: list[float] = []
    while len(times) < 3 or (sum(times) < budget_s * 1e3 and len(times) < 25):
        if on_cuda:
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            fn()
            end.record()
            end.synchronize()
            times.append(begin.elapsed_time(end))
        else:
            begin_s = time.perf_counter()
            fn()
            times.append((time.perf_counter() - begin_s) * 1e3)
    return statistics.median(times), len(times)
