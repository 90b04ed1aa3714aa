"""Balanced (``tp_size``) against unconstrained choice of full heads: per-rank attention tiles and quality.

Tiles: a Llama-shaped layer stack (16 layers, 32 q / 8 kv heads, 2 full + 6 sink-128/window-2048 KV heads) on 2
ranks, both full heads on one rank against one on each; and SmolLM2 (30 layers, 3 KV heads) on 3 ranks with the
gates' global 1/3 budget. Quality: SmolLM2's perplexity at 2K on held-out text (CPU, fp32) for both choices.

    PYTHONPATH=. python bench/quality/tp_balance.py docs/bench/tp-balance/gate-scores.json
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from flexsparse.distributed import rank_tiles  # noqa: E402
from flexsparse.eval.calibration import select  # noqa: E402
from flexsparse.eval.methods import Method  # noqa: E402
from flexsparse.eval.models import load_model  # noqa: E402
from flexsparse.eval.records import format_table, with_ratios  # noqa: E402
from flexsparse.eval.runner import evaluate  # noqa: E402
from flexsparse.masks import Causal, SinkWindow  # noqa: E402

SPARSE = SinkWindow(64, 256)


@dataclass
class Chosen(Method):
    """Given modes, the other heads sink 64 + window 256."""

    name: str
    modes: list

    def apply(self, setup) -> None:
        setup.convert({"full": Causal(), "sparse": SPARSE}, self.modes)


def main() -> int:
    patterns = {"full": Causal(), "ssa": SinkWindow(128, 2048)}
    balanced = [["full", "ssa", "ssa", "ssa", "full", "ssa", "ssa", "ssa"]] * 16
    unbalanced = [["full", "full", "ssa", "ssa", "ssa", "ssa", "ssa", "ssa"]] * 16
    for length in (32768, 131072):
        for name, modes in (("balanced", balanced), ("unbalanced", unbalanced)):
            tiles = rank_tiles(patterns, modes, 32, length, 2).sum(1)
            print(f"Llama-shaped, 2 ranks, {length:,} tokens, {name}: tiles per rank {tiles.tolist()}, "
                  f"slowest / mean {float(tiles.max() / tiles.float().mean()):.3f}")
    scores = torch.tensor(next(iter(json.loads(Path(sys.argv[1]).read_text()).values())))
    choices = {"gates global": select(scores, 1 / 3, per_layer=False),
               "gates global, tp_size=3": select(scores, 1 / 3, per_layer=False, tp_size=3)}
    for name, modes in choices.items():
        tiles = rank_tiles({"full": Causal(), "sparse": SPARSE}, modes, 9, 8192, 3).sum(1)
        print(f"SmolLM2, 3 ranks, 8,192 tokens, {name}: tiles per rank {tiles.tolist()}")
    loaded = load_model(device="cpu")
    methods = [Chosen("every head causal", [["full"] * 3] * 30)] + [Chosen(n, m) for n, m in choices.items()]
    print(format_table(with_ratios(evaluate(loaded, methods, ["perplexity"], [2048], 8))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
