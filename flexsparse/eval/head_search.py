"""A head choice searched on the model's own loss: greedy refinement of a selector's choice of full KV heads.

Selectors score heads one by one (:mod:`flexsparse.eval.calibration`); how much quality a choice keeps also
depends on which other heads are sparse. The ``search`` selector starts from the gates' choice at the budget and
improves it by trying changes and keeping each that lowers the *objective*: the mean next-token NLL on
calibration text windows plus ``passkey_weight`` x the mean NLL of the pass key's answer tokens on calibration
passkey prompts (the model frozen, its attention gated full/sparse per KV head by
:func:`~flexsparse.eval.gates.gated` with hard gates, so no change converts or recompiles anything).

Moves keep the budget:

* per layer (``per_layer=True``): for each layer in turn, every other choice of its ``k`` full heads (``H choose
  k`` - 1 forwards per layer); ``rounds`` sweeps over the layers;
* global: first the per-layer sweep with the starting choice's counts per layer, then ``rounds`` rounds of swaps
  between layers: the ``candidates`` full heads of lowest starting score against the ``candidates`` sparse heads of
  highest score; each round keeps the best swap that lowers the objective.

Cost: one objective per move, each a forward of the calibration windows with both attentions per head (on an
H100, SmolLM2-135M, 3 windows of 8K + 8 passkey prompts of 2K: ~0.5 s).
"""

from __future__ import annotations

import itertools
import math
import random
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from flexsparse.eval.gates import gated
from flexsparse.eval.router_fitting import passkey_batch
from flexsparse.eval.text import Corpus
from flexsparse.integrations.transformers import attention_layers, layer_heads
from flexsparse.masks import Pattern
from flexsparse.validation import as_float, as_int

Objective = Callable[[Tensor], float]
"""The loss of a choice: bool ``[L, H_kv]`` (True = full) -> float (lower is better)."""

_HARD_LOGIT = 30.0  # sigmoid(30) is 1.0 in float32: a hard gate
_CHUNK = 2048  # positions per LM-head chunk


@dataclass(frozen=True)
class SearchOptions:
    """``rounds``: sweeps over the layers (per layer) or swap rounds (global); ``candidates``: heads per side of the
    global swaps; ``text_length`` / ``text_windows``: the calibration text windows the NLL is measured on (default
    length: the calibration length); ``passkey_length`` / ``passkey_prompts``: the passkey prompts (default length:
    the calibration length); ``passkey_weight``: their answer NLL's weight in the objective."""

    rounds: int = 1
    candidates: int = 6
    text_length: int | None = None
    text_windows: int = 3
    passkey_length: int | None = None
    passkey_prompts: int = 8
    passkey_weight: float = 0.1


# ----- the search on any objective ---------------------------------------------------------------------------

def _better(objective: Objective, current: float, trials: Sequence[Tensor]) -> tuple[float, Tensor | None]:
    """The best of ``trials`` if it beats ``current``."""
    best, found = current, None
    for trial in trials:
        value = objective(trial)
        if value < best:
            best, found = value, trial
    return best, found


def refine_per_layer(full: Tensor, objective: Objective, rounds: int = 1) -> tuple[Tensor, float]:
    """Greedy coordinate search: per layer, every choice of as many full heads as it has now, the others fixed;
    ``rounds`` sweeps. Returns the choice (bool ``[L, H_kv]``) and its objective."""
    full = full.clone()
    current = objective(full)
    heads = full.shape[1]
    for _ in range(as_int("rounds", rounds, minimum=0)):
        changed = False
        for layer in range(full.shape[0]):
            count = int(full[layer].sum())
            if count in (0, heads):
                continue
            trials = []
            for chosen in itertools.combinations(range(heads), count):
                row = torch.zeros(heads, dtype=torch.bool)
                row[list(chosen)] = True
                if not torch.equal(row, full[layer]):
                    trial = full.clone()
                    trial[layer] = row
                    trials.append(trial)
            current, found = _better(objective, current, trials)
            if found is not None:
                full, changed = found, True
        if not changed:
            break
    return full, current


def refine_by_swaps(full: Tensor, scores: Tensor, objective: Objective, rounds: int = 1,
                    candidates: int = 6) -> tuple[Tensor, float]:
    """Swaps between any two heads: each round tries the ``candidates`` full heads of lowest ``scores`` against the
    ``candidates`` sparse heads of highest and keeps the best swap that lowers the objective. Returns the choice and
    its objective."""
    full = full.clone()
    current = objective(full)
    candidates = as_int("candidates", candidates, minimum=1)
    flat_scores = scores.flatten()
    for _ in range(as_int("rounds", rounds, minimum=0)):
        flat = full.flatten()
        kept = [int(i) for i in torch.nonzero(flat).flatten()]
        dropped = [int(i) for i in torch.nonzero(~flat).flatten()]
        kept = sorted(kept, key=lambda i: float(flat_scores[i]))[:candidates]
        dropped = sorted(dropped, key=lambda i: -float(flat_scores[i]))[:candidates]
        trials = []
        for out, into in itertools.product(kept, dropped):
            trial = flat.clone()
            trial[out], trial[into] = False, True
            trials.append(trial.view_as(full))
        current, found = _better(objective, current, trials)
        if found is None:
            break
        full = found
    return full, current


# ----- the objective on a real model -------------------------------------------------------------------------

def _answer_nll(model: nn.Module, batch: dict, device: torch.device) -> tuple[float, int]:
    """Summed NLL of the labelled (answer) tokens of a passkey batch and their count."""
    ids, labels = batch["input_ids"].to(device), batch["labels"].to(device)
    hidden = model.get_decoder()(input_ids=ids, use_cache=False).last_hidden_state[:, :-1]
    targets = labels[:, 1:]
    keep = targets != -100
    logits = model.get_output_embeddings()(hidden[keep]).float()
    return float(F.cross_entropy(logits, targets[keep], reduction="sum")), int(keep.sum())


def _text_nll(model: nn.Module, ids: Tensor) -> tuple[float, int]:
    """Summed next-token NLL of windows ``[N, S]`` and the number of predicted tokens."""
    hidden = model.get_decoder()(input_ids=ids, use_cache=False).last_hidden_state[:, :-1]
    hidden, targets = hidden.reshape(-1, hidden.shape[-1]), ids[:, 1:].reshape(-1)
    total = 0.0
    for start in range(0, len(targets), _CHUNK):
        part = slice(start, start + _CHUNK)
        logits = model.get_output_embeddings()(hidden[part]).float()
        total += float(F.cross_entropy(logits, targets[part], reduction="sum"))
    return total, len(targets)


class CalibrationObjective:
    """The search objective's prompts (see the module docstring) and its value on ``model`` as it runs now
    (:meth:`measure`): ``windows`` ``[N, S]`` of calibration text and ``passkeys`` (batches of one prompt each,
    labels on the answer tokens), ``weight`` the passkey term's."""

    def __init__(self, model: nn.Module, tokenizer, corpus: Corpus, options: SearchOptions, length: int,
                 seed: int = 0) -> None:
        self.model, self.device, self.options = model, next(model.parameters()).device, options
        text_length = as_int("text_length", options.text_length or length, minimum=64)
        passkey_length = as_int("passkey_length", options.passkey_length or length, minimum=64)
        self.windows = corpus.windows(text_length, as_int("text_windows", options.text_windows, minimum=1),
                                      split="calibration")
        rng = random.Random(f"head-search/{seed}")
        prompts = as_int("passkey_prompts", options.passkey_prompts, minimum=0)
        self.passkeys = [passkey_batch(corpus, tokenizer, passkey_length, 1, rng) for _ in range(prompts)]
        self.weight = as_float("passkey_weight", options.passkey_weight, minimum=0.0)
        self.max_len = max(text_length, passkey_length)
        self.evaluations = 0
        self.parts: dict[str, float] = {}
        """The last measure's text NLL and passkey answer NLL (nats per token)."""

    @torch.no_grad()
    def measure(self, what: str = "the model") -> float:
        """The objective of the model as it runs now (lower is better); ``what`` names it in the error raised
        when the value is not finite."""
        total, count = 0.0, 0
        for window in self.windows:
            nll, tokens = _text_nll(self.model, window[None].to(self.device))
            total, count = total + nll, count + tokens
        value = total / count
        self.parts = {"text_nll": value}
        if self.passkeys and self.weight:
            answer = [_answer_nll(self.model, batch, self.device) for batch in self.passkeys]
            self.parts["passkey_nll"] = sum(nll for nll, _ in answer) / sum(n for _, n in answer)
            value += self.weight * self.parts["passkey_nll"]
        self.evaluations += 1
        if not math.isfinite(value):
            raise RuntimeError(f"the search objective is {value} for {what}")
        return value


class ModelObjective(CalibrationObjective):
    """The search objective on ``model`` with KV heads gated full or ``sparse``: call it with a choice inside
    :meth:`gates_on` (which runs the model gated)."""

    def __init__(self, model: nn.Module, tokenizer, corpus: Corpus, sparse: Pattern, options: SearchOptions,
                 length: int, seed: int = 0) -> None:
        super().__init__(model, tokenizer, corpus, options, length, seed)
        layers = attention_layers(model)
        self.logits = torch.zeros(len(layers), layer_heads(layers[0][1])[1], device=self.device)
        self.sparse = sparse

    def gates_on(self):
        """The context in which calls evaluate: the model gated by this objective's (hard) gates."""
        return gated(self.model, self.logits, self.sparse, max(8192, self.max_len))

    def __call__(self, full: Tensor) -> float:
        self.logits.copy_(torch.where(full, _HARD_LOGIT, -_HARD_LOGIT).to(self.device))
        return self.measure(f"a choice of {int(full.sum())} full heads")


def search_heads(model: nn.Module, tokenizer, corpus: Corpus, start: Tensor, scores: Tensor, sparse: Pattern, *,
                 per_layer: bool, length: int, options: SearchOptions = SearchOptions(), seed: int = 0,
                 progress: bool = False) -> tuple[Tensor, dict]:
    """Refine the choice ``start`` (bool ``[L, H_kv]``, True = full) on the model's own loss (see the module
    docstring); ``scores`` ``[L, H_kv]`` order the global swap candidates. Returns the choice and a summary
    (objective before and after, evaluations, seconds); ``progress``: print the summary to stderr."""
    if not isinstance(start, Tensor) or start.dtype != torch.bool or start.shape != scores.shape:
        raise ValueError(f"start must be a bool tensor of the scores' shape {tuple(scores.shape)}")
    began = time.perf_counter()
    objective = ModelObjective(model, tokenizer, corpus, sparse, options, length, seed)
    with objective.gates_on():
        before = objective(start)
        parts_before = objective.parts
        full, _ = refine_per_layer(start, objective, options.rounds if per_layer else 1)
        if not per_layer:
            full, _ = refine_by_swaps(full, scores, objective, options.rounds, options.candidates)
        evaluations = objective.evaluations
        after = objective(full)  # also leaves the found choice's parts
    summary = {"objective_start": before, "objective": after, "start_parts": parts_before,
               "parts": objective.parts, "evaluations": evaluations, "changed_heads": int((full != start).sum()),
               "seconds": time.perf_counter() - began}
    if progress:
        parts = ", ".join(f"{name} {parts_before[name]:.4f} -> {value:.4f}" for name, value in objective.parts.items())
        print(f"search ({'per layer' if per_layer else 'global'}): objective {before:.4f} -> {after:.4f} ({parts}), "
              f"{summary['changed_heads']} heads changed, {evaluations} evaluations in {summary['seconds']:.1f} s",
              file=sys.stderr, flush=True)
    return full, summary
