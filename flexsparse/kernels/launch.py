"""Launching a Triton kernel whose grid and non-tensor arguments are fixed, with little host time per call.

Triton's ``kernel[grid](...)`` re-derives the specialization of every argument on each call (its dtype, whether
an integer is 1 or a multiple of 16, whether a pointer is 16-byte aligned unless the kernel opts out), hashes it,
looks the compiled kernel up and then launches it: on the H100 machine's CPU a large share of a decode step's
budget at batch 1 (docs/notes/routers.md). A :class:`CompiledLaunch` fixes all but the tensors (their dtypes,
the integers, the constexprs and the grid are set when it is built), so the specialization can change only
through the alignment of the tensors Triton specializes on. Its first call with all of them 16-byte aligned goes
through Triton's own launch (which compiles the kernel if needed) and keeps the compiled kernel it returns; later
calls with them aligned, on the same current device, launch that kernel directly (its launcher, called as Triton's
own launch path calls it, launch hooks included). Other calls, every call under the Triton interpreter, and every
call on a Triton whose compiled kernels lack that launcher interface (3.6 has it) take Triton's own launch path.
Launches go to the current device's current stream, as Triton's do.
"""

from __future__ import annotations

import triton

__all__ = ["CompiledLaunch"]


class CompiledLaunch:
    """``kernel[grid](*tensors, *scalars, **constexprs, **options)`` with only ``tensors`` varying per call.

    ``kernel``: a ``@triton.jit`` function whose parameters are the tensors, then the scalars, then the constexprs
    (each named in ``constexprs``); ``options``: launch options such as ``num_warps``. Callers must pass tensors of
    the dtypes of the first call (a kernel's plan fixes them; they are not re-checked per call).
    """

    __slots__ = ("kernel", "grid", "scalars", "constexprs", "options", "_grid3", "_tail", "_aligned", "_compiled",
                 "_compiled_on")

    def __init__(self, kernel: triton.runtime.JITFunction, grid: tuple[int, ...], scalars: tuple,
                 constexprs: dict, options: dict) -> None:
        self.kernel, self.grid, self.scalars = kernel, tuple(grid), tuple(scalars)
        self.constexprs, self.options = dict(constexprs), dict(options)
        self._grid3 = self.grid + (1,) * (3 - len(self.grid))  # a compiled kernel's launcher takes three dims
        self._compiled = None  # the kernel compiled for aligned tensors, once launched
        self._compiled_on = -1  # the CUDA device it was loaded on
        self._tail: tuple | None = None  # the bound values after the tensors; None: always Triton's launch path
        self._aligned: tuple[int, ...] = ()
        params = getattr(kernel, "params", None)  # None under the Triton interpreter
        if params is None:
            return
        names = kernel.arg_names
        kinds = [param.is_constexpr for param in params]
        runtime = kinds.index(True) if True in kinds else len(kinds)
        if any(kinds[:runtime]) or not all(kinds[runtime:]):
            raise ValueError(f"{kernel.__name__}: the constexpr parameters must come after the others")
        if set(names[runtime:]) != set(constexprs):
            raise ValueError(f"{kernel.__name__}: constexprs must name {names[runtime:]}, got {sorted(constexprs)}")
        if len(scalars) > runtime:
            raise ValueError(f"{kernel.__name__}: {len(scalars)} scalars for {runtime} runtime parameters")
        self._tail = self.scalars + tuple(constexprs[name] for name in names[runtime:])
        self._aligned = tuple(i for i, param in enumerate(params[:runtime - len(scalars)])  # tensors whose alignment
                              if not (param.do_not_specialize or param.do_not_specialize_on_alignment))  # counts

    def __call__(self, *tensors) -> None:
        bits = 0
        for i in self._aligned:
            bits |= tensors[i].data_ptr()
        aligned = not bits & 15
        compiled = self._compiled
        if compiled is not None and aligned:
            driver = triton.runtime.driver.active
            device = driver.get_current_device()
            if device == self._compiled_on:  # what the compiled kernel's own runner does, without its closure
                stream = driver.get_current_stream(device)
                args = tensors + self._tail
                runtime = triton.knobs.runtime
                enter = runtime.launch_enter_hook
                metadata = None if enter is None else compiled.launch_metadata(self._grid3, stream, *args)
                compiled.run(*self._grid3, stream, compiled.function, compiled.packed_metadata, metadata, enter,
                             runtime.launch_exit_hook, *args)
                return
        launched = self.kernel[self.grid](*tensors, *self.scalars, **self.constexprs, **self.options)
        if aligned and self._tail is not None and not triton.knobs.runtime.interpret and launched is not None:
            launched = launched.result() if hasattr(launched, "result") else launched
            if all(hasattr(launched, name) for name in ("run", "function", "packed_metadata", "launch_metadata")):
                self._compiled = launched
                self._compiled_on = triton.runtime.driver.active.get_current_device()
