"""Quality against density: one panel per task and text domain, a point per (method, length)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from flexsparse.eval.records import Record

PLOT_FILE = "quality.png"
_MARKERS = "osD^v<>pP*X"


def _panels(records: Sequence[Record]) -> list[tuple[str, str, str]]:
    """(task, domain, metric) per panel: perplexity as the ratio to full where measured, else as perplexity."""
    panels: dict[tuple[str, str, str], None] = {}
    ratios = {(r.task, r.domain) for r in records if r.metric == "perplexity_ratio"}
    for r in records:
        if r.metric == "perplexity" and (r.task, r.domain) in ratios:
            continue
        panels[(r.task, r.domain, r.metric)] = None
    return list(panels)


def plot_quality(records: Sequence[Record], path: str | Path, title: str = "") -> Path:
    """Write a PNG of each task's quality (y) against computed tile density (x), a panel per task and domain;
    color = method, marker = length."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = _panels(records)
    if not panels:
        raise ValueError("no records to plot")
    methods = list(dict.fromkeys(r.method for r in records))
    lengths = sorted({r.length for r in records})
    colors = plt.get_cmap("tab10" if len(methods) <= 10 else "tab20")
    cols = min(3, len(panels))
    rows = -(-len(panels) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5.2 * cols, 4.2 * rows), squeeze=False)
    for ax, panel in zip(axes.flat, panels):
        task, domain, metric = panel
        for r in records:
            if (r.task, r.domain, r.metric) != panel:
                continue
            ax.scatter(r.density, r.value, color=colors(methods.index(r.method) % colors.N),
                       marker=_MARKERS[lengths.index(r.length) % len(_MARKERS)], s=46, alpha=0.85)
        ax.set_title(f"{task} on {domain} ({metric})" if domain else f"{task} ({metric})")
        ax.set_xlabel("computed tile fraction (density)")
        ax.set_ylabel(metric)
        ax.set_xlim(0, 1.05)
        ax.grid(alpha=0.3)
        if metric == "perplexity_ratio":
            ax.axhline(1.0, color="gray", lw=0.8)
        values = [r.value for r in records if (r.task, r.domain, r.metric) == panel]
        if metric.startswith("perplexity") and max(values) > 3 * min(values):  # ESA's x26 next to 1.0x
            ax.set_yscale("log")
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    handles = [plt.Line2D([], [], color=colors(i % colors.N), marker="o", ls="", label=method)
               for i, method in enumerate(methods)]
    handles += [plt.Line2D([], [], color="black", marker=_MARKERS[i % len(_MARKERS)], ls="", label=f"{n:,} tokens")
                for i, n in enumerate(lengths)]
    fig.legend(handles=handles, loc="center right", fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout(rect=(0, 0, 0.84, 1))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
