"""Evaluation results: one :class:`Record` per (method, task, domain, length, metric), ``results.json``, a text
table."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path

RESULTS_FILE = "results.json"


@dataclass
class Record:
    """One measurement.

    ``value`` of ``metric`` (perplexity; perplexity_ratio, relative to the ``full`` method at the same length;
    accuracy; recall) over ``n`` windows or prompts of ``length`` tokens. ``density``: fraction of the causal
    (query tile, key tile) pairs the attention computes, averaged over layers and prefill forwards (1.0 for the
    model's own attention). ``kv_bytes``: KV cache bytes one sequence of ``length`` tokens needs under the method
    (:func:`flexsparse.integrations.kv_memory_formula`; every key for routed models and full attention).
    ``seconds``: wall time of the measurement (model forwards and scoring; a calibrated method's calibration,
    done once before its first record, is not included). ``domain``: the text the windows or haystacks came from
    (a :class:`~flexsparse.eval.text.Corpus` name: ``pydoc``, ``code``, ``text``); empty for RULER tasks, whose
    haystacks lm-eval generates.
    """

    method: str
    task: str
    length: int
    metric: str
    value: float
    n: int
    density: float
    kv_bytes: int
    model: str = ""
    seconds: float = 0.0
    domain: str = ""


def write_records(records: Sequence[Record], path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps([asdict(r) for r in records], indent=1) + "\n")
    return path


def read_records(path: str | Path) -> list[Record]:
    names = {f.name for f in fields(Record)}
    return [Record(**{k: v for k, v in item.items() if k in names}) for item in json.loads(Path(path).read_text())]


def with_ratios(records: Sequence[Record], reference: str = "full") -> list[Record]:
    """``records`` with a ``perplexity_ratio`` record after each perplexity record: its perplexity relative to
    ``reference``'s at the same length on the same domain (where that was measured)."""
    base = {(r.length, r.model, r.domain): r.value for r in records
            if r.method == reference and r.metric == "perplexity"}
    out = []
    for r in records:
        if r.metric == "perplexity_ratio":
            continue
        out.append(r)
        key = (r.length, r.model, r.domain)
        if r.metric == "perplexity" and key in base:
            out.append(Record(r.method, r.task, r.length, "perplexity_ratio", r.value / base[key], r.n, r.density,
                              r.kv_bytes, r.model, 0.0, r.domain))
    return out


def _number(value: float) -> str:
    if math.isnan(value):
        return "nan"
    return f"{value:.3f}" if abs(value) < 100 else f"{value:.1f}"


def format_table(records: Sequence[Record]) -> str:
    """A fixed-width table, one row per record, in the records' order."""
    header = ("method", "task", "domain", "length", "metric", "value", "n", "density", "KV MiB", "seconds")
    rows = [(r.method, r.task, r.domain, str(r.length), r.metric, _number(r.value), str(r.n), f"{r.density:.3f}",
             f"{r.kv_bytes / 2**20:.1f}", f"{r.seconds:.1f}") for r in records]
    widths = [max(len(h), *(len(row[i]) for row in rows)) if rows else len(h) for i, h in enumerate(header)]
    def line(cells) -> str:
        return "  ".join(c.ljust(w) if i < 5 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))

    return "\n".join([line(header), line(["-" * w for w in widths])] + [line(row) for row in rows])


def markdown_table(records: Sequence[Record]) -> str:
    """A Markdown table with one row per method: computed tile density and KV MiB at the longest length, then
    one column per (task, domain, metric, length) (perplexity as the ratio to full where measured; the domain is
    named where a task was measured on more than one)."""
    ratios = any(r.metric == "perplexity_ratio" for r in records)
    shown = [r for r in records if not (ratios and r.metric == "perplexity")]
    methods = list(dict.fromkeys(r.method for r in shown))
    columns = list(dict.fromkeys((r.task, r.domain, r.metric, r.length) for r in shown))
    several = {task for task in {c[0] for c in columns} if len({c[1] for c in columns if c[0] == task}) > 1}
    longest = max(r.length for r in shown)
    cells = {(r.method, r.task, r.domain, r.metric, r.length): r for r in shown}
    at_longest = {r.method: r for r in shown if r.length == longest}
    names = {"perplexity_ratio": "PPL / full", "perplexity": "PPL"}
    header = ["method", f"density {longest:,}", f"KV MiB {longest:,}"] + [
        f"{names.get(metric, task)}{f' {domain}' if task in several else ''} {length:,}"
        for task, domain, metric, length in columns]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for method in methods:
        first = at_longest.get(method)
        row = [method, f"{first.density:.2f}" if first else "", f"{first.kv_bytes / 2**20:.1f}" if first else ""]
        for task, domain, metric, length in columns:
            found = cells.get((method, task, domain, metric, length))
            row.append(_number(found.value) if found else "")
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)
