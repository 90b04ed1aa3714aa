"""`flexsparse calibrate --method frontier` and its parts on the real default model (SmolLM2-135M-Instruct), CPU.

Checks: the options' closed-form costs (tiles against enumeration, KV shares) and their refusals; a model run with a
per-head choice of options has the converted model's loss; the first-order effects predict single-head changes of
the objective; the command end to end at 512 tokens meets its budget, writes a monotone frontier, tables and a
configuration that loads with the chosen modes; bad budgets, unreachable budgets and windows that reach the whole
length are one-line errors (exit 2) before the model loads.
"""

import json
import math
import re
import time

import pytest
import torch

from tests.real_model import brute_tile_density, real_corpus, real_model, requires_model

LAYERS, KV_HEADS = 30, 3


def test_option_costs_are_the_patterns_tiles_and_kept_keys():
    from flexsparse.eval.head_options import head_options

    options = head_options(1024, windows=[64, 256], sink=32, xa_thresholds=[0.8, 0.9])
    assert options.names == ["full", "window_64", "window_256", "xa_0.9", "xa_0.8"]
    tiles, kv = options.static_tiles(), options.kv_shares()
    assert tiles[0] == 1.0 and bool(tiles[3:].isnan().all())
    for i, window in ((1, 64), (2, 256)):
        assert float(tiles[i]) == pytest.approx(brute_tile_density(32, window, 1024, 128))
        assert float(kv[i]) == (32 + window) / 1024
    assert kv[0] == kv[3] == kv[4] == 1.0
    floors = options.floors()
    assert floors["kv"] == (32 + 64) / 1024
    assert floors["tiles"] == pytest.approx(brute_tile_density(1, 1, 1024, 128))  # XAttention keeps at least these
    assert head_options(600).names == ["full", "window_128", "window_256", "window_512", "xa_0.9", "xa_0.8"]


@pytest.mark.parametrize("kwargs, message", [
    ({"length": 128}, "fits in one tile"),
    ({"length": 512, "windows": [448]}, r"reaches every key at length 512"),
    ({"length": 512, "windows": [64, 64]}, "repeats"),
    ({"length": 512, "xa_thresholds": [1.0]}, r"in \(0, 1\)"),
    ({"length": 180, "windows": None, "xa_thresholds": []}, "no sparse option"),
])
def test_options_refuse_what_cannot_save_anything(kwargs, message):
    from flexsparse.eval.head_options import head_options

    with pytest.raises(ValueError, match=message):
        head_options(**kwargs)


def test_the_sweep_runs_from_the_cheapest_reachable_to_all_full_through_your_budget():
    from flexsparse.eval.budget import Budget
    from flexsparse.eval.frontier import budget_scales

    scales = budget_scales(Budget(tiles=0.4, kv=0.5), {"tiles": 0.1, "kv": 0.25}, 4)
    assert scales == sorted(scales) and 1.0 in scales and len(scales) == 5
    assert scales[0] == pytest.approx(0.5)  # kv reaches its floor first: 0.25 / 0.5
    assert scales[-1] == pytest.approx(2.5)  # the tiles limit reaches 1
    assert Budget(tiles=0.4, kv=0.5).scaled(scales[-1]) == Budget(tiles=1.0, kv=1.0)


@requires_model
def test_a_run_with_per_head_options_is_the_converted_model():
    from flexsparse.eval.head_options import convert_choice, head_options, options_applied
    from flexsparse.eval.runner import perplexity
    from flexsparse.integrations import revert

    model, windows = real_model().model, real_corpus().windows(256, 1, split="calibration")
    options = head_options(256, windows=[32, 64], sink=16, xa_thresholds=[0.9])
    choice = torch.randint(0, 4, (LAYERS, KV_HEADS), generator=torch.Generator().manual_seed(0))
    choice[0] = 0  # an all-full layer runs the model's own attention
    with options_applied(model, options, choice):
        applied = perplexity(model, windows, 1)
        choice.zero_()  # changed in place between forwards
        full = perplexity(model, windows, 1)
    assert model.config._attn_implementation == "sdpa"
    assert full == pytest.approx(perplexity(model, windows, 1), rel=1e-5)
    choice = torch.randint(0, 4, (LAYERS, KV_HEADS), generator=torch.Generator().manual_seed(0))
    choice[0] = 0
    convert_choice(model, options, choice, backend="dense")
    try:
        converted = perplexity(model, windows, 1)
    finally:
        revert(model)
    assert applied == pytest.approx(converted, rel=1e-4)
    assert applied > full * 1.01
    bad = torch.zeros(LAYERS, 2, dtype=torch.long)
    with pytest.raises(ValueError, match=r"choice must be a long tensor \[30, 3\]"), options_applied(model, options, bad):
        pass


@requires_model
def test_first_order_effects_predict_single_head_changes():
    from flexsparse.eval.head_options import head_options, options_applied
    from flexsparse.eval.head_search import CalibrationObjective, SearchOptions
    from flexsparse.eval.option_effects import option_effects

    loaded = real_model()
    options = head_options(256, windows=[64], sink=16, xa_thresholds=[])
    objective = CalibrationObjective(loaded.model, loaded.tokenizer, real_corpus(),
                                     SearchOptions(text_windows=1, passkey_prompts=1), 256)
    effects = option_effects(loaded.model, objective, options)
    assert effects.effects.shape == effects.magnitudes.shape == (LAYERS, KV_HEADS, 2)
    assert bool((effects.effects[:, :, 0] == 0).all()) and bool((effects.magnitudes[:, :, 0] == 0).all())
    assert bool((effects.magnitudes >= effects.effects.abs() - 1e-12).all())
    assert bool((effects.tiles[:, :, 1] == options.static_tiles()[1]).all())
    scores = effects.scores(0.1)
    assert torch.allclose(scores, effects.effects.clamp(min=0) + 0.1 * effects.magnitudes)
    choice = torch.zeros(LAYERS, KV_HEADS, dtype=torch.long)
    with options_applied(loaded.model, options, choice):
        full = objective.measure()
        assert full == pytest.approx(effects.objective, rel=1e-4)
        flat = effects.effects[:, :, 1].flatten()
        for index in flat.abs().topk(4).indices.tolist():  # the largest predicted changes (0.005-0.011)
            layer, head = divmod(index, KV_HEADS)
            choice.zero_()
            choice[layer, head] = 1
            change = objective.measure() - full
            predicted = float(flat[index])
            assert change * predicted > 0 and abs(change - predicted) < 0.6 * abs(predicted)


@requires_model
def test_effects_at_a_sparse_base_see_the_model_on_that_base():
    from flexsparse.eval.head_options import head_options, options_applied
    from flexsparse.eval.head_search import CalibrationObjective, SearchOptions
    from flexsparse.eval.option_effects import option_effects

    loaded = real_model()
    options = head_options(256, windows=[64], sink=16, xa_thresholds=[0.9])
    objective = CalibrationObjective(loaded.model, loaded.tokenizer, real_corpus(),
                                     SearchOptions(text_windows=1, passkey_prompts=0), 256)
    base = torch.randint(0, 3, (LAYERS, KV_HEADS), generator=torch.Generator().manual_seed(1))
    effects = option_effects(loaded.model, objective, options, base=base)
    with options_applied(loaded.model, options, base.clone()):
        assert effects.objective == pytest.approx(objective.measure(), rel=1e-5)
    assert bool((effects.tiles[:, :, 2] > 0).all()) and bool((effects.tiles[:, :, 2] <= 1).all())  # XA measured
    assert float(effects.magnitudes[:, :, 1].min()) > 0  # the window changes every head's output, at any base


@requires_model
def test_calibrate_frontier_end_to_end(tmp_path, capsys):
    from flexsparse.cli import main
    from flexsparse.integrations import layer_modes, load_config, revert

    out = tmp_path / "frontier"
    began = time.perf_counter()
    assert main(["calibrate", "--method", "frontier", "--kv", "0.6", "--at", "512", "--windows", "64", "128",
                 "--xa-thresholds", "0.9", "--points", "2", "--device", "cpu", "--out",
                 str(out), "--quiet"]) == 0
    seconds = time.perf_counter() - began
    printed = capsys.readouterr().out
    print(f"calibrate --method frontier at 512 tokens on the CPU: {seconds:.1f} s")
    assert "frontier at kv <= 0.6 (512 tokens)" in printed
    saved = json.loads((out / "frontier.json").read_text())
    chosen, points = saved["chosen"], saved["points"]
    assert chosen["kv"] <= 0.6 + 1e-6 and chosen["kv_budget"] == 0.6
    assert [p["kv_budget"] for p in points] == sorted(p["kv_budget"] for p in points)
    objectives = [p["objective"] for p in points]
    assert objectives == sorted(objectives, reverse=True)  # a larger budget never measures worse
    assert points[-1]["kv_budget"] == 1.0 and points[-1]["objective_increase"] <= 1e-6
    assert all(p["kv"] <= p["kv_budget"] + 1e-6 for p in points)
    assert any(p["objective_increase"] > 0.005 for p in points)  # the cheap end costs quality
    assert {o["name"] for o in saved["options"]} == {"full", "window_64", "window_128", "xa_0.9"}
    assert chosen["text_ppl_ratio"] == pytest.approx(math.exp(chosen["objective_increase"]), rel=0.2)
    assert [step["base_scale"] for step in saved["linearisations"]] == [None, 1.0]  # full, then your choice
    csv_lines = (out / "frontier.csv").read_text().splitlines()
    assert len(csv_lines) == 1 + len(points) and csv_lines[0].startswith("scale,tiles_budget,kv_budget,tiles,kv")
    assert "(yours)" in (out / "frontier.md").read_text()
    assert (out / "frontier.png").stat().st_size > 1000
    model = real_model().model
    load_config(model, out)
    try:
        assert layer_modes(model) == chosen["modes"]
    finally:
        revert(model)


@pytest.mark.parametrize("argv, message", [
    (["--tiles", "1.5"], r"tiles budget must be a fraction in \(0, 1\]"),
    (["--kv", "0"], r"kv budget must be a fraction in \(0, 1\]"),
    ([], "needs a budget: --tiles and/or --kv"),
    (["--kv", "0.01", "--at", "512", "--windows", "64"], "kv budget 0.01 is below what these options reach"),
    (["--tiles", "0.5", "--at", "512", "--windows", "512"], "reaches every key at length 512"),
    (["--tiles", "0.5", "--at", "512", "--length", "1024"], "differ"),
    (["--tiles", "0.5", "--at", "64"], "fits in one tile"),
    (["--kv", "0.5", "--at", "512", "--points", "1"], "--points must be >= 2"),
])
def test_cli_frontier_refuses_bad_budgets_before_loading_the_model(argv, message, tmp_path, capsys):
    from flexsparse.cli import main

    assert main(["calibrate", "--method", "frontier", "--device", "cpu", "--out", str(tmp_path), *argv]) == 2
    err = capsys.readouterr().err
    assert re.search(message, err)
    assert "loading" not in err and len(err.strip().splitlines()) == 1
