"""The pattern registry: a pattern class registers itself by ``Pattern.name``; specs, ``config()`` /
``Pattern.from_config`` and ``save_config`` / ``load_config`` find it there.

A new pattern (here ``DilatedWindow``, defined in this file and nowhere else) works through text specs,
HybridAttention (against the dense softmax reference) and a converted transformers model's saved configuration
without any change to the library. Every registered pattern, this one included, round-trips through its config.
"""

import json

import pytest
import torch

import flexsparse.masks.base as pattern_base
from flexsparse import HybridAttention
from flexsparse.masks import (
    ESA,
    BlockTable,
    Causal,
    Geometry,
    Intersection,
    Pattern,
    PerHead,
    Positions,
    SinkWindow,
    TriangleMix,
    Union,
    XAttention,
    pattern_class,
    registered_patterns,
)
from flexsparse.masks.geometry import classify
from flexsparse.reference import attention as reference
from flexsparse.specs import PATTERNS, parse_pattern, parse_stack
from flexsparse.validation import as_int
from tests.util import assert_key_runs_match_dense, assert_pattern_consistent

pytestmark = pytest.mark.filterwarnings("ignore:.*flex_attention called without torch.compile.*")


class DilatedWindow(Pattern):
    """The query at position i attends keys k <= i with i - k < ``window`` and i - k a multiple of ``dilation``."""

    name = "dilated_window"

    def __init__(self, window: int = 8, dilation: int = 2) -> None:
        self.window = as_int("window", window, minimum=1)
        self.dilation = as_int("dilation", dilation, minimum=1)

    def __repr__(self) -> str:
        return f"DilatedWindow(window={self.window}, dilation={self.dilation})"

    def mask_mod(self, geo):
        q_pos, kv_pos = geo.position_mods()
        window, dilation = self.window, self.dilation

        def dilated_window_mask(b, h, q_idx, kv_idx):
            distance = q_pos(b, q_idx) - kv_pos(b, kv_idx)
            return (distance >= 0) & (distance < window) & (distance % dilation == 0)

        return dilated_window_mask

    def block_classes(self, geo):
        q_first, q_last = geo.q_tile_bounds()
        kv_first, kv_last = geo.kv_tile_bounds()
        # Only an undilated window fills a tile; a tile is empty when causality or the window rules out every pair.
        full = (kv_last <= q_first) & (q_last - kv_first < self.window) & (self.dilation == 1)
        empty = (kv_first > q_last) | (q_first - kv_last >= self.window)
        return classify(full=full, empty=empty)

    def dense(self, geo):
        q, kv = geo.dense_grid()
        distance = q - kv
        return (distance >= 0) & (distance < self.window) & (distance % self.dilation == 0)


# ----- the new pattern through the library ------------------------------------------------------------------------

@pytest.mark.parametrize("window,dilation", [(1, 1), (7, 1), (9, 3), (40, 4)])
@pytest.mark.parametrize("q_len,kv_len,block", [(1, 1, 16), (50, 50, 16), (100, 130, 32), (64, 64, 64)])
def test_dilated_window_capabilities_agree(window, dilation, q_len, kv_len, block):
    pattern = DilatedWindow(window, dilation)
    geo = Geometry(2, q_len, kv_len, block_size=block)
    dense = assert_pattern_consistent(pattern, geo)
    assert_key_runs_match_dense(pattern, geo)
    i = kv_len - 1  # the last query, against the definition key by key
    for k in range(kv_len):
        expected = k <= i and i - k < window and (i - k) % dilation == 0
        assert bool(dense[0, 0, i - geo.offset, k]) == expected, (i, k)


def test_dilated_window_with_left_padding():
    real = torch.ones(2, 40, dtype=torch.bool)
    real[1, :13] = False
    geo = Geometry(2, 40, block_size=16, positions=Positions.from_padding_mask(real, 40))
    dense = assert_pattern_consistent(DilatedWindow(10, 3), geo, batch=2)
    alone = DilatedWindow(10, 3).dense(Geometry(2, 27))[0, 0]
    assert torch.equal(dense[1, 0, 13:, 13:], alone)  # the padded sequence attends as it does alone
    assert not dense[1, :, :, :13].any()


def test_dilated_window_from_specs():
    assert PATTERNS["dilated_window"] is DilatedWindow is pattern_class("dilated_window")
    pattern = parse_pattern("dilated_window:window=6,dilation=3")
    assert isinstance(pattern, DilatedWindow) and (pattern.window, pattern.dilation) == (6, 3)
    layer = parse_stack(["causal+dilated_window:dilation=4"])[0]
    assert isinstance(layer[1], DilatedWindow) and (layer[1].window, layer[1].dilation) == (8, 4)
    with pytest.raises(ValueError, match="bad arguments in spec.*dilation must be >= 1"):
        parse_pattern("dilated_window:dilation=0")


def _dense_mask(patterns, head_modes, seq):
    """Reference mask [B, H, Q, KV] from each head's pattern."""
    geo = Geometry(head_modes.shape[-1], seq)
    rows = [[list(patterns.values())[int(m)].dense(geo)[0, 0] for m in row] for row in head_modes]
    return torch.stack([torch.stack(r) for r in rows])


@pytest.mark.parametrize("backend", ["flex_eager", "dense"])
def test_dilated_window_in_hybrid_attention_matches_the_reference(backend):
    patterns = {"full": Causal(), "dilated": DilatedWindow(12, 3), "ssa": SinkWindow(2, 5) | DilatedWindow(30, 5)}
    attn = HybridAttention(8, 4, 16, patterns, ["dilated", "full", "ssa", "dilated"], block_size=16,
                           backend=backend)
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 8, 70, 16, generator=gen)
    k, v = torch.randn(2, 4, 70, 16, generator=gen), torch.randn(2, 4, 70, 16, generator=gen)
    head_modes = attn.default_modes.repeat_interleave(2)[None].expand(2, -1)
    expected = reference(q, k, v, _dense_mask(patterns, head_modes, 70))
    torch.testing.assert_close(attn(q, k, v), expected, atol=2e-5, rtol=0)  # fp32 against the float64 reference


def test_dilated_window_saves_and_loads_with_a_converted_model(tmp_path):
    from flexsparse.integrations import convert, load_config, save_config
    from tests.hf_util import left_padded, tiny_model

    patterns = {"full": Causal(), "dilated": DilatedWindow(6, 2), "mix": SinkWindow(1, 3) | DilatedWindow(9, 4)}
    modes = [["full", "dilated"], ["dilated", "mix"], ["mix", "full"]]
    model = convert(tiny_model("llama"), patterns, modes, backend="dense")
    saved = json.loads(save_config(model, tmp_path).read_text())
    assert saved["patterns"]["dilated"] == {"type": "dilated_window", "window": 6, "dilation": 2}
    assert saved["patterns"]["mix"]["parts"][1] == {"type": "dilated_window", "window": 9, "dilation": 4}
    fresh = load_config(tiny_model("llama"), tmp_path)
    layer = fresh.model.layers[1].self_attn.flexsparse
    assert isinstance(layer.patterns["dilated"], DilatedWindow) and layer.mode_names == ["dilated", "mix"]
    ids, mask = left_padded([20, 12])
    with torch.no_grad():
        got, want = fresh(ids, attention_mask=mask).logits, model(ids, attention_mask=mask).logits
        full = tiny_model("llama")(ids, attention_mask=mask).logits
    torch.testing.assert_close(got, want, atol=0, rtol=0)
    assert (got - full)[mask.bool()].abs().max() > 1e-3  # the dilated heads changed the model


# ----- every registered pattern round-trips through its config -----------------------------------------------------

_TABLE = torch.rand(1, 2, 4, 4, generator=torch.Generator().manual_seed(3)) > 0.4
EXAMPLES = {
    "esa": [ESA(1, 3, 4, 2), ESA(0, 1, 5, 2)],
    "sink_window": [SinkWindow(3, 9), SinkWindow(4, 8, unit=2)],
    "triangle_mix": [TriangleMix(2, 6, last_q=5)],
    "xattention": [XAttention(0.8, stride=4, block_size=16),
                   XAttention([0.5, 0.95], stride=8, block_size=16, rule="minimal")],
    "block_table": [BlockTable(_TABLE, 16), BlockTable(_TABLE[:, :, 2:], 16, q_start=32)],
    "union": [Union(SinkWindow(2, 6), DilatedWindow(9, 3)), Union(Causal())],
    "intersection": [Intersection(Causal(), SinkWindow(0, 20), DilatedWindow(15, 2))],
    "per_head": [PerHead([Causal(), SinkWindow(1, 4) | TriangleMix(1, 4, 3)], [1, 0]),
                 PerHead([DilatedWindow(), ESA(2, 4, 3, 2)], torch.tensor([[0, 1], [1, 1]]))],
}
"""Patterns whose constructors need arguments; any other registered pattern is tried as ``cls()``."""


def _examples(name):
    found = EXAMPLES.get(name)
    if found is None:
        try:
            return [pattern_class(name)()]
        except TypeError as err:
            pytest.fail(f"pattern {name!r} needs constructor arguments: add an example to EXAMPLES ({err})")
    return found


def _same_behaviour(a, b):
    """Equal masks (static patterns) or equal resolved masks (XA, on fixed q/k): the last 32 queries of 64 keys."""
    heads = a.required_heads or 2
    geo = Geometry(heads, 32, 64, block_size=16)
    if a.is_dynamic:
        gen = torch.Generator().manual_seed(0)
        q, k = torch.randn(1, heads, 32, 16, generator=gen), torch.randn(1, heads, 64, 16, generator=gen)
        a, b = a.resolve(q, k), b.resolve(q, k)
    assert torch.equal(a.dense(geo), b.dense(geo))


@pytest.mark.parametrize("name", sorted(registered_patterns()))
def test_every_registered_pattern_round_trips_through_its_config(name):
    for pattern in _examples(name):
        config = pattern.config()
        assert config["type"] == name
        assert json.loads(json.dumps(config)) == config, "config() must be plain JSON data"
        rebuilt = Pattern.from_config(json.loads(json.dumps(config)))
        assert type(rebuilt) is type(pattern) and rebuilt.config() == config and repr(rebuilt) == repr(pattern)
        assert type(type(pattern).from_config(config)) is type(pattern)
        _same_behaviour(pattern, rebuilt)


def _without(config, key):
    return {k: v for k, v in config.items() if k != key}


@pytest.mark.parametrize("name", sorted(registered_patterns()))
def test_a_config_that_lacks_an_argument_is_refused_naming_it(name):
    """A saved config lacking any argument its pattern's config() writes does not load with the default."""
    for pattern in _examples(name):
        config = json.loads(json.dumps(pattern.config()))
        optional = type(pattern).optional_arguments
        for key in config:
            if key == "type":
                continue
            if key in optional:
                assert Pattern.from_config(_without(config, key)).config() == pattern.config()
                continue
            message = rf"config of '{name}' lacks \['{key}'\]: a config names every argument"
            with pytest.raises(ValueError, match=message):
                Pattern.from_config(_without(config, key))
            with pytest.raises(ValueError, match=message):
                type(pattern).from_config(_without(config, key))


def test_a_part_of_a_combination_that_lacks_an_argument_is_refused_naming_it():
    inner = {"type": "sink_window", "sink": 2, "window": 6, "unit": 1}
    for kind in ("union", "intersection"):
        config = {"type": kind, "parts": [{"type": "causal"}, _without(inner, "window")]}
        with pytest.raises(ValueError, match=r"config of 'sink_window' lacks \['window'\]"):
            Pattern.from_config(config)
        with pytest.raises(ValueError, match=rf"config of '{kind}' lacks \['parts'\]"):
            Pattern.from_config({"type": kind})
    per_head = PerHead([Causal(), SinkWindow(2, 6) | DilatedWindow(9, 3)], [1, 0]).config()
    per_head["patterns"][1]["parts"][1].pop("dilation")
    with pytest.raises(ValueError, match=r"config of 'dilated_window' lacks \['dilation'\]"):
        Pattern.from_config(per_head)


def test_a_saved_file_that_lacks_an_argument_is_refused(tmp_path):
    """The user's report: "window" deleted from flexsparse.json loaded as SinkWindow(window=2048), not the saved 16."""
    from flexsparse.integrations import check_config, convert, load_config, save_config
    from tests.hf_util import tiny_model

    model = convert(tiny_model("llama"), {"full": Causal(), "ssa": SinkWindow(4, 16)}, [["full", "ssa"]] * 3,
                    backend="dense", router="head")
    path = save_config(model, tmp_path)
    good = json.loads(path.read_text())
    assert check_config(tmp_path) == path
    lacking_window = {**good, "patterns": {**good["patterns"], "ssa": _without(good["patterns"]["ssa"], "window")}}
    router = good["layers"][0]["router"]
    lacking_pool = {**good, "layers": [{**entry, "router": _without(router, "pool_size")} for entry in good["layers"]]}
    for config, message in [(lacking_window, r"config of 'sink_window' lacks \['window'\]"),
                            (lacking_pool, r"config of a 'head' router lacks \['pool_size'\]")]:
        path.write_text(json.dumps(config))
        for load in (lambda: load_config(tiny_model("llama"), tmp_path), lambda: check_config(tmp_path)):
            with pytest.raises(ValueError, match=message) as info:
                load()
            assert str(path) in str(info.value)


def test_check_config_finds_what_load_config_would_refuse_without_a_model(tmp_path):
    from flexsparse.integrations import check_config, convert, save_config
    from tests.hf_util import tiny_model

    path = save_config(convert(tiny_model("llama"), {"full": Causal(), "ssa": SinkWindow(4, 16)},
                               [["full", "ssa"]] * 3, backend="dense", router="head"), tmp_path)
    good = json.loads(path.read_text())
    with pytest.raises(ValueError, match="no saved flexsparse configuration"):
        check_config(tmp_path / "elsewhere")
    cases = [({**good, "layers": [{**good["layers"][0], "modes": ["full", "xa"]}] * 3},
              r"layers\[0\] has modes \['xa'\] that its patterns \['full', 'ssa'\] lack"),
             ({**good, "patterns": {"full": {"type": "causal"}, "ssa": {"type": "nope"}}},
              "unknown pattern type 'nope'"),
             ({**good, "version": 9}, "has version 9")]
    for config, message in cases:
        path.write_text(json.dumps(config))
        with pytest.raises(ValueError, match=message):
            check_config(path)
    path.write_text(json.dumps(good))
    (tmp_path / good["weights"]).unlink()
    with pytest.raises(ValueError, match="learned tensors 'flexsparse.safetensors' are not beside it"):
        check_config(tmp_path)


def test_configs_name_their_arguments():
    assert SinkWindow(4, 8).config() == {"type": "sink_window", "sink": 4, "window": 8, "unit": 1}
    assert XAttention([0.5, 0.9]).config()["threshold"] == [0.5, 0.9]  # per-head thresholds as a list
    assert (Causal() | SinkWindow(0, 3)).config() == {
        "type": "union", "parts": [{"type": "causal"}, {"type": "sink_window", "sink": 0, "window": 3, "unit": 1}]}
    modes = [0, 1]
    per_head = PerHead([Causal(), SinkWindow(1, 2)], modes)
    modes[0] = 1  # the config records the arguments as they were passed
    assert per_head.config()["modes"] == [0, 1]
    table = BlockTable(torch.tensor([[[[True, False], [True, True]]]]), 16)
    assert table.config() == {"type": "block_table", "table": [[[[True, False], [True, True]]]], "table_block": 16,
                               "q_start": 0}


def test_configs_written_before_the_registry_still_load():
    """The entries save_config wrote with its per-class table (XA without "compile", thresholds as a float)."""
    old = {
        "full": ({"type": "causal"}, Causal()),
        "ssa": ({"type": "sink_window", "sink": 4, "window": 16, "unit": 2}, SinkWindow(4, 16, unit=2)),
        "esa": ({"type": "esa", "layer_idx": 1, "num_layers": 3, "attn_length": 3, "num_heads": 4}, ESA(1, 3, 3, 4)),
        "ta": ({"type": "triangle_mix", "sink": 1, "window": 4, "last_q": 2}, TriangleMix(1, 4, 2)),
        "xa": ({"type": "xattention", "threshold": 0.9, "stride": 8, "block_size": 32, "rule": "minimal"},
               XAttention(0.9, 8, 32, rule="minimal")),
        "xa_heads": ({"type": "xattention", "threshold": [0.5, 0.75], "stride": 16, "block_size": 128,
                      "rule": "plus_one"}, XAttention([0.5, 0.75])),
        "mix": ({"type": "union", "parts": [{"type": "causal"}, {"type": "sink_window", "sink": 0, "window": 4,
                                                                "unit": 1}]}, Causal() | SinkWindow(0, 4)),
        "both": ({"type": "intersection", "parts": [{"type": "causal"}]}, Intersection(Causal())),
    }
    for name, (entry, expected) in old.items():
        loaded = Pattern.from_config(entry)
        assert loaded.config() == expected.config(), name
        _same_behaviour(loaded, expected)


# ----- errors ----------------------------------------------------------------------------------------------------

def test_a_taken_name_is_refused():
    with pytest.raises(ValueError, match=r"pattern name 'causal' of .*Impostor is taken by "
                                         r"flexsparse\.masks\.window\.Causal"):
        class Impostor(Causal):
            name = "causal"
    with pytest.raises(ValueError, match="pattern name 'dilated_window' .* is taken by .*DilatedWindow"):
        class Other(DilatedWindow):
            name = "dilated_window"
    with pytest.raises(ValueError, match="name must be an identifier"):
        class Spaced(Causal):
            name = "causal window"
    assert pattern_class("causal") is Causal and pattern_class("dilated_window") is DilatedWindow


def test_defining_the_same_class_again_replaces_it(monkeypatch):
    """A module reloaded (or a notebook cell run again) defines its classes again under the same names."""
    monkeypatch.setattr(pattern_base, "_REGISTRY", dict(registered_patterns()))

    def define():
        class Reloaded(Causal):
            name = "reloaded_causal"
        return Reloaded

    first, second = define(), define()
    assert first is not second and pattern_class("reloaded_causal") is second


def test_unknown_names_list_the_known_ones():
    with pytest.raises(ValueError, match=r"unknown pattern type 'nope'; known: \[.*'causal'.*'dilated_window'"):
        pattern_class("nope")
    with pytest.raises(ValueError, match=r"unknown pattern type 'nope'; known: \[.*'sink_window'"):
        Pattern.from_config({"type": "nope"})
    with pytest.raises(ValueError, match=r"unknown pattern 'nope' in spec 'nope:x=1'; known: \[.*'dilated_window'"):
        parse_pattern("nope:x=1")


def test_bad_configs_are_value_errors():
    cases = [
        ({"sink": 4}, "a pattern config is a dict with a 'type'"),
        ([("type", "causal")], "a pattern config is a dict with a 'type'"),
        ({"type": "sink_window", "size": 4},
         r"config of 'sink_window' has unknown keys \['size'\]; known: \['sink', 'window', 'unit'\]"),
        ({"type": "esa", "layer_idx": 0, "num_layers": 2}, r"config of 'esa' lacks \['attn_length', 'num_heads'\]"),
        ({"type": "sink_window", "sink": "4", "window": 8, "unit": 1},
         "bad arguments in the config .*sink must be an int"),
        ({"type": "sink_window", "sink": 4, "window": 0, "unit": 1}, "window must be >= 1"),
        ({"type": "union", "parts": [{"type": "causal"}, {"kind": "causal"}]}, "dict with a 'type'"),
        ({"type": "union", "parts": 3}, r"bad arguments in the config"),
        ({"type": "block_table", "table": [[[[1, 0]]]], "table_block": 16, "q_start": 0},
         "table must be a bool tensor"),
    ]
    for config, message in cases:
        with pytest.raises(ValueError, match=message):
            Pattern.from_config(config)
    with pytest.raises(ValueError, match="SinkWindow.from_config got a config of Causal"):
        SinkWindow.from_config({"type": "causal"})


def test_patterns_json_cannot_describe_are_refused():
    class Unnamed(Causal):  # inherits "causal" but behaves differently: not registered, not describable
        pass

    with pytest.raises(TypeError, match=r"cannot describe Unnamed\(\) \(Unnamed\) in JSON"):
        Unnamed().config()
    with pytest.raises(TypeError, match="cannot describe"):
        (SinkWindow(1, 2) | Unnamed()).config()



def test_arguments_json_cannot_carry_are_refused(monkeypatch):
    monkeypatch.setattr(pattern_base, "_REGISTRY", dict(registered_patterns()))

    class Shifted(Causal):
        name = "shifted_test"

        def __init__(self, shift=lambda i: i) -> None:
            self.shift = shift

    with pytest.raises(TypeError, match=r"cannot describe Shifted argument 'shift' \(function\) in JSON"):
        Shifted().config()


# ----- routers: one registry too ---------------------------------------------------------------------------------

def test_routers_register_once_by_kind():
    from flexsparse.routers import HeadRouter, LayerRouter, Router, registered_routers, router_class

    assert dict(registered_routers()) == {"head": HeadRouter, "layer": LayerRouter}

    class Tuned(HeadRouter):  # no kind of its own: not registered, "head" stays HeadRouter
        pass

    assert router_class("head") is HeadRouter
    with pytest.raises(ValueError, match=r"router kind 'layer' of .*Impostor is taken by .*LayerRouter"):
        class Impostor(HeadRouter):
            kind = "layer"
    with pytest.raises(ValueError, match=r"unknown router kind 'mlp'; known: \['head', 'layer'\]"):
        Router.from_config({"kind": "mlp", "head_dim": 8})
    assert type(Router.from_config(LayerRouter(8).config())) is LayerRouter
    saved = LayerRouter(8, full_mode=1, sparse_mode=0).config()
    for key in Router.config_keys:  # a config names every argument, as a pattern's does
        with pytest.raises(ValueError, match=rf"config of a 'layer' router lacks \['{key}'\]"):
            Router.from_config({k: v for k, v in saved.items() if k != key})
