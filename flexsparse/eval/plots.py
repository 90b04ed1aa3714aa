"""Quality against density: one panel per task and text domain, a point per (method, length).

Points that fall on the same spot (methods that all reach accuracy 1.0 at density 1.0, say) stay visible: they are
drawn as hollow markers of decreasing size, the first drawn largest, so each shows as its own ring. Accuracy and
recall axes span [0, 1] with a small margin, whatever the values.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

from flexsparse.eval.records import Record

PLOT_FILE = "quality.png"
_MARKERS = "osD^v<>pP*X"
FRACTIONS = ("accuracy", "recall")
"""Metrics that are fractions: their axes span [0, 1]."""
MARKER_SIZE = 46.0
"""Marker area (points^2) of a point alone on its spot; each point under it on the same spot is drawn larger."""
_MARGIN = 0.05


def _panels(records: Sequence[Record]) -> list[tuple[str, str, str]]:
    """(task, domain, metric) per panel: perplexity as the ratio to full where measured, else as perplexity."""
    panels: dict[tuple[str, str, str], None] = {}
    ratios = {(r.task, r.domain) for r in records if r.metric == "perplexity_ratio"}
    for r in records:
        if r.metric == "perplexity" and (r.task, r.domain) in ratios:
            continue
        panels[(r.task, r.domain, r.metric)] = None
    return list(panels)


def _log_scale(metric: str, values: Sequence[float]) -> bool:
    """Whether a panel's y axis is logarithmic: perplexities that differ by more than 3x (ESA's x26 next to 1.0x)."""
    return metric.startswith("perplexity") and max(values) > 3 * min(values)


def marker_sizes(points: Sequence[Record]) -> list[float]:
    """Each point's marker area (the points of one panel, in drawing order): on a spot shared by n points (the
    same cell of a 1%-of-the-axes grid), the first drawn is the largest and each next one smaller, so that all n
    rings show; a point alone has :data:`MARKER_SIZE`."""
    metric = points[0].metric if points else ""
    values = [p.value for p in points]
    if metric in FRACTIONS:
        low, high = 0.0, 1.0
    elif values and _log_scale(metric, values):
        values = [math.log(v) for v in values]
        low, high = min(values), max(values)
    else:
        low, high = (min(values), max(values)) if values else (0.0, 1.0)
    span = high - low or 1.0
    spots = [(round(p.density, 2), round((v - low) / span, 2)) for p, v in zip(points, values)]
    sizes = []
    for index, spot in enumerate(spots):
        later = spots[index + 1:].count(spot)  # points drawn over this one on its spot
        sizes.append(MARKER_SIZE * (1.0 + 1.1 * later))
    return sizes


def quality_figure(records: Sequence[Record], title: str = ""):
    """The matplotlib figure of each task's quality (y) against computed tile density (x), a panel per task and
    domain: color = method, marker = length; hollow markers, larger under smaller where points share a spot."""
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
    for ax, (task, domain, metric) in zip(axes.flat, panels):
        points = [r for r in records if (r.task, r.domain, r.metric) == (task, domain, metric)]
        for order, (r, size) in enumerate(zip(points, marker_sizes(points))):
            ax.scatter(r.density, r.value, s=size, facecolors="none", linewidths=1.6, zorder=2 + order,
                       edgecolors=[colors(methods.index(r.method) % colors.N)],
                       marker=_MARKERS[lengths.index(r.length) % len(_MARKERS)])
        ax.set_title(f"{task} on {domain} ({metric})" if domain else f"{task} ({metric})")
        ax.set_xlabel("computed tile fraction (density)")
        ax.set_ylabel(metric)
        ax.set_xlim(0, 1.05)
        ax.grid(alpha=0.3)
        if metric in FRACTIONS:
            ax.set_ylim(-_MARGIN, 1 + _MARGIN)
        if metric == "perplexity_ratio":
            ax.axhline(1.0, color="gray", lw=0.8)
        if _log_scale(metric, [r.value for r in points]):
            ax.set_yscale("log")
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    handles = [plt.Line2D([], [], color=colors(i % colors.N), marker="o", markerfacecolor="none", ls="",
                          label=method) for i, method in enumerate(methods)]
    handles += [plt.Line2D([], [], color="black", marker=_MARKERS[i % len(_MARKERS)], markerfacecolor="none", ls="",
                           label=f"{n:,} tokens") for i, n in enumerate(lengths)]
    fig.legend(handles=handles, loc="center right", fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout(rect=(0, 0, 0.84, 1))
    return fig


def plot_quality(records: Sequence[Record], path: str | Path, title: str = "") -> Path:
    """Write :func:`quality_figure` as a PNG at ``path``; returns the path."""
    import matplotlib.pyplot as plt

    fig = quality_figure(records, title)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
