"""Host time against wall time of the sparse cache's decode step at batch 1 and 131,072 cached tokens (bench_hf's
decode setup: 32 q / 8 kv heads, d = 128, bf16, 2 full + 6 sink-128/window-2048 KV heads; 1 and 4 layers per
step), then a cProfile of the 4-layer step (the default one-launch path). Run on a CUDA GPU:

    python bench/profiles/decode_host.py
"""

import cProfile
import pstats
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))  # the checkout's flexsparse, and bench.common

from bench.common import host_and_wall_us  # noqa: E402
from flexsparse.tools.bench_hf import HfBenchConfig, decode_setup  # noqa: E402


def host_and_wall(fn, calls: int = 300) -> str:
    host, wall = host_and_wall_us(fn, calls)
    return f"host {host:7.1f} us, wall {wall:7.1f} us"


def main() -> None:
    config = HfBenchConfig()
    for layers in (1, 4):
        setup = decode_setup(config, 1, layers, False)
        print(f"{layers} layers: one launch ", host_and_wall(setup.timed["flexsparse"]))
        print(f"{layers} layers: per group  ", host_and_wall(setup.timed["flexsparse_per_group"]))
        print(f"{layers} layers: sdpa        ", host_and_wall(setup.timed["sdpa_all_full"]))
    step = setup.timed["flexsparse"]
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(300):
        step()
    profiler.disable()
    torch.cuda.synchronize()
    pstats.Stats(profiler, stream=sys.stdout).sort_stats("tottime").print_stats(30)


if __name__ == "__main__":
    main()
