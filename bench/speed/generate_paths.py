"""generate() decode speed of a converted model against transformers' own decode paths, and the bytes-per-token
floor each path could reach.

The model of ``flexsparse bench --hf``'s generate part: 8 Llama layers, hidden 4096, 32 q / 8 KV heads, d=128,
MLP 14336, vocabulary 32000, random bf16 weights, batch 1. For each prompt length (``--seqs``), the median decode
step of a greedy ``generate()`` of ``--tokens`` new tokens (``bench_hf.generate_timed``) for:

- ``sdpa + DynamicCache``: transformers' default; SDPA with cuDNN off (cuDNN builds a graph per new key length);
- ``sdpa + StaticCache + compile``: ``cache_implementation="static"``, which makes ``generate()`` run the decode
  step through ``torch.compile`` (CUDA graphs): transformers' fastest decode;
- ``flexsparse``: ``flexsparse.convert`` with 2 full + 6 sink-128/window-2048 KV heads per layer and its
  ``SparseKVCache``;
- ``flexsparse + CUDA graphs``: the same with ``convert(..., decode_graphs=True)``: each decode step replays a
  CUDA graph of the model's decode forward (``flexsparse.integrations.graph_decode``; CUDA only, skipped with
  ``--smoke``).

The floor of a decode step is the bytes it must read once -- the weights (without the embedding table, of which
a step reads one row) and the KV cache its attention reads (every key of the full heads; sink + window keys of the
sparse heads) -- at the HBM bandwidth measured here (a device-to-device copy of 1 GiB). The table gives each path's
step against its floor: what bounds a path far above its floor is host time (launches, Python), not the GPU.

    PYTHONPATH=. python bench/speed/generate_paths.py --out DIR    # CUDA; ~4 minutes on an H100
    PYTHONPATH=. python bench/speed/generate_paths.py --smoke      # CPU, toy sizes, no compile (checks the script)

Writes ``DIR/generate_paths.json``; prints the table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch

import flexsparse
from flexsparse.tools.bench_hf import SMOKE, HfBenchConfig, generate_timed, llama_from_config

PATHS = ("sdpa + DynamicCache", "sdpa + StaticCache + compile", "flexsparse", "flexsparse + CUDA graphs")
FLEXSPARSE_PATHS = ("flexsparse", "flexsparse + CUDA graphs")


def hbm_bytes_per_s(device: torch.device) -> float | None:
    """Read + write bytes per second of a 1 GiB device-to-device copy (median of 10)."""
    if device.type != "cuda":
        return None
    src = torch.empty(2**30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    times = []
    for _ in range(12):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return 2 * src.numel() / statistics.median(times[2:])


def weight_bytes(model) -> int:
    """Bytes a decode step reads of the weights: every parameter but the input embedding table."""
    embedding = model.get_input_embeddings().weight
    return sum(p.numel() * p.element_size() for p in model.parameters() if p is not embedding)


def kv_read_bytes(cfg: HfBenchConfig, cached: int, sparse: bool) -> int:
    """Bytes of keys and values one decode step's attention reads over all layers."""
    element = torch.empty((), dtype=cfg.torch_dtype).element_size()
    per_key = 2 * cfg.head_dim * element  # a key and a value of one KV head
    if not sparse:
        return cfg.e2e_layers * cfg.kv_heads * cached * per_key
    sparse_keys = min(cached, cfg.sink + cfg.window)
    heads = cfg.full_kv_heads * cached + (cfg.kv_heads - cfg.full_kv_heads) * sparse_keys
    return cfg.e2e_layers * heads * per_key


def run_path(name: str, cfg: HfBenchConfig, model, ids: torch.Tensor, tokens: int, compile_static: bool) -> float:
    """Median decode-step seconds of one path (a warm-up generate first: compiles)."""
    kwargs: dict = {}
    if name == "sdpa + StaticCache + compile":
        kwargs = {"cache_implementation": "static"}
        if not compile_static:
            kwargs["disable_compile"] = True
    if name in FLEXSPARSE_PATHS:
        flexsparse.convert(model, cfg.patterns(), [cfg.modes()] * cfg.e2e_layers, block_size=cfg.block_size,
                           backend=cfg.backend, decode_graphs=name == "flexsparse + CUDA graphs")
    try:
        generate_timed(model, ids, 4, ids.device, **kwargs)  # warm-up: compiles
        return generate_timed(model, ids, tokens, ids.device, **kwargs)[1]
    finally:
        if name in FLEXSPARSE_PATHS:
            flexsparse.revert(model)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seqs", type=int, nargs="+", default=[32768, 131072], help="prompt lengths")
    parser.add_argument("--tokens", type=int, default=32, help="new tokens per timed generate()")
    parser.add_argument("--paths", nargs="+", choices=PATHS, default=list(PATHS), help="which paths to time")
    parser.add_argument("--out", help="folder for generate_paths.json")
    parser.add_argument("--smoke", action="store_true", help="toy sizes on the CPU, no torch.compile")
    args = parser.parse_args(argv)
    cfg = SMOKE if args.smoke else HfBenchConfig()
    seqs = cfg.e2e_seqs if args.smoke else args.seqs  # in the order given
    device = torch.device(cfg.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("generate_paths.py needs a CUDA GPU (or --smoke)", file=sys.stderr)
        return 2
    tokens = 6 if args.smoke else args.tokens
    model = llama_from_config(cfg, cfg.e2e_layers, cfg.e2e_intermediate, cfg.e2e_vocab)
    bandwidth = hbm_bytes_per_s(device)
    weights = weight_bytes(model)
    cudnn = device.type == "cuda" and torch.backends.cuda.cudnn_sdp_enabled()
    rows = []
    for seq in seqs:
        gen = torch.Generator(device=device).manual_seed(seq)
        ids = torch.randint(1, cfg.e2e_vocab, (1, seq), device=device, generator=gen)
        for name in args.paths:
            if name == "flexsparse + CUDA graphs" and device.type != "cuda":
                print(f"{name} at {seq}: skipped (CUDA graphs need a CUDA device)", flush=True)
                continue
            if cudnn:
                torch.backends.cuda.enable_cudnn_sdp(False)
            try:
                step = run_path(name, cfg, model, ids, tokens, compile_static=not args.smoke)
                error = None
            except Exception as err:  # noqa: BLE001 -- one path failing (out of memory, compile) keeps the others
                step, error = None, f"{type(err).__name__}: {err}"[:300]
            finally:
                if cudnn:
                    torch.backends.cuda.enable_cudnn_sdp(True)
                if device.type == "cuda":
                    torch.cuda.empty_cache()
            floor_bytes = weights + kv_read_bytes(cfg, seq + tokens, sparse=name in FLEXSPARSE_PATHS)
            floor_s = floor_bytes / bandwidth if bandwidth else None
            rows.append({"path": name, "seq": seq, "step_ms": None if step is None else step * 1e3,
                         "tokens_per_s": None if step is None else 1 / step, "floor_bytes": floor_bytes,
                         "floor_ms": None if floor_s is None else floor_s * 1e3,
                         "step_over_floor": None if step is None or floor_s is None else step / floor_s,
                         "error": error})
            print(f"{name} at {seq}: " + (f"{step * 1e3:.2f} ms per step" if step else error), flush=True)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"\ngenerate() decode step on {name} (batch 1, {cfg.e2e_layers} layers, hidden "
          f"{cfg.heads * cfg.head_dim}, {cfg.heads}/{cfg.kv_heads} heads, {cfg.dtype}; median of {tokens - 1} "
          f"steps; HBM {bandwidth / 1e12 if bandwidth else float('nan'):.2f} TB/s measured; weights read per step "
          f"{weights / 2**30:.2f} GiB)")
    print(f"{'path':>30} | {'prompt':>7} | {'ms/step':>8} | {'tokens/s':>8} | {'floor ms':>8} | {'x floor':>7}")
    for row in rows:
        cells = [format(row[key], spec) if row[key] is not None else "-" for key, spec in
                 (("step_ms", "8.2f"), ("tokens_per_s", "8.1f"), ("floor_ms", "8.3f"), ("step_over_floor", "7.1f"))]
        print(f"{row['path']:>30} | {row['seq']:>7} | " + " | ".join(cells))
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        path = os.path.join(args.out, "generate_paths.json")
        with open(path, "w") as f:
            json.dump({"device": name, "torch": torch.__version__, "hbm_bytes_per_s": bandwidth,
                       "weight_bytes": weights, "config": {"layers": cfg.e2e_layers, "heads": cfg.heads,
                       "kv_heads": cfg.kv_heads, "head_dim": cfg.head_dim, "tokens": tokens}, "rows": rows},
                      f, indent=1)
        print(f"wrote {path}")
    return 0 if all(row["error"] is None for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
