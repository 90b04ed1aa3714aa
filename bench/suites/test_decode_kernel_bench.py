"""pytest-benchmark of the ranged decode kernel beside SDPA (CUDA only): one decode step of one layer's heads.

bf16, d = 128, every slot of the cache filled. (B, Hq, Hkv) = (1, 8, 2) and (8, 8, 2) over 131,072 slots (the full
heads of a Qwen3-8B-like layer with 2 full KV heads) and (1, 24, 6) over 2,176 slots (its sink + window ring).
SDPA gets ``q[:, :, None]`` and the first n slots with ``enable_gqa=True``, cuDNN SDPA disabled (with it, torch
builds a cuDNN graph per new key length, ~55 ms). A benchmark round is REPEAT back-to-back eager calls and one
synchronize. ``extra_info`` holds per-call times: ``gpu_ms`` (a CUDA graph of REPEAT calls: GPU time alone) and
``eager_ms`` (events around REPEAT eager calls: host launch overhead included where it exceeds the GPU time), the
achieved bandwidth (bytes of K and V read / gpu_ms) and its fraction of the H100's ~3.35 TB/s. A short cache is
cycled over enough copies (> 2x the 50 MB L2) that K and V come from HBM, as they do layer after layer.

    pytest bench/suites/test_decode_kernel_bench.py --benchmark-only --benchmark-group-by=param:shape

``test_ranged_config_sweep`` times variations of ``KERNEL_CONFIG`` (one knob at a time) for tuning; skip it with
``-k "not sweep"``.

``test_layer_step`` times one layer's whole decode step (B = 1 and 8; Hq = 32, Hkv = 8): ``fused`` is
:func:`decode_step_attention` writing the new token into two cache groups (KV heads 0-1: 131,072 filled slots and
the new token's; KV heads 2-7: a full 2,176-slot ring, the slot mid-ring) and attending them; ``sdpa_groups`` is
two SDPA calls on the same two buffers without any write and without joining their outputs (q's head slices made
once, outside the timing: a lower bound of the unfused step); ``sdpa_full`` is one SDPA call over 8 KV heads x
131,072 slots (the layer with every head full). ``eager_ms`` is what a host-bound batch-1 decode pays.
"""

from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")
from flexsparse.kernels import decode  # noqa: E402
from flexsparse.kernels.decode import DecodeGroup, decode_step_attention, ranged_decode_attention  # noqa: E402

pytestmark = pytest.mark.gpu

SHAPES = {  # batch, query heads, KV heads, filled slots
    "1x8/2 131072": (1, 8, 2, 131_072),
    "8x8/2 131072": (8, 8, 2, 131_072),
    "1x24/6 2176": (1, 24, 6, 2_176),
}
DIM, REPEAT = 128, 32
HBM_BYTES_PER_S = 3.35e12
L2_BYTES = 50 * 2**20
STEP_BATCHES = {"step 1x32/8": 1, "step 8x32/8": 8}
STEP_HEADS, STEP_FULL_KV, STEP_RING_KV, FULL_SLOTS, RING_SLOTS = 32, 2, 6, 131_072, 2_176
SWEEP = [{}, dict(programs_per_sm=1), dict(programs_per_sm=4), dict(num_stages=2), dict(num_stages=4),
         dict(tile_bytes=8192), dict(tile_bytes=32768), dict(num_warps=8), dict(min_blocks_per_split=1)]


@dataclass
class Case:
    shape: str
    kv_bytes: int  # K and V bytes one call reads
    runs: dict  # method -> REPEAT calls, cycling over the cache copies


@pytest.fixture(scope="module", autouse=True)
def no_cudnn_sdpa():
    enabled = torch.backends.cuda.cudnn_sdp_enabled()
    torch.backends.cuda.enable_cudnn_sdp(False)
    yield
    torch.backends.cuda.enable_cudnn_sdp(enabled)


@pytest.fixture(scope="module", params=list(SHAPES))
def case(request):
    batch, heads, kv_heads, slots = SHAPES[request.param]
    kv_bytes = 2 * batch * kv_heads * slots * DIM * torch.bfloat16.itemsize
    copies = -(-2 * L2_BYTES // kv_bytes)
    q = torch.randn(batch, heads, DIM, device="cuda", dtype=torch.bfloat16)
    caches = [tuple(torch.randn(batch, kv_heads, slots, DIM, device="cuda", dtype=torch.bfloat16) for _ in range(2))
              for _ in range(copies)]
    lo = torch.zeros(batch, dtype=torch.int32, device="cuda")
    hi = torch.full((batch,), slots, dtype=torch.int32, device="cuda")
    ranged = lambda k, v: ranged_decode_attention(q, k, v, lo, hi)
    sdpa = lambda k, v: F.scaled_dot_product_attention(q[:, :, None], k[:, :, :slots], v[:, :, :slots],
                                                       enable_gqa=True)[:, :, 0]
    torch.testing.assert_close(ranged(*caches[0]).float(), sdpa(*caches[0]).float(), atol=2e-2, rtol=0)

    def repeated(call):
        def run():
            for i in range(REPEAT):
                call(*caches[i % copies])
        return run

    return Case(request.param, kv_bytes, {"ranged": repeated(ranged), "sdpa": repeated(sdpa)})


def _per_call_ms(run, graph: bool) -> float:
    """Time of one call: events around ``run`` (REPEAT calls), eager or replayed from a CUDA graph."""
    run()  # compile, warm up
    torch.cuda.synchronize()
    if graph:
        cuda_graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(cuda_graph):
            run()
        run = cuda_graph.replay
        run()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    run()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / REPEAT


def _report(kv_bytes: int, gpu_ms: float) -> dict:
    rate = kv_bytes / (gpu_ms * 1e-3)
    return dict(gpu_ms=round(gpu_ms, 4), gb_per_s=round(rate / 1e9, 1), hbm_fraction=round(rate / HBM_BYTES_PER_S, 3))


def _timed(benchmark, run):
    def round_():
        run()
        torch.cuda.synchronize()

    benchmark.pedantic(round_, rounds=10, warmup_rounds=1)


@pytest.mark.parametrize("method", ["ranged", "sdpa"])
def test_decode_step(benchmark, case, method):
    run = case.runs[method]
    gpu_ms = _per_call_ms(run, graph=True)
    info = dict(device=torch.cuda.get_device_name(), shape=case.shape, method=method, repeat=REPEAT,
                kv_mib=round(case.kv_bytes / 2**20, 1), eager_ms=round(_per_call_ms(run, graph=False), 4),
                **_report(case.kv_bytes, gpu_ms))
    if method == "ranged":
        info["speedup_vs_sdpa"] = round(_per_call_ms(case.runs["sdpa"], graph=True) / gpu_ms, 2)
    benchmark.extra_info.update(info)
    _timed(benchmark, run)


@pytest.mark.parametrize("case", ["1x8/2 131072", "1x24/6 2176"], indirect=True)
def test_ranged_config_sweep(benchmark, case):
    """gpu_ms and bandwidth of the default KERNEL_CONFIG and of each variation in SWEEP."""
    default = dict(decode.KERNEL_CONFIG)
    results = {}
    try:
        for change in SWEEP:
            decode.KERNEL_CONFIG.update(default, **change)
            key = ",".join(f"{name}={value}" for name, value in change.items()) or "default"
            results[key] = _report(case.kv_bytes, _per_call_ms(case.runs["ranged"], graph=True))
    finally:
        decode.KERNEL_CONFIG.update(default)
    benchmark.extra_info.update(device=torch.cuda.get_device_name(), shape=case.shape, sweep=results)
    _timed(benchmark, case.runs["ranged"])


@dataclass
class StepCase:
    shape: str
    kv_bytes: dict  # method -> K and V bytes one call reads
    runs: dict  # method -> REPEAT calls


@pytest.fixture(scope="module", params=list(STEP_BATCHES))
def step_case(request):
    batch = STEP_BATCHES[request.param]
    kv_heads, group_size = STEP_FULL_KV + STEP_RING_KV, STEP_HEADS // (STEP_FULL_KV + STEP_RING_KV)
    bf16 = dict(device="cuda", dtype=torch.bfloat16)
    index = lambda value: torch.full((batch,), value, dtype=torch.int32, device="cuda")
    full = DecodeGroup(*(torch.randn(batch, STEP_FULL_KV, FULL_SLOTS + 128, DIM, **bf16) for _ in range(2)), 0,
                       index(0), index(FULL_SLOTS + 1), index(FULL_SLOTS))  # the new token after 131,072
    ring = DecodeGroup(*(torch.randn(batch, STEP_RING_KV, RING_SLOTS, DIM, **bf16) for _ in range(2)),
                       STEP_FULL_KV, index(0), index(RING_SLOTS), index(RING_SLOTS // 3))  # a full ring
    q = torch.randn(batch, 1, STEP_HEADS, DIM, **bf16).transpose(1, 2)  # [B, Hq, 1, d] as a model's projection
    k_new, v_new = (torch.randn(batch, 1, kv_heads, DIM, **bf16).transpose(1, 2) for _ in range(2))
    full_keys, full_values = (t[:, :, : FULL_SLOTS + 1] for t in (full.keys, full.values))
    q_full, q_ring = q[:, : STEP_FULL_KV * group_size], q[:, STEP_FULL_KV * group_size :]
    dense_keys, dense_values = (torch.randn(batch, kv_heads, FULL_SLOTS, DIM, **bf16) for _ in range(2))

    fused = lambda: decode_step_attention(q[:, :, 0], k_new[:, :, 0], v_new[:, :, 0], [full, ring])

    def sdpa_groups():
        return (F.scaled_dot_product_attention(q_full, full_keys, full_values, enable_gqa=True),
                F.scaled_dot_product_attention(q_ring, ring.keys, ring.values, enable_gqa=True))

    sdpa_full = lambda: F.scaled_dot_product_attention(q, dense_keys, dense_values, enable_gqa=True)
    got = fused()  # writes the new token: from then on SDPA reads the same keys
    torch.testing.assert_close(got.float(), torch.cat(sdpa_groups(), dim=1)[:, :, 0].float(), atol=2e-2, rtol=0)

    def repeated(call):
        def run():
            for _ in range(REPEAT):
                call()
        return run

    slot_bytes = 2 * batch * DIM * torch.bfloat16.itemsize  # K and V of one slot of one head
    step_bytes = slot_bytes * (STEP_FULL_KV * (FULL_SLOTS + 1) + STEP_RING_KV * RING_SLOTS)
    return StepCase(request.param, dict(fused=step_bytes, sdpa_groups=step_bytes,
                                        sdpa_full=slot_bytes * kv_heads * FULL_SLOTS),
                    dict(fused=repeated(fused), sdpa_groups=repeated(sdpa_groups), sdpa_full=repeated(sdpa_full)))


@pytest.mark.parametrize("method", ["fused", "sdpa_groups", "sdpa_full"])
def test_layer_step(benchmark, step_case, method):
    """One layer's decode step: the fused call, the unfused SDPA lower bound, and an all-full layer's SDPA."""
    run = step_case.runs[method]
    gpu_ms = _per_call_ms(run, graph=True)
    info = dict(device=torch.cuda.get_device_name(), shape=step_case.shape, method=method, repeat=REPEAT,
                kv_mib=round(step_case.kv_bytes[method] / 2**20, 1), eager_ms=round(_per_call_ms(run, graph=False), 4),
                **_report(step_case.kv_bytes[method], gpu_ms))
    benchmark.extra_info.update(info)
    _timed(benchmark, run)
