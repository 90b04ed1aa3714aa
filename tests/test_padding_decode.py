"""HybridAttention on padded batches, in decode and in chunked prefill (CPU, fp32, uncompiled backends).

Padding equivalence: the rows of every real token equal the output of its sequence run alone (1e-5), rows of
padding queries are 0. Decode and chunks: against the float64 reference and against the same rows of a prefill.
"""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from flexsparse import HybridAttention, Positions
from flexsparse.masks import ESA, Causal, SinkWindow, TriangleMix, XAttention
from flexsparse.reference import attention as reference
from tests.test_hybrid_attention import qkv

pytestmark = pytest.mark.filterwarnings("ignore:.*flex_attention called without torch.compile.*")

HEADS, KV_HEADS, DIM = 4, 2, 8
PATTERNS = {
    "full": Causal(),
    "ssa": SinkWindow(sink=3, window=9),
    "esa": ESA(2, 4, 6, HEADS),
    "ta": TriangleMix(sink=2, window=6, last_q=5),
    "xa": XAttention(0.7, stride=4, block_size=16),
}
TOL = 1e-5


def layer(backend, modes=("full", "ssa"), plan="auto", block=16):
    return HybridAttention(HEADS, KV_HEADS, DIM, PATTERNS, list(modes), block_size=block, backend=backend, plan=plan)


def padded_batch(lengths, kv_len, left, seed=0):
    """Sequences of the given lengths, padded to kv_len (left or right); returns q, k, v, mask and the pieces."""
    gen = torch.Generator().manual_seed(seed)
    alone = [[torch.randn(1, h, n, DIM, generator=gen) for h in (HEADS, KV_HEADS, KV_HEADS)] for n in lengths]
    mask = torch.zeros(len(lengths), kv_len, dtype=torch.bool)
    q, k, v = (torch.randn(len(lengths), h, kv_len, DIM, generator=gen) * 100 for h in (HEADS, KV_HEADS, KV_HEADS))
    for b, (n, parts) in enumerate(zip(lengths, alone)):
        where = slice(kv_len - n, kv_len) if left else slice(0, n)
        mask[b, where] = True
        for full, part in zip((q, k, v), parts):
            full[b, :, where] = part[0]  # padding slots hold large garbage: it must not leak
    return q, k, v, mask, alone


@given(
    lengths=st.lists(st.integers(1, 40), min_size=1, max_size=3),
    extra=st.integers(0, 20),
    left=st.booleans(),
    backend=st.sampled_from(["flex_eager", "dense"]),
    modes=st.lists(st.sampled_from(list(PATTERNS)), min_size=KV_HEADS, max_size=KV_HEADS),
    routed=st.booleans(),
)
def test_padded_rows_equal_each_sequence_alone(lengths, extra, left, backend, modes, routed):
    kv_len = max(lengths) + extra
    q, k, v, mask, alone = padded_batch(lengths, kv_len, left)
    attn = layer(backend, modes)
    call_modes = None
    if routed:  # per-input routing: each sequence its own modes
        call_modes = torch.tensor([[(i + b) % len(PATTERNS) for i in range(KV_HEADS)] for b in range(len(lengths))])
    out = attn(q, k, v, modes=call_modes, key_padding_mask=mask)
    assert torch.isfinite(out).all()
    for b, (n, (qa, ka, va)) in enumerate(zip(lengths, alone)):
        expected = attn(qa, ka, va, modes=None if call_modes is None else call_modes[b])
        real = mask[b]
        torch.testing.assert_close(out[b][:, real], expected[0], atol=TOL, rtol=0)
        assert not out[b][:, ~real].any(), "padding query rows are 0"


@pytest.mark.parametrize("backend", ["flex_eager", "dense"])
@pytest.mark.parametrize("name", list(PATTERNS))
@pytest.mark.parametrize("q_len", [1, 6, 33])
def test_decode_and_chunks_match_reference_and_prefill(backend, name, q_len):
    attn = layer(backend, [name, name])
    q, k, v = qkv(2, HEADS, KV_HEADS, 70, dim=DIM, seed=1)
    prefill = attn(q, k, v)
    chunk = attn(q[:, :, -q_len:], k, v)
    if name != "xa":  # XA estimates a chunk on its own queries, and decodes as full attention
        torch.testing.assert_close(chunk, prefill[:, :, -q_len:], atol=TOL, rtol=0)
    expected = reference(q[:, :, -q_len:], k, v, attn.reference_mask(q[:, :, -q_len:], k))
    torch.testing.assert_close(chunk, expected, atol=TOL, rtol=0)


@pytest.mark.parametrize("backend", ["flex_eager", "dense"])
@pytest.mark.parametrize("q_len", [1, 4])
def test_decode_with_left_padding_matches_each_sequence_alone(backend, q_len):
    lengths = [30, 12, 45]
    q, k, v, mask, alone = padded_batch(lengths, 50, left=True, seed=2)
    attn = layer(backend, ["esa", "ta"])
    out = attn(q[:, :, -q_len:], k, v, key_padding_mask=mask)
    for b, (qa, ka, va) in enumerate(alone):
        expected = attn(qa[:, :, -q_len:], ka, va)
        torch.testing.assert_close(out[b], expected[0], atol=TOL, rtol=0)


def test_split_plan_with_padding_and_decode_equals_fused():
    """Split sends full heads to SDPA (a position mask in decode; flex when a padded prefill is long)."""
    q, k, v, mask, _ = padded_batch([20, 33], 40, left=True, seed=3)
    for q_len in (40, 1, 5):
        fused = layer("flex_eager", ["full", "ssa"], plan="fused")(q[:, :, -q_len:], k, v, key_padding_mask=mask)
        split = layer("flex_eager", ["full", "ssa"], plan="split")(q[:, :, -q_len:], k, v, key_padding_mask=mask)
        torch.testing.assert_close(split, fused, atol=TOL, rtol=0)


def test_positions_object_is_shared_by_layers():
    """A Positions built once per forward serves every layer, and equals the padding mask it came from."""
    q, k, v, mask, _ = padded_batch([10, 25], 25, left=True, seed=4)
    positions = Positions.from_padding_mask(mask, q_len=25)
    layers = [layer("flex_eager", m) for m in (["full", "ssa"], ["esa", "ta"])]
    for attn in layers:
        torch.testing.assert_close(attn(q, k, v, positions=positions), attn(q, k, v, key_padding_mask=mask),
                                   atol=0, rtol=0)


def test_dense_backend_gradients_with_padding_match_reference():
    q, k, v, mask, _ = padded_batch([15, 24], 24, left=True, seed=5)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    attn = layer("auto", ["ssa", "esa"])
    out = attn(q, k, v, key_padding_mask=mask)
    q2, k2, v2 = (t.detach().clone().requires_grad_() for t in (q, k, v))
    expected = reference(q2, k2, v2, attn.reference_mask(q2, k2, key_padding_mask=mask))
    torch.testing.assert_close(out, expected, atol=TOL, rtol=0)
    grad = torch.randn_like(out)
    out.backward(grad)
    expected.backward(grad)
    for name, a, b in (("dq", q, q2), ("dk", k, k2), ("dv", v, v2)):
        torch.testing.assert_close(a.grad, b.grad, atol=1e-4, rtol=0, msg=name)
        assert torch.isfinite(a.grad).all()


def test_last_stats_count_real_tokens_only():
    q, k, v, mask, alone = padded_batch([40, 40], 64, left=True, seed=6)
    attn = layer("flex_eager", ["ssa", "ssa"])
    attn(q, k, v, key_padding_mask=mask)
    padded = attn.last_stats.as_dict()
    attn(*alone[0])
    single = attn.last_stats.as_dict()
    assert padded["esr"] == pytest.approx(single["esr"], abs=1e-6)
    assert padded["msr"] == single["msr"] == 1.0


def test_padding_mask_errors():
    q, k, v = qkv(2, HEADS, KV_HEADS, 10, dim=DIM)
    attn = layer("flex_eager")
    with pytest.raises(ValueError, match=r"shape \[B, S_kv\] = \[2, 10\]"):
        attn(q, k, v, key_padding_mask=torch.ones(2, 9, dtype=torch.bool))
    with pytest.raises(TypeError, match="bool"):
        attn(q, k, v, key_padding_mask=torch.ones(2, 10))
    with pytest.raises(TypeError, match="key_padding_mask"):
        attn(q, k, v, key_padding_mask=[[1] * 10] * 2)
    with pytest.raises(ValueError, match="not both"):
        attn(q, k, v, key_padding_mask=torch.ones(2, 10, dtype=torch.bool), positions=Positions.contiguous(10, 10))
    with pytest.raises(TypeError, match="Positions"):
        attn(q, k, v, positions=torch.arange(10))
