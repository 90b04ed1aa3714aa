"""The decode kernels (flexsparse.kernels.decode: ranged decode, the fused decode step) against their float64
references.

Kernel tests run on CUDA where there is one, else under the Triton interpreter (the root conftest.py sets
TRITON_INTERPRET=1 on machines without CUDA); they force small tiles and several splits so that the split-K path,
its combine and the range masks are all exercised at tiny sizes. GPU-only tests (bf16 at 131K slots, no host
sync) are marked ``gpu``.
"""

import dataclasses

import pytest
import torch

from tests.kernel_markers import CUDA, DEVICE, INTERPRETED, kernel_test

pytest.importorskip("triton")

from flexsparse.kernels import decode, decode_kernels  # noqa: E402
from flexsparse.kernels.decode import decode_step_attention, ranged_decode_attention  # noqa: E402
from flexsparse.kernels.decode_reference import (  # noqa: E402
    DecodeGroup,
    decode_step_reference,
    ranged_decode_reference,
)

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
@pytest.mark.parametrize("dim", [8, 24, 32, 80, 96, 128])
@pytest.mark.parametrize("splits", [1, 2])
def test_kernel_head_dims(dim, splits):
    """Powers of two and the head dims of real models that are not (80: Phi-2, 96: Phi-3), padded in registers;
    the output's lanes are exactly the head dim's (a wider write would show in ``out``'s guard column)."""
    q, keys, values = inputs(1, 4, 2, 50, dim, seed=dim)
    lo, hi = bounds([(3, 47)])
    wide = torch.full((1, 4, dim + 1), 7.0)
    got = ranged_decode_attention(q, keys, values, lo, hi, out=wide[..., :dim], splits=splits, block_n=16)
    assert_matches(got, q, keys, values, lo, hi)
    assert torch.all(wide[..., dim] == 7.0)


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
        (dict(q=torch.zeros(2, 4, 264), keys=torch.zeros(2, 2, 8, 264), values=torch.zeros(2, 2, 8, 264)),
         ValueError, r"head dim must be in \[1, 256\], got 264"),
        (dict(keys=torch.zeros(2, 2, 16, 8).transpose(2, 3)), ValueError, "contiguous last dimension"),
        (dict(lo=torch.zeros(2)), TypeError, "lo must be one of int32, int64"),
        (dict(hi=torch.zeros(3, dtype=torch.int32)), ValueError, r"hi must have shape \[2\]"),
        (dict(lo=torch.zeros(2, 1, dtype=torch.int32)), ValueError, "lo must be 1-D"),
        (dict(hi=torch.zeros(2, dtype=torch.int32, device="meta")), ValueError, "hi is on meta"),
        (dict(out=torch.zeros(2, 4, 8)), ValueError, "out must have q's shape"),
        (dict(out=torch.zeros(2, 4, 16, dtype=torch.float16)), TypeError, "out must be one of float32"),
        (dict(out=[0.0]), TypeError, "out must be a torch.Tensor"),
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
    with pytest.raises(ValueError, match="need CUDA tensors"):
        ranged_decode_attention(**_args())


@kernel_test
def test_ranged_plan_is_reused_and_follows_the_config():
    """A second call of one signature reuses its plan (bounds are read on the device, not baked in); a changed
    KERNEL_CONFIG gives a new plan."""
    q, keys, values = inputs(2, 4, 2, 60, 16, seed=17)
    ranged_decode_attention(q, keys, values, *bounds([(0, 60), (5, 9)]), splits=2, block_n=16)
    plans = len(decode._PLANS)
    lo, hi = bounds([(3, 50), (0, 1)])
    assert_matches(ranged_decode_attention(q, keys, values, lo, hi, splits=2, block_n=16), q, keys, values, lo, hi)
    assert len(decode._PLANS) == plans
    default = dict(decode.KERNEL_CONFIG)
    try:
        decode.KERNEL_CONFIG["num_warps"] = 2
        got = ranged_decode_attention(q, keys, values, lo, hi, splits=2, block_n=16)
    finally:
        decode.KERNEL_CONFIG.update(default)
    assert len(decode._PLANS) == plans + 1
    assert_matches(got, q, keys, values, lo, hi)


# ---------------------------------------------------------------------------------------------------------------
# The fused decode step: write the new token into one or two groups' buffers, attend each group's ranges.

FULL_CAPACITY, RING_CAPACITY = 77, 12
FULL_SLOTS = [(9, 42, 41), (0, 77, 76), (40, 41, 40)]  # (lo, hi, slot): left padding (with 3 splits of 16-slot
# tiles, the last chunk holds the slot alone), the whole buffer, the new token alone
RING_SLOTS = [(0, 12, 5), (0, 7, 6), (3, 12, 3)]  # a full ring at wrap-around (the old key at 5 is evicted), a
# ring still filling, left padding (lo > 0) with the slot at lo
LAYOUTS = {  # name -> groups as (kv_start, KV heads, capacity, slots per sequence), in the order passed
    "one": [(0, 2, FULL_CAPACITY, FULL_SLOTS)],
    "two": [(0, 1, FULL_CAPACITY, FULL_SLOTS), (1, 2, RING_CAPACITY, RING_SLOTS)],
    "ring first": [(0, 2, RING_CAPACITY, RING_SLOTS), (2, 1, FULL_CAPACITY, FULL_SLOTS)],
    "ring at the end": [(1, 1, RING_CAPACITY, RING_SLOTS), (0, 1, FULL_CAPACITY, FULL_SLOTS)],
}


def step_inputs(layout, group_size, dim=16, dtype=torch.float32, batch=3, index_dtype=torch.int64, seed=0):
    """q [B, Hq, d], k_new/v_new [B, Hkv, d] and the groups of ``LAYOUTS[layout]`` (random buffers ~N(0, 1))."""
    gen = torch.Generator().manual_seed(seed)
    specs = LAYOUTS[layout]
    kv_heads = sum(heads for _, heads, _, _ in specs)
    make = lambda *shape: torch.randn(*shape, generator=gen).to(DEVICE, dtype)
    index = lambda values: torch.tensor(values[:batch], dtype=index_dtype, device=DEVICE)
    groups = []
    for kv_start, heads, capacity, slots in specs:
        lo, hi, slot = zip(*slots)
        groups.append(DecodeGroup(make(batch, heads, capacity, dim), make(batch, heads, capacity, dim), kv_start,
                                  index(lo), index(hi), index(slot)))
    return make(batch, group_size * kv_heads, dim), make(batch, kv_heads, dim), make(batch, kv_heads, dim), groups


def step_expected(q, k_new, v_new, groups, scale=None):
    """The float64 reference of the step, from copies taken before the kernel runs (it writes the buffers)."""
    as64 = [dataclasses.replace(g, keys=g.keys.double(), values=g.values.double()) for g in groups]
    return decode_step_reference(q.double(), k_new.double(), v_new.double(), as64, scale)


def assert_step_matches(got, groups, reference, atol=FP32_ATOL):
    out, new_keys, new_values = reference
    torch.testing.assert_close(got.double(), out, atol=atol, rtol=0)
    for group, keys, values in zip(groups, new_keys, new_values):  # the new token at slot, nothing else changed
        assert torch.equal(group.keys.double(), keys) and torch.equal(group.values.double(), values)


def test_step_reference_matches_a_loop_and_keeps_its_inputs():
    q, k_new, v_new, groups = step_inputs("ring first", 2, dtype=torch.float64)
    before = [(g.keys.clone(), g.values.clone()) for g in groups]
    out, new_keys, new_values = decode_step_reference(q, k_new, v_new, groups)
    for group, (keys, values), got_keys, got_values in zip(groups, before, new_keys, new_values):
        assert torch.equal(group.keys, keys) and torch.equal(group.values, values)  # inputs untouched
        for b in range(3):
            lo, hi, slot = (int(t[b]) for t in (group.lo, group.hi, group.slot))
            for head in range(group.keys.shape[1]):
                kv = group.kv_start + head
                k, v = keys[b, head].clone(), values[b, head].clone()
                k[slot], v[slot] = k_new[b, kv], v_new[b, kv]
                torch.testing.assert_close(got_keys[b, head], k, atol=0, rtol=0)
                torch.testing.assert_close(got_values[b, head], v, atol=0, rtol=0)
                for h in (2 * kv, 2 * kv + 1):
                    row = torch.softmax(k[lo:hi] @ q[b, h] / 4.0, dim=0) @ v[lo:hi]
                    torch.testing.assert_close(out[b, h], row, atol=1e-12, rtol=0)


@kernel_test
@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("group_size", [1, 4, 5])
def test_step_fp32_matches_reference(group_size, layout, splits):
    """B = 3, every (lo, hi, slot) case of FULL_SLOTS / RING_SLOTS; 16-slot tiles, so with 3 splits a range
    crosses split boundaries and some chunks are empty or hold the slot alone."""
    q, k_new, v_new, groups = step_inputs(layout, group_size, seed=group_size)
    reference = step_expected(q, k_new, v_new, groups)
    got = decode_step_attention(q, k_new, v_new, groups, splits=splits, block_n=16)
    assert got.shape == q.shape and got.dtype == q.dtype
    assert_step_matches(got, groups, reference)


@kernel_test
@pytest.mark.parametrize("dim", [8, 80])
@pytest.mark.parametrize("splits", [1, 3])
def test_step_head_dims_that_are_not_powers_of_two(dim, splits):
    """The new token is written with exactly the head dim's lanes (the slot's neighbours and the next row keep
    their values) and attended like every other key."""
    q, k_new, v_new, groups = step_inputs("two", 4, dim=dim, seed=dim)
    reference = step_expected(q, k_new, v_new, groups)
    assert_step_matches(decode_step_attention(q, k_new, v_new, groups, splits=splits, block_n=16), groups, reference)


@kernel_test
@pytest.mark.parametrize("batch", [1, 2])
def test_step_batch_sizes(batch):
    q, k_new, v_new, groups = step_inputs("two", 4, batch=batch, index_dtype=torch.int32, seed=batch)
    reference = step_expected(q, k_new, v_new, groups)
    assert_step_matches(decode_step_attention(q, k_new, v_new, groups, splits=2, block_n=16), groups, reference)


@kernel_test
@pytest.mark.parametrize("splits", [1, 2])
def test_step_fp16_matches_reference(splits):
    q, k_new, v_new, groups = step_inputs("two", 4, dim=32, dtype=torch.float16, seed=11)
    reference = step_expected(q, k_new, v_new, groups)
    got = decode_step_attention(q, k_new, v_new, groups, splits=splits, block_n=16)
    assert got.dtype == torch.float16
    assert_step_matches(got, groups, reference, atol=FP16_ATOL)


@kernel_test
def test_step_default_launch_scale_and_int32_bounds():
    """The split counts and tile the launcher chooses itself (several tiles per range), a custom scale."""
    gen = torch.Generator().manual_seed(4)
    make = lambda *shape: torch.randn(*shape, generator=gen).to(DEVICE)
    index = lambda *values: torch.tensor(values, dtype=torch.int32, device=DEVICE)
    full = DecodeGroup(make(2, 1, 600, 32), make(2, 1, 600, 32), 0, index(0, 30), index(599, 420), index(598, 419))
    ring = DecodeGroup(make(2, 3, 40, 32), make(2, 3, 40, 32), 1, index(0, 0), index(40, 40), index(17, 39))
    q, k_new, v_new = make(2, 8, 32), make(2, 4, 32), make(2, 4, 32)
    reference = step_expected(q, k_new, v_new, [full, ring], scale=0.3)
    assert_step_matches(decode_step_attention(q, k_new, v_new, [full, ring], scale=0.3), [full, ring], reference)


@kernel_test
@pytest.mark.parametrize("splits", [1, 3])
def test_step_strided_views_and_out(splits):
    """q, k_new, v_new: views of [B, 1, H, d] tensors transposed to [B, H, 1, d] (as a model's projections);
    the ring's buffers slot-major ([B, C, n, d] transposed); out: heads 2..13 of a [B, 16, d] buffer."""
    gen = torch.Generator().manual_seed(8)
    make = lambda *shape: torch.randn(*shape, generator=gen).to(DEVICE)
    q = make(3, 1, 12, 16).transpose(1, 2)[:, :, 0]
    k_new, v_new = (make(3, 1, 3, 16).transpose(1, 2)[:, :, 0] for _ in range(2))
    _, _, _, (full, ring) = step_inputs("two", 4, seed=8)
    ring = dataclasses.replace(ring, keys=make(3, RING_CAPACITY, 2, 16).transpose(1, 2),
                               values=make(3, RING_CAPACITY, 2, 16).transpose(1, 2))
    reference = step_expected(q, k_new, v_new, [full, ring])
    buffer = torch.full((3, 16, 16), 7.0, device=DEVICE)
    got = decode_step_attention(q, k_new, v_new, [full, ring], out=buffer[:, 2:14], splits=splits, block_n=16)
    assert got.data_ptr() == buffer[:, 2:14].data_ptr()
    assert_step_matches(buffer[:, 2:14], [full, ring], reference)
    assert (buffer[:, :2] == 7.0).all() and (buffer[:, 14:] == 7.0).all()


@kernel_test
def test_step_plan_is_reused_across_steps():
    """Step after step on one layer's buffers: one plan, its workspace reused; every step correct."""
    q, k_new, v_new, groups = step_inputs("two", 4, batch=1, seed=21)
    decode_step_attention(q, k_new, v_new, groups, splits=3, block_n=16)
    plans = len(decode._PLANS)
    gen = torch.Generator().manual_seed(22)
    for step in range(3):
        full, ring = groups
        index = lambda value: torch.tensor([value], device=DEVICE)
        groups = [dataclasses.replace(full, hi=index(61 + step), slot=index(60 + step), lo=index(9)),
                  dataclasses.replace(ring, lo=index(0), hi=index(12), slot=index(step))]
        q, k_new, v_new = (torch.randn(*t.shape, generator=gen).to(DEVICE) for t in (q, k_new, v_new))
        reference = step_expected(q, k_new, v_new, groups)
        assert_step_matches(decode_step_attention(q, k_new, v_new, groups, splits=3, block_n=16), groups, reference)
    assert len(decode._PLANS) == plans


@kernel_test
def test_step_empty_batch():
    q, k_new, v_new, groups = step_inputs("two", 2, batch=0)
    assert decode_step_attention(q, k_new, v_new, groups).shape == (0, 6, 16)


def _step_args(**change):
    """Valid arguments (B = 2, Hq = 4, Hkv = 2, d = 16; groups: KV head 0 in 8 slots, KV head 1 in 5), with
    ``change``: argument -> value, or ``"groups[i].field"`` -> value."""
    index = lambda: torch.tensor([0, 1])
    group = lambda start, capacity: DecodeGroup(torch.zeros(2, 1, capacity, 16), torch.zeros(2, 1, capacity, 16),
                                                start, index(), index() + 1, index())
    args = dict(q=torch.zeros(2, 4, 16), k_new=torch.zeros(2, 2, 16), v_new=torch.zeros(2, 2, 16),
                groups=[group(0, 8), group(1, 5)])
    for name, value in change.items():
        if name.startswith("groups["):
            i, field = int(name[7]), name.split(".")[1]
            args["groups"][i] = dataclasses.replace(args["groups"][i], **{field: value})
        else:
            args[name] = value
    return args


@pytest.mark.parametrize(
    "change,error,match",
    [
        (dict(q=torch.zeros(2, 4, 1, 16)), ValueError, "q must be 3-D"),
        (dict(q=torch.zeros(2, 4, 16, dtype=torch.float64)), TypeError, "q must be one of float32"),
        (dict(q=torch.zeros(2, 5, 16)), ValueError, "multiple of k_new's heads"),
        (dict(k_new=torch.zeros(2, 2, 8)), ValueError, "k_new and v_new must have shape"),
        (dict(v_new=torch.zeros(2, 2, 16, dtype=torch.float16)), TypeError, "v_new must have q's dtype"),
        (dict(k_new=torch.zeros(2, 2, 16, device="meta")), ValueError, "k_new is on meta"),
        (dict(groups=_step_args()["groups"][0]), TypeError, "groups must be a list or tuple"),
        (dict(groups=[]), ValueError, "one or two DecodeGroup"),
        (dict(groups=_step_args()["groups"] * 2), ValueError, "one or two DecodeGroup"),
        (dict(groups=[(0, 1)]), TypeError, r"groups\[0\] must be a DecodeGroup"),
        (dict(groups=_step_args()["groups"][:1]), ValueError, "cover the KV heads 0..1"),
        (dict(**{"groups[1].kv_start": 0}), ValueError, "cover the KV heads"),  # overlapping
        (dict(**{"groups[1].kv_start": 2}), ValueError, "cover the KV heads"),  # a gap
        (dict(**{"groups[0].kv_start": -1}), ValueError, r"groups\[0\].kv_start must be >= 0"),
        (dict(**{"groups[0].kv_start": 0.0}), TypeError, r"groups\[0\].kv_start must be an int"),
        (dict(**{"groups[0].keys": torch.zeros(2, 1, 8, 16, dtype=torch.float16)}), TypeError,
         r"groups\[0\].keys must have q's dtype"),
        (dict(**{"groups[1].values": torch.zeros(2, 1, 6, 16)}), ValueError, r"groups\[1\].values must have the "
                                                                             "same shape"),
        (dict(**{"groups[1].keys": torch.zeros(3, 1, 5, 16), "groups[1].values": torch.zeros(3, 1, 5, 16)}),
         ValueError, r"groups\[1\].keys/values \[B, Hkv, C, d\] must match q's batch 2"),
        (dict(**{"groups[1].keys": torch.zeros(2, 1, 0, 16), "groups[1].values": torch.zeros(2, 1, 0, 16)}),
         ValueError, "at least one slot"),
        (dict(**{"groups[0].keys": torch.zeros(2, 1, 16, 8).transpose(2, 3)}), ValueError,
         "contiguous last dimension"),
        (dict(**{"groups[0].lo": torch.zeros(2)}), TypeError, r"groups\[0\].lo must be one of int32, int64"),
        (dict(**{"groups[1].slot": torch.zeros(3, dtype=torch.int64)}), ValueError,
         r"groups\[1\].slot must have shape \[2\]"),
        (dict(**{"groups[1].hi": torch.zeros(2, dtype=torch.int64, device="meta")}), ValueError,
         r"groups\[1\].hi is on meta"),
        (dict(q=torch.zeros(2, 4, 264), k_new=torch.zeros(2, 2, 264), v_new=torch.zeros(2, 2, 264),
              **{f"groups[{i}].{n}": torch.zeros(2, 1, 4, 264) for i in (0, 1) for n in ("keys", "values")}),
         ValueError, r"head dim must be in \[1, 256\]"),
        (dict(out=torch.zeros(2, 4, 8)), ValueError, "out must have q's shape"),
        (dict(out=torch.zeros(2, 4, 16, dtype=torch.float16)), TypeError, "out must be one of float32"),
        (dict(out=[0.0]), TypeError, "out must be a torch.Tensor"),
        (dict(scale=-1.0), ValueError, "scale"),
        (dict(splits=0), ValueError, "splits must be >= 1"),
    ],
)
def test_step_bad_arguments(change, error, match):
    with pytest.raises(error, match=match):
        decode_step_attention(**_step_args(**change))


def test_step_reference_checks_its_arguments():
    with pytest.raises(ValueError, match="cover the KV heads"):
        decode_step_reference(**_step_args(**{"groups[1].kv_start": 0}))


# ---------------------------------------------------------------------------------------------------------------
# GPU: bf16 at 131K slots (head dims 128 and 96), fp32 exactness at a real head dim, no host sync.


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
@pytest.mark.parametrize("batch, dim", [(1, 128), (8, 128), (2, 96)])
def test_gpu_bf16_long_ranges_against_float64(batch, dim):
    capacity = 131_072 + 77
    q, keys, values = inputs(batch, 8, 2, capacity, dim, dtype=torch.bfloat16, seed=batch)
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


def _layer_step(batch, seed):
    """A Qwen3-8B-like layer's decode step, bf16: Hq = 32, Hkv = 8, d = 128; KV heads 0-1 full (131,072 + 77
    slots, the new token appended after a random range), KV heads 2-7 a 2,176-slot ring (full, the slot mid-ring;
    from B = 8 on also a filling ring and a range of the new token alone)."""
    gen = torch.Generator().manual_seed(seed)
    make = lambda *shape: torch.randn(*shape, generator=gen).to("cuda", torch.bfloat16)
    full_capacity, ring_capacity = 131_072 + 77, 2_176
    full_lo = torch.randint(0, full_capacity // 4, (batch,), generator=gen)
    full_hi = torch.randint(full_capacity // 2, full_capacity + 1, (batch,), generator=gen)
    ring_slot = torch.randint(0, ring_capacity, (batch,), generator=gen)
    ring_lo, ring_hi = torch.zeros(batch, dtype=torch.int64), torch.full((batch,), ring_capacity)
    if batch >= 8:
        ring_hi[1] = ring_slot[1] + 1
        ring_lo[2], ring_hi[2] = ring_slot[2], ring_slot[2] + 1
    groups = [DecodeGroup(make(batch, 2, full_capacity, 128), make(batch, 2, full_capacity, 128), 0,
                          full_lo.cuda(), full_hi.cuda(), (full_hi - 1).cuda()),
              DecodeGroup(make(batch, 6, ring_capacity, 128), make(batch, 6, ring_capacity, 128), 2,
                          ring_lo.cuda(), ring_hi.cuda(), ring_slot.cuda())]
    q = make(batch, 1, 32, 128).transpose(1, 2)[:, :, 0]
    k_new, v_new = (make(batch, 1, 8, 128).transpose(1, 2)[:, :, 0] for _ in range(2))
    return q, k_new, v_new, groups


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [1, 8])
def test_gpu_step_bf16_layer_against_float64(batch):
    q, k_new, v_new, groups = _layer_step(batch, seed=batch)
    reference = step_expected(q, k_new, v_new, groups)
    got = decode_step_attention(q, k_new, v_new, groups)
    assert torch.isfinite(got).all()
    assert_step_matches(got, groups, reference, atol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("splits", [None, 1])
def test_gpu_step_makes_no_host_sync(splits):
    """The default (split) launch and the one-split launch, after a warm-up call (compilation, the plan)."""
    q, k_new, v_new, groups = _layer_step(2, seed=0)
    out = torch.empty_like(q)
    decode_step_attention(q, k_new, v_new, groups, out=out, splits=splits)
    decode_step_attention(q, k_new, v_new, groups, splits=splits)
    torch.cuda.synchronize()
    reference = step_expected(q, k_new, v_new, groups)  # the buffers already hold the new token: rewriting is a no-op
    torch.cuda.set_sync_debug_mode("error")
    try:
        decode_step_attention(q, k_new, v_new, groups, splits=splits)
        decode_step_attention(q, k_new, v_new, groups, out=out, splits=splits)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert_step_matches(out, groups, reference, atol=2e-2)


# ---------------------------------------------------------------------------------------------------------------
# DecodeStep: a step prepared once for a loop over the same buffers.


def _next_step(groups, step, gen, q, k_new, v_new):
    """Step ``step`` after the first: new q/k_new/v_new and bounds of the same layouts, the same buffers."""
    full, ring = groups
    index = lambda value: torch.tensor([value] * q.shape[0], device=DEVICE)
    groups = [dataclasses.replace(full, hi=index(61 + step), slot=index(60 + step), lo=index(9)),
              dataclasses.replace(ring, lo=index(0), hi=index(12), slot=index(step))]
    return (*(torch.randn(*t.shape, generator=gen).to(DEVICE) for t in (q, k_new, v_new)), groups)


@kernel_test
def test_prepared_step_runs_a_loop_of_steps_like_decode_step_attention():
    q, k_new, v_new, groups = step_inputs("two", 4, batch=2, seed=31)
    reference = step_expected(q, k_new, v_new, groups, scale=0.2)
    step = decode.DecodeStep(q, k_new, v_new, groups, 0.2, splits=3, block_n=16)
    assert_step_matches(step(q, k_new, v_new, groups), groups, reference)
    gen = torch.Generator().manual_seed(32)
    for index in range(1, 4):
        q, k_new, v_new, groups = _next_step(groups, index, gen, q, k_new, v_new)
        assert step.accepts(q, k_new, v_new, groups, 0.2)
        reference = step_expected(q, k_new, v_new, groups, scale=0.2)
        assert_step_matches(step(q, k_new, v_new, groups), groups, reference)


@kernel_test
def test_prepared_step_takes_one_token_4d_projections():
    """q/k_new/v_new as [B, H, 1, d] (a model's projections): the output is [B, Hq, 1, d], the same values."""
    q, k_new, v_new, groups = step_inputs("two", 4, batch=2, seed=35)
    reference = step_expected(q, k_new, v_new, groups)
    step = decode.DecodeStep(q[:, :, None], k_new[:, :, None], v_new[:, :, None], groups, splits=2, block_n=16)
    assert step.accepts(q[:, :, None], k_new[:, :, None], v_new[:, :, None], groups)
    assert not step.accepts(q, k_new, v_new, groups)
    got = step(q[:, :, None], k_new[:, :, None], v_new[:, :, None], groups)
    assert got.shape == (2, 12, 1, 16)
    assert_step_matches(got[:, :, 0], groups, reference)
    with pytest.raises(ValueError, match="one token"):
        decode.DecodeStep(q[:, :, None].expand(2, 12, 2, 16), k_new[:, :, None], v_new[:, :, None], groups)


@kernel_test
def test_prepared_step_refuses_other_buffers_layouts_and_scales():
    q, k_new, v_new, groups = step_inputs("two", 4, batch=2, seed=33)
    step = decode.DecodeStep(q, k_new, v_new, groups)
    full, ring = groups
    assert step.accepts(q, k_new, v_new, groups)
    assert not step.accepts(q, k_new, v_new, groups, scale=0.5)
    assert not step.accepts(q, k_new, v_new, [dataclasses.replace(full, keys=full.keys.clone()), ring])
    assert not step.accepts(q, k_new, v_new, [full, dataclasses.replace(ring, slot=ring.slot.int())])
    assert not step.accepts(q.transpose(0, 1).contiguous().transpose(0, 1), k_new, v_new, groups)
    assert not step.accepts(q, k_new, v_new, [full])
    with pytest.raises(ValueError, match="cover the KV heads"):
        decode.DecodeStep(q, k_new, v_new, [full])


@pytest.mark.gpu
def test_gpu_prepared_step_launches_the_compiled_kernels_directly(monkeypatch):
    """After the first step, the split and combine kernels launch without Triton's per-call launch path (counted
    on the JIT functions); a misaligned q still gives the right result (through Triton's path)."""
    runs = []
    monkeypatch.setattr(decode, "_PLANS", {})  # a fresh plan: one an earlier test launched starts direct
    for kernel in (decode_kernels.decode_split_kernel, decode_kernels.decode_combine_kernel):
        original = kernel.run
        monkeypatch.setattr(kernel, "run", lambda *a, _run=original, **k: runs.append(1) or _run(*a, **k))
    q, k_new, v_new, groups = _layer_step(1, seed=5)
    step = decode.DecodeStep(q, k_new, v_new, groups)
    reference = step_expected(q, k_new, v_new, groups)
    assert_step_matches(step(q, k_new, v_new, groups), groups, reference, atol=2e-2)
    first = len(runs)
    assert first == 2  # the split kernel and the combine (B = 1 at 131K slots: several splits)
    for _ in range(3):
        q = torch.randn_like(q)
        reference = step_expected(q, k_new, v_new, groups)
        assert_step_matches(step(q, k_new, v_new, groups), groups, reference, atol=2e-2)
    assert len(runs) == first
    storage = torch.randn(q.numel() + 1, device="cuda", dtype=q.dtype)
    shifted = storage[1:].view(q.shape)  # 2 bytes past a 16-byte boundary, q's strides
    assert step.accepts(shifted, k_new, v_new, groups)
    reference = step_expected(shifted, k_new, v_new, groups)
    assert_step_matches(step(shifted, k_new, v_new, groups), groups, reference, atol=2e-2)
    assert len(runs) == first + 1  # the split kernel reads q: Triton's path; the combine's arguments are aligned
