"""Where the Triton kernels can run in this test session, and the skip markers that follow from it.

The root conftest.py sets TRITON_INTERPRET=1 on machines without CUDA (before anything imports triton), so on
the CPU the kernels run in the Triton interpreter unless a run sets TRITON_INTERPRET=0."""

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
