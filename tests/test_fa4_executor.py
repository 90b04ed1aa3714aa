"""FlashAttention-4 as the full heads' executor: the dense-kernel table ranks ``fa4`` beside SDPA's backends, the
planner gives full heads of a contiguous prefill to it only where the table measured it faster and it is
installed, and its run converts layouts and GQA heads right.

CPU tests fake the device's table (``DENSE_KERNELS.for_device``), the extra's presence
(:func:`fa4_executor.fa4_runs_on`) and FlashAttention-4 itself (SDPA in its ``[B, S, H, d]`` layout). The GPU
test runs the real kernel where the ``fast`` extra is installed (bf16 at 8K against SDPA: |err| <= 3e-2 on outputs,
6e-2 on gradients, relative to the largest magnitude, as tests/test_dense_kernels.py).
"""

import pytest
import torch
import torch.nn.functional as F

from flexsparse.masks import Causal, Geometry, SinkWindow
from flexsparse.reference import attention as reference
from flexsparse.runtime import fa4_executor
from flexsparse.runtime.call import AttentionCall, GroupModes, HeadSelection
from flexsparse.runtime.dense_kernels import DENSE_KERNELS, PASSES, dense_kernel, kernel_rate
from flexsparse.runtime.executors import SdpaExecutor
from flexsparse.runtime.fa4_executor import Fa4Executor
from flexsparse.runtime.flex import FlexExecutor
from flexsparse.runtime.plan import Planner
from flexsparse.runtime.registry import registered_executors

CPU = torch.device("cpu")


def fake_fa4(q, k, v, softmax_scale=None, causal=False):
    """FlashAttention-4's call, [B, S, H, d] in and out, by SDPA."""
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal,
                                         scale=softmax_scale, enable_gqa=True)
    return out.transpose(1, 2), None


@pytest.fixture
def cpu_table(monkeypatch):
    """The CPU as a device whose bf16 rows (length 64) rank ``order`` with ``tflops``, FlashAttention-4 present."""
    setting = {"order": ["fa4", "cudnn", "flash"], "tflops": {"fa4": 700.0, "cudnn": 550.0, "flash": 300.0}}

    def kernels(device):
        entries = [{"pass": p, "length": 64, "backends": setting["order"], "tflops": setting["tflops"]}
                   for p in PASSES]
        return DENSE_KERNELS.device_from_json({"dtype": "bfloat16", "entries": entries})

    monkeypatch.setattr(DENSE_KERNELS, "for_device", kernels)
    monkeypatch.setattr(fa4_executor, "fa4_runs_on", lambda device: setting.get("installed", True))
    monkeypatch.setattr(fa4_executor, "fa4_attention", lambda: fake_fa4)
    return setting


def make_call(q_len=64, kv_len=64, heads=8, kv_heads=2, dim=16, dtype=torch.bfloat16, grad=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, heads, q_len, dim, generator=g).to(dtype).requires_grad_(grad)
    k, v = (torch.randn(1, kv_heads, kv_len, dim, generator=g).to(dtype).requires_grad_(grad) for _ in range(2))
    return AttentionCall(q, k, v, dim**-0.5, Geometry(heads, q_len, kv_len, 16), needs_grad=grad,
                         kv_heads=tuple(range(kv_heads)))


def planned_call(q_len=32768, kv_len=32768, dtype=torch.bfloat16):
    """A call of the benchmark's size (8 query / 2 KV heads, d=128) to plan, not run (its tensors are empty)."""
    q = torch.empty(1, 8, q_len, 128, dtype=dtype)
    k, v = (torch.empty(1, 2, kv_len, 128, dtype=dtype) for _ in range(2))
    return AttentionCall(q, k, v, 128**-0.5, Geometry(8, q_len, kv_len, 128), needs_grad=False, kv_heads=(0, 1))


def test_the_table_ranks_fa4_beside_sdpas_backends(cpu_table):
    """SDPA's executor still gets an SDPA backend from a row that ranks fa4 first; fa4's rate is its own."""
    assert dense_kernel(CPU, 64, 64, False, block_size=16).backend == "cudnn"
    assert dense_kernel(CPU, 64, 64, False).backend == "flash"  # off the 128-grid: no cuDNN
    assert kernel_rate("fa4", CPU, 64, 64, False) == 700e12
    assert kernel_rate("fa4", CPU, 1, 64, False) is None  # decode: no row
    with pytest.raises(ValueError, match="one SDPA backend besides"):
        DENSE_KERNELS.device_from_json({"dtype": "bfloat16", "entries": [
            {"pass": "forward", "length": 64, "backends": ["fa4", "cudnn"], "tflops": {}}]})
    with pytest.raises(ValueError, match="'backends' must be"):
        DENSE_KERNELS.device_from_json({"dtype": "bfloat16", "entries": [
            {"pass": "forward", "length": 64, "backends": ["fa5", "flash"], "tflops": {}}]})


def owners(call, modes):
    patterns = [Causal(), SinkWindow(4, 8)]
    executors = [*registered_executors(), FlexExecutor(patterns, compiled=False)]
    groups = Planner("split", patterns, len(modes), executors).groups(call, modes)
    return {group.executor.name: [call.kv_heads[i] for i in group.heads.kv_heads] for group in groups}


def test_the_planner_gives_full_heads_to_fa4_only_where_it_measured_faster_and_runs(cpu_table):
    # a full KV head at 32K is ~1.1 TFLOP: 700 against 550 TFLOP/s saves 0.43 ms, more than a launch (50 us)
    assert owners(planned_call(), (0, 1)) == {"fa4": [0], "flex_eager": [1]}
    cpu_table["tflops"] = {"fa4": 551.0, "cudnn": 550.0}  # faster by less than a launch: SDPA keeps them
    assert owners(planned_call(), (0, 1)) == {"sdpa": [0], "flex_eager": [1]}
    cpu_table["tflops"] = {"fa4": 700.0, "cudnn": 550.0}
    cpu_table["installed"] = False
    assert owners(planned_call(), (0, 1)) == {"sdpa": [0], "flex_eager": [1]}
    cpu_table["installed"] = True
    assert "fa4" not in owners(planned_call(q_len=64), (0, 1))  # a chunk: SDPA's masked path or flex
    assert "fa4" not in owners(planned_call(dtype=torch.float32), (0, 1))  # 16-bit floats only


@pytest.mark.parametrize("grad", [False, True])
def test_run_converts_layouts_and_picks_the_selected_heads(cpu_table, grad):
    call = make_call(dtype=torch.float32, grad=grad, kv_heads=4)
    selection = HeadSelection.of((1, 3), call, 4)
    modes = GroupModes(torch.zeros(1, 8, dtype=torch.long), (0,) * 4)
    out = Fa4Executor().run(call, [Causal()], modes, selection)
    expected = SdpaExecutor().run(call, [Causal()], modes, selection)
    assert out.shape == expected.shape == (1, 4, 64, 16)
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=0)
    q, k, v = (t.detach().double() for t in (call.q, call.k, call.v))
    dense = reference(q[:, 2:4], k[:, 1:2], v[:, 1:2], Causal().dense(Geometry(2, 64, 64, 16)), scale=16**-0.5)
    torch.testing.assert_close(out[:, :2].double(), dense, atol=2e-5, rtol=0)  # query heads 2-3: KV head 1
    if grad:
        out.sum().backward()
        assert call.k.grad[:, [0, 2]].abs().max() == 0 and call.k.grad[:, [1, 3]].abs().max() > 0


@pytest.mark.gpu
def test_gpu_fa4_matches_sdpa_forward_and_backward():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    if fa4_executor.fa4_attention() is None:
        pytest.skip("FlashAttention-4 is not installed (the fast extra)")
    gen = torch.Generator(device="cuda").manual_seed(0)
    make = lambda h: torch.randn(1, h, 8192, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
    q, k, v = make(32).requires_grad_(), make(8).requires_grad_(), make(8).requires_grad_()
    call = AttentionCall(q, k, v, 128**-0.5, Geometry(32, 8192, 8192, 128, "cuda"), needs_grad=True,
                         kv_heads=tuple(range(8)))
    modes = GroupModes(torch.zeros(1, 32, dtype=torch.long, device="cuda"), (0,) * 8)
    heads = HeadSelection.of(tuple(range(8)), call, 8)
    grad_out = torch.randn_like(q)
    results = []
    for executor in (Fa4Executor(), SdpaExecutor()):
        out = executor.run(call, [Causal()], modes, heads)
        results.append((out.detach(), *torch.autograd.grad(out, (q, k, v), grad_out)))
    for name, a, b, tol in zip(("out", "dq", "dk", "dv"), results[0], results[1], (3e-2, 6e-2, 6e-2, 6e-2)):
        scale = b.abs().max().item()
        assert (a.double() - b.double()).abs().max().item() <= tol * max(scale, 1.0), name


@pytest.mark.gpu
def test_gpu_hybrid_on_fa4_and_flex_flash_matches_the_default_layer():
    """The fastest hybrid layer measured (full heads on FlashAttention-4, sink+window heads on flex's FLASH
    backend) gives the default layer's outputs and gradients (bf16, 8K)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    if fa4_executor.fa4_attention() is None:
        pytest.skip("FlashAttention-4 is not installed (the fast extra)")
    from flexsparse import HybridAttention

    patterns, modes = {"full": Causal(), "ssa": SinkWindow(128, 2048)}, ["full"] * 2 + ["ssa"] * 6
    gen = torch.Generator(device="cuda").manual_seed(0)
    make = lambda h: torch.randn(1, h, 8192, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
    q, k, v = make(32).requires_grad_(), make(8).requires_grad_(), make(8).requires_grad_()
    grad_out = torch.randn_like(q)
    results = []
    for options in ({"BACKEND": "FLASH"}, None):
        layer = HybridAttention(32, 8, 128, patterns, modes, backend="flex", plan="split", kernel_options=options)
        out = layer(q, k, v)
        results.append((out.detach(), *torch.autograd.grad(out, (q, k, v), grad_out)))
    for name, a, b, tol in zip(("out", "dq", "dk", "dv"), results[0], results[1], (3e-2, 6e-2, 6e-2, 6e-2)):
        scale = b.abs().max().item()
        assert (a.double() - b.double()).abs().max().item() <= tol * max(scale, 1.0), name
