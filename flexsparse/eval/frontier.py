"""``flexsparse calibrate --method frontier``: one attention option per KV head under a budget of attention tiles
and/or KV bytes at a length, and the whole quality-against-budget frontier.

Every KV head of every layer takes one option (:mod:`flexsparse.eval.head_options`): full attention, sink + window
for a set of windows (default 128 ... 2048, sink 64), or XAttention at a set of thresholds (default 0.9, 0.8). The
user states a :class:`~flexsparse.eval.budget.Budget` at a length L: ``tiles``, the fraction of the causal
attention tiles (128 x 128) computed at L, and/or ``kv``, the fraction of a full KV cache's bytes kept at L
(XAttention heads keep every key, a sink + window head ``min(L, sink + window)``). The objective is the ``search``
selector's (:class:`~flexsparse.eval.head_search.CalibrationObjective`): the model's own mean next-token NLL on
calibration text windows of L tokens plus ``passkey_weight`` x the NLL of the pass key's answer on calibration
passkey prompts of L tokens. Nothing of the evaluated text is seen.

The method (:func:`calibrate_frontier`):

1. **Effects.** One forward and backward of the full model per calibration batch gives, for every (layer, KV head,
   option), the first-order change of the objective when that head alone takes that option and the same summed
   without cancellation between positions (:func:`~flexsparse.eval.option_effects.option_effects`), and
   XAttention's tile share per head on these prompts. A head's score for an option is the change's positive part
   plus 0.1 x its magnitude (:meth:`~flexsparse.eval.option_effects.OptionEffects.scores`, whose module says why:
   single-head changes do not add up, and this score is what chose best on the real model).
2. **Budgeted choice.** A greedy multiple-choice knapsack over heads (:func:`~flexsparse.eval.budget.solve`): the
   lowest added score per unit of budget saved until every budget is met, then the slack spent on the moves that
   lower the score most. Early layers stay full where that is what the budget buys best.
3. **Frontier by continuation.** The user's budget is scaled by ``points`` factors from the cheapest the options
   reach to where the tightest limit reaches 1 (and 1, the user's own). Going down from all-full, each budget is
   solved on the current scores and its **true** objective measured: the model runs with every head on its option
   (:func:`~flexsparse.eval.head_options.options_applied`, no conversion). Above the user's budget, the effects are
   then measured again with that choice as the base and the next (smaller) budget is solved on those scores: which
   heads matter changes as others go sparse, and each linearisation is used for a short step only. At the user's
   budget, the scores at its own choice solve it again (``refine_rounds`` times while that measures better); the
   budgets below it are solved on the last scores. On SmolLM2-135M at 1,024 tokens (KV budget 0.5) the choice from
   the full model's scores raised the objective by 0.010, re-solved at its own scores by 0.007, and reached from the
   choice at KV 0.7 by 0.004; at 1,024 tokens with the default options and a tiles budget of 0.6 (just above the
   cheapest, 0.583), the choice from the scores at tiles 0.72 raised it by 0.405, re-solved at its own by 0.065.
4. **Measured envelope.** Each reported point is the measured configuration of lowest objective among those that
   meet its budget, so the frontier is monotone; the user's point's configuration is the result (its
   ``flexsparse.json`` loads with :func:`flexsparse.load_config` and runs in ``flexsparse eval --config``).

Outputs (:meth:`FrontierResult.save`): ``flexsparse.json``, ``frontier.json`` (options, costs, every point with its
per-layer modes), ``frontier.csv`` and ``frontier.md`` (one row per point: budget, tiles and KV fractions, objective,
text perplexity ratio to full, per-layer options), ``frontier.png`` (objective against tiles and KV fractions; skipped
with a note without matplotlib).

Cost: one effects pass (a forward and backward of the calibration prompts, the options' attentions per layer from
the captured q/k/v) at full, one more per sparse sweep point above the user's budget (``continuation``) and per
refinement round, and one objective evaluation (a forward of the prompts) per distinct configuration measured (the
full model, the sweep points, one per refinement round). Sparse attention in these passes is
dense (masked SDPA on the patterns' masks, no compilation): O(L^2) per head. On a CPU at 512 tokens (one text
window, one passkey prompt) a pass costs about five forwards of a prompt, an evaluation two.
"""

from __future__ import annotations

import argparse
import csv
import importlib.util
import io
import json
import math
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from torch import Tensor, nn

from flexsparse.eval.budget import Budget, cheapest, envelope, evaluate_choice, solve
from flexsparse.eval.head_options import (
    DEFAULT_XA_THRESHOLDS,
    FULL,
    OptionSet,
    convert_choice,
    head_options,
    options_applied,
)
from flexsparse.eval.head_search import CalibrationObjective, SearchOptions
from flexsparse.eval.option_effects import option_effects
from flexsparse.eval.text import Corpus
from flexsparse.integrations.serialization import save_config
from flexsparse.integrations.transformers import revert
from flexsparse.validation import as_int

FRONTIER_FILE = "frontier.json"
TABLE_FILES = ("frontier.csv", "frontier.md")
PLOT_FILE = "frontier.png"


@dataclass
class FrontierPoint:
    """One measured configuration at a budget: ``scale`` (the user's budget times it), ``budget``, ``choice``
    (long ``[L, H_kv]`` option indices), its mean ``tiles`` and ``kv`` shares, the ``score`` and the ``first_order``
    objective increase of the full model's effects (summed over heads), the measured ``objective`` and its ``parts``,
    and which scores chose it (``source``: the full model's, or those at the choice of another scale)."""

    scale: float
    budget: Budget
    choice: Tensor
    tiles: float
    kv: float
    score: float
    first_order: float
    objective: float
    parts: dict[str, float]
    source: str = "scores at full"


@dataclass
class FrontierResult:
    """The configuration at the user's budget (``chosen``), the frontier (``points``, ascending budget, each the
    best measured configuration that meets it), the full model's objective and how the search went."""

    options: OptionSet
    budget: Budget
    chosen: FrontierPoint
    points: list[FrontierPoint]
    full_objective: float
    full_parts: dict[str, float]
    seconds: float
    evaluations: int
    linearisations: list[dict] = field(default_factory=list)
    """The effects passes: the scale of the budget whose choice was the base (None: the full model), that choice's
    objective and the seconds the pass took."""
    skipped: list[str] = field(default_factory=list)
    """Sweep budgets no choice was found for (two budgets the greedy could not meet together)."""
    measured: list[FrontierPoint] = field(default_factory=list)
    """Every configuration measured, at the budget it was solved for (the frontier's points are among them)."""

    def modes(self, point: FrontierPoint | None = None) -> list[list[str]]:
        """Option names per layer and KV head of ``point`` (default: the chosen one)."""
        point = self.chosen if point is None else point
        return [[self.options.names[i] for i in row] for row in point.choice.tolist()]

    def layer_codes(self, point: FrontierPoint) -> list[str]:
        """Per layer, its heads' options in short: ``F`` full, ``W256`` sink + window 256, ``X0.9`` XAttention."""
        short = [_short(name) for name in self.options.names]
        return ["/".join(short[i] for i in row) for row in point.choice.tolist()]

    def row(self, point: FrontierPoint) -> dict:
        """One point as a flat, JSON-ready row (what the tables show)."""
        text = point.parts.get("text_nll")
        return {
            "scale": round(point.scale, 6),
            **{f"{kind}_budget": None if getattr(point.budget, kind) is None else round(getattr(point.budget, kind), 6)
               for kind in ("tiles", "kv")},
            "tiles": round(point.tiles, 6), "kv": round(point.kv, 6), "objective": round(point.objective, 6),
            "objective_increase": round(point.objective - self.full_objective, 6),
            "score": round(point.score, 6), "first_order_increase": round(point.first_order, 6),
            "text_ppl_ratio": None if text is None else round(math.exp(text - self.full_parts["text_nll"]), 6),
            "passkey_nll": None if "passkey_nll" not in point.parts else round(point.parts["passkey_nll"], 6),
            "full_heads": int((point.choice == 0).sum()), "source": point.source,
            "layers": " ".join(self.layer_codes(point)),
        }

    def as_dict(self) -> dict:
        """Everything ``frontier.json`` holds."""
        return {"method": "frontier", "length": self.options.length, "block_size": self.options.block_size,
                "budget": {"tiles": self.budget.tiles, "kv": self.budget.kv}, "options": self.options.describe(),
                "full": {"objective": self.full_objective, "parts": self.full_parts},
                "chosen": {**self.row(self.chosen), "modes": self.modes()},
                "points": [{**self.row(p), "modes": self.modes(p)} for p in self.points],
                "measured": [self.row(p) for p in self.measured],
                "linearisations": self.linearisations, "skipped": self.skipped, "evaluations": self.evaluations,
                "seconds": round(self.seconds, 3)}

    def table(self) -> str:
        """The frontier as a markdown table."""
        columns = ["scale", "tiles_budget", "kv_budget", "tiles", "kv", "objective", "objective_increase",
                   "text_ppl_ratio", "passkey_nll", "full_heads", "layers"]
        lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
        for point in self.points:
            row = self.row(point)
            mark = " (yours)" if point is self.chosen else ""
            cells = ["-" if row[c] is None else f"{row[c]:.4f}" if isinstance(row[c], float) else str(row[c])
                     for c in columns]
            cells[0] += mark
            lines.append("| " + " | ".join(cells) + " |")
        return "\n".join(lines) + "\n"

    def save(self, model: nn.Module, directory: str | Path, plot: bool = True, **convert_options) -> list[Path]:
        """Write ``flexsparse.json`` (the chosen configuration: the model is converted for the call and reverted),
        ``frontier.json``, ``frontier.csv``, ``frontier.md`` and, with ``plot`` and matplotlib, ``frontier.png``.
        Returns the paths written."""
        directory = Path(directory)
        convert_choice(model, self.options, self.chosen.choice, **convert_options)
        try:
            written = [save_config(model, directory)]
        finally:
            revert(model)
        (directory / FRONTIER_FILE).write_text(json.dumps(self.as_dict(), indent=1) + "\n")
        buffer = io.StringIO()
        rows = [self.row(point) for point in self.points]
        writer = csv.DictWriter(buffer, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
        (directory / TABLE_FILES[0]).write_text(buffer.getvalue())
        (directory / TABLE_FILES[1]).write_text(self.table())
        written += [directory / FRONTIER_FILE, *(directory / name for name in TABLE_FILES)]
        if plot and importlib.util.find_spec("matplotlib") is not None:
            written.append(self.plot(directory / PLOT_FILE))
        return written

    def plot(self, path: str | Path) -> Path:
        """Objective increase over full against the tiles and the KV fractions (one panel each)."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        figure, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
        increase = [p.objective - self.full_objective for p in self.points]
        for axis, kind in zip(axes, ("tiles", "kv")):
            axis.plot([getattr(p, kind) for p in self.measured], [p.objective - self.full_objective
                                                                  for p in self.measured],
                      "x", color="0.6", label="measured")
            axis.plot([1.0], [0.0], "ks", label="full")
            axis.plot([getattr(p, kind) for p in self.points], increase, "o-", label="frontier (measured)")
            axis.plot([getattr(self.chosen, kind)], [self.chosen.objective - self.full_objective], "r*",
                      markersize=14, label=f"your budget ({self.budget})")
            limit = getattr(self.budget, kind)
            if limit is not None:
                axis.axvline(limit, color="r", linestyle=":", linewidth=1)
            axis.set_xlabel(f"{kind} fraction of full at {self.options.length} tokens")
            axis.grid(alpha=0.3)
        axes[0].set_ylabel("objective increase over full (nats)")
        axes[0].legend(fontsize=8)
        figure.suptitle(f"frontier: options {', '.join(self.options.names)}", fontsize=9)
        figure.tight_layout()
        path = Path(path)
        figure.savefig(path, dpi=120)
        plt.close(figure)
        return path


def _short(name: str) -> str:
    if name == FULL:
        return "F"
    kind, _, value = name.partition("_")
    return ("W" if kind == "window" else "X") + value


def budget_scales(budget: Budget, floors: dict[str, float], points: int) -> list[float]:
    """Factors of ``budget`` for the sweep: ``points`` evenly spaced from the cheapest the options reach (each
    kind's ``floors``) to where the tightest limit reaches 1 (all full), and 1 (the user's budget), ascending."""
    points = as_int("points", points, minimum=2)
    limits = budget.limits()
    low = max(floors[kind] / limit for kind, limit in limits.items())
    high = 1.0 / min(limits.values())
    scales = {round(low + (high - low) * i / (points - 1), 9) for i in range(points)} | {1.0}
    return sorted(s for s in scales if s > 0)


def check_reachable(options: OptionSet, budget: Budget) -> None:
    """Refuse, before any model work, a budget below the least the options could cost (:meth:`OptionSet.floors`)."""
    floors = options.floors()
    for kind, limit in budget.limits().items():
        if limit < floors[kind]:
            raise ValueError(f"the {kind} budget {limit:.4g} is below what these options reach at {options.length} "
                             f"tokens (at best {floors[kind]:.4f} of a full model's); raise it or add cheaper options")


class _Measured:
    """The true objective of configurations (memoised per choice), the model running each one."""

    def __init__(self, objective: CalibrationObjective, choice: Tensor) -> None:
        self.objective, self.choice = objective, choice
        self.values: dict[bytes, tuple[float, dict[str, float]]] = {}

    def __call__(self, choice: Tensor) -> tuple[float, dict[str, float]]:
        key = choice.numpy().tobytes()
        if key not in self.values:
            self.choice.copy_(choice)
            value = self.objective.measure(f"a configuration of {int((choice == 0).sum())} full heads")
            self.values[key] = (value, dict(self.objective.parts))
        return self.values[key]


def calibrate_frontier(model: nn.Module, tokenizer, budget: Budget, length: int, *, corpus: Corpus | None = None,
                       windows: list[int] | None = None, sink: int = 64,
                       xa_thresholds: tuple[float, ...] = DEFAULT_XA_THRESHOLDS, block_size: int = 128,
                       search: SearchOptions | None = None, points: int = 6, continuation: bool = True,
                       refine_rounds: int = 1, magnitude_weight: float = 0.1, batch_tokens: int | None = None, seed: int = 0,
                       progress: bool = False) -> FrontierResult:
    """One option per KV head of ``model`` under ``budget`` at ``length`` tokens, and the frontier around it (see
    the module docstring).

    Args:
        model: a transformers causal LM, not converted; tokenizer: its tokenizer.
        budget: tiles and/or kv fractions of full at ``length`` (the calibration prompts' length too).
        corpus: calibration text (its calibration part; default the pydoc topics).
        windows, sink: the sink + window options (None: 128 ... 2048 where below ``length``).
        xa_thresholds: XAttention's options (empty: none); block_size: the tile the tiles budget counts.
        search: the objective's prompts (text windows, passkey prompts and weight; their lengths are ``length``;
            default :class:`~flexsparse.eval.head_search.SearchOptions`).
        points: budget points of the frontier sweep (besides the user's).
        continuation: re-linearise the scores at each point of the sweep above the user's budget (one effects
            pass each); False: those points from the full model's scores (faster, usually worse).
        refine_rounds: at the user's budget, solve again from the scores at its best choice (one effects pass
            and one evaluation each) while that measures better, at most this many times; the budgets below it
            are solved on the last scores.
        magnitude_weight: of :meth:`~flexsparse.eval.option_effects.OptionEffects.scores`.
        batch_tokens: tokens per forward of the full model's effects pass (default 32K on CUDA, one prompt
            elsewhere; the continuation's passes, whose sparse attention is dense with its masks kept for the
            backward, take one prompt per forward unless given).
    """
    began = time.perf_counter()
    if not isinstance(budget, Budget):
        raise TypeError(f"budget must be a flexsparse.eval.budget.Budget, got {type(budget).__name__}")
    options = head_options(length, windows, sink, xa_thresholds, block_size)
    check_reachable(options, budget)
    points = as_int("points", points, minimum=2)
    refine_rounds = as_int("refine_rounds", refine_rounds, minimum=0)
    search = SearchOptions() if search is None else search
    for name in ("text_length", "passkey_length"):
        if getattr(search, name) not in (None, length):
            raise ValueError(f"search.{name} must be the budget's length {length} (or None): the options' tiles "
                             "are measured on the calibration prompts")
    corpus = Corpus.from_text(tokenizer) if corpus is None else corpus
    objective = CalibrationObjective(model, tokenizer, corpus, search, length, seed)
    say = (lambda text: print(text, file=sys.stderr, flush=True)) if progress else (lambda text: None)
    first = option_effects(model, objective, options, batch_tokens=batch_tokens)
    costs = {"tiles": first.tiles, "kv": options.kv_shares()[None, None].expand_as(first.tiles)}
    say(f"frontier: effects of {first.effects.numel()} (layer, head, option) in {time.perf_counter() - began:.1f} s")
    scales = budget_scales(budget, {kind: cheapest(costs, kind) for kind in costs}, points)
    choice = torch.zeros(first.base.shape, dtype=torch.long)
    measured: list[FrontierPoint] = []
    skipped: list[str] = []
    linearisations = [{"base_scale": None, "base_objective": None,
                       "seconds": round(time.perf_counter() - began, 3)}]
    with options_applied(model, options, choice):
        measure = _Measured(objective, choice)
        full_objective, full_parts = measure(choice.clone())

        def record(found: Tensor, scale: float, source: str) -> FrontierPoint:
            value, parts = measure(found)
            score = evaluate_choice(found, first.scores(magnitude_weight), costs)
            point = FrontierPoint(scale, budget.scaled(scale), found, score.costs["tiles"], score.costs["kv"],
                                  score.loss, evaluate_choice(found, first.effects, costs).loss, value, parts,
                                  source)
            measured.append(point)
            say(f"frontier: {point.budget}: tiles {point.tiles:.3f}, kv {point.kv:.3f}, objective {value:.4f} "
                f"(+{value - full_objective:.4f}) [{source}]")
            return point

        def linearised(point: FrontierPoint) -> tuple[Tensor, str]:
            """The scores with ``point``'s choice as the base (one effects pass)."""
            started = time.perf_counter()
            around = option_effects(model, objective, options, base=point.choice,
                                    batch_tokens=length if batch_tokens is None else batch_tokens)
            linearisations.append({"base_scale": point.scale, "base_objective": point.objective,
                                   "seconds": round(time.perf_counter() - started, 3)})
            return around.scores(magnitude_weight), f"the choice at scale {point.scale:.3g}"

        scores, source = first.scores(magnitude_weight), "full"
        for scale in reversed(scales):  # from all-full down to the cheapest
            try:
                found = solve(scores, costs, budget.scaled(scale)).options
            except ValueError as error:
                if scale == 1.0:
                    raise
                skipped.append(f"{budget.scaled(scale)}: {error}")  # two budgets not met together at this scale
                continue
            point = record(found, scale, f"scores at {source}")
            if scale == 1.0:  # refine: solve again from the scores at the best choice while that measures better
                for _ in range(refine_rounds):
                    scores, source = linearised(point)
                    again = solve(scores, costs, budget).options
                    if torch.equal(again, point.choice):
                        break
                    candidate = record(again, 1.0, f"scores at {source}")
                    if candidate.objective >= point.objective:
                        break
                    point = candidate
            elif continuation and scale > 1.0 and bool(found.any()):
                scores, source = linearised(point)
    frontier = _frontier(scales, budget, measured)
    chosen = next(point for point in frontier if point.scale == 1.0)
    return FrontierResult(options, budget, chosen, frontier, full_objective, full_parts,
                          time.perf_counter() - began, objective.evaluations, linearisations, skipped, measured)


def _frontier(scales: list[float], budget: Budget, measured: list[FrontierPoint]) -> list[FrontierPoint]:
    """At each scaled budget, the measured configuration of lowest objective that meets it (ascending budgets)."""
    budgets = [budget.scaled(scale) for scale in scales]
    picks = envelope(budgets, [{"tiles": p.tiles, "kv": p.kv} for p in measured], [p.objective for p in measured])
    return [replace(measured[pick], scale=scale, budget=point_budget)
            for scale, point_budget, pick in zip(scales, budgets, picks) if pick >= 0]


# ----- the command ------------------------------------------------------------------------------------------

def run_command(args: argparse.Namespace, cuda: bool) -> int:
    """``flexsparse calibrate --method frontier`` (the arguments of :func:`~flexsparse.eval.cli
    .add_calibrate_command`); ``cuda``: the run's device is CUDA. Prints the frontier table and writes the outputs
    into ``args.out``."""
    from flexsparse.eval.domains import DEFAULT_CALIBRATION_DOMAIN, domain_corpus
    from flexsparse.eval.models import load_model
    from flexsparse.eval.text import read_texts

    if args.tiles is None and args.kv is None:
        raise ValueError("--method frontier needs a budget: --tiles and/or --kv (fractions in (0, 1])")
    budget = Budget(tiles=args.tiles, kv=args.kv)
    if args.at is not None and args.length is not None and args.at != args.length:
        raise ValueError(f"--at {args.at} and --length {args.length} differ: the frontier calibrates at the "
                         "budget's length")
    length = args.at or args.length or (2048 if cuda else 512)
    if args.search_length is not None and args.search_length != length:
        raise ValueError(f"--search-length {args.search_length}: the frontier scores prompts of the budget's "
                         f"length ({length})")
    thresholds = DEFAULT_XA_THRESHOLDS if args.xa_thresholds is None else tuple(args.xa_thresholds)
    options = head_options(length, args.windows, args.sink, thresholds)  # checked before loading the model
    check_reachable(options, budget)
    as_int("--points", args.points, minimum=2)
    as_int("--refine-rounds", args.refine_rounds, minimum=0)
    search = SearchOptions() if cuda else SearchOptions(text_windows=1, passkey_prompts=1)
    if args.samples is not None:
        samples = as_int("--samples", args.samples, minimum=1)
        search = SearchOptions(text_windows=samples, passkey_prompts=search.passkey_prompts)
    print(f"loading {args.model or 'the default model (SmolLM2-135M-Instruct)'} ...", file=sys.stderr, flush=True)
    loaded = load_model(args.model, device=args.device)
    corpus = (Corpus.from_text(loaded.tokenizer, read_texts(args.text)) if args.text else
              domain_corpus(loaded.tokenizer, getattr(args, "calibration_domain", None) or DEFAULT_CALIBRATION_DOMAIN))
    result = calibrate_frontier(loaded.model, loaded.tokenizer, budget, length, corpus=corpus,
                                windows=args.windows, sink=args.sink, xa_thresholds=thresholds, search=search,
                                points=args.points, continuation=not args.no_continuation,
                                refine_rounds=args.refine_rounds, seed=args.seed,
                                progress=not args.quiet)
    print(result.table(), end="")
    for note in result.skipped:
        print(f"skipped {note}")
    chosen = result.row(result.chosen)
    print(f"frontier at {budget} ({length} tokens): tiles {chosen['tiles']:.4f}, kv {chosen['kv']:.4f}, objective "
          f"{chosen['objective']:.4f} (full {result.full_objective:.4f}), {chosen['full_heads']} full heads; "
          f"{result.evaluations} evaluations in {result.seconds:.1f} s")
    written = result.save(loaded.model, args.out)
    if not any(path.name == PLOT_FILE for path in written):
        print(f"no {PLOT_FILE}: matplotlib is not installed (pip install 'flexsparse[plot]')")
    print(f"wrote {', '.join(str(path) for path in written)} (flexsparse.load_config / flexsparse eval --config "
          f"{args.out})")
    return 0
