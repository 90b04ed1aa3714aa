"""flexsparse.kernels.launch.CompiledLaunch: a Triton kernel launched with fixed non-tensor arguments.

On CPU it runs under the Triton interpreter (every call through Triton's own launch path); on CUDA the test
counts Triton's launch path: the first aligned call only, then the compiled kernel directly; a misaligned tensor
goes through Triton again."""

import pytest
import torch

from tests.kernel_markers import DEVICE, INTERPRETED, kernel_test

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

from flexsparse.kernels.launch import CompiledLaunch  # noqa: E402


@triton.jit
def _scaled_copy(src, dst, n, scale, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(dst + offs, tl.load(src + offs, mask=offs < n) * scale, mask=offs < n)


@triton.jit
def _constexpr_first(BLOCK: tl.constexpr, src):
    pass


@kernel_test
def test_launches_equal_the_kernel_call():
    src = torch.arange(100, dtype=torch.float32, device=DEVICE)
    launch = CompiledLaunch(_scaled_copy, (4,), (100, 0.5), dict(BLOCK=32), dict(num_warps=1))
    for _ in range(3):
        dst = torch.zeros_like(src)
        launch(src, dst)
        torch.testing.assert_close(dst, src * 0.5)


def test_refuses_kernels_it_cannot_hold_fixed():
    if INTERPRETED:
        pytest.skip("the interpreter's kernels do not describe their parameters: nothing is checked")
    with pytest.raises(ValueError, match="constexpr parameters must come after"):
        CompiledLaunch(_constexpr_first, (1,), (), dict(BLOCK=16), {})
    with pytest.raises(ValueError, match="constexprs must name"):
        CompiledLaunch(_scaled_copy, (1,), (1, 1.0), dict(SIZE=16), {})


@pytest.mark.gpu
def test_gpu_direct_launch_after_the_first_and_triton_for_misaligned(monkeypatch):
    runs = []
    original = _scaled_copy.run
    monkeypatch.setattr(_scaled_copy, "run", lambda *a, **k: runs.append(1) or original(*a, **k))
    src = torch.arange(1001, dtype=torch.float32, device="cuda")
    launch = CompiledLaunch(_scaled_copy, (8,), (1000, 2.0), dict(BLOCK=128), dict(num_warps=4))
    for _ in range(3):
        dst = torch.zeros(1000, device="cuda")
        launch(src[:1000], dst)
        torch.testing.assert_close(dst, src[:1000] * 2)
    assert len(runs) == 1
    dst = torch.zeros(1000, device="cuda")
    launch(src[1:], dst)  # 4 bytes past a 16-byte boundary: another specialization
    torch.testing.assert_close(dst, src[1:] * 2)
    assert len(runs) == 2
