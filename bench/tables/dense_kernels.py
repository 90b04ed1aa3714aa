"""Times SDPA's backends on causal GQA attention and writes the per-device table flexsparse picks full heads'
kernel from (:mod:`flexsparse.runtime.dense_kernels`).

Shape: B=1, 32 query / 8 KV heads, head dim 128, bf16, causal, lengths 8K to 128K, forward and forward+backward.
Kernels: SDPA's ``flash``, ``cudnn`` and ``efficient`` backends, each alone (``sdpa_kernel``), called as
flexsparse calls them (``enable_gqa=True``, no K/V copy); a backend that refuses that call runs on K/V repeated to
32 heads, the copy inside the timed call, marked ``repeat_kv`` and left out of the table. For reference:
compiled flex_attention with flexsparse's closed-form causal BlockMask (``flex``), and flex with
``kernel_options={"BACKEND": "FLASH"}`` (``flex-fa4``). FlashAttention-4 itself (``fa4``: ``flash_attn.cute``'s
``flash_attn_func``, which :class:`~flexsparse.runtime.fa4_executor.Fa4Executor` runs) is measured and ranked in the
table too. Both need the ``fast`` extra (flash-attn-4 and nvidia-cutlass-dsl) and are skipped without it; ``--site
DIR`` adds a folder it was installed in with ``site.addsitedir`` (the CuTe DSL finds its ``cutlass`` module
through a .pth file, which PYTHONPATH does not read).

Time: median of CUDA-event-timed calls after one warm-up call (which builds cuDNN's graph and compiles flex), as
many calls as fit ``--budget-s`` (3 to 25). TFLOP/s counts ``4 d`` FLOPs per attended (query, key) pair and query
head (L(L+1)/2 causal pairs), times 3.5 for forward+backward (the backward's five matrix products against the
forward's two). ``vs best``: time over the fastest kernel's at that (pass, length).

    python bench/tables/dense_kernels.py --out bench/results/dense_kernels.json --write-table  # an H100: ~2 minutes
    python bench/tables/dense_kernels.py --device cpu --tiny          # CPU check, toy sizes: ~1 minute on 2 cores

(the script puts its checkout first on sys.path). ``--write-table`` ranks the SDPA backends and FlashAttention-4
that ran the call natively by time at every (pass, length) and writes them with their TFLOP/s into the shipped
table (``flexsparse/runtime/data/dense_kernels.json``) under ``--device-key`` (default: the device name's model,
such as ``H100``), replacing that key's rows and keeping other devices'; with a path it writes there instead (the
only way from ``--tiny`` or the CPU).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import site
import sys
import time
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import sdpa_kernel

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))  # the checkout's flexsparse, and bench.common

from bench.common import attention_inputs, one_line, timed_ms  # noqa: E402
from flexsparse.masks import Causal, Geometry  # noqa: E402
from flexsparse.runtime.compiled import run_flex  # noqa: E402
from flexsparse.runtime.dense_kernels import DENSE_KERNELS, OTHER_KERNELS, SDPA_BACKENDS  # noqa: E402
from flexsparse.runtime.device_tables import PASSES  # noqa: E402

FULL = {"heads": 32, "kv_heads": 8, "dim": 128, "lengths": [8192, 16384, 32768, 65536, 131072], "dtype": "bfloat16"}
TINY = {"heads": 4, "kv_heads": 2, "dim": 32, "lengths": [128, 256], "dtype": "float32"}
GPU_KERNELS = ["flash", "cudnn", "efficient", "fa4", "flex", "flex-fa4"]
CPU_KERNELS = ["flash", "math", "cudnn", "efficient", "flex"]
KERNELS = [*SDPA_BACKENDS, "fa4", "flex", "flex-fa4"]
RANKED = (*SDPA_BACKENDS, *OTHER_KERNELS)
"""The kernels the table ranks (each run by an executor)."""
FORWARD_BACKWARD_FLOPS = 3.5
BLOCK_SIZE = 128


def causal_flops(heads: int, dim: int, length: int, pass_name: str) -> float:
    """FLOPs of causal attention of one sequence (B=1)."""
    forward = 4 * dim * heads * length * (length + 1) / 2
    return forward * (FORWARD_BACKWARD_FLOPS if pass_name == "forward_backward" else 1.0)


def sdpa_attend(backend: str, repeat_kv: bool) -> Callable:
    """Causal SDPA on one backend alone; GQA natively, or on K/V repeated to the query heads (inside the call)."""
    enabled = [SDPA_BACKENDS[backend]]

    def attend(q, k, v):
        with sdpa_kernel(enabled):
            if repeat_kv:
                group = q.shape[1] // k.shape[1]
                k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
                return F.scaled_dot_product_attention(q, k, v, is_causal=True)
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    return attend


def fa4_attend(q, k, v):
    """FlashAttention-4 as flexsparse's executor calls it: [B, H, S, d] views as [B, S, H, d], GQA native."""
    from flash_attn.cute import flash_attn_func

    out = flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=True)
    return (out[0] if isinstance(out, tuple) else out).transpose(1, 2)


def flex_attend(heads: int, length: int, device: torch.device, kernel_options: dict | None) -> Callable:
    block_mask = Causal().block_mask(Geometry(heads, length, length, BLOCK_SIZE, device))
    return lambda q, k, v: run_flex(q, k, v, block_mask, q.shape[-1] ** -0.5, kernel_options)


def fa4_missing() -> str | None:
    """Why FlashAttention-4 (directly or as flex's FLASH backend) cannot run here, or None."""
    try:
        if importlib.util.find_spec("flash_attn.cute") is None:
            return "flash_attn.cute not importable (needs flash-attn-4 and nvidia-cutlass-dsl)"
    except (ImportError, ValueError) as err:
        return f"flash_attn.cute not importable ({err})"
    return None


def measure(kernel: str, pass_name: str, length: int, shape: dict, device: torch.device, budget_s: float) -> dict:
    """One row: ms, TFLOP/s and how GQA ran, or the reason it was skipped."""
    row = {"kernel": kernel, "pass": pass_name, "length": length}
    dtype = getattr(torch, shape["dtype"])
    grad = pass_name == "forward_backward"
    if kernel in ("fa4", "flex-fa4") and (reason := fa4_missing()):
        return {**row, "skipped": reason}
    q, k, v, grad_out = attention_inputs(length, grad, shape["heads"], shape["kv_heads"], shape["dim"],
                                         device=device, dtype=dtype)
    if kernel in SDPA_BACKENDS:
        ways = [("native", sdpa_attend(kernel, False)), ("repeat_kv", sdpa_attend(kernel, True))]
    elif kernel == "fa4":
        ways = [("native", fa4_attend)]
    else:
        options = {"BACKEND": "FLASH"} if kernel == "flex-fa4" else None
        ways = [("native", flex_attend(shape["heads"], length, device, options))]
    errors = []
    for gqa, attend in ways:
        if grad:
            step = lambda attend=attend: torch.autograd.grad(attend(q, k, v), (q, k, v), grad_out)
        else:
            step = lambda attend=attend: attend(q, k, v)
        try:
            with torch.no_grad() if not grad else torch.enable_grad():
                ms, calls = timed_ms(step, budget_s, device)
        except (RuntimeError, NotImplementedError, ValueError, AssertionError) as err:  # refused or out of memory
            errors.append(one_line(err) if not errors or one_line(err) != errors[-1] else None)
            if device.type == "cuda":
                torch.cuda.empty_cache()
            continue
        tflops = causal_flops(shape["heads"], shape["dim"], length, pass_name) / (ms * 1e-3) / 1e12
        return {**row, "gqa": gqa, "ms": ms, "tflops": tflops, "calls": calls}
    return {**row, "skipped": "; ".join(e for e in errors if e is not None)}


def add_ratios(rows: list[dict]) -> None:
    """``vs_best``: each row's time over the fastest at its (pass, length)."""
    for row in rows:
        times = [r["ms"] for r in rows if "ms" in r and (r["pass"], r["length"]) == (row["pass"], row["length"])]
        if "ms" in row:
            row["vs_best"] = row["ms"] / min(times)


def print_tables(rows: list[dict], kernels: list[str]) -> None:
    for pass_name in PASSES:
        lengths = sorted({r["length"] for r in rows if r["pass"] == pass_name})
        if not lengths:
            continue
        print(f"\n{pass_name}: ms | TFLOP/s | time vs best")
        print(f"{'length':>8}" + "".join(f"{k:>26}" for k in kernels))
        for length in lengths:
            cells = []
            for kernel in kernels:
                row = next(r for r in rows if (r["kernel"], r["pass"], r["length"]) == (kernel, pass_name, length))
                if "ms" not in row:
                    cells.append(f"{'skipped':>26}")
                    continue
                mark = "*" if row["gqa"] == "repeat_kv" else " "
                cells.append(f"{row['ms']:9.3f} {row['tflops']:7.4g} x{row['vs_best']:4.2f}{mark}".rjust(26))
            print(f"{length:>8}" + "".join(cells))
    skipped = {(r["kernel"], r["skipped"]) for r in rows if "skipped" in r}
    for kernel, reason in sorted(skipped):
        print(f"skipped {kernel}: {reason}")
    if any(r.get("gqa") == "repeat_kv" for r in rows):
        print("* K/V repeated to the query heads (the backend refuses enable_gqa); not eligible for the table")


def table_entries(rows: list[dict]) -> list[dict]:
    """The table's rows: the ranked kernels (SDPA backends, FlashAttention-4) that ran natively, fastest first,
    with their TFLOP/s."""
    entries = []
    for pass_name in PASSES:
        for length in sorted({r["length"] for r in rows if r["pass"] == pass_name}):
            ran = sorted((r for r in rows if (r["pass"], r["length"]) == (pass_name, length)
                          and r["kernel"] in RANKED and r.get("gqa") == "native"), key=lambda r: r["ms"])
            if all(r["kernel"] == "cudnn" or r["kernel"] in OTHER_KERNELS for r in ran):
                print(f"table: no row for ({pass_name}, {length}): no SDPA backend besides cudnn ran",
                      file=sys.stderr)
                continue
            entries.append({"pass": pass_name, "length": length, "backends": [r["kernel"] for r in ran],
                            "tflops": {r["kernel"]: float(f"{r['tflops']:.4g}") for r in ran}})
    return entries


def write_table(path: Path, key: str, shape: dict, rows: list[dict], measured: dict) -> None:
    """Replaces ``key``'s rows of the table at ``path`` (created if absent), keeps the other devices', and checks
    that flexsparse loads the result."""
    entry = {"dtype": shape["dtype"], "measured": measured, "entries": table_entries(rows)}
    DENSE_KERNELS.write(path, key, entry)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    parser.add_argument("--tiny", action="store_true", help="toy sizes: 4/2 heads, d 32, lengths 128 and 256, fp32")
    parser.add_argument("--kernels", nargs="+", choices=KERNELS, help="default: flash cudnn efficient flex "
                        "flex-fa4 on CUDA; flash math cudnn efficient flex on the CPU")
    parser.add_argument("--lengths", nargs="+", type=int, help="sequence lengths (default: 8K to 128K)")
    parser.add_argument("--passes", nargs="+", choices=PASSES, default=list(PASSES))
    parser.add_argument("--budget-s", type=float, default=0.3, help="time budget per measurement (3 to 25 calls)")
    parser.add_argument("--out", type=Path, help="write every row as JSON here")
    parser.add_argument("--write-table", nargs="?", type=Path, const=True, default=None, metavar="PATH",
                        help="write the ranking into the shipped table (or into PATH)")
    parser.add_argument("--device-key", help="the table's key for this device (default: the name's model)")
    parser.add_argument("--site", help="a folder FlashAttention-4 is installed in (added with site.addsitedir)")
    args = parser.parse_args(argv)
    if args.device not in ("cuda", "cpu"):
        parser.error(f"--device must be cuda or cpu, got {args.device!r}")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device here (use --device cpu --tiny)")
    if args.write_table is True and (args.tiny or args.device != "cuda" or args.lengths):
        parser.error("--write-table without a path writes the shipped table: only from the full-size CUDA run")
    if args.lengths and any(n < 1 for n in args.lengths):
        parser.error(f"--lengths must be positive, got {args.lengths}")
    if args.budget_s <= 0:
        parser.error(f"--budget-s must be positive, got {args.budget_s}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.site:
        site.addsitedir(args.site)
    device = torch.device(args.device)
    shape = dict(TINY if args.tiny else FULL)
    if args.lengths:
        shape["lengths"] = args.lengths
    kernels = args.kernels or (GPU_KERNELS if device.type == "cuda" else CPU_KERNELS)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    cudnn = torch.backends.cudnn.version() if device.type == "cuda" else None
    print(f"{name}, torch {torch.__version__}, cuDNN {cudnn}; B=1, {shape['heads']}/{shape['kv_heads']} heads, "
          f"d {shape['dim']}, {shape['dtype']}, causal")
    started = time.perf_counter()
    rows = []
    for kernel in kernels:
        kernel_start = time.perf_counter()
        for pass_name in args.passes:
            for length in shape["lengths"]:
                rows.append(measure(kernel, pass_name, length, shape, device, args.budget_s))
        print(f"{kernel}: {time.perf_counter() - kernel_start:.1f} s", flush=True)
    add_ratios(rows)
    print_tables(rows, kernels)
    print(f"\ntotal {time.perf_counter() - started:.1f} s")
    measured = {"device": name, "torch": torch.__version__, "cudnn": cudnn,
                "date": datetime.now(timezone.utc).strftime("%Y-%m-%d"),
                "shape": {k: shape[k] for k in ("heads", "kv_heads", "dim")}}
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({**measured, "rows": rows}, indent=1) + "\n")
        print(f"wrote {args.out}")
    if args.write_table is not None:
        path = DENSE_KERNELS.shipped_path if args.write_table is True else args.write_table
        key = args.device_key or (name.removeprefix("NVIDIA ").split() or [name])[0]
        write_table(path, key, shape, rows, measured)
    return 0


if __name__ == "__main__":
    sys.exit(main())
