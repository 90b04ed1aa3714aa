"""Pictures of patterns: the attention mask per head (and per layer), like the ESA paper's figures."""

from __future__ import annotations

from pathlib import Path

import torch

from flexsparse.masks import Geometry, Pattern


def draw_masks(rows: list[tuple[str, Pattern]], seq_len: int, path: str | Path) -> Path:
    """Write a PNG with one row of panels per (label, pattern) and one panel per head. Needs matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise ImportError("pictures need matplotlib: pip install 'flexsparse[plot]'") from err
    masks = []
    for _, pattern in rows:
        heads = pattern.required_heads or 1
        masks.append(pattern.dense(Geometry(heads, seq_len))[0])
    cols = max(m.shape[0] for m in masks)
    fig, axes = plt.subplots(len(rows), cols, figsize=(2.2 * cols, 2.2 * len(rows)), squeeze=False)
    for r, ((label, _), mask) in enumerate(zip(rows, masks)):
        for c in range(cols):
            ax = axes[r][c]
            ax.set_xticks([])
            ax.set_yticks([])
            if c >= mask.shape[0]:
                ax.axis("off")
                continue
            ax.imshow(mask[c].to(torch.uint8).numpy(), cmap="Greys", interpolation="nearest")
            ax.set_title(f"{label} head {c}" if mask.shape[0] > 1 else label, fontsize=7)
    fig.supxlabel("key position")
    fig.supylabel("query position")
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
