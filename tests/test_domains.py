"""Text domains and per-domain results, without a model (a byte tokenizer for the corpora).

Checks: the code domain is the running interpreter's stdlib source in a fixed order, deterministic and of another
kind than the pydoc text; a missing source file is a clear error; the default evaluation domains are both built-in
ones around a built-in calibration corpus and the user's corpus alone otherwise; ratios to full attention, the text
table, the Markdown table and the plot keep domains apart; RULER means are the mean of their tasks per method and
length, placed after the last of them, and recomputed rather than stacked.
"""

import json
import sysconfig
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from flexsparse.eval.domains import DOMAINS, STDLIB_MODULES, domain_corpus, evaluation_domains, stdlib_source
from flexsparse.eval.records import (
    Record,
    format_table,
    markdown_table,
    read_records,
    with_ratios,
    write_records,
)
from flexsparse.eval.ruler import RULER_MEAN, RULER_TASKS, with_ruler_means
from flexsparse.eval.text import Corpus, default_text
from tests.hf_util import byte_tokenizer


def test_code_domain_is_the_stdlib_source_in_order_and_unlike_the_docs():
    code = stdlib_source()
    assert code == stdlib_source()
    root = Path(sysconfig.get_path("stdlib"))
    first, second = (root / f"{name}.py" for name in STDLIB_MODULES[:2])
    assert code.startswith(first.read_text(encoding="utf-8").strip())
    assert code.index(second.read_text(encoding="utf-8").strip()) > 0
    assert "class ArgumentParser" in code and len(code) > 300_000
    docs = default_text()

    def indented(text: str) -> float:
        lines = [line for line in text.splitlines() if line.strip()]
        return sum(line.startswith("    ") for line in lines) / len(lines)

    assert indented(code) > 0.6 and indented(docs) < 0.4  # code: most lines are indented blocks
    assert DOMAINS["pydoc"] is default_text and DOMAINS["code"] is stdlib_source


def test_missing_stdlib_source_is_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.setattr(sysconfig, "get_path", lambda name: str(tmp_path))
    with pytest.raises(FileNotFoundError, match="argparse.py is not installed"):
        stdlib_source()


def test_default_domains_are_both_built_in_ones_or_the_users_text_alone(monkeypatch):
    tokenizer = byte_tokenizer()
    code = domain_corpus(tokenizer, "code")
    assert code.name == "code" and len(code.evaluation) > 200_000  # bytes of held-out source
    assert tokenizer.decode(code.evaluation[:2000].tolist()).count("\n    ") > 10
    monkeypatch.setitem(DOMAINS, "pydoc", lambda: "Docs say what things do. " * 40)  # small texts: fast
    monkeypatch.setitem(DOMAINS, "code", lambda: "def f(x):\n    return x\n" * 40)
    pydoc = domain_corpus(tokenizer, "pydoc")
    domains = evaluation_domains(tokenizer, pydoc)
    assert [d.name for d in domains] == ["pydoc", "code"] and domains[0] is pydoc
    assert tokenizer.decode(domains[1].evaluation[:9].tolist()) in "def f(x):\n    return x\n" * 2
    assert [d.name for d in evaluation_domains(tokenizer, domains[1])] == ["pydoc", "code"]
    assert Corpus.from_text(tokenizer).name == "pydoc"
    own = Corpus.from_text(tokenizer, "some words of my own " * 20)
    assert own.name == "text" and evaluation_domains(tokenizer, own) == (own,)
    with pytest.raises(ValueError, match="unknown text domain 'poetry'"):
        domain_corpus(tokenizer, "poetry")
    with pytest.raises(ValueError, match="name must be a non-empty string"):
        Corpus.from_text(tokenizer, "abc " * 100, name="")


def _perplexity(method: str, domain: str, length: int, value: float) -> Record:
    return Record(method, "perplexity", length, "perplexity", value, 2, 0.5, 1024, "m", 1.0, domain)


def test_ratios_tables_and_plot_keep_domains_apart(tmp_path):
    records = [_perplexity("full", "pydoc", 256, 10.0), _perplexity("full", "code", 256, 4.0),
               _perplexity("ssa", "pydoc", 256, 11.0), _perplexity("ssa", "code", 256, 5.0),
               Record("ssa", "passkey", 256, "accuracy", 0.5, 2, 0.5, 1024, "m", 1.0, "pydoc")]
    final = with_ratios(records)
    ratios = {(r.method, r.domain): r.value for r in final if r.metric == "perplexity_ratio"}
    assert ratios == {("full", "pydoc"): 1.0, ("full", "code"): 1.0, ("ssa", "pydoc"): pytest.approx(1.1),
                      ("ssa", "code"): pytest.approx(1.25)}
    assert read_records(write_records(final, tmp_path / "results.json")) == final
    assert json.loads((tmp_path / "results.json").read_text())[1]["domain"] == "pydoc"
    table = format_table(final).splitlines()
    assert table[0].split()[:4] == ["method", "task", "domain", "length"]
    assert table[2].split()[:5] == ["full", "perplexity", "pydoc", "256", "perplexity"]
    header = markdown_table(final).splitlines()[0]
    assert "PPL / full pydoc 256" in header and "PPL / full code 256" in header and "| passkey 256 |" in header
    ssa_row = markdown_table(final).splitlines()[3]
    assert "1.100" in ssa_row and "1.250" in ssa_row
    pytest.importorskip("matplotlib")
    from flexsparse.eval.plots import plot_quality

    assert plot_quality(final, tmp_path / "quality.png").stat().st_size > 10_000


def _ruler(method: str, task: str, length: int, value: float) -> Record:
    return Record(method, task, length, "accuracy", value, 4, 0.25, 2048, "m", 2.0)


def test_ruler_means_follow_the_last_task_of_each_method_and_length():
    tasks = RULER_TASKS[:3]
    records = [_ruler(method, task, length, value)
               for method in ("full", "ssa") for task, value in zip(tasks, (1.0, 0.5, 0.0))
               for length in (1024, 2048)]
    records.insert(2, _perplexity("full", "pydoc", 1024, 9.0))
    done = with_ruler_means(records)
    means = [(r.method, r.length, r.value, r.n, r.seconds) for r in done if r.task == RULER_MEAN]
    assert means == [(method, length, 0.5, 12, 6.0) for method in ("full", "ssa") for length in (1024, 2048)]
    for index, r in enumerate(done):
        if r.task == RULER_MEAN:  # right after the group's last task record
            before = [x for x in done[:index] if (x.method, x.length) == (r.method, r.length) and x.task in tasks]
            assert before[-1].task == tasks[-1] and done[index - 1].task == tasks[-1]
    assert with_ruler_means(done) == done
    assert with_ruler_means([_perplexity("full", "pydoc", 1024, 9.0)]) == [_perplexity("full", "pydoc", 1024, 9.0)]


@given(st.lists(st.floats(0.0, 1.0), min_size=1, max_size=len(RULER_TASKS)))
def test_a_ruler_mean_lies_between_its_tasks(values):
    records = [_ruler("full", task, 4096, value) for task, value in zip(RULER_TASKS, values)]
    (mean,) = [r for r in with_ruler_means(records) if r.task == RULER_MEAN]
    assert min(values) - 1e-12 <= mean.value <= max(values) + 1e-12
    assert mean.n == 4 * len(values) and mean.domain == "" and mean.density == pytest.approx(0.25)
