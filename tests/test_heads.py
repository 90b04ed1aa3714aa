"""The shared vocabulary: KV heads to query heads (index and tensor forms agree), mode names/indices to indices,
and which devices the Triton kernels are taken on by default."""

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from flexsparse.heads import per_query_head, query_heads
from flexsparse.kernels.availability import kernels_preferred_on, kernels_run_on
from flexsparse.runtime.modes import mode_index


@given(kv_heads=st.integers(1, 6), group=st.integers(1, 4), dim=st.sampled_from([0, 1, -2]), data=st.data())
def test_query_heads_and_per_query_head_agree(kv_heads, group, dim, data):
    values = torch.randn(2, kv_heads, 3) if dim != 0 else torch.randn(kv_heads, 2, 3)
    expanded = per_query_head(values, group, dim=dim)
    axis = dim % 3
    assert expanded.shape[axis] == kv_heads * group
    chosen = data.draw(st.lists(st.integers(0, kv_heads - 1), min_size=1, max_size=kv_heads, unique=True).map(sorted))
    rows = query_heads(chosen, group)
    assert rows == [h * group + i for h in chosen for i in range(group)]
    for row in rows:  # query head h reads KV head h // group
        torch.testing.assert_close(expanded.select(axis, row), values.select(axis, row // group), atol=0, rtol=0)


def test_mode_index_takes_names_and_indices_and_names_the_place():
    names = ["full", "ssa", "esa"]
    assert [mode_index(names, m) for m in ("full", "esa", 1, np.int64(2))] == [0, 2, 1, 2]
    with pytest.raises(ValueError, match=r"modes for layer 3, KV head 1 names unknown pattern 'nope'; known: \['full'"):
        mode_index(names, "nope", "modes for layer 3, KV head 1")
    for bad in (3, -1, 1.0, True, None):
        with pytest.raises(ValueError, match=rf"modes must be a pattern name or an index < 3, got {bad!r}"):
            mode_index(names, bad)


def test_kernels_are_preferred_on_cuda_only():
    """The interpreter may run the kernels on CPU (``TRITON_INTERPRET=1``), but the paths that choose for
    themselves keep to torch there."""
    assert not kernels_preferred_on("cpu") and not kernels_preferred_on(torch.device("meta"))
    assert kernels_preferred_on("cuda") == kernels_run_on("cuda")
