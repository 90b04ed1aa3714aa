"""flexsparse.calibrate and `flexsparse calibrate` on the real default model (SmolLM2-135M-Instruct), CPU.

Checks: the captured q/k give the retrieval scores computed from the model's own eager attention weights; the
model is unchanged by calibration; DuoAttention-style gates at 1 and 0 give the full and the converted sparse
model, and per-head gates map to the right heads; gate training reaches every gate; budgets select the top
scores per layer or over the model; a calibrated configuration saves, loads with the same modes and lowers the
measured density in `flexsparse eval --config`.
"""

import json
import re

import pytest
import torch

from tests.real_model import brute_tile_density, real_corpus, real_model, requires_model

LAYERS, KV_HEADS = 30, 3
SPARSE = {"sink": 16, "window": 64}


def _window():
    from flexsparse.masks import SinkWindow

    return SinkWindow(**SPARSE)


def test_budgets_select_the_top_scores_per_layer_or_over_the_model():
    from flexsparse.eval.calibration import select

    scores = torch.arange(LAYERS * KV_HEADS, dtype=torch.float32).flip(0).view(LAYERS, KV_HEADS) % 7
    per_layer = select(scores, 1 / 3)
    assert all(modes.count("full") == 1 for modes in per_layer)
    assert all(modes[int(scores[i].argmax())] == "full" for i, modes in enumerate(per_layer))
    spread = select(scores, 1 / 3, per_layer=False)
    chosen = torch.tensor([[m == "full" for m in modes] for modes in spread])
    assert int(chosen.sum()) == 30
    assert float(scores[chosen].min()) >= float(scores[~chosen].max())  # the top 30 scores of the model
    assert len({int(row.sum()) for row in chosen}) > 1  # not the same count in every layer
    per_layer_scores = torch.arange(LAYERS, dtype=torch.float32)[:, None].expand(-1, KV_HEADS)
    layers = select(per_layer_scores, 0.2, layer_scores=True)
    assert [modes for modes in layers if modes == ["full"] * KV_HEADS] == [["full"] * KV_HEADS] * 6
    assert select(scores, 0.0) == [["sparse"] * KV_HEADS] * LAYERS
    with pytest.raises(ValueError, match="budget"):
        select(scores, 1.5)


@requires_model
def test_captured_retrieval_scores_equal_the_models_eager_attention_weights():
    from flexsparse.eval.calibration import needle_inputs, retrieval_head_scores

    loaded = real_model()
    model = loaded.model
    inputs = needle_inputs(real_corpus(), loaded.tokenizer, 256, 1)
    scores = retrieval_head_scores(model, inputs)
    assert model.config._attn_implementation == "sdpa"  # restored
    model.set_attn_implementation("eager")
    try:
        with torch.no_grad():
            attentions = model(inputs.ids, output_attentions=True).attentions
    finally:
        model.set_attn_implementation("sdpa")
    mask = inputs.needle_mask[0]
    expected = torch.stack([a[0, :, -1, mask].sum(-1).view(KV_HEADS, -1).mean(-1) for a in attentions])
    torch.testing.assert_close(scores, expected.float(), atol=1e-5, rtol=1e-4)


@requires_model
def test_gates_at_one_and_zero_give_the_full_and_the_converted_model():
    from flexsparse.eval.gates import gated
    from flexsparse.integrations import convert, revert
    from flexsparse.masks import Causal

    model = real_model().model
    ids = real_corpus().windows(128, 1)
    decoder = model.get_decoder()
    hidden = lambda: decoder(input_ids=ids, use_cache=False).last_hidden_state
    with torch.no_grad():
        full = hidden()
        gates = torch.full((LAYERS, KV_HEADS), -40.0)
        gates[:, 0] = 40.0  # head 0 full, heads 1-2 sparse
        with gated(model, gates, _window()):
            mixed = hidden()
        with gated(model, torch.full((LAYERS, KV_HEADS), 40.0), _window()):
            all_full = hidden()
        convert(model, {"full": Causal(), "sparse": _window()}, [["full", "sparse", "sparse"]] * LAYERS,
                backend="dense")
        try:
            converted = hidden()
        finally:
            revert(model)
    torch.testing.assert_close(all_full, full, atol=2e-4, rtol=1e-4)
    torch.testing.assert_close(mixed, converted, atol=2e-4, rtol=1e-4)
    assert (mixed - full).abs().max() > 0.1  # the sparse heads change the output
    with pytest.raises(ValueError, match=r"logits must be a tensor \[L, H_kv\]"):
        with gated(model, torch.zeros(LAYERS, 2), _window()):
            pass


@requires_model
def test_gate_training_reaches_every_gate():
    from flexsparse.eval.calibration import calibration_scores
    from flexsparse.eval.gates import GateOptions, gated

    loaded = real_model()
    model, ids = loaded.model, real_corpus().windows(128, 1, split="calibration")
    logits = torch.zeros(LAYERS, KV_HEADS, requires_grad=True)
    decoder = model.get_decoder()
    with torch.no_grad():
        target = decoder(input_ids=ids, use_cache=False).last_hidden_state
    with gated(model, logits, _window()):
        loss = (decoder(input_ids=ids, use_cache=False).last_hidden_state - target).pow(2).mean()
    loss.backward()
    assert bool(torch.isfinite(logits.grad).all())
    assert int((logits.grad < 0).sum()) >= LAYERS  # raising a gate towards full lowers the distillation loss
    assert logits.grad.abs().min() > 0 and logits.grad.unique().numel() == LAYERS * KV_HEADS
    scores = calibration_scores(model, loaded.tokenizer, "gates", sparse=_window(), corpus=real_corpus(),
                                length=128, samples=2, gates=GateOptions(steps=1))
    assert scores.shape == (LAYERS, KV_HEADS)
    assert bool(((scores > 0) & (scores < torch.sigmoid(torch.tensor(2.0)))).all())  # below the initial gate


@requires_model
def test_hsa_and_entropy_scores_leave_the_model_unchanged():
    from flexsparse.eval.calibration import calibration_scores

    loaded = real_model()
    ids = real_corpus().windows(128, 1)
    with torch.no_grad():
        before = loaded.model(ids).logits
    hsa = calibration_scores(loaded.model, loaded.tokenizer, "hsa", sparse=_window(), corpus=real_corpus(),
                             length=128, samples=1)
    entropy = calibration_scores(loaded.model, loaded.tokenizer, "entropy", corpus=real_corpus(), length=128,
                                 samples=1)
    assert hsa.shape == entropy.shape == (LAYERS, KV_HEADS)
    assert bool((hsa > 0).all()) and bool(torch.isfinite(hsa).all())
    assert bool((entropy[:, 0] > 0).all()) and bool((entropy == entropy[:, :1]).all())
    with torch.no_grad():
        assert torch.equal(loaded.model(ids).logits, before)
    assert loaded.model.config._attn_implementation == "sdpa"


@requires_model
def test_calibrate_saves_a_config_that_loads_and_lowers_density(tmp_path, capsys):
    import flexsparse
    from flexsparse.cli import main
    from flexsparse.integrations import layer_modes, load_config, revert

    loaded = real_model()
    result = flexsparse.calibrate(loaded.model, loaded.tokenizer, method="retrieval", sparse=_window(),
                                  corpus=real_corpus(), length=256, samples=1)
    assert result.full_fraction == pytest.approx(1 / 3)
    assert all(modes.count("full") == 1 for modes in result.modes)
    result.save(loaded.model, tmp_path / "api")
    load_config(loaded.model, tmp_path / "api")
    try:
        assert layer_modes(loaded.model) == result.modes
    finally:
        revert(loaded.model)
    saved = json.loads((tmp_path / "api" / "calibration.json").read_text())
    assert saved["method"] == "retrieval" and len(saved["scores"]) == LAYERS

    config = tmp_path / "cli"
    assert main(["calibrate", "--method", "retrieval", "--global", "--length", "256", "--samples", "1",
                 "--sink", "16", "--window", "64", "--out", str(config), "--quiet"]) == 0
    assert "of the KV heads full (global budget)" in capsys.readouterr().out
    assert main(["eval", "--config", str(config), "--methods", "--tasks", "perplexity", "--lengths", "512",
                 "--trials", "1", "--out", str(tmp_path / "eval"), "--quiet", "--no-plot"]) == 0
    records = json.loads((tmp_path / "eval" / "results.json").read_text())
    assert [r["domain"] for r in records] == ["pydoc", "code"]  # perplexity on both text domains
    record = records[0]
    modes = json.loads((config / "flexsparse.json").read_text())["layers"]
    full = sum(m == "full" for layer in modes for m in layer["modes"]) / (LAYERS * KV_HEADS)
    assert full == pytest.approx(1 / 3)
    sparse = brute_tile_density(16, 64, 512, 128)
    assert record["method"] == "config:cli"
    assert record["density"] == pytest.approx(full + (1 - full) * sparse, abs=1e-6)
    assert record["density"] < 0.95


@pytest.mark.parametrize("argv, message", [
    (["--budget", "1.5"], "--budget must be a fraction"),
    (["--method", "magic"], "invalid choice"),
])
def test_cli_calibrate_rejects_bad_input(argv, message, tmp_path, capsys):
    from flexsparse.cli import main

    try:
        code = main(["calibrate", "--out", str(tmp_path), *argv])
    except SystemExit as exit_:  # argparse's own usage errors
        code = exit_.code
    assert code == 2
    assert message in capsys.readouterr().err


def _additive(weights: torch.Tensor):
    """An objective whose best choice keeps the heads of largest weight (lower is better)."""
    calls = []

    def objective(full: torch.Tensor) -> float:
        calls.append(full.clone())
        return -float(weights[full].sum())
    return objective, calls


def test_per_layer_search_finds_each_layers_best_heads_and_keeps_the_counts():
    from flexsparse.eval.head_search import refine_per_layer

    weights = torch.rand(6, 4, generator=torch.Generator().manual_seed(0))
    start = torch.zeros(6, 4, dtype=torch.bool)
    start[:, 0] = True
    start[2, 1] = True  # layer 2 keeps two heads
    objective, calls = _additive(weights)
    found, value = refine_per_layer(start, objective, rounds=2)
    assert found.sum(1).tolist() == start.sum(1).tolist()
    for layer in range(6):
        best = weights[layer].topk(int(start[layer].sum())).indices
        assert set(torch.nonzero(found[layer]).flatten().tolist()) == set(best.tolist())
    assert value == -float(weights[found].sum()) < -float(weights[start].sum())
    # one sweep finds a separable optimum; the second sweep changes nothing and ends the search
    assert len(calls) == 1 + 2 * (5 * 3 + 5)


def test_swap_search_moves_full_heads_between_layers_under_the_budget():
    from flexsparse.eval.head_search import refine_by_swaps

    weights = torch.rand(5, 3, generator=torch.Generator().manual_seed(1))
    start = torch.zeros(5, 3, dtype=torch.bool)
    start[:, 0] = True
    objective, _ = _additive(weights)
    found, value = refine_by_swaps(start, weights, objective, rounds=10, candidates=15)
    assert int(found.sum()) == 5
    assert set(torch.nonzero(found.flatten()).flatten().tolist()) == set(weights.flatten().topk(5).indices.tolist())
    assert value == -float(weights[found].sum())
    unchanged, _ = refine_by_swaps(found, weights, objective, rounds=3)
    assert torch.equal(unchanged, found)  # a local optimum stays
    with pytest.raises(ValueError, match="candidates"):
        refine_by_swaps(start, weights, objective, candidates=0)


@requires_model
def test_search_objective_is_the_converted_models_nll():
    import math

    from flexsparse.eval.head_search import ModelObjective, SearchOptions
    from flexsparse.eval.runner import perplexity
    from flexsparse.integrations import convert, revert
    from flexsparse.masks import Causal

    loaded = real_model()
    model, corpus = loaded.model, real_corpus()
    options = SearchOptions(text_length=128, text_windows=1, passkey_prompts=0)
    objective = ModelObjective(model, loaded.tokenizer, corpus, _window(), options, length=128)
    choice = torch.zeros(LAYERS, KV_HEADS, dtype=torch.bool)
    choice[:, 1] = True
    with objective.gates_on():
        gated_value = objective(choice)
        full_value = objective(torch.ones(LAYERS, KV_HEADS, dtype=torch.bool))
    windows = corpus.windows(128, 1, split="calibration")
    assert full_value == pytest.approx(math.log(perplexity(model, windows, 1)), rel=1e-4)
    convert(model, {"full": Causal(), "sparse": _window()}, [["sparse", "full", "sparse"]] * LAYERS,
            backend="dense")
    try:
        converted = math.log(perplexity(model, windows, 1))
    finally:
        revert(model)
    assert gated_value == pytest.approx(converted, rel=1e-4)
    assert abs(gated_value - full_value) > 1e-3  # the sparse heads change the loss at 128 tokens, window 64


@requires_model
@pytest.mark.parametrize("per_layer", [True, False])
def test_search_calibration_keeps_the_budget_and_lowers_its_objective(per_layer):
    from flexsparse.eval.calibration import calibrate
    from flexsparse.eval.gates import GateOptions
    from flexsparse.eval.head_search import SearchOptions
    from tests.hf_util import tiny_model

    tokenizer = real_model().tokenizer  # real text and prompts on a small random model: a fast search
    model = tiny_model("llama", vocab_size=len(tokenizer), num_hidden_layers=4, max_position_embeddings=512)
    result = calibrate(model, tokenizer, method="search", budget=0.5, per_layer=per_layer, sparse=_window(),
                       corpus=real_corpus(), length=160, samples=2, gates=GateOptions(steps=2),
                       search=SearchOptions(text_windows=1, passkey_prompts=1, candidates=2))
    counts = [modes.count("full") for modes in result.modes]
    assert sum(counts) == 4 and (counts == [1] * 4 or not per_layer)
    assert result.search["objective"] <= result.search["objective_start"]
    assert result.search["evaluations"] >= 1 + 4  # the start, then one other choice per layer at least
    assert model.config._attn_implementation == "sdpa"  # restored
    with pytest.raises(ValueError, match="own budget"):
        result.reselect(0.25)
    with pytest.raises(ValueError, match="tp_size"):
        calibrate(model, tokenizer, method="search", corpus=real_corpus(), length=160, samples=2, tp_size=2,
                  gates=GateOptions(steps=1))


# ----- every input refused before the model loads, every argument checked first --------------------------------

@pytest.fixture
def no_model(monkeypatch):
    """Fails the test if the command loads a model: bad input must be refused before."""
    from flexsparse.eval import models

    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded before the bad input was refused")

    monkeypatch.setattr(models, "load_model", refuse)


@pytest.mark.parametrize("argv, message", [
    (["--length", "0"], "--length must be >= 64, got 0"),
    (["--length", "32"], "--length must be >= 64, got 32"),
    (["--samples", "0"], "--samples must be >= 1, got 0"),
    (["--gate-steps", "0"], "--gate-steps must be >= 1, got 0"),
    (["--search-length", "0"], "--search-length must be >= 64, got 0"),
    (["--window", "0"], "--window must be >= 1, got 0"),
    (["--sink", "-1"], "--sink must be >= 0, got -1"),
    (["--length", "256"], ("--length 256, --sink 64, --window 256: the calibration prompts fit inside the sparse "
                           "pattern's reach (sink + window = 64 + 256 = 320 >= 256)")),
    (["--length", "300", "--sink", "0", "--window", "300"],
     "calibrate on prompts longer than 300 tokens, or with a smaller sink + window"),
    (["--text", "/nonexistent/corpus.txt"], "--text: cannot read /nonexistent/corpus.txt"),
])
def test_cli_calibrate_refuses_bad_numbers_before_loading_the_model(argv, message, no_model, tmp_path, capsys):
    from flexsparse.cli import main

    assert main(["calibrate", "--out", str(tmp_path / "out"), *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("flexsparse calibrate: error:") and message in err[0], err


def test_cli_calibrate_refuses_an_out_it_cannot_write_into(no_model, tmp_path, capsys):
    from flexsparse.cli import main

    taken = tmp_path / "taken"
    taken.write_text("a file")
    assert main(["calibrate", "--out", str(taken), "--length", "512"]) == 2
    assert f"--out {taken}: is a file, not a folder" in capsys.readouterr().err


class _Tokenizer:
    """Enough of a tokenizer for the argument checks (none of these tests builds a prompt)."""

    def __call__(self, text, **kwargs):
        return {"input_ids": [1] * len(text.split())}

    def decode(self, ids):
        return " ".join("w" for _ in ids)


def _sparse_too_wide():
    from flexsparse.masks import SinkWindow, TriangleMix

    return TriangleMix(sink=8, window=120, last_q=16) | SinkWindow(0, 128)


SPARSE_TOO_WIDE = _sparse_too_wide()
"""A sparse pattern that is no pattern at 128 tokens: every query attends every earlier key."""


def test_calibrate_checks_every_argument_first():
    """flexsparse.calibrate(model, None, ...) failed deep inside with "'NoneType' object is not callable"."""
    import flexsparse
    from flexsparse.eval.gates import GateOptions
    from flexsparse.integrations import convert, revert
    from flexsparse.masks import Causal
    from tests.hf_util import tiny_model

    model, tokenizer = tiny_model("llama"), _Tokenizer()
    cases = [
        ({"model": None}, TypeError, "model must be a transformers PreTrainedModel, got NoneType"),
        ({"model": torch.nn.Linear(2, 2)}, TypeError, "model must be a transformers PreTrainedModel, got Linear"),
        ({"tokenizer": None}, TypeError,
         "tokenizer must be the model's tokenizer (callable, with decode), got NoneType"),
        ({"method": "magic"}, ValueError, "method must be one of"),
        ({"budget": 1.5}, ValueError, "budget must be <= 1"),
        ({"budget": "half"}, TypeError, "budget must be a"),
        ({"per_layer": 1}, TypeError, "per_layer must be a bool"),
        ({"sparse": "ssa"}, TypeError, "sparse must be a flexsparse Pattern, got str"),
        ({"corpus": "some text"}, TypeError, "corpus must be a flexsparse.eval.Corpus or None, got str"),
        ({"length": 0}, ValueError, "length must be >= 64"),
        ({"length": 512.0}, TypeError, "length must be an int"),
        ({"samples": 0}, ValueError, "samples must be >= 1"),
        ({"batch_size": 0}, ValueError, "batch_size must be >= 1"),
        ({"gates": {"steps": 2}}, TypeError, "gates must be a GateOptions, got dict"),
        ({"search": None}, TypeError, "search must be a SearchOptions, got NoneType"),
        ({"seed": None}, TypeError, "seed must be an int"),
        ({"progress": "yes"}, TypeError, "progress must be a bool"),
        ({"tp_size": 0}, ValueError, "tp_size must be >= 1"),
        ({"length": 256}, ValueError,
         "the calibration prompts fit inside the sparse pattern's reach (sink + window = 64 + 256 = 320 >= 256)"),
        ({"length": 128, "sparse": SPARSE_TOO_WIDE}, ValueError, "attends every earlier key of 128 tokens"),
    ]
    for change, error, message in cases:
        arguments = {"model": model, "tokenizer": tokenizer, "length": 512, **change}
        with pytest.raises(error, match=re.escape(message)):
            flexsparse.calibrate(arguments.pop("model"), arguments.pop("tokenizer"), **arguments)
    convert(model, {"full": Causal(), "ssa": _window()}, [["full", "ssa"]] * 3, backend="dense")
    try:
        with pytest.raises(ValueError, match=re.escape("model must not be converted")):
            flexsparse.calibrate(model, tokenizer, length=512)
    finally:
        revert(model)
    with pytest.raises(ValueError, match="steps must be >= 1"):
        GateOptions(steps=0)
    with pytest.raises(ValueError, match="lr must be > 0"):
        GateOptions(lr=0.0)


def test_gate_training_says_what_it_will_cost_once(capsys):
    from flexsparse.eval.gates import GateOptions, gate_scores
    from tests.hf_util import VOCAB, tiny_model

    ids = torch.randint(1, VOCAB, (2, 64), generator=torch.Generator().manual_seed(0))
    gate_scores(tiny_model("llama"), ids, _window(), options=GateOptions(steps=3), progress=True)
    lines = [line for line in capsys.readouterr().err.replace("\r", "\n").splitlines() if "gate training" in line]
    assert len(lines) == 1, lines
    assert re.fullmatch(r"gate training: 3 steps of 1 x 64 tokens on cpu; the first took \d+ s, so the other 2 "
                        r"will take about \d+ s \(fewer steps: GateOptions.steps, --gate-steps\)", lines[0])
    gate_scores(tiny_model("llama"), ids, _window(), options=GateOptions(steps=3), progress=False)
    assert capsys.readouterr().err == ""
