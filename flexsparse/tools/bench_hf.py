"""Benchmark of the transformers integration (issue 10's performance section), on a CUDA GPU.

Shapes: Qwen3-8B-like attention (32 query / 8 KV heads, d = 128, bf16), rho = 0.75 (2 full KV heads, 6 sink 128 +
window 2048 heads). Three measurements, every ratio from times taken in the same run:

1. KV memory of the sparse cache at 128K against the all-full cache (the formula gives 3.81x);
2. one layer's decode attention per step at 128K, batch 1 and 8: flexsparse's attention function with its sparse
   KV cache (cache write and one HybridAttention call per head group), against all-full SDPA over the whole cache
   and the ideal hybrid (two SDPA calls on pre-split caches, no masks), timed in turns; on CUDA also the same
   step replayed from a CUDA graph ("flexsparse_graph", the cache's device-side steps);
3. end-to-end ``generate()`` on a Llama-shaped model built from its config (8 layers, hidden 4096, 32/8 heads,
   random weights) at 32K and 128K prompts: flexsparse (sparse KV cache) against the same model with sdpa and
   transformers' DynamicCache, as is and with cuDNN's SDPA disabled (on an H100 with torch 2.11 SDPA picks cuDNN,
   which builds a graph for every decode step's new key length): prefill time, decode tokens per second, peak
   memory.

Run: ``flexsparse bench --hf --out bench/results``, or ``--hf --smoke`` for toy sizes on the CPU (checks the
script, times nothing meaningful); ``python bench/speed/hf_bench.py`` takes the sizes and parts as options. Writes
``hf-bench.json``.
"""

from __future__ import annotations

import dataclasses
import json
import platform
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import LogitsProcessor, LogitsProcessorList

import flexsparse.runtime.compiled
from flexsparse.integrations import SparseKVCache, convert, kv_memory_formula, revert
from flexsparse.integrations.transformers import flexsparse_attention, flexsparse_mask
from flexsparse.kernels.availability import kernels_run_on
from flexsparse.masks import Causal, SinkWindow


@dataclass
class HfBenchConfig:
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
    decode_seq: int = 131072
    decode_batches: list[int] = field(default_factory=lambda: [1, 8])
    decode_extra: int = 1024
    """Decode steps the timed cache has room for (timing and profiling run about 450 steps)."""
    decode_layers: list[int] = field(default_factory=lambda: [1, 4])
    decode_padded_batches: list[int] = field(default_factory=lambda: [8])
    """Batches also timed with left-padded prompts (one layer per step; rows padded differently)."""
    """Layers per timed decode step: 1 is the issue's one-layer figure; more share one mask per step as a model's
    forward does (its per-forward work, the position tables, is then amortised)."""
    e2e_seqs: list[int] = field(default_factory=lambda: [32768, 131072])
    e2e_layers: int = 8
    e2e_intermediate: int = 14336
    e2e_vocab: int = 32000
    e2e_batch: int = 1
    new_tokens: int = 32
    parts: list[str] = field(default_factory=lambda: ["decode", "generate"])

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    def patterns(self) -> dict:
        return {"full": Causal(), "ssa": SinkWindow(self.sink, self.window)}

    def modes(self) -> list[str]:
        return ["full"] * self.full_kv_heads + ["ssa"] * (self.kv_heads - self.full_kv_heads)


SMOKE = HfBenchConfig(device="cpu", dtype="float32", backend="dense", heads=8, kv_heads=4, head_dim=16,
                      full_kv_heads=1, sink=4, window=32, block_size=16, decode_seq=512, decode_batches=[1, 2],
                      decode_extra=512, decode_layers=[1, 2], decode_padded_batches=[2], e2e_seqs=[256, 512], e2e_layers=2, e2e_intermediate=128, e2e_vocab=128,
                      new_tokens=6)


# ----- timing ------------------------------------------------------------------------------------------------------

def time_ms(fn, device: torch.device, rounds: int = 5) -> float:
    """Milliseconds per call in steady state: CUDA events over back-to-back calls (flexsparse.tools.bench's
    method) on a GPU, wall clock medians on a CPU."""
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


def in_turns(timed: dict, device: torch.device, rounds: int = 3) -> dict[str, float]:
    """Medians of each function's time, measured in turns (A B C A B C ...) so drift hits all alike."""
    samples: dict[str, list[float]] = {name: [] for name in timed}
    for _ in range(rounds):
        for name, fn in timed.items():
            samples[name].append(time_ms(fn, device))
    return {name: statistics.median(values) for name, values in samples.items()}


def gpu_kernel_ms(fn, calls: int = 20) -> float | None:
    """Summed CUDA kernel time per call (the GPU work alone, without host overhead), from torch.profiler."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    total_us = 0.0
    for event in prof.key_averages():
        if str(getattr(event, "device_type", "")).endswith("CUDA"):
            total_us += getattr(event, "self_device_time_total", getattr(event, "self_cuda_time_total", 0.0))
    return total_us / calls / 1e3


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


# ----- models --------------------------------------------------------------------------------------------------------

def llama_from_config(cfg: HfBenchConfig, layers: int, intermediate: int, vocab: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=vocab, hidden_size=cfg.heads * cfg.head_dim, intermediate_size=intermediate,
                         num_hidden_layers=layers, num_attention_heads=cfg.heads, num_key_value_heads=cfg.kv_heads,
                         head_dim=cfg.head_dim, max_position_embeddings=2 * max(cfg.e2e_seqs + [cfg.decode_seq]),
                         attn_implementation="sdpa", pad_token_id=0, bos_token_id=None, eos_token_id=None)
    torch.manual_seed(0)
    with torch.device(cfg.device):
        model = LlamaForCausalLM(config)
    return model.to(cfg.torch_dtype).eval()


# ----- 1 + 2: one layer's decode attention and the cache's memory ----------------------------------------------------

@dataclass
class DecodeSetup:
    """What the decode benchmark times: ``timed`` callables (one decode step each; the "flexsparse..." ones run
    ``layers`` layers: "flexsparse" the cache's default decode path, "flexsparse_per_group" or
    "flexsparse_one_launch" the other one where it differs and runs, "flexsparse_graph" on CUDA the one-launch
    step from the cache's device-side state, captured once in a CUDA graph and replayed) and the sparse cache's
    memory at ``seq`` tokens."""

    batch: int
    seq: int
    layers: int
    timed: dict
    kv_bytes: int
    kv_bytes_formula: int
    kv_bytes_all_full: int
    first_step_error: float
    """Max |error| of the first decode step's output against SDPA on the keys each head may attend."""


def _check_first_step(cfg: HfBenchConfig, cache, modules, keys, values, q1, k1, v1, real) -> float:
    """One decode step through flexsparse against SDPA on exactly the keys each head attends (full heads: every
    real key; sink + window heads: the first sink real keys and the last window keys, the new one included);
    raises when it differs. ``real``: the padding mask ``[B, >= seq + 1]`` (left padding)."""
    batch, seq, full = keys.shape[0], keys.shape[2], cfg.full_kv_heads
    mask = flexsparse_mask(batch, 1, seq + 1, attention_mask=real[:, :seq + 1], device=q1.device)
    for index, module in enumerate(modules):
        cache.update(k1, v1, index)
        out = flexsparse_attention(module, q1, k1, v1, mask)[0].transpose(1, 2)
    split = full * (cfg.heads // cfg.kv_heads)
    expected = []
    for b, pad in enumerate((~real[:, :seq]).sum(1).tolist()):  # one sequence at a time: its real keys only
        every = lambda t, new: torch.cat([t[b:b + 1, :full, pad:], new[b:b + 1, :full]], 2)
        ring = lambda t, new: torch.cat([t[b:b + 1, full:, pad:pad + cfg.sink],
                                         t[b:b + 1, full:, max(pad + cfg.sink, seq - cfg.window + 1):],
                                         new[b:b + 1, full:]], 2)
        expected.append(torch.cat([
            F.scaled_dot_product_attention(q1[b:b + 1, :split], every(keys, k1), every(values, v1), enable_gqa=True),
            F.scaled_dot_product_attention(q1[b:b + 1, split:], ring(keys, k1), ring(values, v1), enable_gqa=True),
        ], 1))
    expected = torch.cat(expected)
    error = float((out.float() - expected.float()).abs().max())
    tolerance = 1e-4 if q1.dtype == torch.float32 else 2e-2
    if error > tolerance:
        raise RuntimeError(f"flexsparse's decode step differs from SDPA on the attended keys by {error:.3g} "
                           f"(tolerance {tolerance})")
    return error


@torch.no_grad()
def decode_setup(cfg: HfBenchConfig, batch: int, layers: int = 1, padded: bool = False) -> DecodeSetup:
    """A converted model of ``layers`` attention layers with a sparse cache prefilled with ``cfg.decode_seq``
    random tokens (``padded``: row b's first ``(b * 997) % min(4096, seq / 2)`` of them are left padding), its decode step
    (attention function + cache, one mask per step as a model's forward), and the one-layer baselines: all-full
    SDPA over the whole cache and the ideal two-SDPA hybrid on pre-split caches (both without padding)."""
    dev, dtype, seq = torch.device(cfg.device), cfg.torch_dtype, cfg.decode_seq
    model = llama_from_config(cfg, layers=layers, intermediate=64, vocab=64)
    convert(model, cfg.patterns(), [cfg.modes()] * layers, block_size=cfg.block_size, backend=cfg.backend)
    modules = [layer.self_attn for layer in model.model.layers]
    group, dim = cfg.heads // cfg.kv_heads, cfg.head_dim
    gen = torch.Generator(device=dev).manual_seed(0)
    rand = lambda *shape: torch.randn(*shape, device=dev, dtype=dtype, generator=gen)
    keys, values = rand(batch, cfg.kv_heads, seq, dim), rand(batch, cfg.kv_heads, seq, dim)
    prefill_q = rand(batch, cfg.heads, seq, dim)
    real = torch.ones(batch, seq + cfg.decode_extra, dtype=torch.bool, device=dev)
    if padded:
        for b in range(batch):
            real[b, :(b * 997) % min(4096, seq // 2)] = False

    def prefilled(max_length: int, q, one_launch: bool | None = None) -> SparseKVCache:
        cache = SparseKVCache(model, max_length=max_length, one_launch_decode=one_launch)
        mask = flexsparse_mask(batch, seq, seq, attention_mask=real[:, :seq], device=dev)
        for index, module in enumerate(modules):
            cache.update(keys, values, index)
            flexsparse_attention(module, q, keys, values, mask)
        return cache

    exact = prefilled(seq, prefill_q)  # memory at exactly `seq` tokens
    kv_bytes, formula = exact.memory_bytes(), kv_memory_formula(model, batch, seq, dtype)
    del exact
    caches = {"flexsparse": prefilled(seq + cfg.decode_extra, prefill_q)}  # the default; room for the timed steps
    if dev.type == "cuda":  # the default is the one-launch step: time the per-group calls beside it
        caches["flexsparse_per_group"] = prefilled(seq + cfg.decode_extra, prefill_q, one_launch=False)
        caches["flexsparse_graph"] = prefilled(seq + cfg.decode_extra, prefill_q)  # the step replayed from a graph
    elif kernels_run_on(dev):  # the interpreter: the one-launch step beside the default per-group calls
        caches["flexsparse_one_launch"] = prefilled(seq + cfg.decode_extra, prefill_q, one_launch=True)
    del prefill_q
    _sync(dev)

    q1, k1, v1 = rand(batch, cfg.heads, 1, dim), rand(batch, cfg.kv_heads, 1, dim), rand(batch, cfg.kv_heads, 1, dim)
    error = max(_check_first_step(cfg, cache, modules, keys, values, q1, k1, v1, real) for cache in caches.values())

    def decode_step(cache: SparseKVCache):
        def step():
            if cache.get_seq_length(0) >= seq + cfg.decode_extra:
                raise RuntimeError("the benchmark's cache is full: raise decode_extra")
            tokens = cache.get_seq_length(0) + 1
            mask = flexsparse_mask(batch, 1, tokens, attention_mask=real[:, :tokens] if padded else None, device=dev)
            for index, module in enumerate(modules):
                cache.update(k1, v1, index)
                flexsparse_attention(module, q1, k1, v1, mask)
        return step

    full_heads, full_q = cfg.full_kv_heads, cfg.full_kv_heads * group
    folded_q = q1.view(batch, cfg.kv_heads, group, dim)  # the GQA group as query rows: no K/V expansion
    full_k, full_v = keys[:, :full_heads].contiguous(), values[:, :full_heads].contiguous()
    ring_k = torch.cat([keys[:, full_heads:, :cfg.sink], keys[:, full_heads:, -cfg.window:]], 2).contiguous()
    ring_v = torch.cat([values[:, full_heads:, :cfg.sink], values[:, full_heads:, -cfg.window:]], 2).contiguous()
    sdpa = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, enable_gqa=True)  # the flash kernel
    def graph_step(cache: SparseKVCache):
        """The same step (mask, ``layers`` layers of attention function + cache) from the cache's device-side
        state, captured once in a CUDA graph; a call replays it."""
        steps = cache.start_device_steps(real[:, :cache.get_seq_length(0)] if padded else None)

        def record() -> None:
            steps.begin_step()
            mask = flexsparse_mask(batch, 1, cache.get_seq_length(0) + 1, device=dev)  # read by no device work
            for index, module in enumerate(modules):
                cache.update(k1, v1, index)
                flexsparse_attention(module, q1, k1, v1, mask)

        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up: plans, compiled kernels
            for _ in range(2):
                record()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            record()
        graph.replay()

        def step():
            if cache.get_seq_length(0) >= cache.room():
                raise RuntimeError("the benchmark's cache is full: raise decode_extra")
            graph.replay()
            cache.replayed_step()
        return step

    timed = {
        **{name: decode_step(cache) for name, cache in caches.items() if name != "flexsparse_graph"},
        **({"flexsparse_graph": graph_step(caches["flexsparse_graph"])} if "flexsparse_graph" in caches else {}),
        "sdpa_all_full": lambda: sdpa(q1, keys, values),
        "sdpa_all_full_folded": lambda: F.scaled_dot_product_attention(folded_q, keys, values),
        "ideal_two_sdpa": lambda: (sdpa(q1[:, :full_q], full_k, full_v), sdpa(q1[:, full_q:], ring_k, ring_v)),
    }
    itemsize = torch.empty((), dtype=dtype).element_size()
    all_full = 2 * batch * cfg.kv_heads * seq * dim * itemsize * layers  # a DynamicCache of `seq` tokens
    return DecodeSetup(batch, seq, layers, timed, kv_bytes, formula, all_full, error)


def bench_decode_layer(cfg: HfBenchConfig, batch: int, layers: int = 1, padded: bool = False) -> dict:
    """Per-layer decode step times (flexsparse divided by ``layers``), timed in turns, and the KV memory."""
    dev = torch.device(cfg.device)
    setup = decode_setup(cfg, batch, layers, padded)
    per_layer = [name for name in setup.timed if name.startswith("flexsparse")]
    ms = in_turns(setup.timed, dev)
    for name in per_layer:
        ms[name] /= layers
    result = dict(
        batch=batch, seq=setup.seq, layers_per_step=layers, left_padded=padded, ms=ms,
        speedup_vs_sdpa=ms["sdpa_all_full"] / ms["flexsparse"],
        speedup_vs_sdpa_folded=ms["sdpa_all_full_folded"] / ms["flexsparse"],
        ideal_speedup_vs_sdpa=ms["sdpa_all_full"] / ms["ideal_two_sdpa"],
        kv_bytes=setup.kv_bytes, kv_bytes_formula=setup.kv_bytes_formula, kv_bytes_all_full=setup.kv_bytes_all_full,
        kv_saved=setup.kv_bytes_all_full / setup.kv_bytes, first_step_error=setup.first_step_error,
    )
    for path in ("per_group", "one_launch", "graph"):
        if f"flexsparse_{path}" in ms:
            result[f"{path}_speedup_vs_sdpa"] = ms["sdpa_all_full"] / ms[f"flexsparse_{path}"]
    if dev.type == "cuda":  # GPU work alone (host overhead excluded): kernel time per call from the profiler
        try:
            kernel = {name: gpu_kernel_ms(fn) for name, fn in setup.timed.items()}
            for name in per_layer:
                kernel[name] /= layers
            result["gpu_kernel_ms"] = kernel
            result["gpu_kernel_speedup_vs_sdpa"] = kernel["sdpa_all_full"] / kernel["flexsparse"]
        except Exception as err:  # a diagnostic: its failure must not lose the timings
            result["gpu_kernel_ms"] = f"profiler failed: {err!r}"
    return result


# ----- 3: generate() end to end --------------------------------------------------------------------------------------

class _TokenClock(LogitsProcessor):
    """A logits processor that only records when each token's logits are ready (after a device sync; generate()
    syncs every step anyway): the first call ends the prefill, the gaps between calls are decode steps."""

    def __init__(self, device: torch.device) -> None:
        self.device, self.times = device, []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        _sync(self.device)
        self.times.append(time.perf_counter())
        return scores


def generate_timed(model, ids: torch.Tensor, new_tokens: int, dev: torch.device,
                   **generate_kwargs) -> tuple[float, float, int]:
    """One ``generate`` of ``new_tokens`` tokens (``generate_kwargs`` passed on, e.g. ``cache_implementation``):
    prefill seconds (to the first logits), seconds per decode step (median of the steps), and peak memory above
    what was allocated before."""
    clock = _TokenClock(dev)
    if dev.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    start = time.perf_counter()
    model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                   do_sample=False, logits_processor=LogitsProcessorList([clock]), **generate_kwargs)
    _sync(dev)
    peak = torch.cuda.max_memory_allocated() - before if dev.type == "cuda" else 0
    steps = [b - a for a, b in zip(clock.times, clock.times[1:])]
    return clock.times[0] - start, statistics.median(steps), peak


@torch.no_grad()
def bench_generate(cfg: HfBenchConfig, model, seq: int) -> list[dict]:
    """Prefill time, decode tokens/s and peak memory of ``generate()`` at a ``seq``-token prompt, for flexsparse
    (rho = 0.75 in every layer, sparse KV cache) and for the model's own sdpa + DynamicCache (with and without
    cuDNN's SDPA)."""
    dev = torch.device(cfg.device)
    gen = torch.Generator(device=dev).manual_seed(seq)
    ids = torch.randint(1, cfg.e2e_vocab, (cfg.e2e_batch, seq), device=dev, generator=gen)
    rows = []
    cudnn_sdp = dev.type == "cuda" and torch.backends.cuda.cudnn_sdp_enabled()
    for name in ("flexsparse", "sdpa + DynamicCache", "sdpa without cuDNN + DynamicCache"):
        if name == "flexsparse":
            convert(model, cfg.patterns(), [cfg.modes()] * cfg.e2e_layers, block_size=cfg.block_size,
                    backend=cfg.backend)
        elif name == "sdpa + DynamicCache":
            revert(model)
        if name.startswith("sdpa without cuDNN"):
            if not cudnn_sdp:
                continue  # the same as the row before
            torch.backends.cuda.enable_cudnn_sdp(False)  # cuDNN builds a graph per decode step's new key length
        try:
            generate_timed(model, ids, 3, dev)  # warm-up: compiles flex at this length
            prefill_s, step_s, peak = generate_timed(model, ids, cfg.new_tokens, dev)
        finally:
            if cudnn_sdp:
                torch.backends.cuda.enable_cudnn_sdp(True)
        rows.append(dict(config=name, seq=seq, batch=cfg.e2e_batch, new_tokens=cfg.new_tokens, prefill_s=prefill_s,
                         decode_step_ms=step_s * 1e3, decode_tokens_per_s=cfg.e2e_batch / step_s,
                         peak_memory_bytes=peak))
    return rows


# ----- the suite -----------------------------------------------------------------------------------------------------

def run_hf_bench(cfg: HfBenchConfig | None = None, out_dir: str | Path = "bench/results", log=print) -> dict:
    """Run the suite, write ``hf-bench.json`` under ``out_dir`` (partial results after each part); return it."""
    cfg = cfg or HfBenchConfig()
    dev = torch.device(cfg.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("the transformers benchmark needs a CUDA GPU (or --smoke for toy sizes on the CPU)")
    import transformers

    # every length and batch compiles its own flex variants (prefill of the timed caches and of each prompt)
    flexsparse.runtime.compiled.MAX_COMPILED_VARIANTS = max(flexsparse.runtime.compiled.MAX_COMPILED_VARIANTS, 256)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    result = dict(device=torch.cuda.get_device_name() if dev.type == "cuda" else platform.processor() or "cpu",
                  torch=torch.__version__, transformers=transformers.__version__, python=platform.python_version(),
                  config=dataclasses.asdict(cfg), decode=[], generate=[])
    started = time.perf_counter()
    path = out / "hf-bench.json"
    if "decode" in cfg.parts:
        if dev.type != "cuda":
            log("decode: flexsparse_graph (the step replayed from a CUDA graph) skipped: it needs a CUDA device")
        cases = [(b, n, False) for b in cfg.decode_batches for n in cfg.decode_layers]
        for batch, layers, padded in cases + [(b, 1, True) for b in cfg.decode_padded_batches]:
            row = bench_decode_layer(cfg, batch, layers, padded)
            result["decode"].append(row)
            log(_decode_line(row))
            path.write_text(json.dumps(result, indent=1))
            _empty_cache(dev)
    if "generate" in cfg.parts:
        model = llama_from_config(cfg, cfg.e2e_layers, cfg.e2e_intermediate, cfg.e2e_vocab)
        for seq in cfg.e2e_seqs:
            for row in bench_generate(cfg, model, seq):
                result["generate"].append(row)
                log(f"generate, {seq:,}-token prompt, {row['config']}: prefill {row['prefill_s']:.2f} s, decode "
                    f"{row['decode_step_ms']:.2f} ms per step ({row['decode_tokens_per_s']:.1f} tokens/s), peak "
                    f"+{row['peak_memory_bytes'] / 2**30:.2f} GiB")
            path.write_text(json.dumps(result, indent=1))
            _empty_cache(dev)
        del model
    result["total_s"] = time.perf_counter() - started
    path.write_text(json.dumps(result, indent=1))
    log(f"wrote {path} ({result['total_s']:.0f} s)")
    return result


def _decode_line(row: dict) -> str:
    ms, kernel = row["ms"], row.get("gpu_kernel_ms")
    line = (f"decode step at {row['seq']:,} cached tokens, batch {row['batch']}"
            f"{' left-padded' if row['left_padded'] else ''}, per layer "
            f"({row['layers_per_step']} per step): flexsparse {ms['flexsparse']:.3f} ms, all-full SDPA "
            f"{ms['sdpa_all_full']:.3f} ms ({row['speedup_vs_sdpa']:.2f}x), ideal two-SDPA {ms['ideal_two_sdpa']:.3f} "
            f"ms ({row['ideal_speedup_vs_sdpa']:.2f}x)")
    other = next((path for path in ("per_group", "one_launch") if f"flexsparse_{path}" in ms), None)
    if other is not None:  # the decode path that is not the default, timed beside it
        line += (f", {other.replace('_', '-')} {ms['flexsparse_' + other]:.3f} ms "
                 f"({row[other + '_speedup_vs_sdpa']:.2f}x)")
    if "flexsparse_graph" in ms:
        line += f", CUDA graph {ms['flexsparse_graph']:.3f} ms ({row['graph_speedup_vs_sdpa']:.2f}x)"
    if isinstance(kernel, dict):
        line += (f"; GPU kernels alone: flexsparse {kernel['flexsparse']:.3f} ms, SDPA {kernel['sdpa_all_full']:.3f} "
                 f"ms ({row['gpu_kernel_speedup_vs_sdpa']:.2f}x)")
        if other is not None:
            line += f", {other.replace('_', '-')} {kernel['flexsparse_' + other]:.3f} ms"
    return line + (f"; first step max |error| {row['first_step_error']:.1e}; KV {row['kv_bytes'] / 2**20:.1f} MiB (formula {row['kv_bytes_formula'] / 2**20:.1f}) vs "
                   f"{row['kv_bytes_all_full'] / 2**20:.1f} MiB all-full: {row['kv_saved']:.2f}x less")


def _empty_cache(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.empty_cache()
