"""ESA, XAttention and TriangleMix heads beside full heads in the sparse KV cache (issue 27), on a CUDA GPU.

A layer of 32 query / 8 KV heads, d = 128, bf16, batch 1, with 2 full + 6 KV heads of one kind (ESA layer 4 of 8,
w = 64; XAttention threshold 0.9, stride 16; TriangleMix sink 128, window 2048, last 128 queries), through
flexsparse's attention function and its sparse KV cache (backend "flex", plan "auto"):

1. prefill of a 32K / 128K-token prompt: a cache sized for the generation (as generate() builds it), the layer's
   attention and the cache's writes;
2. one decode step at 32K / 128K cached tokens (cache write + attention, one layer per step; CUDA events over
   back-to-back steps), its first step checked against the same layer without a cache (every key passed, as with
   transformers' DynamicCache); all-full SDPA over the same cache beside it;
3. KV bytes after a 70,000 / 130,000-token prompt and one decode step (the allocation policy: the cache's
   update, without attention), for a cache of unknown length (``SparseKVCache(model)``, the issue's case) and one
   sized for the generation, against transformers' DynamicCache holding the same tokens (its tensors walked).

    PYTHONPATH=. python bench/speed/keep_heads.py                        # this checkout, ~5 minutes on an H100
    PYTHONPATH=. python bench/speed/keep_heads.py --baseline /path/to/checkout
        # and the same script run with that checkout's flexsparse, side by side
    PYTHONPATH=. python bench/speed/keep_heads.py --smoke                # toy sizes on the CPU (checks the script)

Only API that older checkouts have is used (convert, SparseKVCache, the attention and mask functions), so a
baseline run measures the same thing. Prints one table; ``--json PATH`` also writes the numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field, replace

import torch
import torch.nn.functional as F


@dataclass
class KeepBenchConfig:
    device: str = "cuda"
    dtype: str = "bfloat16"
    backend: str = "flex"
    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    full_kv_heads: int = 2
    block_size: int = 128
    esa_length: int = 64
    seqs: list[int] = field(default_factory=lambda: [32768, 131072])
    memory_seqs: list[int] = field(default_factory=lambda: [70000, 130000])
    decode_extra: int = 1024
    """Decode steps the timed cache has room for (a timing runs at most ~320)."""
    kinds: list[str] = field(default_factory=lambda: ["esa", "xa", "tm"])

    def pattern(self, kind: str):
        from flexsparse.masks import ESA, TriangleMix, XAttention

        if kind == "esa":
            return ESA(4, 8, self.esa_length, self.heads)
        if kind == "xa":
            return XAttention(threshold=0.9, stride=16, block_size=self.block_size)
        return TriangleMix(sink=128, window=2048, last_q=128)

    def modes(self, kind: str) -> list[str]:
        return ["full"] * self.full_kv_heads + [kind] * (self.kv_heads - self.full_kv_heads)


SMOKE = KeepBenchConfig(device="cpu", dtype="float32", backend="dense", heads=8, kv_heads=4, head_dim=16,
                        full_kv_heads=1, block_size=16, esa_length=8, seqs=[256, 512], memory_seqs=[700, 1300],
                        decode_extra=128)


def _time_ms(fn, device: torch.device, rounds: int = 5) -> float:
    if device.type == "cuda":
        from flexsparse.tools.bench import cuda_time_ms

        return cuda_time_ms(fn, rounds=rounds)
    fn()
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def _layer_model(cfg: KeepBenchConfig, kind: str):
    """A one-layer Llama converted with 2 full + 6 ``kind`` KV heads, and its attention module."""
    from flexsparse.integrations import convert
    from flexsparse.masks import Causal
    from flexsparse.tools.bench_hf import HfBenchConfig, llama_from_config

    shapes = HfBenchConfig(device=cfg.device, dtype=cfg.dtype, heads=cfg.heads, kv_heads=cfg.kv_heads,
                           head_dim=cfg.head_dim, e2e_seqs=[max(cfg.seqs + cfg.memory_seqs)])
    model = llama_from_config(shapes, layers=1, intermediate=64, vocab=64)
    convert(model, {"full": Causal(), kind: cfg.pattern(kind)}, [cfg.modes(kind)], block_size=cfg.block_size,
            backend=cfg.backend)
    return model, model.model.layers[0].self_attn


@torch.no_grad()
def bench_times(cfg: KeepBenchConfig, kind: str, seq: int) -> dict:
    """Prefill and decode-step milliseconds of one layer at ``seq`` tokens, the first step's max |error| against
    the layer without a cache, and all-full SDPA's decode step over the same keys."""
    from flexsparse.integrations import SparseKVCache
    from flexsparse.integrations.transformers import flexsparse_attention, flexsparse_mask

    dev, dtype = torch.device(cfg.device), getattr(torch, cfg.dtype)
    model, module = _layer_model(cfg, kind)
    gen = torch.Generator(device=dev).manual_seed(seq)
    rand = lambda *shape: torch.randn(*shape, device=dev, dtype=dtype, generator=gen)
    q, keys, values = rand(1, cfg.heads, seq, cfg.head_dim), rand(1, cfg.kv_heads, seq, cfg.head_dim), rand(
        1, cfg.kv_heads, seq, cfg.head_dim)
    prompt_mask = flexsparse_mask(1, seq, seq, device=dev)

    def prefill() -> SparseKVCache:
        cache = SparseKVCache(model, max_length=seq + cfg.decode_extra)
        cache.update(keys, values, 0)
        flexsparse_attention(module, q, keys, values, prompt_mask)
        return cache

    prefill_ms = _time_ms(prefill, dev, rounds=3)
    cache = prefill()
    del q
    q1, k1, v1 = rand(1, cfg.heads, 1, cfg.head_dim), rand(1, cfg.kv_heads, 1, cfg.head_dim), rand(
        1, cfg.kv_heads, 1, cfg.head_dim)
    step_mask = flexsparse_mask(1, 1, seq + 1, device=dev)
    cache.update(k1, v1, 0)
    cached = flexsparse_attention(module, q1, k1, v1, step_mask)[0]
    every_k, every_v = torch.cat([keys, k1], 2), torch.cat([values, v1], 2)
    uncached = flexsparse_attention(module, q1, every_k, every_v, step_mask)[0]
    error = float((cached.float() - uncached.float()).abs().max())
    del every_k, every_v

    def step():
        tokens = cache.get_seq_length(0) + 1
        if tokens > seq + cfg.decode_extra:
            raise RuntimeError("the benchmark's cache is full: raise decode_extra")
        mask = flexsparse_mask(1, 1, tokens, device=dev)
        cache.update(k1, v1, 0)
        flexsparse_attention(module, q1, k1, v1, mask)

    decode_ms = _time_ms(step, dev)
    sdpa_ms = _time_ms(lambda: F.scaled_dot_product_attention(q1, keys, values, enable_gqa=True), dev)
    return dict(kind=kind, seq=seq, prefill_ms=prefill_ms, decode_ms=decode_ms, sdpa_all_full_decode_ms=sdpa_ms,
                first_step_error=error)


@torch.no_grad()
def bench_memory(cfg: KeepBenchConfig, kind: str, seq: int) -> dict:
    """KV bytes after a ``seq``-token prompt and one decode step: a cache of unknown length and one sized for
    the generation (seq + 1 tokens, as generate(max_new_tokens=2)), against a DynamicCache of the same tokens."""
    from transformers import DynamicCache

    from flexsparse.integrations import SparseKVCache

    dev, dtype = torch.device(cfg.device), getattr(torch, cfg.dtype)
    model, module = _layer_model(cfg, kind)
    keys = torch.randn(1, cfg.kv_heads, seq, cfg.head_dim, device=dev, dtype=dtype)
    one = keys[:, :, :1].clone()
    dynamic = DynamicCache()
    for new in (keys, one):
        dynamic.update(new, new, 0)
    dynamic_bytes = sum(t.numel() * t.element_size() for layer in dynamic.layers for t in (layer.keys, layer.values))
    del dynamic
    found = dict(kind=kind, seq=seq, tokens=seq + 1, dynamic_cache_bytes=dynamic_bytes)
    for name, max_length in (("unknown_length", None), ("sized", seq + 1)):
        cache = SparseKVCache(model, max_length=max_length)
        for new in (keys, one):  # the allocation policy: update() sizes the buffers (the attention only writes)
            cache.update(new, new, 0)
            module.flexsparse.take_staged(new, new)
        found[f"{name}_bytes"] = cache.memory_bytes()
        del cache
    return found


def run(cfg: KeepBenchConfig, log=print) -> dict:
    import flexsparse
    import flexsparse.runtime.compiled

    dev = torch.device(cfg.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("this benchmark needs a CUDA GPU (or --smoke for toy sizes on the CPU)")
    # each prompt length compiles its prefill variants, each decode bucket its own
    flexsparse.runtime.compiled.MAX_COMPILED_VARIANTS = max(flexsparse.runtime.compiled.MAX_COMPILED_VARIANTS, 256)
    result = dict(flexsparse=os.path.dirname(flexsparse.__file__), device=torch.cuda.get_device_name()
                  if dev.type == "cuda" else "cpu", torch=torch.__version__, times=[], memory=[])
    for kind in cfg.kinds:
        for seq in cfg.seqs:
            row = bench_times(cfg, kind, seq)
            log(f"  {kind} {seq}: prefill {row['prefill_ms']:.2f} ms, decode {row['decode_ms']:.3f} ms, "
                f"first step error {row['first_step_error']:.1e}")
            result["times"].append(row)
            if dev.type == "cuda":
                torch.cuda.empty_cache()
        for seq in cfg.memory_seqs:
            result["memory"].append(bench_memory(cfg, kind, seq))
    return result


def _fmt_ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def table(result: dict, baseline: dict | None) -> str:
    """The results (and a baseline run's beside them) as one text table."""
    lines = [f"flexsparse from {result['flexsparse']} on {result['device']}, torch {result['torch']}"]
    if baseline is not None:
        lines.append(f"baseline: flexsparse from {baseline['flexsparse']}")
    old = {(r["kind"], r["seq"]): r for r in (baseline or {}).get("times", [])}
    header = f"{'heads':6} {'tokens':>8} | {'prefill ms':>10} {'decode ms':>10} {'SDPA all-full':>13} {'max |err|':>9}"
    if baseline is not None:
        header += f" | {'base prefill':>12} {'base decode':>11} {'speedup':>8}"
    lines += ["", "2 full + 6 keep KV heads, one layer, B = 1: times", header, "-" * len(header)]
    for row in result["times"]:
        line = (f"{row['kind']:6} {row['seq']:>8,} | {row['prefill_ms']:>10.2f} {row['decode_ms']:>10.3f} "
                f"{row['sdpa_all_full_decode_ms']:>13.3f} {row['first_step_error']:>9.1e}")
        before = old.get((row["kind"], row["seq"]))
        if before is not None:
            line += (f" | {before['prefill_ms']:>12.2f} {before['decode_ms']:>11.3f} "
                     f"{before['decode_ms'] / row['decode_ms']:>7.2f}x")
        lines.append(line)
    old = {(r["kind"], r["seq"]): r for r in (baseline or {}).get("memory", [])}
    header = (f"{'heads':6} {'tokens':>8} | {'DynamicCache MiB':>16} {'unknown length':>14} {'sized':>7}")
    if baseline is not None:
        header += f" | {'base unknown':>12} {'base sized':>10}"
    lines += ["", "KV bytes after prompt + 1 decode step, as a multiple of DynamicCache's", header, "-" * len(header)]
    for row in result["memory"]:
        dyn = row["dynamic_cache_bytes"]
        line = (f"{row['kind']:6} {row['tokens']:>8,} | {dyn / 2**20:>16.1f} {row['unknown_length_bytes'] / dyn:>13.3f}x "
                f"{row['sized_bytes'] / dyn:>6.3f}x")
        before = old.get((row["kind"], row["seq"]))
        if before is not None:
            line += (f" | {before['unknown_length_bytes'] / dyn:>11.3f}x {before['sized_bytes'] / dyn:>9.3f}x")
        lines.append(line)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="toy sizes on the CPU (checks the script)")
    parser.add_argument("--kinds", nargs="+", choices=["esa", "xa", "tm"], default=None)
    parser.add_argument("--seqs", type=int, nargs="+", default=None, help="prompt lengths timed")
    parser.add_argument("--memory-seqs", type=int, nargs="+", default=None, help="prompt lengths whose KV bytes are "
                        "measured")
    parser.add_argument("--baseline", default=None, help="a flexsparse checkout (its root) to run the same "
                        "benchmark with, in a subprocess, shown beside this one")
    parser.add_argument("--json", default=None, help="also write the numbers here")
    args = parser.parse_args(argv)
    cfg = replace(SMOKE) if args.smoke else KeepBenchConfig()
    for name in ("kinds", "seqs", "memory_seqs"):
        if getattr(args, name) is not None:
            setattr(cfg, name, getattr(args, name))
    baseline = None
    if args.baseline is not None:
        if not os.path.isdir(os.path.join(args.baseline, "flexsparse")):
            print(f"keep_heads: --baseline must be a flexsparse checkout (a folder holding flexsparse/), got "
                  f"{args.baseline!r}", file=sys.stderr)
            return 2
        with tempfile.TemporaryDirectory() as folder:
            out = os.path.join(folder, "baseline.json")
            forwarded = ["--smoke"] if args.smoke else []
            for name in ("kinds", "seqs", "memory_seqs"):
                forwarded += [f"--{name.replace('_', '-')}", *map(str, getattr(cfg, name))]
            env = dict(os.environ, PYTHONPATH=os.path.abspath(args.baseline))
            print(f"baseline run (flexsparse from {args.baseline}):", flush=True)
            subprocess.run([sys.executable, os.path.abspath(__file__), *forwarded, "--json", out], env=env,
                           check=True)
            with open(out) as f:
                baseline = json.load(f)
    print("this run:", flush=True)
    result = run(cfg)
    if args.json is not None:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    print(table(result, baseline))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
