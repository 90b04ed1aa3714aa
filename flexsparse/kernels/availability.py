"""Whether flexsparse's Triton kernels can run: the one place that asks (and the only import of triton outside the
kernel modules).

triton is optional: ``pip install flexsparse[hf]`` on a CPU machine has none, and everything but the kernels runs
without it (the kernels' callers take their PyTorch paths). The kernels run on CUDA devices, and on any device under
the Triton interpreter (``TRITON_INTERPRET=1`` in the environment before triton is first imported; slow, for tests).
"""

from __future__ import annotations

import functools
import os
from types import ModuleType

import torch


@functools.cache
def _triton() -> ModuleType | None:
    try:
        import triton
    except ImportError:
        return None
    return triton


def triton_version() -> str | None:
    """The installed triton's version; None when triton cannot be imported."""
    triton = _triton()
    return None if triton is None else triton.__version__


def kernel_unavailable(device: torch.device | str) -> str | None:
    """None when flexsparse's Triton kernels run on ``device``, else why not (for messages). Imports triton only
    for a CUDA device or under ``TRITON_INTERPRET=1``."""
    device = torch.device(device)
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return f"the Triton kernels need a CUDA device (or TRITON_INTERPRET=1 on CPU), got {device.type}"
    triton = _triton()
    if triton is None:
        return "the Triton kernels need triton (pip install triton)"
    if device.type != "cuda" and not triton.knobs.runtime.interpret:
        return ("the Triton kernels need a CUDA device; TRITON_INTERPRET=1 was set after triton was imported, so "
                "the interpreter is off")
    return None


def kernels_run_on(device: torch.device | str) -> bool:
    """Whether flexsparse's Triton kernels run on ``device``: CUDA with triton installed, or any device under the
    Triton interpreter."""
    return kernel_unavailable(device) is None


def kernels_preferred_on(device: torch.device | str) -> bool:
    """Whether the paths that choose for themselves (``backend="auto"``, the default decode and ESA executors)
    take the Triton kernels on ``device``: on CUDA where they run. Under the interpreter on CPU the kernels run
    (:func:`kernels_run_on`) only where a caller asks for them: it is slow, for tests."""
    return torch.device(device).type == "cuda" and kernels_run_on(device)
