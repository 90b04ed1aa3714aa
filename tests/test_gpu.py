"""GPU: the compiled flex path forward and backward against the float64 reference, plans, padding, decode and
chunks, no recompiles.

Run on a CUDA machine: ``python -m pytest -m gpu``. Tolerances: fp32 |err| <= 5e-3 (flex may use TF32 tensor
cores), bf16 |err| <= 3e-2 on outputs and 6e-2 on gradients, relative to the reference's largest magnitude.
"""

import pytest
import torch

from flexsparse import HybridAttention
from flexsparse.kernels.xa_estimate import antidiagonal_block_mass
from flexsparse.masks import ESA, Causal, Geometry, SinkWindow, TriangleMix, XAttention
from flexsparse.reference import attention as reference
from flexsparse.runtime.call import AttentionCall

pytestmark = pytest.mark.gpu

HEADS, KV_HEADS, DIM = 8, 4, 64
PATTERNS = {
    "full": Causal(),
    "ssa": SinkWindow(sink=64, window=256),
    "esa": ESA(3, 8, 64, HEADS),
    "xa": XAttention(0.9, stride=16, block_size=128),
    "ta": TriangleMix(sink=64, window=256, last_q=128),
}
TOLERANCE = {torch.float32: (5e-3, 5e-3), torch.bfloat16: (3e-2, 6e-2)}


def inputs(seq, dtype, seed=0, grad=True):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    make = lambda h: torch.randn(1, h, seq, DIM, device="cuda", dtype=dtype, generator=gen).requires_grad_(grad)
    return make(HEADS), make(KV_HEADS), make(KV_HEADS)


def assert_near(actual, expected, tol, what):
    scale = expected.abs().max().item()
    err = (actual.double() - expected.double()).abs().max().item()
    assert err <= tol * max(scale, 1.0), f"{what}: max error {err:.3g} (reference scale {scale:.3g})"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(
    "modes,seq", [(["full", "ssa", "esa", "xa"], 1000), (["ta", "xa", "full", "ssa"], 2048), (["esa"] * 4, 1000)]
)
def test_flex_forward_and_backward_match_reference(dtype, modes, seq):
    attn = HybridAttention(HEADS, KV_HEADS, DIM, PATTERNS, modes, backend="flex", plan="fused")
    q, k, v = inputs(seq, dtype)
    out = attn(q, k, v)
    grad_out = torch.randn_like(out)
    out.backward(grad_out)
    q2, k2, v2 = (t.detach().double().requires_grad_() for t in (q, k, v))
    expected = reference(q2, k2, v2, attn.reference_mask(q.detach(), k.detach()))
    expected.backward(grad_out.double())
    out_tol, grad_tol = TOLERANCE[dtype]
    assert_near(out, expected, out_tol, "output")
    for name, a, b in (("dq", q, q2), ("dk", k, k2), ("dv", v, v2)):
        assert_near(a.grad, b.grad, grad_tol, name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_split_plan_forward_and_backward_equal_fused(dtype):
    modes = ["full", "ssa", "full", "esa"]
    q, k, v = inputs(2048, dtype)
    results = []
    for plan in ("fused", "split"):
        attn = HybridAttention(HEADS, KV_HEADS, DIM, PATTERNS, modes, backend="flex", plan=plan)
        for t in (q, k, v):
            t.grad = None
        out = attn(q, k, v)
        out.sum().backward()
        results.append([out.detach().clone()] + [t.grad.clone() for t in (q, k, v)])
    out_tol, grad_tol = TOLERANCE[dtype]
    for name, a, b in zip(("out", "dq", "dk", "dv"), *results):
        assert_near(a, b, grad_tol if name != "out" else out_tol, name)


def test_hundred_routings_cause_no_recompile():
    attn = HybridAttention(HEADS, KV_HEADS, DIM, PATTERNS, backend="flex")
    q, k, v = inputs(4096, torch.bfloat16, grad=False)
    gen = torch.Generator(device="cuda").manual_seed(0)
    attn(q, k, v, modes=torch.tensor([0, 1, 2, 3], device="cuda"))
    with torch.compiler.set_stance("fail_on_recompile"):
        for _ in range(100):
            attn(q, k, v, modes=torch.randint(0, len(PATTERNS), (KV_HEADS,), device="cuda", generator=gen))
    torch.cuda.synchronize()


def test_compiled_estimator_matches_eager():
    q, k, _ = inputs(4096, torch.bfloat16, grad=False)
    eager = antidiagonal_block_mass(q, k, 16, 128, compiled=False, backend="torch")
    compiled = antidiagonal_block_mass(q, k, 16, 128, compiled=True, backend="torch")
    torch.testing.assert_close(compiled, eager, atol=2e-2, rtol=2e-2)


def test_modes_on_another_device_are_rejected():
    attn = HybridAttention(HEADS, KV_HEADS, DIM, PATTERNS, backend="flex")
    q, k, v = inputs(256, torch.bfloat16, grad=False)
    with pytest.raises(ValueError, match="modes is on cpu"):
        attn(q, k, v, modes=torch.tensor([0, 1, 0, 1]))
    with pytest.raises(ValueError, match="k is on"):
        attn(q, k.cpu(), v)


def padded_inputs(lengths, kv_len, dtype, left=True, seed=0):
    """A padded batch (garbage in the padding slots) and each sequence alone."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    make = lambda b, h, n: torch.randn(b, h, n, DIM, device="cuda", dtype=dtype, generator=gen)
    q, k, v = (make(len(lengths), h, kv_len) * 50 for h in (HEADS, KV_HEADS, KV_HEADS))
    mask = torch.zeros(len(lengths), kv_len, dtype=torch.bool, device="cuda")
    alone = []
    for b, n in enumerate(lengths):
        where = slice(kv_len - n, kv_len) if left else slice(0, n)
        mask[b, where] = True
        parts = [make(1, h, n) for h in (HEADS, KV_HEADS, KV_HEADS)]
        for full, part in zip((q, k, v), parts):
            full[b, :, where] = part[0]
        alone.append(parts)
    return q, k, v, mask, alone


@pytest.mark.parametrize("dtype,left", [(torch.float32, True), (torch.bfloat16, False)], ids=["fp32-left", "bf16-right"])
def test_padded_batch_rows_equal_each_sequence_alone(dtype, left):
    """Compiled flex, mixed per-head modes (FA/SSA/ESA/TA/XA) and per-call routing: each real row against its
    sequence alone through the float64 reference; padding rows are 0."""
    attn = HybridAttention(HEADS, KV_HEADS, DIM, PATTERNS, ["full", "ssa", "esa", "xa"], backend="flex")
    q, k, v, mask, alone = padded_inputs([1500, 700, 1999], 2000, dtype, left)
    out_tol, _ = TOLERANCE[dtype]
    for modes in (None, torch.tensor([[0, 1, 2, 3], [4, 3, 2, 0], [1, 1, 4, 2]], device="cuda")):
        out = attn(q, k, v, modes=modes, key_padding_mask=mask)
        for b, (qa, ka, va) in enumerate(alone):
            row_modes = None if modes is None else modes[b]
            expected = reference(qa.double(), ka.double(), va.double(), attn.reference_mask(qa, ka, row_modes))
            assert_near(out[b][:, mask[b]], expected[0], out_tol, f"batch element {b}")
            assert not out[b][:, ~mask[b]].any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_padded_forward_and_backward_match_reference(dtype):
    attn = HybridAttention(HEADS, KV_HEADS, DIM, PATTERNS, ["full", "ssa", "esa", "xa"], backend="flex",
                           plan="split")
    q, k, v, mask, _ = padded_inputs([1000, 430], 1024, dtype, seed=1)
    assert_forward_backward_match_reference(attn, q, k, v, mask)


def assert_forward_backward_match_reference(attn, q, k, v, mask):
    """attn's output and q/k/v gradients (random upstream gradient) against the float64 reference, within the
    inputs' dtype's tolerances; returns the output."""
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = attn(q, k, v, key_padding_mask=mask)
    grad_out = torch.randn_like(out)
    out.backward(grad_out)
    q2, k2, v2 = (t.detach().double().requires_grad_() for t in (q, k, v))
    expected = reference(q2, k2, v2, attn.reference_mask(q.detach(), k.detach(), key_padding_mask=mask))
    expected.backward(grad_out.double())
    out_tol, grad_tol = TOLERANCE[q.dtype]
    assert_near(out, expected, out_tol, "output")
    for name, a, b in (("dq", q, q2), ("dk", k, k2), ("dv", v, v2)):
        assert_near(a.grad, b.grad, grad_tol, name)
    return out


@pytest.mark.parametrize("q_len", [1, 300])
def test_decode_and_chunks_match_reference(q_len):
    attn = HybridAttention(HEADS, KV_HEADS, DIM, PATTERNS, ["full", "ssa", "esa", "ta"], backend="flex", plan="split")
    q, k, v = inputs(3000, torch.float32, seed=2, grad=False)
    out = attn(q[:, :, -q_len:], k, v)
    expected = reference(q[:, :, -q_len:], k, v, attn.reference_mask(q[:, :, -q_len:], k))
    assert_near(out, expected, TOLERANCE[torch.float32][0], "chunk")
    prefill = attn(q, k, v)
    assert_near(out, prefill[:, :, -q_len:], TOLERANCE[torch.float32][0], "chunk vs prefill rows")


def test_decode_loop_compiles_once_per_bucket_and_padding_masks_never_recompile():
    from torch._dynamo.utils import counters

    from flexsparse.runtime.buckets import kv_bucket

    attn = HybridAttention(HEADS, KV_HEADS, DIM, PATTERNS, ["full", "ssa", "esa", "ta"], backend="flex",
                           plan="fused")
    q, k, v = inputs(1500, torch.bfloat16, seed=3, grad=False)
    graphs = counters["stats"]["unique_graphs"]
    for step in range(1100, 1400):  # 300 decode steps
        attn(q[:, :, step - 1 : step], k[:, :, :step], v[:, :, :step])
    torch.cuda.synchronize()
    assert counters["stats"]["unique_graphs"] - graphs <= len({kv_bucket(n, 128) for n in range(1100, 1400)})
    q, k, v, mask, _ = padded_inputs([900, 1000], 1024, torch.bfloat16, seed=4)
    attn(q, k, v, key_padding_mask=mask)
    gen = torch.Generator().manual_seed(0)
    with torch.compiler.set_stance("fail_on_recompile"):
        for _ in range(50):
            lengths = torch.randint(1, 1025, (2,), generator=gen).tolist()
            mask = torch.zeros(2, 1024, dtype=torch.bool, device="cuda")
            for b, n in enumerate(lengths):
                mask[b, -n:] = True
            attn(q, k, v, key_padding_mask=mask)
    torch.cuda.synchronize()


def _planned_executors(attn, q, k, v, modes):
    """(executor name, KV heads) of each group the flex planner makes for a contiguous call of these modes."""
    call = AttentionCall(q, k, v, 1.0, Geometry(HEADS, q.shape[2], device="cuda"), needs_grad=True,
                         kv_heads=tuple(range(KV_HEADS)))
    return [(g.executor.name, g.heads.kv_heads) for g in attn._planners["flex"].groups(call, modes)]


def _assert_esa_layer_matches_reference(attn, seed, padded):
    """bf16 forward and backward of a 2-sequence batch (left-padded or not) against the float64 reference;
    returns the output and the inputs."""
    q, k, v, mask, _ = padded_inputs([1800, 900], 2048, torch.bfloat16, seed=seed)
    mask = mask if padded else None
    out = assert_forward_backward_match_reference(attn, q, k, v, mask)
    return out.detach(), q.detach(), k.detach(), v.detach(), mask


@pytest.mark.parametrize("padded", [False, True], ids=["contiguous", "left-padded"])
def test_mixed_layer_runs_esa_heads_on_the_gather_kernel(padded):
    """Full heads on SDPA, ESA heads (KV heads 1 and 3) on the gather kernel, sink+window heads on flex, in one
    layer: forward and backward against the float64 reference."""
    patterns = {"full": Causal(), "esa": ESA(3, 8, 64, HEADS), "ssa": SinkWindow(16, 256)}
    attn = HybridAttention(HEADS, KV_HEADS, DIM, patterns, ["full", "esa", "ssa", "esa"], backend="flex",
                           plan="split")
    q, k, v, _, _ = padded_inputs([2048], 2048, torch.bfloat16)
    assert _planned_executors(attn, q, k, v, (0, 1, 2, 1))[:2] == [("sdpa", (0,)), ("esa", (1, 3))]
    _assert_esa_layer_matches_reference(attn, 6, padded)


def test_esa_layers_of_other_head_dims_stay_on_flex():
    """The gather kernel takes power-of-two head dims; a layer with d = 96 (Phi-3) plans its ESA heads on flex."""
    esa = {"esa": ESA(3, 8, 64, HEADS)}
    attn = HybridAttention(HEADS, KV_HEADS, 96, esa, backend="flex")
    q = torch.randn(1, HEADS, 256, 96, device="cuda")
    k = torch.randn(1, KV_HEADS, 256, 96, device="cuda")
    call = AttentionCall(q, k, k, 1.0, Geometry(HEADS, 256, device="cuda"), needs_grad=False,
                         kv_heads=tuple(range(KV_HEADS)))
    assert attn._planners["flex"].groups(call, (0,) * KV_HEADS)[0].executor.name != "esa"


@pytest.mark.parametrize("padded", [False, True], ids=["contiguous", "left-padded"])
def test_all_esa_layers_run_the_gather_kernel(padded):
    """plan="auto" sends an all-ESA layer to the Triton gather kernel: equal to flex, and to the reference."""
    esa = {"esa": ESA(3, 8, 64, HEADS)}
    kernel = HybridAttention(HEADS, KV_HEADS, DIM, esa, backend="flex")
    flex = HybridAttention(HEADS, KV_HEADS, DIM, esa, backend="flex", plan="fused")
    q, k, v, _, _ = padded_inputs([2048], 2048, torch.bfloat16)
    assert _planned_executors(kernel, q, k, v, (0,) * KV_HEADS)[0][0] == "esa"
    out, q, k, v, mask = _assert_esa_layer_matches_reference(kernel, 5, padded)
    assert_near(out, flex(q, k, v, key_padding_mask=mask), TOLERANCE[torch.bfloat16][0], "vs flex")
