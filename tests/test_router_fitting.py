"""train_routers on CPU (dense backend): a head and a layer router fitted on a tiny random Llama with a character
tokenizer over the real pydoc text, and a head router on the real default model at 128 tokens.

Checks: batches take the calibration text only and label what they should; the fit meets the budget exactly on
its check batches (the offset), saves a configuration that load_config rebuilds with the same decisions and that
runs as an eval method with a measured density between all-sparse and full; the model comes back unconverted with
its requires_grad flags; the constraint moves the sampled MSR towards its target; on the real model a few steps
make the passkey answer cheaper than untrained routing at the same budget; bad arguments name themselves.
"""

import pytest
import torch

from flexsparse.eval.router_fitting import (
    FIT_FILE,
    budget_offset,
    check_set,
    passkey_batch,
    routed_quality,
    sparse_margins,
    text_batch,
    train_routers,
)
from flexsparse.eval.text import Corpus, default_text
from flexsparse.integrations import convert, is_converted, load_config, revert, routed_layers
from flexsparse.masks import Causal, SinkWindow
from flexsparse.routers import HeadRouter, LayerRouter
from tests.hf_util import KV_HEADS, LAYERS, one_thread, tiny_model  # noqa: F401  (autouse fixture)
from tests.real_model import brute_tile_density, real_corpus, real_model, requires_model

LENGTH = 320  # a passkey prompt of this character tokenizer needs ~230 tokens besides its haystack
SPARSE = SinkWindow(4, 32)
BLOCK = 32


class CharTokenizer:
    """Newline as id 0 and printable ASCII as 1..95 (the tiny models' 96 ids); other characters are dropped."""

    def __call__(self, text: str, add_special_tokens: bool = False) -> dict:
        return {"input_ids": [0 if c == "\n" else ord(c) - 31 for c in text if c == "\n" or " " <= c <= "~"]}

    def decode(self, ids) -> str:
        return "".join("\n" if i == 0 else chr(i + 31) for i in ids)


@pytest.fixture(scope="module")
def tiny():
    tokenizer = CharTokenizer()
    return tiny_model("llama", max_position_embeddings=1024), tokenizer, Corpus.from_text(tokenizer,
                                                                                         default_text()[:60000])


def _fit(tiny, out, kind="head", **kwargs):
    model, tokenizer, corpus = tiny
    options = {"sparse": SPARSE, "steps": 3, "length": LENGTH, "batch_size": 2, "check_batches": 1, "corpus": corpus,
               "pool_size": 8, "router_lr": 1e-2, "block_size": BLOCK, "backend": "dense", "log_every": 1}
    return train_routers(model, tokenizer, out, kind, **{**options, **kwargs})


@pytest.fixture(scope="module")
def head_fit(tiny, tmp_path_factory):
    model = tiny[0]
    flags = [p.requires_grad for p in model.parameters()]
    fit = _fit(tiny, tmp_path_factory.mktemp("fit") / "head")
    assert not is_converted(model) and [p.requires_grad for p in model.parameters()] == flags
    return fit


def test_batches_read_the_calibration_text_and_label_the_answer(tiny):
    import random

    _, tokenizer, corpus = tiny
    text = text_batch(corpus, LENGTH, 2, random.Random(0))
    calibration = corpus.calibration
    windows = torch.cat([calibration, calibration[:LENGTH]]).unfold(0, LENGTH, 1)  # every window, wrapping
    for row in text["input_ids"]:
        assert bool((windows == row).all(1).any())  # a window of the calibration part
    assert torch.equal(text["labels"], text["input_ids"]) and bool(text["prompt_mask"].all())
    keys = passkey_batch(corpus, tokenizer, LENGTH, 3, random.Random(1))
    assert keys["input_ids"].shape == (3, LENGTH) and keys["task"] == ["passkey"] * 3
    labelled = keys["labels"] != -100
    assert torch.equal(labelled, ~keys["prompt_mask"])
    for row in range(3):
        answer = tokenizer.decode(keys["labels"][row][labelled[row]].tolist())
        assert answer.isdigit() and len(answer) == 5  # the pass key, the only labelled tokens
        assert tokenizer.decode(keys["input_ids"][row].tolist()).count(answer) == 3  # twice in the needle, once asked
        assert bool(labelled[row, -5:].all()) and not bool(labelled[row, :-5].any())


def test_budget_offset_makes_the_top_share_positive():
    margins = torch.tensor([0.3, -1.0, 2.0, 0.1, -0.2, 0.0])
    for share, expected in [(0.5, 3), (1 / 3, 2), (0.0, 0), (1.0, 6), (0.9, 5)]:
        assert int((margins + budget_offset(margins, share) > 0).sum()) == expected


def test_head_fit_meets_the_budget_saves_and_runs_as_an_eval_method(tiny, head_fit):
    model, tokenizer, corpus = tiny
    fit = head_fit
    assert [r["step"] for r in fit.history] == [1, 2, 3]
    assert {task for r in fit.history for task in r["msr"]} == {"text", "passkey"}
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in fit.history)
    for check in (fit.untrained, fit.trained):  # 2 + 2 sequences x 3 layers x 2 KV heads: 16 of 24 sparse, +-2
        assert sum(check["msr"].values()) / 2 == pytest.approx(2 / 3, abs=2 / 24 + 1e-6)
        assert set(check["lm_loss"]) == {"text", "passkey"}
    assert (fit.directory / FIT_FILE).is_file()
    # the saved routers (with their offset) decide and score the same on the same check batches
    checks = check_set(corpus, tokenizer, LENGTH, 2, 1)
    load_config(model, fit.directory)
    try:
        assert all(isinstance(layer.router, HeadRouter) for layer in routed_layers(model))
        assert sparse_margins(model, checks).shape == (2 * 2 * LAYERS * KV_HEADS,)
        assert routed_quality(model, checks) == {"lm_loss": fit.trained["lm_loss"], "msr": fit.trained["msr"]}
    finally:
        revert(model)
    # as an eval method: measured density strictly between every head sparse and full
    from flexsparse.eval.methods import ConfigMethod, parse_method
    from flexsparse.eval.models import LoadedModel
    from flexsparse.eval.runner import evaluate

    loaded = LoadedModel(model, tokenizer, "tiny", "tiny")
    records = evaluate(loaded, [parse_method("full"), ConfigMethod(fit.directory)], ["perplexity", "passkey"],
                       [LENGTH], 2, corpus=corpus, backend="dense")
    assert [(r.method, r.task) for r in records] == [("full", "perplexity"), ("full", "passkey"),
                                                     ("config:head", "perplexity"), ("config:head", "passkey")]
    sparse_density = brute_tile_density(SPARSE.sink, SPARSE.window, LENGTH, BLOCK)  # every head sparse
    for record in records[2:]:
        assert sparse_density < record.density < 1.0
    assert records[2].value != records[0].value and not is_converted(model)


def test_layer_fit_decides_whole_layers_at_the_budget(tiny, tmp_path):
    model, tokenizer, corpus = tiny
    fit = _fit(tiny, tmp_path / "layer", "layer", steps=2)
    assert fit.kind == "layer" and fit.settings["sparse"] == {"type": "sink_window", "sink": 4, "window": 32,
                                                               "unit": 1}
    assert sum(fit.trained["msr"].values()) / 2 == pytest.approx(2 / 3, abs=1 / 12 + 1e-6)  # 8 of 12, +-1
    load_config(model, fit.directory)
    try:
        assert all(isinstance(layer.router, LayerRouter) for layer in routed_layers(model))
        checks = check_set(corpus, tokenizer, LENGTH, 2, 1)
        assert sparse_margins(model, checks).shape == (2 * 2 * LAYERS,)  # one decision per (sequence, layer)
        assert routed_quality(model, checks)["msr"] == fit.trained["msr"]
    finally:
        revert(model)


@pytest.mark.parametrize("budget", [0.0, 1.0])
def test_the_constraint_moves_the_sampled_msr_towards_its_target(tiny, tmp_path, budget):
    """Budget 0 (target MSR 1) raises the sampled sparse share from about 1/2, budget 1 lowers it."""
    fit = _fit(tiny, tmp_path / "run", budget=budget, steps=12, passkey_share=0.0, router_lr=5e-2, lambda_lr=5e-2, batch_size=4)
    sampled = [r["msr"]["text"] for r in fit.history]
    first, last = sum(sampled[:3]) / 3, sum(sampled[-3:]) / 3
    assert (last > first + 0.2) if budget == 0.0 else (last < first - 0.2), sampled


def test_bad_arguments_name_themselves(tiny, tmp_path):
    model = tiny[0]
    with pytest.raises(ValueError, match="kind must be one of"):
        _fit(tiny, tmp_path, "heads")
    with pytest.raises(ValueError, match="budget must be <= 1"):
        _fit(tiny, tmp_path, budget=1.5)
    with pytest.raises(TypeError, match="sparse must be a static sparse"):
        _fit(tiny, tmp_path, sparse=Causal())
    with pytest.raises(ValueError, match="targets must map exactly the tasks"):
        _fit(tiny, tmp_path, targets={"text": 0.5})
    with pytest.raises(ValueError, match="steps must be >= 1"):
        _fit(tiny, tmp_path, steps=0)
    with pytest.raises(TypeError, match="corpus must be a flexsparse.eval.text.Corpus"):
        _fit(tiny, tmp_path, corpus="text")
    convert(model, {"full": Causal(), "sparse": SPARSE}, [["full"] * KV_HEADS] * LAYERS, backend="dense")
    try:
        with pytest.raises(ValueError, match="model is converted"):
            _fit(tiny, tmp_path)
    finally:
        revert(model)


@requires_model
def test_real_model_head_router_learns_the_passkey_in_a_few_steps(tmp_path):
    """SmolLM2 at 128 tokens, sink 4 + window 16: after 2 steps (one passkey batch) the trained routers, matched to
    the budget, give the pass key a lower loss than untrained routing matched to the same budget."""
    loaded = real_model()
    fit = train_routers(loaded.model, loaded.tokenizer, tmp_path / "head", "head", sparse=SinkWindow(4, 16),
                        steps=2, length=128, batch_size=1, check_batches=1, corpus=real_corpus(), pool_size=16,
                        router_lr=1e-2, backend="dense", block_size=16, log_every=1)
    assert not is_converted(loaded.model)
    assert sum(fit.trained["msr"].values()) / 2 == pytest.approx(2 / 3, abs=0.05)  # 120 of 180 slots, +-9
    assert fit.trained["lm_loss"]["passkey"] < fit.untrained["lm_loss"]["passkey"], (fit.trained, fit.untrained)
