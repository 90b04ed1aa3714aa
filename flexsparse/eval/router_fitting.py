"""Routers fitted on a real model: :func:`train_routers` trains an Elastic head router or a Flux layer router of
a frozen transformers causal LM on real text and passkey prompts, meets a budget of full KV heads, and saves a
configuration :func:`~flexsparse.integrations.load_config` reads.

One call:

1. converts the model with ``{"full": Causal(), "sparse": sparse}`` and a router per layer (``kind="head"``: one
   decision per sequence and KV head; ``"layer"``: one per sequence and layer);
2. trains the routers with :class:`~flexsparse.integrations.RouterTrainer` (the model frozen) on batches of the
   corpus's *calibration* part (never the evaluated part): ``text`` batches of random windows with the LM loss on
   every token, and ``passkey`` batches of passkey prompts (:func:`~flexsparse.eval.tasks.passkey_prompt`, random
   depths) with the LM loss on the answer only, so that retrieval costs loss when its heads go sparse. Each batch
   holds one task (the LM loss is a mean over labelled tokens: mixed, the few answer tokens would drown). The
   routers pool the prompt (a passkey prompt without its answer). The sparsity constraint targets an MSR of
   ``1 - budget`` for both tasks (``targets`` overrides it per task);
3. matches the budget: the Lagrangian constrains the *sampled* decisions in training, while inference takes the
   argmax, whose sparse share can differ (logits that are not yet decisive). One offset added to every router's
   sparse logit makes the argmax decisions on fresh calibration batches (``check_batches`` per task) sparse in
   ``round((1 - budget) x N)`` of their N (sequence, layer, group) slots, up to the few that flip when earlier
   layers' decisions move later layers' states (three rounds of matching): a threshold, as DuoAttention picks
   one for its gates. The same matching is applied to the untrained routers first, so the fit reports the
   LM loss of trained and untrained (random) routing at the same budget on the same batches;
4. saves the configuration (routers included) and ``router_fit.json`` (settings, the training log, the check
   results) into ``out``, and reverts the model: it is left as it came (``load_config(model, out)`` routes it).

Backends: ``"auto"`` trains with HybridAttention's choice (compiled flex forward and backward on CUDA, dense on
CPU, where flex has no backward); ``"dense"`` (masked SDPA, O(S^2)) avoids compilation at a few thousand tokens.
"""

from __future__ import annotations

import json
import math
import random
import time
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import Tensor, nn

from flexsparse.eval.tasks import passkey_prompt
from flexsparse.eval.text import Corpus
from flexsparse.integrations.router_trainer import RouterTrainer
from flexsparse.integrations.routing import last_routings, pooling_mask, routed_layers
from flexsparse.integrations.serialization import save_config
from flexsparse.integrations.transformers import convert, is_converted, revert
from flexsparse.masks import Causal, Pattern, SinkWindow
from flexsparse.routers import SparsityConstraint
from flexsparse.routers.relaxation import SPARSE
from flexsparse.validation import as_float, as_int

TASK_NAMES = ("text", "passkey")
"""The training tasks: real-text windows (LM loss on every token) and passkey prompts (on the answer)."""
DEFAULT_SPARSE = SinkWindow(sink=64, window=256)
FIT_FILE = "router_fit.json"
KINDS = ("head", "layer")


# ----- batches ---------------------------------------------------------------------------------------------------

def text_batch(corpus: Corpus, length: int, count: int, rng: random.Random) -> dict:
    """``count`` windows of ``length`` tokens from random offsets of the calibration text: input_ids, labels (every
    token), prompt_mask (every token) ``[count, length]`` and task names."""
    ids = torch.tensor([corpus.haystack(length, rng, "calibration") for _ in range(count)], dtype=torch.long)
    return {"input_ids": ids, "labels": ids.clone(), "prompt_mask": torch.ones(ids.shape, dtype=torch.bool),
            "task": ["text"] * count}


def passkey_batch(corpus: Corpus, tokenizer, length: int, count: int, rng: random.Random) -> dict:
    """``count`` passkey prompts of ``length`` tokens on calibration haystacks, each ending with its answer, the
    pass key at a random depth in [0.1, 0.9]: labels on the answer tokens only, prompt_mask on the others."""
    prompts = [passkey_prompt(corpus, tokenizer, length, rng, rng.uniform(0.1, 0.9), "calibration")
               for _ in range(count)]
    ids = torch.tensor([p.ids for p in prompts], dtype=torch.long)
    answer = torch.zeros(ids.shape, dtype=torch.bool)
    for row, prompt in enumerate(prompts):
        answer[row, len(prompt.ids) - prompt.answer_len:] = True
    return {"input_ids": ids, "labels": ids.masked_fill(~answer, -100), "prompt_mask": ~answer,
            "task": ["passkey"] * count}


def training_batches(corpus: Corpus, tokenizer, length: int, batch_size: int, passkey_share: float,
                     rng: random.Random) -> Iterator[dict]:
    """Endless one-task batches: a ``passkey_share`` of them passkey batches, spread evenly, the rest text."""
    step = 0
    while True:
        is_passkey = math.floor((step + 1) * passkey_share) > math.floor(step * passkey_share)
        yield (passkey_batch(corpus, tokenizer, length, batch_size, rng) if is_passkey
               else text_batch(corpus, length, batch_size, rng))
        step += 1


def check_set(corpus: Corpus, tokenizer, length: int, batch_size: int, count: int, passkey: bool = True,
              seed: int = 0) -> list[dict]:
    """The check batches of :func:`train_routers` (same arguments, same batches): ``count`` text batches, then
    ``count`` passkey batches when ``passkey``, drawn from a generator of their own (not the training one)."""
    rng = random.Random(f"router-fit/check/{seed}")
    batches = [text_batch(corpus, length, batch_size, rng) for _ in range(count)]
    if passkey:
        batches += [passkey_batch(corpus, tokenizer, length, batch_size, rng) for _ in range(count)]
    return batches


# ----- checks of the eval-mode decisions -------------------------------------------------------------------------

def _to(batch: dict, device: torch.device) -> dict:
    return {k: v.to(device) if isinstance(v, Tensor) else v for k, v in batch.items()}


@torch.no_grad()
def sparse_margins(model: nn.Module, batches: list[dict]) -> Tensor:
    """Eval-mode routing margins (sparse logit minus full logit), float32 ``[N]``: every (sequence, layer, group)
    slot of ``batches`` (the routers pool each batch's ``prompt_mask``)."""
    device = next(model.parameters()).device
    found = []
    for batch in batches:
        batch = _to(batch, device)
        with pooling_mask(model, batch["prompt_mask"]):
            model.get_decoder()(input_ids=batch["input_ids"], use_cache=False)
        found += [(r.logits[..., SPARSE] - r.logits[..., 1 - SPARSE]).float().flatten() for r in last_routings(model)]
    return torch.cat(found)


def budget_offset(margins: Tensor, sparse_share: float) -> float:
    """The offset that, added to every margin, makes exactly ``round(sparse_share x N)`` of the N margins
    positive (sparse): the midpoint between the k-th and (k+1)-th largest margins (1 beyond the ends)."""
    ordered = margins.double().sort(descending=True).values.cpu()
    k = round(as_float("sparse_share", sparse_share, minimum=0.0, maximum=1.0) * len(ordered))
    if k == 0:
        return float(-ordered[0]) - 1.0
    if k == len(ordered):
        return float(-ordered[-1]) + 1.0
    return float(-(ordered[k - 1] + ordered[k]) / 2)


def shift_sparse_logits(model: nn.Module, offset: float) -> None:
    """Add ``offset`` to the sparse logit of every router of ``model`` (the last linear layer's bias)."""
    with torch.no_grad():
        for layer in routed_layers(model):
            layer.router.router_mlp[-1].bias[SPARSE] += offset


@torch.no_grad()
def routed_quality(model: nn.Module, batches: list[dict]) -> dict:
    """Eval-mode LM loss and MSR (share of sparse slots) per task, over ``batches``."""
    device = next(model.parameters()).device
    sums: dict[str, list[float]] = {}
    for batch in batches:
        batch = _to(batch, device)
        with pooling_mask(model, batch["prompt_mask"]):
            loss = model(input_ids=batch["input_ids"], labels=batch["labels"], use_cache=False).loss
        sparse = torch.cat([r.is_sparse.float().flatten(1) for r in last_routings(model)], 1).mean()
        task = batch["task"][0]
        total = sums.setdefault(task, [0.0, 0.0, 0])
        total[0] += float(loss)
        total[1] += float(sparse)
        total[2] += 1
    return {"lm_loss": {t: s[0] / s[2] for t, s in sums.items()}, "msr": {t: s[1] / s[2] for t, s in sums.items()}}


def matched_check(model: nn.Module, batches: list[dict], sparse_share: float, rounds: int = 3) -> dict:
    """Match the budget on ``batches`` and measure the routed model there: ``offset`` (the sum of ``rounds`` of
    :func:`budget_offset`, each applied with :func:`shift_sparse_logits` to the margins the previous offsets give:
    a layer's states depend on the earlier layers' decisions, so one round moves later margins), ``raw_msr``
    (the argmax MSR before any offset) and :func:`routed_quality`."""
    offset = raw_msr = 0.0
    for round_ in range(rounds):
        margins = sparse_margins(model, batches)
        if round_ == 0:
            raw_msr = float((margins > 0).float().mean())
        step = budget_offset(margins, sparse_share)
        shift_sparse_logits(model, step)
        offset += step
    return {"offset": offset, "raw_msr": raw_msr, **routed_quality(model, batches)}


# ----- the fit ---------------------------------------------------------------------------------------------------

@dataclass
class RouterFit:
    """What :func:`train_routers` did: ``directory`` (the saved configuration), its settings, the trainer's
    ``history`` (one record per logged step), and the checks on fresh calibration batches at the budget:
    ``untrained`` and ``trained`` routers, each with ``offset`` (added to the sparse logits), ``raw_msr`` (argmax
    MSR before the offset), ``lm_loss`` and ``msr`` per task. ``seconds``: training time (checks excluded)."""

    kind: str
    directory: Path
    settings: dict
    history: list[dict] = field(default_factory=list)
    untrained: dict = field(default_factory=dict)
    trained: dict = field(default_factory=dict)
    seconds: float = 0.0

    def to_dict(self) -> dict:
        return {**asdict(self), "directory": str(self.directory)}


def _check_arguments(model: nn.Module, kind: str, sparse: Pattern, budget: float,
                     targets: Mapping[str, float] | None) -> dict[str, float]:
    if not isinstance(model, nn.Module) or not hasattr(model, "get_decoder"):
        raise TypeError(f"model must be a transformers causal LM, got {type(model).__name__}")
    if is_converted(model):
        raise ValueError("model is converted: train routers on an unconverted model (flexsparse.revert(model))")
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    if not isinstance(sparse, Pattern) or sparse.is_full or sparse.is_dynamic:
        raise TypeError(f"sparse must be a static sparse flexsparse Pattern (e.g. SinkWindow(64, 256)), got "
                        f"{sparse!r}")
    sparse.config()  # save_config must describe it: fail now, not after training
    budget = as_float("budget", budget, minimum=0.0, maximum=1.0)
    if targets is None:
        return {task: 1.0 - budget for task in TASK_NAMES}
    if not isinstance(targets, Mapping) or set(targets) != set(TASK_NAMES):
        raise ValueError(f"targets must map exactly the tasks {list(TASK_NAMES)} to target MSRs, got {targets!r}")
    return {task: as_float(f"targets[{task!r}]", targets[task], minimum=0.0, maximum=1.0) for task in TASK_NAMES}


def train_routers(model: nn.Module, tokenizer, out: str | Path, kind: str = "head", *,
                  sparse: Pattern = DEFAULT_SPARSE, budget: float = 1 / 3, targets: Mapping[str, float] | None = None,
                  steps: int = 200, length: int = 2048, batch_size: int = 4, passkey_share: float = 0.5,
                  check_batches: int = 2, corpus: Corpus | None = None, pool_size: int = 100,
                  router_lr: float = 2e-3, lambda_lr: float = 1e-2, backend: str = "auto", block_size: int = 128,
                  log_every: int = 10, seed: int = 0, progress: bool = False) -> RouterFit:
    """Train a ``kind`` router ("head": Elastic Attention; "layer": Flux Attention) per layer of the frozen
    ``model`` choosing full attention or ``sparse`` per sequence, keep ``budget`` of the (layer, KV head) slots
    full, save the configuration into ``out``; see the module docstring. Returns a :class:`RouterFit`.

    Args:
        model: an unconverted transformers causal LM (left unconverted, its ``requires_grad`` flags restored).
        tokenizer: its tokenizer (passkey prompts; the corpus when ``corpus`` is None).
        out: the directory of the saved configuration (created).
        sparse: the sparse pattern (one that ``save_config`` describes: SinkWindow, ...).
        budget: share of slots kept full; the constraint's target MSR is ``1 - budget``.
        targets: per-task target MSRs ``{"text": t, "passkey": t}`` instead (the budget still sets the offset).
        steps, length, batch_size: training steps, tokens per sequence, sequences per batch.
        passkey_share: the share of passkey batches (0: text only).
        check_batches: fresh batches per task for matching the budget and measuring the fit.
        corpus: the text (default: the pydoc topics, :meth:`Corpus.from_text`); only its calibration part is read.
        pool_size: the routers' P (first and last P prompt tokens pooled).
        router_lr, lambda_lr: RouterTrainer's rates (larger than the papers': a run of a few hundred steps).
        backend, block_size: HybridAttention's, for training and in the saved configuration.
        log_every: steps between the trainer's log records (one host sync each).
        seed: router initialisation, Gumbel noise, batches and constraint multipliers.
    """
    targets = _check_arguments(model, kind, sparse, budget, targets)
    steps = as_int("steps", steps, minimum=1)
    length = as_int("length", length, minimum=64)
    batch_size = as_int("batch_size", batch_size, minimum=1)
    check_batches = as_int("check_batches", check_batches, minimum=1)
    passkey_share = as_float("passkey_share", passkey_share, minimum=0.0, maximum=1.0)
    corpus = Corpus.from_text(tokenizer) if corpus is None else corpus
    if not isinstance(corpus, Corpus):
        raise TypeError(f"corpus must be a flexsparse.eval.text.Corpus, got {type(corpus).__name__}")
    out = Path(out)
    device = next(model.parameters()).device
    settings = {"kind": kind, "sparse": sparse.config(), "budget": budget, "targets": targets,
                "steps": steps, "length": length, "batch_size": batch_size, "passkey_share": passkey_share,
                "check_batches": check_batches, "pool_size": pool_size, "router_lr": router_lr,
                "lambda_lr": lambda_lr, "backend": backend, "block_size": block_size, "seed": seed}
    checks = check_set(corpus, tokenizer, length, batch_size, check_batches, passkey_share > 0, seed)
    batches = training_batches(corpus, tokenizer, length, batch_size, passkey_share,
                               random.Random(f"router-fit/train/{seed}"))
    flags = {p: p.requires_grad for p in model.parameters()}
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(seed)
        convert(model, {"full": Causal(), "sparse": sparse}, router=kind,
                router_options={"pool_size": pool_size, "full": "full", "sparse": "sparse"}, backend=backend,
                block_size=block_size)
    fit = RouterFit(kind, out, settings)
    try:
        initial = {name: p.detach().clone() for name, p in model.named_parameters() if "router" in name}
        fit.untrained = matched_check(model, checks, 1.0 - budget)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name in initial:
                    p.copy_(initial[name])
        constraint = SparsityConstraint(targets, seed=seed)
        trainer = RouterTrainer(model, constraint, steps, router_lr=router_lr, lambda_lr=lambda_lr,
                                log_every=log_every, progress=progress,
                                generator=torch.Generator(device=device).manual_seed(seed))
        start = time.perf_counter()
        fit.history = trainer.train(batches)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        fit.seconds = time.perf_counter() - start
        fit.trained = matched_check(model, checks, 1.0 - budget)
        save_config(model, out)
        (out / FIT_FILE).write_text(json.dumps(fit.to_dict(), indent=2) + "\n")
    finally:
        revert(model)
        for p, flag in flags.items():
            p.requires_grad_(flag)
    return fit
