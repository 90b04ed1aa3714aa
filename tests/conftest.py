import os
import sys

import pytest
import torch.distributed as dist
from hypothesis import HealthCheck, settings

LOOPBACK = "lo0" if sys.platform == "darwin" else "lo"
"""The loopback interface gloo binds to in the multi-process tests."""

settings.register_profile(
    "ci", max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True
)
settings.register_profile("dev", max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture
def one_rank_group(monkeypatch):
    """A one-process gloo group for the duration of a test."""
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", LOOPBACK)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()
