"""The measured dense-kernel table: loading, lookups by device name and length bucket, the rules that keep cuDNN
out of decode steps and off-grid lengths, and SdpaExecutor running (and pricing) what the table says.

CPU tests fake a CUDA device's name (:func:`device_tables.cuda_device_name`) or its table
(``DENSE_KERNELS.for_device``); outputs are
compared with the float64 reference at fp32 tolerance (2e-5). GPU tests (8K, bf16: |err| <= 3e-2 on outputs and
6e-2 on gradients, relative to the largest magnitude, as tests/test_gpu.py) check every SDPA backend against
SDPA's default choice and that a decode call on the GPU runs with cuDNN off.
"""

import json

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

from flexsparse.masks import Causal, Geometry
from flexsparse.reference import attention as reference
from flexsparse.runtime import device_tables
from flexsparse.runtime.buckets import is_kv_bucket
from flexsparse.runtime.call import AttentionCall, GroupModes, HeadSelection
from flexsparse.runtime.cost import DENSE_FLOPS_PER_S, attention_flops, causal_pairs
from flexsparse.runtime.dense_kernels import (
    DENSE_KERNELS,
    PASSES,
    SDPA_BACKENDS,
    DenseKernel,
    dense_backend,
    dense_kernel,
    sdpa_backend_order,
)
from flexsparse.runtime.executors import SdpaExecutor

ATOL = 2e-5
CUDA0 = torch.device("cuda", 0)
NAMES = {0: "NVIDIA H100 80GB HBM3", 1: "NVIDIA H100 PCIe", 2: "NVIDIA A100-SXM4-80GB", 3: "NVIDIA H200"}


def rows(**by_pass_and_length):
    """Table rows from keyword ``forward_8192=(["cudnn", "flash"], {"cudnn": 600})``."""
    out = []
    for key, (backends, tflops) in by_pass_and_length.items():
        pass_name, length = key.rsplit("_", 1)
        out.append({"pass": pass_name, "length": int(length), "backends": backends, "tflops": tflops})
    return out


TABLE = {"devices": {
    "H100": {"dtype": "bfloat16", "measured": None, "entries": rows(
        forward_8192=(["cudnn", "flash"], {"cudnn": 500.0, "flash": 400.0}),
        forward_32768=(["flash", "cudnn"], {"flash": 450.0}),
        forward_backward_8192=(["efficient", "cudnn", "flash"], {}))},
    "H100 PCIe": {"dtype": "bfloat16", "measured": None, "entries": rows(forward_8192=(["math"], {}))},
}}


@pytest.fixture
def table(tmp_path, monkeypatch):
    """TABLE written to a file, loaded as the process's table; device names faked by index."""
    path = tmp_path / "dense_kernels.json"
    path.write_text(json.dumps(TABLE))
    monkeypatch.setattr(DENSE_KERNELS, "devices", DENSE_KERNELS.load(path))
    monkeypatch.setattr(device_tables, "cuda_device_name", NAMES.__getitem__)
    return DENSE_KERNELS.devices


def test_shipped_table_holds_the_h100_measurement_for_both_passes():
    table = DENSE_KERNELS.load()
    assert table == DENSE_KERNELS.devices
    assert set(table) == {"H100"}  # measured devices only: others run SDPA's own choice
    kernels = table["H100"]
    assert kernels.dtype == torch.bfloat16
    for pass_name in PASSES:
        assert kernels.series[pass_name,].lengths == (8192, 16384, 32768, 65536, 131072)
    assert all(set(r.backends) <= {*SDPA_BACKENDS, "fa4"} for r in kernels.rows.values())
    # FlashAttention-4 first (1.0-1.22x cuDNN), then cuDNN (1.7-2.1x flash on the H100)
    assert all(r.backends[:2] == ("fa4", "cudnn") for r in kernels.rows.values())


def test_lookup_by_device_name_and_nearest_measured_length(table):
    assert dense_kernel(CUDA0, 8192, 8192, False) == DenseKernel("cudnn", 500e12)
    assert dense_backend(CUDA0, 32768, 32768, False) == "flash"
    assert dense_kernel(CUDA0, 32768, 32768, False).flops_per_s == 450e12
    assert dense_backend(CUDA0, 4096, 4096, False) == "cudnn"  # below the table: its shortest row
    assert dense_backend(CUDA0, 1 << 20, 1 << 20, False) == "flash"  # above: its longest
    assert dense_backend(CUDA0, 16384, 16384, False) == "cudnn"  # halfway in log scale: the shorter row
    assert dense_backend(CUDA0, 32768, 32768, True) == "efficient"  # the forward+backward rows
    assert dense_kernel(CUDA0, 8192, 8192, True).flops_per_s is None  # not measured
    assert dense_backend(torch.device("cuda", 1), 8192, 8192, False) == "math"  # the longest matching key


def test_unknown_devices_dtypes_and_the_cpu_get_no_forced_backend(table):
    assert dense_kernel(torch.device("cuda", 2), 8192, 8192, False) is None  # A100: no key
    assert dense_kernel(torch.device("cuda", 3), 8192, 8192, False) is None  # H200: not in this table
    assert dense_kernel(CUDA0, 8192, 8192, False, dtype=torch.float16) is None
    assert dense_kernel(torch.device("cpu"), 8192, 8192, False) is None


@given(q_len=st.integers(1, 1 << 17), kv_len=st.integers(1, 1 << 17), grad=st.booleans(),
       block_size=st.sampled_from([16, 64, 128, 100]))
def test_decode_and_off_grid_lengths_never_get_cudnn(q_len, kv_len, grad, block_size):
    """Fewer queries than keys (decode steps, chunks): no forced backend; cuDNN only at bucketed lengths."""
    with pytest.MonkeyPatch.context() as patch:
        cudnn_first = {"devices": {"H100": {"dtype": "bfloat16", "entries": rows(
            forward_8192=(["cudnn", "flash"], {}), forward_backward_8192=(["cudnn", "efficient"], {}))}}}
        patch.setattr(DENSE_KERNELS, "devices", {
            "H100": DENSE_KERNELS.device_from_json(cudnn_first["devices"]["H100"])})
        patch.setattr(device_tables, "cuda_device_name", NAMES.__getitem__)
        kv_len = max(kv_len, q_len)
        backend = dense_backend(CUDA0, q_len, kv_len, grad, block_size=block_size)
    if q_len != kv_len:
        assert backend is None
    elif is_kv_bucket(kv_len, block_size):
        assert backend == "cudnn"
    else:
        assert backend == ("efficient" if grad else "flash")


def test_backend_order_puts_the_choice_first_and_cudnn_only_when_chosen():
    assert sdpa_backend_order("cudnn")[0] == SDPA_BACKENDS["cudnn"]
    for name in ("flash", "efficient", "math"):
        order = sdpa_backend_order(name)
        assert order[0] == SDPA_BACKENDS[name] and SDPA_BACKENDS["cudnn"] not in order
        assert set(order) == {SDPA_BACKENDS[b] for b in ("flash", "efficient", "math")}
    with pytest.raises(ValueError, match="backend must be one of"):
        sdpa_backend_order("fa4")


@pytest.mark.parametrize("change,message", [
    (lambda d: d.update(devices=[]), "'devices' object"),
    (lambda d: d["devices"]["H100"].update(dtype="float99"), "'dtype' must name a torch dtype"),
    (lambda d: d["devices"]["H100"]["entries"][0].update({"pass": "backward"}), "'pass' must be one of"),
    (lambda d: d["devices"]["H100"]["entries"][0].update(length=0), "'length' must be a positive integer"),
    (lambda d: d["devices"]["H100"]["entries"][0].update(backends=["fa5"]), "'backends' must be a non-empty"),
    (lambda d: d["devices"]["H100"]["entries"][0].update(backends=["fa4"], tflops={}), "one SDPA backend"),
    (lambda d: d["devices"]["H100"]["entries"][0].update(backends=["flash", "flash"]), "distinct"),
    (lambda d: d["devices"]["H100"]["entries"][0].update(backends=["cudnn"], tflops={}), "besides"),
    (lambda d: d["devices"]["H100"]["entries"][0].update(tflops={"math": 1.0}), "'tflops' must map"),
    (lambda d: d["devices"]["H100"]["entries"][0].update(tflops={"cudnn": -1}), "'tflops' must map"),
    (lambda d: d["devices"]["H100"]["entries"].append(d["devices"]["H100"]["entries"][0]), "a second row"),
])
def test_a_malformed_table_names_the_file_and_the_field(tmp_path, change, message):
    data = json.loads(json.dumps(TABLE))
    change(data)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=message) as err:
        DENSE_KERNELS.load(path)
    assert str(path) in str(err.value)


def test_an_unreadable_table_is_a_value_error(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text("{not json")
    with pytest.raises(ValueError, match="cannot be read as JSON"):
        DENSE_KERNELS.load(path)


# ----- SdpaExecutor ------------------------------------------------------------------------------------------

def sdpa_flags():
    return {"flash": torch.backends.cuda.flash_sdp_enabled(), "cudnn": torch.backends.cuda.cudnn_sdp_enabled(),
            "efficient": torch.backends.cuda.mem_efficient_sdp_enabled(),
            "math": torch.backends.cuda.math_sdp_enabled()}


@pytest.fixture
def seen_flags(monkeypatch):
    """The SDPA backend flags at each scaled_dot_product_attention call."""
    seen, sdpa = [], F.scaled_dot_product_attention

    def spy(*args, **kwargs):
        seen.append(sdpa_flags())
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    return seen


def run_executor(q_len, kv_len, block_size=16, grad=False, heads=4, kv_heads=2, seed=0):
    """SdpaExecutor on every head of a full causal layer; returns (output, float64 reference, call)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, heads, q_len, 8, generator=g, requires_grad=grad)
    k, v = (torch.randn(1, kv_heads, kv_len, 8, generator=g, requires_grad=grad) for _ in range(2))
    call = AttentionCall(q, k, v, 8**-0.5, Geometry(heads, q_len, kv_len, block_size), needs_grad=grad,
                         kv_heads=tuple(range(kv_heads)))
    modes = GroupModes(torch.zeros(1, heads, dtype=torch.long), (0,) * kv_heads)
    out = SdpaExecutor().run(call, [Causal()], modes, HeadSelection.of(call.kv_heads, call, kv_heads))
    expected = reference(q.detach(), k.detach(), v.detach(), Causal().dense(call.geometry), scale=8**-0.5)
    return out, expected, call


@pytest.fixture
def cpu_as_h100(monkeypatch):
    """The CPU looked up as an H100 whose fp32 rows say ``backend`` (set on the returned dict)."""
    choice = {"forward": ["math", "flash"], "forward_backward": ["flash", "math"], "tflops": {}}

    def kernels(device):
        entries = [{"pass": p, "length": 64, "backends": choice[p],
                    "tflops": {b: t for b, t in choice["tflops"].items() if b in choice[p]}} for p in PASSES]
        return DENSE_KERNELS.device_from_json({"dtype": "float32", "entries": entries})

    monkeypatch.setattr(DENSE_KERNELS, "for_device", kernels)
    return choice


def test_cpu_runs_sdpa_as_before(seen_flags):
    """No table on the CPU: SDPA's own choice, flags untouched, the reference's output."""
    defaults = sdpa_flags()
    for q_len, kv_len in ((32, 32), (5, 32), (1, 32)):
        out, expected, _ = run_executor(q_len, kv_len)
        torch.testing.assert_close(out, expected.float(), atol=ATOL, rtol=0)
    assert seen_flags == [defaults] * 3


@pytest.mark.parametrize("forward", [["math", "flash"], ["flash", "math"], ["cudnn", "math"]])
def test_forced_backend_output_equals_the_reference(cpu_as_h100, seen_flags, forward):
    """Prefill runs with the table's backend first (cuDNN enabled only when chosen, on the grid); the output is the
    dense reference's. On the CPU the fused kernel or math serves whatever is first."""
    cpu_as_h100["forward"] = forward
    out, expected, _ = run_executor(64, 64)
    torch.testing.assert_close(out, expected.float(), atol=ATOL, rtol=0)
    assert seen_flags[-1]["cudnn"] == (forward[0] == "cudnn")
    assert seen_flags[-1][forward[0]]
    seen_flags.clear()
    out, expected, _ = run_executor(48, 48)  # off the grid (16 x 3): never cuDNN
    torch.testing.assert_close(out, expected.float(), atol=ATOL, rtol=0)
    assert not seen_flags[-1]["cudnn"]


def test_forced_backend_backward_matches_the_reference(cpu_as_h100):
    out, _, call = run_executor(64, 64, grad=True)
    grad_out = torch.randn_like(out)
    out.backward(grad_out)
    q, k, v = (t.detach().double().requires_grad_() for t in (call.q, call.k, call.v))
    reference(q, k, v, Causal().dense(call.geometry), scale=8**-0.5).backward(grad_out.double())
    for name, a, b in (("dq", call.q, q), ("dk", call.k, k), ("dv", call.v, v)):
        torch.testing.assert_close(a.grad, b.grad.float(), atol=1e-4, rtol=0, msg=name)


def test_decode_and_chunks_keep_sdpa_default_flags(cpu_as_h100, seen_flags):
    """Calls with fewer queries than keys get no forced backend (their masked path keeps cuDNN out on CUDA)."""
    defaults = sdpa_flags()
    for q_len in (1, 7):
        out, expected, _ = run_executor(q_len, 64)
        torch.testing.assert_close(out, expected.float(), atol=ATOL, rtol=0)
    assert seen_flags == [defaults] * 2


def test_cost_uses_the_measured_throughput(cpu_as_h100):
    _, _, prefill = run_executor(64, 64)
    _, _, decode = run_executor(1, 64)
    flops = lambda call: attention_flops(call, 2, causal_pairs(call))
    executor = SdpaExecutor()
    assert executor.cost([Causal()] * 2, prefill) == pytest.approx(flops(prefill) / DENSE_FLOPS_PER_S)
    cpu_as_h100["tflops"] = {"math": 300.0, "flash": 200.0}
    assert executor.cost([Causal()] * 2, prefill) == pytest.approx(flops(prefill) / 300e12)
    assert executor.cost([Causal()] * 2, decode) == pytest.approx(flops(decode) / DENSE_FLOPS_PER_S)


# ----- GPU ---------------------------------------------------------------------------------------------------

def gpu_inputs(seq, grad, heads=32, kv_heads=8, dim=128):
    gen = torch.Generator(device="cuda").manual_seed(0)
    make = lambda h: torch.randn(1, h, seq, dim, device="cuda", dtype=torch.bfloat16, generator=gen)
    return tuple(make(h).requires_grad_(grad) for h in (heads, kv_heads, kv_heads))


def assert_near(actual, expected, tol, what):
    scale = expected.abs().max().item()
    err = (actual.double() - expected.double()).abs().max().item()
    assert err <= tol * max(scale, 1.0), f"{what}: max error {err:.3g} (reference scale {scale:.3g})"


@pytest.mark.gpu
@pytest.mark.parametrize("backend", [b for b in SDPA_BACKENDS if b != "math"])
def test_every_sdpa_backend_matches_sdpa_default_at_8k(backend):
    """Causal GQA at 8K in bf16, forward and backward: the backend alone (GQA natively, else on repeated K/V)
    against SDPA's default choice."""
    q, k, v = gpu_inputs(8192, grad=True)
    grad_out = torch.randn_like(q)
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    expected_grads = torch.autograd.grad(expected, (q, k, v), grad_out)
    try:
        with torch.nn.attention.sdpa_kernel([SDPA_BACKENDS[backend]]):
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    except RuntimeError:  # refuses enable_gqa: on K/V repeated to the query heads
        with torch.nn.attention.sdpa_kernel([SDPA_BACKENDS[backend]]):
            try:
                out = F.scaled_dot_product_attention(q, k.repeat_interleave(4, 1), v.repeat_interleave(4, 1),
                                                     is_causal=True)
            except RuntimeError as err:
                pytest.skip(f"{backend} does not run here: {err}")
    grads = torch.autograd.grad(out, (q, k, v), grad_out)
    assert_near(out, expected, 3e-2, "output")
    for name, a, b in zip(("dq", "dk", "dv"), grads, expected_grads):
        assert_near(a, b, 6e-2, name)


@pytest.mark.gpu
def test_gpu_executor_prefill_matches_default_and_decode_runs_without_cudnn(seen_flags):
    q, k, v = gpu_inputs(8192, grad=False)
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    for q_len in (8192, 1):
        call = AttentionCall(q[:, :, -q_len:], k, v, 128**-0.5, Geometry(32, q_len, 8192, device="cuda"),
                             needs_grad=False, kv_heads=tuple(range(8)))
        modes = GroupModes(torch.zeros(1, 32, dtype=torch.long, device="cuda"), (0,) * 8)
        out = SdpaExecutor().run(call, [Causal()], modes, HeadSelection.of(call.kv_heads, call, 8))
        assert_near(out, expected[:, :, -q_len:], 3e-2, f"q_len {q_len}")
    backend = dense_backend(q.device, 8192, 8192, False)
    if backend is not None:
        assert seen_flags[-2][backend]
    assert not seen_flags[-1]["cudnn"]  # the decode call
