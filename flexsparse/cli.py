"""Command line: `flexsparse demo [--hf] | verify | bench [--hf] | show | eval | calibrate`.

Exit codes: 0 success (for `verify`: hole-free), 1 `verify` found a hole, 2 a usage or input error, reported as
one line on stderr (argparse's own usage errors also exit 2).
"""

from __future__ import annotations

import argparse
import importlib.util
import sys

EXIT_OK, EXIT_HOLE, EXIT_USAGE = 0, 1, 2


class CommandError(Exception):
    """A problem with the command's input or environment: reported as one line, exit code 2."""


def _require_cuda(what: str) -> None:
    import torch

    if not torch.cuda.is_available():
        raise CommandError(f"{what} needs a CUDA device, and torch sees none")


def _check_device(device: str | None) -> None:
    """``--device`` must be cpu, cuda or cuda:N, and a CUDA device must exist."""
    if device is None:
        return
    import torch

    try:
        found = torch.device(device)
    except RuntimeError:
        raise CommandError(f"--device {device!r} is not a device; use cpu, cuda or cuda:N") from None
    if found.type not in ("cpu", "cuda"):
        raise CommandError(f"--device {device!r}: flexsparse commands run on cpu or cuda")
    if found.type == "cuda":
        _require_cuda(f"--device {device}")
        if found.index is not None and found.index >= torch.cuda.device_count():
            raise CommandError(f"--device {device}: torch sees {torch.cuda.device_count()} CUDA device(s)")


def _require_matplotlib(what: str) -> None:
    if importlib.util.find_spec("matplotlib") is None:
        raise CommandError(f"{what} needs matplotlib: pip install 'flexsparse[plot]'")


def _positive(name: str, value: int | None) -> None:
    if value is not None and value < 1:
        raise CommandError(f"{name} must be >= 1, got {value}")


def _demo(args: argparse.Namespace) -> int:
    _positive("--seq", args.seq)
    _check_device(args.device)
    if args.hf:
        if args.seq is not None:
            raise CommandError("--seq does not apply to --hf (the demo's prompts are fixed)")
        if importlib.util.find_spec("transformers") is None:
            raise CommandError("demo --hf needs transformers: pip install 'flexsparse[hf]'")
        from flexsparse.tools.demo_hf import run_hf_demo

        device = args.device or "cpu"
        run_hf_demo(device=device, backend=args.backend or ("flex" if device.startswith("cuda") else "dense"))
        return EXIT_OK
    from flexsparse.tools.demo import run_demo

    run_demo(device=args.device, backend=args.backend, seq=args.seq)
    return EXIT_OK


def _progress(done: int, total: int) -> None:
    bar = "#" * (30 * done // total)
    print(f"\rpositions {done:,}/{total:,} [{bar:<30}]", end="\n" if done == total else "", file=sys.stderr,
          flush=True)


def _read_config(path: str) -> dict:
    import json

    try:
        with open(path) as file:
            config = json.load(file)
    except json.JSONDecodeError as err:
        raise CommandError(f"--config {path}: not valid JSON ({err})") from err
    if not isinstance(config, dict) or not isinstance(config.get("layers"), list):
        raise CommandError(f'--config {path}: expected an object with a "layers" list, e.g. '
                           '{"seq_len": 4096, "layers": ["causal"]}')
    return config


def _verify(args: argparse.Namespace) -> int:
    import time

    from flexsparse.specs import parse_stack
    from flexsparse.verify import max_hole_free_length, receptive_field

    specs, repeat, seq_len = args.layers or [], args.repeat, args.seq_len
    if args.config:
        config = _read_config(args.config)
        specs, repeat = config["layers"], config.get("repeat", repeat)
        seq_len = config.get("seq_len", seq_len)
    if not specs:
        raise CommandError("give --layers SPEC ... or --config FILE")
    if seq_len is None and not args.max_length:
        raise CommandError("give --seq-len (or seq_len in the config), or --max-length")
    _check_device(args.device)
    stack = parse_stack(specs, repeat)
    progress = _progress if sys.stderr.isatty() else None
    if args.max_length:
        start = time.perf_counter()
        horizon = max_hole_free_length(stack, limit=args.limit, device=args.device, progress=progress)
        print(f"max hole-free length: {horizon} ({time.perf_counter() - start:.2f} s)")
        if seq_len is None:
            return EXIT_OK
    start = time.perf_counter()
    report = receptive_field(stack, seq_len, device=args.device, progress=progress,
                             stop_at_first_hole=args.first_hole_only)
    print(report)
    done = "all" if report.positions_done == seq_len else "the first"
    print(f"verified exactly, {done} {report.positions_done:,} queries, in {time.perf_counter() - start:.2f} s")
    return EXIT_OK if report.hole_free else EXIT_HOLE


def _show_xa(kwargs: dict, args: argparse.Namespace) -> int:
    """XAttention's blocks depend on the input: draw them for synthetic inputs (sinks, windows, needles)."""
    from flexsparse.masks import XAttention
    from flexsparse.synthetic import synthetic_attention_inputs

    try:
        pattern = XAttention(**kwargs, rule=args.rule)
    except (TypeError, ValueError) as err:
        raise CommandError(f"bad arguments in spec {args.pattern!r}: {err}") from None
    if args.seq_len % pattern.stride:
        raise CommandError(f"--seq-len ({args.seq_len}) must be a multiple of the stride ({pattern.stride})")
    _require_matplotlib("flexsparse show")
    from flexsparse.tools.pictures import draw_xa_blocks

    inputs = synthetic_attention_inputs(heads=args.heads, kv_heads=args.heads, seq_len=args.seq_len, head_dim=64,
                                        seed=args.seed)
    path = draw_xa_blocks(inputs.q, inputs.k, args.out, threshold=pattern.threshold, stride=pattern.stride,
                          block_size=pattern.block_size, rule=pattern.rule, titles=inputs.kinds)
    print(f"wrote {path}")
    return EXIT_OK


def _varies_by_layer(name: str, kwargs: dict) -> bool:
    """Whether the spec's pattern takes a ``layer_idx`` that the spec leaves to the row (ESA)."""
    import inspect

    from flexsparse.specs import PATTERNS

    cls = PATTERNS.get(name)
    return cls is not None and "layer_idx" in inspect.signature(cls).parameters and "layer_idx" not in kwargs


def _show(args: argparse.Namespace) -> int:
    from flexsparse.specs import parse_pattern, split_spec

    _positive("--seq-len", args.seq_len)
    _positive("--layers", args.layers)
    _positive("--heads", args.heads)
    name, kwargs = split_spec(args.pattern)
    if name == "xa":
        if args.layers:
            raise CommandError("--layers applies to ESA specs, not to xa")
        return _show_xa(kwargs, args)
    if args.layers:
        if args.layers > 1 and not _varies_by_layer(name, kwargs):
            raise CommandError(f"--layers {args.layers}: {args.pattern!r} is the same in every layer, so its rows "
                               "would be identical; --layers applies to patterns that take their layer_idx from the "
                               "row (esa without layer_idx)")
        rows = [(f"layer {i}", parse_pattern(args.pattern, layer_idx=i)) for i in range(args.layers)]
    else:
        rows = [(args.pattern.split(":")[0], parse_pattern(args.pattern))]
    _require_matplotlib("flexsparse show")
    from flexsparse.tools.pictures import draw_masks

    path = draw_masks(rows, args.seq_len, args.out)
    print(f"wrote {path}")
    return EXIT_OK


def _bench_hf(args: argparse.Namespace) -> int:
    if importlib.util.find_spec("transformers") is None:
        raise CommandError("bench --hf needs transformers: pip install 'flexsparse[hf]'")
    if not args.smoke:
        _require_cuda("flexsparse bench --hf (use --smoke for toy sizes on the CPU)")
    from flexsparse.tools.bench_hf import SMOKE, HfBenchConfig, run_hf_bench

    run_hf_bench(SMOKE if args.smoke else HfBenchConfig(), args.out)
    return EXIT_OK


def _bench(args: argparse.Namespace) -> int:
    if args.hf or args.smoke:
        if not args.hf:
            raise CommandError("--smoke applies to --hf")
        return _bench_hf(args)
    for seq in args.seq:
        _positive("--seq", seq)
    _require_cuda("flexsparse bench")
    _require_matplotlib("flexsparse bench (its plot)")
    from flexsparse.tools.bench import run_bench

    run_bench(args.seq, backward=not args.forward_only, out_dir=args.out, only=args.only)
    return EXIT_OK


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="flexsparse", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="run hybrid layers, check them against the dense reference, time them")
    demo.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    demo.add_argument("--backend", default=None, choices=["flex", "flex_eager", "dense"],
                      help="default: flex on CUDA, flex_eager (uncompiled, exact) on CPU")
    demo.add_argument("--seq", type=int, default=None, help="sequence length (default 1024 on CPU, 4096 on CUDA)")
    demo.add_argument("--hf", action="store_true",
                      help="a tiny random Llama through flexsparse.convert: padded prefill, generate() with the "
                           "sparse KV cache, save/load, revert (default device cpu)")
    demo.set_defaults(run=_demo)

    verify = sub.add_parser("verify", help="prove a stack of layers has no attention holes "
                                           "(exit 0 hole-free, 1 hole, 2 bad input)")
    verify.add_argument("--layers", nargs="+", metavar="SPEC",
                        help="one spec per layer, e.g. 'esa:num_layers=8,attn_length=64,num_heads=8' or "
                             "'causal+sink_window:sink=4,window=64' (per-head patterns joined with +)")
    verify.add_argument("--repeat", type=int, default=1, help="repeat the --layers list this many times")
    verify.add_argument("--seq-len", type=int, default=None)
    verify.add_argument("--config", help='JSON: {"seq_len": N, "layers": [spec or [per-head specs], ...], "repeat": n}')
    verify.add_argument("--device", default=None, help="cpu (default) or cuda")
    verify.add_argument("--first-hole-only", action="store_true",
                        help="stop once hole-freeness and the first hole are certain (no coverage per layer)")
    verify.add_argument("--max-length", action="store_true",
                        help="print the longest hole-free sequence length (searched up to --limit); with "
                             "--seq-len, also verify that length")
    verify.add_argument("--limit", type=int, default=1 << 22, help="upper end of the --max-length search "
                                                                   "(default 4,194,304)")
    verify.set_defaults(run=_verify)

    show = sub.add_parser("show", help="write a PNG of a pattern's mask per head (per layer with --layers); "
                                       "'xa:threshold=0.9,stride=16,block_size=128' draws XAttention's blocks on "
                                       "synthetic inputs")
    show.add_argument("pattern", help="a spec, e.g. 'esa:num_layers=12,attn_length=32,num_heads=8'")
    show.add_argument("--seq-len", type=int, default=512)
    show.add_argument("--layers", type=int, default=None,
                      help="draw layers 0..N-1 of a pattern that varies by layer (ESA: layer_idx by row)")
    show.add_argument("--heads", type=int, default=8, help="xa: synthetic heads drawn (one per kind)")
    show.add_argument("--seed", type=int, default=0, help="xa: seed of the synthetic inputs")
    show.add_argument("--rule", default="plus_one", help="xa: block selection rule, plus_one or minimal")
    show.add_argument("--out", default="pattern.png")
    show.set_defaults(run=_show)

    bench = sub.add_parser("bench", help="GPU benchmark against SDPA and serial dispatch (writes JSON and PNG)")
    bench.add_argument("--seq", type=int, nargs="+", default=[8192, 32768, 131072])
    bench.add_argument("--forward-only", action="store_true")
    bench.add_argument("--out", default="bench/results")
    bench.add_argument("--only", default=None, help="run only configurations whose name contains this text")
    bench.add_argument("--hf", action="store_true",
                       help="the transformers suite instead: decode step per layer against all-full SDPA, KV "
                            "memory, generate() tokens/s (writes hf-bench.json)")
    bench.add_argument("--smoke", action="store_true", help="with --hf: toy sizes on the CPU (checks the suite)")
    bench.set_defaults(run=_bench)

    from flexsparse.eval.cli import add_calibrate_command, add_eval_command

    add_eval_command(sub)
    add_calibrate_command(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run a command; returns its exit code. Input errors print one line on stderr and return 2."""
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except (CommandError, ValueError, TypeError, OSError, ImportError) as err:
        message = " ".join(str(err).split()) or type(err).__name__
        print(f"flexsparse {args.command}: error: {message}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
