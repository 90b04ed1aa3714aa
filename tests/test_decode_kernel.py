"""The ranged decode kernel (flexsparse.kernels.decode) against its float64 reference.

Kernel tests run on CUDA where there is one, else under the Triton interpreter (the root conftest.py sets
TRITON_INTERPRET=1 on machines without CUDA); they force small tiles and several splits so that the split-K path,
its combine and the range masks are all exercised at tiny sizes. GPU-only tests (bf16 at 131K slots, no host
sync) are marked ``gpu``.
"""

import os

import pytest
import torch

pytest.importorskip("triton")

from flexsparse.kernels.decode import ranged_decode_attention, ranged_decode_reference  # noqa: E402

CUDA = torch.cuda.is_available()
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cuda" if CUDA else "cpu"
kernel_test = pytest.mark.skipif(not (CUDA or INTERPRETED), reason="needs CUDA or TRITON_INTERPRET=1")
FP32_ATOL, FP16_ATOL = 1e-5, 2e-3


def inputs(batch, heads, kv_heads, capacity, dim, dtype=torch.float32, seed=0):
    """q [B, Hq, d], keys/values [B, Hkv, C, d], ~N(0, 1)."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, dim, generator=gen)
    keys, values = (torch.randn(batch, kv_heads, capacity, dim, generator=gen) for _ in range(2))
    return tuple(t.to(DEVICE, dtype) for t in (q, keys, values))


def bounds(pairs, dtype=torch.int64):
    """lo, hi [B] from (lo, hi) per sequence."""
    lo, hi = zip(*pairs)
    return torch.tensor(lo, dtype=dtype, device=DEVICE), torch.tensor(hi, dtype=dtype, device=DEVICE)


def expected(q, keys, values, lo, hi, scale=None):
    return ranged_decode_reference(q.double(), keys.double(), values.double(), lo, hi, scale)


def assert_matches(got, q, keys, values, lo, hi, atol=FP32_ATOL, scale=None):
    torch.testing.assert_close(got.double(), expected(q, keys, values, lo, hi, scale), atol=atol, rtol=0)


# ---------------------------------------------------------------------------------------------------------------
# The reference (no kernel).


def test_reference_matches_a_loop_over_sequences_and_heads():
    q, keys, values = (t.double().cpu() for t in inputs(3, 4, 2, 20, 16, seed=1))
    lo, hi = torch.tensor([-3, 5, 9]), torch.tensor([25, 12, 9])  # clamped to [0, 20]; the last one is empty
    got = ranged_decode_reference(q, keys, values, lo, hi)
    for b, (first, end) in enumerate([(0, 20), (5, 12), (9, 9)]):
        for h in range(4):
            k, v = keys[b, h // 2, first:end], values[b, h // 2, first:end]
            row = torch.softmax(k @ q[b, h] / 4.0, dim=0) @ v if end > first else torch.zeros(16)
            torch.testing.assert_close(got[b, h], row.double(), atol=1e-12, rtol=0)


# ---------------------------------------------------------------------------------------------------------------
# Kernels at tiny sizes (interpreter on CPU, compiled on CUDA) against the float64 reference.

RANGES = [(9, 60), (0, 77), (40, 41)]  # lo > 0 and hi < C (a left-padded prompt), the full buffer, one slot


@kernel_test
@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("group", [1, 2, 4, 5])
def test_kernel_fp32_matches_reference(group, splits):
    """B = 3, 2 KV heads of G query heads (G = 5: padded to 16 rows); 16-slot tiles, so with 3 splits every
    range longer than a tile crosses split boundaries."""
    q, keys, values = inputs(3, 2 * group, 2, 77, 16, seed=group)
    lo, hi = bounds(RANGES)
    got = ranged_decode_attention(q, keys, values, lo, hi, splits=splits, block_n=16)
    assert got.shape == q.shape and got.dtype == q.dtype
    assert_matches(got, q, keys, values, lo, hi)


@kernel_test
@pytest.mark.parametrize("dim", [32, 64, 128])
def test_kernel_head_dims(dim):
    q, keys, values = inputs(1, 4, 2, 50, dim, seed=dim)
    lo, hi = bounds([(3, 47)])
    assert_matches(ranged_decode_attention(q, keys, values, lo, hi, splits=2, block_n=16), q, keys, values, lo, hi)


@kernel_test
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("splits", [1, 4])
def test_kernel_empty_and_out_of_range_bounds(index_dtype, splits):
    """Empty (lo == hi), inverted (lo > hi), and out-of-range (lo < 0, hi > C: the whole buffer) ranges."""
    q, keys, values = inputs(3, 4, 2, 40, 16, seed=7)
    lo, hi = bounds([(20, 20), (30, 10), (-5, 1000)], index_dtype)
    got = ranged_decode_attention(q, keys, values, lo, hi, splits=splits, block_n=16)
    assert (got[:2] == 0).all()
    assert_matches(got, q, keys, values, lo, hi)


@kernel_test
def test_kernel_more_splits_than_tiles():
    """8 splits over ranges of 1 and 17 slots: most programs have an empty chunk and contribute nothing."""
    q, keys, values = inputs(2, 2, 1, 64, 16, seed=3)
    lo, hi = bounds([(63, 64), (5, 22)])
    assert_matches(ranged_decode_attention(q, keys, values, lo, hi, splits=8, block_n=16), q, keys, values, lo, hi)


@kernel_test
@pytest.mark.parametrize("splits", [1, 2])
def test_kernel_fp16_matches_reference(splits):
    q, keys, values = inputs(2, 8, 2, 70, 32, dtype=torch.float16, seed=11)
    lo, hi = bounds([(6, 70), (0, 33)])
    got = ranged_decode_attention(q, keys, values, lo, hi, splits=splits, block_n=16)
    assert got.dtype == torch.float16
    assert_matches(got, q, keys, values, lo, hi, atol=FP16_ATOL)


@kernel_test
def test_kernel_scale_and_default_launch():
    """A custom scale, and the split count and tile size the launcher chooses itself."""
    q, keys, values = inputs(2, 4, 2, 300, 16, seed=2)
    lo, hi = bounds([(17, 290), (0, 300)], torch.int32)
    got = ranged_decode_attention(q, keys, values, lo, hi, scale=0.3)
    assert_matches(got, q, keys, values, lo, hi, scale=0.3)


@kernel_test
@pytest.mark.parametrize("splits", [1, 3])
def test_kernel_strided_q_and_keys(splits):
    """q: heads 2..5 of a [B, H, 1, d] tensor, and a [B, d, H] transpose (head dim not contiguous); keys/values:
    the first C slots of a larger-capacity buffer, KV heads 2..5 of a bigger cache, a [B, C, Hkv, d] layout."""
    gen = torch.Generator().manual_seed(5)
    make = lambda *shape: torch.randn(*shape, generator=gen).to(DEVICE)
    q_full = make(2, 8, 1, 16)
    lo, hi = bounds([(4, 45), (0, 50)])
    q_variants = [q_full[:, 2:8, 0], make(2, 16, 6).transpose(1, 2)]  # [2, 6, 16]
    kv_variants = [
        (make(2, 3, 90, 16)[:, :, :50], make(2, 3, 90, 16)[:, :, :50]),  # a slice of a larger capacity
        (make(2, 7, 50, 16)[:, 2:5], make(2, 7, 50, 16)[:, 2:5]),  # a head slice of a bigger cache
        (make(2, 50, 3, 16).transpose(1, 2), make(2, 50, 3, 16).transpose(1, 2)),  # slot-major layout
    ]
    for q in q_variants:
        for keys, values in kv_variants:
            got = ranged_decode_attention(q, keys, values, lo, hi, splits=splits, block_n=16)
            assert_matches(got, q, keys, values, lo, hi)


@kernel_test
@pytest.mark.parametrize("splits", [1, 3])
def test_kernel_out_into_a_head_slice(splits):
    """out: heads 3..6 of a larger [B, 10, d] buffer; the other heads stay untouched."""
    q, keys, values = inputs(2, 4, 2, 40, 16, seed=13)
    lo, hi = bounds([(2, 39), (0, 0)])
    buffer = torch.full((2, 10, 16), 7.0, device=DEVICE)
    target = buffer[:, 3:7]
    got = ranged_decode_attention(q, keys, values, lo, hi, out=target, splits=splits, block_n=16)
    assert got.data_ptr() == target.data_ptr() and got.stride() == target.stride()
    assert_matches(buffer[:, 3:7], q, keys, values, lo, hi)
    assert (buffer[:, :3] == 7.0).all() and (buffer[:, 7:] == 7.0).all()


@kernel_test
def test_kernel_empty_batch_and_capacity():
    q, keys, values = inputs(0, 4, 2, 8, 16)
    none = torch.zeros(0, dtype=torch.int64, device=DEVICE)
    assert ranged_decode_attention(q, keys, values, none, none).shape == (0, 4, 16)
    q, keys, values = inputs(2, 4, 2, 0, 16)
    out = torch.full((2, 4, 16), 3.0, device=DEVICE)
    ranged_decode_attention(q, keys, values, *bounds([(0, 5), (0, 0)]), out=out)
    assert (out == 0).all()


def _args(**change):
    args = dict(q=torch.zeros(2, 4, 16), keys=torch.zeros(2, 2, 8, 16), values=torch.zeros(2, 2, 8, 16),
                lo=torch.zeros(2, dtype=torch.int64), hi=torch.ones(2, dtype=torch.int64))
    args.update(change)
    return args


@pytest.mark.parametrize(
    "change,error,match",
    [
        (dict(q=torch.zeros(2, 4, 1, 16)), ValueError, "q must be 3-D"),
        (dict(q=[0.0]), TypeError, "q must be a torch.Tensor"),
        (dict(q=torch.zeros(2, 4, 16, dtype=torch.float64)), TypeError, "q must be one of float32"),
        (dict(keys=torch.zeros(2, 8, 16)), ValueError, "keys must be 4-D"),
        (dict(values=torch.zeros(2, 2, 9, 16)), ValueError, "same shape"),
        (dict(keys=torch.zeros(2, 2, 8, 16, dtype=torch.float16)), TypeError, "q's dtype"),
        (dict(keys=torch.zeros(3, 2, 8, 16), values=torch.zeros(3, 2, 8, 16)), ValueError, "q's batch 2"),
        (dict(keys=torch.zeros(2, 3, 8, 16), values=torch.zeros(2, 3, 8, 16)), ValueError, "multiple of keys"),
        (dict(q=torch.zeros(2, 4, 24), keys=torch.zeros(2, 2, 8, 24), values=torch.zeros(2, 2, 8, 24)),
         ValueError, "power of two"),
        (dict(keys=torch.zeros(2, 2, 16, 8).transpose(2, 3)), ValueError, "contiguous last dimension"),
        (dict(lo=torch.zeros(2)), TypeError, "lo must be one of int32, int64"),
        (dict(hi=torch.zeros(3, dtype=torch.int32)), ValueError, r"hi must have shape \[2\]"),
        (dict(lo=torch.zeros(2, 1, dtype=torch.int32)), ValueError, "lo must be 1-D"),
        (dict(hi=torch.zeros(2, dtype=torch.int32, device="meta")), ValueError, "hi is on meta"),
        (dict(out=torch.zeros(2, 4, 8)), ValueError, "out must have q's shape"),
        (dict(out=torch.zeros(2, 4, 16, dtype=torch.float16)), TypeError, "out must be one of float32"),
        (dict(scale=0.0), ValueError, "scale"),
        (dict(splits=0), ValueError, "splits must be >= 1"),
        (dict(block_n=24), ValueError, "block_n must be a power of two"),
        (dict(block_n=8), ValueError, "block_n must be >= 16"),
    ],
)
def test_bad_arguments(change, error, match):
    with pytest.raises(error, match=match):
        ranged_decode_attention(**_args(**change))


def test_reference_checks_its_arguments():
    with pytest.raises(ValueError, match="multiple of keys"):
        ranged_decode_reference(**_args(keys=torch.zeros(2, 3, 8, 16), values=torch.zeros(2, 3, 8, 16)))


@pytest.mark.skipif(CUDA or INTERPRETED, reason="CPU without the interpreter only")
def test_cpu_tensors_need_the_interpreter():
    with pytest.raises(ValueError, match="needs CUDA tensors"):
        ranged_decode_attention(**_args())


# ---------------------------------------------------------------------------------------------------------------
# GPU: bf16 at 131K slots, fp32 exactness at a real head dim, no host sync.


def _random_bounds(batch, capacity, seed):
    """Random ranges; from B = 8 on, sequence 1 is empty and sequence 2 the whole buffer."""
    gen = torch.Generator().manual_seed(seed)
    lo = torch.randint(0, capacity // 4, (batch,), generator=gen)
    hi = torch.randint(capacity // 2, capacity + 1, (batch,), generator=gen)
    if batch >= 8:
        lo[1], hi[1] = 1000, 1000
        lo[2], hi[2] = 0, capacity
    return lo.cuda(), hi.cuda()


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [1, 8])
def test_gpu_bf16_long_ranges_against_float64(batch):
    capacity = 131_072 + 77
    q, keys, values = inputs(batch, 8, 2, capacity, 128, dtype=torch.bfloat16, seed=batch)
    lo, hi = _random_bounds(batch, capacity, seed=batch)
    got = ranged_decode_attention(q, keys, values, lo, hi)
    assert torch.isfinite(got).all()
    assert_matches(got, q, keys, values, lo, hi, atol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("splits", [None, 1])
def test_gpu_fp32_is_exact(splits):
    q, keys, values = inputs(2, 8, 2, 20_000, 128, seed=3)
    lo, hi = _random_bounds(2, 20_000, seed=3)
    assert_matches(ranged_decode_attention(q, keys, values, lo, hi, splits=splits), q, keys, values, lo, hi)


@pytest.mark.gpu
@pytest.mark.parametrize("capacity", [131_072, 2_176])
@pytest.mark.parametrize("splits", [None, 1])
def test_gpu_call_makes_no_host_sync(capacity, splits):
    """The default (split) launch and the one-split launch, after a warm-up call (compilation)."""
    q, keys, values = inputs(2, 8, 2, capacity, 128, dtype=torch.bfloat16)
    lo, hi = _random_bounds(2, capacity, seed=0)
    out = torch.empty_like(q)
    ranged_decode_attention(q, keys, values, lo, hi, out=out, splits=splits)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        ranged_decode_attention(q, keys, values, lo, hi, splits=splits)
        ranged_decode_attention(q, keys, values, lo, hi, out=out, splits=splits)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert_matches(out, q, keys, values, lo, hi, atol=2e-2)
