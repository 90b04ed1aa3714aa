"""RULER through lm-eval (the ``ruler`` extra; skipped without lm-eval) with the default model's tokenizer.

Checks: our samples are the first of lm-eval's own dataset functions' 500 under the same seeds (the generator
parameters match lm-eval's); samples are seeded, fit their length, hold their answers in the context, split into
context + question, and leave the global random generators as they were; lm-eval's scoring gives 1 to the answers
and 0 to nothing; FlexsparseLM hands lm-eval's requests to TextModel unchanged; ``flexsparse eval --suite ruler``
on the real model writes a record per task and their mean per length. The first lm-eval import takes ~30 s and
~1 GB (lm-eval builds RULER's word list).
"""

import json
import random

import numpy as np
import pytest

pytest.importorskip("lm_eval")

from flexsparse.eval.ruler import (  # noqa: E402
    RULER_MEAN,
    RULER_TASKS,
    ruler_samples,
    ruler_scores,
    sample_seed,
    seeded_generators,
)
from flexsparse.eval.text_model import TextModel  # noqa: E402
from tests.real_model import real_model, requires_model  # noqa: E402

pytestmark = requires_model

LENGTH = 1024


def _encode(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def test_samples_are_the_first_of_lm_evals_own(tmp_path):
    from lm_eval.tasks.ruler import cwe_utils, fwe_utils, niah_utils, vt_utils

    tokenizer = real_model().tokenizer
    tokenizer.save_pretrained(tmp_path)  # lm-eval's dataset functions take a tokenizer by name
    own = {"niah_single_1": niah_utils.niah_single_1, "niah_multikey_2": niah_utils.niah_multikey_2,
           "niah_multikey_3": niah_utils.niah_multikey_3, "ruler_vt": vt_utils.get_vt_dataset,
           "ruler_cwe": cwe_utils.get_cw_dataset, "ruler_fwe": fwe_utils.fwe_download}
    for task in RULER_TASKS:
        ours = ruler_samples(task, LENGTH, 2, 7, tokenizer)
        with seeded_generators(sample_seed(task, LENGTH, 7)):
            theirs = own[task](max_seq_lengths=[LENGTH], tokenizer=str(tmp_path))["test"]
        assert len(theirs) == 500
        assert [sample.doc for sample in ours] == [theirs[i] for i in range(2)], task


def test_samples_are_seeded_fit_their_length_and_leave_the_generators_alone():
    tokenizer = real_model().tokenizer
    random.seed(11)
    np.random.seed(11)
    states = random.getstate(), np.random.get_state()[1].copy()
    for task in RULER_TASKS:
        samples = ruler_samples(task, LENGTH, 2, 0, tokenizer)
        assert samples == ruler_samples(task, LENGTH, 2, 0, tokenizer)
        assert [s.prompt for s in samples] != [s.prompt for s in ruler_samples(task, LENGTH, 2, 1, tokenizer)]
        for sample in samples:
            assert (sample.task, sample.length) == (task, LENGTH)
            assert sample.prompt == sample.context + sample.question
            assert sample.question.startswith("\n") and sample.question.endswith(sample.doc["gen_prefix"])
            assert all(answer in sample.context for answer in sample.answers)
            size = len(_encode(tokenizer, sample.prompt))
            if task == "ruler_fwe":  # lm-eval sizes fwe's prompt to the length and generates beyond it
                assert LENGTH // 2 <= size <= LENGTH
            else:
                assert LENGTH // 2 <= size <= LENGTH - sample.max_new_tokens
            assert sample.score(" ".join(sample.answers)) == 1.0 and sample.score("") == 0.0
    assert random.getstate() == states[0] and (np.random.get_state()[1] == states[1]).all()
    with pytest.raises(ValueError, match="unknown RULER task 'niah_single_2'"):
        ruler_samples("niah_single_2", LENGTH, 1, 0, tokenizer)
    with pytest.raises(ValueError, match="length must be an integer >= 1024"):
        ruler_samples("ruler_vt", 512, 1, 0, tokenizer)


class _Oracle:
    """An lm-eval model stand-in that answers with the expected strings (or with nothing)."""

    def __init__(self, right: bool) -> None:
        self.right = right

    def generate_until(self, requests):
        return [" " + ", ".join(request.doc["outputs"]) if self.right else "" for request in requests]


def test_lm_eval_scores_generations_through_flexsparse_lm():
    from lm_eval.api.instance import Instance

    from flexsparse.eval.harness import FlexsparseLM
    from tests.hf_util import tiny_model

    tokenizer = real_model().tokenizer
    assert ruler_scores(_Oracle(True), "ruler_cwe", LENGTH, 2, 0, tokenizer) == [1.0, 1.0]
    assert ruler_scores(_Oracle(False), "niah_multikey_3", LENGTH, 2, 0, tokenizer) == [0.0, 0.0]
    model = tiny_model("llama", vocab_size=len(tokenizer), max_position_embeddings=2048)
    text_model = TextModel(model, tokenizer)
    done = []
    lm = FlexsparseLM(text_model, progress=done.append)
    scores = ruler_scores(lm, "niah_single_1", LENGTH, 2, 0, tokenizer)
    samples = ruler_samples("niah_single_1", LENGTH, 2, 0, tokenizer)
    texts = text_model.generate_until([(s.prompt, {"max_gen_toks": s.max_new_tokens, "until": []}) for s in samples])
    assert scores == [s.score(text) for s, text in zip(samples, texts)] and sum(done) == 2
    pairs = [("The grass is", " green"), ("", "Hello")]
    requests = [Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(pairs)]
    assert lm.loglikelihood(requests) == text_model.loglikelihood(pairs)
    rolling = [Instance("loglikelihood_rolling", {}, ("Some text.",), 0)]
    assert lm.loglikelihood_rolling(rolling) == text_model.loglikelihood_rolling(["Some text."])
    with pytest.raises(TypeError, match="TextModel"):
        FlexsparseLM(model)


def test_cli_eval_ruler_suite_reports_each_task_and_their_mean(tmp_path, capsys):
    from flexsparse.cli import main

    method, tasks = "ssa:sink=16,window=64", ("niah_single_1", "ruler_vt")
    code = main(["eval", "--suite", "ruler", "--tasks", *tasks, "--lengths", str(LENGTH), "--trials", "1",
                 "--methods", method, "--out", str(tmp_path), "--quiet"])
    assert code == 0
    records = json.loads((tmp_path / "results.json").read_text())
    assert [(r["method"], r["task"]) for r in records] == [(method, task) for task in (*tasks, RULER_MEAN)]
    assert all(r["metric"] == "accuracy" and r["length"] == LENGTH and r["domain"] == "" for r in records)
    assert records[2]["value"] == pytest.approx((records[0]["value"] + records[1]["value"]) / 2)
    assert records[2]["n"] == 2 and 0.1 < records[0]["density"] < 1.0  # measured on the sink + window prefill
    assert (tmp_path / "quality.png").stat().st_size > 10_000
    assert RULER_MEAN in capsys.readouterr().out
