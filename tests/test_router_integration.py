"""Routers inside converted transformers models: per-sequence routing at prefill, decode with the prefill's modes,
generate(), save/load, revert, and errors. Tiny random Llama / Qwen3 (fp32, CPU, dense backend).

The routers are initialised with std 0.2 (not 0.02) so that their decisions differ between sequences and heads
with clear margins (at 0.02 the logits of a random model are ~1e-6 apart).
"""

import json

import pytest
import torch

from flexsparse.integrations import (
    SparseKVCache,
    convert,
    fused_routers,
    is_converted,
    last_routings,
    load_config,
    revert,
    save_config,
)
from flexsparse.masks import Causal, SinkWindow
from flexsparse.routers import HeadRouter, LayerRouter
from tests.hf_util import (
    HEAD_DIM,
    KV_HEADS,
    LAYERS,
    greedy,
    left_padded,
    one_thread,  # noqa: F401  (autouse fixture)
    tiny_model,
    transformers,
)

PATTERNS = {"full": Causal(), "ssa": SinkWindow(2, 4)}
OPTIONS = {"pool_size": 3, "init_std": 0.2}


def routed(kind="llama", router="head", seed=0, **kwargs):
    torch.manual_seed(seed)
    return convert(tiny_model(kind), PATTERNS, router=router, router_options=OPTIONS, backend="dense", **kwargs)


def forward(model, ids, mask=None):
    with torch.no_grad():
        return model(ids, attention_mask=mask).logits


def decisions(model):
    """The last prefill's modes of every layer, ``[B, L, H_kv]``."""
    return torch.stack([layer.self_attn.flexsparse.prefill_modes for layer in model.model.layers], 1)


def static_for(modes):
    """A model converted with one sequence's routed modes ``[L, H_kv]`` as static modes."""
    names = list(PATTERNS)
    return convert(tiny_model("llama"), PATTERNS, [[names[m] for m in row] for row in modes.tolist()],
                   backend="dense")


def test_routed_logits_equal_static_per_sequence_modes():
    """A left-padded batch: each row's logits are those of the model converted with that row's decisions; the
    rows were routed independently (their decisions differ)."""
    model = routed()
    lengths = [12, 7, 9]
    ids, mask = left_padded(lengths, seed=3)
    batched = forward(model, ids, mask)
    modes = decisions(model)
    assert modes.shape == (3, LAYERS, KV_HEADS)
    assert len({tuple(m.flatten().tolist()) for m in modes}) == 3, "the rows must be routed differently"
    assert modes.eq(1).any() and modes.eq(0).any()
    for row, n in enumerate(lengths):
        real = mask[row].bool()
        expected = forward(static_for(modes[row]), ids[row:row + 1, real])
        torch.testing.assert_close(batched[row, real], expected[0], atol=1e-4, rtol=0)


def test_batch_elements_are_routed_as_alone():
    model = routed()
    ids, mask = left_padded([12, 7], seed=3)
    forward(model, ids, mask)
    batched = decisions(model)
    for row in range(2):
        real = mask[row].bool()
        forward(model, ids[row:row + 1, real])
        assert torch.equal(decisions(model)[0], batched[row])
    assert not torch.equal(batched[0], batched[1])


@pytest.mark.parametrize("router", ["head", "layer"])
def test_fused_routers_decide_as_the_torch_path(router):
    """Inside fused_routers(model) every layer routes through the fused kernel (here in the Triton interpreter):
    the same modes and logits as the torch path; outside it, on the CPU, the torch path again. Where the kernel
    cannot run (gradients required) the forward raises, naming the layer."""
    model = routed(router=router)
    ids, mask = left_padded([12, 7], seed=3)
    expected_logits, expected_modes = forward(model, ids, mask), decisions(model)
    assert all(not routing.fused for routing in last_routings(model))
    with fused_routers(model):
        got_logits = forward(model, ids, mask)
        assert all(routing.fused for routing in last_routings(model))
        assert torch.equal(decisions(model), expected_modes)
        torch.testing.assert_close(got_logits, expected_logits, atol=1e-5, rtol=0)
        for p in model.model.layers[0].self_attn.flexsparse.router.parameters():
            p.requires_grad_(True)
        with pytest.raises(ValueError, match=r"layer 0 .*gradients are enabled and required"):
            model(ids, attention_mask=mask)
    forward(model, ids, mask)
    assert all(not routing.fused for routing in last_routings(model))
    with pytest.raises(TypeError, match="enabled must be a bool"):
        with fused_routers(model, enabled=1):
            pass


def test_the_decisions_respond_to_the_router():
    """Guard: forcing every sparse logit up routes every head sparse and changes the logits."""
    model = routed()
    ids, mask = left_padded([12, 7], seed=3)
    before = forward(model, ids, mask)
    for layer in model.model.layers:
        last = layer.self_attn.flexsparse.router.router_mlp[-1]
        with torch.no_grad():
            last.bias.copy_(torch.tensor([-100.0, 100.0]))
    after = forward(model, ids, mask)
    assert decisions(model).eq(1).all()
    assert (after - before).abs().max() > 1e-2


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_head_router_reads_keys_before_rope_after_the_key_norm(kind):
    model = routed(kind)
    attn = model.model.layers[1].self_attn
    seen = {}
    hook = attn.register_forward_pre_hook(lambda m, args, kwargs: seen.update(h=kwargs["hidden_states"]),
                                          with_kwargs=True)
    ids, mask = left_padded([10, 6], seed=2)
    forward(model, ids, mask)
    hook.remove()
    keys = attn.k_proj(seen["h"]).view(2, 10, KV_HEADS, HEAD_DIM)
    if kind == "qwen3":
        keys = attn.k_norm(keys)
    state = attn.flexsparse
    with torch.no_grad():
        expected = state.router(keys, mask.bool())
    torch.testing.assert_close(state.routing.logits, expected, atol=1e-5, rtol=0)


def test_layer_router_reads_query_states_and_decides_every_head():
    model = routed("qwen3", router="layer")
    ids, mask = left_padded([12, 7, 9], seed=3)
    forward(model, ids, mask)
    state = model.model.layers[0].self_attn.flexsparse
    assert isinstance(state.router, LayerRouter) and state.routing.logits.shape == (3, 1, 2)
    modes = decisions(model)
    assert torch.equal(modes, modes[..., :1].expand_as(modes))


def test_generate_uses_a_dynamic_cache_and_decodes_with_the_prefill_modes():
    """Left-padded batched generate equals, per sequence, the model converted with that sequence's decisions and
    decoded without a cache (a full recompute in the static modes at every step)."""
    model = routed()
    lengths = [12, 7]
    ids, mask = left_padded(lengths, seed=3)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=8, min_new_tokens=8, do_sample=False,
                             return_dict_in_generate=True)
    assert type(out.past_key_values) is transformers.DynamicCache
    forward(model, ids, mask)
    modes = decisions(model)
    new = out.sequences[:, ids.shape[1]:]
    for row, n in enumerate(lengths):
        alone = ids[row:row + 1, -n:]
        expected = greedy(static_for(modes[row]), alone, torch.ones_like(alone), 8, use_cache=False)
        assert torch.equal(new[row], expected[0]), f"sequence {row}"
    with pytest.raises(ValueError, match="cannot serve routed layers"):
        SparseKVCache(model)


def test_a_decode_step_without_a_prefill_of_that_batch_is_refused():
    """The cache was filled elsewhere: the layer has no routing of a batch of 1 to reuse."""
    model = routed()
    ids, mask = left_padded([6, 5], seed=3)
    forward(model, ids, mask)  # routes a batch of 2
    cache = transformers.DynamicCache()
    for index in range(LAYERS):
        cache.update(torch.randn(1, KV_HEADS, 4, HEAD_DIM), torch.randn(1, KV_HEADS, 4, HEAD_DIM), index)
    with torch.no_grad(), pytest.raises(ValueError, match=r"layer 0 .*prefill's routing of the same batch"):
        model(ids[:1, :1], past_key_values=cache, attention_mask=torch.ones(1, 5, dtype=torch.long))


def test_save_and_load_reproduce_decisions_and_logits(tmp_path):
    model = routed("qwen3")
    ids, mask = left_padded([12, 7, 9], seed=3)
    expected = forward(model, ids, mask)
    modes = decisions(model)
    save_config(model, tmp_path)
    saved = json.loads((tmp_path / "flexsparse.json").read_text())
    assert saved["layers"][0]["router"] == {"kind": "head", "head_dim": HEAD_DIM, "pool_size": 3, "full_mode": 0,
                                            "sparse_mode": 1, "init_std": 0.2}
    fresh = load_config(tiny_model("qwen3"), tmp_path)
    assert isinstance(fresh.model.layers[2].self_attn.flexsparse.router, HeadRouter)
    torch.testing.assert_close(forward(fresh, ids, mask), expected, atol=0, rtol=0)
    assert torch.equal(decisions(fresh), modes)


def test_a_factory_routes_some_layers_and_revert_removes_the_hooks():
    torch.manual_seed(0)
    model = tiny_model("llama")
    factory = lambda index: HeadRouter(HEAD_DIM, 3, init_std=0.2) if index != 1 else None
    convert(model, PATTERNS, [["full", "full"], ["ssa", "full"], ["full", "full"]], router=factory, backend="dense")
    layers = model.model.layers
    assert layers[1].self_attn.flexsparse.router is None
    assert len(layers[0].self_attn.k_proj._forward_hooks) == 1
    ids, mask = left_padded([9, 6])
    forward(model, ids, mask)
    assert layers[0].self_attn.flexsparse.prefill_modes.shape == (2, KV_HEADS)
    convert(model, PATTERNS, [["full", "full"]] * LAYERS, backend="dense")  # re-converting drops the old hooks
    assert all(not layer.self_attn.k_proj._forward_hooks for layer in layers)
    routed_again = routed()
    revert(routed_again)
    assert not is_converted(routed_again)
    assert all(not layer.self_attn.k_proj._forward_hooks for layer in routed_again.model.layers)


# ----- errors ------------------------------------------------------------------------------------------------------

def test_router_errors_name_the_argument():
    model = tiny_model("llama")
    with pytest.raises(ValueError, match=r"router must be one of \['head', 'layer'\]"):
        convert(model, PATTERNS, router="heads")
    with pytest.raises(TypeError, match="router must be 'head', 'layer' or a function"):
        convert(model, PATTERNS, router=HeadRouter(HEAD_DIM))
    with pytest.raises(ValueError, match=r"router for layer 0 \(model.layers.0.self_attn\) has head_dim=8, the "
                                         r"layer has head_dim=16"):
        convert(model, PATTERNS, router=lambda index: HeadRouter(8))
    with pytest.raises(ValueError, match=r"router for layer 0 .* sparse_mode=3, the layer has 2 patterns"):
        convert(model, PATTERNS, router=lambda index: HeadRouter(HEAD_DIM, sparse_mode=3))
    with pytest.raises(TypeError, match="router for layer 0 .* must be a flexsparse.routers.Router or None"):
        convert(model, PATTERNS, router=lambda index: torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match=r"router_options has unknown keys \['pool'\]"):
        convert(model, PATTERNS, router="head", router_options={"pool": 3})
    with pytest.raises(TypeError, match="router_options go with router='head' or 'layer'"):
        convert(model, PATTERNS, router=lambda index: None, router_options={"pool_size": 3})
    with pytest.raises(TypeError, match="router_options needs a router"):
        convert(model, PATTERNS, [["full"] * 2] * 3, router_options={"pool_size": 3})
    with pytest.raises(ValueError, match=r"router_options\['sparse'\] must name a pattern of layer 0"):
        convert(model, PATTERNS, router="head", router_options={"sparse": "window"})
    with pytest.raises(ValueError, match="layer 0: a router needs a full and a sparse pattern"):
        convert(model, {"full": Causal()}, router="layer")
    with pytest.raises(ValueError, match=r"pool_size must be >= 1"):
        convert(model, PATTERNS, router="head", router_options={"pool_size": 0})
    with pytest.raises(ValueError, match=r"modes is required for layers without a router \(layers \[1\]\)"):
        convert(model, PATTERNS, router=lambda index: None if index == 1 else HeadRouter(HEAD_DIM))
    assert not is_converted(model)
