"""The fused router inference kernel (flexsparse.kernels.router_infer) against the torch path, under
TRITON_INTERPRET=1 on CPU (natively on a GPU): logits, weights and modes of both routers for float32 / float16 /
bfloat16 states, padding, short sequences, odd head counts and strided layouts; boundary_positions against the
pooling rule; the decision rule at ties; the per-forward boundary memo of the model integration."""

import pytest
import torch
from torch import nn

from flexsparse.integrations.forward_mask import ForwardMask
from flexsparse.integrations.routing import forward_boundary
from flexsparse.kernels.router_infer import RouterWorkspace, fused_routing
from flexsparse.routers import (
    Boundary,
    HeadRouter,
    LayerRouter,
    boundary_pool,
    boundary_positions,
    gather_pool,
    relaxed_decisions,
)
from tests.kernel_markers import CUDA, DEVICE

pytestmark = pytest.mark.usefixtures("triton_interpreter_scalars")  # the CPU runs: conftest.py


def make_router(kind, dim, pool, seed=0, std=0.3, **kwargs):
    """A router in eval mode with weights and biases large enough for logits of order 1 (decisions both ways)."""
    router = (HeadRouter if kind == "head" else LayerRouter)(dim, pool, **kwargs)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in router.modules():
            if isinstance(m, nn.Linear):
                m.weight.copy_(torch.randn(m.weight.shape, generator=gen) * std)
                m.bias.copy_(torch.randn(m.bias.shape, generator=gen) * std)
    return router.to(DEVICE).eval()


def padded(batch, seq, side, gen):
    """A [B, S] mask: rows of random lengths (the first full, the second of one token) padded on the left or
    the right; None for no padding."""
    if side == "none":
        return None
    lengths = [seq, 1, *torch.randint(1, seq + 1, (batch,), generator=gen).tolist()][:batch]
    mask = torch.zeros(batch, seq, dtype=torch.bool)
    for b, n in enumerate(lengths):
        if side == "left":
            mask[b, seq - n:] = True
        else:
            mask[b, :n] = True
    return mask.to(DEVICE)


def torch_and_fused(router, states, mask):
    with torch.no_grad():
        return router.route(states, mask, fused=False), router.route(states, mask, fused=True)


def assert_same_routing(expected, got, atol):
    torch.testing.assert_close(got.logits, expected.logits, atol=atol, rtol=0)
    assert got.weights.dtype == expected.weights.dtype == torch.float32
    assert torch.equal(got.weights, expected.weights)
    assert torch.equal(got.modes(), expected.modes()) and got.modes().dtype == torch.long
    assert got.logits.requires_grad is False and got.weights.requires_grad is False


# ----- boundary_positions --------------------------------------------------------------------------------------

def reference_slots(mask_row, pool):
    real = [i for i, m in enumerate(mask_row.tolist()) if m]
    return sorted(set(real[:pool]) | set(real[-pool:] if real else []))


@pytest.mark.parametrize("seq,pool", [(1, 1), (1, 4), (5, 3), (6, 3), (7, 3), (40, 6)])
def test_boundary_positions_follow_the_pooling_rule(seq, pool):
    """The weighted slots are the first and last P real tokens, each once, weighted 1/n."""
    gen = torch.Generator().manual_seed(seq * 7 + pool)
    marked = torch.rand(5, seq, generator=gen) < torch.tensor([0.0, 0.2, 0.5, 0.9, 1.0])[:, None]
    marked[:, seq // 2] = True  # a row needs a token to pool (the first row: only this one)
    masks = [None, marked]
    for mask in masks:
        batch = 5 if mask is not None else 2
        found = boundary_positions(mask, batch, seq, pool, "cpu")
        assert isinstance(found, Boundary) and found.pool_size == pool and found.seq == seq
        assert found.positions.shape == found.weights.shape == (batch, 2 * pool)
        assert found.positions.dtype == torch.long and found.weights.dtype == torch.float32
        assert int(found.positions.min()) >= 0 and int(found.positions.max()) < seq
        for b in range(batch):
            row = torch.ones(seq, dtype=torch.bool) if mask is None else mask[b]
            slots = reference_slots(row, pool)
            used = found.weights[b] > 0
            assert sorted(found.positions[b][used].tolist()) == slots
            assert torch.all(found.weights[b][used] == 1.0 / len(slots))


def one_step_boundary_pool(states, mask, pool):
    """boundary_pool as it was before the split into boundary_positions and gather_pool."""
    batch, seq = states.shape[:2]
    step = torch.arange(pool)
    if mask is None:
        count = torch.full((batch, 1), seq)
        ranks = torch.cat([step, seq - pool + step])[None].expand(batch, 2 * pool)
        positions = ranks
    else:
        running = mask.cumsum(1, dtype=torch.int32)
        count = running[:, -1:].long()
        ranks = torch.cat([step.expand(batch, pool), count - pool + step], dim=1)
        positions = torch.searchsorted(running, (ranks + 1).clamp(min=1).to(torch.int32).contiguous())
    valid = torch.cat([step.expand(batch, pool) < count, ranks[:, pool:] >= pool], dim=1)
    weights = valid.float() / count.clamp(min=1, max=2 * pool).float()
    picked = states[torch.arange(batch)[:, None], positions.clamp(0, seq - 1)].float()
    picked = torch.where(valid[:, :, None, None], picked, 0.0)
    return torch.einsum("bphd,bp->bhd", picked, weights).to(states.dtype)


@pytest.mark.parametrize("seq,pool", [(1, 3), (5, 3), (30, 4), (30, 20)])
def test_two_steps_give_the_one_step_result(seq, pool):
    """gather_pool at boundary_positions, and boundary_pool, are bit for bit the one-step boundary_pool."""
    gen = torch.Generator().manual_seed(seq + pool)
    states = torch.randn(4, seq, 2, 5, generator=gen)
    masks = [padded(4, seq, side, gen) for side in ("none", "left", "right")]
    holes = torch.rand(4, seq, generator=gen) < torch.tensor([0.0, 0.3, 0.7, 1.0])[:, None]
    holes[:, seq - 1] = True  # the first row: one token
    masks.append(holes)
    for mask in masks:
        mask = None if mask is None else mask.cpu()
        expected = one_step_boundary_pool(states, mask, pool)
        assert torch.equal(gather_pool(states, boundary_positions(mask, 4, seq, pool, "cpu")), expected)
        assert torch.equal(boundary_pool(states, mask, pool), expected)


def test_boundary_is_checked_against_the_states():
    router = HeadRouter(8, pool_size=3).eval()
    states = torch.randn(2, 10, 2, 8)
    boundary = boundary_positions(None, 2, 10, 3, "cpu")
    with pytest.raises(ValueError, match="not both"):
        router.route(states, torch.ones(2, 10, dtype=torch.bool), boundary=boundary)
    with pytest.raises(ValueError, match="computed for 10 tokens"):
        router.route(torch.randn(2, 11, 2, 8), boundary=boundary)
    with pytest.raises(ValueError, match="pools 4 tokens"):
        router.route(states, boundary=boundary_positions(None, 2, 10, 4, "cpu"))
    with pytest.raises(ValueError, match="B = 2"):
        router.route(states, boundary=boundary_positions(None, 3, 10, 3, "cpu"))
    with pytest.raises(ValueError, match="needs a device"):
        boundary_positions(None, 2, 10, 3)


# ----- the kernel against the torch path ------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["head", "layer"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("side", ["none", "left", "right"])
def test_fused_routing_matches_torch(kind, dtype, side):
    """Logits of order 1-10 to 1e-4 for every states dtype: pooled rows are rounded to it as on the torch path."""
    gen = torch.Generator().manual_seed(10 * len(side) + dtype.itemsize + len(kind))
    router = make_router(kind, 16, pool=4, seed=3)
    for batch, seq, heads in ((1, 13, 3), (3, 6, 5), (2, 1, 1)):  # S < 2P, S = 1, odd head counts
        states = torch.randn(batch, seq, heads, 16, generator=gen).to(DEVICE, dtype)
        expected, got = torch_and_fused(router, states, padded(batch, seq, side, gen))
        assert got.fused and not expected.fused
        assert_same_routing(expected, got, 1e-4)


@pytest.mark.parametrize("kind", ["head", "layer"])
@pytest.mark.parametrize("dim", [32, 64, 24])
def test_head_dims_and_row_blocks(kind, dim):
    """head_dim 32/64 and a non-power of two; 3 x 7 = 21 head rows: two row blocks of 16."""
    gen = torch.Generator().manual_seed(dim)
    router = make_router(kind, dim, pool=3, seed=dim, std=0.15)
    states = torch.randn(3, 9, 7, dim, generator=gen).to(DEVICE)
    expected, got = torch_and_fused(router, states, padded(3, 9, "left", gen))
    assert_same_routing(expected, got, 1e-4)


@pytest.mark.parametrize("layout", ["qkv_slice", "heads_first", "dims_strided"])
def test_strided_states(layout):
    """A view into a fused qkv projection, [B, H, S, d] transposed, and a layout with head_dim not innermost."""
    gen = torch.Generator().manual_seed(2)
    batch, seq, heads, dim = 2, 11, 3, 16
    if layout == "qkv_slice":
        qkv = torch.randn(batch, seq, 3 * heads * dim, generator=gen)
        states = qkv[..., heads * dim:2 * heads * dim].view(batch, seq, heads, dim)
    elif layout == "heads_first":
        states = torch.randn(batch, heads, seq, dim, generator=gen).transpose(1, 2)
    else:
        states = torch.randn(batch, dim, heads, seq, generator=gen).permute(0, 3, 2, 1)
    assert not states.is_contiguous()
    states = states.to(DEVICE).bfloat16() if CUDA else states.bfloat16()
    mask = padded(batch, seq, "right", gen)
    for kind in ("head", "layer"):
        router = make_router(kind, dim, pool=3, seed=5)
        expected, got = torch_and_fused(router, states, mask)
        assert_same_routing(expected, got, 1e-4)
        _, contiguous = torch_and_fused(router, states.contiguous(), mask)
        assert torch.equal(got.logits, contiguous.logits)


def test_bfloat16_router_weights():
    """A router cast to bfloat16: every layer's output and SiLU rounded as torch rounds them."""
    gen = torch.Generator().manual_seed(8)
    for kind in ("head", "layer"):
        router = make_router(kind, 16, pool=3, seed=9).bfloat16()
        states = torch.randn(2, 9, 3, 16, generator=gen).to(DEVICE, torch.bfloat16)
        expected, got = torch_and_fused(router, states, padded(2, 9, "left", gen))
        assert got.logits.dtype == torch.bfloat16
        torch.testing.assert_close(got.logits.float(), expected.logits.float(), atol=1e-3, rtol=2 ** -7)  # 1 ulp
        assert torch.equal(got.modes(), expected.modes())


@pytest.mark.parametrize("full,sparse", [(0, 1), (2, 0)])
def test_modes_and_layer_expansion(full, sparse):
    gen = torch.Generator().manual_seed(4)
    router = make_router("layer", 16, pool=3, seed=1, full_mode=full, sparse_mode=sparse)
    states = torch.randn(3, 8, 5, 16, generator=gen).to(DEVICE)
    expected, got = torch_and_fused(router, states, None)
    assert got.logits.shape == (3, 1, 2) and got.fused and got.modes().shape == (3, 1)
    assert torch.equal(got.modes(4), expected.modes(4)) and got.modes(4).shape == (3, 4)
    assert set(got.modes().flatten().tolist()) <= {full, sparse}
    with torch.no_grad():
        head_routing = make_router("head", 16, pool=3).route(states, fused=True)
    with pytest.raises(ValueError, match="num_kv_heads"):
        head_routing.modes(4)


@pytest.mark.parametrize("gap_ulps,sparse", [(0, False), (1, False), (-3, False), (2, True), (200, True)])
def test_ties_go_to_full_as_in_the_softmax(gap_ulps, sparse):
    """Zero weights: the logits are the last bias exactly on both paths. Logits closer than 2^-25 give equal
    float32 softmax probabilities (full); a gap above it is sparse."""
    router = make_router("head", 16, pool=2, std=0.0)
    full_logit = 0.25  # float32 spacing 2^-25 at 0.25: 1 ulp ties, 2 ulps do not
    with torch.no_grad():
        router.router_mlp[-1].bias.copy_(torch.tensor([full_logit, full_logit + gap_ulps * 2.0 ** -25]))
    expected, got = torch_and_fused(router, torch.randn(2, 5, 3, 16).to(DEVICE), None)
    assert torch.equal(got.logits, expected.logits)
    assert torch.equal(got.weights, expected.weights)
    assert bool(got.is_sparse.all()) is sparse and bool(got.is_sparse.any()) is sparse
    assert torch.equal(relaxed_decisions(got.logits, hard=True, noise=False), got.weights)


def test_workspace_counters_reset_and_grow():
    """The last program zeroes the stage counters: the next launch (a larger batch here) reuses the workspace."""
    router = make_router("head", 16, pool=2)
    layers = router.fused_layers()
    workspace = RouterWorkspace()
    for batch in (1, 4, 2):
        states = torch.randn(batch, 6, 3, 16).to(DEVICE)
        boundary = boundary_positions(None, batch, 6, 2, DEVICE)
        logits, _, _ = fused_routing(states, boundary.positions, boundary.weights, layers, average_heads=False,
                                     full_mode=0, sparse_mode=1, workspace=workspace)
        counters = workspace.get(states.device, 0)[1]
        assert not counters.any()
        with torch.no_grad():
            torch.testing.assert_close(logits, router(states), atol=1e-4, rtol=0)


def test_fused_path_is_the_cuda_default_and_refuses_training():
    """fused=None (default): the kernel on CUDA where it can run, else torch (the CPU, gradients, training);
    fused=True raises where it cannot run; fused=False is always torch."""
    router = make_router("head", 16, pool=2)
    states = torch.randn(2, 6, 3, 16).to(DEVICE)
    on_cuda = states.device.type == "cuda"
    with torch.no_grad():
        assert router.route(states).fused == on_cuda
        assert not router.route(states, fused=False).fused
        assert router.route(states, fused=True).fused
    with pytest.raises(ValueError, match="gradients"):
        router.route(states, fused=True)  # gradients enabled and the weights require them
    assert not router.route(states).fused  # the default falls back to torch
    router.train()
    with torch.no_grad(), pytest.raises(ValueError, match="training"):
        router.route(states, fused=True)
    with torch.no_grad():
        assert not router.route(states).fused


# ----- the model integration: one boundary per forward ---------------------------------------------------------

def test_forward_boundary_is_memoised_per_forward():
    padding = torch.ones(2, 12, dtype=torch.bool)
    padding[1, :5] = False
    mask = ForwardMask(padding, 2, 12, 12, torch.device("cpu"))
    router = HeadRouter(8, pool_size=3)
    states = torch.randn(2, 12, 2, 8)
    first = forward_boundary(router, states, mask, None)
    assert forward_boundary(router, states, mask, None) is first  # every layer of the forward
    assert torch.equal(first.weights, boundary_positions(padding, 2, 12, 3).weights)
    other = forward_boundary(HeadRouter(8, pool_size=4), states, mask, None)  # another pool size
    assert other is not first and other.pool_size == 4
    prompt = torch.zeros(2, 12, dtype=torch.bool)
    prompt[:, :6] = True
    pooled = forward_boundary(router, states, mask, prompt)
    assert pooled is not first and forward_boundary(router, states, mask, prompt) is pooled
    assert torch.equal(pooled.weights, boundary_positions(prompt, 2, 12, 3).weights)
    assert forward_boundary(router, states, mask, prompt.clone()) is not pooled  # another pooling mask
    fresh = ForwardMask(padding, 2, 12, 12, torch.device("cpu"))
    assert forward_boundary(router, states, fresh, None) is not first  # another forward


# ----- GPU: realistic sizes -------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["head", "layer"])
def test_cuda_realistic_sizes_are_stable(kind):
    """d = 128, P = 100, bf16 states at 8K tokens with padding: the fused path equals the torch path, launch
    after launch (the counters reset, the sums are deterministic)."""
    router = (HeadRouter if kind == "head" else LayerRouter)(128).cuda().eval()
    heads = 8 if kind == "head" else 32
    for batch in (1, 3):
        states = torch.randn(batch, 8192, heads, 128, device="cuda", dtype=torch.bfloat16)
        mask = torch.ones(batch, 8192, dtype=torch.bool, device="cuda")
        mask[-1, :1000] = False
        with torch.no_grad():
            expected = router.route(states, mask, fused=False)
            runs = [router.route(states, mask, fused=True) for _ in range(20)]
        for got in runs:
            assert torch.equal(got.logits, runs[0].logits)
            assert_same_routing(expected, got, 1e-4)
