"""The training path: full and sparse outputs mixed by straight-through weights, against the float64 reference."""

import pytest
import torch

from flexsparse import HybridAttention
from flexsparse.masks import Causal, SinkWindow
from flexsparse.reference import attention as reference
from flexsparse.routers import HeadRouter, LayerRouter, Routing, mix_full_sparse, routed_attention

PATTERNS = {"full": Causal(), "ssa": SinkWindow(sink=2, window=5)}
HEADS, KV_HEADS, DIM, SEQ = 4, 2, 8, 24


def layer(**kwargs):
    return HybridAttention(HEADS, KV_HEADS, DIM, PATTERNS, backend="dense", block_size=8, **kwargs)


def qkv(batch=2, seed=0, grad=True):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, HEADS, SEQ, DIM, generator=gen)
    k, v = (torch.randn(batch, KV_HEADS, SEQ, DIM, generator=gen) for _ in range(2))
    return [t.requires_grad_(grad) for t in (q, k, v)]


def reference_output(q, k, v, modes):
    """Each (sequence, KV head) in its mode's dense pattern, float64 softmax."""
    from flexsparse.masks import Geometry

    geo = Geometry(HEADS, q.shape[2])
    dense = [p.dense(geo)[0, 0] for p in PATTERNS.values()]
    head_modes = modes.repeat_interleave(HEADS // KV_HEADS, dim=1)
    mask = torch.stack([torch.stack([dense[m] for m in row.tolist()]) for row in head_modes])
    return reference(q, k, v, mask)


def hard_routing(sparse):
    weights = torch.stack([1 - sparse, sparse], -1).float().requires_grad_(True)
    return Routing(torch.zeros_like(weights), weights, 0, 1)


def test_hard_weights_select_outputs_exactly():
    attn = layer()
    q, k, v = qkv()
    routing = hard_routing(torch.tensor([[0.0, 1.0], [1.0, 1.0]]))
    mixed = mix_full_sparse(attn, q, k, v, routing)
    single = attn(q, k, v, modes=routing.modes())
    assert torch.equal(mixed, single)
    torch.testing.assert_close(mixed, reference_output(q, k, v, routing.modes()), atol=2e-5, rtol=0)


def test_gradient_to_the_weights_is_the_output_difference():
    attn = layer()
    q, k, v = qkv(grad=False)
    routing = hard_routing(torch.tensor([[0.0, 1.0], [1.0, 0.0]]))
    upstream = torch.randn(2, HEADS, SEQ, DIM)
    (mix_full_sparse(attn, q, k, v, routing) * upstream).sum().backward()
    full = attn(q, k, v, modes=torch.zeros(2, KV_HEADS, dtype=torch.long))
    sparse = attn(q, k, v, modes=torch.ones(2, KV_HEADS, dtype=torch.long))
    per_head = ((sparse - full) * upstream).sum((2, 3))  # [B, H]
    expected = per_head.view(2, KV_HEADS, -1).sum(-1)  # a KV head's weight is shared by its query heads
    torch.testing.assert_close(routing.weights.grad[..., 1], expected, atol=1e-4, rtol=1e-5)
    assert expected.abs().min() > 0


def test_soft_weights_mix_convexly():
    attn = layer()
    q, k, v = qkv(grad=False)
    weights = torch.tensor([[[0.75, 0.25], [0.5, 0.5]], [[0.1, 0.9], [1.0, 0.0]]])
    mixed = mix_full_sparse(attn, q, k, v, Routing(torch.zeros_like(weights), weights, 0, 1))
    full = reference_output(q, k, v, torch.zeros(2, KV_HEADS, dtype=torch.long))
    sparse = reference_output(q, k, v, torch.ones(2, KV_HEADS, dtype=torch.long))
    w = weights[..., 1].repeat_interleave(HEADS // KV_HEADS, 1)[:, :, None, None]
    torch.testing.assert_close(mixed, (1 - w) * full + w * sparse, atol=2e-5, rtol=0)


def test_head_router_learns_through_the_layer():
    """Router parameters, q, k and v all get gradients from a loss on the mixed output (CPU: dense backend)."""
    torch.manual_seed(0)
    attn = layer()
    router = HeadRouter(DIM, pool_size=4)
    q, k, v = qkv()
    routing = router.route(k.transpose(1, 2), tau=1.5, generator=torch.Generator().manual_seed(0))
    out = routed_attention(attn, q, k, v, routing)
    out.pow(2).mean().backward()
    for name, p in router.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, name
    assert all(t.grad is not None and t.grad.abs().sum() > 0 for t in (q, k, v))


def test_layer_router_one_decision_per_sequence():
    attn = layer()
    router = LayerRouter(DIM, pool_size=4)
    q, k, v = qkv()
    routing = router.route(q.transpose(1, 2), generator=torch.Generator().manual_seed(1))
    out = mix_full_sparse(attn, q, k, v, routing)
    expected = reference_output(q, k, v, routing.modes(KV_HEADS))
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=0)
    out.sum().backward()
    assert all(p.grad is not None for p in router.parameters())


def test_inference_path_is_one_call_with_the_modes():
    attn = layer()
    router = HeadRouter(DIM, pool_size=4).eval()
    q, k, v = qkv(grad=False)
    with torch.no_grad():
        routing = router.route(k.transpose(1, 2))
        out = routed_attention(attn, q, k, v, routing)
    assert torch.equal(out, attn(q, k, v, modes=routing.modes()))


def test_batch_elements_are_mixed_independently_with_padding():
    attn = layer()
    q, k, v = qkv(grad=False)
    mask = torch.ones(2, SEQ, dtype=torch.bool)
    mask[0, :9] = False  # row 0 left-padded
    routing = hard_routing(torch.tensor([[1.0, 0.0], [0.0, 1.0]]))
    out = mix_full_sparse(attn, q, k, v, routing, key_padding_mask=mask)
    alone = mix_full_sparse(attn, q[:1, :, 9:], k[:1, :, 9:], v[:1, :, 9:], hard_routing(torch.tensor([[1.0, 0.0]])))
    torch.testing.assert_close(out[:1, :, 9:], alone, atol=1e-5, rtol=0)
    second = mix_full_sparse(attn, q[1:], k[1:], v[1:], hard_routing(torch.tensor([[0.0, 1.0]])))
    torch.testing.assert_close(out[1:], second, atol=1e-6, rtol=0)


def test_bad_input():
    attn = layer()
    q, k, v = qkv(grad=False)
    with pytest.raises(ValueError, match="routing has batch 1"):
        mix_full_sparse(attn, q, k, v, hard_routing(torch.tensor([[0.0, 1.0]])))
    with pytest.raises(ValueError, match="routing decides 3 KV heads"):
        mix_full_sparse(attn, q, k, v, hard_routing(torch.zeros(2, 3)))
    weights = torch.zeros(2, 2, 2)
    with pytest.raises(ValueError, match="sparse_mode = 5"):
        mix_full_sparse(attn, q, k, v, Routing(weights, weights, 0, 5))
    with pytest.raises(TypeError, match="attn must be"):
        mix_full_sparse(torch.nn.Identity(), q, k, v, hard_routing(torch.zeros(2, 2)))


@pytest.mark.gpu
def test_cuda_training_mix_runs_flex_forward_and_backward():
    """The training path on the GPU: bf16, full heads on SDPA and sink+window heads on compiled flex, forward and
    backward, against the float64 dense path of the same mix (soft weights, so both outputs get gradients)."""
    heads, kv_heads, seq, dim = 8, 4, 1024, 64
    patterns = {"full": Causal(), "ssa": SinkWindow(sink=16, window=128)}
    flex = HybridAttention(heads, kv_heads, dim, patterns, backend="flex")
    dense = HybridAttention(heads, kv_heads, dim, patterns, backend="dense")
    gen = torch.Generator(device="cuda").manual_seed(0)
    make = lambda h: torch.randn(2, h, seq, dim, device="cuda", generator=gen)
    inputs = [make(heads), make(kv_heads), make(kv_heads)]
    sparse = torch.rand(2, kv_heads, device="cuda", generator=gen)
    upstream = torch.randn(2, heads, seq, dim, device="cuda", generator=gen)

    def run(attn, dtype, weight_dtype):
        q, k, v = (t.to(dtype).requires_grad_() for t in inputs)
        weights = torch.stack([1 - sparse, sparse], -1).to(weight_dtype).requires_grad_()
        out = mix_full_sparse(attn, q, k, v, Routing(torch.zeros_like(weights), weights, 0, 1))
        (out.double() * upstream.double()).sum().backward()
        return out, q.grad, k.grad, v.grad, weights.grad

    got, expected = run(flex, torch.bfloat16, torch.float32), run(dense, torch.float64, torch.float64)
    for name, a, b in zip(("output", "dq", "dk", "dv"), got[:4], expected[:4]):
        scale = b.abs().max().item()
        assert (a.double() - b).abs().max().item() <= 2e-2 * scale, name
    torch.testing.assert_close(got[4].double(), expected[4], atol=5e-2 * expected[4].abs().max().item(), rtol=0)
