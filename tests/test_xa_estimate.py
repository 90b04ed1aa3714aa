"""XAttention's antidiagonal estimator: the torch path against a literal loop, the fused Triton kernel against the
torch path (under TRITON_INTERPRET=1 on CPU, natively on the GPU), positions, padding, GQA, recompiles."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from flexsparse.kernels.xa_estimate import antidiagonal_block_mass, block_mass_torch
from flexsparse.synthetic import synthetic_attention_inputs


def literal_block_mass(q, k, stride, block, q_start=None, kv_valid_len=None):
    """The estimate written out: per query group and visible key group, the antidiagonal's dot products summed,
    scaled by 1 / (sqrt(d) stride), soft-maxed over the visible groups, added per (query block, key block)."""
    batch, heads, q_len, dim = q.shape
    kv_len = k.shape[2]
    k = k.repeat_interleave(heads // k.shape[1], dim=1)
    q_start = kv_len - q_len if q_start is None else q_start
    out = torch.zeros(batch, heads, -(-q_len // block), -(-kv_len // block), dtype=torch.float64)
    for b in range(batch):
        valid = kv_len if kv_valid_len is None else min(int(kv_valid_len[b]), kv_len)
        for r in range(-(-q_len // stride)):
            first = q_start + r * stride
            if first >= valid:
                continue
            groups = [j for j in range(-(-kv_len // stride)) if j * stride <= first and j * stride < valid]
            scores = torch.zeros(heads, len(groups), dtype=torch.float64)
            for col, j in enumerate(groups):
                for t in range(stride):
                    qi, kj = r * stride + stride - 1 - t, j * stride + t
                    if qi < q_len and q_start + qi < valid and kj < valid:
                        scores[:, col] += (q[b, :, qi].double() * k[b, :, kj].double()).sum(-1)
            probs = torch.softmax(scores / dim**0.5 / stride, -1)
            for col, j in enumerate(groups):
                out[b, :, r * stride // block, j * stride // block] += probs[:, col]
    return out.float()


def qk(batch, heads, kv_heads, q_len, kv_len, dim, seed=0, dtype=torch.float32, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, q_len, dim, generator=gen)
    k = torch.randn(batch, kv_heads, kv_len, dim, generator=gen)
    return q.to(device, dtype), k.to(device, dtype)


CASES = [  # batch, heads, kv heads, q_len, kv_len, dim, stride, block, kv_valid_len
    (1, 2, 1, 64, 64, 16, 4, 16, None),
    (2, 4, 2, 100, 100, 16, 8, 32, [100, 61]),
    (1, 2, 2, 37, 37, 16, 4, 16, None),
    (2, 4, 1, 40, 130, 16, 4, 16, [130, 90]),  # chunked prefill: queries at 90..129, padded batch
    (1, 3, 3, 33, 70, 8, 2, 16, None),  # q_start = 37: not a multiple of the stride or the block
]


@pytest.mark.parametrize("batch,heads,kv_heads,q_len,kv_len,dim,stride,block,valid", CASES)
def test_torch_estimator_matches_the_literal_scoring(batch, heads, kv_heads, q_len, kv_len, dim, stride, block, valid):
    q, k = qk(batch, heads, kv_heads, q_len, kv_len, dim)
    valid = None if valid is None else torch.tensor(valid)
    got = block_mass_torch(q, k, stride, block, kv_valid_len=valid)
    torch.testing.assert_close(got, literal_block_mass(q, k, stride, block, kv_valid_len=valid), atol=1e-5, rtol=1e-5)


@given(q_len=st.integers(1, 48), extra=st.integers(0, 40), stride=st.sampled_from([1, 2, 4, 8]),
       per_block=st.sampled_from([1, 2, 4]), group=st.sampled_from([1, 2]), cut=st.integers(0, 50),
       seed=st.integers(0, 1000))
def test_estimator_positions_and_padding_match_the_literal(q_len, extra, stride, per_block, group, cut, seed):
    """Hypothesis over sizes not divisible by the block or stride, bottom-right offsets, padding, GQA."""
    kv_len, block = q_len + extra, max(stride * per_block, 16)
    q, k = qk(2, 2 * group, 2, q_len, kv_len, 8, seed=seed)
    valid = torch.tensor([kv_len, max(0, kv_len - cut)])
    got = block_mass_torch(q, k, stride, block, kv_valid_len=valid)
    torch.testing.assert_close(got, literal_block_mass(q, k, stride, block, kv_valid_len=valid), atol=1e-5, rtol=1e-5)


def test_rows_sum_to_their_valid_query_groups():
    q, k = qk(2, 4, 2, 100, 100, 16)
    mass = block_mass_torch(q, k, 4, 32, kv_valid_len=torch.tensor([100, 50]))
    assert torch.allclose(mass[0].sum(-1), torch.tensor([8.0, 8.0, 8.0, 1.0]).expand(4, 4), atol=1e-5)
    assert torch.allclose(mass[1].sum(-1), torch.tensor([8.0, 5.0, 0.0, 0.0]).expand(4, 4), atol=1e-5)
    assert (mass[1, ..., 2:] == 0).all()  # keys past the valid length get nothing


def test_padded_batch_equals_each_sequence_alone():
    """Right-padded sequences with kv_valid_len give, in their valid blocks, exactly the unpadded estimate."""
    q, k = qk(2, 4, 2, 96, 96, 16, seed=3)
    k[1, :, 70:] = 1e3  # garbage in the padding must not leak
    mass = block_mass_torch(q, k, 4, 16, kv_valid_len=torch.tensor([96, 70]))
    alone = block_mass_torch(q[1:, :, :70], k[1:, :, :70], 4, 16)
    torch.testing.assert_close(mass[1:, :, :5, :5], alone, atol=1e-6, rtol=1e-6)
    assert (mass[1, :, 5:] == 0).all()


def test_gqa_reads_shared_keys_without_copies():
    q, k = qk(1, 8, 2, 64, 64, 16, seed=5)
    torch.testing.assert_close(block_mass_torch(q, k, 4, 16), block_mass_torch(q, k.repeat_interleave(4, 1), 4, 16))


def test_synthetic_inputs_are_peaked_like_real_attention():
    """The generator's local heads put most of the estimated mass in few blocks; its diffuse head does not."""
    inputs = synthetic_attention_inputs(1, 8, 8, 2048, 128, seed=0)
    mass = block_mass_torch(inputs.q, inputs.k, 16, 128)[0, :, -1]  # last query block, every head
    top3 = mass.sort(-1, descending=True).values[:, :3].sum(-1) / mass.sum(-1)  # of 16 blocks
    assert inputs.kinds[:3] == ["local", "retrieval", "anchors"] and inputs.kinds[7] == "diffuse"
    assert top3[:7].mean() > 0.8 and top3[7] < 0.6
    assert len(inputs.needles[1]) == 4 and inputs.needles[0] == []


@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        (dict(stride=0), ValueError, "stride"),
        (dict(stride=3), ValueError, "divide"),
        (dict(stride=2.0), TypeError, "stride"),
        (dict(q_start=40), ValueError, "kv_len"),
        (dict(kv_valid_len=torch.tensor([1.0])), TypeError, "kv_valid_len"),
        (dict(kv_valid_len=torch.tensor([1, 2])), ValueError, "kv_valid_len"),
        (dict(backend="cuda"), ValueError, "backend"),
    ],
)
def test_estimator_rejects_bad_arguments(kwargs, error, match):
    q, k = qk(1, 2, 1, 32, 64, 8)
    args = dict(stride=4, block_size=16) | kwargs
    with pytest.raises(error, match=match):
        antidiagonal_block_mass(q, k, args.pop("stride"), args.pop("block_size"), **args)


def test_estimator_rejects_mismatched_q_k():
    q, k = qk(1, 3, 2, 32, 32, 8)
    with pytest.raises(ValueError, match="multiple"):
        antidiagonal_block_mass(q, k, 4, 16)
    with pytest.raises(ValueError, match="kv_len"):
        antidiagonal_block_mass(*qk(1, 2, 2, 40, 32, 8), 4, 16)


@pytest.mark.compiled
def test_compiled_torch_path_matches_and_does_not_recompile():
    from torch._dynamo.utils import counters

    q, k = qk(1, 2, 1, 96, 96, 16)
    torch.testing.assert_close(antidiagonal_block_mass(q, k, 4, 32, compiled=True, backend="torch"),
                               block_mass_torch(q, k, 4, 32), atol=1e-5, rtol=1e-5)
    graphs = counters["stats"]["unique_graphs"]
    for seed in range(10):
        antidiagonal_block_mass(*qk(1, 2, 1, 96, 96, 16, seed=seed), 4, 32, compiled=True, backend="torch")
    assert counters["stats"]["unique_graphs"] == graphs


# ----- the fused Triton kernel ------------------------------------------------------------------------------

triton = pytest.importorskip("triton")
from flexsparse.kernels import xa_estimate_triton  # noqa: E402


@pytest.mark.parametrize("batch,heads,kv_heads,q_len,kv_len,dim,stride,block,valid", CASES)
def test_triton_estimator_matches_torch_in_the_interpreter(batch, heads, kv_heads, q_len, kv_len, dim, stride, block,
                                                           valid):
    if torch.cuda.is_available():
        pytest.skip("the GPU test below covers the compiled kernel")
    q, k = qk(batch, heads, kv_heads, q_len, kv_len, dim)
    valid = None if valid is None else torch.tensor(valid)
    got = xa_estimate_triton.block_mass_triton(q, k, stride, block, kv_valid_len=valid,
                                               config=(16, 16, 4, 1, False))
    torch.testing.assert_close(got, block_mass_torch(q, k, stride, block, kv_valid_len=valid), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("tma", [True, False])
def test_triton_estimator_16_bit_inputs_in_the_interpreter(tma):
    """Tensor-descriptor loads (16-bit inputs, lengths divisible by the stride) and pointer loads agree."""
    if torch.cuda.is_available():
        pytest.skip("the GPU test below covers the compiled kernel")
    for batch, heads, kv_heads, q_len, kv_len, stride, block in [(1, 2, 1, 64, 64, 4, 16), (2, 4, 2, 96, 160, 4, 64)]:
        q, k = qk(batch, heads, kv_heads, q_len, kv_len, 16, dtype=torch.float16)
        got = xa_estimate_triton.block_mass_triton(q, k, stride, block, config=(16, 64, 4, 1, tma))
        expected = block_mass_torch(q.float(), k.float(), stride, block)
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_triton_estimator_chunks_rows(monkeypatch):
    """A scratch budget of one row tile forces one launch per tile; the result does not change."""
    if torch.cuda.is_available():
        pytest.skip("CPU interpreter test")
    q, k = qk(1, 2, 1, 64, 64, 16, seed=2)
    monkeypatch.setattr(xa_estimate_triton, "_SCRATCH_BYTES", 1)
    got = xa_estimate_triton.block_mass_triton(q, k, 2, 16, config=(16, 16, 4, 1, False))
    torch.testing.assert_close(got, block_mass_torch(q, k, 2, 16), atol=1e-5, rtol=1e-5)


def test_triton_estimator_refuses_unsupported_shapes():
    q, k = qk(1, 2, 1, 64, 64, 16)
    assert xa_estimate_triton.triton_supports(q, 16, 48) is not None  # 3 groups per block: not a power of two
    with pytest.raises(ValueError, match="power of two"):
        xa_estimate_triton.block_mass_triton(q, k, 16, 48)


@pytest.mark.gpu
@pytest.mark.parametrize("batch,heads,kv_heads,q_len,kv_len,stride,block,valid", [
    (1, 32, 8, 4096, 4096, 16, 128, None),
    (2, 8, 2, 1000, 3000, 16, 128, [3000, 2100]),
    (1, 4, 4, 777, 777, 8, 64, None),
])
def test_triton_estimator_matches_torch_on_the_gpu(batch, heads, kv_heads, q_len, kv_len, stride, block, valid):
    q, k = qk(batch, heads, kv_heads, q_len, kv_len, 128, dtype=torch.bfloat16, device="cuda")
    valid = None if valid is None else torch.tensor(valid, device="cuda")
    got = antidiagonal_block_mass(q, k, stride, block, kv_valid_len=valid)  # auto: Triton on CUDA
    expected = block_mass_torch(q.float(), k.float(), stride, block, kv_valid_len=valid)  # same bf16 values
    torch.testing.assert_close(got, expected, atol=2e-4, rtol=1e-4)


@pytest.mark.gpu
def test_triton_estimator_does_not_recompile_on_new_inputs():
    run = lambda seed: antidiagonal_block_mass(*qk(1, 8, 2, 2048, 2048, 128, seed, torch.bfloat16, "cuda"), 16, 128)
    run(0)
    variants = xa_estimate_triton.compiled_variants()
    for seed in range(1, 11):
        run(seed)
    assert xa_estimate_triton.compiled_variants() == variants
