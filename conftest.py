"""Shared by tests/ and bench/: tests marked `gpu` skip on machines without CUDA; on such machines the Triton
kernels run in the interpreter, which must be chosen before anything imports triton."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session", autouse=True)
def triton_interpreter_scalars():
    """triton-lang/triton#9171: with numpy >= 2.4 the interpreter cannot use a program-id-derived scalar as a loop
    bound (``int()`` of a 1-element array). Applies the upstream fix (squeeze first) to every CPU run (kernels
    also run inside the cache and the routers, not only in their own test modules)."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        yield
        return
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    interpreter._patch_lang_tensor = patched
    yield
    interpreter._patch_lang_tensor = original
