"""Router training under Ulysses on P GPUs against the same step on one GPU: time, memory, exchange, check.

A Llama-shaped causal LM built from ``LlamaConfig`` with random weights (seeded, rank 0's broadcast to every
rank): bf16, ``--layers`` layers (default 2), hidden 4096, 32 query / 8 KV heads, head_dim 128, intermediate
14336, vocabulary 8192. Converted by ``flexsparse.convert`` with patterns {"full": Causal(), "ssa":
SinkWindow(128, 2048)}, backend "auto", and a router on every layer (``--routers``: "head", the Elastic head
router, default; "layer", the Flux layer router), so each input's modes are the router's. One step is
``RouterTrainer.step``: forward of one sequence (batch 1, S tokens, the last S/8 the answer: labels there, the
routers pooling the prompt), LM loss + sparsity regulariser, backward, gradient clip and AdamW on the router
parameters (and the constraint's multipliers); the base model is frozen. For each router and S:

- the step through ``flexsparse.distributed.UlyssesCausalLM``, each rank running S/P tokens: median of
  CUDA-event-timed steps after warm-up (which compiles), the slowest rank's median;
- the same step of the plain converted model on the whole sequence on rank 0 alone (the other ranks wait),
  skipped above ``--single-max`` and reported "OOM" when it does not fit;
- peak memory per GPU of each (``torch.cuda.max_memory_allocated``, reset before; weights included, and in the
  1-GPU peak also the idle Ulysses model's, ~1 GiB at 2 layers);
- the all-to-all time of one step: ``dist.all_to_all_single`` alone on buffers of the bytes each layer's
  exchange reported (``flexsparse.distributed.last_exchanges``: q/k/v in and output back, forward and
  backward), summed over the layers, without the layers' pack/unpack copies (the routers' all-reduces, of
  ``[1, 2*pool, heads, d]`` states and ``[1, G]`` gradients, are left out: kilobytes);
- at the smallest S, a correctness check of one step from the same router weights, Gumbel seed and
  multipliers: the P-GPU loss and router gradients (unclipped) against the 1-GPU step's, max |error| /
  max |reference| within bf16 tolerances (3e-2 loss, 6e-2 gradients), and the same routing decisions.

What bounds the sizes (estimates, bf16, a GPU running T tokens; the base weights are frozen, so their linear
layers keep no inputs for the backward): a layer keeps ~150-200 KB a token (SiLU input and both MLP branches,
3 x 28 KB; q/k/v and the full and sparse attention outputs the routed mix needs; the norms' float32 inputs),
the loss ~50 KB (bf16 logits and their float32 log-softmax at V = 8192). At T = 128K (S = 256K on 2 GPUs) that
is ~40-55 GiB with 2 layers; one GPU at S = 256K needs twice that and is expected to report OOM. The
vocabulary is 8192 because the loss materialises float32 logits: at a real model's 128K vocabulary they alone
would take 128 GiB at 256K tokens. Training mixes the full and sparse outputs of every head, so every head
runs causal attention each step (~2*S^2*d*H FLOPs forward per layer): about 6 s a step at S = 256K on 2 H100s.

    torchrun --nproc-per-node 2 --master-addr 127.0.0.1 bench/speed/ulysses_router_gpus.py --out DIR
    torchrun --nproc-per-node 2 --master-addr 127.0.0.1 bench/speed/ulysses_router_gpus.py --smoke  # CPU, gloo

(the script puts its checkout first on sys.path). Rank 0 prints one table and writes ``DIR/ulysses_router.json`` after
every S; the exit code is 1 when a correctness check fails. Out-of-memory errors are caught per S on every
rank and agreed on with one all-reduce; they must happen on every rank alike (one process per GPU, nothing
else on them), since a rank that fails alone leaves the others waiting in a collective.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
import transformers
from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedModel

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))  # the checkout's flexsparse, and bench.common

import flexsparse  # noqa: E402
from bench.common import (  # noqa: E402
    barrier,
    every_rank,
    exchange_ms,
    free_memory,
    join_ranks,
    median_ms,
    peak_gib,
    relative_error,
    reset_peak,
    torchrun_world,
)
from flexsparse import Causal, SinkWindow  # noqa: E402
from flexsparse.distributed import UlyssesCausalLM, last_exchanges  # noqa: E402
from flexsparse.integrations import RouterTrainer, last_routings, router_parameters  # noqa: E402
from flexsparse.routers import SparsityConstraint  # noqa: E402

TASK = "long"
TIMING_STEPS = 10**6  # RouterTrainer's schedule length while timing: no log record (host sync) in the steps


@dataclass
class RouterBenchConfig:
    device: str = "cuda"
    dtype: str = "bfloat16"
    backend: str = "auto"
    layers: int = 2
    hidden: int = 4096
    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    intermediate: int = 14336
    vocab: int = 8192
    sink: int = 128
    window: int = 2048
    block_size: int = 128
    pool_size: int = 100
    routers: list[str] = field(default_factory=lambda: ["head"])
    seqs: list[int] = field(default_factory=lambda: [65536, 131072, 262144])
    single_max: int | None = None
    """The longest S the 1-GPU baseline runs (None: every S)."""
    answer_fraction: float = 0.125
    """The last S * answer_fraction tokens carry labels; the routers pool the rest (the prompt)."""
    target_sparsity: float = 0.5
    seed: int = 0
    """Of the weights (routers included) and the constraint's multipliers."""
    gumbel_seed: int = 1
    """Of the Gumbel noise (1: the CPU smoke run's draws pick both modes in both routers)."""
    warmup: int = 2
    steps: int = 3
    exchange_rounds: int = 10
    loss_tolerance: float = 3e-2
    grad_tolerance: float = 6e-2


SMOKE = RouterBenchConfig(device="cpu", dtype="float32", hidden=128, heads=8, kv_heads=4, head_dim=16,
                          intermediate=256, vocab=96, sink=4, window=16, block_size=16, pool_size=4,
                          routers=["head", "layer"], seqs=[64, 128], warmup=1, steps=2, exchange_rounds=2,
                          loss_tolerance=1e-4, grad_tolerance=1e-4)


# ----- model, batch, trainer --------------------------------------------------------------------------------

def build_model(cfg: RouterBenchConfig, router: str, device: torch.device) -> PreTrainedModel:
    """The converted, routed model with weights from ``cfg.seed`` (built on ``device``)."""
    config = LlamaConfig(vocab_size=cfg.vocab, hidden_size=cfg.hidden, intermediate_size=cfg.intermediate,
                         num_hidden_layers=cfg.layers, num_attention_heads=cfg.heads,
                         num_key_value_heads=cfg.kv_heads, head_dim=cfg.head_dim,
                         max_position_embeddings=max(cfg.seqs), tie_word_embeddings=False,
                         attn_implementation="sdpa", pad_token_id=0, bos_token_id=None, eos_token_id=None)
    torch.manual_seed(cfg.seed)
    with device:  # RoPE's inv_freq stays float32, as from_pretrained(dtype=...) keeps it
        model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, cfg.dtype)).eval()
    patterns = {"full": Causal(), "ssa": SinkWindow(cfg.sink, cfg.window)}
    return flexsparse.convert(model, patterns, router=router, block_size=cfg.block_size, backend=cfg.backend,
                              router_options={"pool_size": cfg.pool_size, "full": "full", "sparse": "ssa"})


def broadcast_weights(model: torch.nn.Module) -> None:
    """Rank 0's parameters and buffers (routers included) on every rank."""
    for tensor in [*model.parameters(), *model.buffers()]:
        dist.broadcast(tensor.data, src=0)


def router_state(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in router_parameters(model)]


def load_router_state(model: torch.nn.Module, state: list[torch.Tensor]) -> None:
    with torch.no_grad():
        for param, saved in zip(router_parameters(model), state, strict=True):
            param.copy_(saved)


def make_batch(cfg: RouterBenchConfig, seq: int, device: torch.device) -> dict:
    """One sequence of S random tokens (seeded by S, the same on every rank): labels on the answer (the last
    S * answer_fraction tokens), the routers pooling the prompt."""
    gen = torch.Generator(device).manual_seed(seq)
    ids = torch.randint(1, cfg.vocab, (1, seq), generator=gen, device=device)
    prompt = torch.ones_like(ids, dtype=torch.bool)
    prompt[:, seq - max(1, int(seq * cfg.answer_fraction)):] = False
    return {"input_ids": ids, "labels": ids.masked_fill(prompt, -100), "prompt_mask": prompt, "task": [TASK]}


def make_trainer(cfg: RouterBenchConfig, model: torch.nn.Module, device: torch.device, *,
                 check: bool) -> RouterTrainer:
    """A fresh trainer (Gumbel generator from ``cfg.gumbel_seed``, multipliers from ``cfg.seed``). ``check``:
    one logged step without gradient clip (``max_grad_norm=None``), for comparing gradients; else a long
    schedule that logs nothing (no host sync)."""
    constraint = SparsityConstraint({TASK: cfg.target_sparsity}, seed=cfg.seed)
    generator = torch.Generator(device).manual_seed(cfg.gumbel_seed)
    if check:
        return RouterTrainer(model, constraint, total_steps=1, max_grad_norm=None, progress=False,
                             generator=generator)
    return RouterTrainer(model, constraint, total_steps=TIMING_STEPS, log_every=TIMING_STEPS, progress=False,
                         generator=generator)


def checked_step(cfg: RouterBenchConfig, model: torch.nn.Module, initial: list[torch.Tensor], batch: dict,
                 device: torch.device) -> dict:
    """One step from the ``initial`` router weights: loss, router gradients and decisions (on the CPU)."""
    load_router_state(model, initial)
    trainer = make_trainer(cfg, model, device, check=True)
    record = trainer.step(batch)
    return {"loss": torch.tensor(record["loss"]),
            "grads": [p.grad.detach().float().cpu() for p in trainer.router_params],
            "decisions": [r.is_sparse.cpu() for r in last_routings(model)]}


# ----- timing and collectives -------------------------------------------------------------------------------







def all_ranks_ok(ok: bool, device: torch.device) -> bool:
    flag = torch.tensor([1.0 if ok else 0.0], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())



def is_out_of_memory(error: BaseException) -> bool:
    """A CUDA allocation failure (also as cuBLAS's allocation error or wrapped by the compiler)."""
    return isinstance(error, torch.OutOfMemoryError) or (
        isinstance(error, RuntimeError) and ("out of memory" in str(error) or "ALLOC_FAILED" in str(error)))



def step_exchange_ms(exchanges: list, cfg: RouterBenchConfig, device: torch.device) -> float:
    """All-to-all milliseconds of one step: every layer's exchanges, each size timed once. The first layer's
    backward sends no q/k/v gradients (its q/k/v need none: the model is frozen, only its output's routing
    weights train)."""
    timed: dict[int, float] = {}
    total = 0.0
    for stats in exchanges:
        for sent in (stats.qkv, stats.out, stats.grad_out, stats.grad_qkv):
            if sent == 0:
                continue
            if sent not in timed:
                timed[sent] = exchange_ms(sent, getattr(torch, cfg.dtype), cfg.exchange_rounds, device)
            total += timed[sent]
    return total



def compare(cfg: RouterBenchConfig, seq: int, sharded: dict, single: dict) -> dict:
    grads = zip(sharded["grads"], single["grads"], strict=True)
    errors = {"loss": relative_error(sharded["loss"], single["loss"]),
              "router_grads": max(relative_error(got, ref) for got, ref in grads)}
    tolerances = {"loss": cfg.loss_tolerance, "router_grads": cfg.grad_tolerance}
    decisions = all(torch.equal(a, b) for a, b in zip(sharded["decisions"], single["decisions"]))
    sparse = torch.cat([d.flatten() for d in single["decisions"]]).float().mean().item()
    return {"seq": seq, "errors": errors, "tolerances": tolerances, "loss": single["loss"].item(),
            "decisions_equal": decisions, "sparse_fraction": sparse,
            "passed": decisions and all(errors[name] <= tolerances[name] for name in errors)}


# ----- one sequence length ----------------------------------------------------------------------------------

def measure(cfg: RouterBenchConfig, router: str, model: UlyssesCausalLM, initial: list[torch.Tensor],
            seq: int, check: bool, device: torch.device) -> dict:
    """One router kind and sequence length on every rank; rank 0's dict holds the results."""
    world, rank = dist.get_world_size(), dist.get_rank()
    row: dict = {"router": router, "seq": seq, "world": world}
    batch = make_batch(cfg, seq, device)

    # P GPUs: UlyssesCausalLM, S/P tokens a rank
    sharded_result, ok = None, True
    try:
        load_router_state(model, initial)
        trainer = make_trainer(cfg, model, device, check=False)
        reset_peak(device)
        ms = median_ms(lambda: trainer.step(batch), cfg.warmup, cfg.steps, device)
        peak = peak_gib(device)
        exchanges = last_exchanges(model)
        del trainer
        if check:
            sharded_result = checked_step(cfg, model, initial, batch, device)
    except Exception as error:
        if not is_out_of_memory(error):
            raise
        ok = False
    free_memory(device)
    if not all_ranks_ok(ok, device):
        row["sharded_ms"] = "OOM"
        sharded_result = None
    else:
        row["sharded_ms_per_rank"] = every_rank(ms, device)
        row["sharded_ms"] = max(row["sharded_ms_per_rank"])
        row["sharded_peak_gib_per_rank"] = every_rank(peak, device)
        row["exchange_bytes_per_rank"] = {"qkv": sum(s.qkv for s in exchanges),
                                          "out": sum(s.out for s in exchanges),
                                          "step": sum(s.forward + s.backward for s in exchanges)}
        if world > 1:
            row["exchange_ms"] = max(every_rank(step_exchange_ms(exchanges, cfg, device), device))
    free_memory(device)

    # 1 GPU: the plain converted model on the whole sequence, rank 0 alone
    capped = cfg.single_max is not None and seq > cfg.single_max
    if rank == 0 and world > 1 and (capped or row["sharded_ms"] == "OOM"):
        row["single_ms"] = "skipped"  # above --single-max, or P GPUs already ran out of memory
    elif rank == 0 and world > 1:
        try:
            single = build_model(cfg, router, device)
            single.load_state_dict(model.model.state_dict())
            trainer = make_trainer(cfg, single, device, check=False)
            reset_peak(device)
            row["single_ms"] = median_ms(lambda: trainer.step(batch), cfg.warmup, cfg.steps, device)
            row["single_peak_gib"] = peak_gib(device)
            del trainer
            if sharded_result is not None:
                reference = checked_step(cfg, single, initial, batch, device)
                row["check"] = compare(cfg, seq, sharded_result, reference)
        except Exception as error:
            if not is_out_of_memory(error):
                raise
            row["single_ms"] = "OOM"
        single = trainer = None
        free_memory(device)
    barrier(device)
    return row


# ----- report -----------------------------------------------------------------------------------------------

def fmt(value, spec: str = ".1f") -> str:
    return format(value, spec) if isinstance(value, (int, float)) else str(value or "-")


def table(rows: list[dict]) -> str:
    world = rows[0]["world"]
    head = (f"{'router':>6} | {'S':>7} | {f'{world} GPU ms':>10} | {'1 GPU ms':>9} | {'speedup':>7} | "
            f"{'a2a ms':>7} | {'a2a %':>5} | {'a2a MB/rank':>11} | {f'peak GiB ({world} GPU)':>19} | "
            f"{'peak GiB 1 GPU':>14}")
    lines = [head, "-" * len(head)]
    for row in rows:
        sharded, single = row["sharded_ms"], row.get("single_ms")
        speedup = single / sharded if isinstance(single, float) and isinstance(sharded, float) else None
        a2a = row.get("exchange_ms")
        share = 100 * a2a / sharded if a2a is not None else None
        peaks = " / ".join(fmt(p, ".2f") for p in row.get("sharded_peak_gib_per_rank", []))
        sent = row.get("exchange_bytes_per_rank", {}).get("step")
        lines.append(f"{row['router']:>6} | {row['seq']:>7} | {fmt(sharded, '.1f'):>10} | "
                     f"{fmt(single, '.1f'):>9} | {fmt(speedup, '.2f'):>7} | {fmt(a2a, '.1f'):>7} | "
                     f"{fmt(share, '.0f'):>5} | "
                     f"{fmt(None if sent is None else sent / 1e6, '.1f'):>11} | {peaks or '-':>19} | "
                     f"{fmt(row.get('single_peak_gib'), '.2f'):>14}")
    return "\n".join(lines)


def write_json(path: str, cfg: RouterBenchConfig, device: torch.device, rows: list[dict]) -> None:
    checks = [row["check"] | {"router": row["router"]} for row in rows if "check" in row]
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    with open(path, "w") as f:
        json.dump({"config": asdict(cfg), "world": dist.get_world_size(), "device": gpu,
                   "torch": torch.__version__, "transformers": transformers.__version__, "rows": rows,
                   "checks": checks}, f, indent=1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seqs", type=int, nargs="+", help="sequence lengths (default 65536 131072 262144)")
    parser.add_argument("--single-max", type=int, help="longest S of the 1-GPU baseline (default: every S)")
    parser.add_argument("--layers", type=int, help="decoder layers (default 2)")
    parser.add_argument("--routers", nargs="+", choices=["head", "layer"],
                        help="router kinds, one setting each (default head; --smoke: head layer)")
    parser.add_argument("--steps", type=int, help="timed steps (default 3)")
    parser.add_argument("--out", help="folder for ulysses_router.json")
    parser.add_argument("--smoke", action="store_true", help="toy sizes on the CPU, gloo")
    args = parser.parse_args(argv)
    cfg = SMOKE if args.smoke else RouterBenchConfig()
    for name in ("single_max", "layers", "routers", "steps"):
        if getattr(args, name) is not None:
            setattr(cfg, name, getattr(args, name))
    if args.seqs:
        cfg.seqs = sorted(args.seqs)
    world = torchrun_world(parser)
    bad = [s for s in cfg.seqs if s <= 0 or s % world]
    if bad or cfg.steps < 1 or cfg.layers < 1:
        parser.error(f"--seqs must be positive multiples of the {world} ranks (got {bad}), --steps and "
                     "--layers >= 1")
    if cfg.heads % world or cfg.kv_heads % world:
        parser.error(f"{cfg.heads} query and {cfg.kv_heads} KV heads must divide by the {world} ranks")

    device = join_ranks(parser, cfg.device, "--smoke")
    rank = dist.get_rank()
    path = None
    if args.out and rank == 0:
        os.makedirs(args.out, exist_ok=True)
        path = os.path.join(args.out, "ulysses_router.json")
    try:
        rows, begin = [], time.perf_counter()
        for router in cfg.routers:
            model = build_model(cfg, router, device)
            broadcast_weights(model)
            initial = router_state(model)
            model = UlyssesCausalLM(model)
            for seq in cfg.seqs:
                rows.append(measure(cfg, router, model, initial, seq, check=seq == cfg.seqs[0] and world > 1,
                                    device=device))
                if rank == 0:
                    elapsed = time.perf_counter() - begin
                    print(f"{router} router, S={seq}: {json.dumps(rows[-1])} ({elapsed:.0f} s)", flush=True)
                    if path:
                        write_json(path, cfg, device, rows)
            model = initial = None
            free_memory(device)
        if rank != 0:
            return 0
        gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
        print(f"\nRouter training step (RouterTrainer.step: fwd, LM loss + sparsity regulariser, bwd, AdamW "
              f"on the routers) under Ulysses on {world} x {gpu}: Llama {cfg.layers} layers, hidden "
              f"{cfg.hidden}, H={cfg.heads}, H_kv={cfg.kv_heads}, d={cfg.head_dim}, vocab {cfg.vocab}, "
              f"{cfg.dtype}, B=1, patterns full + sink {cfg.sink}/window {cfg.window}, backend "
              f"{cfg.backend}; median of {cfg.steps} steps; a2a = all_to_all_single alone on the exchanged "
              "bytes, every layer, fwd+bwd")
        print(table(rows))
        checks = [row for row in rows if "check" in row]
        for row in checks:
            check = row["check"]
            errors = ", ".join(f"{name} {err:.2e} (tol {check['tolerances'][name]:.0e})"
                               for name, err in check["errors"].items())
            decisions = "equal" if check["decisions_equal"] else "DIFFER"
            verdict = "PASS" if check["passed"] else "FAIL"
            print(f"check ({row['router']} router, S={check['seq']}): max|err|/max|ref| {errors}; decisions "
                  f"{decisions} ({check['sparse_fraction']:.0%} sparse): {verdict}")
        if world > 1 and len(checks) < len(cfg.routers):
            print("check: not run for every router (the 1-GPU baseline did not run at the smallest S)")
        if path:
            print(f"wrote {path}")
        return 0 if all(row["check"]["passed"] for row in checks) else 1
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
