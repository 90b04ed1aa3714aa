"""pytest-benchmark of the ranged decode kernel beside SDPA (CUDA only): one decode step of one layer's heads.

bf16, d = 128, every slot of the cache filled. (B, Hq, Hkv) = (1, 8, 2) and (8, 8, 2) over 131,072 slots (the full
heads of a Qwen3-8B-like layer with 2 full KV heads) and (1, 24, 6) over 2,176 slots (its sink + window ring).
SDPA gets ``q[:, :, None]`` and the first n slots with ``enable_gqa=True``, cuDNN SDPA disabled (with it, torch
builds a cuDNN graph per new key length, ~55 ms). A benchmark round is REPEAT back-to-back eager calls and one
synchronize. ``extra_info`` holds per-call times: ``gpu_ms`` (a CUDA graph of REPEAT calls: GPU time alone) and
``eager_ms`` (events around REPEAT eager calls: host launch overhead included where it exceeds the GPU time), the
achieved bandwidth (bytes of K and V read / gpu_ms) and its fraction of the H100's ~3.35 TB/s. A short cache is
cycled over enough copies (> 2x the 50 MB L2) that K and V come from HBM, as they do layer after layer.

    pytest bench/test_decode_kernel_bench.py --benchmark-only --benchmark-group-by=param:shape

``test_ranged_config_sweep`` times variations of ``KERNEL_CONFIG`` (one knob at a time) for tuning; skip it with
``-k "not sweep"``.
"""

from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")
from flexsparse.kernels import decode  # noqa: E402
from flexsparse.kernels.decode import ranged_decode_attention  # noqa: E402

pytestmark = pytest.mark.gpu

SHAPES = {  # batch, query heads, KV heads, filled slots
    "1x8/2 131072": (1, 8, 2, 131_072),
    "8x8/2 131072": (8, 8, 2, 131_072),
    "1x24/6 2176": (1, 24, 6, 2_176),
}
DIM, REPEAT = 128, 32
HBM_BYTES_PER_S = 3.35e12
L2_BYTES = 50 * 2**20
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


def _report(case: Case, gpu_ms: float) -> dict:
    rate = case.kv_bytes / (gpu_ms * 1e-3)
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
                **_report(case, gpu_ms))
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
            results[key] = _report(case, _per_call_ms(case.runs["ranged"], graph=True))
    finally:
        decode.KERNEL_CONFIG.update(default)
    benchmark.extra_info.update(device=torch.cuda.get_device_name(), shape=case.shape, sweep=results)
    _timed(benchmark, case.runs["ranged"])
