"""`flexsparse demo`: build hybrid layers, run them, and check them against the dense reference."""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from flexsparse.attention import HybridAttention
from flexsparse.masks import Causal, SinkWindow
from flexsparse.reference import attention as reference


@dataclass
class DemoSize:
    batch: int
    heads: int
    kv_heads: int
    seq: int
    head_dim: int
    sink: int
    window: int
    dtype: torch.dtype


CPU_SIZE = DemoSize(batch=1, heads=8, kv_heads=4, seq=1024, head_dim=32, sink=16, window=128, dtype=torch.float32)
GPU_SIZE = DemoSize(batch=1, heads=32, kv_heads=8, seq=4096, head_dim=128, sink=128, window=512, dtype=torch.bfloat16)


def _time_ms(fn, device: torch.device, repeats: int = 5) -> float:
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / repeats * 1e3


def run_demo(device: str | None = None, backend: str | None = None, seq: int | None = None) -> list[dict]:
    """Run the demo configurations; print and return one row per configuration."""
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    size = GPU_SIZE if dev.type == "cuda" else CPU_SIZE
    if seq:
        size = replace(size, seq=seq)
    backend = backend or ("flex" if dev.type == "cuda" else "flex_eager")
    gen = torch.Generator(device=dev).manual_seed(0)
    shape_q = (size.batch, size.heads, size.seq, size.head_dim)
    shape_kv = (size.batch, size.kv_heads, size.seq, size.head_dim)
    q = torch.randn(shape_q, generator=gen, device=dev, dtype=size.dtype)
    k = torch.randn(shape_kv, generator=gen, device=dev, dtype=size.dtype)
    v = torch.randn(shape_kv, generator=gen, device=dev, dtype=size.dtype)
    patterns = {"full": Causal(), "ssa": SinkWindow(sink=size.sink, window=size.window)}
    n = size.kv_heads
    configs = {
        "all FA": ["full"] * n,
        "all SSA": ["ssa"] * n,
        f"hybrid {n // 4} of {n} full": ["full"] * (n // 4) + ["ssa"] * (n - n // 4),
        "routed per input": None,
    }
    print(f"flexsparse demo on {dev} ({torch.cuda.get_device_name(dev) if dev.type == 'cuda' else 'cpu'}), "
          f"backend={backend}, dtype={str(size.dtype).replace('torch.', '')}: B={size.batch}, H={size.heads}, "
          f"H_kv={size.kv_heads}, S={size.seq}, d={size.head_dim}, SSA sink={size.sink} window={size.window}")
    sdpa_ms = _time_ms(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True), dev)
    rows = []
    header = f"{'config':<22} {'kv-head modes':<34} {'density':>8} {'MSR':>6} {'ESR':>6} {'max err':>9} " \
             f"{'ms':>8} {'x SDPA':>7}"
    print(header)
    print("-" * len(header))
    for name, modes in configs.items():
        attn = HybridAttention(size.heads, size.kv_heads, size.head_dim, patterns, modes, backend=backend).to(dev)
        call_modes = None
        if modes is None:  # a router's decision: an int tensor per KV head, new values each call
            call_modes = torch.randint(0, 2, (n,), generator=gen, device=dev)
        out = attn(q, k, v, modes=call_modes)
        stats = attn.last_stats.as_dict()
        err = (out.float() - reference(q, k, v, attn.reference_mask(q, k, call_modes)).float()).abs().max().item()
        ms = _time_ms(lambda: attn(q, k, v, modes=call_modes), dev)
        ran = call_modes if call_modes is not None else attn.default_modes
        label = "".join("F" if m == 0 else "S" for m in ran.tolist())
        row = dict(config=name, modes=label, **stats, max_err=err, ms=ms, vs_sdpa=ms / sdpa_ms)
        rows.append(row)
        print(f"{name:<22} {label:<34} {stats['block_density']:>8.3f} {stats['msr']:>6.2f} {stats['esr']:>6.3f} "
              f"{err:>9.2e} {ms:>8.2f} {ms / sdpa_ms:>7.2f}")
    print(f"SDPA causal: {sdpa_ms:.2f} ms.  Modes: F = full causal (FA), S = sink+window (SSA).")
    if backend == "flex_eager":
        print("This ran uncompiled flex_attention (exact, not fast); timings mean little here. "
              "Use --backend flex to compile (about 25 s the first time on a CPU).")
    return rows
