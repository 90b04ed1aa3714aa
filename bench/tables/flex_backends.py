"""Times compiled flex on torch's default Triton kernels and on FLASH (FlashAttention-4's CuTe kernels,
``kernel_options={"BACKEND": "FLASH"}``), and writes the per-device table flex chooses its backend from
(:mod:`flexsparse.runtime.flex_backend_table`, read by :class:`~flexsparse.runtime.flex.FlexExecutor`).

Shape: B=1, 32 query / 8 KV heads, head dim 128, bf16, block 128, one pattern on every head:
``SinkWindow(128, 2048)`` (``sink_window``; ``--patterns`` adds ``triangle_mix``, ``TriangleMix(128, 2048,
128)``), lengths 8K, 32K and 128K, forward and forward+backward. Each backend is a HybridAttention whose one
executor is a compiled :class:`~flexsparse.runtime.flex.FlexExecutor` with ``{"BACKEND": "TRITON"}`` or
``{"BACKEND": "FLASH"}`` (explicit options: the table being measured does not steer it). At the shortest
length each pattern's two layers are checked to agree, outputs and gradients (max |FLASH - Triton| over
Triton's largest magnitude: 3e-2 for outputs, 6e-2 for gradients, bf16, as tests/test_gpu.py); a pattern
FLASH refuses gets no rows. tests/test_flex_backends.py checks both against a dense reference on the GPU.
FLASH needs the ``fast`` extra (flash-attn-4 and nvidia-cutlass-dsl); ``--site DIR`` adds a folder it was
installed in with ``site.addsitedir`` (the CuTe DSL finds its ``cutlass`` module through a .pth file, which
PYTHONPATH does not read).

Time: the two backends in turns (Triton, FLASH, Triton, ... ``--rounds`` times, so clock drift hits both),
each turn the median of CUDA-event-timed calls after one warm-up call (the first compiles), as many as fit
``--budget-s`` over the turns (3 to 25 a turn); a backend's time is the median of its turns. Measurements that
would start past ``--deadline-s`` (whole run) are skipped, as are those that fail (out of memory, a refused
compile): the outputs are written with what was measured.

    PYTHONPATH=. python bench/tables/flex_backends.py --site DIR --out bench/results/flex_backends.json --write-table

``--write-table`` (no path: the shipped ``flexsparse/runtime/data/flex_backends.json``) writes, under
``--device-key`` (default: the device name's model, such as ``H100``), every (pattern, pass, length) where
both backends ran, replacing that key's rows and keeping other devices'. A disagreement writes nothing
(exit 1).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import site
import statistics
import sys
import time
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))  # the checkout's flexsparse, and bench.common

from bench.common import Deadline, attention_inputs, one_line, timed_ms  # noqa: E402
from flexsparse import HybridAttention  # noqa: E402
from flexsparse.masks import Pattern, SinkWindow, TriangleMix  # noqa: E402
from flexsparse.runtime.device_tables import PASSES  # noqa: E402
from flexsparse.runtime.fa4_executor import fa4_attention  # noqa: E402
from flexsparse.runtime.flex import FlexExecutor  # noqa: E402
from flexsparse.runtime.flex_backend_table import FLEX_BACKENDS  # noqa: E402

HEADS, KV_HEADS, DIM, BLOCK = 32, 8, 128, 128
LENGTHS = [8192, 32768, 131072]
PATTERNS: dict[str, Callable[[], Pattern]] = {
    "sink_window": lambda: SinkWindow(128, 2048),
    "triangle_mix": lambda: TriangleMix(128, 2048, 128),
}
BACKENDS = {"triton": {"BACKEND": "TRITON"}, "flash": {"BACKEND": "FLASH"}}
OUT_TOLERANCE, GRAD_TOLERANCE = 3e-2, 6e-2
PACKAGES = ("flash-attn-4", "nvidia-cutlass-dsl")


def layers(pattern_name: str) -> dict[str, HybridAttention]:
    """The pattern on every head, on each backend (one pattern object; masks are cached per layer)."""
    pattern = PATTERNS[pattern_name]()
    patterns, modes = {pattern_name: pattern}, [pattern_name] * KV_HEADS
    return {backend: HybridAttention(HEADS, KV_HEADS, DIM, patterns, modes, block_size=BLOCK, executors=[
        FlexExecutor([pattern], compiled=True, kernel_options=options)]).cuda()
        for backend, options in BACKENDS.items()}


def step(layer: HybridAttention, pass_name: str, length: int) -> Callable[[], object]:
    """One call of the layer: a forward (no autograd graph), or a forward and its backward."""
    grad = pass_name == "forward_backward"
    q, k, v, grad_out = attention_inputs(length, grad, HEADS, KV_HEADS, DIM)
    if grad:
        return lambda: torch.autograd.grad(layer(q, k, v), (q, k, v), grad_out)

    def forward():
        with torch.no_grad():
            return layer(q, k, v)

    return forward


def measure(pattern: str, pair: dict[str, HybridAttention], pass_name: str, length: int,
            args: argparse.Namespace, deadline: Deadline) -> dict:
    """One row: each backend's ms (median of its turns), or why it was skipped."""
    row = {"pattern": pattern, "pass": pass_name, "length": length}
    if deadline.passed():
        return {**row, "skipped": "past --deadline-s"}
    steps, turns, failed = {}, {name: [] for name in pair}, {}
    for name, layer in pair.items():
        try:
            steps[name] = step(layer, pass_name, length)
        except Exception as err:  # noqa: BLE001 -- one shot on a lent machine: record it (OOM), go on
            failed[name] = one_line(err)
    for _ in range(args.rounds):
        for name in [n for n in pair if n in steps and n not in failed]:
            try:
                turns[name].append(timed_ms(steps[name], args.budget_s / args.rounds)[0])
            except Exception as err:  # noqa: BLE001 -- a refused compile or OOM: no time for that backend
                failed[name] = one_line(err)
    steps.clear()
    torch.cuda.empty_cache()
    for name in pair:
        if name in failed:
            row[f"{name}_skipped"] = failed[name]
        elif turns[name]:
            row[f"{name}_ms"] = statistics.median(turns[name])
    if "triton_ms" in row and "flash_ms" in row:
        row["flash_over_triton"] = row["flash_ms"] / row["triton_ms"]
    return row


def agreement(pair: dict[str, HybridAttention], length: int) -> dict:
    """Max |FLASH - Triton| over Triton's largest magnitude, for the output and each gradient (bf16)."""
    results = {}
    for name, layer in pair.items():
        q, k, v, grad_out = attention_inputs(length, True, HEADS, KV_HEADS, DIM, seed=1)
        out = layer(q, k, v)
        results[name] = (out.detach(), *torch.autograd.grad(out, (q, k, v), grad_out))
    errors = {label: float((got.float() - expected.float()).abs().max() / expected.float().abs().max())
              for label, got, expected in zip(("out", "dq", "dk", "dv"), results["flash"], results["triton"])}
    ok = errors["out"] <= OUT_TOLERANCE and all(errors[g] <= GRAD_TOLERANCE for g in ("dq", "dk", "dv"))
    return {"length": length, "errors": errors, "status": "ok" if ok else "disagree"}


def run(args: argparse.Namespace) -> tuple[list[dict], dict[str, dict]]:
    """Every measurement row, and each pattern's check (status "ok", "disagree" or "failed")."""
    deadline = Deadline(args.deadline_s)
    pairs = {pattern: layers(pattern) for pattern in args.patterns}
    checks = {}
    for pattern, pair in pairs.items():
        try:
            checks[pattern] = agreement(pair, min(args.lengths))
        except Exception as err:  # noqa: BLE001 -- FLASH refused this pattern: no rows for it
            checks[pattern] = {"length": min(args.lengths), "status": "failed", "error": one_line(err)}
            torch.cuda.empty_cache()
        print(f"check {pattern}: {checks[pattern]}", flush=True)
    rows = []
    for length in sorted(args.lengths):
        started = time.perf_counter()
        for pass_name in args.passes:
            for pattern, pair in pairs.items():
                if checks[pattern]["status"] == "ok":
                    rows.append(measure(pattern, pair, pass_name, length, args, deadline))
        print(f"length {length}: {time.perf_counter() - started:.1f} s", flush=True)
    return rows, checks


def print_table(rows: list[dict]) -> None:
    cell = lambda row, key, fmt: format(row[key], fmt) if key in row else "-"
    for pattern in dict.fromkeys(r["pattern"] for r in rows):
        for pass_name in PASSES:
            chosen = [r for r in rows if (r["pattern"], r["pass"]) == (pattern, pass_name)]
            if not chosen:
                continue
            print(f"\n{pattern}, {pass_name}: ms (FLASH/Triton < 1: FLASH is faster)")
            print(f"{'length':>8}{'Triton':>12}{'FLASH':>12}{'FLASH/Triton':>14}")
            for row in chosen:
                print(f"{row['length']:>8}{cell(row, 'triton_ms', '12.3f'):>12}"
                      f"{cell(row, 'flash_ms', '12.3f'):>12}{cell(row, 'flash_over_triton', '14.3f'):>14}")
    for row in rows:
        for key in ("skipped", "triton_skipped", "flash_skipped"):
            if key in row:
                print(f"{key.replace('_', ' ')} {row['pattern']} {row['pass']} {row['length']}: {row[key]}",
                      file=sys.stderr)


def table_entries(rows: list[dict]) -> list[dict]:
    """The table's rows: every (pattern, pass, length) where both backends ran."""
    return [{"pattern": r["pattern"], "pass": r["pass"], "length": r["length"],
             "triton_ms": float(f"{r['triton_ms']:.4g}"), "flash_ms": float(f"{r['flash_ms']:.4g}")}
            for r in rows if "triton_ms" in r and "flash_ms" in r]


def write_table(path: Path, key: str, entries: list[dict], measured: dict) -> None:
    """Replaces ``key``'s rows of the table at ``path`` (created if absent), keeps the other devices', and
    checks that flexsparse loads the result."""
    entry = {"dtype": "bfloat16", "head_dim": DIM, "block_size": BLOCK, "measured": measured,
             "entries": entries}
    FLEX_BACKENDS.write(path, key, entry)


def package_versions() -> dict[str, str | None]:
    versions = {}
    for name in PACKAGES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--patterns", nargs="+", choices=list(PATTERNS), default=["sink_window"],
                        help="patterns measured, each on every head (default: sink_window)")
    parser.add_argument("--lengths", nargs="+", type=int, default=LENGTHS,
                        help="sequence lengths (default: 8K 32K 128K; the table reads from the shortest up)")
    parser.add_argument("--passes", nargs="+", choices=PASSES, default=list(PASSES))
    parser.add_argument("--rounds", type=int, default=3, help="turns per backend, alternating (default 3)")
    parser.add_argument("--budget-s", type=float, default=0.6,
                        help="time budget per measurement, split over the turns (3 to 25 calls a turn)")
    parser.add_argument("--deadline-s", type=float, default=420.0,
                        help="measurements start only this long after the run began (default 420 s)")
    parser.add_argument("--out", type=Path, help="write every row as JSON here")
    parser.add_argument("--write-table", nargs="?", type=Path, const=True, default=None, metavar="PATH",
                        help="write the table into the shipped file (or into PATH)")
    parser.add_argument("--device-key", help="the table's key for this device (default: the name's model)")
    parser.add_argument("--site",
                        help="a folder FlashAttention-4 is installed in (added with site.addsitedir)")
    args = parser.parse_args(argv)
    if any(n < 1 or n % BLOCK for n in args.lengths):
        parser.error(f"--lengths must be positive multiples of {BLOCK}, got {args.lengths}")
    if args.rounds < 1 or args.budget_s <= 0 or args.deadline_s <= 0:
        parser.error(f"--rounds, --budget-s and --deadline-s must be positive, got {args.rounds}, "
                     f"{args.budget_s} and {args.deadline_s}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.site:
        site.addsitedir(args.site)
    if not torch.cuda.is_available():
        print("flex_backends: needs a CUDA device (FLASH and compiled flex's backward run there)",
              file=sys.stderr)
        return 2
    if fa4_attention() is None:
        print("flex_backends: FlashAttention-4 does not import (install the fast extra; --site DIR adds the "
              "folder it was installed in)", file=sys.stderr)
        return 2
    name = torch.cuda.get_device_name()
    versions = package_versions()
    print(f"{name}, torch {torch.__version__}, {versions}; B=1, {HEADS}/{KV_HEADS} heads, d {DIM}, bfloat16, "
          f"block {BLOCK}, patterns {args.patterns}", flush=True)
    started = time.perf_counter()
    rows, checks = run(args)
    print_table(rows)
    print(f"\ntotal {time.perf_counter() - started:.1f} s")
    measured = {"device": name, "torch": torch.__version__, **versions,
                "date": datetime.now(timezone.utc).strftime("%Y-%m-%d"),
                "shape": {"heads": HEADS, "kv_heads": KV_HEADS, "dim": DIM, "block": BLOCK},
                "patterns": {p: repr(PATTERNS[p]()) for p in args.patterns}}
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({**measured, "checks": checks, "rows": rows}, indent=1) + "\n")
        print(f"wrote {args.out}")
    if any(check["status"] == "disagree" for check in checks.values()):
        print("flex_backends: FLASH and Triton disagree (see the checks); table not written", file=sys.stderr)
        return 1
    if args.write_table is not None:
        entries = table_entries(rows)
        if not entries:
            print("flex_backends: no (pattern, pass, length) where both backends ran; table not written",
                  file=sys.stderr)
            return 1
        path = FLEX_BACKENDS.shipped_path if args.write_table is True else args.write_table
        key = args.device_key or (name.removeprefix("NVIDIA ").split() or [name])[0]
        write_table(path, key, entries, measured)
    return 0


if __name__ == "__main__":
    sys.exit(main())
