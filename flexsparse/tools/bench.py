"""`flexsparse bench`: torch.compile'd flexsparse against SDPA and serial dispatch, on a CUDA GPU.

Shapes follow the papers' benchmarks (Qwen3-8B-like: B=1, 32 query heads, 8 KV heads, d=128, bf16). Every ratio
is computed from times measured in the same run. "serial" is the hand-written baseline of the Elastic Attention
paper: SDPA for the full heads, compiled flex_attention for the sparse heads, concatenated. "ideal" is SDPA's
causal time scaled by the configuration's computed tile fraction.
"""

from __future__ import annotations

import json
import platform
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import flexsparse.runtime.compiled
from flexsparse.attention import HybridAttention
from flexsparse.heads import per_query_head
from flexsparse.kernels.availability import triton_version
from flexsparse.masks import ESA, Causal, Geometry, SinkWindow, XAttention
from flexsparse.masks.blocks import BlockMaskStack, block_density
from flexsparse.runtime.compiled import run_flex
from flexsparse.runtime.fa4_executor import fa4_attention

BATCH, HEADS, KV_HEADS, DIM = 1, 32, 8, 128
SINK, WINDOW = 128, 2048


def cuda_time_ms(fn, rounds: int = 5, budget_s: float = 0.5) -> float:
    """Milliseconds per ``fn()`` call in steady state: median over rounds of back-to-back calls between two CUDA
    events (host overhead overlaps the GPU, as in a model's forward), after warm-up (which compiles)."""
    fn()
    torch.cuda.synchronize()
    start_wall = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    calls = max(1, min(20, int(budget_s / rounds / max(time.perf_counter() - start_wall, 1e-4))))
    times = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / calls)
    return statistics.median(times)


def _with_backward(fn, q, k, v):
    grad = None

    def step():
        nonlocal grad
        out = fn(q, k, v)
        if grad is None:
            grad = torch.randn_like(out)
        out.backward(grad)

    return step


def _layer(patterns, modes, **kwargs) -> HybridAttention:
    return HybridAttention(HEADS, KV_HEADS, DIM, patterns, modes, backend="flex", **kwargs)


def _serial_dispatch(full_kv: int, seq: int):
    """SDPA on the first ``full_kv`` KV heads, compiled flex (sink+window) on the rest, concatenated."""
    group = HEADS // KV_HEADS
    geo = Geometry(1, seq, device="cuda")
    mask = SinkWindow(SINK, WINDOW).block_mask(geo)

    def run(q, k, v):
        full = F.scaled_dot_product_attention(q[:, : full_kv * group], k[:, :full_kv], v[:, :full_kv],
                                              is_causal=True, enable_gqa=True)
        sparse = run_flex(q[:, full_kv * group :], k[:, full_kv:], v[:, full_kv:], mask, DIM**-0.5)
        return torch.cat([full, sparse], dim=1)

    return run


def _density(attn: HybridAttention, q, k, v) -> float:
    """Computed fraction of causal tiles, over all heads, for the layer's default modes."""
    geo = Geometry(HEADS, q.shape[2], device=q.device)
    patterns = [p.resolve(q, k, geo) for p in attn.patterns.values()]
    per_mode = [float(block_density(p.block_mask(geo), geo)) for p in patterns]
    modes = attn.default_modes.tolist()
    return sum(per_mode[m] for m in modes) / len(modes)


def bench_sequence(seq: int, backward: bool, log, only: str | None = None) -> list[dict]:
    """All configurations at one sequence length (those whose name contains ``only``, if given)."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    make = lambda h: torch.randn(BATCH, h, seq, DIM, device="cuda", dtype=torch.bfloat16, generator=gen)
    q, k, v = make(HEADS), make(KV_HEADS), make(KV_HEADS)
    causal_flops = 4 * BATCH * HEADS * DIM * seq * (seq + 1) / 2
    ssa = {"full": Causal(), "ssa": SinkWindow(SINK, WINDOW)}
    layers = {
        "flex causal": (_layer(ssa, ["full"] * 8, plan="fused"), None),
        "SSA sink128+win2048": (_layer(ssa, ["ssa"] * 8), None),
        "hybrid rho=0.5 fused": (_layer(ssa, ["full"] * 4 + ["ssa"] * 4, plan="fused"), 4),
        "hybrid rho=0.5 split": (_layer(ssa, ["full"] * 4 + ["ssa"] * 4, plan="split"), 4),
        "hybrid rho=0.75 fused": (_layer(ssa, ["full"] * 2 + ["ssa"] * 6, plan="fused"), 2),
        "hybrid rho=0.75 split": (_layer(ssa, ["full"] * 2 + ["ssa"] * 6, plan="split"), 2),
        "hybrid rho=0.75 auto": (_layer(ssa, ["full"] * 2 + ["ssa"] * 6, plan="auto"), 2),
        **({"hybrid rho=0.75 split, flex pinned to Triton": (
            _layer(ssa, ["full"] * 2 + ["ssa"] * 6, plan="split", kernel_options={"BACKEND": "TRITON"}), 2)}
           if fa4_attention() is not None else {}),  # beside the measured flex backend choice the others make
        "ESA layer 4/8 w=64": (_layer({"esa": ESA(4, 8, 64, HEADS)}, ["esa"] * 8), None),
        "XA thr=0.9 stride=16": (_layer({"xa": XAttention(0.9, 16, 128)}, ["xa"] * 8), None),
    }
    rows = []
    sdpa = lambda q_, k_, v_: F.scaled_dot_product_attention(q_, k_, v_, is_causal=True, enable_gqa=True)
    passes = [("fwd", False)] + ([("fwd+bwd", True)] if backward else [])
    for pass_name, with_grad in passes:
        flop_factor = 3.5 if with_grad else 1.0  # backward ~2.5x forward FLOPs
        inputs = [t.detach().requires_grad_(with_grad) for t in (q, k, v)]
        timed = lambda fn: cuda_time_ms(_with_backward(fn, *inputs) if with_grad else (lambda: fn(*inputs)))
        sdpa_ms = timed(sdpa)
        serial = {n: timed(_serial_dispatch(n, seq)) for n in (4, 2)}
        rows.append(dict(seq=seq, config="SDPA causal", pass_=pass_name, ms=sdpa_ms, density=1.0,
                         tflops=causal_flops * flop_factor / sdpa_ms / 1e9))
        for n, ms in serial.items():
            rows.append(dict(seq=seq, config=f"serial dispatch rho={1 - n / 8:g}", pass_=pass_name, ms=ms,
                             density=(n + (8 - n) * _ssa_density(seq)) / 8, vs_sdpa=ms / sdpa_ms))
        log(f"S={seq} {pass_name}: SDPA {sdpa_ms:.2f} ms, serial {serial}")
        for name, (attn, full_kv) in layers.items():
            if only and only not in name:
                continue
            if with_grad and ("XA" in name or "auto" in name or "0.5" in name):
                continue
            density = _density(attn, q, k, v)
            if isinstance(full_kv, int):  # against serial dispatch timed alternately with it: drift cancels
                ms, serial_ms = _alternating(timed, attn, _serial_dispatch(full_kv, seq))
            else:
                ms, serial_ms = timed(attn), None
            row = dict(seq=seq, config=name, pass_=pass_name, ms=ms, density=density, vs_sdpa=ms / sdpa_ms,
                       vs_ideal=ms / (sdpa_ms * density), tflops=causal_flops * density * flop_factor / ms / 1e9)
            if serial_ms is not None:
                row.update(serial_ms=serial_ms, vs_serial=ms / serial_ms)
            rows.append(row)
            log(f"  {name:<24} {ms:9.2f} ms  density {density:.3f}  x SDPA {ms / sdpa_ms:.3f}")
        if not with_grad and (not only or only in "XA estimator"):
            xa = XAttention(0.9, 16, 128)
            est_ms = cuda_time_ms(lambda: xa.select(q, k))
            rows.append(dict(seq=seq, config="XA estimator+selection", pass_=pass_name, ms=est_ms,
                             vs_sdpa=est_ms / sdpa_ms))
            log(f"  XA estimator+selection {est_ms:.2f} ms = {100 * est_ms / sdpa_ms:.1f}% of SDPA causal")
    return rows


def _alternating(timed, fn, baseline, rounds: int = 3) -> tuple[float, float]:
    """Medians of ``fn`` and ``baseline`` timed in turns (A B A B ...), so clock and thermal drift hit both."""
    pairs = [(timed(fn), timed(baseline)) for _ in range(rounds)]
    return statistics.median(a for a, _ in pairs), statistics.median(b for _, b in pairs)


def _ssa_density(seq: int) -> float:
    geo = Geometry(1, seq, device="cuda")
    return float(block_density(SinkWindow(SINK, WINDOW).block_mask(geo), geo))


def bench_mode_switch(seq: int, routings: int = 100) -> dict:
    """Per-call routing at ``seq``: recompiles over ``routings`` random mode tensors and the call overhead."""
    patterns = {"full": Causal(), "ssa": SinkWindow(SINK, WINDOW)}
    attn = _layer(patterns, ["full"] * 2 + ["ssa"] * 6)
    gen = torch.Generator(device="cuda").manual_seed(0)
    make = lambda h: torch.randn(BATCH, h, seq, DIM, device="cuda", dtype=torch.bfloat16, generator=gen)
    q, k, v = make(HEADS), make(KV_HEADS), make(KV_HEADS)
    modes = [torch.randint(0, 2, (KV_HEADS,), device="cuda", generator=gen) for _ in range(routings)]
    attn(q, k, v, modes=modes[0])
    torch.cuda.synchronize()
    frames_before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    with torch.compiler.set_stance("fail_on_recompile"):
        start = time.perf_counter()
        for m in modes:
            attn(q, k, v, modes=m)
        torch.cuda.synchronize()
        routed_ms = (time.perf_counter() - start) / routings * 1e3
    recompiles = torch._dynamo.utils.counters["stats"]["unique_graphs"] - frames_before
    # the mode switch alone: composing the per-head BlockMask from the per-pattern masks built once
    geo = Geometry(HEADS, seq, device="cuda")
    masks = [p.block_mask(geo) for p in patterns.values()]
    stack = BlockMaskStack.from_masks(masks, HEADS)
    q_modes = per_query_head(modes[1], HEADS // KV_HEADS, dim=0)[None]
    switch_ms = cuda_time_ms(lambda: stack.select(q_modes, masks[0].mask_mod, with_backward=False))
    train_switch_ms = cuda_time_ms(lambda: stack.select(q_modes, masks[0].mask_mod))
    return dict(seq=seq, routings=routings, recompiles=recompiles, routed_call_ms=routed_ms,
                mode_switch_ms=switch_ms, mode_switch_with_backward_ms=train_switch_ms)


def run_bench(seqs: list[int], backward: bool, out_dir: str | Path, quiet: bool = False,
              only: str | None = None) -> dict:
    """Run the suite, write ``bench.json`` and ``bench.png`` under ``out_dir``; return the results."""
    if not torch.cuda.is_available():
        raise RuntimeError("flexsparse bench needs a CUDA GPU")
    # The suite compiles dozens of distinct structures in one process (each config, shape and grad mode).
    flexsparse.runtime.compiled.MAX_COMPILED_VARIANTS = 256

    log = (lambda *_: None) if quiet else (lambda msg: print(msg, flush=True))
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for seq in seqs:
        rows.extend(bench_sequence(seq, backward, log, only))
        (out / "partial.json").write_text(json.dumps(rows, indent=1))  # kept if a later size fails
    switch = bench_mode_switch(max(seqs))
    log(f"mode switch at S={switch['seq']}: {switch['recompiles']} recompiles over {switch['routings']} routings, "
        f"{switch['mode_switch_ms']:.3f} ms per switch ({switch['mode_switch_with_backward_ms']:.3f} ms with the "
        f"backward's indices), {switch['routed_call_ms']:.2f} ms per routed call")
    result = dict(
        device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton_version(),
        python=platform.python_version(),
        shapes=dict(batch=BATCH, q_heads=HEADS, kv_heads=KV_HEADS, head_dim=DIM, dtype="bfloat16",
                    ssa=dict(sink=SINK, window=WINDOW)),
        results=[{("pass" if k == "pass_" else k): v for k, v in r.items()} for r in rows],
        mode_switch=switch,
    )
    (out / "bench.json").write_text(json.dumps(result, indent=1))
    _plot(result, out / "bench.png")
    log(f"wrote {out / 'bench.json'} and {out / 'bench.png'}")
    return result


def _plot(result: dict, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fwd = [r for r in result["results"] if r["pass"] == "fwd"]
    seqs = sorted({r["seq"] for r in fwd})
    configs = list(dict.fromkeys(r["config"] for r in fwd))
    fig, axes = plt.subplots(1, len(seqs), figsize=(max(9, 6 * len(seqs)), 5), squeeze=False)
    for ax, seq in zip(axes[0], seqs):
        by_config = {r["config"]: r["ms"] for r in fwd if r["seq"] == seq}
        names = [c for c in configs if c in by_config]
        ax.barh(names, [by_config[c] for c in names], color="tab:blue")
        ax.set_xscale("log")
        ax.set_title(f"S = {seq:,} (forward)")
        ax.set_xlabel("ms (log)")
        ax.invert_yaxis()
    fig.suptitle(f"flexsparse on {result['device']}, torch {result['torch']}, B=1 H=32 H_kv=8 d=128 bf16",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
