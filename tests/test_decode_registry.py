"""Adding a pattern that decodes differently is its module, its test and one line: a dilated window (every
``dilation``-th earlier key, ``count`` of them), and an executor that decodes it by gathering exactly those keys
from the sparse KV cache's store, registered with ``register_executor``. Prefill runs the dense plan; decode steps
without padding go to the new executor (chosen by its ``accepts_decode`` and ``decode_cost``); steps it declines
(a left-padded prompt) fall back to the layer's plan over the whole store. Both equal the uncached forward."""

import pytest
import torch
import torch.nn.functional as F

from flexsparse.integrations import SparseKVCache, convert
from flexsparse.integrations.transformers import cache_argument
from flexsparse.masks import Causal, Pattern
from flexsparse.masks.geometry import Geometry, classify
from flexsparse.runtime.executors import Executor
from flexsparse.runtime.registry import register_executor, unregister_executor
from tests.hf_util import left_padded, tiny_model


class DilatedWindow(Pattern):
    """Query position i attends key positions i, i - dilation, ..., i - (count - 1) * dilation (test-only: not
    registered under a name, so it stays out of the pattern registry)."""

    def __init__(self, dilation: int, count: int) -> None:
        self.dilation, self.count = dilation, count

    def _allowed(self, q, kv):
        distance = q - kv
        return (distance >= 0) & (distance % self.dilation == 0) & (distance < self.dilation * self.count)

    def mask_mod(self, geo: Geometry):
        q_pos, kv_pos = geo.position_mods()
        return lambda b, h, q_idx, kv_idx: self._allowed(q_pos(b, q_idx), kv_pos(b, kv_idx))

    def block_classes(self, geo: Geometry):
        q_first, q_last = geo.q_tile_bounds()
        kv_first, kv_last = geo.kv_tile_bounds()
        too_far = q_first - kv_last >= self.dilation * self.count
        return geo.restrict(classify(full=torch.zeros_like(too_far), empty=(kv_first > q_last) | too_far))

    def dense(self, geo: Geometry):
        q, kv = geo.dense_grid()
        return self._allowed(q, kv)


class DilatedDecoder(Executor):
    """Decodes DilatedWindow heads by gathering the new token's keys (slot t holds token t without padding)."""

    name = "dilated_decoder"
    steps = 0

    def accepts(self, pattern, call):
        return False  # prefill and chunks stay on the layer's other executors

    def cost(self, patterns, call):
        return float("inf")

    def run(self, call, patterns, modes, heads):
        raise AssertionError("never planned for prefill")

    def decodes(self, pattern):
        return isinstance(pattern, DilatedWindow)

    def accepts_decode(self, call):
        return super().accepts_decode(call) and call.groups[0].view.prefix  # no padding: slot t is token t

    def decode_cost(self, call):
        return 0.0

    def decode(self, call):
        DilatedDecoder.steps += 1
        (group,) = call.groups
        pattern, newest = group.pattern, group.view.filled - 1
        slots = torch.arange(newest, max(newest - pattern.dilation * pattern.count, -1), -pattern.dilation,
                             device=call.q.device)
        keys, values = group.store.keys[:, :, slots], group.store.values[:, :, slots]
        q = call.query()
        return F.scaled_dot_product_attention(q, keys, values, scale=call.scale, enable_gqa=q.shape[1] > keys.shape[1])


@pytest.fixture
def registered():
    DilatedDecoder.steps = 0
    register_executor(DilatedDecoder)  # the one line
    yield
    unregister_executor(DilatedDecoder)


def logits_step_by_step(model, ids, mask, prompt):
    cache, pieces = SparseKVCache(model), []
    with torch.no_grad():
        for end in [prompt, *range(prompt + 1, ids.shape[1] + 1)]:
            start = 0 if end == prompt else end - 1
            positions = (mask.cumsum(-1) - 1).clamp(min=0)[:, start:end]
            out = model(ids[:, start:end], attention_mask=mask[:, :end], position_ids=positions,
                        **{cache_argument(model): cache})
            pieces.append(out.logits[:, -1:] if end == prompt else out.logits)
    return cache, torch.cat(pieces, 1)


@pytest.mark.parametrize("lengths,decoded", [([20, 20], True), ([20, 14], False)])
def test_a_registered_decoder_serves_its_pattern(registered, lengths, decoded):
    model = convert(tiny_model("llama"), {"full": Causal(), "dilated": DilatedWindow(3, 4)},
                    [["full", "dilated"]] * 3, backend="dense")
    assert [g.decoder.name for g in model.model.layers[0].self_attn.flexsparse.groups] == ["sdpa", "dilated_decoder"]
    ids, mask = left_padded(lengths)
    prompt = 12
    with torch.no_grad():
        expected = model(ids, attention_mask=mask).logits[:, prompt - 1:]
    _, got = logits_step_by_step(model, ids, mask, prompt)
    real = mask[:, prompt - 1:].bool()
    torch.testing.assert_close(got[real], expected[real], atol=1e-4, rtol=0)
    steps = (ids.shape[1] - prompt) * 3  # one call per decode step and layer
    assert DilatedDecoder.steps == (steps if decoded else 0)
