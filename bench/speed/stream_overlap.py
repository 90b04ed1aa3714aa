"""Does running a split plan's two head groups on two CUDA streams pay, and where?

The layer is ``flexsparse bench``'s "hybrid rho=0.75": 32 query / 8 KV heads, d=128, bf16, KV heads 0-1
full (Causal), 2-7 SinkWindow(128, 2048). Its split plan runs two groups one after the other on the current
stream (full heads on SDPA, sink+window heads on compiled flex) and writes both into one output. Variants:

* ``serial``: the two groups as two calls of the split layer itself, one per group (``kv_heads=[0, 1]``,
  ``kv_heads=[2, ..., 7]``: the layer plans each on the executor its split plan picks), back to back on the
  current stream, copied into one preallocated ``[B, 32, S_q, d]`` output;
* ``overlapped``: the same two calls, each on its own CUDA stream (both wait on the current stream, which
  waits on both), each copying its result into the output on its stream (``record_stream`` for it);
* ``split`` / ``fused``: the layer's ``plan="split"`` and ``plan="fused"`` (one flex launch for every head)
  on the layer's q/k/v, as references; ``sdpa all``: SDPA on all 32 heads (lower-right causal for chunks).

Inputs of the group calls: views of the layer's q/k/v for prefill (what the split plan passes its
executors); for chunks and decode each group's q/k/v in its own contiguous tensor, as ``SparseKVCache``
keeps a layer's head groups (on one K/V tensor the split plan copies the flex group's strided view to
contiguous strides on every such call: part of the "split" - "serial" gap there). Chunks and decode pass one
prebuilt ``Positions.contiguous`` per case, as a model builds one per forward for all its layers. Decode
cases also time ``cache decode``: SparseKVCache's per-group decode for this layer
(SDPA over a prefix of the slots, as the cache's SDPA decoder runs it, on the full heads' keys and on the sink+window heads' 2176-slot ring),
serial and overlapped (SparseKVCache's one-launch ``DecodeStep`` is not timed here).

Cases, in this order (``--deadline-s`` cuts the tail; ``--only`` picks some): decode (q_len 1) and 512-token
chunks against 32K and 128K keys at B=1 and B=8; then per batch (1, then 8) prefill forward at 1K, 2K, 4K,
8K, 32K and forward+backward at 2K and 8K (autograd runs each backward op on its forward op's stream, so the
overlapped backward overlaps too). Times: median over rounds of back-to-back calls between two CUDA events,
after warm-up (which compiles); serial and overlapped timed in turns (A B A B), so drift hits both.
``graph``: each forward variant captured in a CUDA graph and replayed (no host time: the GPU-side effect of
overlap); a variant that cannot be captured is skipped with its error; backward passes are not captured.
Checks: overlapped output (and gradients) against serial, max |diff| / max |serial| <= 1e-2 (bit-equal
expected: the same kernels on the same inputs), serial against split.

    PYTHONPATH=. python bench/speed/stream_overlap.py --out rows.json   # about 4 minutes on an H100
    PYTHONPATH=. python bench/speed/stream_overlap.py --dry-run         # CPU, toy sizes: every variant built

Reading it: ``serial/overlapped`` > 1 means overlap pays. Eager times of short calls (decode, chunks, 1K-2K
prefill) are bounded by host time (launches and the plan's Python; two group calls cost two layer calls),
which streams cannot shorten; the graph column removes it. There, overlap pays where neither group fills the
GPU: decode (a few CTAs per group, latency- and bandwidth-bound: SDPA's split-KV over 2 heads' keys beside
flex's decode over 6 heads' windows) and chunks (few query tiles per head). At long prefill each group
launches more CTAs than the GPU has SMs (132 on an H100): compute-bound, the ratio goes to 1 (overlap only
fills the tail of the shorter group). Compare ``overlapped`` with ``fused`` too: overlap is worth putting in
the library where it beats both the split and the fused plan.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention.bias import causal_lower_right

import flexsparse.runtime.compiled
from flexsparse import Causal, HybridAttention, Positions, SinkWindow
from flexsparse.runtime.call import AttentionCall
from flexsparse.runtime.executors import sdpa_without_graph_builds
from flexsparse.runtime.inputs import call_geometry
from flexsparse.runtime.plan import Planner
from flexsparse.tools.bench import cuda_time_ms

HEADS, KV_HEADS, DIM = 32, 8, 128
FULL_KV = 2
"""KV heads 0 .. FULL_KV - 1 are full, the rest sink+window (rho = 0.75)."""
SINK, WINDOW = 128, 2048
GROUP = HEADS // KV_HEADS
CHUNK = 512
TOLERANCE = 1e-2
"""Overlapped against serial: max |diff| / max |serial| (bf16; the same kernels: bit-equal expected)."""


@dataclass(frozen=True)
class Case:
    kind: str  # "prefill", "chunk" or "decode"
    batch: int
    q_len: int
    kv_len: int
    backward: bool = False

    @property
    def name(self) -> str:
        size = (f"S={self.kv_len}" if self.kind == "prefill" else f"q={self.q_len} kv={self.kv_len}")
        return f"{self.kind} B={self.batch} {size} {'fwd+bwd' if self.backward else 'fwd'}"


def gpu_cases() -> list[Case]:
    """The cases in the order they run, most informative for the issue first (the deadline cuts the tail):
    decode, chunks, B=1 prefill, B=1 training, then B=8 prefill and training."""
    cases = [Case("decode", b, 1, n) for n in (32768, 131072) for b in (1, 8)]
    cases += [Case("chunk", b, CHUNK, n) for n in (32768, 131072) for b in (1, 8)]
    for batch in (1, 8):
        cases += [Case("prefill", batch, n, n) for n in (1024, 2048, 4096, 8192, 32768)]
        cases += [Case("prefill", batch, n, n, backward=True) for n in (2048, 8192)]
    return cases


@dataclass
class Layers:
    """The layer under both plans, and the head groups of the split plan."""

    split: HybridAttention
    fused: HybridAttention
    groups: tuple[tuple[int, ...], tuple[int, ...]] = (tuple(range(FULL_KV)), tuple(range(FULL_KV, KV_HEADS)))

    @classmethod
    def build(cls, backend: str, sink: int, window: int, block_size: int) -> Layers:
        patterns = {"full": Causal(), "ssa": SinkWindow(sink, window)}
        modes = ["full"] * FULL_KV + ["ssa"] * (KV_HEADS - FULL_KV)
        make = lambda plan: HybridAttention(HEADS, KV_HEADS, DIM, patterns, modes, backend=backend, plan=plan,
                                            block_size=block_size)
        return cls(make("split"), make("fused"))


def q_slice(kv_heads: tuple[int, ...]) -> slice:
    return slice(kv_heads[0] * GROUP, (kv_heads[-1] + 1) * GROUP)


def kv_slice(kv_heads: tuple[int, ...]) -> slice:
    return slice(kv_heads[0], kv_heads[-1] + 1)


@dataclass
class CaseInputs:
    """The layer's q ``[B, H, S_q, d]``, k/v ``[B, H_kv, S_kv, d]``, each group's (q, k, v), the positions of
    a chunk or decode call (None for prefill), and the leaves that get gradients (prefill with backward: q, k,
    v, whose views the group calls take)."""

    q: Tensor
    k: Tensor
    v: Tensor
    group_qkv: list[tuple[Tensor, Tensor, Tensor]]
    positions: Positions | None
    leaves: list[Tensor] = field(default_factory=list)


def make_inputs(case: Case, layers: Layers, device: str, dtype: torch.dtype) -> CaseInputs:
    """Random inputs of a case (seeded)."""
    gen = torch.Generator(device=device).manual_seed(0)
    make = lambda h, n: torch.randn(case.batch, h, n, DIM, device=device, dtype=dtype, generator=gen)
    q, k, v = make(HEADS, case.q_len), make(KV_HEADS, case.kv_len), make(KV_HEADS, case.kv_len)
    if case.backward:
        q, k, v = (t.requires_grad_() for t in (q, k, v))
    if case.kind == "prefill":  # views, as the split plan passes them (their gradients reach q/k/v)
        groups = [(q[:, q_slice(h)], k[:, kv_slice(h)], v[:, kv_slice(h)]) for h in layers.groups]
        return CaseInputs(q, k, v, groups, None, [q, k, v])
    groups = [(q[:, q_slice(h)].contiguous(), k[:, kv_slice(h)].contiguous(), v[:, kv_slice(h)].contiguous())
              for h in layers.groups]  # apart, as a sparse KV cache keeps a layer's head groups
    return CaseInputs(q, k, v, groups, Positions.contiguous(case.q_len, case.kv_len, device))


# ----- the variants ----------------------------------------------------------------------------------------


def two_calls(calls: list[tuple[Callable[[], Tensor], slice]], out_shape: tuple[int, ...], like: Tensor,
              streams: Streams) -> Callable[[], Tensor]:
    """Each ``(call, query-head slice)`` written into one new output ``out_shape``: back to back on the
    current stream (``streams`` None), or each call and its copy on its own stream, forked from and joined
    into the current one. The output is allocated on the current stream before the fork and recorded on both
    streams; the callers keep the inputs alive (and synchronize) until the calls finished."""

    def serial() -> Tensor:
        out = like.new_empty(out_shape)
        for call, heads in calls:
            out[:, heads].copy_(call())
        return out

    def overlapped() -> Tensor:
        main = torch.cuda.current_stream()
        out = like.new_empty(out_shape)
        for stream, (call, heads) in zip(streams, calls):
            stream.wait_stream(main)  # an event on the main stream after the output's allocation
            with torch.cuda.stream(stream):
                out[:, heads].copy_(call())
            out.record_stream(stream)
        for stream in streams:
            main.wait_stream(stream)
        return out

    return serial if streams is None else overlapped


Streams = tuple[torch.cuda.Stream, torch.cuda.Stream] | None


def layer_variants(case: Case, layers: Layers, inputs: CaseInputs, streams: Streams) -> dict[str, Callable]:
    """name -> a call returning the layer's output ``[B, H, S_q, d]`` (overlapped only with ``streams``)."""
    q, k, v, positions = inputs.q, inputs.k, inputs.v, inputs.positions
    attn = layers.split
    group_calls = [(lambda heads=heads, qkv=qkv: attn(*qkv, kv_heads=heads, positions=positions),
                    q_slice(heads)) for heads, qkv in zip(layers.groups, inputs.group_qkv)]
    variants = {"serial": two_calls(group_calls, tuple(q.shape), q, None)}
    if streams is not None:
        variants["overlapped"] = two_calls(group_calls, tuple(q.shape), q, streams)
    variants["split"] = lambda: layers.split(q, k, v, positions=positions)
    variants["fused"] = lambda: layers.fused(q, k, v, positions=positions)
    variants["sdpa all"] = sdpa_all(case, q, k, v)
    return variants


def sdpa_all(case: Case, q: Tensor, k: Tensor, v: Tensor) -> Callable[[], Tensor]:
    """SDPA on every head: causal for prefill, lower-right causal for a chunk (its queries are the last
    positions), no mask for decode (the new token sees every key)."""
    if case.kind == "prefill":
        return lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    if case.kind == "chunk":
        bias = causal_lower_right(case.q_len, case.kv_len)
        return lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=bias, enable_gqa=True)
    return lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True)


def cache_decode_variants(case: Case, inputs: CaseInputs, sink: int, window: int,
                          streams) -> dict[str, Callable[[], Tensor]]:
    """A decode step as SparseKVCache runs it per group for this layer: SDPA over the full heads' filled keys,
    SDPA over the sink+window heads' ring (the first ``sink`` and last ``window`` keys: what the new token
    attends, in any slot order), serial and overlapped."""
    (q_full, k_full, v_full), (q_ring, k_sparse, v_sparse) = inputs.group_qkv
    keep = lambda t: (t if case.kv_len <= sink + window
                      else torch.cat([t[:, :, :sink], t[:, :, -window:]], dim=2))
    k_ring, v_ring = keep(k_sparse), keep(v_sparse)
    ring = k_ring.shape[2]
    scale = DIM**-0.5
    prefix = lambda q, k, v, filled: sdpa_without_graph_builds(q, k[:, :, :filled], v[:, :, :filled], scale=scale,
                                                               enable_gqa=q.shape[1] > k.shape[1])
    calls = [(lambda: prefix(q_full, k_full, v_full, case.kv_len), q_slice(tuple(range(FULL_KV)))),
             (lambda: prefix(q_ring, k_ring, v_ring, ring),
              q_slice(tuple(range(FULL_KV, KV_HEADS))))]
    shape = tuple(inputs.q.shape)
    variants = {"cache decode serial": two_calls(calls, shape, inputs.q, None)}
    if streams is not None:
        variants["cache decode overlapped"] = two_calls(calls, shape, inputs.q, streams)
    return variants


def with_backward(fn: Callable[[], Tensor], leaves: list[Tensor], grad: Tensor) -> Callable[[], Tensor]:
    """One training step of ``fn``: forward, backward of ``grad`` into fresh ``.grad`` of ``leaves``."""

    def step() -> Tensor:
        for t in leaves:
            t.grad = None
        out = fn()
        out.backward(grad)
        return out

    return step


def plan_label(attn: HybridAttention, q: Tensor, k: Tensor, v: Tensor, positions: Positions | None,
               needs_grad: bool, kv_heads: tuple[int, ...] | None = None) -> str:
    """The executor groups the layer's planner makes for this call, as ``sdpa[0-1] + flex[2-7]`` (built from
    public pieces: a Planner over the layer's executors, as the layer builds its own)."""
    heads = tuple(range(attn.num_kv_heads)) if kv_heads is None else kv_heads
    geo = call_geometry(q, k, attn.num_heads, attn.block_size, None, positions)
    call = AttentionCall(q, k, v, attn.scale, geo, needs_grad, heads)
    planner = Planner(attn.plan, list(attn.patterns.values()), attn.num_kv_heads, attn.executors,
                      attn.pattern_names)
    modes = tuple(int(attn.default_modes[h]) for h in heads)
    parts = []
    for group in planner.groups(call, modes):
        layer_heads = [heads[h] for h in group.heads.kv_heads]
        parts.append(f"{group.executor.name}[{layer_heads[0]}-{layer_heads[-1]}]")
    return " + ".join(parts)


# ----- measuring -------------------------------------------------------------------------------------------




def captured(fn: Callable[[], Tensor]) -> tuple[torch.cuda.CUDAGraph, Tensor]:
    """``fn`` captured in a CUDA graph (after a warm-up on a side stream, as torch's docs ask), and its static
    output."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    torch.cuda.synchronize()
    return graph, out


def verdict(diff: float) -> dict:
    return {"rel_diff": diff, "exact": diff == 0.0, "ok": diff <= TOLERANCE}


def relative_diff(actual: Tensor, expected: Tensor) -> float:
    """max |actual - expected| / max |expected| (float64)."""
    diff = (actual.double() - expected.double()).abs().max().item()
    return diff / max(expected.double().abs().max().item(), 1e-30)


class Clock:
    """The run's deadline: measurements and cases that would start past it are skipped."""

    def __init__(self, deadline_s: float) -> None:
        self.start, self.deadline_s = time.perf_counter(), deadline_s

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def left(self) -> float:
        return self.deadline_s - self.elapsed()


def short_error(err: BaseException) -> str:
    return f"{type(err).__name__}: {str(err).strip().splitlines()[0][:300] if str(err).strip() else ''}"


def bench_case(case: Case, layers: Layers, streams, clock: Clock, budget_s: float, log) -> dict:
    """One case: warm-up, checks, eager and graph times of every variant; failures recorded, not raised."""
    row: dict = {"case": case.name, "kind": case.kind, "batch": case.batch, "q_len": case.q_len,
                 "kv_len": case.kv_len, "passes": "fwd+bwd" if case.backward else "fwd", "eager_ms": {},
                 "graph_ms": {}, "checks": {}, "errors": {}, "notes": []}
    inputs = make_inputs(case, layers, "cuda", torch.bfloat16)
    try:
        row["plans"] = {
            "split": plan_label(layers.split, inputs.q, inputs.k, inputs.v, inputs.positions, case.backward),
            "serial groups": " | ".join(
                plan_label(layers.split, *qkv, inputs.positions, case.backward, kv_heads=heads)
                for heads, qkv in zip(layers.groups, inputs.group_qkv)),
        }
    except Exception as err:  # noqa: BLE001 -- labelling only
        row["errors"]["plans"] = short_error(err)
    variants = layer_variants(case, layers, inputs, streams)
    if case.kind == "decode":
        variants.update(cache_decode_variants(case, inputs, SINK, WINDOW, streams))
    if case.backward:
        grad = torch.randn(inputs.q.shape, device=inputs.q.device, dtype=inputs.q.dtype,
                           generator=torch.Generator(device=inputs.q.device).manual_seed(1))
        variants = {name: with_backward(fn, inputs.leaves, grad) for name, fn in variants.items()}
    grad_mode = nullcontext() if case.backward else torch.no_grad()
    with grad_mode:
        outputs = warm_up(variants, row, clock)
        check(case, outputs, inputs, variants, row)
        time_eager(variants, row, clock, budget_s)
        if case.backward:
            row["notes"].append("backward passes not captured in CUDA graphs (eager times only)")
        else:
            time_graphs(variants, row, clock, budget_s)
    for prefix in ("", "cache decode "):
        for column in ("eager_ms", "graph_ms"):
            times = row[column]
            if f"{prefix}serial" in times and f"{prefix}overlapped" in times:
                row.setdefault("serial_over_overlapped", {})[f"{prefix}{column[:-3]}"] = (
                    times[f"{prefix}serial"] / times[f"{prefix}overlapped"])
    del inputs, variants, outputs
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    print_case(row, log)
    return row


def warm_up(variants: dict, row: dict, clock: Clock) -> dict[str, Tensor]:
    """Each variant's first call (compiles); its output, detached, for the checks. Serial before overlapped:
    the first calls build the plan's masks, on the main stream."""
    outputs = {}
    for name, fn in variants.items():
        if clock.left() <= 0:
            row["errors"][name] = "skipped: deadline"
            continue
        try:
            outputs[name] = fn().detach().clone()
            torch.cuda.synchronize()
        except Exception as err:  # noqa: BLE001 -- one shot on a lent machine: record the failure, go on
            row["errors"][name] = short_error(err)
            settle()
    return outputs


def check(case: Case, outputs: dict[str, Tensor], inputs: CaseInputs, variants: dict, row: dict) -> None:
    """Overlapped against serial (outputs, and gradients for backward), serial against split."""
    pairs = [("overlapped", "serial"), ("serial", "split"),
             ("cache decode overlapped", "cache decode serial"), ("cache decode serial", "split")]
    for actual, expected in pairs:
        if actual in outputs and expected in outputs:
            diff = relative_diff(outputs[actual], outputs[expected])
            row["checks"][f"{actual} vs {expected}"] = verdict(diff)
    if case.backward and "serial" in outputs and "overlapped" in outputs:
        try:
            grads = {}
            for name in ("serial", "overlapped"):
                variants[name]()
                grads[name] = [t.grad.detach().clone() for t in inputs.leaves]
            torch.cuda.synchronize()
            diff = max(relative_diff(a, b) for a, b in zip(grads["overlapped"], grads["serial"]))
            row["checks"]["overlapped vs serial gradients"] = verdict(diff)
        except Exception as err:  # noqa: BLE001 -- recorded
            row["errors"]["gradient check"] = short_error(err)
            settle()


def time_eager(variants: dict, row: dict, clock: Clock, budget_s: float, turns: int = 3) -> None:
    """Every variant that warmed up; serial and overlapped pairs in turns."""
    ready = [n for n in variants if n not in row["errors"]]
    for prefix in ("", "cache decode "):
        pair = [f"{prefix}serial", f"{prefix}overlapped"]
        if all(n in ready for n in pair):
            times = {n: [] for n in pair}
            for _ in range(turns):
                for name in pair:
                    if clock.left() > 0:
                        measure(partial(cuda_time_ms, variants[name], budget_s=budget_s), times[name], row,
                                name)
            for name in pair:
                if times[name]:
                    row["eager_ms"][name] = statistics.median(times[name])
                ready.remove(name)
    for name in ready:
        if clock.left() > 0:
            times = []
            measure(partial(cuda_time_ms, variants[name], budget_s=budget_s), times, row, name)
            if times:
                row["eager_ms"][name] = times[0]


def measure(fn: Callable[[], float], into: list[float], row: dict, name: str) -> None:
    """``fn()``'s time appended to ``into``, or its error recorded under ``name``."""
    try:
        into.append(fn())
    except Exception as err:  # noqa: BLE001 -- one shot on a lent machine: record the failure, go on
        row["errors"][name] = short_error(err)
        settle()


def settle() -> None:
    """Wait for the device after a failure; an error that sticks is recorded by the next measurement."""
    try:
        torch.cuda.synchronize()
    except Exception:  # noqa: BLE001, S110 -- the next measurement reports it
        pass


def time_graphs(variants: dict, row: dict, clock: Clock, budget_s: float, turns: int = 3) -> None:
    """Each variant captured and replayed; a capture that fails is recorded and skipped. The overlapped
    replay's output is checked against the serial one."""
    graphs: dict[str, tuple[torch.cuda.CUDAGraph, Tensor]] = {}
    for name, fn in variants.items():
        if name in row["errors"] or clock.left() <= 0:
            continue
        try:
            graphs[name] = captured(fn)
        except Exception as err:  # noqa: BLE001 -- a variant that cannot be captured is skipped
            row["errors"][f"{name} (graph capture)"] = short_error(err)
            settle()
    for prefix in ("", "cache decode "):
        serial, overlapped = f"{prefix}serial", f"{prefix}overlapped"
        if serial in graphs and overlapped in graphs:
            try:
                for name in (serial, overlapped):
                    graphs[name][0].replay()
                torch.cuda.synchronize()
                diff = relative_diff(graphs[overlapped][1], graphs[serial][1])
                row["checks"][f"{overlapped} vs {serial} (graph replay)"] = verdict(diff)
            except Exception as err:  # noqa: BLE001 -- recorded
                row["errors"][f"{prefix}graph check"] = short_error(err)
                settle()
    order = [n for n in graphs if "serial" in n or "overlapped" in n]
    times: dict[str, list[float]] = {n: [] for n in graphs}
    for _ in range(turns):  # serial and overlapped in turns
        for name in order:
            if clock.left() > 0:
                measure(partial(cuda_time_ms, graphs[name][0].replay, budget_s=budget_s), times[name], row,
                        f"{name} (graph)")
    for name in graphs:
        if name not in order and clock.left() > 0:
            measure(partial(cuda_time_ms, graphs[name][0].replay, budget_s=budget_s), times[name], row,
                    f"{name} (graph)")
    for name, ts in times.items():
        if ts:
            row["graph_ms"][name] = statistics.median(ts)
    graphs.clear()


def print_case(row: dict, log) -> None:
    plans = row.get("plans", {})
    log(f"\n== {row['case']}   split plan: {plans.get('split', '?')}   serial groups: "
        f"{plans.get('serial groups', '?')}")
    names = list(dict.fromkeys([*row["eager_ms"], *row["graph_ms"]]))
    log(f"  {'variant':<26}{'eager ms':>11}{'graph ms':>11}")
    fmt = lambda x: f"{x:11.4f}" if x is not None else f"{'-':>11}"
    for name in names:
        log(f"  {name:<26}{fmt(row['eager_ms'].get(name))}{fmt(row['graph_ms'].get(name))}")
    for key, ratio in row.get("serial_over_overlapped", {}).items():
        log(f"  serial/overlapped ({key}): {ratio:.3f}")
    for key, result in row["checks"].items():
        verdict = "exact" if result["exact"] else ("ok" if result["ok"] else "MISMATCH")
        log(f"  check {key}: rel diff {result['rel_diff']:.3g} ({verdict})")
    for key, err in row["errors"].items():
        log(f"  skipped {key}: {err}")
    for note in row["notes"]:
        log(f"  note: {note}")


def run_gpu(args: argparse.Namespace) -> dict:
    clock = Clock(args.deadline_s)
    flexsparse.runtime.compiled.MAX_COMPILED_VARIANTS = 256  # one process compiles every case's shapes
    log = lambda msg: print(msg, flush=True)
    layers = Layers.build("flex", SINK, WINDOW, 128)
    streams = (torch.cuda.Stream(), torch.cuda.Stream())
    result = {
        "device": torch.cuda.get_device_name(),
        "sm_count": torch.cuda.get_device_properties(0).multi_processor_count,
        "torch": torch.__version__, "python": platform.python_version(),
        "layer": {"q_heads": HEADS, "kv_heads": KV_HEADS, "head_dim": DIM, "dtype": "bfloat16",
                  "full_kv_heads": FULL_KV, "sink": SINK, "window": WINDOW, "block_size": 128},
        "tolerance": TOLERANCE, "cases": [], "skipped": [],
    }
    out = Path(args.out) if args.out else None
    case_seconds: list[float] = []  # the first case's include the cold start (compiler, kernels): not counted
    for case in gpu_cases():
        if args.only and args.only not in case.name:
            continue
        if clock.left() < max(case_seconds[1:], default=0.0):
            result["skipped"].append({"case": case.name, "why": f"deadline ({args.deadline_s:g} s)"})
            log(f"\n== {case.name}: skipped (deadline {args.deadline_s:g} s, "
                f"{clock.elapsed():.0f} s elapsed)")
            continue
        started = time.perf_counter()
        try:
            row = bench_case(case, layers, streams, clock, args.budget_s, log)
        except Exception as err:  # noqa: BLE001 -- inputs (out of memory, say), anything the guards missed
            row = {"case": case.name, "errors": {"case": short_error(err)}}
            log(f"\n== {case.name}: failed: {short_error(err)}")
            traceback.print_exc(file=sys.stderr)
            settle()
            torch.cuda.empty_cache()
        row["seconds"] = time.perf_counter() - started
        case_seconds.append(row["seconds"])
        result["cases"].append(row)
        if out is not None:
            out.write_text(json.dumps(result, indent=1))  # kept if a later case fails
    result["seconds"] = clock.elapsed()
    if out is not None:
        out.write_text(json.dumps(result, indent=1))
        log(f"\nwrote {out} ({clock.elapsed():.0f} s)")
    return result


# ----- dry run (CPU, toy sizes) -----------------------------------------------------------------------------


def dry_run() -> int:
    """Every variant built and called on the CPU at toy sizes (eager flex, float32; no streams, no graphs):
    serial against split, split against fused, ``sdpa all`` against an all-full layer; a backward through the
    dense backend (flex has none on the CPU). Returns the exit code."""
    torch.manual_seed(0)
    sink, window, block = 16, 64, 32
    flex = Layers.build("flex_eager", sink, window, block)
    dense = Layers.build("dense", sink, window, block)
    everything_full = HybridAttention(HEADS, KV_HEADS, DIM, Causal(), backend="flex_eager", block_size=block)
    cases = [Case("prefill", 1, 256, 256), Case("prefill", 2, 192, 192), Case("chunk", 2, 64, 512),
             Case("decode", 1, 1, 512), Case("decode", 2, 1, 320),
             Case("prefill", 2, 128, 128, backward=True)]
    failures = 0
    for case in cases:
        layers = dense if case.backward else flex
        inputs = make_inputs(case, layers, "cpu", torch.float32)
        variants = layer_variants(case, layers, inputs, streams=None)
        if case.kind == "decode":
            variants.update(cache_decode_variants(case, inputs, sink, window, None))
        if case.backward:
            grad = torch.randn(inputs.q.shape)
            variants = {n: with_backward(fn, inputs.leaves, grad) for n, fn in variants.items()}
        labels = "(dense backend: one fused group per call)" if case.backward else " | ".join(
            plan_label(layers.split, *qkv, inputs.positions, case.backward, kv_heads=heads)
            for heads, qkv in zip(layers.groups, inputs.group_qkv))
        outputs, grads = {}, {}
        for name, fn in variants.items():
            out = fn()
            outputs[name] = out.detach()
            if case.backward:
                grads[name] = [t.grad.clone() for t in inputs.leaves]
            if tuple(out.shape) != tuple(inputs.q.shape):
                print(f"FAIL {case.name} {name}: shape {tuple(out.shape)}, expected {tuple(inputs.q.shape)}")
                failures += 1
        checks = {}
        if case.backward:
            checks["serial vs split gradients"] = max(relative_diff(a, b) for a, b in zip(grads["serial"],
                                                                                        grads["split"]))
        full_ref = everything_full(*(t.detach() for t in (inputs.q, inputs.k, inputs.v)),
                                   positions=inputs.positions)
        comparisons = [("serial", "split"), ("split", "fused"), ("cache decode serial", "split")]
        checks.update({f"{a} vs {b}": relative_diff(outputs[a], outputs[b]) for a, b in comparisons
                       if a in outputs and b in outputs})
        if "sdpa all" in outputs:
            checks["sdpa all vs all-full layer"] = relative_diff(outputs["sdpa all"], full_ref)
        bad = [k for k, d in checks.items() if d > 1e-4]
        failures += len(bad)
        print(f"{case.name}: {len(variants)} variants [{', '.join(variants)}]; serial groups {labels}; "
              + "; ".join(f"{k} {d:.2g}" for k, d in checks.items())
              + (f"  FAIL {bad}" if bad else ""))
    print("dry run:", "ok" if not failures else f"{failures} failures")
    return 1 if failures else 0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="write the results as JSON to this file (rewritten after every case)")
    parser.add_argument("--deadline-s", type=float, default=200.0,
                        help="skip cases (and measurements) that would start past this many seconds "
                             "(default 200: the run ends within about 4 minutes)")
    parser.add_argument("--budget-s", type=float, default=0.1,
                        help="seconds of calls per timed measurement (default 0.1)")
    parser.add_argument("--only", help="run only the cases whose name contains this, e.g. 'decode' or 'B=1'")
    parser.add_argument("--dry-run", action="store_true",
                        help="build and call every variant on the CPU at toy sizes (no streams, no graphs), "
                             "then exit")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.dry_run:
        return dry_run()
    if not torch.cuda.is_available():
        print("stream_overlap: needs a CUDA GPU (--dry-run checks the variants on the CPU)", file=sys.stderr)
        return 2
    if args.deadline_s <= 0 or args.budget_s <= 0:
        print("stream_overlap: --deadline-s and --budget-s must be positive", file=sys.stderr)
        return 2
    run_gpu(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
