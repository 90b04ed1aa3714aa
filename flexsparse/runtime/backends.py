"""Backends: which executor set a layer's call plans with.

"flex": the registered executors and compiled flex (fuses any mix); "flex_eager": the same with flex uncompiled
(small sizes, debugging); "dense": masked SDPA on the dense patterns alone (small sizes; has a backward on CPU);
"auto": flex, except on CPU when gradients are needed (flex has no CPU backward) or q is float64 (compiled flex
takes float32, float16 and bfloat16 there), where dense is used.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from flexsparse.masks.base import Pattern
from flexsparse.runtime.call import AttentionCall
from flexsparse.runtime.executors import DenseExecutor, Executor
from flexsparse.runtime.flex import CPU_COMPILED_DTYPES, FlexExecutor

Backend = Literal["auto", "flex", "flex_eager", "dense"]
BACKENDS = ("auto", "flex", "flex_eager", "dense")


def backend_executors(specialised: Sequence[Executor], patterns: Sequence[Pattern], kernel_options: dict | None,
                      max_dense_len: int) -> dict[str, list[Executor]]:
    """Each backend's executors in preference order: ``specialised`` (the registered ones) before flex; dense
    alone."""
    return {
        "flex": [*specialised, FlexExecutor(patterns, compiled=True, kernel_options=kernel_options)],
        "flex_eager": [*specialised, FlexExecutor(patterns, compiled=False, max_len=max_dense_len)],
        "dense": [DenseExecutor(max_len=max_dense_len)],
    }


def choose_backend(backend: Backend, call: AttentionCall, max_dense_len: int) -> str:
    """The backend a call runs on, or a clear error where the chosen one cannot run it."""
    on_cpu, dtype = call.q.device.type == "cpu", call.q.dtype
    compiles_on_cpu = dtype in CPU_COMPILED_DTYPES
    hint = "Use backend='flex' (compiled) for long inputs"
    if backend == "auto":
        backend = "dense" if on_cpu and (call.needs_grad or not compiles_on_cpu) else "flex"
        if backend == "dense" and call.needs_grad:
            hint = "backend='auto' runs dense on CPU when gradients are needed (flex has no CPU backward)"
        elif backend == "dense":
            hint = (f"backend='auto' runs dense on CPU for {dtype} (compiled flex takes float32, float16 or "
                    "bfloat16 there)")
    if backend == "flex" and on_cpu and not compiles_on_cpu:
        raise TypeError(f"backend='flex' (compiled flex_attention) takes float32, float16 or bfloat16 on CPU, "
                        f"q/k/v are {dtype}; use backend='dense', 'flex_eager' or 'auto' for {dtype}")
    if backend in ("flex", "flex_eager") and on_cpu and call.needs_grad:
        raise ValueError(f"backend={backend!r} has no backward on CPU (flex_attention is forward-only there); "
                         "use backend='dense' or 'auto' for CPU training")
    longest = max(call.geometry.q_len, call.geometry.kv_len)
    if backend in ("dense", "flex_eager") and longest > max_dense_len:
        raise ValueError(f"backend={backend!r} costs O(S^2); sequence length {longest} exceeds "
                         f"max_dense_len={max_dense_len}. {hint}")
    return backend
