"""Times the ESA kernel's passes one by one (forward, dQ, dK/dV) beside SDPA causal and, optionally, the ESA
authors' Triton kernel, in one run: where the forward+backward time goes, and how far it is from SDPA and theirs.

Shape: B=1, 32 query / 8 KV heads, d=128, bf16, ``ESA(4, 8, attn_length, 32)`` (layer 4 of 8; issue 12's shape).
Each row is the median of ``triton.testing.do_bench`` (L2 flushed between calls). ``ps/pair`` is picoseconds per
(query head, attended key) pair, ``heads x length x attn_length``; the forward's and each backward kernel's bytes
moved through L2 are about 512 per pair (two 16-bit rows of d=128), so ``TB/s`` = 512 B / (ps per pair) is the
gathered stream a pass sustains (the H100's measured L2 read ceiling: 7.6-8.2 TB/s). What bounds the passes on the
H100 is shared-memory traffic, 1-3 KB per pair (``docs/notes/esa-kernel.md``, "The backward rebuilt").

    PYTHONPATH=. python bench/speed/esa_backward.py --seq 8192 32768 131072 --out rows.json
    PYTHONPATH=. python bench/speed/esa_backward.py --seq 131072 --authors PATH/elastic_sparse_attention.py

``--authors FILE``: the authors' module (HighCWu/elastic-sparse-attention, ``elastic_sparse_attention.py``, a copy
outside the repository), timed at the lengths of ``--authors-seq``. ``--once``: one call of each kernel after a
warm-up and no timing, for a profiler (``ncu -k regex:esa_ ...``). ``--config KEY=INT ...``: launch settings
(:data:`flexsparse.kernels.esa_launch.KERNEL_CONFIG`) for a sweep.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys

import torch
import torch.nn.functional as F
import triton

from flexsparse.kernels.esa import esa_attention, esa_launch
from flexsparse.kernels.esa_index import EsaIndexRule
from flexsparse.kernels.esa_launch import KERNEL_CONFIG, dkdv_work, launch_backward, launch_forward

HEADS, KV_HEADS, DIM, LAYER, NUM_LAYERS = 32, 8, 128, 4, 8
BYTES_PER_PAIR = 2 * DIM * 2


def inputs(length: int, seed: int = 0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    make = lambda h: torch.randn(1, h, length, DIM, device="cuda", dtype=torch.bfloat16, generator=gen)
    return make(HEADS), make(KV_HEADS), make(KV_HEADS), make(HEADS)


def sdpa_causal(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


def fwd_bwd(attend, q, k, v, grad_out):
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    return lambda: torch.autograd.grad(attend(*leaves), leaves, grad_out)


def median_ms(fn) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")


def authors_module(path: str, length: int, attn_length: int):
    spec = importlib.util.spec_from_file_location("esa_authors", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    layer = module.ElasticSparseAttention(LAYER, NUM_LAYERS, HEADS, DIM, attn_length, length,
                                          num_key_value_heads=KV_HEADS, implementation="triton")
    return layer.cuda()


def rows_for(length: int, attn_length: int, authors: str | None, once: bool) -> list[dict]:
    rule = EsaIndexRule(LAYER, NUM_LAYERS, attn_length, HEADS)
    q, k, v, grad_out = inputs(length)
    launch = esa_launch(q, k, v, rule)
    out, lse = launch_forward(q, k, v, launch)
    passes = {
        "forward kernel": lambda: launch_forward(q, k, v, launch),
        "dQ kernel": lambda: launch_backward(grad_out, q, k, v, out, lse, launch, need_dkdv=False),
        "dK/dV work list": lambda: dkdv_work(launch, 1, HEADS, q.device),
        "dQ + dK/dV kernels": lambda: launch_backward(grad_out, q, k, v, out, lse, launch, need_dkdv=True),
        "esa fwd+bwd": fwd_bwd(lambda q, k, v: esa_attention(q, k, v, rule), q, k, v, grad_out),
        "sdpa fwd": lambda: sdpa_causal(q, k, v),
        "sdpa fwd+bwd": fwd_bwd(sdpa_causal, q, k, v, grad_out),
    }
    if authors is not None:
        layer = authors_module(authors, length, attn_length)
        passes["authors fwd"] = lambda: layer(q, k, v)
        passes["authors fwd+bwd"] = fwd_bwd(lambda q, k, v: layer(q, k, v)[0], q, k, v, grad_out.transpose(1, 2)
                                            .reshape(1, length, HEADS * DIM))
    if once:
        for fn in passes.values():
            fn()
        torch.cuda.synchronize()
        return []
    pairs = HEADS * length * attn_length
    rows = []
    for name, fn in passes.items():
        ms = median_ms(fn)
        rows.append({"pass": name, "length": length, "attn_length": attn_length, "ms": ms,
                     "ps_per_pair": ms * 1e9 / pairs})
    by_name = {row["pass"]: row["ms"] for row in rows}
    by_name["dK/dV kernel"] = by_name["dQ + dK/dV kernels"] - by_name["dQ kernel"]
    rows.append({"pass": "dK/dV kernel (difference)", "length": length, "attn_length": attn_length,
                 "ms": by_name["dK/dV kernel"], "ps_per_pair": by_name["dK/dV kernel"] * 1e9 / pairs})
    for row in rows:
        ratio = f"  esa/sdpa {by_name['esa fwd+bwd'] / by_name['sdpa fwd+bwd']:.2f}" if row["pass"] == "esa fwd+bwd" \
            else ""
        if row["pass"] == "esa fwd+bwd" and "authors fwd+bwd" in by_name:
            ratio += f"  esa/authors {by_name['esa fwd+bwd'] / by_name['authors fwd+bwd']:.2f}"
        print(f"S={length:>7} w={attn_length:<4} {row['pass']:<26} {row['ms']:9.3f} ms  "
              f"{row['ps_per_pair']:7.1f} ps/pair  {BYTES_PER_PAIR / row['ps_per_pair']:5.2f} TB/s{ratio}",
              flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, nargs="+", default=[8192, 32768, 131072])
    parser.add_argument("--attn-length", type=int, default=64)
    parser.add_argument("--authors", help="the authors' elastic_sparse_attention.py")
    parser.add_argument("--authors-seq", type=int, nargs="*", default=[131072])
    parser.add_argument("--once", action="store_true", help="one call per pass, untimed (for a profiler)")
    parser.add_argument("--config", nargs="*", default=[], metavar="KEY=INT",
                        help="override the launchers' KERNEL_CONFIG entries (settings sweeps)")
    parser.add_argument("--out", help="write the rows as JSON")
    args = parser.parse_args(argv)
    for item in args.config:
        key, _, value = item.partition("=")
        if key not in KERNEL_CONFIG or not value.lstrip("-").isdigit():
            print(f"esa_backward: --config takes KEY=INT with KEY in {sorted(KERNEL_CONFIG)}, got {item!r}",
                  file=sys.stderr)
            return 2
        KERNEL_CONFIG[key] = type(KERNEL_CONFIG[key])(int(value))
    if not torch.cuda.is_available():
        print("esa_backward: needs a CUDA device", file=sys.stderr)
        return 2
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}; "
          f"B=1, {HEADS}/{KV_HEADS} heads, d {DIM}, bf16, ESA({LAYER}, {NUM_LAYERS}, {args.attn_length}, {HEADS}); "
          f"{KERNEL_CONFIG}")
    rows = []
    for length in args.seq:
        authors = args.authors if length in args.authors_seq else None
        rows += rows_for(length, args.attn_length, authors, args.once)
    if args.out:
        with open(args.out, "w") as handle:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, handle, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
