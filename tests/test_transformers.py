"""flexsparse.convert on tiny random transformers models (Llama, Qwen3 with q/k norms, Mistral), fp32 on CPU.

All-full heads give the model's own sdpa logits (atol 1e-4), padded batches too; mixed modes generate with the
sparse KV cache the tokens of a full recompute through HybridAttention at every step (use_cache=False); padded
batches give each sequence its own logits and tokens; errors name the layer and head; configurations round-trip.
The CPU tests run the dense backend (masked SDPA on the patterns' dense references, the fastest on CPU at these
sizes) and one flex_eager run; GPU tests (marked gpu) run compiled flex.
"""

import json

import pytest
import torch
from torch import nn

from flexsparse.integrations import (
    SparseKVCache,
    cache_argument,
    convert,
    is_converted,
    kv_memory_formula,
    layer_modes,
    load_config,
    revert,
    save_config,
    sparse_generate_cache,
)
from flexsparse.masks import ESA, Causal, SinkWindow, TriangleMix
from tests.hf_util import (
    KV_HEADS,
    LAYERS,
    PATTERNS,
    greedy,
    kv_tensor_bytes,
    left_padded,
    one_thread,  # noqa: F401  (autouse fixture)
    returned_cache,
    right_padded,
    tiny_model,
    transformers,
)

MODELS = ["llama", "qwen3", "mistral"]
ALL_FULL = [["full"] * KV_HEADS] * LAYERS
MIXED = [["full", "ssa"], ["ssa2", "esa"], ["ssa", "ssa"]]  # per layer and head; layers 1 and 2 have no full head


def mixed_patterns():
    """Shared patterns plus a per-layer ESA (it keeps every key in the cache)."""
    return [{**PATTERNS, "esa": ESA(layer, LAYERS, 3, 4)} for layer in range(LAYERS)]


def logits(model, ids, mask=None):
    with torch.no_grad():
        return model(ids, attention_mask=mask).logits


@pytest.mark.parametrize("kind", MODELS)
@pytest.mark.parametrize("padding", ["none", "left", "right"])
def test_all_full_logits_equal_the_models_own_sdpa(kind, padding):
    model = tiny_model(kind)
    lengths = [13, 13] if padding == "none" else [13, 7]
    ids, mask = (left_padded if padding != "right" else right_padded)(lengths)
    expected = logits(model, ids, mask)
    convert(model, PATTERNS, ALL_FULL, backend="dense")
    assert model.config._attn_implementation == "flexsparse"
    real = mask.bool()
    torch.testing.assert_close(logits(model, ids, mask)[real], expected[real], atol=1e-4, rtol=0)


def test_all_full_flex_eager_and_split_plan_equal_sdpa():
    model = tiny_model("llama")
    ids, mask = left_padded([11, 6])
    expected = logits(model, ids, mask)
    convert(model, PATTERNS, ALL_FULL, backend="flex_eager", plan="split")
    real = mask.bool()
    torch.testing.assert_close(logits(model, ids, mask)[real], expected[real], atol=1e-4, rtol=0)


@pytest.mark.parametrize("pad", [left_padded, right_padded])
def test_padded_batch_logits_equal_each_sequence_alone(pad):
    model = convert(tiny_model("qwen3"), mixed_patterns(), MIXED, backend="dense")
    lengths = [17, 5, 11]
    ids, mask = pad(lengths)
    batched = logits(model, ids, mask)
    for row, n in enumerate(lengths):
        real = mask[row].bool()
        alone = logits(model, ids[row:row + 1, real])
        torch.testing.assert_close(batched[row, real], alone[0], atol=1e-4, rtol=0)


def test_training_gradients_through_all_full_heads_equal_sdpa():
    """backend="auto" on CPU with gradients runs the dense executor: the model's gradients are sdpa's."""
    ids, mask = left_padded([10, 6])
    grads = []
    for converted in (False, True):
        model = tiny_model("llama").train()
        if converted:
            convert(model, PATTERNS, ALL_FULL)
        labels = ids.masked_fill(mask == 0, -100)
        model(ids, attention_mask=mask, labels=labels, use_cache=False).loss.backward()
        grads.append(model.model.layers[1].self_attn.q_proj.weight.grad)
    torch.testing.assert_close(grads[1], grads[0], atol=1e-5, rtol=1e-4)


def test_the_patterns_change_the_output():
    """Guard for the tests above and below: the mixed modes are not the full model in disguise."""
    model = tiny_model("llama")
    ids, _ = left_padded([20])
    full = logits(model, ids)
    convert(model, mixed_patterns(), MIXED, backend="dense")
    assert (logits(model, ids) - full).abs().max() > 1e-2


@pytest.mark.parametrize("kind", MODELS)
def test_sparse_cache_generation_equals_full_recompute(kind):
    """Left-padded prompts of 5 and 20 tokens (shorter / longer than sink + window = 8), 32 new tokens."""
    model = convert(tiny_model(kind), mixed_patterns(), MIXED, backend="dense")
    ids, mask = left_padded([5, 20])
    with torch.no_grad():
        cached = model.generate(ids, attention_mask=mask, max_new_tokens=32, min_new_tokens=32, do_sample=False,
                                return_dict_in_generate=True, output_logits=True)
        recomputed = model.generate(ids, attention_mask=mask, max_new_tokens=32, min_new_tokens=32,
                                    do_sample=False, use_cache=False, return_dict_in_generate=True,
                                    output_logits=True)
    assert isinstance(returned_cache(cached), SparseKVCache)
    assert torch.equal(cached.sequences, recomputed.sequences)
    torch.testing.assert_close(torch.stack(cached.logits), torch.stack(recomputed.logits), atol=1e-4, rtol=0)


def generated_cache(model, ids, mask, new_tokens: int, **kwargs):
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                             do_sample=False, return_dict_in_generate=True, **kwargs)
    return returned_cache(out)


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_generate_keeps_fewer_kv_bytes_than_the_all_full_cache(kind):
    """Whatever the transformers version (CI runs the newest and 5.17), a converted model's generate() holds
    its keys in the sparse cache: the bytes of the tensors the returned cache holds equal the formula for the
    mixed modes (prompt 20 + 23 new - 1 = 42 tokens) and are below those of the all-full model's cache, which
    equal transformers' own DynamicCache."""
    ids, mask = left_padded([20, 12])
    own = generated_cache(tiny_model(kind), ids, mask, 23)
    all_full = generated_cache(convert(tiny_model(kind), PATTERNS, ALL_FULL, backend="dense"), ids, mask, 23)
    model = convert(tiny_model(kind), mixed_patterns(), MIXED, backend="dense")
    mixed = generated_cache(model, ids, mask, 23)
    assert type(own) is transformers.DynamicCache and isinstance(mixed, SparseKVCache)
    assert kv_tensor_bytes(all_full) == kv_tensor_bytes(own)
    assert kv_tensor_bytes(mixed) == kv_memory_formula(model, 2, 42, torch.float32) < kv_tensor_bytes(all_full)


def test_generate_with_the_default_length_uses_the_sparse_cache():
    """Without max_new_tokens or max_length (transformers' default length) the cache is built without a length
    and grows: the same tokens as a recompute."""
    model = convert(tiny_model("llama"), PATTERNS, [["full", "ssa"]] * LAYERS, backend="dense")
    ids, mask = left_padded([9, 5])
    model.generation_config.do_sample = False
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, return_dict_in_generate=True)
        again = model.generate(ids, attention_mask=mask, use_cache=False)
    assert isinstance(returned_cache(out), SparseKVCache) and torch.equal(out.sequences, again)


def test_sparse_cache_generation_with_interleaved_head_groups():
    """Four KV heads alternating full / sink+window: the groups are not contiguous head ranges."""
    model = tiny_model("llama", num_attention_heads=8, num_key_value_heads=4, hidden_size=128)
    modes = [["full", "ssa", "full", "ssa2"], ["ssa", "full", "ssa", "full"], ["ssa2", "ssa", "ssa2", "ssa"]]
    convert(model, PATTERNS, modes, backend="dense")
    ids, mask = left_padded([6, 17])
    assert torch.equal(greedy(model, ids, mask, 32), greedy(model, ids, mask, 32, use_cache=False))


def test_sparse_cache_generation_on_the_flex_eager_backend():
    """The flex executors (eager flex_attention is slow on CPU: fewer tokens)."""
    model = convert(tiny_model("llama"), mixed_patterns(), MIXED, backend="flex_eager")
    ids, mask = left_padded([3, 10])
    assert torch.equal(greedy(model, ids, mask, 10), greedy(model, ids, mask, 10, use_cache=False))


def test_left_padded_generation_equals_each_sequence_alone():
    model = convert(tiny_model("mistral"), mixed_patterns(), MIXED, backend="dense")
    lengths = [19, 3, 9]
    ids, mask = left_padded(lengths)
    batched = greedy(model, ids, mask, 32)
    for row, n in enumerate(lengths):
        alone = greedy(model, ids[row:row + 1, -n:], mask[row:row + 1, -n:], 32)
        assert torch.equal(batched[row], alone[0]), f"sequence {row}"


def test_greedy_beam_search_with_the_sparse_cache_equals_recompute():
    model = convert(tiny_model("llama"), PATTERNS, [["full", "ssa"], ["ssa", "ssa2"], ["ssa", "full"]],
                    backend="dense")
    ids, mask = left_padded([10, 6])
    kwargs = dict(num_beams=2, num_return_sequences=2)
    assert torch.equal(greedy(model, ids, mask, 12, **kwargs), greedy(model, ids, mask, 12, use_cache=False, **kwargs))


def test_a_dynamic_cache_still_works_on_a_converted_model():
    """Given a DynamicCache, every head keeps every key and decode reads the whole prefix."""
    model = convert(tiny_model("llama"), PATTERNS, [["full", "ssa"], ["ssa", "ssa2"], ["ssa", "full"]],
                    backend="dense")
    ids, mask = left_padded([9, 14])
    dynamic = greedy(model, ids, mask, 16, **{cache_argument(model): transformers.DynamicCache()})
    assert torch.equal(dynamic, greedy(model, ids, mask, 16))


def test_generate_calls_the_sparse_cache_cannot_serve_say_what_to_pass():
    """Assisted generation crops the cache: refused, naming the DynamicCache to pass, with which prompt-lookup
    decoding gives the greedy tokens. Another dynamic cache_implementation is honoured with a warning; a cache
    the caller passes is kept."""
    model = convert(tiny_model("llama"), PATTERNS, [["full", "ssa"], ["ssa", "ssa2"], ["ssa", "full"]],
                    backend="dense")
    ids, mask = left_padded([11])  # assisted generation takes one sequence
    name = cache_argument(model)
    expected = greedy(model, ids, mask, 8)
    with pytest.raises(ValueError, match=rf"assisted generation .* pass {name}=transformers.DynamicCache\(\)"):
        greedy(model, ids, mask, 8, prompt_lookup_num_tokens=3)
    with pytest.raises(ValueError, match="assisted generation"):
        greedy(model, ids, mask, 8, assistant_model=tiny_model("llama", seed=1))
    looked_up = greedy(model, ids, mask, 8, prompt_lookup_num_tokens=3, **{name: transformers.DynamicCache()})
    assert torch.equal(looked_up, expected)
    with pytest.warns(UserWarning, match="every head of the converted model keeps every key"):  # (needs CUDA)
        assert sparse_generate_cache(model, ids, max_new_tokens=4, cache_implementation="offloaded") is None
    with pytest.raises(ValueError, match=rf"cache_implementation='static'.*{name}=transformers.DynamicCache"):
        greedy(model, ids, mask, 4, cache_implementation="static")
    assert sparse_generate_cache(model, ids, max_new_tokens=4, use_cache=False) is None
    mine = SparseKVCache(model)
    assert generated_cache(model, ids, mask, 4, **{name: mine}) is mine


def test_a_static_cache_in_direct_calls_and_its_refusal_in_generate():
    """A static cache keeps every key; its queries sit before its empty slots. generate() prepares 4-D masks for
    it, which flexsparse refuses clearly."""
    model = convert(tiny_model("llama"), mixed_patterns(), MIXED, backend="dense")
    ids, mask = left_padded([12, 7])
    expected = logits(model, ids, mask)
    cache = transformers.StaticCache(config=model.config, max_cache_len=24)
    with torch.no_grad():
        pieces = [model(ids[:, :8], attention_mask=mask[:, :8], **{cache_argument(model): cache}).logits]
        pieces += [model(ids[:, t:t + 1], attention_mask=mask[:, :t + 1], **{cache_argument(model): cache}).logits
                   for t in range(8, 12)]
    real = mask.bool()
    torch.testing.assert_close(torch.cat(pieces, 1)[real], expected[real], atol=1e-4, rtol=0)
    with pytest.raises(ValueError, match="static"):
        greedy(model, ids, mask, 4, cache_implementation="static")


def test_revert_restores_the_models_attention():
    model = tiny_model("llama")
    ids, mask = left_padded([8, 12])
    before = logits(model, ids, mask)
    convert(model, mixed_patterns(), MIXED, backend="dense")
    assert is_converted(model) and layer_modes(model) == MIXED
    assert hasattr(model.model.layers[0].self_attn, "flexsparse")
    revert(model)
    assert not is_converted(model) and model.config._attn_implementation == "sdpa"
    assert not hasattr(model.model.layers[0].self_attn, "flexsparse")
    assert "generate" not in model.__dict__
    torch.testing.assert_close(logits(model, ids, mask), before, atol=0, rtol=0)
    assert type(generated_cache(model, ids, mask, 2)) is transformers.DynamicCache
    with pytest.raises(ValueError, match="not converted"):
        revert(model)


def test_other_instances_of_the_class_are_untouched():
    converted, other = tiny_model("llama"), tiny_model("llama", seed=1)
    convert(converted, PATTERNS, ALL_FULL, backend="dense")
    ids, mask = left_padded([6])
    assert type(generated_cache(other, ids, mask, 2)) is transformers.DynamicCache
    assert other.config._attn_implementation == "sdpa"


def test_save_and_load_config_round_trip(tmp_path):
    model = convert(tiny_model("qwen3"), mixed_patterns(), MIXED, block_size=64, backend="dense", plan="split")
    path = save_config(model, tmp_path / "run")
    saved = json.loads(path.read_text())
    assert saved["layers"][0]["modes"] == ["full", "ssa"] and "weights" not in saved
    assert saved["options"] == {"block_size": 64, "backend": "dense", "plan": "split"}
    assert saved["layers"][1]["patterns"]["esa"] == {"type": "esa", "layer_idx": 1, "num_layers": 3,
                                                      "attn_length": 3, "num_heads": 4}
    fresh = load_config(tiny_model("qwen3"), tmp_path / "run")
    assert layer_modes(fresh) == MIXED
    ids, mask = left_padded([9, 4])
    torch.testing.assert_close(logits(fresh, ids, mask), logits(model, ids, mask), atol=0, rtol=0)
    layer = fresh.model.layers[2].self_attn.flexsparse
    assert layer.attention.block_size == 64 and layer.options["plan"] == "split"


def test_save_config_describes_combined_patterns_and_refuses_unknown_ones(tmp_path):
    patterns = {"full": Causal(), "mix": SinkWindow(2, 6) | TriangleMix(1, 4, 2), "both": Causal() & SinkWindow(0, 4)}
    model = convert(tiny_model("llama"), patterns, [["full", "mix"], ["both", "mix"], ["full", "both"]],
                    backend="dense")
    save_config(model, tmp_path)
    fresh = load_config(tiny_model("llama"), tmp_path / "flexsparse.json")
    ids, _ = left_padded([10])
    torch.testing.assert_close(logits(fresh, ids), logits(model, ids), atol=0, rtol=0)

    class Custom(type(Causal())):
        pass

    convert(model, {"full": Causal(), "custom": Custom()}, ALL_FULL, backend="dense")
    with pytest.raises(TypeError, match="cannot describe"):
        save_config(model, tmp_path / "other")


def test_learned_tensors_go_to_safetensors(tmp_path):
    """Learned modules on a layer's flexsparse state (routers: tests/test_router_integration.py) are saved beside
    the JSON; tensors load_config cannot place are refused."""
    from safetensors.torch import load_file

    model = convert(tiny_model("llama"), PATTERNS, ALL_FULL, backend="dense")
    router = nn.Linear(4, 2)
    model.model.layers[1].self_attn.flexsparse.extra = router
    save_config(model, tmp_path)
    saved = json.loads((tmp_path / "flexsparse.json").read_text())
    tensors = load_file(str(tmp_path / saved["weights"]))
    assert set(tensors) == {"layers.1.extra.weight", "layers.1.extra.bias"}
    torch.testing.assert_close(tensors["layers.1.extra.weight"], router.weight.detach())
    with pytest.raises(ValueError, match=r"layer 1: .*cannot rebuild"):
        load_config(tiny_model("llama"), tmp_path)


def test_hf_demo_reports_agreement_and_memory(capsys):
    from flexsparse.tools.demo_hf import run_hf_demo

    report = run_hf_demo()
    assert report["all_full_max_logit_error"] <= 1e-4 and report["all_full_tokens_equal"] == "64/64"
    assert report["sparse_cache_tokens_equal_recompute"] == "64/64"
    assert report["kv_bytes_sparse_cache"] == report["kv_bytes_formula"] and report["kv_saved"] > 2.5
    assert "KV memory" in capsys.readouterr().out


# ----- errors ------------------------------------------------------------------------------------------------------

def test_mode_errors_name_the_layer_and_head():
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="modes has 2 layers, the model has 3"):
        convert(model, PATTERNS, ALL_FULL[:2])
    with pytest.raises(ValueError, match="modes for layer 1 has 3 entries, layer 1 has 2 KV heads"):
        convert(model, PATTERNS, [["full"] * 2, ["full"] * 3, ["full"] * 2])
    with pytest.raises(ValueError, match="layer 2, KV head 1 names unknown pattern 'sparse'"):
        convert(model, PATTERNS, [["full"] * 2, ["full"] * 2, ["full", "sparse"]])
    with pytest.raises(ValueError, match="layer 0, KV head 0 must be a pattern name or an index < 3"):
        convert(model, PATTERNS, [[7, 0], [0, 0], [0, 0]])
    with pytest.raises(ValueError, match="patterns has 2 per-layer entries, the model has 3"):
        convert(model, [PATTERNS, PATTERNS], ALL_FULL)
    with pytest.raises(TypeError, match="modes must be one list"):
        convert(model, PATTERNS, "full")
    with pytest.raises(ValueError, match=r"layer 1 \(model.layers.1.self_attn\): .*defined for 8 query heads"):
        convert(model, [PATTERNS, {"esa": ESA(1, 3, 4, 8)}, PATTERNS], [["full"] * 2, ["esa"] * 2, ["full"] * 2])
    assert not is_converted(model)


class ManualAttention(nn.Module):
    """An attention module that computes attention itself instead of calling transformers' registry."""

    def __init__(self, config, layer_idx):
        super().__init__()
        self.config, self.layer_idx, self.head_dim = config, layer_idx, config.hidden_size // config.num_attention_heads
        self.qkv = nn.Linear(config.hidden_size, 3 * config.hidden_size)

    def forward(self, hidden_states, **kwargs):
        q, k, v = self.qkv(hidden_states).chunk(3, -1)
        return torch.softmax(q @ k.transpose(-1, -2), -1) @ v, None


def test_a_layer_that_bypasses_the_registry_is_refused_by_name():
    model = tiny_model("llama")
    model.model.layers[1].self_attn = ManualAttention(model.config, 1)
    with pytest.raises(ValueError, match=r"layer 1 \(model.layers.1.self_attn, ManualAttention\) does not call"):
        convert(model, PATTERNS, ALL_FULL)
    del model.model.layers[1].self_attn
    with pytest.raises(ValueError, match="layer 1: found no attention module"):
        convert(model, PATTERNS, ALL_FULL)


def test_models_with_their_own_sliding_window_are_refused_by_layer():
    mistral = tiny_model("mistral", sliding_window=8)
    with pytest.raises(ValueError, match=r"MistralForCausalLM .*sliding_window=8.*sliding_window = None before "
                                         r"convert.*SinkWindow\(sink=0, window=8\)"):
        convert(mistral, PATTERNS, ALL_FULL)
    assert not is_converted(mistral)
    qwen = tiny_model("qwen3", use_sliding_window=True, sliding_window=8, max_window_layers=1)
    with pytest.raises(ValueError, match=r"layer 1 .*sliding_attention"):
        convert(qwen, PATTERNS, ALL_FULL)


def test_the_refusal_of_mistrals_window_says_how_to_reproduce_it():
    """Mistral's default config has a sliding window: convert refuses it and says to drop the window from the
    config and give it as SinkWindow(sink=0, window); doing so on the loaded model reproduces its logits."""
    model = tiny_model("mistral", sliding_window=6)
    ids, mask = left_padded([15, 9])
    expected = logits(model, ids, mask)
    with pytest.raises(ValueError, match=r"model.config.sliding_window = None.*SinkWindow\(sink=0, window=6\)"):
        convert(model, {"full": Causal()}, ALL_FULL)
    model.config.sliding_window = None
    convert(model, {"window": SinkWindow(0, 6)}, [["window"] * 2] * 3, backend="dense")
    real = mask.bool()
    torch.testing.assert_close(logits(model, ids, mask)[real], expected[real], atol=1e-4, rtol=0)
    assert torch.equal(greedy(model, ids, mask, 12), greedy(model, ids, mask, 12, use_cache=False))


def gemma(kind: str, **overrides):
    """A tiny Gemma 2 / Gemma 3 text model whose layers are all full attention."""
    config = {"gemma2": transformers.Gemma2Config, "gemma3": transformers.Gemma3TextConfig}[kind](
        vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=LAYERS, num_attention_heads=4,
        num_key_value_heads=KV_HEADS, head_dim=16, max_position_embeddings=256, pad_token_id=0,
        layer_types=["full_attention"] * LAYERS, **overrides)
    cls = {"gemma2": transformers.Gemma2ForCausalLM, "gemma3": transformers.Gemma3ForCausalLM}[kind]
    return cls(config).eval()


@pytest.mark.parametrize("kind, overrides, refusal", [
    ("gemma2", {}, r"layer 0 .*attn_logit_softcapping=50.0"),
    ("gemma2", {"attn_logit_softcapping": None}, r"sliding_window=4096\) that none of its layers uses"),
    ("gemma3", {}, r"Gemma3ForCausalLM defines a sliding window \(config.sliding_window=4096\) that none"),
])
def test_gemma_with_every_layer_full_is_refused_at_convert(kind, overrides, refusal):
    """Gemma 2/3 build a sliding-window mask at every forward whatever their layer types (and Gemma 2 caps its
    logits): refused by convert, not at the first forward."""
    model = gemma(kind, **overrides)
    with pytest.raises(ValueError, match=refusal):
        convert(model, PATTERNS, ALL_FULL)
    assert not is_converted(model) and model.config._attn_implementation != "flexsparse"


def test_other_inputs_are_refused():
    with pytest.raises(TypeError, match="PreTrainedModel"):
        convert(nn.Linear(2, 2), PATTERNS, ALL_FULL)
    model = convert(tiny_model("llama"), PATTERNS, ALL_FULL, backend="dense")
    ids = torch.randint(1, 50, (1, 6))
    with pytest.raises(ValueError, match="2-D padding mask"):
        with torch.no_grad():
            model(ids, attention_mask=torch.ones(1, 1, 6, 6, dtype=torch.bool))
    with pytest.raises(ValueError, match="another mask"):  # packed sequences (position ids restart, no mask)
        with torch.no_grad():
            model(ids, position_ids=torch.tensor([[0, 1, 2, 0, 1, 2]]), use_cache=False)
    with pytest.raises(ValueError, match="SparseKVCache needs a model converted"):
        SparseKVCache(tiny_model("llama"))


# ----- GPU (compiled flex) -------------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("one_launch", [False, True])
def test_gpu_sparse_cache_decode_equals_one_forward_and_never_recompiles(one_launch):
    """Compiled flex (ESA heads in bucketed buffers), SDPA (full heads, rings) on CUDA, fp32: teacher-forced decode
    logits through the sparse cache equal one forward over the whole sequence (atol 5e-3: flex may use TF32);
    a second generate() of the same lengths compiles nothing."""
    patterns = {**PATTERNS, "esa": ESA(0, 1, 3, 4)}
    # block 128, as on real models: inductor finds no flex kernel configuration for 16-token blocks
    model = convert(tiny_model("llama").cuda(), patterns, [["full", "ssa"], ["ssa2", "esa"], ["ssa", "ssa"]],
                    block_size=128, backend="flex")
    ids, mask = left_padded([20, 9])
    ids, mask = ids.cuda(), mask.cuda()
    with torch.no_grad():
        expected = model(ids, attention_mask=mask).logits
        cache, pieces = SparseKVCache(model, max_length=ids.shape[1], one_launch_decode=one_launch), []
        for start, stop in [(0, 9)] + [(t, t + 1) for t in range(9, ids.shape[1])]:
            positions = (mask[:, :stop].cumsum(-1) - 1).clamp(min=0)[:, start:stop]
            pieces.append(model(ids[:, start:stop], attention_mask=mask[:, :stop], position_ids=positions,
                                **{cache_argument(model): cache}).logits)
    real = mask.bool()
    torch.testing.assert_close(torch.cat(pieces, 1)[real], expected[real], atol=5e-3, rtol=0)
    first = greedy(model, ids, mask, 40)
    with torch.compiler.set_stance("fail_on_recompile"):
        assert torch.equal(greedy(model, ids, mask, 40), first)
