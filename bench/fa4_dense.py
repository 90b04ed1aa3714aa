"""The full heads' dense causal attention on every kernel at hand: SDPA's cuDNN and flash backends, FlashAttention-4
(CuTe DSL, ``flash_attn.cute.flash_attn_func``) and FlexAttention's FLASH backend (``kernel_options={"BACKEND":
"FLASH"}``, which runs FlashAttention-4's kernels), forward and forward+backward, GPU.

Shape: the full heads of the hybrid rho=0.75 layer of ``flexsparse bench`` (2 of 8 KV heads: 8 query / 2 KV heads,
d=128, bf16, B=1), causal. TFLOP/s count the causal half of ``4 S^2 H d`` (forward) and 2.5x that (forward +
backward). Each kernel's output is checked against cuDNN's (max |difference| <= 2e-2).

FlashAttention-4 is not a flexsparse dependency; on a machine without internet its wheels travel in parts and are
installed into a folder added with ``site.addsitedir`` (its CuTe DSL finds its ``cutlass`` module through a .pth
file, which PYTHONPATH does not read):

    pip install --no-deps --no-index --target /tmp/fa4-site WHEELS...     # flash-attn-4 4.0.0b36, nvidia-cutlass-dsl
                                                                           # (+ libs-base, libs-core, libs-cu13),
                                                                           # quack-kernels, apache-tvm-ffi,
                                                                           # torch-c-dlpack-ext, cuda-bindings,
                                                                           # cuda-pathfinder, einops
    PYTHONPATH=. python bench/fa4_dense.py --site /tmp/fa4-site --out DIR

writes DIR/fa4_dense.json and prints the table. A kernel that fails is reported with its error, not skipped.
"""

from __future__ import annotations

import argparse
import json
import site
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from flexsparse.tools.bench import cuda_time_ms

HEADS, KV_HEADS, DIM = 8, 2, 128


def sdpa(backend):
    def run(q, k, v):  # [B, H, S, d]
        with sdpa_kernel([backend]):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    return run


def fa4():
    from flash_attn.cute import flash_attn_func

    def run(q, k, v):
        out = flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=True)
        out = out[0] if isinstance(out, tuple) else out
        return out.transpose(1, 2)
    return run


def flex_flash(length: int):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    causal = create_block_mask(lambda b, h, q, kv: q >= kv, None, None, length, length, device="cuda")
    compiled = torch.compile(flex_attention, dynamic=False)

    def run(q, k, v):
        return compiled(q, k, v, block_mask=causal, enable_gqa=True, kernel_options={"BACKEND": "FLASH"})
    return run


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--site", default=None, help="folder FlashAttention-4 is installed in (site.addsitedir)")
    parser.add_argument("--lengths", type=int, nargs="+", default=[8192, 32768, 131072])
    parser.add_argument("--backward-lengths", type=int, nargs="+", default=[8192, 32768, 131072])
    parser.add_argument("--out", default="bench/results/fa4-dense")
    args = parser.parse_args()
    if args.site:
        site.addsitedir(args.site)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    rows = []
    for length in args.lengths:
        q = torch.randn(1, HEADS, length, DIM, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(1, KV_HEADS, length, DIM, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(1, KV_HEADS, length, DIM, device="cuda", dtype=torch.bfloat16)
        flops = 2 * HEADS * DIM * length * length  # causal half of 4 S^2 H d
        kernels = {"sdpa cudnn": lambda: sdpa(SDPBackend.CUDNN_ATTENTION),
                   "sdpa flash": lambda: sdpa(SDPBackend.FLASH_ATTENTION),
                   "fa4": fa4, "flex FLASH": lambda: flex_flash(length)}
        reference = sdpa(SDPBackend.CUDNN_ATTENTION)(q, k, v)
        for name, make in kernels.items():
            for backward in (False, True):
                if backward and length not in args.backward_lengths:
                    continue
                row = {"kernel": name, "length": length, "pass": "forward_backward" if backward else "forward"}
                began = time.perf_counter()
                try:
                    run = make()
                    if backward:
                        qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
                        grad = torch.randn_like(q)

                        def step():
                            run(qg, kg, vg).backward(grad)
                    else:
                        with torch.no_grad():
                            error = float((run(q, k, v).float() - reference.float()).abs().max())
                        row["max_error_vs_cudnn"] = error

                        def step():
                            with torch.no_grad():
                                run(q, k, v)
                    ms = cuda_time_ms(step)
                    row.update(ms=ms, tflops=flops * (2.5 if backward else 1.0) / ms / 1e9)
                except Exception as err:  # reported, not hidden: the point is which kernels run here
                    row["error"] = f"{type(err).__name__}: {err}"[:400]
                    traceback.print_exc(limit=2)
                row["seconds"] = time.perf_counter() - began
                rows.append(row)
                print(json.dumps(row), flush=True)
                (out / "fa4_dense.json").write_text(json.dumps(
                    {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                     "shape": {"heads": HEADS, "kv_heads": KV_HEADS, "dim": DIM}, "rows": rows}, indent=1) + "\n")
        del q, k, v, reference
        torch.cuda.empty_cache()
    print(f"\n{'kernel':<12} {'length':>7} {'pass':<17} {'ms':>9} {'TFLOP/s':>8}")
    for row in rows:
        text = row.get("error", "")[:60] or f"{row['ms']:9.3f} {row['tflops']:8.1f}"
        print(f"{row['kernel']:<12} {row['length']:>7} {row['pass']:<17} {text}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
