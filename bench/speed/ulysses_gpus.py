"""Sequence-parallel (Ulysses) attention on P GPUs against the same layer on one GPU: time, memory, exchange.

One HybridAttention layer: bf16, batch 1, 32 query / 8 KV heads, d = 128, patterns {"full": Causal(),
"ssa": SinkWindow(128, 2048)}, 2 full + 6 ssa KV heads, backend "flex", plan "auto". For each sequence
length S:

- forward + backward step (``autograd.grad`` of q, k, v for a fixed output gradient) through
  ``flexsparse.distributed.UlyssesAttention``, each rank holding S/P tokens: median of CUDA-event-timed steps
  after warm-up (which compiles), the slowest rank's median;
- the same step of the plain layer on the whole sequence on rank 0 alone (the other ranks wait), skipped above
  ``--single-max`` and reported "OOM" when it does not fit;
- peak memory per GPU of each (``torch.cuda.max_memory_allocated``, reset before each measurement; inputs
  included);
- the all-to-all time of one step: ``dist.all_to_all_single`` alone on buffers of the bytes ``last_exchange``
  reports (q/k/v in and output back, twice: the backward exchanges the same bytes), without the layer's
  pack/unpack copies;
- at the smallest S, a correctness check: the P-GPU output and q/k/v gradients, gathered, against the 1-GPU
  run's, max |error| / max |reference| within bf16 tolerances (3e-2 output, 6e-2 gradients).

Layout: by default each rank's KV heads hold an equal share of the full heads (KV heads full, ssa, ssa, ssa,
full, ssa, ssa, ssa at P = 2); ``--layout grouped`` puts them first (full, full, ssa x 6), which gives rank 0
both causal heads (the load imbalance a layer's head order can cause).

    torchrun --nproc-per-node 2 --master-addr 127.0.0.1 bench/speed/ulysses_gpus.py \
        --seqs 65536 131072 262144 --out DIR
    torchrun --nproc-per-node 2 --master-addr 127.0.0.1 bench/speed/ulysses_gpus.py --smoke  # CPU, gloo, toy sizes

(the script puts its checkout first on sys.path). Rank 0 prints one table and writes ``DIR/ulysses.json``; the exit
code is 1 when the correctness check fails.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))  # the checkout's flexsparse, and bench.common

from bench.common import (  # noqa: E402
    barrier,
    every_rank,
    exchange_ms,
    join_ranks,
    median_ms,
    peak_gib,
    relative_error,
    reset_peak,
    torchrun_world,
)
from flexsparse import Causal, HybridAttention, SinkWindow  # noqa: E402
from flexsparse.distributed import UlyssesAttention, shard_sequence  # noqa: E402


@dataclass
class UlyssesBenchConfig:
    device: str = "cuda"
    dtype: str = "bfloat16"
    backend: str = "flex"
    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    full_kv_heads: int = 2
    sink: int = 128
    window: int = 2048
    block_size: int = 128
    seqs: list[int] = field(default_factory=lambda: [65536, 131072, 262144])
    single_max: int | None = None
    """The longest S the 1-GPU baseline runs (None: every S)."""
    warmup: int = 2
    steps: int = 5
    exchange_rounds: int = 10
    layout: str = "balanced"
    out_tolerance: float = 3e-2
    grad_tolerance: float = 6e-2


SMOKE = UlyssesBenchConfig(device="cpu", dtype="float32", backend="dense", heads=8, kv_heads=4, head_dim=16,
                           sink=4, window=16, block_size=16, seqs=[64, 128], warmup=1, steps=2,
                           exchange_rounds=2, out_tolerance=1e-4, grad_tolerance=1e-4)


def kv_modes(cfg: UlyssesBenchConfig, world: int) -> list[str]:
    """Pattern name per KV head: ``balanced`` gives each rank's KV heads full_kv_heads / P full heads."""
    if cfg.layout == "grouped" or cfg.full_kv_heads % world:
        return ["full"] * cfg.full_kv_heads + ["ssa"] * (cfg.kv_heads - cfg.full_kv_heads)
    share, full = cfg.kv_heads // world, cfg.full_kv_heads // world
    return (["full"] * full + ["ssa"] * (share - full)) * world


def make_layer(cfg: UlyssesBenchConfig, modes: list[str], device: torch.device) -> HybridAttention:
    patterns = {"full": Causal(), "ssa": SinkWindow(cfg.sink, cfg.window)}
    return HybridAttention(cfg.heads, cfg.kv_heads, cfg.head_dim, patterns, modes, block_size=cfg.block_size,
                           backend=cfg.backend, plan="auto").to(device)


def whole_inputs(cfg: UlyssesBenchConfig, seq: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """q ``[1, H, S, d]``, k, v ``[1, H_kv, S, d]`` and the output gradient ``[1, H, S, d]``: the same on
    every rank (seeded by S)."""
    gen = torch.Generator(device).manual_seed(seq)
    dtype = getattr(torch, cfg.dtype)
    shapes = [(1, cfg.heads, seq, cfg.head_dim)] + [(1, cfg.kv_heads, seq, cfg.head_dim)] * 2
    shapes.append(shapes[0])
    return tuple(torch.randn(shape, generator=gen, device=device, dtype=dtype) for shape in shapes)


def sharded_inputs(cfg: UlyssesBenchConfig, seq: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """This rank's S/P tokens of :func:`whole_inputs` (copies: the whole tensors are freed)."""
    return tuple(shard_sequence(t).clone() for t in whole_inputs(cfg, seq, device))


def step_fn(module: torch.nn.Module, q, k, v, grad_out):
    """One forward + backward: returns (output, grad q, grad k, grad v)."""
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]

    def step():
        out = module(*leaves)
        return (out.detach(), *torch.autograd.grad(out, leaves, grad_out))

    return step








def gather_sequence(t: torch.Tensor) -> torch.Tensor:
    """The whole sequence (dim 2) of every rank's shard, on every rank."""
    every = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(every, t.contiguous())
    return torch.cat(every, dim=2)




def measure(cfg: UlyssesBenchConfig, seq: int, check: bool, device: torch.device) -> dict:
    """One sequence length on every rank; rank 0's dict holds the results."""
    world, rank = dist.get_world_size(), dist.get_rank()
    modes = kv_modes(cfg, world)
    row: dict = {"seq": seq, "world": world}

    # P GPUs: UlyssesAttention, S/P tokens a rank
    sp = UlyssesAttention(make_layer(cfg, modes, device))
    step = step_fn(sp, *sharded_inputs(cfg, seq, device))
    reset_peak(device)  # after the whole-sequence tensors the shards were cut from are freed
    ms = median_ms(step, cfg.warmup, cfg.steps, device)
    row["sharded_ms_per_rank"] = every_rank(ms, device)
    row["sharded_ms"] = max(row["sharded_ms_per_rank"])
    row["sharded_peak_gib_per_rank"] = every_rank(peak_gib(device), device)
    bytes_sent = sp.last_exchange
    row["exchange_bytes_per_rank"] = {"qkv": bytes_sent.qkv, "out": bytes_sent.out,
                                      "step": bytes_sent.forward + bytes_sent.backward}
    if world > 1:
        dtype = getattr(torch, cfg.dtype)
        qkv_ms = exchange_ms(bytes_sent.qkv, dtype, cfg.exchange_rounds, device)
        out_ms = exchange_ms(bytes_sent.out, dtype, cfg.exchange_rounds, device)
        row["exchange_ms"] = max(every_rank(2 * (qkv_ms + out_ms), device))  # forward and backward
        row["exchange_ms_split"] = {"qkv": qkv_ms, "out": out_ms}
    sharded_result = None
    if check:
        sharded_result = [gather_sequence(t) for t in step()]
        sharded_result = [t.cpu() for t in sharded_result] if rank == 0 else None
    del sp, step

    # 1 GPU: the plain layer on the whole sequence, rank 0 alone
    capped = cfg.single_max is not None and seq > cfg.single_max
    if rank == 0 and world > 1 and capped:
        row["single_ms"] = "skipped"  # above --single-max
    elif rank == 0 and world > 1:
        try:
            reset_peak(device)
            step = step_fn(make_layer(cfg, modes, device), *whole_inputs(cfg, seq, device))
            row["single_ms"] = median_ms(step, cfg.warmup, cfg.steps, device)
            row["single_peak_gib"] = peak_gib(device)
            if check:
                names = ("out", "grad_q", "grad_k", "grad_v")
                errors = {name: relative_error(got.to(device), ref)
                          for name, got, ref in zip(names, sharded_result, step())}
                tolerances = {name: cfg.grad_tolerance for name in names} | {"out": cfg.out_tolerance}
                row["check"] = {"seq": seq, "errors": errors, "tolerances": tolerances,
                                "passed": all(errors[n] <= tolerances[n] for n in names)}
            del step
        except torch.OutOfMemoryError:
            row["single_ms"] = "OOM"
        reset_peak(device)
    barrier(device)
    return row


def fmt(value, spec: str = ".1f") -> str:
    return format(value, spec) if isinstance(value, (int, float)) else str(value or "-")


def table(rows: list[dict], cfg: UlyssesBenchConfig) -> str:
    world = rows[0]["world"]
    head = (f"{'S':>8} | {f'{world} GPU ms':>10} | {'1 GPU ms':>9} | {'speedup':>7} | {'a2a ms':>7} | "
            f"{'a2a %':>5} | {'a2a MB/rank':>11} | {f'peak GiB ({world} GPU)':>19} | {'peak GiB 1 GPU':>14}")
    lines = [head, "-" * len(head)]
    for row in rows:
        single = row.get("single_ms")
        speedup = single / row["sharded_ms"] if isinstance(single, float) else None
        a2a = row.get("exchange_ms")
        share = 100 * a2a / row["sharded_ms"] if a2a is not None else None
        peaks = " / ".join(fmt(p, ".2f") for p in row["sharded_peak_gib_per_rank"])
        lines.append(f"{row['seq']:>8} | {row['sharded_ms']:>10.2f} | {fmt(single, '.2f'):>9} | "
                     f"{fmt(speedup, '.2f'):>7} | {fmt(a2a, '.2f'):>7} | {fmt(share, '.0f'):>5} | "
                     f"{row['exchange_bytes_per_rank']['step'] / 1e6:>11.1f} | {peaks:>19} | "
                     f"{fmt(row.get('single_peak_gib'), '.2f'):>14}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seqs", type=int, nargs="+", help="sequence lengths (default 65536 131072 262144)")
    parser.add_argument("--single-max", type=int, help="longest S of the 1-GPU baseline (default: every S)")
    parser.add_argument("--layout", choices=["balanced", "grouped"], default="balanced",
                        help="where the full KV heads sit (see the module docstring)")
    parser.add_argument("--steps", type=int, help="timed steps (default 5)")
    parser.add_argument("--out", help="folder for ulysses.json")
    parser.add_argument("--smoke", action="store_true", help="toy sizes on the CPU, gloo")
    args = parser.parse_args(argv)
    cfg = SMOKE if args.smoke else UlyssesBenchConfig()
    cfg.layout = args.layout
    if args.seqs:
        cfg.seqs = sorted(args.seqs)
    if args.single_max is not None:
        cfg.single_max = args.single_max
    if args.steps is not None:
        cfg.steps = args.steps
    world = torchrun_world(parser)
    bad = [s for s in cfg.seqs if s <= 0 or s % world]
    if bad or cfg.steps < 1:
        parser.error(f"--seqs must be positive multiples of the {world} ranks (got {bad}) and --steps >= 1")

    device = join_ranks(parser, cfg.device, "--smoke")
    rank = dist.get_rank()
    try:
        rows, begin = [], time.perf_counter()
        for seq in cfg.seqs:
            rows.append(measure(cfg, seq, check=seq == cfg.seqs[0] and world > 1, device=device))
            if rank == 0:
                print(f"S={seq} done at {time.perf_counter() - begin:.0f} s", flush=True)
        if rank != 0:
            return 0
        modes = kv_modes(cfg, world)
        gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
        print(f"\nUlyssesAttention on {world} x {gpu} ({cfg.dtype}, B=1, H={cfg.heads}, H_kv={cfg.kv_heads}, "
              f"d={cfg.head_dim}, backend {cfg.backend}, KV heads {modes}); fwd+bwd step, median of "
              f"{cfg.steps}; a2a = all_to_all_single alone on the exchanged bytes, fwd+bwd")
        print(table(rows, cfg))
        check = next((row["check"] for row in rows if "check" in row), None)
        if check:
            errors = ", ".join(f"{name} {err:.2e} (tol {check['tolerances'][name]:.0e})"
                               for name, err in check["errors"].items())
            print(f"check at S={check['seq']}: max|err|/max|ref| {errors}: "
                  f"{'PASS' if check['passed'] else 'FAIL'}")
        elif world > 1:
            print("check: not run (the 1-GPU baseline did not run at the smallest S)")
        if args.out:
            os.makedirs(args.out, exist_ok=True)
            path = os.path.join(args.out, "ulysses.json")
            with open(path, "w") as f:
                json.dump({"config": asdict(cfg), "kv_modes": modes, "torch": torch.__version__, "rows": rows,
                           "check": check}, f, indent=1)
            print(f"wrote {path}")
        return 0 if check is None or check["passed"] else 1
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
