"""Contiguous prefill through compiled flex, exact length against bucketed (CUDA only): forward and
forward+backward.

B=1, 32 query / 8 KV heads, d=128, bf16. Two layers: "hybrid auto" (2 full + 6 SinkWindow(128, 2048) KV
heads, plan auto: the full heads go to SDPA, the six window heads to flex) and "sparse fused" (6
SinkWindow(128, 2048) + 2 TriangleMix(128, 2048, last_q=128) heads in one flex launch). Policies
(:mod:`flexsparse.runtime.buckets`):

* ``exact``: ``PREFILL_POLICY = "exact"``, the call at its own length, positions as arithmetic;
* ``bucketed``: ``PREFILL_POLICY = "buckets"``, the call at its key bucket with position tables (q/k/v copied
  into the bucket when the length is off the grid).

8K, 32K and 128K are on the grid (128 x 2^k): there the two differ only by the tables, which decides between
the default ``"grid"`` policy (exact on the grid) and ``"buckets"`` (one variant per bucket). ``--off-grid``
adds 3/4 of each length (6K, 24K, 96K), where bucketed runs at the full bucket: the price of padding.

    pytest bench/suites/test_prefill_buckets_bench.py --benchmark-only \
        --benchmark-group-by=param:layer,param:seq,param:step
    python bench/suites/test_prefill_buckets_bench.py [--off-grid] [--forward-only] [--lengths 8192 32768]
"""

import argparse
import statistics
import sys
from unittest.mock import patch

import pytest
import torch

import flexsparse.runtime.buckets as buckets
from flexsparse import HybridAttention
from flexsparse.masks import Causal, SinkWindow, TriangleMix

pytestmark = pytest.mark.gpu

HEADS, KV_HEADS, DIM = 32, 8, 128
SEQS = [8192, 32768, 131072]
PATTERNS = {"full": Causal(), "ssa": SinkWindow(128, 2048), "ta": TriangleMix(128, 2048, last_q=128)}
LAYERS = {
    "hybrid auto": (["full"] * 2 + ["ssa"] * 6, "auto"),
    "sparse fused": (["ssa"] * 6 + ["ta"] * 2, "fused"),
}
POLICIES = {"exact": "exact", "bucketed": "buckets"}
STEPS = ["fwd", "fwd+bwd"]


def make_call(layer: str, seq: int, step: str):
    """A function running one call of ``layer`` at ``seq`` tokens (forward, or forward and backward),
    without synchronising."""
    modes, plan = LAYERS[layer]
    attn = HybridAttention(HEADS, KV_HEADS, DIM, PATTERNS, modes, backend="flex", plan=plan)
    grad = step == "fwd+bwd"
    make = lambda h: torch.randn(1, h, seq, DIM, device="cuda", dtype=torch.bfloat16, requires_grad=grad)
    q, k, v = make(HEADS), make(KV_HEADS), make(KV_HEADS)
    grad_out = torch.randn_like(q)

    def call():
        if not grad:
            with torch.no_grad():
                return attn(q, k, v)
        for t in (q, k, v):
            t.grad = None
        attn(q, k, v).backward(grad_out)

    return call


def time_ms(call, rounds: int = 10) -> float:
    """Median of ``rounds`` CUDA-event timings of one call (after a compiling call and two warm-up calls)."""
    for _ in range(3):
        call()
    times = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        call()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


@pytest.mark.parametrize("step", STEPS)
@pytest.mark.parametrize("seq", SEQS)
@pytest.mark.parametrize("layer", list(LAYERS))
@pytest.mark.parametrize("policy", list(POLICIES))
def test_prefill(benchmark, policy, layer, seq, step):
    with patch.object(buckets, "PREFILL_POLICY", POLICIES[policy]):
        call = make_call(layer, seq, step)

        def run():
            call()
            torch.cuda.synchronize()

        run()  # compile
        benchmark.extra_info.update(device=torch.cuda.get_device_name(), policy=POLICIES[policy],
                                    torch=torch.__version__)
        benchmark.pedantic(run, rounds=10, warmup_rounds=2)


def summary(lengths: list[int], steps: list[str], off_grid: bool) -> None:
    """Print ms of exact and bucketed prefill for each layer, length and step, in one run."""
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, bf16, B=1, {HEADS}/{KV_HEADS} heads, "
          f"d={DIM}")
    print(f"{'layer':<14}{'seq':>8}{'runs at':>9}  {'step':<8}{'exact ms':>10}{'bucketed ms':>13}"
          f"{'bucketed/exact':>16}")
    for layer in LAYERS:
        for base in lengths:
            for seq in [base, base * 3 // 4] if off_grid else [base]:
                for step in steps:
                    times = {}
                    for name, policy in POLICIES.items():
                        with patch.object(buckets, "PREFILL_POLICY", policy):
                            times[name] = time_ms(make_call(layer, seq, step))
                        torch.cuda.empty_cache()
                    ratio = times["bucketed"] / times["exact"]
                    print(f"{layer:<14}{seq:>8}{buckets.kv_bucket(seq, 128):>9}  {step:<8}"
                          f"{times['exact']:>10.3f}{times['bucketed']:>13.3f}{ratio:>16.3f}", flush=True)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description="Exact against bucketed prefill through compiled flex.")
    parser.add_argument("--lengths", type=int, nargs="+", default=SEQS)
    parser.add_argument("--forward-only", action="store_true")
    parser.add_argument("--off-grid", action="store_true",
                        help="also 3/4 of each length (bucketed runs it at the full bucket)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("error: needs a CUDA device", file=sys.stderr)
        return 2
    summary(args.lengths, STEPS[:1] if args.forward_only else STEPS, args.off_grid)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
