"""Command line: `flexsparse demo | verify | bench | show`."""

from __future__ import annotations

import argparse
import sys


def _demo(args: argparse.Namespace) -> int:
    from flexsparse.demo import run_demo

    run_demo(device=args.device, backend=args.backend, seq=args.seq)
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
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
