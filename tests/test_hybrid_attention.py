"""HybridAttention against the dense softmax reference (fp32, CPU), its errors, and its no-recompile guarantee."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import flexsparse
from flexsparse import HybridAttention
from flexsparse.masks import Causal, Geometry, SinkWindow
from flexsparse.reference import attention as reference

pytestmark = pytest.mark.filterwarnings("ignore:.*flex_attention called without torch.compile.*")

PATTERNS = {"full": Causal(), "ssa": SinkWindow(sink=8, window=24), "narrow": SinkWindow(sink=0, window=5)}
ATOL = 2e-5  # fp32 flex / SDPA vs float64 reference


def dense_mask(patterns, head_modes, seq, kv=None):
    """Reference mask [B, H, Q, KV] from each row's pattern's dense reference."""
    kv = kv or seq
    heads = head_modes.shape[-1]
    geo = Geometry(heads, seq, kv)
    rows = [[list(patterns.values())[int(m)].dense(geo)[0, 0] for m in row] for row in head_modes]
    return torch.stack([torch.stack(r) for r in rows])


def qkv(batch, heads, kv_heads, seq, dim=16, kv=None, seed=0, grad=False):
    gen = torch.Generator().manual_seed(seed)
    kv = kv or seq
    q = torch.randn(batch, heads, seq, dim, generator=gen)
    k = torch.randn(batch, kv_heads, kv, dim, generator=gen)
    v = torch.randn(batch, kv_heads, kv, dim, generator=gen)
    return [t.requires_grad_(grad) for t in (q, k, v)]


@pytest.mark.parametrize("groups", [1, 2, 4])
@pytest.mark.parametrize("seq", [64, 100, 130])
@pytest.mark.parametrize("modes", ["all_full", "all_ssa", "mixed"])
def test_eager_flex_matches_reference(groups, seq, modes):
    kv_heads = 4
    names = {"all_full": ["full"] * 4, "all_ssa": ["ssa"] * 4, "mixed": ["full", "ssa", "narrow", "ssa"]}[modes]
    attn = HybridAttention(kv_heads * groups, kv_heads, 16, PATTERNS, names, block_size=32, backend="flex_eager")
    q, k, v = qkv(2, kv_heads * groups, kv_heads, seq)
    head_modes = attn.default_modes.repeat_interleave(groups)[None].expand(2, -1)
    expected = reference(q, k, v, dense_mask(PATTERNS, head_modes, seq))
    torch.testing.assert_close(attn(q, k, v), expected, atol=ATOL, rtol=0)


def test_per_batch_modes_and_decode_offset():
    attn = HybridAttention(4, 2, 16, PATTERNS, block_size=16, backend="flex_eager")
    q, k, v = qkv(3, 4, 2, 20, kv=90)  # 20 queries at positions 70..89
    modes = torch.tensor([[0, 1], [2, 0], [1, 2]])
    expected = reference(q, k, v, dense_mask(PATTERNS, modes.repeat_interleave(2, 1), 20, 90))
    torch.testing.assert_close(attn(q, k, v, modes=modes), expected, atol=ATOL, rtol=0)


@pytest.mark.parametrize("groups", [1, 2, 4])
def test_dense_backend_gradients_match_reference(groups):
    attn = HybridAttention(2 * groups, 2, 16, PATTERNS, ["ssa", "full"], block_size=16, backend="auto")
    q, k, v = qkv(2, 2 * groups, 2, 75, grad=True)
    out = attn(q, k, v)
    head_modes = attn.default_modes.repeat_interleave(groups)[None].expand(2, -1)
    q2, k2, v2 = (t.detach().clone().requires_grad_() for t in (q, k, v))
    expected = reference(q2, k2, v2, dense_mask(PATTERNS, head_modes, 75))
    torch.testing.assert_close(out, expected, atol=ATOL, rtol=0)
    grad_out = torch.randn_like(out)
    out.backward(grad_out)
    expected.backward(grad_out)
    for name, a, b in (("dq", q, q2), ("dk", k, k2), ("dv", v, v2)):
        torch.testing.assert_close(a.grad, b.grad, atol=5e-5, rtol=0, msg=name)


def test_auto_backend_uses_dense_mask_path_for_cpu_training():
    attn = HybridAttention(2, 2, 16, PATTERNS, ["ssa", "full"])
    q, k, v = qkv(1, 2, 2, 40, grad=True)
    attn(q, k, v).sum().backward()  # flex_attention has no CPU backward; auto must not pick it
    assert q.grad is not None and torch.isfinite(q.grad).all()


def test_flex_backend_refuses_cpu_backward_up_front():
    attn = HybridAttention(2, 2, 16, PATTERNS, backend="flex")
    q, k, v = qkv(1, 2, 2, 40, grad=True)
    with pytest.raises(ValueError, match="no backward on CPU"):
        attn(q, k, v)


def test_last_stats_msr_and_esr():
    attn = HybridAttention(8, 4, 16, PATTERNS, ["full", "ssa", "ssa", "narrow"], block_size=16, backend="flex_eager")
    q, k, v = qkv(1, 8, 4, 64)
    attn(q, k, v)
    stats = attn.last_stats.as_dict()
    assert stats["msr"] == pytest.approx(0.75)
    geo = Geometry(1, 64)
    causal = 64 * 65 / 2
    pruned = [1 - PATTERNS[n].attended(geo).sum().item() / causal for n in ("full", "ssa", "ssa", "narrow")]
    assert stats["esr"] == pytest.approx(sum(pruned) / 4, abs=1e-6)
    assert 0 < stats["block_density"] < 1


@given(
    seq=st.integers(2, 70),
    cut=st.data(),
    modes=st.lists(st.integers(0, 2), min_size=2, max_size=2),
    block=st.sampled_from([16, 32]),
)
def test_output_is_causal(seq, cut, modes, block):
    """Changing keys/values after position t never changes output rows 0..t."""
    t = cut.draw(st.integers(0, seq - 2))
    attn = HybridAttention(4, 2, 8, PATTERNS, modes, block_size=block, backend="flex_eager")
    q, k, v = qkv(1, 4, 2, seq, dim=8)
    before = attn(q, k, v)
    k2, v2 = k.clone(), v.clone()
    k2[:, :, t + 1 :] = torch.randn_like(k2[:, :, t + 1 :]) * 10
    v2[:, :, t + 1 :] = torch.randn_like(v2[:, :, t + 1 :]) * 10
    after = attn(q, k2, v2)
    torch.testing.assert_close(after[:, :, : t + 1], before[:, :, : t + 1], atol=1e-6, rtol=0)


# ----- bad input -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        (dict(num_heads=6, num_kv_heads=4), ValueError, "multiple of num_kv_heads"),
        (dict(head_dim=0), ValueError, "head_dim"),
        (dict(num_heads=4.0), TypeError, "num_heads"),
        (dict(modes=["full"]), ValueError, "one entry per KV head"),
        (dict(modes=["full", "sparse"]), ValueError, "unknown pattern 'sparse'"),
        (dict(modes=["full", 7]), ValueError, "KV head 1 must be a pattern name or an index < 3, got 7"),
        (dict(modes="full"), TypeError, "modes"),
        (dict(backend="triton"), ValueError, "backend"),
        (dict(patterns={"full": "causal"}), TypeError, "patterns"),
        (dict(patterns={}), TypeError, "patterns"),
    ],
)
def test_constructor_rejects(kwargs, error, match):
    args = dict(num_heads=4, num_kv_heads=2, head_dim=16, patterns=PATTERNS) | kwargs
    with pytest.raises(error, match=match):
        HybridAttention(**args)


def _inputs(**changes):
    q, k, v = qkv(1, 4, 2, 32)
    d = dict(q=q, k=k, v=v) | changes
    return d["q"], d["k"], d["v"]


@pytest.mark.parametrize(
    "inputs,modes,error,match",
    [
        (_inputs(q=torch.randn(4, 32, 16)), None, ValueError, "q must be 4-D"),
        (_inputs(q=torch.randn(1, 3, 32, 16)), None, ValueError, "q has 3 heads"),
        (_inputs(k=torch.randn(1, 4, 32, 16)), None, ValueError, "k has 4 heads"),
        (_inputs(v=torch.randn(1, 2, 32, 8)), None, ValueError, "v has head_dim 8"),
        (_inputs(k=torch.randn(1, 2, 31, 16)), None, ValueError, "lengths differ"),
        (_inputs(q=torch.randn(1, 4, 40, 16)), None, ValueError, "exceeds kv_len"),
        (_inputs(k=torch.randn(1, 2, 32, 16, dtype=torch.float64)), None, TypeError, "dtype"),
        (_inputs(v=torch.randn(2, 2, 32, 16)), None, ValueError, "batch"),
        (_inputs(), torch.tensor([0, 1, 1]), ValueError, r"shape \[2\]"),
        (_inputs(), torch.tensor([0.0, 1.0]), TypeError, "integer"),
        (_inputs(), torch.tensor([0, 3]), ValueError, "index the 3 patterns"),
        (_inputs(), torch.tensor([[0, 1], [1, 0], [0, 0]]), ValueError, "batch 3"),
        (_inputs(), {0: 1}, TypeError, "sequence of pattern names/indices"),  # lists run: test_bad_input.py
    ],
)
def test_forward_rejects(inputs, modes, error, match):
    attn = HybridAttention(4, 2, 16, PATTERNS, backend="flex_eager")
    with pytest.raises(error, match=match):
        attn(*inputs, modes=modes)


def test_long_inputs_never_take_an_O_S2_path_silently():
    attn = HybridAttention(4, 2, 16, PATTERNS, backend="flex_eager", max_dense_len=64)
    with pytest.raises(ValueError, match="max_dense_len"):
        attn(*qkv(1, 4, 2, 65))
    attn = HybridAttention(4, 2, 16, PATTERNS, backend="dense", max_dense_len=64)
    with pytest.raises(ValueError, match="max_dense_len"):
        attn(*qkv(1, 4, 2, 65))


def test_public_api_is_exported():
    for name in ("HybridAttention", "Causal", "SinkWindow", "Union", "Intersection", "PerHead", "PerLayer"):
        assert hasattr(flexsparse, name)


@pytest.mark.parametrize("modes", [["full", "ssa", "narrow", "full"], ["ssa", "full", "full", "narrow"]])
def test_split_plan_matches_fused_and_reference(modes):
    """Full heads through SDPA, sparse heads through flex, written back in head order."""
    split = HybridAttention(8, 4, 16, PATTERNS, modes, block_size=16, backend="flex_eager", plan="split")
    fused = HybridAttention(8, 4, 16, PATTERNS, modes, block_size=16, backend="flex_eager", plan="fused")
    q, k, v = qkv(2, 8, 4, 70)
    expected = reference(q, k, v, fused.reference_mask(q, k))
    torch.testing.assert_close(split(q, k, v), expected, atol=ATOL, rtol=0)
    torch.testing.assert_close(fused(q, k, v), expected, atol=ATOL, rtol=0)
    routed = torch.tensor([1, 0, 0, 2])
    torch.testing.assert_close(split(q, k, v, modes=routed), reference(q, k, v, split.reference_mask(q, k, routed)),
                               atol=ATOL, rtol=0)
    assert split.last_stats.msr == 0.5


def test_split_plan_runs_decode_and_per_call_modes():
    """Decode sends full heads to SDPA with a position mask; per-call mode tensors run fused (no host sync)."""
    split = HybridAttention(4, 2, 16, PATTERNS, ["full", "ssa"], backend="flex_eager", plan="split")
    q, k, v = qkv(1, 4, 2, 20, kv=40)
    torch.testing.assert_close(split(q, k, v), reference(q, k, v, split.reference_mask(q, k)), atol=ATOL, rtol=0)
    q, k, v = qkv(2, 4, 2, 20)
    routed = torch.tensor([[0, 1], [1, 0]])
    torch.testing.assert_close(split(q, k, v, modes=routed), reference(q, k, v, split.reference_mask(q, k, routed)),
                               atol=ATOL, rtol=0)
    with pytest.raises(ValueError, match="plan"):
        HybridAttention(4, 2, 16, PATTERNS, plan="serial")


def test_auto_plan_cost_model_prefers_split_only_for_long_sequences():
    """The executors' costs: 2 full heads of 8 on SDPA beside 6 sink+window heads on flex pay for the extra launch
    and the output copy only for long sequences."""
    from flexsparse.runtime.call import AttentionCall
    from flexsparse.runtime.executors import SdpaExecutor
    from flexsparse.runtime.flex import FlexExecutor
    from flexsparse.runtime.plan import split_pays

    def call(seq):
        q, k = torch.empty(1, 32, seq, 128), torch.empty(1, 8, seq, 128)
        return AttentionCall(q, k, k, 1.0, Geometry(32, seq), needs_grad=False, kv_heads=tuple(range(8)))

    full, ssa = Causal(), SinkWindow(128, 2048)
    flex = FlexExecutor([full, ssa])
    groups = [(SdpaExecutor(), [full] * 2), (flex, [ssa] * 6)]
    assert not split_pays(call(2048), groups, flex)
    assert split_pays(call(65536), groups, flex)


def test_one_mode_for_every_head_is_planned_on_the_host():
    """modes="full" (or an index) equals the same modes as a tensor, and is grouped like default modes."""
    attn = HybridAttention(8, 4, 16, PATTERNS, ["ssa"] * 4, block_size=16, backend="flex_eager", plan="split")
    q, k, v = qkv(2, 8, 4, 40)
    for mode in ("full", 1, 2):
        index = list(PATTERNS).index(mode) if isinstance(mode, str) else mode
        expected = attn(q, k, v, modes=torch.full((4,), index))
        torch.testing.assert_close(attn(q, k, v, modes=mode), expected, atol=ATOL, rtol=0)
    from flexsparse.runtime.call import AttentionCall

    _, host = attn._q_modes(q, "full")
    assert host == (0, 0, 0, 0)
    call = AttentionCall(q, k, v, 0.25, Geometry(8, 40, block_size=16), needs_grad=False, kv_heads=(0, 1, 2, 3))
    assert [g.executor.name for g in attn._planners["flex_eager"].groups(call, host)] == ["sdpa"]
    with pytest.raises(ValueError, match="unknown pattern 'nope'"):
        attn(q, k, v, modes="nope")
    with pytest.raises(ValueError, match="modes must be a pattern name or an index < 3, got 3"):
        attn(q, k, v, modes=3)


@pytest.mark.parametrize("backend", ["flex_eager", "dense"])
def test_a_subset_of_kv_heads_equals_those_heads_of_the_whole_layer(backend):
    """kv_heads runs some heads alone (a cache group); per-head patterns keep their head ids."""
    from flexsparse.masks import ESA

    patterns = dict(PATTERNS, esa=ESA(1, 4, 6, 8))
    attn = HybridAttention(8, 4, 16, patterns, ["full", "esa", "ssa", "esa"], block_size=16, backend=backend)
    q, k, v = qkv(2, 8, 4, 50)
    whole = attn(q, k, v)
    for heads in ([1, 3], [0, 2], [2]):
        q_rows = [h * 2 + i for h in heads for i in range(2)]
        part = attn(q[:, q_rows], k[:, heads], v[:, heads], kv_heads=heads)
        torch.testing.assert_close(part, whole[:, q_rows], atol=ATOL, rtol=0)
        assert 0 <= attn.last_stats.as_dict()["esr"] < 1
    routed = torch.tensor([[3, 1, 0, 2], [2, 2, 1, 0]])
    torch.testing.assert_close(attn(q[:, 2:6], k[:, 1:3], v[:, 1:3], modes=routed, kv_heads=[1, 2]),
                               attn(q, k, v, modes=routed)[:, 2:6], atol=ATOL, rtol=0)
    with pytest.raises(ValueError, match="ascending"):
        attn(q[:, :4], k[:, :2], v[:, :2], kv_heads=[1, 0])
    with pytest.raises(ValueError, match=r"k has 2 heads, expected 1 for kv_heads=\[3\]"):
        attn(q[:, :2], k[:, :2], v[:, :2], kv_heads=[3])


def test_split_plan_sends_each_head_to_the_cheapest_executor_that_accepts_it():
    """A mixed layer: full heads to SDPA, ESA heads to the ESA kernel (any subset of the layer's heads, here KV
    heads 1 and 3), the rest to the sparse executor; a cache group's subset of heads plans the same way."""
    from flexsparse.masks import ESA
    from flexsparse.runtime.call import AttentionCall
    from flexsparse.runtime.executors import Executor, SdpaExecutor
    from flexsparse.runtime.plan import Planner

    class EsaKernel(Executor):
        name = "esa"

        def accepts(self, pattern, call):
            return isinstance(pattern, ESA)

        def cost(self, patterns, call):
            return 1.0 * len(patterns)

        def run(self, call, patterns, modes, heads):
            raise AssertionError("not run")

    class Sparse(EsaKernel):
        name = "sparse"
        fuses = True

        def accepts(self, pattern, call):
            return True

        def cost(self, patterns, call):
            return 2.0 * len(patterns)

    patterns = [Causal(), ESA(0, 2, 4, 8), SinkWindow(2, 8)]
    planner = Planner("split", patterns, 4, [SdpaExecutor(), EsaKernel(), Sparse()])
    q, k = torch.empty(1, 8, 64, 16), torch.empty(1, 4, 64, 16)
    call = AttentionCall(q, k, k, 0.25, Geometry(8, 64), needs_grad=False, kv_heads=(0, 1, 2, 3))
    groups = planner.groups(call, (0, 1, 2, 1))
    assert [(g.executor.name, g.heads.kv_heads) for g in groups] == [("sdpa", (0,)), ("esa", (1, 3)), ("sparse", (2,))]
    half = AttentionCall(q[:, :4], k[:, :2], k[:, :2], 0.25, Geometry(8, 64), needs_grad=False, kv_heads=(1, 3))
    assert [(g.executor.name, g.heads.kv_heads) for g in planner.groups(half, (1, 1))] == [("esa", (0, 1))]
