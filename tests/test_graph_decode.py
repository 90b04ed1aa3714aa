"""Decode steps from a sparse KV cache's device-side state (SparseKVCache.start_device_steps) and their CUDA graphs
(flexsparse.integrations.graph_decode), against the host-driven decode path (tiny random Llama).

On the CPU the device-side step runs eagerly under the Triton interpreter (``one_launch_decode=True``,
``capture=False``): step by step it equals the host-driven one-launch path (fp32, 1e-5), without padding and
after a left-padded prompt, through the rings' wrap; and re-running the recorded step function with the host-side
state frozen at its first run (what a graph replay does) gives each next step's logits, which catches any host
int a graph would bake in. GPU tests (marked ``gpu``) capture real graphs: greedy generate() with and without
decode graphs, and a replay's host syncs.
"""

import pytest
import torch

from flexsparse.integrations import SparseKVCache, convert
from flexsparse.integrations.graph_decode import GraphDecodeForward, GraphDecoder
from flexsparse.masks import ESA
from tests.hf_util import (
    LAYERS,
    MIXED,
    PATTERNS,
    VOCAB,
    greedy,
    left_padded,
    one_thread,  # noqa: F401  (autouse fixture)
    right_padded,
    tiny_model,
    transformers,
)
from tests.kernel_markers import DEVICE, kernel_test, needs_interpreter

PROMPT, STEPS = 9, 10  # the rings (8 and 5 slots) wrap during the steps


def model_and_tokens(lengths, seed=0):
    """A converted tiny Llama, a left-padded prompt of ``lengths`` and STEPS tokens to decode per row."""
    model = convert(tiny_model("llama"), PATTERNS, MIXED, backend="dense")
    ids, mask = left_padded(lengths, seed=seed)
    new = torch.randint(1, VOCAB, (len(lengths), STEPS), generator=torch.Generator().manual_seed(seed + 1))
    return model, ids, mask, new


def positions_of(mask):
    """Rotary positions as generate() gives them: real tokens before each token."""
    return (mask.cumsum(-1) - 1).clamp(min=0)


@torch.no_grad()
def prefilled(model, ids, mask, max_length=PROMPT + STEPS, one_launch=True):
    cache = SparseKVCache(model, max_length=max_length, one_launch_decode=one_launch)
    model(ids, attention_mask=mask, position_ids=positions_of(mask), past_key_values=cache, use_cache=True)
    return cache


@torch.no_grad()
def host_steps(model, ids, mask, new):
    """Logits ``[B, V]`` of each new token through the host-driven one-launch path, as generate() calls it."""
    cache, logits = prefilled(model, ids, mask), []
    for t in range(new.shape[1]):
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], 1)
        out = model(new[:, t:t + 1], attention_mask=mask, position_ids=positions_of(mask)[:, -1:],
                    past_key_values=cache, use_cache=True)
        logits.append(out.logits[:, 0])
    return logits


def decoder(model, ids, mask, capture=False):
    """A GraphDecoder over a prefilled cache, given the first step's mask and positions as generate() does."""
    cache = prefilled(model, ids, mask)
    grown = torch.cat([mask, torch.ones_like(mask[:, :1])], 1)
    return GraphDecoder(model, cache, attention_mask=grown, position_ids=positions_of(grown)[:, -1:],
                        capture=capture)


@needs_interpreter
@pytest.mark.parametrize("lengths", [[PROMPT, PROMPT], [PROMPT, 4], [PROMPT]], ids=["none", "left", "batch-1"])
def test_device_steps_equal_host_steps(lengths):
    model, ids, mask, new = model_and_tokens(lengths)
    expected = host_steps(model, ids, mask, new)
    graphed = decoder(model, ids, mask)
    with torch.no_grad():
        for t in range(STEPS):
            got = graphed.step(new[:, t:t + 1])
            torch.testing.assert_close(got[:, 0], expected[t], atol=1e-5, rtol=0, msg=f"step {t}")
    assert graphed.cache.get_seq_length(0) == PROMPT + STEPS
    assert graphed.steps.tokens.tolist() == [PROMPT + STEPS]
    assert graphed.steps.real.tolist() == [n + STEPS for n in lengths]


@needs_interpreter
@pytest.mark.parametrize("lengths", [[PROMPT, PROMPT], [PROMPT, 4]], ids=["none", "left"])
def test_recorded_step_replays_with_frozen_host_state(lengths):
    """A replay runs the recorded step's device work again, none of its Python: here the host-side state (each
    layer's token count, from which the step's masks and views are made) is put back to what it was when the
    step was first run, before every later run; every run must still give its own step's logits."""
    model, ids, mask, new = model_and_tokens(lengths, seed=3)
    expected = host_steps(model, ids, mask, new)
    graphed = decoder(model, ids, mask)
    cache = graphed.cache
    with torch.no_grad():
        for t in range(2):  # warm-up steps, as before a capture
            graphed.step(new[:, t:t + 1])
        recorded = [layer.tokens for layer in cache.layers]
        for t in range(2, STEPS):
            for layer, tokens in zip(cache.layers, recorded):
                layer.tokens = tokens
            graphed.input_ids.copy_(new[:, t:t + 1])
            got = graphed.forward_step()
            torch.testing.assert_close(got[:, 0], expected[t], atol=1e-5, rtol=0, msg=f"step {t}")


@needs_interpreter
@pytest.mark.parametrize("lengths", [[13, 13], [13, 7]], ids=["none", "left"])
def test_generate_with_device_steps_gives_the_eager_tokens(lengths, monkeypatch):
    """generate() of a model converted with decode_graphs=True serves its decode steps through a GraphDecoder
    (here eager: capture=False, in the interpreter) and gives the eager path's greedy tokens; the model's own
    forward is back afterwards."""
    model = convert(tiny_model("llama"), PATTERNS, MIXED, backend="dense")
    ids, mask = left_padded(lengths)
    new_tokens = 12
    cache = lambda: SparseKVCache(model, max_length=ids.shape[1] + new_tokens, one_launch_decode=True)
    expected = greedy(model, ids, mask, new_tokens, past_key_values=cache())
    calls = []
    original_step = GraphDecoder.step

    def counted(self, input_ids):
        calls.append(1)
        return original_step(self, input_ids)

    def prefill_kwargs(self, *args, **kwargs):
        if kwargs["input_ids"].shape[1] > 1:
            prefills.append(sorted(kwargs))
        return original_call(self, *args, **kwargs)

    prefills = []
    original_call = GraphDecodeForward.__call__
    monkeypatch.setattr(GraphDecodeForward, "capture", False)
    monkeypatch.setattr(GraphDecodeForward, "__call__", prefill_kwargs)
    monkeypatch.setattr(GraphDecoder, "step", counted)
    convert(model, PATTERNS, MIXED, backend="dense", decode_graphs=True)
    got = greedy(model, ids, mask, new_tokens, past_key_values=cache())
    assert torch.equal(got, expected)
    assert len(calls) == new_tokens - 1
    assert "forward" not in model.__dict__
    # generate() reads the forward's signature: it still passes the rotary positions and logits_to_keep
    assert {"position_ids", "logits_to_keep"} <= set(prefills[0])


# ---------------------------------------------------------------------------------------------------------------
# Bad input.


def test_convert_refuses_decode_graphs_it_cannot_serve():
    with pytest.raises(ValueError, match=r"decode_graphs=True: .*ESA\(.*\) heads .*, whose decode reads their own pattern"):
        convert(tiny_model("llama"), {**PATTERNS, "esa": ESA(0, 1, 3, 4)}, [["full", "esa"]] * LAYERS,
                decode_graphs=True)
    with pytest.raises(ValueError, match="decode_graphs=True: layer 0 .* is routed"):
        convert(tiny_model("llama"), PATTERNS, router="head", decode_graphs=True)
    with pytest.raises(TypeError, match="decode_graphs must be a bool"):
        convert(tiny_model("llama"), PATTERNS, MIXED, decode_graphs="yes")


def test_graph_decoder_refusals():
    model = convert(tiny_model("llama"), PATTERNS, MIXED, backend="dense")
    ids, mask = left_padded([PROMPT, 4])
    with pytest.raises(ValueError, match="decode graphs need CUDA"):
        decoder(model, ids, mask, capture=None)
    with pytest.raises(ValueError, match="start after a prefill"):
        GraphDecoder(model, SparseKVCache(model, max_length=20, one_launch_decode=True), capture=False)
    with pytest.raises(ValueError, match="need a SparseKVCache built with max_length"):
        GraphDecoder(model, prefilled(model, ids, mask, max_length=None), capture=False)
    with pytest.raises(TypeError, match="need flexsparse's SparseKVCache, got DynamicCache"):
        GraphDecoder(model, transformers.DynamicCache(), capture=False)


@needs_interpreter
def test_device_steps_refusals():
    model = convert(tiny_model("llama"), PATTERNS, MIXED, backend="dense")
    ids, mask = left_padded([PROMPT, 4])
    with pytest.raises(ValueError, match="needs its attention_mask"):
        prefilled(model, ids, mask).start_device_steps()
    with pytest.raises(ValueError, match=r"attention_mask must be a 2-D tensor \[2, >= 9\]"):
        prefilled(model, ids, mask).start_device_steps(mask[:, :3])
    with pytest.raises(ValueError, match=r"position_ids must be a tensor \[2, 1\]"):
        prefilled(model, ids, mask).start_device_steps(mask, torch.zeros(2, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="layer 0 .* no executor runs its decode step as one kernel call"):
        prefilled(model, ids, mask, one_launch=False).start_device_steps(mask)
    right_ids, right_mask = right_padded([PROMPT, 4])
    with pytest.raises(ValueError, match="padding other than a left-padded prompt"):
        prefilled(model, right_ids, right_mask).start_device_steps(right_mask)
    with pytest.raises(ValueError, match="cannot run device-side decode steps: the cache holds no prompt"):
        SparseKVCache(model, max_length=20, one_launch_decode=True).start_device_steps()
    cache = prefilled(model, ids, mask)
    cache.start_device_steps(mask)
    with pytest.raises(ValueError, match="reorder_cache .* call stop_device_steps"):
        cache.reorder_cache(torch.tensor([1, 0]))
    with torch.no_grad(), pytest.raises(ValueError, match="device-side steps of one token, got 2"):
        model(ids[:, :2], past_key_values=cache, use_cache=True)


@needs_interpreter
def test_graph_decoder_step_refusals():
    model, ids, mask, new = model_and_tokens([PROMPT, 4])
    graphed = decoder(model, ids, mask)
    with pytest.raises(ValueError, match=r"input_ids must be integer token ids \[2, 1\]"):
        graphed.step(new[:1, :1])
    with torch.no_grad():
        for t in range(STEPS):
            graphed.step(new[:, t:t + 1])
        with pytest.raises(ValueError, match=f"holds {PROMPT + STEPS} tokens per sequence and is full"):
            graphed.step(new[:, :1])
    graphed.close()
    with pytest.raises(ValueError, match="left this decoder's device-side steps"):
        graphed.step(new[:, :1])


def test_generate_with_decode_graphs_refuses_another_cache():
    model = convert(tiny_model("llama"), PATTERNS, MIXED, backend="dense", decode_graphs=True)
    ids, mask = left_padded([5, 5])
    with pytest.raises(ValueError, match="decode_graphs=True.*uses DynamicCache"):
        greedy(model, ids, mask, 3, past_key_values=transformers.DynamicCache())


# ---------------------------------------------------------------------------------------------------------------
# CUDA graphs (GPU).


def _gpu_model(dtype=torch.bfloat16, decode_graphs=False):
    model = tiny_model("llama").to("cuda", dtype)
    return convert(model, PATTERNS, MIXED, decode_graphs=decode_graphs)


@pytest.mark.gpu
@pytest.mark.parametrize("lengths", [[40], [40, 40], [40, 23, 31]], ids=["batch-1", "none", "left"])
def test_gpu_greedy_generate_with_graphs_equals_eager(lengths):
    """Greedy tokens identical, logits within bf16 tolerance (the same kernels on the same values: in practice
    equal), over 40 steps (the rings wrap), without padding and left-padded."""
    ids, mask = (t.cuda() for t in left_padded(lengths))
    outputs = []
    for decode_graphs in (False, True):
        model = _gpu_model(decode_graphs=decode_graphs)
        with torch.no_grad():
            outputs.append(model.generate(ids, attention_mask=mask, max_new_tokens=40, min_new_tokens=40,
                                          do_sample=False, output_logits=True, return_dict_in_generate=True))
        assert "forward" not in model.__dict__
    eager, graphed = outputs
    assert torch.equal(graphed.sequences, eager.sequences)
    for step, (a, b) in enumerate(zip(eager.logits, graphed.logits)):
        torch.testing.assert_close(b.float(), a.float(), atol=2e-2, rtol=2e-2, msg=f"step {step}")


@pytest.mark.gpu
def test_gpu_graph_replays_equal_eager_steps_and_make_no_host_sync():
    """A GraphDecoder's replays give the host-driven path's logits (fp32, 1e-4), and a replay syncs nothing."""
    torch.manual_seed(0)
    model = _gpu_model(torch.float32)
    ids, mask = (t.cuda() for t in left_padded([PROMPT, 4]))
    new = torch.randint(1, VOCAB, (2, STEPS), device="cuda")
    expected = host_steps(model, ids, mask, new)
    graphed = decoder(model, ids, mask, capture=None)
    with torch.no_grad():
        for t in range(STEPS):
            if t == STEPS - 1:
                torch.cuda.synchronize()
                torch.cuda.set_sync_debug_mode("error")
            try:
                got = graphed.step(new[:, t:t + 1])
            finally:
                torch.cuda.set_sync_debug_mode("default")
            torch.testing.assert_close(got[:, 0], expected[t], atol=1e-4, rtol=0, msg=f"step {t}")
    assert graphed._graph is not None  # steps 3 onwards were replays
    graphed.close()


@pytest.mark.gpu
def test_gpu_graph_decoder_refuses_a_changed_cache():
    model = _gpu_model(torch.float32)
    ids, mask = (t.cuda() for t in left_padded([PROMPT, 4]))
    new = torch.randint(1, VOCAB, (2, 4), device="cuda")
    graphed = decoder(model, ids, mask, capture=None)
    with torch.no_grad():
        for t in range(3):
            graphed.step(new[:, t:t + 1])
        for layer in graphed.cache.layers:  # as reset() or growing would
            layer.stores[0].keys = layer.stores[0].keys.clone()
        with pytest.raises(ValueError, match="buffers changed since the decode graph was captured"):
            graphed.step(new[:, 3:4])


@kernel_test
@pytest.mark.parametrize("rings", [[], [(4, 8, 12)], [(0, 5, 5), (64, 256, 320)]])
def test_step_bounds_kernel_equals_the_pytorch_ops_over_many_steps(rings):
    from flexsparse.integrations.kv_cache import DeviceSteps
    from flexsparse.kernels.decode_steps import step_bounds_launch

    real = torch.tensor([40, 17, 0, 33, 40], device=DEVICE)  # left padding: 40 slots, rows with fewer real tokens
    positions = (real - 1).clamp(min=0)[:, None] + 1
    by_torch = DeviceSteps(40, real, positions, set(rings))
    by_kernel = DeviceSteps(40, real, positions, set(rings))
    launch = step_bounds_launch(len(real), len(rings))
    table = torch.tensor(by_kernel.ring_params or [(0, 1, 0)], dtype=torch.long, device=DEVICE)
    for _ in range(300):  # past every ring's wrap
        by_torch.step_with_torch()
        launch(by_kernel.tokens, by_kernel.real, by_kernel.next_positions, by_kernel._every, by_kernel._rings, table,
               by_kernel.position_ids, by_kernel.cache_position)
        for name in ("tokens", "real", "next_positions", "position_ids", "cache_position", "_every", "_rings"):
            assert torch.equal(getattr(by_kernel, name), getattr(by_torch, name)), name
