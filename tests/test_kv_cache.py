"""flexsparse's sparse KV cache: ring slots against a step-by-step simulation, memory against the formula and
DynamicCache, buffer capacities, chunked prefill, right padding, growth, errors (tiny random Llama, fp32, CPU)."""

import pytest
import torch

from flexsparse.integrations import SparseKVCache, convert, kv_memory_formula
from flexsparse.integrations.forward_mask import ForwardMask
from flexsparse.cache import ring_slot_of, ring_slot_positions
from flexsparse.integrations.transformers import flexsparse_attention, flexsparse_mask
from flexsparse.masks import ESA, Causal, SinkWindow, TriangleMix
from tests.hf_util import (
    HEAD_DIM,
    KV_HEADS,
    LAYERS,
    MIXED,
    PATTERNS,
    greedy,
    left_padded,
    one_thread,  # noqa: F401  (autouse fixture)
    right_padded,
    tiny_model,
    transformers,
)
from tests.kernel_markers import needs_interpreter


@pytest.mark.parametrize("sink, window", [(0, 1), (0, 4), (2, 3), (3, 5), (4, 1)])
def test_ring_slots_match_a_step_by_step_ring(sink, window):
    """Write positions 0, 1, 2, ... into a simulated ring: every slot holds what the closed form says."""
    capacity, span = sink + window, 1000
    ring = [span] * capacity
    for written in range(0, 40):
        table = ring_slot_positions(torch.tensor([written]), sink, window, capacity, span)[0].tolist()
        assert table == ring, f"after {written} tokens"
        ring[int(ring_slot_of(torch.tensor(written), sink, window))] = written
        held = sorted(p for p in ring if p != span)
        expected = sorted(set(range(min(sink, written + 1))) | set(range(max(0, written + 1 - window), written + 1)))
        assert held == expected  # exactly the keys SinkWindow attends from position `written`


def test_ring_slots_of_a_shorter_generation():
    """Capacity below sink + window (a generation that never fills the window): identity slots."""
    table = ring_slot_positions(torch.tensor([0, 3, 5]), 2, 6, 5, 99)
    assert table.tolist() == [[99] * 5, [0, 1, 2, 99, 99], [0, 1, 2, 3, 4]]


def dynamic_cache_bytes(cache) -> int:
    return sum((layer.keys.numel() + layer.values.numel()) * layer.keys.element_size() for layer in cache.layers)


def generate_cache(model, ids, mask, new_tokens):
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                             do_sample=False, return_dict_in_generate=True)
    return out.past_key_values


@pytest.mark.parametrize("new_tokens", [3, 20])
def test_cache_memory_equals_the_formula(new_tokens):
    """generate() sizes the cache for its maximum length S = prompt + new - 1: memory is the formula exactly."""
    model = convert(tiny_model("llama"), PATTERNS, MIXED, backend="dense")
    ids, mask = left_padded([4, 7])
    cache = generate_cache(model, ids, mask, new_tokens)
    length = ids.shape[1] + new_tokens - 1
    heads_kept = (length + min(length, 8)) + 2 * min(length, 5) + (min(length, 8) + length)
    assert cache.memory_bytes() == 2 * 2 * HEAD_DIM * 4 * heads_kept
    assert cache.memory_bytes() == kv_memory_formula(model, 2, length, torch.float32)


def test_all_full_cache_has_the_size_of_dynamic_cache():
    ids, mask = left_padded([6, 9])
    dynamic = generate_cache(tiny_model("llama"), ids, mask, 11)
    assert type(dynamic) is transformers.DynamicCache
    model = convert(tiny_model("llama"), PATTERNS, [["full"] * KV_HEADS] * LAYERS, backend="dense")
    sparse = generate_cache(model, ids, mask, 11)
    assert isinstance(sparse, SparseKVCache)
    assert sparse.memory_bytes() == dynamic_cache_bytes(dynamic)


def test_buffer_capacities():
    """A known maximum length: every buffer holds exactly that (rings at most sink + window). Without one: the
    growth grid, rings capped at sink + window. Only heads no executor decodes (here a union), whose store the
    plan reads whole under compiled flex, take flex buckets (block_size x 2^k). Full, ESA and TriangleMix heads keep every key alike."""
    esa = ESA(0, 1, 3, 4)
    patterns = {**PATTERNS, "esa": esa, "tm": TriangleMix(1, 4, 2), "mix": SinkWindow(0, 3) | esa}
    model = convert(tiny_model("llama"), patterns, [["full", "esa"], ["ssa", "mix"], ["tm", "ssa2"]],
                    block_size=16, backend="flex")  # no forward runs: only the allocation policy
    described = [[(g.store_kind.value, g.decoder.name if g.decoder else "plan") for g in layer.flexsparse.groups]
                 for layer in (m.self_attn for m in model.model.layers)]
    assert described == [[("every key", "sdpa"), ("every key", "esa")], [("every key", "plan"), ("ring", "sdpa")],
                         [("every key", "sdpa"), ("ring", "sdpa")]]
    key = torch.zeros(2, KV_HEADS, 7, HEAD_DIM)

    def capacities(cache):
        for index in range(LAYERS):
            cache.update(key, key, index)
            model.model.layers[index].self_attn.flexsparse.take_staged(key, key)
        return [[store.capacity for store in layer.stores] for layer in cache.layers]

    assert capacities(SparseKVCache(model, max_length=40)) == [[40, 40], [64, 8], [40, 5]]
    assert capacities(SparseKVCache(model, max_length=4)) == [[7, 7], [16, 7], [7, 5]]
    grown = SparseKVCache(model)  # unknown length: the growth grid (multiples of 16 below 512 tokens)
    assert capacities(grown) == [[16, 16], [16, 8], [16, 5]]
    assert capacities(grown) == [[16, 16], [16, 8], [16, 5]]
    assert capacities(grown) == [[32, 32], [32, 8], [32, 5]]


def forward_logits(model, ids, mask, cache=None):
    """Logits of ``ids`` (the last tokens of ``mask``), at the rotary positions generate() gives them."""
    positions = (mask.cumsum(-1) - 1).clamp(min=0)[:, -ids.shape[1]:]
    with torch.no_grad():
        return model(ids, attention_mask=mask, position_ids=positions, past_key_values=cache,
                     use_cache=cache is not None).logits


@pytest.mark.parametrize("chunks", [[5, 9, 1, 1, 3], [1, 12, 1, 2], [14, 1, 1, 1, 1]])
def test_chunked_prefill_and_decode_equal_one_forward(chunks):
    """Chunks longer and shorter than the window (keys evicted inside a chunk), left padding, ESA heads."""
    patterns = {**PATTERNS, "esa": ESA(0, 1, 3, 4)}
    model = convert(tiny_model("llama"), patterns, [["full", "ssa"], ["esa", "ssa2"], ["ssa", "ssa"]],
                    backend="dense")
    ids, mask = left_padded([sum(chunks), sum(chunks) - 4])
    expected = forward_logits(model, ids, mask)
    cache, start, pieces = SparseKVCache(model), 0, []
    for size in chunks:
        pieces.append(forward_logits(model, ids[:, start:start + size], mask[:, :start + size], cache))
        start += size
    real = mask.bool()
    torch.testing.assert_close(torch.cat(pieces, 1)[real], expected[real], atol=1e-4, rtol=0)


def test_ring_grows_past_a_given_max_length():
    model = convert(tiny_model("llama"), PATTERNS, MIXED, backend="dense")
    ids, mask = left_padded([12])
    expected = forward_logits(model, ids, mask)
    cache = SparseKVCache(model, max_length=3)
    pieces = [forward_logits(model, ids[:, :3], mask[:, :3], cache)]
    pieces += [forward_logits(model, ids[:, t:t + 1], mask[:, :t + 1], cache) for t in range(3, 12)]
    torch.testing.assert_close(torch.cat(pieces, 1), expected, atol=1e-4, rtol=0)
    assert [[s.capacity for s in layer.stores] for layer in cache.layers] == [[16, 8], [5], [16, 8]]


def test_right_padded_decode_equals_each_sequence_alone():
    """Decode after a right-padded prompt: the padding stays in the cache between real tokens."""
    model = convert(tiny_model("llama"), PATTERNS, MIXED, backend="dense")
    lengths = [11, 4]
    ids, mask = right_padded(lengths)
    cache = SparseKVCache(model)
    step_logits = forward_logits(model, ids, mask, cache)
    last = mask.sum(-1) - 1
    tokens = [step_logits[torch.arange(2), last].argmax(-1)]
    for _ in range(15):
        mask = torch.cat([mask, torch.ones(2, 1, dtype=mask.dtype)], 1)
        tokens.append(forward_logits(model, tokens[-1][:, None], mask, cache)[:, -1].argmax(-1))
    batched = torch.stack(tokens, 1)
    for row, n in enumerate(lengths):
        alone = greedy(model, ids[row:row + 1, :n], None, 16)
        assert torch.equal(batched[row], alone[0]), f"sequence {row}"


def test_a_padding_token_in_decode_keeps_the_ring_intact():
    model = convert(tiny_model("llama"), PATTERNS, MIXED, backend="dense")
    ids, mask = left_padded([12])
    cache = SparseKVCache(model)
    forward_logits(model, ids[:, :9], mask[:, :9], cache)
    holes = torch.cat([mask[:, :9], torch.zeros(1, 1, dtype=mask.dtype)], 1)
    forward_logits(model, ids[:, 9:10], holes, cache)  # a padding token: written where nothing real is lost
    rest = [forward_logits(model, ids[:, t:t + 1], torch.cat([holes, mask[:, 9:t + 1]], 1), cache)
            for t in range(9, 12)]
    alone = forward_logits(model, ids, mask)
    torch.testing.assert_close(torch.cat(rest, 1), alone[:, 9:12], atol=1e-4, rtol=0)


def test_cache_errors():
    model = convert(tiny_model("llama"), PATTERNS, MIXED, backend="dense")
    ids, mask = left_padded([6])
    cache = SparseKVCache(model)
    forward_logits(model, ids, mask, cache)
    with pytest.raises(NotImplementedError, match="cannot be cropped"):
        cache.crop(2)
    convert(model, PATTERNS, [["full", "full"], ["ssa2", "ssa2"], ["ssa", "full"]], backend="dense")
    with pytest.raises(ValueError, match=r"layer 0 .*built for an earlier conversion"):
        forward_logits(model, ids[:, :1], torch.ones(1, 7, dtype=torch.long), cache)
    key = torch.zeros(1, KV_HEADS, 1, HEAD_DIM)
    fresh = SparseKVCache(model)
    fresh.update(key, key, 0)
    with pytest.raises(ValueError, match="updated twice without an attention call"):
        fresh.update(key, key, 0)
    layer = model.model.layers[1].self_attn
    fresh.update(key, key, 1)
    with pytest.raises(ValueError, match="other keys or values than the sparse KV cache's update returned"):
        flexsparse_attention(layer, torch.zeros(1, 4, 1, HEAD_DIM), key.clone(), key, None)
    with pytest.raises(TypeError, match="one_launch_decode must be a bool or None"):
        SparseKVCache(model, one_launch_decode="yes")


def test_forward_mask_positions():
    padding = torch.tensor([[False, True, True, True], [True, True, True, True]])
    mask = flexsparse_mask(2, 2, 4, q_offset=2, attention_mask=padding)
    positions = mask.positions()
    assert positions.kv.tolist() == [[4, 0, 1, 2], [0, 1, 2, 3]] and positions.q.tolist() == [[1, 2], [2, 3]]
    assert mask.real_counts(2).tolist() == [1, 2] and mask.new_positions().tolist() == [[1, 2], [2, 3]]
    assert mask.positions_in(8).kv.tolist() == [[4, 0, 1, 2, 4, 4, 4, 4], [0, 1, 2, 3, 4, 4, 4, 4]]
    assert ForwardMask(None, 2, 3, 3, "cpu").positions() is None  # contiguous prefill: no tables
    assert flexsparse_mask(2, 2, 4, attention_mask=padding).positions().q.tolist() == [[1, 2], [2, 3]]  # last slots
    static = flexsparse_mask(1, 1, 6, q_offset=3, attention_mask=torch.ones(1, 4, dtype=torch.long))
    assert static.padding.tolist() == [[True] * 4 + [False] * 2]  # a static cache's empty slots
    assert static.positions().q.tolist() == [[3]] and static.positions().kv.tolist() == [[0, 1, 2, 3, 6, 6]]


@pytest.mark.gpu
@pytest.mark.parametrize("one_launch", [False, True])
def test_gpu_decode_step_has_no_host_sync(one_launch):
    """A left-padded batch's decode step (ranged kernel per group, or the one-launch step kernel, for full and
    ring heads) syncs nothing per layer: the only sync of a forward is whether its new tokens hold padding, read
    once for all layers."""
    model = convert(tiny_model("llama").cuda(), PATTERNS, MIXED, backend="flex")
    ids, mask = left_padded([20, 9])
    ids, mask = ids.cuda(), mask.cuda()
    cache = SparseKVCache(model, max_length=64, one_launch_decode=one_launch)
    forward_logits(model, ids, mask, cache)
    mask = torch.cat([mask, torch.ones_like(mask[:, :1])], 1)
    layer = model.model.layers[0].self_attn
    for step in range(3):  # the first decode step builds what later steps reuse (plans, index tensors)
        q = torch.randn(2, 4, 1, HEAD_DIM, device="cuda")
        key = torch.randn(2, KV_HEADS, 1, HEAD_DIM, device="cuda")
        past = cache.get_seq_length(0)
        forward = flexsparse_mask(2, 1, past + 1, q_offset=past, attention_mask=mask, device="cuda")
        cache.update(key, key, 0)
        forward.new_tokens_padded()  # the forward's one host sync (its first layer reads it for every layer)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error" if step else "default")
        try:
            flexsparse_attention(layer, q, key, key, forward)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], 1)


def test_qwen3_8b_like_cache_at_128k_is_3_8x_smaller():
    """The issue's shapes (32 / 8 heads, d = 128, bf16, 2 full + 6 sink 128 + window 2048 KV heads) at 131,072
    tokens, allocated on the meta device: the buffers the cache really allocates, without the memory."""
    config = transformers.LlamaConfig(vocab_size=16, hidden_size=4096, intermediate_size=16, num_hidden_layers=1,
                                      num_attention_heads=32, num_key_value_heads=8, head_dim=128)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    convert(model, {"full": Causal(), "ssa": SinkWindow(128, 2048)}, [["full"] * 2 + ["ssa"] * 6])
    seq = 131072
    keys = torch.empty(1, 8, seq, 128, dtype=torch.bfloat16, device="meta")
    cache = SparseKVCache(model, max_length=seq)
    cache.update(keys, keys, 0)
    model.model.layers[0].self_attn.flexsparse.take_staged(keys, keys)
    all_full = 2 * 8 * seq * 128 * 2
    assert cache.memory_bytes() == kv_memory_formula(model, 1, seq, torch.bfloat16) == 2 * 128 * 2 * (2 * seq + 6 * 2176)
    assert all_full / cache.memory_bytes() == pytest.approx(3.81, abs=0.005)


@pytest.mark.parametrize("one_launch", [pytest.param(True, marks=needs_interpreter), False, None],
                         ids=["one-launch", "per-group", "default"])
@pytest.mark.parametrize("layout", ["none", "left", "other"])
def test_decode_path_follows_the_padding_layout(layout, one_launch, monkeypatch):
    """Full and ring heads decode without masks while the cache holds no padding (SDPA over the filled slots) or
    a left-padded prompt (the ranged kernel, one slot range per sequence), and through position masks for other
    padding; the logits equal the uncached model's in every case (the rings wrap around during the steps), with
    the one-launch step kernel (here in the Triton interpreter) and with a call per group. The default (None) runs
    the step kernel on CUDA only, so on the CPU it takes the per-group path even under the interpreter."""
    import flexsparse.integrations.kv_cache as kv_cache
    from flexsparse.kernels import decode

    calls = []
    original = kv_cache.SparseKVLayer.attend

    def spy(self, q, key, value, mask, scale):
        out = original(self, q, key, value, mask, scale)
        calls.append(self.layout.value)
        return out

    def cuda_only(*args, **kwargs):
        raise AssertionError("the CUDA decode kernel was called on CPU tensors (it needs the interpreter there)")

    step_calls = []
    step_kernel = decode.DecodeStep.__call__

    def counted_step(*args, **kwargs):
        step_calls.append(1)
        return step_kernel(*args, **kwargs)

    monkeypatch.setattr(kv_cache.SparseKVLayer, "attend", spy)
    monkeypatch.setattr(decode, "ranged_decode_attention", cuda_only)
    monkeypatch.setattr(decode.DecodeStep, "__call__", counted_step)
    model = convert(tiny_model("llama"), PATTERNS, MIXED, backend="dense")
    ids, mask = {"none": left_padded([14, 14]), "left": left_padded([14, 10]), "other": right_padded([14, 6])}[layout]
    cache = SparseKVCache(model, one_launch_decode=one_launch)
    forward_logits(model, ids[:, :8], mask[:, :8], cache)
    steps = [forward_logits(model, ids[:, t:t + 1], mask[:, :t + 1], cache) for t in range(8, 14)]
    alone = forward_logits(model, ids, mask)
    real = mask[:, 8:14].bool()
    torch.testing.assert_close(torch.cat(steps, 1)[real], alone[:, 8:14][real], atol=1e-4, rtol=0)
    assert set(calls) == {layout}
    assert bool(step_calls) == (one_launch is True and layout != "other")


@needs_interpreter
def test_generate_with_a_one_launch_cache_passed_by_the_user(monkeypatch):
    """generate() keeps a SparseKVCache the user passes (here with the one-launch decode step, in the Triton
    interpreter): the same greedy tokens as the cache generate() builds, the step kernel called every step."""
    from flexsparse.kernels import decode

    model = convert(tiny_model("llama"), PATTERNS, MIXED, backend="dense")
    ids, mask = left_padded([13, 8])
    expected = greedy(model, ids, mask, 12)
    calls = []
    step_kernel = decode.DecodeStep.__call__

    def counted_step(*args, **kwargs):
        calls.append(1)
        return step_kernel(*args, **kwargs)

    monkeypatch.setattr(decode.DecodeStep, "__call__", counted_step)
    got = greedy(model, ids, mask, 12, past_key_values=SparseKVCache(model, one_launch_decode=True))
    assert torch.equal(got, expected)
    assert len(calls) == 11 * LAYERS  # every decode step of every layer (MIXED: at most two groups per layer)
