"""Executors are registered, not listed: a new one is its module, its test and one registration line.

The test executor here runs token-exact sink+window heads by slicing the keys any query of the call may see (the
sink and the window of the first query) and running SDPA with a band mask over the slice. Registered, the planner
picks it where its cost is the lowest, its output equals the dense reference, and a sparse KV cache is untouched by
it (it names no cache kind)."""

from typing import ClassVar

import pytest
import torch
import torch.nn.functional as F

from flexsparse import HybridAttention
from flexsparse.masks import ESA, Causal, Geometry, SinkWindow
from flexsparse.reference import attention as reference
from flexsparse.runtime.call import AttentionCall
from flexsparse.runtime.cost import DENSE_FLOPS_PER_S, LAUNCH_S, attention_flops
from flexsparse.runtime.executors import DenseExecutor, Executor, SdpaExecutor
from flexsparse.runtime.flex import FlexExecutor
from flexsparse.runtime.registry import register_executor, registered_executors, unregister_executor

PATTERNS = {"full": Causal(), "ssa": SinkWindow(sink=2, window=6), "narrow": SinkWindow(sink=0, window=3),
            "coarse": SinkWindow(sink=4, window=8, unit=4)}
ATOL = 2e-5  # fp32 SDPA / flex against the float64 reference


class SinkWindowSlices(Executor):
    """Token-exact sink+window heads of calls whose queries are the last positions: the keys the call's queries
    may see (sink, then the first query's window onwards), SDPA with a band mask over them. ``price`` scales its
    cost (the attended pairs at SDPA's throughput)."""

    name = "sink_window_slices"
    runs: ClassVar[list[tuple[int, ...]]] = []  # the KV heads of every run, for the tests

    def __init__(self, price: float = 1.0) -> None:
        self.price = price

    def accepts(self, pattern, call):
        positions = call.geometry.positions
        return (pattern.name == "sink_window" and getattr(pattern, "unit", None) == 1
                and (positions is None or positions.is_contiguous_layout))

    def cost(self, patterns, call):
        pairs = call.geometry.q_len * sum(min(p.sink + p.window, call.geometry.kv_len) for p in patterns)
        return self.price * attention_flops(call, 1, pairs) / DENSE_FLOPS_PER_S

    def run(self, call, patterns, modes, heads):
        SinkWindowSlices.runs.append(heads.kv_heads)
        q, k, v = heads.pick(call)
        geo, group = call.geometry, call.group_size
        offset = geo.kv_len - geo.q_len
        q_pos = torch.arange(geo.q_len, device=q.device) + offset
        outputs = []
        for i, mode in enumerate(modes.host):
            pattern = patterns[mode]
            start = max(pattern.sink, offset - pattern.window + 1)  # no query of the call sees keys in sink..start
            k_pos = torch.cat([torch.arange(min(pattern.sink, start)), torch.arange(start, geo.kv_len)]).to(q.device)
            allowed = (k_pos <= q_pos[:, None]) & ((k_pos < pattern.sink) | (q_pos[:, None] - k_pos < pattern.window))
            rows = slice(i * group, (i + 1) * group)
            outputs.append(F.scaled_dot_product_attention(q[:, rows], k[:, i:i + 1, k_pos], v[:, i:i + 1, k_pos],
                                                          attn_mask=allowed, scale=call.scale))
        return torch.cat(outputs, dim=1)


@pytest.fixture
def registered():
    """The one registration line, undone after the test."""
    SinkWindowSlices.runs.clear()
    register_executor(SinkWindowSlices)
    yield
    unregister_executor(SinkWindowSlices)


def qkv(batch, heads, kv_heads, seq, dim=16, kv=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, seq, dim, generator=g)
    k = torch.randn(batch, kv_heads, kv or seq, dim, generator=g)
    v = torch.randn(batch, kv_heads, kv or seq, dim, generator=g)
    return q, k, v


def planned(attn, q, k, host_modes, backend="flex_eager"):
    call = AttentionCall(q, k, k, 0.25, attn._geometry(q, k, None, None), needs_grad=False,
                         kv_heads=tuple(range(k.shape[1])))
    return [(g.executor.name, g.heads.kv_heads) for g in attn._planners[backend].groups(call, host_modes)]


def test_registered_executor_runs_its_heads_and_matches_the_reference(registered):
    """Registered, the executor takes the token-exact sink+window heads of a split plan (prefill, a chunk and a
    decode step): full heads stay on SDPA, block-granular sink+window on flex; the output is the dense softmax's."""
    assert [type(e) for e in registered_executors()][-1] is SinkWindowSlices
    modes = ["full", "ssa", "coarse", "narrow"]
    attn = HybridAttention(8, 4, 16, PATTERNS, modes, block_size=16, backend="flex_eager", plan="split")
    for q_len, kv_len in ((40, 40), (7, 40), (1, 40)):
        q, k, v = qkv(2, 8, 4, q_len, kv=kv_len, seed=q_len)
        assert planned(attn, q, k, (0, 1, 3, 2)) == [("sdpa", (0,)), ("sink_window_slices", (1, 3)),
                                                     ("flex_eager", (2,))]
        SinkWindowSlices.runs.clear()
        out = attn(q, k, v)
        assert SinkWindowSlices.runs == [(1, 3)]  # KV heads 1 ("ssa") and 3 ("narrow")
        torch.testing.assert_close(out, reference(q, k, v, attn.reference_mask(q, k)), atol=ATOL, rtol=0)


def test_layers_built_before_registration_keep_their_executors():
    attn = HybridAttention(4, 2, 16, PATTERNS, ["full", "ssa"], block_size=16, backend="flex_eager", plan="split")
    register_executor(SinkWindowSlices)
    try:
        q, k, _ = qkv(1, 4, 2, 24)
        assert planned(attn, q, k, (0, 1)) == [("sdpa", (0,)), ("flex_eager", (1,))]
        later = HybridAttention(4, 2, 16, PATTERNS, ["full", "ssa"], block_size=16, backend="flex_eager",
                                plan="split")
        assert planned(later, q, k, (0, 1)) == [("sdpa", (0,)), ("sink_window_slices", (1,))]
        with pytest.raises(ValueError, match="registered already"):
            register_executor(SinkWindowSlices)
    finally:
        unregister_executor(SinkWindowSlices)
    with pytest.raises(ValueError, match="not registered"):
        unregister_executor(SinkWindowSlices)
    with pytest.raises(TypeError, match="register_executor takes"):
        register_executor(SinkWindowSlices())


@pytest.mark.parametrize("price,owner", [(1.0, "sink_window_slices"), (1e9, "flex_eager")])
def test_the_planner_follows_costs(price, owner):
    """The same executor set: the sink+window heads go to the test executor while it is cheaper than flex, to flex
    once it costs more by more than a launch; estimates closer than a launch leave the head to the earlier
    executor."""
    flex = FlexExecutor(list(PATTERNS.values()), compiled=False)
    attn = HybridAttention(4, 2, 16, PATTERNS, ["ssa", "full"], block_size=16, plan="split",
                           executors=[SdpaExecutor(), SinkWindowSlices(price), flex])
    q, k, v = qkv(1, 4, 2, 32)
    assert planned(attn, q, k, (1, 0), "custom")[0] == (owner, (0,))
    torch.testing.assert_close(attn(q, k, v), reference(q, k, v, attn.reference_mask(q, k)), atol=ATOL, rtol=0)

    class Priced(SinkWindowSlices):
        def __init__(self, name, cost):
            super().__init__()
            self.name, self.fixed = name, cost

        def cost(self, patterns, call):
            return self.fixed

    for first, second, expected in ((0.0, 0.0, "a"), (1.0, 0.0, "b"), (0.0, 1.0, "a"), (LAUNCH_S / 2, 0.0, "a")):
        tied = HybridAttention(4, 2, 16, PATTERNS, ["ssa", "ssa"], plan="split",
                               executors=[Priced("a", first), Priced("b", second), flex])
        assert planned(tied, q, k, (1, 1), "custom") == [(expected, (0, 1))]


def test_a_later_executor_takes_a_head_when_it_saves_more_than_a_launch():
    """Preference order [flex, slices]: at 8192 tokens flex's estimate for a sink+window head exceeds the slices'
    by more than a launch, so the later executor takes it; at 64 tokens the estimates do not rank and flex keeps
    it. Only planned (empty tensors)."""
    flex = FlexExecutor(list(PATTERNS.values()), compiled=False)
    attn = HybridAttention(4, 2, 16, PATTERNS, ["ssa", "full"], plan="split", executors=[flex, SinkWindowSlices()])
    for seq, owner in ((8192, "sink_window_slices"), (64, "flex_eager")):
        q, k = torch.empty(1, 4, seq, 16), torch.empty(1, 2, seq, 16)
        call = AttentionCall(q, k, k, 0.25, Geometry(4, seq), needs_grad=False, kv_heads=(0, 1))
        saving = flex.cost([PATTERNS["ssa"]], call) - SinkWindowSlices().cost([PATTERNS["ssa"]], call)
        assert (saving > LAUNCH_S) == (seq == 8192)
        assert planned(attn, q, k, (1, 0), "custom")[0][0] == owner  # the group holding KV head 0


def test_a_custom_set_is_used_and_fused_plans_take_its_fusing_executor():
    """executors= replaces the backend's set: a dense-only set runs everything dense (equal to the reference), a
    set without SDPA keeps full heads off it, and plan="fused" or per-call mode tensors take the first executor
    that fuses."""
    q, k, v = qkv(2, 8, 4, 24)
    dense = HybridAttention(8, 4, 16, PATTERNS, ["full", "ssa", "narrow", "coarse"], block_size=16, plan="split",
                            executors=[DenseExecutor()])
    assert planned(dense, q, k, (0, 1, 2, 3), "custom") == [("dense", (0, 1, 2, 3))]
    torch.testing.assert_close(dense(q, k, v), reference(q, k, v, dense.reference_mask(q, k)), atol=ATOL, rtol=0)
    slices = SinkWindowSlices()
    mixed = HybridAttention(8, 4, 16, PATTERNS, ["full", "ssa", "narrow", "coarse"], block_size=16, plan="fused",
                            executors=[slices, DenseExecutor()])
    assert planned(mixed, q, k, (0, 1, 2, 3), "custom") == [("dense", (0, 1, 2, 3))]
    routed = torch.tensor([[1, 0, 2, 3], [0, 0, 1, 1]])
    torch.testing.assert_close(mixed(q, k, v, modes=routed), reference(q, k, v, mixed.reference_mask(q, k, routed)),
                               atol=ATOL, rtol=0)
    with pytest.raises(ValueError, match="backend or executors"):
        HybridAttention(8, 4, 16, PATTERNS, backend="dense", executors=[DenseExecutor()])


def test_no_executor_accepting_a_pattern_is_a_clear_value_error():
    q, k, v = qkv(1, 4, 2, 24)
    attn = HybridAttention(4, 2, 16, PATTERNS, ["full", "coarse"], plan="split", executors=[SdpaExecutor()])
    with pytest.raises(ValueError, match=r"no executor accepts pattern 'coarse' \(SinkWindow\(sink=4, window=8, "
                                         r"unit=4\)\) .*q_len 24.*executors: \['sdpa'\]"):
        attn(q, k, v)
    with pytest.raises(ValueError, match=r"no executor runs patterns \['full', 'ssa', 'narrow', 'coarse'\] in one launch"):
        attn(q, k, v, modes=torch.tensor([0, 1]))
    esa = HybridAttention(4, 2, 16, {"esa": ESA(0, 2, 4, 4)}, plan="split", executors=[SdpaExecutor()])
    with pytest.raises(ValueError, match="no executor accepts pattern 'esa'"):
        esa(q, k, v)
    with pytest.raises(TypeError, match="executors must be a non-empty sequence of Executor"):
        HybridAttention(4, 2, 16, PATTERNS, executors=[])


def test_costs_rank_the_default_executors():
    """SDPA is cheaper than flex on full heads (flex runs full tiles at 0.7x), and flex's estimate of a sparse
    head (every causal tile at a partial tile's cost) is above the work of its attended pairs."""
    q, k = torch.empty(1, 32, 4096, 128), torch.empty(1, 8, 4096, 128)
    call = AttentionCall(q, k, k, 1.0, Geometry(32, 4096), needs_grad=False, kv_heads=tuple(range(8)))
    flex = FlexExecutor(list(PATTERNS.values()))
    full, ssa = PATTERNS["full"], PATTERNS["ssa"]
    assert SdpaExecutor().cost([full], call) == pytest.approx(0.7 * flex.cost([full], call))
    assert flex.cost([ssa], call) > flex.cost([full], call)
    assert SinkWindowSlices().cost([ssa], call) < flex.cost([ssa], call)
    assert flex.cost([full, ssa], call) == pytest.approx(flex.cost([full], call) + flex.cost([ssa], call))


def test_a_sparse_kv_cache_groups_heads_as_the_executors_say():
    """cache_groups asks each executor in order whether it decodes the head's pattern: the default set gives an
    every-key group (SDPA), ESA's own group, a group the plan reads whole and a ring; a set without SDPA or ESA
    leaves every head to the plan (one group); a set that neither decodes a pattern nor runs a plan is a
    ValueError."""
    from flexsparse.cache import StoreKind
    from flexsparse.integrations.layer import cache_groups
    from flexsparse.runtime.esa_executor import EsaExecutor

    patterns = [Causal(), ESA(0, 2, 4, 4), PATTERNS["coarse"], PATTERNS["ssa"]]
    flex = FlexExecutor(patterns)
    default = [SdpaExecutor(), EsaExecutor(), flex]
    groups = cache_groups(patterns, [3, 0, 1, 2, 0], default)
    assert [(g.store_kind, g.kv_heads, type(g.decoder)) for g in groups] == [
        (StoreKind.EVERY_KEY, (1, 4), SdpaExecutor), (StoreKind.EVERY_KEY, (2,), EsaExecutor),
        (StoreKind.EVERY_KEY, (3,), type(None)), (StoreKind.RING, (0,), SdpaExecutor)]
    assert groups[1].pattern is patterns[1] and groups[3].pattern is patterns[3] and groups[2].pattern is None
    plan_only = cache_groups(patterns, [3, 0, 1, 2, 0], [flex])
    assert [(g.decoder, g.kv_heads) for g in plan_only] == [(None, (0, 1, 2, 3, 4))]
    with pytest.raises(ValueError, match="no executor decodes pattern SinkWindow"):
        cache_groups(patterns, [3, 0], [SinkWindowSlices()])
