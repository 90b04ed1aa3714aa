"""Boundary pooling against a loop-over-positions reference: padding, short sequences, what it reads, bad input."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from flexsparse.routers import boundary_pool, boundary_positions


def reference_pool(states, mask, pool):
    """Per row: the set of the first and last ``pool`` real positions, each once, averaged (float64)."""
    batch, seq, heads, dim = states.shape
    mask = torch.ones(batch, seq, dtype=torch.bool) if mask is None else mask
    out = torch.zeros(batch, heads, dim, dtype=torch.float64)
    for b in range(batch):
        real = [i for i in range(seq) if mask[b, i]]
        chosen = sorted(set(real[:pool]) | set(real[-pool:] if real else []))
        if chosen:
            out[b] = states[b, chosen].double().mean(0)
    return out


def padded_mask(seq, lengths_and_left):
    rows = []
    for length, left in lengths_and_left:
        row = torch.zeros(seq, dtype=torch.bool)
        start = seq - length if left else 0
        row[start:start + length] = True
        rows.append(row)
    return torch.stack(rows)


@pytest.mark.parametrize("seq,pool", [(1, 1), (1, 100), (5, 3), (6, 3), (7, 3), (20, 3), (200, 100), (250, 100)])
def test_no_mask_matches_reference(seq, pool):
    states = torch.randn(2, seq, 3, 8)
    torch.testing.assert_close(boundary_pool(states, pool_size=pool).double(), reference_pool(states, None, pool),
                               atol=1e-6, rtol=1e-6)


def test_short_sequence_counts_each_token_once():
    """Fewer than 2P real tokens: the plain mean of the real tokens (the authors' code counts the overlap twice)."""
    states = torch.randn(1, 150, 2, 4)
    torch.testing.assert_close(boundary_pool(states, pool_size=100), states.mean(1), atol=1e-6, rtol=1e-6)
    one = torch.randn(1, 1, 2, 4)
    torch.testing.assert_close(boundary_pool(one), one[:, 0])


def test_long_sequence_pools_exactly_the_boundary():
    states = torch.randn(1, 1000, 2, 4)
    expected = torch.cat([states[:, :100], states[:, -100:]], 1).mean(1)
    torch.testing.assert_close(boundary_pool(states), expected, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("left", [False, True])
def test_padding_gives_the_unpadded_result(left):
    seq, pool = 40, 6
    lengths = [40, 25, 12, 11, 1]
    mask = padded_mask(seq, [(n, left) for n in lengths])
    states = torch.randn(len(lengths), seq, 2, 8)
    pooled = boundary_pool(states, mask, pool)
    for b, n in enumerate(lengths):
        alone = states[b:b + 1, seq - n:] if left else states[b:b + 1, :n]
        torch.testing.assert_close(pooled[b:b + 1], boundary_pool(alone, pool_size=pool), atol=1e-6, rtol=1e-6)


def test_mixed_left_right_padding_and_integer_mask():
    mask = padded_mask(30, [(17, True), (17, False), (30, False)])
    states = torch.randn(3, 30, 2, 4)
    expected = reference_pool(states, mask, 5)
    torch.testing.assert_close(boundary_pool(states, mask, 5).double(), expected, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(boundary_pool(states, mask.long(), 5).double(), expected, atol=1e-6, rtol=1e-6)


def test_a_row_with_nothing_to_pool_is_refused():
    """A mask row without a True (no token to pool) names the rows, also when every row is empty."""
    mask = padded_mask(10, [(4, True), (0, False), (3, False), (0, True)])
    with pytest.raises(ValueError, match=r"no token to pool in rows \[1, 3\]"):
        boundary_pool(torch.randn(4, 10, 2, 4), mask, 3)
    with pytest.raises(ValueError, match=r"no token to pool in rows \[0, 1\]"):
        boundary_positions(torch.zeros(2, 10, dtype=torch.bool), 2, 10, 3)
    with pytest.raises(ValueError, match=r"no token to pool in rows \[0\]"):
        boundary_positions(torch.zeros(1, 10, dtype=torch.long), 1, 10, 3)  # a 0/1 attention_mask


def test_reads_only_boundary_tokens():
    """NaN in the middle of the sequence and in padding never reaches the result: only 2P tokens are read."""
    seq, pool = 1000, 10
    states = torch.randn(2, seq, 2, 4)
    mask = padded_mask(seq, [(900, True), (seq, False)])
    poisoned = states.clone()
    poisoned[:, 120:880] = float("nan")
    poisoned[0, :100] = float("nan")  # left padding of row 0
    pooled = boundary_pool(poisoned, mask, pool)
    assert torch.isfinite(pooled).all()
    torch.testing.assert_close(pooled, boundary_pool(states, mask, pool))


def test_padding_values_never_leak():
    """Short rows with NaN padding: finite results, equal to the clean ones."""
    mask = padded_mask(12, [(3, False), (1, False), (5, True)])
    states = torch.randn(3, 12, 2, 4)
    poisoned = states.masked_fill(~mask[:, :, None, None], float("nan"))
    pooled = boundary_pool(poisoned, mask, 4)
    assert torch.isfinite(pooled).all()
    torch.testing.assert_close(pooled, boundary_pool(states, mask, 4))


def test_dtype_and_batch_independence():
    states = torch.randn(3, 50, 2, 4).bfloat16()
    pooled = boundary_pool(states, pool_size=8)
    assert pooled.dtype == torch.bfloat16 and pooled.shape == (3, 2, 4)
    changed = states.clone()
    changed[1:] = torch.randn(2, 50, 2, 4).bfloat16()
    assert torch.equal(boundary_pool(changed, pool_size=8)[0], pooled[0])


@given(
    seq=st.integers(1, 40),
    pool=st.integers(1, 12),
    rows=st.lists(st.tuples(st.integers(0, 40), st.integers(0, 40)), min_size=1, max_size=4),
)
def test_matches_reference_for_any_padding(seq, pool, rows):
    """Any left and right padding amounts (rows: (left, right) pads, clipped to leave one real token)."""
    mask = torch.zeros(len(rows), seq, dtype=torch.bool)
    for b, (left, right) in enumerate(rows):
        left = min(left, seq - 1)
        mask[b, left:seq - min(right, seq - left - 1)] = True
    states = torch.randn(len(rows), seq, 2, 3, generator=torch.Generator().manual_seed(seq * 131 + pool))
    torch.testing.assert_close(boundary_pool(states, mask, pool).double(), reference_pool(states, mask, pool),
                               atol=1e-6, rtol=1e-6)


def test_any_token_subset_pools_the_first_and_last_marked_tokens():
    """A mask with holes (e.g. prompt tokens only, answers left out) pools by rank among the marked tokens."""
    gen = torch.Generator().manual_seed(4)
    mask = torch.rand(6, 50, generator=gen) < torch.tensor([0.0, 0.05, 0.3, 0.6, 0.9, 1.0])[:, None]
    mask[:, 17] = True  # every row marks a token (the first row only this one)
    states = torch.randn(6, 50, 2, 3, generator=gen)
    torch.testing.assert_close(boundary_pool(states, mask, 7).double(), reference_pool(states, mask, 7),
                               atol=1e-6, rtol=1e-6)


def test_bad_input():
    states = torch.randn(2, 10, 2, 4)
    with pytest.raises(ValueError, match="pool_size"):
        boundary_pool(states, pool_size=0)
    with pytest.raises(TypeError, match="pool_size"):
        boundary_pool(states, pool_size=1.9)
    with pytest.raises(ValueError, match="states must be 4-D"):
        boundary_pool(torch.randn(2, 10, 4))
    with pytest.raises(TypeError, match="states must be floating point"):
        boundary_pool(torch.ones(2, 10, 2, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="key_padding_mask must have shape"):
        boundary_pool(states, torch.ones(2, 9, dtype=torch.bool))
    with pytest.raises(TypeError, match="key_padding_mask must be bool"):
        boundary_pool(states, torch.ones(2, 10))
    with pytest.raises(ValueError, match="S >= 1"):
        boundary_pool(torch.randn(2, 0, 2, 4))
    with pytest.raises(ValueError, match="states have batch 0"):
        boundary_pool(torch.randn(0, 10, 2, 4))
    with pytest.raises(ValueError, match="batch must be >= 1"):
        boundary_positions(None, 0, 10, 3, "cpu")


@pytest.mark.gpu
def test_a_mask_on_cuda_pools_with_device_given_as_plain_cuda():
    """``device="cuda"`` names the mask's ``cuda:0``: the two must compare equal, not raise."""
    mask = torch.ones(2, 300, dtype=torch.bool, device="cuda")
    mask[1, :40] = False
    boundary = boundary_positions(mask, 2, 300, 100, "cuda")
    expected = boundary_positions(mask.cpu(), 2, 300, 100, "cpu")
    assert torch.equal(boundary.positions.cpu(), expected.positions)
    assert torch.equal(boundary.weights.cpu(), expected.weights)
