"""Times one ESA layer on flexsparse's gather kernel and on compiled flex, and writes the per-device table the ESA
executor prices the kernel and chooses between the two from (:mod:`flexsparse.runtime.esa_executor`).

Shape: B=1, 32 query / 8 KV heads, head dim 128, bf16; the layer of ``flexsparse bench``'s "ESA layer 4/8"
(``ESA(4, 8, attn_length, 32)`` on every head) at attn_length 64 and 256, lengths 2K to 32K, forward and
forward+backward. Each layer is a HybridAttention whose executor set holds one executor: the kernel
(``EsaExecutor(crossover=False)``, so the table being measured does not steer it) or compiled flex
(``FlexExecutor``); SDPA causal (``enable_gqa``, SDPA's own backend) is timed as a reference. At the shortest length
the two layers' outputs and gradients are checked to agree within bf16 tolerance (max |difference| over the
largest magnitude: 3e-2 for outputs, 6e-2 for gradients, as tests/test_gpu.py).

Time: median of CUDA-event-timed calls after one warm-up call (which compiles), as many calls as fit
``--budget-s`` (3 to 25). Measurements past ``--deadline-s`` (whole run) are skipped, as are those that fail (out
of memory, say): the outputs are written with what was measured. ``rate`` is the layer's seconds per (query head,
attended key), over ``heads x length x min(attn_length, length)`` pairs: the unit the executor prices in.

    PYTHONPATH=. python bench/tables/esa_crossover.py --out rows.json \\
        --write-table flexsparse/runtime/data/esa_kernel.json   # under 4 minutes: --deadline-s 200 bounds it

``--write-table PATH`` writes, under ``--device-key`` (default: the device name's model, such as ``H100``), every
(pass, length, attn_length) where both layers ran, replacing that key's rows and keeping other devices'.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))  # the checkout's flexsparse, and bench.common

from bench.common import Deadline, attention_inputs, one_line, timed_ms  # noqa: E402
from flexsparse import HybridAttention  # noqa: E402
from flexsparse.kernels.availability import triton_version  # noqa: E402
from flexsparse.masks import ESA  # noqa: E402
from flexsparse.runtime.device_tables import PASSES  # noqa: E402
from flexsparse.runtime.esa_executor import EsaExecutor  # noqa: E402
from flexsparse.runtime.esa_kernel_table import ESA_KERNEL  # noqa: E402
from flexsparse.runtime.flex import FlexExecutor  # noqa: E402

HEADS, KV_HEADS, DIM, LAYER, NUM_LAYERS = 32, 8, 128, 4, 8
LENGTHS = [2048, 4096, 8192, 16384, 32768]
ATTN_LENGTHS = [64, 256]
EXECUTORS = ("kernel", "flex")
OUT_TOLERANCE, GRAD_TOLERANCE = 3e-2, 6e-2


def esa_layers(attn_length: int) -> dict[str, HybridAttention]:
    """The ESA layer with its heads forced onto the kernel and onto compiled flex (one pattern object: flex's
    masks are cached per length)."""
    pattern = ESA(LAYER, NUM_LAYERS, attn_length, HEADS)
    patterns, modes = {"esa": pattern}, ["esa"] * KV_HEADS
    executors = {"kernel": EsaExecutor(crossover=False), "flex": FlexExecutor([pattern], compiled=True)}
    return {name: HybridAttention(HEADS, KV_HEADS, DIM, patterns, modes, executors=[executor]).cuda()
            for name, executor in executors.items()}


def sdpa_causal(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


def measure(name: str, attend: Callable, pass_name: str, length: int, attn_length: int | None, budget_s: float,
            deadline: Deadline) -> dict:
    """One row: ms and rate, or why it was skipped."""
    row = {"executor": name, "pass": pass_name, "length": length, "attn_length": attn_length}
    if deadline.passed():
        return {**row, "skipped": "past --deadline-s"}
    grad = pass_name == "forward_backward"
    failure = None
    try:
        q, k, v, grad_out = attention_inputs(length, grad, HEADS, KV_HEADS, DIM)
        if grad:
            step = lambda: torch.autograd.grad(attend(q, k, v), (q, k, v), grad_out)
        else:
            step = lambda: attend(q, k, v)
        with torch.enable_grad() if grad else torch.no_grad():
            ms, calls = timed_ms(step, budget_s)
    except Exception as err:  # noqa: BLE001 -- one shot on a lent machine: record the failure (OOM, compile), go on
        failure = one_line(err)
    if failure is not None:
        torch.cuda.empty_cache()  # after the handler: its traceback no longer holds the failed call's tensors
        return {**row, "skipped": failure}
    if attn_length is not None:
        row["rate"] = ms * 1e-3 / (HEADS * length * min(attn_length, length))
    return {**row, "ms": ms, "calls": calls}


def agreement(layers: dict[str, HybridAttention], length: int) -> dict:
    """Max |kernel - flex| over flex's largest magnitude, for the output and each gradient (bf16)."""
    errors = {}
    results = {}
    for name, layer in layers.items():
        q, k, v, grad_out = attention_inputs(length, True, HEADS, KV_HEADS, DIM, seed=1)
        out = layer(q, k, v)
        results[name] = (out.detach(), *torch.autograd.grad(out, (q, k, v), grad_out))
    for label, got, expected in zip(("out", "dq", "dk", "dv"), results["kernel"], results["flex"]):
        errors[label] = float((got.float() - expected.float()).abs().max() / expected.float().abs().max())
    ok = errors["out"] <= OUT_TOLERANCE and all(errors[g] <= GRAD_TOLERANCE for g in ("dq", "dk", "dv"))
    return {"length": length, "errors": errors, "ok": ok}


def run(args: argparse.Namespace) -> tuple[list[dict], list[dict]]:
    """Every measurement row, and the agreement check per attn_length."""
    deadline = Deadline(args.deadline_s)
    layers = {w: esa_layers(w) for w in args.attn_lengths}
    checks, rows = [], []
    for w in args.attn_lengths:
        try:
            checks.append({"attn_length": w, **agreement(layers[w], min(args.lengths))})
        except Exception as err:  # noqa: BLE001 -- reported, and the table is not written
            checks.append({"attn_length": w, "length": min(args.lengths), "ok": False, "error": one_line(err)})
        print(f"check attn_length {w}: {checks[-1]}", flush=True)
    for length in sorted(args.lengths):
        started = time.perf_counter()
        for pass_name in args.passes:
            rows.append(measure("sdpa", sdpa_causal, pass_name, length, None, args.budget_s, deadline))
            for w in args.attn_lengths:
                for name in EXECUTORS:
                    rows.append(measure(name, layers[w][name], pass_name, length, w, args.budget_s, deadline))
        print(f"length {length}: {time.perf_counter() - started:.1f} s", flush=True)
    return rows, checks


def find(rows: list[dict], executor: str, pass_name: str, length: int, attn_length: int | None) -> dict | None:
    return next((r for r in rows if (r["executor"], r["pass"], r["length"], r["attn_length"])
                 == (executor, pass_name, length, attn_length) and "ms" in r), None)


def print_table(rows: list[dict]) -> None:
    fmt = lambda row: f"{row['ms']:9.3f}" if row else f"{'-':>9}"
    for pass_name in PASSES:
        windows = sorted({r["attn_length"] for r in rows if r["pass"] == pass_name and r["attn_length"]})
        for w in windows:
            print(f"\n{pass_name}, attn_length {w}: ms (flex/kernel < 1: flex is faster)")
            print(f"{'length':>8}{'kernel':>10}{'flex':>10}{'flex/kern':>10}{'sdpa':>10}{'kern/sdpa':>10}"
                  f"{'kernel ps/qk':>14}")
            for length in sorted({r["length"] for r in rows if r["pass"] == pass_name}):
                kernel, flex = find(rows, "kernel", pass_name, length, w), find(rows, "flex", pass_name, length, w)
                sdpa = find(rows, "sdpa", pass_name, length, None)
                ratio = f"{flex['ms'] / kernel['ms']:10.2f}" if kernel and flex else f"{'-':>10}"
                vs_sdpa = f"{kernel['ms'] / sdpa['ms']:10.2f}" if kernel and sdpa else f"{'-':>10}"
                rate = f"{kernel['rate'] * 1e12:14.3f}" if kernel else f"{'-':>14}"
                print(f"{length:>8} {fmt(kernel)} {fmt(flex)}{ratio} {fmt(sdpa)}{vs_sdpa}{rate}")
    for row in rows:
        if "skipped" in row:
            print(f"skipped {row['executor']} {row['pass']} {row['length']} attn_length {row['attn_length']}: "
                  f"{row['skipped']}", file=sys.stderr)


def table_entries(rows: list[dict]) -> list[dict]:
    """The table's rows: every (pass, length, attn_length) where the kernel and flex both ran."""
    entries = []
    for pass_name in PASSES:
        keys = sorted({(r["length"], r["attn_length"]) for r in rows if r["pass"] == pass_name and r["attn_length"]})
        for length, w in keys:
            kernel, flex = find(rows, "kernel", pass_name, length, w), find(rows, "flex", pass_name, length, w)
            if kernel and flex:
                entries.append({"pass": pass_name, "length": length, "attn_length": w,
                                "kernel_s_per_query_key": float(f"{kernel['rate']:.4g}"),
                                "flex_s_per_query_key": float(f"{flex['rate']:.4g}")})
    return entries


def write_table(path: Path, key: str, entries: list[dict], measured: dict) -> None:
    """Replaces ``key``'s rows of the table at ``path`` (created if absent), keeps the other devices', and checks
    that flexsparse loads the result."""
    entry = {"dtype": "bfloat16", "head_dim": DIM, "measured": measured, "entries": entries}
    ESA_KERNEL.write(path, key, entry)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", nargs="+", type=int, default=LENGTHS, help="sequence lengths (default: 2K-32K)")
    parser.add_argument("--attn-lengths", nargs="+", type=int, default=ATTN_LENGTHS, help="ESA attn_length values")
    parser.add_argument("--passes", nargs="+", choices=PASSES, default=list(PASSES))
    parser.add_argument("--budget-s", type=float, default=0.3, help="time budget per measurement (3 to 25 calls)")
    parser.add_argument("--deadline-s", type=float, default=200.0,
                        help="measurements start only this long after the run began (default 200 s)")
    parser.add_argument("--out", type=Path, help="write every row as JSON here")
    parser.add_argument("--write-table", type=Path, metavar="PATH",
                        help="write the measured rates here (flexsparse/runtime/data/esa_kernel.json)")
    parser.add_argument("--device-key", help="the table's key for this device (default: the name's model)")
    args = parser.parse_args(argv)
    for flag, values in (("--lengths", args.lengths), ("--attn-lengths", args.attn_lengths)):
        if any(n < 1 for n in values):
            parser.error(f"{flag} must be positive, got {values}")
    if args.budget_s <= 0 or args.deadline_s <= 0:
        parser.error(f"--budget-s and --deadline-s must be positive, got {args.budget_s} and {args.deadline_s}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("esa_crossover: needs a CUDA device (the ESA kernel and compiled flex's backward run there)",
              file=sys.stderr)
        return 2
    name = torch.cuda.get_device_name()
    print(f"{name}, torch {torch.__version__}, triton {triton_version()}; B=1, {HEADS}/{KV_HEADS} heads, d {DIM}, "
          f"bfloat16, ESA({LAYER}, {NUM_LAYERS}, attn_length, {HEADS})", flush=True)
    started = time.perf_counter()
    rows, checks = run(args)
    print_table(rows)
    print(f"\ntotal {time.perf_counter() - started:.1f} s")
    measured = {"device": name, "torch": torch.__version__, "triton": triton_version(),
                "date": datetime.now(timezone.utc).strftime("%Y-%m-%d"),
                "shape": {"heads": HEADS, "kv_heads": KV_HEADS, "dim": DIM, "layer": LAYER, "num_layers": NUM_LAYERS}}
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({**measured, "checks": checks, "rows": rows}, indent=1) + "\n")
        print(f"wrote {args.out}")
    if not all(check["ok"] for check in checks):
        print("esa_crossover: the kernel and flex disagree (or the check failed); table not written",
              file=sys.stderr)
        return 1
    if args.write_table is not None:
        entries = table_entries(rows)
        if not entries:
            print("esa_crossover: no (pass, length, attn_length) where both ran; table not written", file=sys.stderr)
            return 1
        key = args.device_key or (name.removeprefix("NVIDIA ").split() or [name])[0]
        write_table(args.write_table, key, entries, measured)
    return 0


if __name__ == "__main__":
    sys.exit(main())
