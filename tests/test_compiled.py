"""The compiled flex_attention path on CPU: correct, and new routings never recompile.

One compiled shape is shared by the module (the first compiled call costs ~25 s of C++ codegen on 2 cores).
"""

from unittest.mock import patch

import pytest
import torch

import flexsparse.runtime.compiled
from flexsparse import HybridAttention, RecompileLimitError
from flexsparse.masks import Causal, SinkWindow, XAttention
from flexsparse.reference import attention as reference
from tests.test_hybrid_attention import ATOL, dense_mask, qkv

pytestmark = pytest.mark.compiled

PATTERNS = {"full": Causal(), "ssa": SinkWindow(sink=16, window=48), "local": SinkWindow(sink=0, window=20)}
BATCH, HEADS, KV_HEADS, SEQ = 2, 4, 2, 200


@pytest.fixture(scope="module")
def warm():
    torch._dynamo.reset()
    attn = HybridAttention(HEADS, KV_HEADS, 16, PATTERNS, ["full", "ssa"], block_size=64, backend="flex")
    q, k, v = qkv(BATCH, HEADS, KV_HEADS, SEQ)
    attn(q, k, v, modes=torch.tensor([[0, 1], [2, 0]]))  # warm-up: compiles the per-head dispatch once
    return attn, (q, k, v)


def test_compiled_matches_reference(warm):
    attn, (q, k, v) = warm
    modes = torch.tensor([[1, 2], [0, 0]])
    out = attn(q, k, v, modes=modes)
    expected = reference(q, k, v, dense_mask(PATTERNS, modes.repeat_interleave(2, 1), SEQ))
    torch.testing.assert_close(out, expected, atol=ATOL, rtol=0)


def test_fifty_routings_cause_no_recompile(warm):
    attn, (q, k, v) = warm
    gen = torch.Generator().manual_seed(1)
    routings = [torch.randint(0, 3, (BATCH, KV_HEADS), generator=gen) for _ in range(50)]
    assert len({tuple(r.flatten().tolist()) for r in routings}) > 5
    with torch.compiler.set_stance("fail_on_recompile"):
        outs = [attn(q, k, v, modes=r) for r in routings]
    for r, out in list(zip(routings, outs))[:3]:
        expected = reference(q, k, v, dense_mask(PATTERNS, r.repeat_interleave(2, 1), SEQ))
        torch.testing.assert_close(out, expected, atol=ATOL, rtol=0)


def test_recompile_limit_raises_instead_of_unfused_fallback(warm):
    attn, _ = warm
    with patch.object(flexsparse.runtime.compiled, "MAX_COMPILED_VARIANTS", 1), torch._dynamo.config.patch(recompile_limit=1):
        with pytest.raises(RecompileLimitError, match="refuses the unfused fallback"):
            attn(*qkv(BATCH, HEADS, KV_HEADS, SEQ + 7), modes=torch.tensor([0, 1]))


def test_content_dependent_xa_heads_never_recompile():
    """XA resolves a new block table for every input; new tables are new tensor values, not new graphs.

    (The modes tensor's shape, [H_kv] or [B, H_kv], is part of the compiled structure: keep it fixed.)"""
    patterns = {"full": Causal(), "ssa": SinkWindow(sink=16, window=48), "xa": XAttention(0.8, stride=8, block_size=64)}
    attn = HybridAttention(HEADS, KV_HEADS, 16, patterns, ["xa", "ssa"], block_size=64, backend="flex")
    attn(*qkv(BATCH, HEADS, KV_HEADS, SEQ, seed=100), modes=torch.tensor([[2, 0], [0, 2]]))  # warm-up
    with torch.compiler.set_stance("fail_on_recompile"):
        for seed in range(10):
            q, k, v = qkv(BATCH, HEADS, KV_HEADS, SEQ, seed=seed)
            modes = torch.tensor([[2, 1], [0, 2]]) if seed % 2 else torch.tensor([[2, 2], [1, 0]])
            out = attn(q, k, v, modes=modes)
    expected = reference(q, k, v, attn.reference_mask(q, k, modes))
    torch.testing.assert_close(out, expected, atol=ATOL, rtol=0)


def test_esa_layers_share_one_compiled_kernel():
    """ESA's layer enters mask_mod as a tensor: a model's ESA layers compile once, not once per layer."""
    from torch._dynamo.utils import counters

    from flexsparse.masks import ESA

    layers = [HybridAttention(HEADS, KV_HEADS, 16, ESA(i, 6, 12, HEADS), block_size=64, backend="flex") for i in range(6)]
    q, k, v = qkv(1, HEADS, KV_HEADS, SEQ)
    layers[0](q, k, v)
    graphs = counters["stats"]["unique_graphs"]
    with torch.compiler.set_stance("fail_on_recompile"):
        outs = [layer(q, k, v) for layer in layers[1:]]
    assert counters["stats"]["unique_graphs"] == graphs
    expected = reference(q, k, v, layers[-1].reference_mask(q, k))
    torch.testing.assert_close(outs[-1], expected, atol=ATOL, rtol=0)


def test_other_callers_exhausting_torch_flex_attention_do_not_affect_flexsparse(warm):
    """A caller that compiles torch's flex_attention past the recompile limit makes torch run that function
    unfused from then on; flexsparse compiles its own wrapper, so its calls stay compiled."""
    import warnings

    from torch.nn.attention.flex_attention import flex_attention

    attn, (q, k, v) = warm
    other = torch.compile(flex_attention, dynamic=False)
    with torch._dynamo.config.patch(recompile_limit=1), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        other(q[:, :, :64], k[:, :, :64], v[:, :, :64], enable_gqa=True)
        other(q[:, :, :96], k[:, :, :96], v[:, :, :96], enable_gqa=True)  # past the limit: torch gives up
    with torch.compiler.set_stance("fail_on_recompile"), warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*without torch.compile.*")
        out = attn(q, k, v, modes=torch.tensor([[0, 1], [2, 0]]))
    expected = reference(q, k, v, dense_mask(PATTERNS, torch.tensor([[0, 0, 1, 1], [2, 2, 0, 0]]), SEQ))
    torch.testing.assert_close(out, expected, atol=ATOL, rtol=0)


def test_fifty_padding_masks_and_routings_cause_no_recompile():
    """New padding patterns are new position tables (tensor values), new routings new mode tensors."""
    from tests.test_padding_decode import padded_batch

    attn = HybridAttention(HEADS, KV_HEADS, 8, PATTERNS, ["full", "ssa"], block_size=64, backend="flex")
    gen = torch.Generator().manual_seed(7)

    def random_call():
        lengths = torch.randint(1, SEQ + 1, (BATCH,), generator=gen).tolist()
        left = bool(torch.randint(0, 2, (1,), generator=gen))
        q, k, v, mask, alone = padded_batch(lengths, SEQ, left, seed=int(torch.randint(0, 1000, (1,), generator=gen)))
        modes = torch.randint(0, 3, (BATCH, KV_HEADS), generator=gen)
        return q, k, v, mask, alone, modes

    q, k, v, mask, _, modes = random_call()
    attn(q, k, v, modes=modes, key_padding_mask=mask)  # warm-up: compiles once
    calls = [random_call() for _ in range(50)]
    with torch.compiler.set_stance("fail_on_recompile"):
        outs = [attn(q, k, v, modes=m, key_padding_mask=mask) for q, k, v, mask, _, m in calls]
    for out, (_, _, _, mask, alone, modes) in list(zip(outs, calls))[:3]:
        for b, (qa, ka, va) in enumerate(alone):
            expected = reference(qa, ka, va, attn.reference_mask(qa, ka, modes[b]))
            torch.testing.assert_close(out[b][:, mask[b]], expected[0], atol=ATOL, rtol=0)


def test_long_decode_loop_compiles_one_variant_per_length_bucket():
    """300 decode steps, the cache growing by one key per step: keys run at bucketed lengths (64 x 2^k), so the
    loop compiles once per bucket it crosses and never reaches the recompile limit."""
    from torch._dynamo.utils import counters

    from flexsparse.runtime.buckets import kv_bucket

    attn = HybridAttention(HEADS, KV_HEADS, 16, PATTERNS, ["ssa", "local"], block_size=64, backend="flex")
    q, k, v = qkv(1, HEADS, KV_HEADS, 420, seed=3)
    start = 120
    graphs = counters["stats"]["unique_graphs"]
    with patch.object(flexsparse.runtime.compiled, "MAX_COMPILED_VARIANTS", 8), \
            torch._dynamo.config.patch(recompile_limit=8):
        for step in range(start, start + 300):
            out = attn(q[:, :, step - 1 : step], k[:, :, :step], v[:, :, :step])
            if step in (start, start + 63, start + 299):
                expected = reference(q[:, :, step - 1 : step], k[:, :, :step], v[:, :, :step],
                                     attn.reference_mask(q[:, :, step - 1 : step], k[:, :, :step]))
                torch.testing.assert_close(out, expected, atol=ATOL, rtol=0)
    buckets = {kv_bucket(n, 64) for n in range(start, start + 300)}
    assert len(buckets) == 3
    assert counters["stats"]["unique_graphs"] - graphs <= len(buckets)
