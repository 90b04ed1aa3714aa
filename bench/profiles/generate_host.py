"""Where a ``generate()`` decode step of a converted model spends its host time, against the model's own SDPA
(flash, cuDNN off: cuDNN builds a graph per new key length) on the same prompt. The model of ``flexsparse bench
--hf``'s generate part (8 Llama layers, hidden 4096, 32 q / 8 KV heads, random bf16 weights; flexsparse: 2 full +
6 sink-128/window-2048 KV heads per layer). For each setting: the median decode step, then the Python lines that
synchronise the host with the GPU during decode steps (``torch.cuda.set_sync_debug_mode("warn")``: each
synchronising call's line, counted), then a cProfile of the decode steps (top functions by own time). Run on a
CUDA GPU:

    PYTHONPATH=. python bench/profiles/generate_host.py [--seq 8192] [--tokens 16]
"""

import argparse
import collections
import cProfile
import pstats
import sys
import warnings

import torch

from flexsparse import convert, revert
from flexsparse.tools.bench_hf import HfBenchConfig, generate_timed, llama_from_config


def sync_lines(model, ids: torch.Tensor, tokens: int) -> collections.Counter:
    """(file:line of the call that synchronised) -> count, over a generate() of ``tokens`` tokens."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=tokens, min_new_tokens=tokens,
                           do_sample=False)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return collections.Counter(f"{w.filename}:{w.lineno}" for w in caught
                               if "synchroniz" in str(w.message).lower())


def profile(model, ids: torch.Tensor, tokens: int, rows: int) -> None:
    profiler = cProfile.Profile()
    profiler.enable()
    model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=tokens, min_new_tokens=tokens,
                   do_sample=False)
    profiler.disable()
    stats = pstats.Stats(profiler, stream=sys.stdout)
    stats.sort_stats("tottime").print_stats(rows)
    stats.sort_stats("cumulative").print_stats(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq", type=int, default=8192, help="prompt tokens")
    parser.add_argument("--tokens", type=int, default=16, help="new tokens of the timed and profiled generate()")
    parser.add_argument("--rows", type=int, default=30, help="functions shown per profile table")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench/profiles/generate_host.py needs a CUDA GPU", file=sys.stderr)
        return 2
    cfg = HfBenchConfig(e2e_seqs=[args.seq])
    model = llama_from_config(cfg, cfg.e2e_layers, cfg.e2e_intermediate, cfg.e2e_vocab)
    gen = torch.Generator(device="cuda").manual_seed(0)
    ids = torch.randint(1, cfg.e2e_vocab, (1, args.seq), device="cuda", generator=gen)
    device = torch.device("cuda")
    for name in ("sdpa (flash)", "flexsparse"):
        if name == "flexsparse":
            convert(model, cfg.patterns(), [cfg.modes()] * cfg.e2e_layers, block_size=cfg.block_size,
                    backend=cfg.backend)
        torch.backends.cuda.enable_cudnn_sdp(False)
        try:
            generate_timed(model, ids, 3, device)  # warm-up (compiles flex at this length)
            _, step_s, _ = generate_timed(model, ids, args.tokens, device)
            print(f"\n===== {name}: {step_s * 1e3:.2f} ms per decode step (median of {args.tokens - 1})", flush=True)
            print("synchronising lines during generate():")
            for line, count in sync_lines(model, ids, args.tokens).most_common(20):
                print(f"  {count:5d}  {line}")
            profile(model, ids, args.tokens, args.rows)
        finally:
            torch.backends.cuda.enable_cudnn_sdp(True)
    revert(model)
    return 0


if __name__ == "__main__":
    sys.exit(main())
