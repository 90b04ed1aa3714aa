"""Timing, memory and collectives shared by the multi-process GPU benchmarks (``ulysses_gpus.py``,
``ulysses_router_gpus.py``): every rank calls them alike (they hold collectives)."""

import gc
import statistics
import time

import torch
import torch.distributed as dist


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_ms(fn, warmup: int, steps: int, device: torch.device) -> float:
    """Median milliseconds of ``steps`` calls, each timed alone (CUDA events on a GPU), after ``warmup``
    calls. Every rank makes the same number of calls (they hold collectives)."""
    for _ in range(warmup):
        fn()
    sync(device)
    times = []
    for _ in range(steps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            begin = time.perf_counter()
            fn()
            times.append((time.perf_counter() - begin) * 1e3)
    return statistics.median(times)


def free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def reset_peak(device: torch.device) -> None:
    free_memory(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_gib(device: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None


def every_rank(value: float | None, device: torch.device) -> list[float | None]:
    """``value`` of every rank, in rank order."""
    mine = torch.tensor([float("nan") if value is None else value], device=device, dtype=torch.float64)
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    return [None if t.isnan().item() else t.item() for t in every]


def barrier(device: torch.device) -> None:
    dist.barrier(device_ids=[device.index]) if device.type == "cuda" else dist.barrier()


def exchange_ms(sent_bytes: int, dtype: torch.dtype, rounds: int, device: torch.device) -> float:
    """Median milliseconds of one ``all_to_all_single`` whose send buffer this rank sends ``sent_bytes`` of to
    the others (the rest stays local), as a Ulysses layer's exchange does."""
    world = dist.get_world_size()
    numel = sent_bytes * world // (world - 1) // dtype.itemsize
    send = torch.empty(world, numel // world, device=device, dtype=dtype)
    received = torch.empty_like(send)
    return median_ms(lambda: dist.all_to_all_single(received, send), 3, rounds, device)


def relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    """max |got - expected| / max |expected|."""
    expected = expected.float()
    return ((got.float() - expected).abs().max() / expected.abs().max().clamp_min(1e-30)).item()
