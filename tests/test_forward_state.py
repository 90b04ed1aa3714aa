"""The per-forward state (ForwardState): each entry built once per forward and shared by every layer, a new
forward building its own; in a converted tiny Llama the padding's positions, tile bounds and decode slots are built
once per forward, not once per layer, and the logits are those of a fresh state per layer."""

import pytest
import torch

from flexsparse import HybridAttention
from flexsparse.integrations import convert
from flexsparse.masks import Causal, Geometry, Positions, SinkWindow
from flexsparse.masks.forward_state import ForwardState
from tests.hf_util import LAYERS, left_padded, one_thread, tiny_model  # noqa: F401  (autouse fixture)


def test_entries_are_built_once_per_key():
    state, calls = ForwardState(), []

    def build(value):
        def make():
            calls.append(value)
            return torch.tensor([value])
        return make

    first = state.real_counts(5, build(5))
    assert state.real_counts(5, build(50)) is first and calls == [5]
    assert state.real_counts(6, build(6)).item() == 6 and calls == [5, 6]  # another key
    assert state.capacity_positions(8, build(1)) is not state.capacity_positions(9, build(2))  # another capacity
    assert state.positions(lambda: None) is None
    assert state.positions(lambda: pytest.fail("None is a stored value, not a missing one")) is None
    assert ForwardState().real_counts(5, build(7)).item() == 7  # another forward: its own entries


def test_positions_and_derived_tables_have_states_of_their_own():
    positions = Positions.from_padding_mask(torch.tensor([[False, True, True, True]]), 4)
    assert positions.key_slots() is positions.key_slots()
    padded = positions.padded(4, 8)
    assert padded.state is not positions.state
    assert torch.equal(padded.key_slots()[:, :4], positions.key_slots()[:, :4])


class _Counter:
    """Counts calls of a function, by wrapping it with monkeypatch."""

    def __init__(self, monkeypatch, owner, name):
        self.calls = 0
        original = getattr(owner, name)

        def counted(*args, **kwargs):
            self.calls += 1
            return original(*args, **kwargs)
        monkeypatch.setattr(owner, name, counted)


def test_layers_given_one_positions_share_its_tables(monkeypatch):
    """Three layers called with one Positions build the tile bounds once (a query and a key table), a new Positions
    builds them again; every layer's output is the one it gives alone."""
    torch.manual_seed(0)
    layers = [HybridAttention(4, 2, 16, {"full": Causal(), "ssa": SinkWindow(2, 5)}, ["ssa", "ssa"], block_size=8,
                              backend="flex_eager") for _ in range(3)]
    q, k, v = (torch.randn(2, h, 20, 16) for h in (4, 2, 2))
    padding = torch.arange(20)[None] >= torch.tensor([[0], [7]])
    alone = [layer(q, k, v, key_padding_mask=padding) for layer in layers]
    tiles = _Counter(monkeypatch, Geometry, "_tile_bounds")
    positions = Positions.from_padding_mask(padding, 20)
    for layer, expected in zip(layers, alone):
        torch.testing.assert_close(layer(q, k, v, positions=positions), expected, atol=1e-5, rtol=0)
    assert tiles.calls == 2
    layers[0](q, k, v, positions=Positions.from_padding_mask(padding, 20))
    assert tiles.calls == 4


def test_converted_llama_builds_shared_entries_once_per_forward(monkeypatch):
    """A padded batch through a converted tiny Llama (flex, every layer sink/window): one position table, one set
    of tile bounds and, in each decode step, one ring slot per forward for all layers."""
    model = tiny_model("llama")
    convert(model, {"full": Causal(), "ssa": SinkWindow(2, 4)}, [["ssa", "ssa"]] * LAYERS, block_size=8,
            backend="flex_eager")
    ids, mask = left_padded([13, 7])
    tables = _Counter(monkeypatch, Positions, "from_padding_mask")
    tiles = _Counter(monkeypatch, Geometry, "_tile_bounds")
    with torch.no_grad():
        model(ids, attention_mask=mask)
    assert (tables.calls, tiles.calls) == (1, 2)  # not one per layer (3 layers)

    from flexsparse.cache import views

    views_built = _Counter(monkeypatch, views.StepViews, "_ring_step")
    slot_builds = _Counter(monkeypatch, views, "ring_slot_of")
    out = model.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False)
    steps = 2  # the first new token comes from the prefill
    assert views_built.calls == steps * LAYERS and slot_builds.calls == steps
    assert out.shape == (2, 16)
