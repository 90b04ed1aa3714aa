"""The sparse KV cache's capacities (issue 27): the growth grid, buffer sizes across a long generation, memory
against transformers' DynamicCache for full heads beside ESA, XAttention and TriangleMix heads, and cached decode
equal to a DynamicCache's (and to recompute where a pattern's decode is one) across capacity changes (tiny random
Llama, fp32, CPU; the Triton kernels in the interpreter where a test says so)."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flexsparse.integrations import SparseKVCache, convert, kv_memory_formula
from flexsparse.cache import GROWTH_STEPS, StoreKind, grown_capacity
from flexsparse.integrations.transformers import flexsparse_attention, flexsparse_mask
from flexsparse.masks import ESA, Causal, SinkWindow, TriangleMix, XAttention
from tests.hf_util import (
    HEAD_DIM,
    KV_HEADS,
    LAYERS,
    greedy,
    left_padded,
    one_thread,  # noqa: F401  (autouse fixture)
    right_padded,
    tiny_model,
    transformers,
)
from tests.kernel_markers import needs_interpreter

KEEP_PATTERNS = {"esa": ESA(1, 3, 5, 4), "tm": TriangleMix(sink=2, window=6, last_q=3),
                 "xa": XAttention(threshold=0.9, stride=4, block_size=16)}
"""The patterns that keep every key besides full heads (small sizes: ESA reads 5 keys spread over the second half
of the history, TriangleMix a window of 6)."""


def converted(kind: str, backend: str = "dense", ring: bool = True, **config):
    """A tiny Llama, every layer with one full KV head and one ``kind`` head; with ``ring``, layer 1 has a
    sink+window head (sink 2, window 300: its ring grows with a short generation) instead of its full one."""
    patterns = {"full": Causal(), kind: KEEP_PATTERNS[kind], "ssa": SinkWindow(2, 300)}
    modes = [["full", kind], [kind, "ssa"] if ring else ["full", kind], [kind, "full"]]
    return convert(tiny_model("llama", **config), patterns, modes, backend=backend, block_size=16)


def dynamic_cache_bytes(cache) -> int:
    return sum((layer.keys.numel() + layer.values.numel()) * layer.keys.element_size() for layer in cache.layers)


def forward_logits(model, ids, mask, cache):
    """Logits of ``ids`` (the last tokens of ``mask``) at the rotary positions generate() gives them."""
    positions = (mask.cumsum(-1) - 1).clamp(min=0)[:, -ids.shape[1]:]
    with torch.no_grad():
        return model(ids, attention_mask=mask, position_ids=positions, past_key_values=cache, use_cache=True).logits


# ----- the growth grid ---------------------------------------------------------------------------------------------

@settings(max_examples=300, deadline=None)
@given(st.integers(1, 1 << 24))
def test_grown_capacity_is_a_grid_within_one_sixteenth(tokens):
    capacity = grown_capacity(tokens)
    assert capacity >= tokens and capacity % 16 == 0
    assert grown_capacity(capacity) == capacity  # a grid point holds itself
    assert grown_capacity(tokens + 1) >= capacity  # monotone
    if tokens > 256:
        assert capacity - tokens < tokens / GROWTH_STEPS
    else:
        assert capacity - tokens < 16


@pytest.mark.parametrize("power", [8, 10, 16, 22])
def test_grown_capacity_has_sixteen_steps_per_power_of_two(power):
    first, last = (1 << power) + 1, 1 << (power + 1)
    step = max(16, (1 << power) // GROWTH_STEPS)
    capacities = {grown_capacity(n) for n in range(first, last + 1, max(1, step // 4))} | {grown_capacity(last)}
    assert len(capacities) == GROWTH_STEPS and max(capacities) == last


def test_grown_capacity_rejects_bad_input():
    with pytest.raises(ValueError, match="tokens"):
        grown_capacity(0)
    with pytest.raises(TypeError, match="tokens"):
        grown_capacity(2.5)


# ----- buffer sizes across a long generation -----------------------------------------------------------------------

def _step(model, cache, tokens: int, batch: int = 2) -> None:
    """One cache update of ``tokens`` tokens in every layer (the allocation policy only; no attention runs)."""
    key = torch.zeros(batch, KV_HEADS, tokens, HEAD_DIM)
    for index in range(LAYERS):
        cache.update(key, key, index)
        model.model.layers[index].self_attn.flexsparse.take_staged(key, key)


@pytest.mark.parametrize("kind", ["esa", "tm", "xa"])
@pytest.mark.parametrize("backend", ["dense", "flex"])
def test_buffers_across_a_long_generation(kind, backend):
    """A 100-token prompt and 3,000 decode steps in a cache of unknown final length: every buffer holds its tokens;
    past 256 tokens the cache allocates less than 1/16 above what it holds, every step (the compiled flex backend
    alike: no group here runs flex at decode); every-key buffers take exactly the grid's capacities (16 per
    doubling) and the ring (sink 2 + window 300) the same up to its 302 slots. With a known maximum length one
    allocation serves the whole generation and ends exactly full."""
    model = converted(kind, backend)
    cache = SparseKVCache(model)
    _step(model, cache, 100)
    seen = [[{store.capacity} for store in layer.stores] for layer in cache.layers]
    for step in range(3000):
        _step(model, cache, 1)
        tokens = 101 + step
        report = cache.memory_report()
        assert report.tokens == tokens
        assert report.used_bytes == kv_memory_formula(model, 2, tokens, torch.float32)
        assert report.allocated_bytes == cache.memory_bytes()
        if tokens > 256:
            assert report.overhead < 1 / GROWTH_STEPS, f"after {tokens} tokens"
        for layer, capacities in zip(cache.layers, seen):
            for store, found in zip(layer.stores, capacities):
                found.add(store.capacity)
                assert store.capacity >= min(tokens, store.fixed_size or tokens)
    grid = {grown_capacity(tokens) for tokens in range(100, 3101)}  # 67 capacities: 16 per doubling past 256
    for layer, capacities in zip(cache.layers, seen):
        for store, found in zip(layer.stores, capacities):
            assert found == ({c for c in grid if c < 302} | {302} if store.kind is StoreKind.RING else grid)
    assert cache.layers[1].stores[-1].kind is StoreKind.RING

    known = SparseKVCache(model, max_length=400)
    _step(model, known, 100)
    first = [store.keys for layer in known.layers for store in layer.stores]
    for _ in range(300):
        _step(model, known, 1)
    assert all(store.keys is keys for store, keys in zip((s for layer in known.layers for s in layer.stores), first))
    assert known.memory_report().overhead == 0.0
    assert known.memory_bytes() == kv_memory_formula(model, 2, 400, torch.float32)


def test_keep_heads_under_compiled_flex_keep_flex_buckets():
    """Patterns without a decode of their own (here a union) run every call through compiled flex: their
    capacities stay on its buckets (no copy per step), the one exception to the growth grid."""
    patterns = {"full": Causal(), "mix": SinkWindow(0, 3) | ESA(0, 1, 3, 4)}
    model = convert(tiny_model("llama"), patterns, [["full", "mix"]] * LAYERS, backend="flex", block_size=16)
    cache = SparseKVCache(model)
    _step(model, cache, 100)
    for _ in range(60):
        _step(model, cache, 1)
    layer = cache.layers[0]
    assert [(g.decoder.name if g.decoder else "plan", s.capacity) for g, s in zip(layer.groups, layer.stores)] == [
        ("sdpa", 160), ("plan", 256)]


# ----- memory against DynamicCache ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def dynamic_bytes():
    """Bytes of transformers' DynamicCache after generate(max_new_tokens=2) of the unconverted model, per prompt."""
    found = {}
    for length in (1100, 2100):
        ids = torch.randint(1, 90, (1, length), generator=torch.Generator().manual_seed(length))
        with torch.no_grad():
            out = tiny_model("llama", max_position_embeddings=4096).generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=2, min_new_tokens=2, do_sample=False,
                return_dict_in_generate=True)
        assert type(out.past_key_values) is transformers.DynamicCache
        found[length] = dynamic_cache_bytes(out.past_key_values)
    return found


@pytest.mark.parametrize("kind", ["esa", "tm", "xa"])
@pytest.mark.parametrize("length", [1100, 2100])
def test_memory_against_dynamic_cache(kind, length, dynamic_bytes):
    """The issue's measurement: one full and one ESA / TriangleMix / XAttention KV head per layer,
    generate(max_new_tokens=2): a SparseKVCache the user passes (no known length) holds at most 1.1x the
    DynamicCache's bytes (the grid: < 1/16 above the tokens held), generate()'s own exactly as many; both report
    the DynamicCache's bytes as used (every head keeps every token)."""
    model = converted(kind, ring=False, max_position_embeddings=4096)
    ids = torch.randint(1, 90, (1, length), generator=torch.Generator().manual_seed(length))
    for cache in (SparseKVCache(model), None):
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=2, min_new_tokens=2,
                                 do_sample=False, return_dict_in_generate=True, past_key_values=cache)
        cache = out.past_key_values
        assert isinstance(cache, SparseKVCache)
        report = cache.memory_report()
        assert report.tokens == length + 1
        assert report.used_bytes == kv_memory_formula(model, 1, length + 1, torch.float32) == dynamic_bytes[length]
        assert report.allocated_bytes <= 1.1 * dynamic_bytes[length]
        assert report.overhead < 1 / GROWTH_STEPS
    assert report.allocated_bytes == dynamic_bytes[length]  # generate()'s cache: sized for its maximum length


# ----- cached decode across capacity changes -----------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["esa", "tm", "xa"])
@pytest.mark.parametrize("layout", ["none", "left", "other"])
def test_teacher_forced_decode_equals_a_dynamic_cache_across_growth(kind, layout):
    """A 250-token prompt, then 40 one-token steps and a 5-token chunk through a cache of unknown length: its
    buffers grow (256 -> 272 -> 288 -> 304 slots) during the steps. Every logit equals the same model's with
    transformers' DynamicCache (whose decode runs each head's own pattern over every key: the reference of
    XAttention's and TriangleMix's full-attention decode and of ESA's gather), without padding, after a
    left-padded prompt and with a right-padded one (the masked path)."""
    model = converted(kind)
    lengths = [250, 250] if layout == "none" else [250, 231]
    ids, mask = (right_padded if layout == "other" else left_padded)(lengths)
    extra = torch.randint(1, 90, (2, 45), generator=torch.Generator().manual_seed(3))
    ids, mask = torch.cat([ids, extra], 1), torch.cat([mask, torch.ones_like(extra)], 1)
    sparse, dynamic = SparseKVCache(model), transformers.DynamicCache()
    pieces = {"sparse": [], "dynamic": []}
    capacities = set()
    for start, stop in [(0, 250)] + [(t, t + 1) for t in range(250, 290)] + [(290, 295)]:
        for name, cache in (("sparse", sparse), ("dynamic", dynamic)):
            pieces[name].append(forward_logits(model, ids[:, start:stop], mask[:, :stop], cache))
        capacities.add(sparse.layers[0].stores[0].capacity)
    assert capacities == {256, 272, 288, 304}
    real = mask.bool()
    got, expected = torch.cat(pieces["sparse"], 1)[real], torch.cat(pieces["dynamic"], 1)[real]
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)


@pytest.mark.parametrize("kind", ["esa", "tm", "xa"])
def test_greedy_generation_across_growth(kind):
    """generate() with a SparseKVCache of unknown length (its buffers grow during the generation) gives the
    tokens of generate() with a DynamicCache, and for ESA (whose cached decode is a recompute of the prefix) of
    generate() without a cache."""
    model = converted(kind)
    ids, mask = left_padded([250, 241])
    tokens = greedy(model, ids, mask, 30, past_key_values=SparseKVCache(model))
    assert torch.equal(tokens, greedy(model, ids, mask, 30, past_key_values=transformers.DynamicCache()))
    if kind == "esa":
        assert torch.equal(tokens, greedy(model, ids, mask, 30, use_cache=False))


@needs_interpreter
@pytest.mark.parametrize("kind", ["tm", "xa"])
def test_one_launch_decode_serves_full_and_full_decoding_heads(kind, monkeypatch):
    """TriangleMix and XAttention heads share the full heads' buffer, so a layer of them and full heads (and a
    sink+window ring) decodes in one kernel call per step (here in the Triton interpreter), equal to a
    DynamicCache's decode across a growth of the buffers."""
    from flexsparse.kernels.decode import DecodeStep

    calls = []
    step_kernel = DecodeStep.__call__

    def counted_step(*args, **kwargs):
        calls.append(1)
        return step_kernel(*args, **kwargs)

    monkeypatch.setattr(DecodeStep, "__call__", counted_step)
    model = converted(kind)
    ids, mask = left_padded([30, 22])
    extra = torch.randint(1, 90, (2, 6), generator=torch.Generator().manual_seed(4))
    ids, mask = torch.cat([ids, extra], 1), torch.cat([mask, torch.ones_like(extra)], 1)
    sparse, dynamic = SparseKVCache(model, one_launch_decode=True), transformers.DynamicCache()
    assert [len(layer.stores) for layer in sparse.layers] == [1, 2, 1]
    got, expected = [], []
    for start, stop in [(0, 30)] + [(t, t + 1) for t in range(30, 36)]:
        got.append(forward_logits(model, ids[:, start:stop], mask[:, :stop], sparse))
        expected.append(forward_logits(model, ids[:, start:stop], mask[:, :stop], dynamic))
    assert sparse.layers[0].stores[0].capacity == 48  # grew from 32 at token 33
    assert len(calls) == 6 * LAYERS
    real = mask.bool()
    torch.testing.assert_close(torch.cat(got, 1)[real], torch.cat(expected, 1)[real], atol=1e-4, rtol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["esa", "tm", "xa"])
@pytest.mark.parametrize("layout", ["none", "left", "other"])
def test_gpu_decode_of_every_key_heads_has_no_host_sync(kind, layout):
    """ESA heads (their kernel), TriangleMix and XAttention heads (with the full ones) and the ring decode one
    token without a host sync in any padding layout; the only sync of a forward is whether its new tokens hold
    padding, read once for all layers."""
    model = converted(kind).cuda()
    lengths = [40, 40] if layout == "none" else [40, 29]
    ids, mask = (right_padded if layout == "other" else left_padded)(lengths)
    ids, mask = ids.cuda(), mask.cuda()
    cache = SparseKVCache(model)
    forward_logits(model, ids, mask, cache)
    layer = model.model.layers[1].self_attn
    for step in range(3):  # the first decode step builds what later steps reuse (plans, index tensors)
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], 1)
        q = torch.randn(2, 4, 1, HEAD_DIM, device="cuda")
        key = torch.randn(2, KV_HEADS, 1, HEAD_DIM, device="cuda")
        past = cache.get_seq_length(1)
        forward = flexsparse_mask(2, 1, past + 1, q_offset=past, attention_mask=mask, device="cuda")
        cache.update(key, key, 1)
        forward.new_tokens_padded()
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error" if step else "default")
        try:
            flexsparse_attention(layer, q, key, key, forward)
        finally:
            torch.cuda.set_sync_debug_mode("default")
