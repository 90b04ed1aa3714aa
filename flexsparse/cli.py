"""Command line: `flexsparse demo | verify | bench | show`."""

from __future__ import annotations

import argparse
import sys


def _demo(args: argparse.Namespace) -> int:
    from flexsparse.tools.demo import run_demo

    run_demo(device=args.device, backend=args.backend, seq=args.seq)
    return 0


def _progress(done: int, total: int) -> None:
    bar = "#" * (30 * done // total)
    print(f"\rlayer {done}/{total} [{bar:<30}]", end="\n" if done == total else "", file=sys.stderr, flush=True)


def _verify(args: argparse.Namespace) -> int:
    import json
    import time

    from flexsparse.specs import parse_stack
    from flexsparse.verify import receptive_field

    specs, repeat, seq_len = args.layers or [], args.repeat, args.seq_len
    if args.config:
        config = json.loads(open(args.config).read())
        specs, repeat = config["layers"], config.get("repeat", repeat)
        seq_len = config.get("seq_len", seq_len)
    if not specs:
        raise SystemExit("flexsparse verify: give --layers SPEC ... or --config FILE")
    if seq_len is None:
        raise SystemExit("flexsparse verify: give --seq-len (or seq_len in the config)")
    stack = parse_stack(specs, repeat)
    start = time.perf_counter()
    report = receptive_field(stack, seq_len, device=args.device, progress=_progress)
    print(report)
    print(f"verified exactly, all {seq_len:,} queries, in {time.perf_counter() - start:.2f} s")
    return 0 if report.hole_free else 1


def _show(args: argparse.Namespace) -> int:
    from flexsparse.specs import parse_pattern
    from flexsparse.tools.pictures import draw_masks

    if args.layers:
        rows = [(f"layer {i}", parse_pattern(args.pattern, layer_idx=i)) for i in range(args.layers)]
    else:
        rows = [(args.pattern.split(":")[0], parse_pattern(args.pattern))]
    path = draw_masks(rows, args.seq_len, args.out)
    print(f"wrote {path}")
    return 0


def _bench(args: argparse.Namespace) -> int:
    from flexsparse.tools.bench import run_bench

    run_bench(args.seq, backward=not args.forward_only, out_dir=args.out, only=args.only)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="flexsparse", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="run hybrid layers, check them against the dense reference, time them")
    demo.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    demo.add_argument("--backend", default=None, choices=["flex", "flex_eager", "dense"],
                      help="default: flex on CUDA, flex_eager (uncompiled, exact) on CPU")
    demo.add_argument("--seq", type=int, default=None, help="sequence length (default 1024 on CPU, 4096 on CUDA)")
    demo.set_defaults(run=_demo)

    verify = sub.add_parser("verify", help="prove a stack of layers has no attention holes (exit 1 on a hole)")
    verify.add_argument("--layers", nargs="+", metavar="SPEC",
                        help="one spec per layer, e.g. 'esa:num_layers=8,attn_length=64,num_heads=8' or "
                             "'causal+sink_window:sink=4,window=64' (per-head patterns joined with +)")
    verify.add_argument("--repeat", type=int, default=1, help="repeat the --layers list this many times")
    verify.add_argument("--seq-len", type=int, default=None)
    verify.add_argument("--config", help='JSON: {"seq_len": N, "layers": [spec or [per-head specs], ...], "repeat": n}')
    verify.add_argument("--device", default=None, help="cpu (default) or cuda")
    verify.set_defaults(run=_verify)

    show = sub.add_parser("show", help="write a PNG of a pattern's mask per head (per layer with --layers)")
    show.add_argument("pattern", help="a spec, e.g. 'esa:num_layers=12,attn_length=32,num_heads=8'")
    show.add_argument("--seq-len", type=int, default=512)
    show.add_argument("--layers", type=int, default=None, help="draw ESA layers 0..N-1 (layer_idx by row)")
    show.add_argument("--out", default="pattern.png")
    show.set_defaults(run=_show)

    bench = sub.add_parser("bench", help="GPU benchmark against SDPA and serial dispatch (writes JSON and PNG)")
    bench.add_argument("--seq", type=int, nargs="+", default=[8192, 32768, 131072])
    bench.add_argument("--forward-only", action="store_true")
    bench.add_argument("--out", default="bench/results")
    bench.add_argument("--only", default=None, help="run only configurations whose name contains this text")
    bench.set_defaults(run=_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
