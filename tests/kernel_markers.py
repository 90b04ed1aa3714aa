"""Where the Triton kernels can run in this test session, and the skip markers that follow from it.

The root conftest.py sets TRITON_INTERPRET=1 on machines without CUDA (before anything imports triton), so on
the CPU the kernels run in the Triton interpreter unless a run sets TRITON_INTERPRET=0."""

import functools
import os

import pytest
import torch

CUDA = torch.cuda.is_available()
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cuda" if CUDA else "cpu"
"""Where the kernel tests put their tensors."""

kernel_test = pytest.mark.skipif(not (CUDA or INTERPRETED), reason="needs CUDA or TRITON_INTERPRET=1")
"""A test of the Triton kernels on DEVICE: compiled on CUDA, else in the interpreter."""

needs_interpreter = pytest.mark.skipif(
    not INTERPRETED, reason="the one-launch step on CPU tensors needs the Triton interpreter "
    "(the root conftest turns it on where there is no CUDA)")
"""A test of the one-launch decode step on the CPU tensors of the tiny transformers models, which only the
interpreter runs (skipped on CUDA without it)."""


@functools.cache
def interpreted_bf16_dot_is_exact() -> bool:
    """Whether the Triton interpreter's ``tl.dot`` multiplies bf16 operands as numbers: a 16 x 16 product
    against torch's (the interpreter of triton 3.6 to 3.9 at least multiplies their raw bits instead)."""
    import triton
    import triton.language as tl

    @triton.jit
    def product(a_ptr, b_ptr, out_ptr, N: tl.constexpr):
        tile = tl.arange(0, N)[:, None] * N + tl.arange(0, N)[None, :]
        tl.store(out_ptr + tile, tl.dot(tl.load(a_ptr + tile), tl.load(b_ptr + tile)))

    generator = torch.Generator().manual_seed(0)
    a, b = (torch.randn(16, 16, generator=generator).to(torch.bfloat16) for _ in range(2))
    out = torch.empty(16, 16)
    product[(1,)](a, b, out, 16)
    return torch.allclose(out, a.float() @ b.float(), atol=1e-2, rtol=1e-2)


def needs_interpreted_bf16_dot():
    """Skip a bf16 kernel test where the kernels run in an interpreter whose ``tl.dot`` gets bf16 wrong (probed
    once, on the installed triton; CUDA runs are never skipped)."""
    import triton

    broken = INTERPRETED and not interpreted_bf16_dot_is_exact()
    return pytest.mark.skipif(broken, reason=f"the Triton interpreter of the installed triton {triton.__version__} "
                                             "multiplies the raw bits of bf16 tl.dot operands (probed)")
