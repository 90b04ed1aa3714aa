"""What the benchmark scripts of bench/ share: timing a call (CUDA events, or the host clock on a CPU), a run's
time budget, their inputs and failure lines, host against wall time (bench/profiles/), and the torchrun process
group with its collectives (bench/speed/*_gpus.py: every rank calls those alike).

Scripts in a folder of bench/ put the checkout's root first on ``sys.path`` (its flexsparse, and this module as
``bench.common``) before importing it.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist

# ----- timing ------------------------------------------------------------------------------------------------------


def call_ms(fn: Callable[[], object], device: torch.device | None = None) -> float:
    """Milliseconds of one call of ``fn`` timed alone: CUDA events on a CUDA device (the default), the host clock on
    a CPU."""
    if device is not None and device.type != "cuda":
        begin = time.perf_counter()
        fn()
        return (time.perf_counter() - begin) * 1e3
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    fn()
    end.record()
    end.synchronize()
    return begin.elapsed_time(end)


def sync(device: torch.device | None = None) -> None:
    """Waits for a CUDA device (the default); nothing on a CPU."""
    if device is None or device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_ms(fn: Callable[[], object], budget_s: float, device: torch.device | None = None) -> tuple[float, int]:
    """(median ms, calls timed) of ``fn`` after one warm-up call: at least 3 calls, more while they fit
    ``budget_s``, at most 25 (:func:`call_ms` each)."""
    fn()
    sync(device)
    times: list[float] = []
    while len(times) < 3 or (sum(times) < budget_s * 1e3 and len(times) < 25):
        times.append(call_ms(fn, device))
    return statistics.median(times), len(times)


def median_ms(fn: Callable[[], object], warmup: int, steps: int, device: torch.device) -> float:
    """Median milliseconds of ``steps`` calls (:func:`call_ms` each) after ``warmup`` calls: a fixed number of
    calls, so that every rank makes the same ones (they hold collectives)."""
    for _ in range(warmup):
        fn()
    sync(device)
    return statistics.median(call_ms(fn, device) for _ in range(steps))


def host_and_wall_us(fn: Callable[[], object], calls: int) -> tuple[float, float]:
    """(host us, wall us) per call of a CUDA callable ``fn`` run back to back after 10 warm-up calls: host stops
    before the final synchronise, wall after."""
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


class Deadline:
    """The run's time budget: measurements start only before it passes."""

    def __init__(self, seconds: float) -> None:
        self.end = time.perf_counter() + seconds

    def passed(self) -> bool:
        return time.perf_counter() > self.end


# ----- inputs and failures -----------------------------------------------------------------------------------------


def attention_inputs(length: int, grad: bool, heads: int = 32, kv_heads: int = 8, dim: int = 128, *,
                     device: torch.device | str = "cuda", dtype: torch.dtype = torch.bfloat16, seed: int = 0):
    """q ``[1, heads, length, dim]``, k and v ``[1, kv_heads, length, dim]`` (leaves, requiring grad for a
    backward) and the output's gradient (None without), normal random from ``seed``."""
    gen = torch.Generator(device=device).manual_seed(seed)
    make = lambda h: torch.randn(1, h, length, dim, device=device, dtype=dtype, generator=gen)
    q, k, v = (t.requires_grad_(grad) for t in (make(heads), make(kv_heads), make(kv_heads)))
    return q, k, v, (make(heads) if grad else None)


def one_line(err: BaseException) -> str:
    """A failure as one short line for a row: its type and the first line of its message."""
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}"[:200]


def relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    """max |got - expected| / max |expected|."""
    expected = expected.float()
    return ((got.float() - expected).abs().max() / expected.abs().max().clamp_min(1e-30)).item()


# ----- memory ------------------------------------------------------------------------------------------------------


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


# ----- ranks (torchrun) --------------------------------------------------------------------------------------------


def torchrun_world(parser: argparse.ArgumentParser) -> int:
    """The number of ranks torchrun started; a usage error (exit 2) when not launched by torchrun."""
    world = int(os.environ.get("WORLD_SIZE", "0"))
    if not world:
        parser.error("launch with torchrun (WORLD_SIZE is not set)")
    return world


def join_ranks(parser: argparse.ArgumentParser, device_type: str, cpu_option: str) -> torch.device:
    """Joins torchrun's process group and returns this rank's device: ``LOCAL_RANK``'s GPU with NCCL (NVLink
    multicast off, as on the lent machines), or the CPU with gloo (one thread a rank). A usage error naming
    ``cpu_option`` (the toy-size flag) when CUDA is asked for and missing."""
    if device_type == "cuda":
        if not torch.cuda.is_available():
            parser.error(f"no CUDA device: use {cpu_option} on a CPU machine")
        os.environ["NCCL_NVLS_ENABLE"] = "0"  # read at NCCL init
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", timeout=timedelta(minutes=30), device_id=device)
        return device
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo0" if sys.platform == "darwin" else "lo")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(minutes=30))
    return torch.device("cpu")


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
