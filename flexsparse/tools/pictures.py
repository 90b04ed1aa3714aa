"""Pictures of patterns: the attention mask per head (and per layer), like the ESA paper's figures, and XAttention's
resolved block tables for a given input."""

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


def draw_xa_blocks(q: torch.Tensor, k: torch.Tensor, path: str | Path, *, threshold: float | torch.Tensor = 0.9,
                   stride: int = 16, block_size: int = 128, rule: str = "plus_one", batch: int = 0,
                   max_heads: int = 16, titles: list[str] | None = None) -> Path:
    """Write a PNG of XAttention's resolved block table for one input: per query head, the kept (query block,
    key block) pairs (top row, black) and the estimated block mass on a log scale (bottom row). Needs matplotlib.

    q ``[B, H_q, S_q, d]``, k ``[B, H_kv, S_kv, d]`` (any device); ``titles``: one label per drawn head (e.g. the
    kinds of :func:`flexsparse.synthetic.synthetic_attention_inputs`). At most ``max_heads`` heads are drawn.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise ImportError("pictures need matplotlib: pip install 'flexsparse[plot]'") from err
    from flexsparse.kernels.xa_estimate import antidiagonal_block_mass
    from flexsparse.masks.xa_selection import select_blocks

    q, k = q[batch:batch + 1], k[batch:batch + 1]
    mass = antidiagonal_block_mass(q, k, stride, block_size)
    table = select_blocks(mass, threshold, rule=rule, q_len=q.shape[2], kv_len=k.shape[2], block_size=block_size)
    heads = min(q.shape[1], max_heads)
    table, mass = table[0, :heads].cpu(), mass[0, :heads].float().cpu()
    causal = torch.ones(table.shape[-2:], dtype=torch.bool).tril(table.shape[-1] - table.shape[-2])
    fig, axes = plt.subplots(2, heads, figsize=(2.2 * heads, 4.6), squeeze=False)
    for h in range(heads):
        density = float(table[h].sum()) / float(causal.sum())
        label = titles[h] if titles is not None and h < len(titles) else f"head {h}"
        axes[0][h].imshow(table[h].to(torch.uint8).numpy(), cmap="Greys", interpolation="nearest", vmin=0, vmax=1)
        axes[0][h].set_title(f"{label}\ndensity {density:.2f}", fontsize=7)
        share = mass[h] / mass[h].sum(-1, keepdim=True).clamp(min=1e-30)
        axes[1][h].imshow(share.clamp(min=1e-6).log10().masked_fill(~causal, float("nan")).numpy(), cmap="viridis",
                          interpolation="nearest", vmin=-6, vmax=0)
        for row in axes:
            row[h].set_xticks([])
            row[h].set_yticks([])
    axes[0][0].set_ylabel("kept blocks", fontsize=7)
    axes[1][0].set_ylabel("log10 estimated share", fontsize=7)
    fig.suptitle(f"XAttention threshold {threshold if isinstance(threshold, float) else 'per head'}, stride {stride}, "
                 f"block {block_size}, rule {rule}: query block (down) x key block (across)", fontsize=8)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
