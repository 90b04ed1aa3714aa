"""Proof that the routers learn: a small Llama trained from scratch on a sparsity-sensitive and a sparsity-robust
task, frozen, converted with full / sink+window modes, then a head router and a layer router trained with
:class:`~flexsparse.integrations.RouterTrainer`; compared with all-full, all-sparse and the static selectors (HSA
discrepancy, retrieval score) at the head router's MSR.

Tasks (one token vocabulary: 4 specials, keys, values, filler):

* ``retrieval`` (sensitive): ``[R]`` then key-value pairs at random places among filler tokens, then ``[Q]`` and
  ``answers`` queries ``k a``: each queried pair lies more than ``window`` tokens before the queries, so a
  sink+window head cannot see it. Accuracy: the answer tokens.
* ``local`` (robust): ``[C]`` then a random pattern of period 2..6 repeated to the end. Accuracy: the last
  ``2 * answers`` tokens, each predictable from the previous period.

The routers pool the prompt (everything before the first answer). Targets on the GPU (documented, not asserted):
retrieval accuracy of the routed model within 5 points of all-full while the local task's MSR exceeds the
retrieval task's by at least 0.2.

    python -m flexsparse.tools.router_proof --device cuda --out bench/results/router-proof
    python -m flexsparse.tools.router_proof --toy --out /tmp/router-proof      # CPU, seconds

Writes ``router-proof.json`` and ``router-proof.txt`` (a table) into ``--out``. :func:`router_overhead` times one
layer's routing at long prompts (``--overhead``; CUDA events).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
from torch import Tensor, nn

PAD, RETRIEVE, CONTINUE, QUERY = 0, 1, 2, 3
SPECIALS = 4
TASKS = ("retrieval", "local")


@dataclass(frozen=True)
class ProofConfig:
    """Sizes of the proof run. The defaults are the GPU run (about 3 minutes on an H100, fp32 + TF32)."""

    seq_len: int = 256
    pairs: int = 32
    keys: int = 64
    values: int = 64
    filler: int = 32
    answers: int = 8
    layers: int = 4
    hidden: int = 256
    heads: int = 8
    kv_heads: int = 4
    intermediate: int = 512
    sink: int = 4
    window: int = 32
    pool_size: int = 32
    pretrain_steps: int = 3000
    pretrain_batch: int = 64
    pretrain_lr: float = 1e-3
    router_steps: int = 400
    router_batch: int = 32
    router_lr: float = 2e-3
    lambda_lr: float = 1e-2
    robust_target: float = 1.0
    sensitive_target: float = 0.5
    eval_batch: int = 512
    backend: str = "dense"
    seed: int = 0

    @property
    def vocab(self) -> int:
        return SPECIALS + self.keys + self.values + self.filler

    @property
    def prompt_len(self) -> int:
        """Tokens before the first answer (the routers pool these)."""
        return self.seq_len - 2 * self.answers + 1


TOY = ProofConfig(seq_len=48, pairs=6, keys=16, values=16, filler=8, answers=2, layers=2, hidden=32, heads=4,
                  kv_heads=2, intermediate=64, sink=2, window=8, pool_size=8, pretrain_steps=30, pretrain_batch=16,
                  router_steps=4, router_batch=8, eval_batch=16)


# ----- data ------------------------------------------------------------------------------------------------------

def make_batch(cfg: ProofConfig, task: str, batch: int, generator: torch.Generator) -> dict:
    """``batch`` sequences of one task: input_ids, labels (answers only), attention_mask, prompt_mask (tensors
    ``[B, S]``) and task (B names)."""
    if task not in TASKS:
        raise ValueError(f"task must be one of {TASKS}, got {task!r}")
    S, A = cfg.seq_len, cfg.answers
    ids = torch.empty(batch, S, dtype=torch.long)
    labels = torch.full((batch, S), -100, dtype=torch.long)
    rows = torch.arange(batch)[:, None]
    if task == "retrieval":
        value0, filler0 = SPECIALS + cfg.keys, SPECIALS + cfg.keys + cfg.values
        context = S - 2 * A - 2  # tokens between [R] and [Q]
        slots = context // 2
        far = (context - cfg.window) // 2  # slots ending more than `window` tokens before the queries
        if cfg.pairs > slots or A > min(cfg.pairs, far) or cfg.pairs > cfg.keys:
            raise ValueError(f"seq_len {S} is too short for {cfg.pairs} pairs and {A} far queries")
        ids[:, 0] = RETRIEVE
        ids[:, 1:1 + context] = filler0 + torch.randint(cfg.filler, (batch, context), generator=generator)
        far_slots = torch.rand(batch, far, generator=generator).argsort(1)
        queried = far_slots[:, :A]  # slots of the queried pairs (all far)
        others = torch.cat([far_slots[:, A:], torch.arange(far, slots).expand(batch, -1)], 1)
        rest = others.gather(1, torch.rand(batch, others.shape[1], generator=generator).argsort(1))
        slot = torch.cat([queried, rest[:, :cfg.pairs - A]], 1)  # [B, pairs]
        keys = SPECIALS + torch.rand(batch, cfg.keys, generator=generator).argsort(1)[:, :cfg.pairs]
        values = value0 + torch.randint(cfg.values, (batch, cfg.pairs), generator=generator)
        ids[rows, 1 + 2 * slot] = keys
        ids[rows, 2 + 2 * slot] = values
        ids[:, 1 + context] = QUERY
        answer = 2 + context + 2 * torch.arange(A)  # query-key positions; answers follow
        order = torch.rand(batch, A, generator=generator).argsort(1)
        ids[:, answer] = keys[:, :A].gather(1, order)
        ids[:, answer + 1] = values[:, :A].gather(1, order)
        labels[:, answer + 1] = ids[:, answer + 1]
    else:
        period = torch.randint(2, 7, (batch, 1), generator=generator)
        symbols = SPECIALS + cfg.keys + torch.randint(cfg.values + cfg.filler, (batch, 6), generator=generator)
        ids[:, 0] = CONTINUE
        ids[:, 1:] = symbols.gather(1, torch.arange(S - 1)[None] % period)
        labels[:, S - 2 * A:] = ids[:, S - 2 * A:]
    prompt = torch.arange(S)[None].expand(batch, S) < cfg.prompt_len
    return {"input_ids": ids, "labels": labels, "attention_mask": torch.ones_like(ids), "prompt_mask": prompt,
            "task": [task] * batch}


def mixed_batch(cfg: ProofConfig, batch: int, generator: torch.Generator) -> dict:
    """Half retrieval, half local (retrieval first)."""
    parts = [make_batch(cfg, task, n, generator) for task, n in zip(TASKS, (batch - batch // 2, batch // 2))]
    return {key: (parts[0][key] + parts[1][key]) if key == "task" else torch.cat([p[key] for p in parts])
            for key in parts[0]}


def to_device(batch: dict, device: torch.device) -> dict:
    return {k: v.to(device) if isinstance(v, Tensor) else v for k, v in batch.items()}


# ----- model -------------------------------------------------------------------------------------------------------

def build_model(cfg: ProofConfig) -> nn.Module:
    """A randomly initialised Llama of the config's sizes (sdpa attention)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=cfg.vocab, hidden_size=cfg.hidden, intermediate_size=cfg.intermediate,
                         num_hidden_layers=cfg.layers, num_attention_heads=cfg.heads,
                         num_key_value_heads=cfg.kv_heads, max_position_embeddings=cfg.seq_len,
                         attn_implementation="sdpa", pad_token_id=PAD, bos_token_id=None, eos_token_id=None,
                         tie_word_embeddings=True)
    return LlamaForCausalLM(config)


def pretrain(model: nn.Module, cfg: ProofConfig, device: torch.device, generator: torch.Generator) -> list[float]:
    """Train the whole model on the task mixture (AdamW, warmup 10% then cosine); returns the losses."""
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.pretrain_lr, weight_decay=0.01)
    warm = max(1, cfg.pretrain_steps // 10)
    factor = lambda step: min(1.0, (step + 1) / warm) * 0.5 * (1 + math.cos(math.pi * step / cfg.pretrain_steps))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
    losses = []
    for _ in range(cfg.pretrain_steps):
        batch = to_device(mixed_batch(cfg, cfg.pretrain_batch, generator), device)
        loss = model(input_ids=batch["input_ids"], labels=batch["labels"], use_cache=False).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        losses.append(loss.detach())
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return torch.stack(losses).tolist()


# ----- evaluation -----------------------------------------------------------------------------------------------

@torch.no_grad()
def evaluate(model: nn.Module, batches: dict[str, dict]) -> dict[str, dict]:
    """Per task: teacher-forced accuracy on the answer tokens and, for a routed model, the mean MSR of its
    decisions (else None)."""
    from flexsparse.integrations import last_routings, pooling_mask, routed_layers
    from flexsparse.routers import msr

    result = {}
    for task, batch in batches.items():
        routed = bool(routed_layers(model))
        if routed:
            with pooling_mask(model, batch["prompt_mask"]):
                logits = model(input_ids=batch["input_ids"], use_cache=False).logits
            sparsity = msr([routing.is_sparse.float() for routing in last_routings(model)]).mean().item()
        else:
            logits = model(input_ids=batch["input_ids"], use_cache=False).logits
            sparsity = None
        target = batch["labels"][:, 1:]
        scored = target != -100
        correct = (logits[:, :-1].argmax(-1) == target) & scored
        result[task] = {"accuracy": (correct.sum() / scored.sum()).item(), "msr": sparsity}
    return result


def _convert_static(model: nn.Module, cfg: ProofConfig, modes: list[list[str]]) -> None:
    from flexsparse.integrations import convert

    convert(model, patterns(cfg), modes, backend=cfg.backend)


def patterns(cfg: ProofConfig) -> dict:
    from flexsparse.masks import Causal, SinkWindow

    return {"full": Causal(), "ssa": SinkWindow(cfg.sink, cfg.window)}


# ----- static selectors -------------------------------------------------------------------------------------------

@torch.no_grad()
def calibration_scores(model: nn.Module, cfg: ProofConfig, batch: dict) -> tuple[Tensor, Tensor]:
    """HSA discrepancy and retrieval scores ``[L, H_kv]`` from retrieval prompts (cut at the first query key, whose
    attention to the queried pair is what the retrieval score measures). q/k (after RoPE) and v are captured by a
    registered attention function that runs sdpa."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    from transformers.modeling_utils import AttentionInterface

    from flexsparse.routers import hsa_discrepancy, retrieval_scores

    captured: dict[int, tuple[Tensor, Tensor, Tensor]] = {}

    def capture(module, query, key, value, attention_mask, **kwargs):
        captured[module.layer_idx] = (query, key, value)
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register("router_proof_capture", capture)
    AttentionMaskInterface.register("router_proof_capture", sdpa_mask)
    previous = model.config._attn_implementation
    model.set_attn_implementation("router_proof_capture")
    try:
        length = cfg.prompt_len
        model(input_ids=batch["input_ids"][:, :length], use_cache=False)
    finally:
        model.set_attn_implementation(previous)
    prompt = batch["input_ids"][:, :length]
    key_at = prompt == prompt[:, -1:]  # the queried key in the context (keys are distinct) and the query itself
    key_at[:, -1] = False
    needle = key_at | key_at.roll(1, 1)  # the key and its value
    sparse = patterns(cfg)["ssa"]
    discrepancy, scores = [], []
    for index, layer in enumerate(model.model.layers):
        q, k, v = captured[index]
        discrepancy.append(hsa_discrepancy(q, k, v, layer.self_attn.o_proj.weight, sparse, backend=cfg.backend,
                                           block_size=min(128, cfg.seq_len)))
        scores.append(retrieval_scores(q, k, needle))
    return torch.stack(discrepancy), torch.stack(scores)


# ----- the run ---------------------------------------------------------------------------------------------------

def train_router(model: nn.Module, cfg: ProofConfig, kind: str, device: torch.device, generator: torch.Generator,
                 out: Path | None, progress: bool) -> list[dict]:
    """Convert with a ``kind`` router and train it; returns the trainer's history."""
    from flexsparse.integrations import RouterTrainer, convert
    from flexsparse.routers import SparsityConstraint

    torch.manual_seed(cfg.seed)
    convert(model, patterns(cfg), router=kind, router_options={"pool_size": cfg.pool_size}, backend=cfg.backend)
    constraint = SparsityConstraint.from_categories(["local"], ["retrieval"], robust_target=cfg.robust_target,
                                                    sensitive_target=cfg.sensitive_target, seed=cfg.seed)
    log = None if out is None else out / f"{kind}-router-log.jsonl"
    if log is not None and log.exists():
        log.unlink()
    trainer = RouterTrainer(model, constraint, cfg.router_steps, router_lr=cfg.router_lr, lambda_lr=cfg.lambda_lr,
                            log_every=max(1, cfg.router_steps // 20), log_file=log, progress=progress,
                            generator=torch.Generator(device=device).manual_seed(cfg.seed),
                            checkpoint_dir=None if out is None else out / f"{kind}-router")
    batches = (to_device(mixed_batch(cfg, cfg.router_batch, generator), device) for _ in range(cfg.router_steps))
    return trainer.train(batches)


def run_proof(cfg: ProofConfig = TOY, device: str | torch.device = "cpu", out: str | Path | None = None,
              progress: bool = False) -> dict:
    """The whole proof; returns the report (and writes it into ``out`` when given)."""
    from flexsparse.integrations import revert
    from flexsparse.routers import hsa_selection, retrieval_selection

    device = torch.device(device)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    out = None if out is None else Path(out)
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(cfg.seed)
    generator = torch.Generator().manual_seed(cfg.seed)
    timings = {}
    start = time.perf_counter()
    model = build_model(cfg).to(device)
    losses = pretrain(model, cfg, device, generator)
    timings["pretrain_s"] = time.perf_counter() - start
    eval_gen = torch.Generator().manual_seed(cfg.seed + 1)
    held_out = {task: to_device(make_batch(cfg, task, cfg.eval_batch, eval_gen), device) for task in TASKS}
    report: dict = {"config": asdict(cfg), "device": str(device), "pretrain_loss_first_last": [losses[0],
                                                                                               losses[-1]]}
    results = {"all_full": evaluate(model, held_out)}
    _convert_static(model, cfg, [["ssa"] * cfg.kv_heads] * cfg.layers)
    results["all_sparse"] = evaluate(model, held_out)
    for task in TASKS:
        results["all_full"][task]["msr"], results["all_sparse"][task]["msr"] = 0.0, 1.0
    revert(model)

    start = time.perf_counter()
    history = {}
    for kind in ("head", "layer"):
        history[kind] = train_router(model, cfg, kind, device, generator, out, progress)
        results[f"{kind}_router"] = evaluate(model, held_out)
        revert(model)
    timings["routers_s"] = time.perf_counter() - start

    rho = sum(results["head_router"][task]["msr"] for task in TASKS) / len(TASKS)
    calibration = to_device(make_batch(cfg, "retrieval", min(cfg.eval_batch, 64), eval_gen), device)
    discrepancy, scores = calibration_scores(model, cfg, calibration)
    for name, modes in (("hsa_static", hsa_selection(discrepancy, rho, sparse="ssa")),
                        ("retrieval_static", retrieval_selection(scores, rho, sparse="ssa"))):
        _convert_static(model, cfg, modes)
        results[name] = evaluate(model, held_out)
        static_msr = sum(m == "ssa" for row in modes for m in row) / (cfg.layers * cfg.kv_heads)
        for task in TASKS:
            results[name][task]["msr"] = static_msr
        results[name]["modes"] = modes
        revert(model)
    report.update(results=results, static_rho=rho, timings=timings,
                  router_history={kind: h[-1] if h else None for kind, h in history.items()})
    report["targets"] = targets(results)
    if out is not None:
        (out / "router-proof.json").write_text(json.dumps(report, indent=2) + "\n")
        (out / "router-proof.txt").write_text(table(report) + "\n")
    return report


def targets(results: dict) -> dict:
    """The issue's targets for each router: retrieval accuracy within 5 points of all-full, and the local task's MSR
    above the retrieval task's by 0.2."""
    full = results["all_full"]["retrieval"]["accuracy"]
    found = {}
    for kind in ("head_router", "layer_router"):
        r = results[kind]
        found[kind] = {"retrieval_gap_points": 100 * (full - r["retrieval"]["accuracy"]),
                       "msr_gap": r["local"]["msr"] - r["retrieval"]["msr"]}
        found[kind]["met"] = found[kind]["retrieval_gap_points"] <= 5 and found[kind]["msr_gap"] >= 0.2
    return found


def table(report: dict) -> str:
    rows = ["method              retrieval acc  retrieval MSR  local acc  local MSR"]
    for name, r in report["results"].items():
        rows.append(f"{name:<20}{r['retrieval']['accuracy']:>13.3f}{r['retrieval']['msr']:>15.3f}"
                    f"{r['local']['accuracy']:>11.3f}{r['local']['msr']:>11.3f}")
    for kind, t in report["targets"].items():
        rows.append(f"{kind}: retrieval gap {t['retrieval_gap_points']:.1f} points (target <= 5), MSR gap "
                    f"{t['msr_gap']:.2f} (target >= 0.2): {'met' if t['met'] else 'not met'}")
    return "\n".join(rows)


# ----- overhead -----------------------------------------------------------------------------------------------

@torch.no_grad()
def router_overhead(lengths: tuple[int, ...] = (8192, 131072, 1048576), *, kind: str = "head", kv_heads: int = 8,
                    heads: int = 32, head_dim: int = 128, pool_size: int = 100, batch: int = 1,
                    dtype: torch.dtype = torch.bfloat16, device: str = "cuda", repeats: int = 50) -> dict[int, float]:
    """Milliseconds per layer of routing one prefill (``router.route`` in eval mode on states ``[B, S, H, d]``
    with a padding mask, then ``routing.modes``), per prompt length; CUDA events, mean of ``repeats``."""
    from flexsparse.routers import HeadRouter, LayerRouter

    router = (HeadRouter if kind == "head" else LayerRouter)(head_dim, pool_size).to(device).eval()
    result = {}
    for length in lengths:
        states = torch.randn(batch, length, kv_heads if kind == "head" else heads, head_dim, device=device,
                             dtype=dtype)
        mask = torch.ones(batch, length, dtype=torch.bool, device=device)
        result[length] = cuda_ms(lambda: router.route(states, mask).modes(kv_heads), repeats)
    return result


def cuda_ms(fn, repeats: int, warmup: int = 5) -> float:
    """Mean milliseconds of ``fn()`` over ``repeats`` calls, CUDA events."""
    for _ in range(warmup):
        fn()
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    begin.record()
    for _ in range(repeats):
        fn()
    end.record()
    torch.cuda.synchronize()
    return begin.elapsed_time(end) / repeats


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", default="bench/results/router-proof")
    parser.add_argument("--toy", action="store_true", help="the CPU toy sizes")
    parser.add_argument("--overhead", action="store_true", help="also time routing at 8K/128K/1M (CUDA)")
    parser.add_argument("--progress", action="store_true")
    for field, default in asdict(ProofConfig()).items():
        parser.add_argument(f"--{field.replace('_', '-')}", type=type(default), default=None)
    args = parser.parse_args(argv)
    cfg = TOY if args.toy else ProofConfig()
    overrides = {f: getattr(args, f) for f in asdict(cfg) if getattr(args, f) is not None}
    cfg = replace(cfg, **overrides)
    report = run_proof(cfg, args.device, args.out, progress=args.progress)
    print(table(report))
    print(f"timings: {report['timings']}")
    if args.overhead:
        overhead = {kind: router_overhead(kind=kind) for kind in ("head", "layer")}
        Path(args.out, "router-overhead.json").write_text(json.dumps(overhead, indent=2) + "\n")
        print(f"routing ms per layer: {overhead}")


if __name__ == "__main__":
    main()
