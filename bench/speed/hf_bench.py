"""The transformers benchmark of ``flexsparse bench --hf`` (flexsparse/tools/bench_hf.py) with its sizes and parts
as options, on a CUDA GPU:

    python bench/speed/hf_bench.py --out bench/results                                   # the defaults, both parts
    python bench/speed/hf_bench.py --parts decode --decode-layers 1 4 --out DIR          # the decode table of README.md
    python bench/speed/hf_bench.py --smoke --out /tmp/hf-bench                           # toy sizes on the CPU

Writes ``hf-bench.json`` into ``--out``.
"""

from __future__ import annotations

import argparse
import dataclasses

from flexsparse.tools.bench_hf import SMOKE, HfBenchConfig, run_hf_bench

OPTIONS = ("parts", "decode_seq", "decode_batches", "decode_layers", "decode_padded_batches", "e2e_seqs", "e2e_layers",
           "new_tokens")
"""The fields of HfBenchConfig that the command line sets (each ``--name-with-dashes``)."""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python bench/speed/hf_bench.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="bench/results")
    parser.add_argument("--smoke", action="store_true", help="toy sizes on the CPU (checks the script)")
    parser.add_argument("--parts", nargs="+", choices=["decode", "generate"], default=None)
    parser.add_argument("--decode-seq", type=int, default=None)
    parser.add_argument("--decode-batches", type=int, nargs="+", default=None)
    parser.add_argument("--decode-layers", type=int, nargs="+", default=None)
    parser.add_argument("--decode-padded-batches", type=int, nargs="*", default=None)
    parser.add_argument("--e2e-seqs", type=int, nargs="+", default=None)
    parser.add_argument("--e2e-layers", type=int, default=None)
    parser.add_argument("--new-tokens", type=int, default=None)
    args = parser.parse_args(argv)
    cfg = dataclasses.replace(SMOKE if args.smoke else HfBenchConfig())
    for name in OPTIONS:
        if getattr(args, name) is not None:
            setattr(cfg, name, getattr(args, name))
    run_hf_bench(cfg, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
