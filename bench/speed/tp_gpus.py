"""Tensor-parallel inference on P GPUs (transformers' ``tp_plan="auto"``) of a flexsparse-converted model against
the same model with SDPA: prefill and decode time, per-rank attention time, KV cache bytes per rank.

The model: a Llama-shaped causal LM built from a config (16 layers, hidden 4096, 32 query / 8 KV heads,
head_dim 128, MLP 14336, vocabulary 32000) with random bf16 weights, saved once by rank 0 under ``--model-dir``
(reused when its config matches) and loaded on every rank with ``from_pretrained(..., tp_plan="auto")``. Three
attention settings of the same loaded model:

- ``sdpa``: transformers' SDPA attention (every head full, a DynamicCache);
- ``balanced``: ``flexsparse.convert`` with 2 full (Causal) + 6 sink-128/window-2048 KV heads per layer, the
  full heads spread over the ranks (each rank's contiguous block of KV heads holds the same number,
  ``select_modes(..., tp_size=P)``'s choice);
- ``unbalanced``: the same 2 + 6 heads with both full heads in rank 0's block (KV heads 0 and 1).

With ``--nproc-per-node 1`` the same model runs on one GPU (loaded without ``tp_plan``): the baseline TP is
compared with. After each setting's timings, rank 0 saves the last hidden states of the last ``--check-rows``
positions of a ``--check-len``-token prompt to ``DIR/hidden-SETTING-wP.pt``; ``--compare DIR_A DIR_B`` (no torchrun)
prints max |difference| / max |reference| of each setting found in both and exits 1 above ``--compare-tol``.

For each: prefill of ``--seqs`` tokens (batch 1, the decoder without the LM head; median of CUDA-event-timed
forwards after warm-up), and at ``--decode-len`` one-token decode steps after a prefill of that many tokens
(median step). Per rank, the time inside the attention function alone (CUDA events around each call, summed
over the layers of a forward): the ranks wait for each other at every all-reduce, so the forward time is the
slowest rank's, and the attention times show the imbalance. Also per rank: the KV cache bytes after the decode
prefill and :func:`flexsparse.distributed.rank_tiles` of each layout.

    torchrun --nproc-per-node 2 bench/speed/tp_gpus.py --out DIR
    torchrun --nproc-per-node 1 bench/speed/tp_gpus.py --settings sdpa balanced --layout-world 2 --out DIR1  # 1 GPU
    python bench/speed/tp_gpus.py --compare DIR1 DIR                           # outputs: 1 GPU against 2
    torchrun --nproc-per-node 2 bench/speed/tp_gpus.py --tiny --out DIR   # CPU, gloo, toy sizes (a correctness run)

(the script puts its checkout first on sys.path; needs transformers and accelerate). Rank 0 prints one table and writes
``DIR/tp.json``. ``--tiny`` also checks that the converted TP model's prefill hidden states equal the converted
single-process model's (float32) and exits 1 when they do not.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, DynamicCache, LlamaConfig
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))  # the checkout's flexsparse, and bench.common

import flexsparse  # noqa: E402
from bench.common import every_rank, join_ranks, sync, torchrun_world  # noqa: E402
from flexsparse import Causal, SinkWindow  # noqa: E402
from flexsparse.distributed import rank_kv_heads, rank_tiles  # noqa: E402
from flexsparse.integrations import SparseKVCache, cache_argument  # noqa: E402
from flexsparse.integrations.transformers import ATTENTION_NAME, flexsparse_attention  # noqa: E402
from flexsparse.routers.selection import select_modes  # noqa: E402


@dataclass
class TPBenchConfig:
    device: str = "cuda"
    dtype: str = "bfloat16"
    backend: str = "auto"
    layers: int = 16
    hidden: int = 4096
    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    intermediate: int = 14336
    vocab: int = 32000
    full_kv_heads: int = 2
    sink: int = 128
    window: int = 2048
    block_size: int = 128
    seqs: list[int] = field(default_factory=lambda: [32768, 131072])
    decode_len: int = 131072
    warmup: int = 1
    steps: int = 3
    decode_steps: int = 20
    check_len: int = 8192
    check_rows: int = 64
    check_atol: float | None = None
    """--tiny: the largest |difference| of TP and single-process hidden states allowed (None: no check)."""


TINY = TPBenchConfig(device="cpu", dtype="float32", backend="dense", layers=2, hidden=128, heads=16, kv_heads=8,
                     head_dim=8, intermediate=256, vocab=256, sink=4, window=16, block_size=16, seqs=[64, 128],
                     decode_len=128, warmup=1, steps=2, decode_steps=4, check_len=64, check_rows=8,
                     check_atol=1e-4)


def model_config(cfg: TPBenchConfig) -> LlamaConfig:
    return LlamaConfig(vocab_size=cfg.vocab, hidden_size=cfg.hidden, intermediate_size=cfg.intermediate,
                       num_hidden_layers=cfg.layers, num_attention_heads=cfg.heads, num_key_value_heads=cfg.kv_heads,
                       head_dim=cfg.head_dim, max_position_embeddings=max(cfg.seqs + [cfg.decode_len]) + 64,
                       tie_word_embeddings=False)


def save_model(cfg: TPBenchConfig, directory: str, device: torch.device) -> None:
    """Rank 0 writes a random-weight model of ``cfg`` into ``directory`` unless one with the same config is there."""
    config = model_config(cfg)
    path = os.path.join(directory, "config.json")
    if os.path.exists(path):
        with open(path) as f:
            saved = json.load(f)
        if all(saved.get(k) == v for k, v in config.to_diff_dict().items() if k not in ("dtype", "torch_dtype")):
            return
    torch.manual_seed(0)
    with device:  # initialise on the GPU: seconds instead of minutes
        model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, cfg.dtype))
    model.save_pretrained(directory)
    del model


def layouts(cfg: TPBenchConfig, world: int) -> dict[str, list[list[str]]]:
    """Per layer KV-head modes: the full heads spread over the ranks (balanced) or all in rank 0's block."""
    scores = torch.zeros(cfg.layers, cfg.kv_heads)
    scores[:, : cfg.full_kv_heads] = 1.0  # the heads a selector would keep full: the first ones
    rho = 1 - cfg.full_kv_heads / cfg.kv_heads
    balanced = select_modes(scores, rho, per_layer=True, tp_size=world, full="full", sparse="ssa")
    unbalanced = [["full"] * cfg.full_kv_heads + ["ssa"] * (cfg.kv_heads - cfg.full_kv_heads)] * cfg.layers
    return {"balanced": balanced, "unbalanced": unbalanced}


class AttentionTimer:
    """Wraps a transformers attention function: CUDA events (wall clock on the CPU) around each call, summed per
    forward by :meth:`take`."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.marks: list = []

    def wrap(self, fn):
        def timed(*args, **kwargs):
            if self.device.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                out = fn(*args, **kwargs)
                end.record()
            else:
                start = time.perf_counter()
                out = fn(*args, **kwargs)
                end = time.perf_counter()
            self.marks.append((start, end))
            return out

        return timed

    def take(self) -> float:
        """Milliseconds inside the attention function since the last take (synchronises)."""
        sync(self.device)
        marks, self.marks = self.marks, []
        if self.device.type == "cuda":
            return sum(start.elapsed_time(end) for start, end in marks)
        return sum(end - start for start, end in marks) * 1e3


def timed_runs(fn, warmup: int, steps: int, device: torch.device, timer: AttentionTimer) -> tuple[float, float]:
    """Median milliseconds of ``steps`` calls (each timed alone) after ``warmup``, and the median attention
    milliseconds of the same calls. Every rank makes the same calls (they hold collectives)."""
    for _ in range(warmup):
        fn()
    timer.take()
    times, attention = [], []
    for _ in range(steps):
        sync(device)
        begin = time.perf_counter()
        fn()
        sync(device)
        times.append((time.perf_counter() - begin) * 1e3)
        attention.append(timer.take())
    return statistics.median(times), statistics.median(attention)


def prompt(cfg: TPBenchConfig, length: int, device: torch.device) -> torch.Tensor:
    gen = torch.Generator().manual_seed(length)
    return torch.randint(0, cfg.vocab, (1, length), generator=gen).to(device)


def measure(model, cfg: TPBenchConfig, setting: str, device: torch.device, timer: AttentionTimer) -> dict:
    """Prefill at every length and decode at ``decode_len`` for the model's current attention."""
    row: dict = {"setting": setting, "prefill": {}}
    decoder = model.model
    for seq in cfg.seqs:
        with torch.no_grad():
            forward = partial(decoder, input_ids=prompt(cfg, seq, device), use_cache=False)
            ms, attention_ms = timed_runs(forward, cfg.warmup, cfg.steps, device, timer)
        row["prefill"][seq] = {"ms": max(every_rank(ms, device)),
                               "attention_ms_per_rank": every_rank(attention_ms, device)}
    ids = prompt(cfg, cfg.decode_len, device)
    converted = flexsparse.integrations.is_converted(model)
    name = cache_argument(model)
    with torch.no_grad():
        cache = SparseKVCache(model, max_length=cfg.decode_len + cfg.warmup + cfg.decode_steps) if converted \
            else DynamicCache(config=model.config)
        out = decoder(input_ids=ids, use_cache=True, **{name: cache})
        del out, ids
        token = torch.zeros(1, 1, dtype=torch.long, device=device)  # token 0 each step: time, not text
        if converted:
            kv_bytes = cache.memory_report().used_bytes
        else:
            kv_bytes = sum(layer.keys.numel() * layer.keys.element_size() * 2 for layer in cache.layers)
        step = partial(decoder, input_ids=token, use_cache=True, **{name: cache})
        ms, attention_ms = timed_runs(step, cfg.warmup, cfg.decode_steps, device, timer)
    row["decode"] = {"cached": cfg.decode_len, "ms": max(every_rank(ms, device)),
                     "attention_ms_per_rank": every_rank(attention_ms, device),
                     "kv_bytes_per_rank": every_rank(kv_bytes, device)}
    return row


@torch.no_grad()
def save_hidden(model, cfg: TPBenchConfig, setting: str, out: str | None, device: torch.device) -> None:
    """Rank 0 writes the last ``check_rows`` hidden states (float32, CPU) of a ``check_len``-token prompt."""
    hidden = model.model(input_ids=prompt(cfg, cfg.check_len, device), use_cache=False).last_hidden_state
    if out and dist.get_rank() == 0:
        os.makedirs(out, exist_ok=True)
        rows = hidden[0, -cfg.check_rows:].float().cpu()
        torch.save(rows, os.path.join(out, f"hidden-{setting}-w{dist.get_world_size()}.pt"))


def compare(dir_a: str, dir_b: str, tol: float) -> int:
    """max |a - b| / max |a| of the hidden states of each setting saved in both folders; 1 when any is above tol."""
    def saved(directory: str) -> dict[str, str]:
        names = [n for n in os.listdir(directory) if n.startswith("hidden-") and n.endswith(".pt")]
        return {n[len("hidden-"):].rsplit("-w", 1)[0]: os.path.join(directory, n) for n in names}

    a, b = saved(dir_a), saved(dir_b)
    common = sorted(set(a) & set(b))
    if not common:
        print(f"no setting has hidden states in both {dir_a} and {dir_b}", file=sys.stderr)
        return 2
    worst = 0.0
    for setting in common:
        ref, got = torch.load(a[setting]), torch.load(b[setting])
        error = ((got - ref).abs().max() / ref.abs().max()).item()
        worst = max(worst, error)
        print(f"{setting}: max|diff|/max|ref| {error:.2e} ({os.path.basename(a[setting])} vs "
              f"{os.path.basename(b[setting])}; tol {tol:.0e})")
    print("PASS" if worst <= tol else "FAIL")
    return 0 if worst <= tol else 1


def hidden_check(path: str, cfg: TPBenchConfig, modes: list[list[str]], patterns: dict, sharded) -> float:
    """Largest |difference| of the converted TP model's last hidden states and a converted single-process model's
    (every rank loads the whole model: toy sizes only)."""
    single = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, cfg.dtype)).eval()
    flexsparse.convert(single, patterns, modes, block_size=cfg.block_size, backend=cfg.backend)
    ids = prompt(cfg, cfg.seqs[0], torch.device("cpu"))
    with torch.no_grad():
        expected = single.model(input_ids=ids, use_cache=False).last_hidden_state
        got = sharded.model(input_ids=ids, use_cache=False).last_hidden_state
    return (got - expected).abs().max().item()


def table(rows: list[dict]) -> str:
    per_rank = lambda values: " / ".join(f"{v:.1f}" for v in values)
    head = f"{'setting':>10} | {'what':>16} | {'ms':>9} | {'attention ms per rank':>24} | {'KV MiB per rank':>18}"
    lines = [head, "-" * len(head)]
    for row in rows:
        for seq, result in row["prefill"].items():
            lines.append(f"{row['setting']:>10} | {f'prefill {seq}':>16} | {result['ms']:>9.2f} | "
                         f"{per_rank(result['attention_ms_per_rank']):>24} | {'':>18}")
        decode = row["decode"]
        kv = " / ".join(f"{b / 2**20:.2f}" for b in decode["kv_bytes_per_rank"])
        what = f"decode @{decode['cached']}"
        attention = " / ".join(f"{v:.3f}" for v in decode["attention_ms_per_rank"])
        lines.append(f"{row['setting']:>10} | {what:>16} | {decode['ms']:>9.3f} | {attention:>24} | {kv:>18}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seqs", type=int, nargs="+", help="prefill lengths (default 32768 131072)")
    parser.add_argument("--decode-len", type=int, help="cached tokens of the decode steps (default 131072)")
    parser.add_argument("--model-dir", help="where the random model is saved and reused (default: a temp folder)")
    parser.add_argument("--out", help="folder for tp.json")
    parser.add_argument("--tiny", action="store_true", help="toy sizes on the CPU, gloo, with a correctness check")
    parser.add_argument("--settings", nargs="+", choices=["sdpa", "balanced", "unbalanced"],
                        default=["sdpa", "balanced", "unbalanced"], help="which attention settings to run")
    parser.add_argument("--layout-world", type=int,
                        help="ranks the balanced layout is chosen for (default: the world size); 2 on one GPU "
                             "gives the modes a 2-GPU run uses, so --compare matches them")
    parser.add_argument("--compare", nargs=2, metavar=("DIR_A", "DIR_B"),
                        help="compare the hidden states two runs saved (no torchrun) and exit")
    parser.add_argument("--compare-tol", type=float, default=5e-2,
                        help="largest max|diff|/max|ref| --compare accepts (bf16 over 16 layers; default 5e-2)")
    args = parser.parse_args(argv)
    if args.compare:
        return compare(*args.compare, args.compare_tol)
    cfg = TINY if args.tiny else TPBenchConfig()
    if args.seqs:
        cfg.seqs = sorted(args.seqs)
    if args.decode_len:
        cfg.decode_len = args.decode_len
    world = torchrun_world(parser)
    if cfg.kv_heads % world or cfg.full_kv_heads % world:
        parser.error(f"{cfg.kv_heads} KV heads with {cfg.full_kv_heads} full must divide among {world} ranks")
    device = join_ranks(parser, cfg.device, "--tiny")
    rank = dist.get_rank()
    name = "flexsparse-tp-tiny" if args.tiny else "flexsparse-tp-llama"
    directory = args.model_dir or os.path.join(tempfile.gettempdir(), name)
    try:
        if rank == 0:
            os.makedirs(directory, exist_ok=True)
            save_model(cfg, directory, device)
        dist.barrier()
        sharding = {"tp_plan": "auto"} if world > 1 else {"device_map": {"": device}}
        model = AutoModelForCausalLM.from_pretrained(directory, dtype=getattr(torch, cfg.dtype),
                                                     attn_implementation="sdpa", **sharding).eval()
        timer = AttentionTimer(device)
        sdpa = ALL_ATTENTION_FUNCTIONS["sdpa"]
        patterns = {"full": Causal(), "ssa": SinkWindow(cfg.sink, cfg.window)}
        modes = {name: layer_modes for name, layer_modes in layouts(cfg, args.layout_world or world).items() if name in args.settings}
        rows, begin = [], time.perf_counter()
        if "sdpa" in args.settings:
            AttentionInterface.register("sdpa", timer.wrap(sdpa))
            try:
                rows.append(measure(model, cfg, "sdpa", device, timer))
            finally:
                AttentionInterface.register("sdpa", sdpa)
            save_hidden(model, cfg, "sdpa", args.out, device)
        check = None
        for setting, layer_modes in modes.items():
            flexsparse.convert(model, patterns, layer_modes, block_size=cfg.block_size, backend=cfg.backend)
            if cfg.check_atol is not None and setting == "balanced":
                check = hidden_check(directory, cfg, layer_modes, patterns, model)
            AttentionInterface.register(ATTENTION_NAME, timer.wrap(flexsparse_attention))  # convert registers its own
            rows.append(measure(model, cfg, setting, device, timer))
            save_hidden(model, cfg, setting, args.out, device)
            if device.type == "cuda":
                torch.cuda.empty_cache()  # the last decode cache
            if rank == 0:
                print(f"{setting} done at {time.perf_counter() - begin:.0f} s", flush=True)
        flexsparse.revert(model)
        checks = every_rank(check, device)
        if rank != 0:
            return 0
        tiles = {name: rank_tiles(patterns, layer_modes, cfg.heads, length, world,
                                  block_size=cfg.block_size).sum(1).tolist()
                 for name, layer_modes in modes.items() for length in cfg.seqs[-1:]}
        gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
        heads = [list(rank_kv_heads(cfg.kv_heads, world, r)) for r in range(world)]
        print(f"\nTensor parallel on {world} x {gpu} ({cfg.dtype}, B=1, {cfg.layers} layers, H={cfg.heads}, "
              f"H_kv={cfg.kv_heads}, d={cfg.head_dim}; rank KV heads {heads}; {cfg.full_kv_heads} full + "
              f"{cfg.kv_heads - cfg.full_kv_heads} sink {cfg.sink}/window {cfg.window} per layer; prefill median "
              f"of {cfg.steps}, decode median of {cfg.decode_steps} steps; attention ms = inside the attention "
              "function, summed over layers)")
        print(table(rows))
        print(f"tiles per rank at {cfg.seqs[-1]} (block {cfg.block_size}, all layers): {tiles}")
        passed = True
        if cfg.check_atol is not None:
            worst = max(checks)
            passed = worst <= cfg.check_atol
            print(f"check: TP vs single-process hidden states, max |diff| {worst:.2e} (atol {cfg.check_atol:.0e}): "
                  f"{'PASS' if passed else 'FAIL'}")
        if args.out:
            os.makedirs(args.out, exist_ok=True)
            path = os.path.join(args.out, "tp.json")
            with open(path, "w") as f:
                json.dump({"config": asdict(cfg), "world": world, "modes": modes, "tiles_per_rank": tiles,
                           "torch": torch.__version__, "device": gpu, "rows": rows, "check": checks}, f, indent=1)
            print(f"wrote {path}")
        return 0 if passed else 1
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
