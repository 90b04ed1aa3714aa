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
