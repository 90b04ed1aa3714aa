"""Which dense kernel runs full causal heads on a device: a measured per-device table.

``bench/tables/dense_kernels.py`` times SDPA's backends (flash, cuDNN, memory-efficient) and FlashAttention-4
(``fa4``, where installed: the ``fast`` extra) on causal GQA attention at lengths 8K to 128K, forward and
forward+backward, and writes the ranking it measured into
``flexsparse/runtime/data/dense_kernels.json`` (shipped in the package), keyed by a substring of the CUDA device
name (``"H100"`` matches ``"NVIDIA H100 80GB HBM3"``; the longest matching key wins). :data:`DENSE_KERNELS`
holds it, loaded at import (a :class:`~flexsparse.runtime.device_tables.MeasuredTable`).

SDPA's executor runs the fastest SDPA backend of a row (:func:`dense_kernel`); FlashAttention-4's executor
(:mod:`flexsparse.runtime.fa4_executor`) prices its work at its own row throughput (:func:`kernel_rate`), so the
planner gives full heads to it where it measured faster and it is installed.

Rules (:func:`dense_kernel`):

* only causal prefill (as many queries as keys) on a CUDA device whose name the table knows, at the dtype it was
  measured at, gets a forced backend; everything else (CPU, unknown devices, other dtypes) runs SDPA's own choice;
* decode steps and chunks (fewer queries than keys) never get one: their key length changes every call, and
  cuDNN builds an execution graph per new shape (~55 ms a call on an H100);
* for the same reason cuDNN is chosen only at key lengths on the bucket grid
  (:func:`~flexsparse.runtime.buckets.is_kv_bucket`), a bounded set of shapes; at other lengths the fastest
  other backend of the ranking runs;
* a length the table has no row for takes the row of the measured length nearest to it (in log scale).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch.nn.attention import SDPBackend

from flexsparse.runtime.buckets import is_kv_bucket
from flexsparse.runtime.device_tables import PASSES, Field, MeasuredTable, positive_number

SDPA_BACKENDS: dict[str, SDPBackend] = {
    "flash": SDPBackend.FLASH_ATTENTION,
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "math": SDPBackend.MATH,
}
"""The table's names of SDPA's backends."""

OTHER_KERNELS = ("fa4",)
"""Kernels the table ranks besides SDPA's backends, each run by its own executor."""

GRAPH_BUILDING_BACKENDS = ("cudnn",)
"""Backends that build an execution graph per new shape: only run at bucketed lengths."""

_FALLBACK_ORDER = ("flash", "efficient", "math")
_KERNELS = (*SDPA_BACKENDS, *OTHER_KERNELS)


@dataclass(frozen=True)
class DenseKernelRanking:
    """SDPA's backends for one (pass, length), fastest first, and the throughput measured for each (TFLOP/s,
    forward FLOPs ``4 d`` per attended (query, key) pair and query head, times 3.5 for forward+backward; empty
    where not measured)."""

    backends: tuple[str, ...]
    tflops: Mapping[str, float]


class DenseKernel(NamedTuple):
    """The backend a call runs on, and its measured throughput in FLOP/s (None: not measured)."""

    backend: str
    flops_per_s: float | None


def _ranking_problem(row: dict) -> str | None:
    """What is wrong across a row's ``backends`` and ``tflops`` (None: nothing)."""
    backends, tflops = row["backends"], row.get("tflops", {})
    if all(b in GRAPH_BUILDING_BACKENDS or b in OTHER_KERNELS for b in backends):
        return (f"'backends' needs one SDPA backend besides {GRAPH_BUILDING_BACKENDS} (for lengths off the bucket "
                f"grid), got {backends!r}")
    if not isinstance(tflops, dict) or any(b not in backends or not positive_number(t) for b, t in tflops.items()):
        return f"'tflops' must map listed backends to positive numbers, got {tflops!r}"
    return None


DENSE_KERNELS: MeasuredTable[DenseKernelRanking, DenseKernelRanking] = MeasuredTable(
    "dense kernel table", "data/dense_kernels.json", key=("pass", "length"),
    fields=(Field.one_of("pass", PASSES), Field.positive_int("length"),
            Field("backends", lambda b: isinstance(b, list) and b != [] and all(k in _KERNELS for k in b)
                  and len(set(b)) == len(b), f"a non-empty list of distinct names from {_KERNELS}")),
    row=lambda row: DenseKernelRanking(tuple(row["backends"]),
                                       {b: float(t) for b, t in row.get("tflops", {}).items()}),
    row_problem=_ranking_problem)
"""The table: ``{"devices": {KEY: {"dtype": "bfloat16", "entries": [{"pass": "forward", "length": 8192,
"backends": ["cudnn", "flash"], "tflops": {"cudnn": 560.0}}, ...]}}}``, loaded at import; a device's
:attr:`~flexsparse.runtime.device_tables.DeviceTable.series` are its rankings by ``(pass,)``."""


def _ranking(device: torch.device, q_len: int, kv_len: int, grad: bool,
             dtype: torch.dtype) -> DenseKernelRanking | None:
    """The table's row for a causal prefill call (nearest measured length), or None (see the module docstring)."""
    if q_len != kv_len:
        return None
    table = DENSE_KERNELS.for_device(device)
    if table is None or dtype != table.dtype:
        return None
    series = table.series.get((PASSES[1] if grad else PASSES[0],))
    return None if series is None else series.nearest(kv_len)


def dense_kernel(device: torch.device, q_len: int, kv_len: int, grad: bool, *, dtype: torch.dtype = torch.bfloat16,
                 block_size: int = 128) -> DenseKernel | None:
    """The SDPA backend the table picks for causal attention of ``q_len`` queries against ``kv_len`` keys (the
    last positions) on ``device``, or None: SDPA's own choice (see the module docstring for the rules). ``grad``:
    the call runs a backward too; ``block_size``: the layer's tile, whose grid says which lengths are bucketed."""
    ranking = _ranking(device, q_len, kv_len, grad, dtype)
    if ranking is None:
        return None
    bucketed = is_kv_bucket(kv_len, block_size)
    backend = next(b for b in ranking.backends
                   if b in SDPA_BACKENDS and (bucketed or b not in GRAPH_BUILDING_BACKENDS))
    tflops = ranking.tflops.get(backend)
    return DenseKernel(backend, tflops * 1e12 if tflops is not None else None)


def kernel_rate(kernel: str, device: torch.device, q_len: int, kv_len: int, grad: bool, *,
                dtype: torch.dtype = torch.bfloat16) -> float | None:
    """The throughput (FLOP/s, the table's count) measured for ``kernel`` (a name of :data:`OTHER_KERNELS` or
    :data:`SDPA_BACKENDS`) on causal prefill of this size on ``device``; None where the table has none."""
    ranking = _ranking(device, q_len, kv_len, grad, dtype)
    tflops = None if ranking is None else ranking.tflops.get(kernel)
    return tflops * 1e12 if tflops is not None else None


def dense_backend(device: torch.device, q_len: int, kv_len: int, grad: bool, *,
                  dtype: torch.dtype = torch.bfloat16, block_size: int = 128) -> str | None:
    """The name of the backend :func:`dense_kernel` picks (a key of :data:`SDPA_BACKENDS`), or None."""
    kernel = dense_kernel(device, q_len, kv_len, grad, dtype=dtype, block_size=block_size)
    return kernel.backend if kernel is not None else None


def sdpa_backend_order(backend: str) -> list[SDPBackend]:
    """SDPA's backends in priority order with ``backend`` first (for ``sdpa_kernel(..., set_priority=True)``):
    the others follow as fallbacks for inputs it cannot run, without the graph-building ones."""
    if backend not in SDPA_BACKENDS:
        raise ValueError(f"backend must be one of {tuple(SDPA_BACKENDS)}, got {backend!r}")
    return [SDPA_BACKENDS[b] for b in dict.fromkeys((backend, *_FALLBACK_ORDER))]
