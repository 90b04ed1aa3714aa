"""Calibration on a real model: which KV heads stay full, from scores the model itself gives on real text.

:func:`calibrate` runs a selector on a transformers causal LM in one call and returns a :class:`Calibration`
(scores, per-layer modes, patterns) that converts the model or saves a configuration :func:`load_config` reads.

Selectors (higher score = keep full):

* ``hsa``: HSA's output discrepancy per KV head between full and sparse attention
  (:func:`flexsparse.routers.selection.hsa_discrepancy`) on real-text windows;
* ``retrieval``: Elastic Attention's retrieval score (attention mass from the last token to the needle,
  :func:`~flexsparse.routers.selection.retrieval_scores`) on passkey prompts;
* ``entropy``: Flux Attention's layer entropy (:func:`~flexsparse.routers.selection.layer_entropy`) of each layer's
  input hidden states; whole layers stay full;
* ``gates``: DuoAttention-style gates. Every KV head gets one trainable scalar ``g`` in (0, 1) (a sigmoid of a
  logit) mixing its full and sparse attention outputs, ``out = g full + (1 - g) sparse``; the gates are optimised
  (the model frozen) to keep the last hidden states of the full model on real text and passkey prompts, with an
  L1 penalty pulling every gate to 0, so only the heads whose long-range attention matters keep large gates.

q/k/v are captured through transformers' attention registry: during calibration the model runs a registered
attention function that records each layer's query (after RoPE), keys and values and then runs the model's own
SDPA attention, so scores see exactly what the layer attends with. The model's attention implementation is
restored afterwards.

Budget: ``budget`` is the fraction of KV heads kept full. ``per_layer=True`` keeps ``floor(budget x H_kv)`` per
layer (at least one when the budget is above 0: HSA's rule); ``per_layer=False`` ranks every (layer, head) of
the model by score and keeps the top ``floor(budget x L x H_kv)`` (a layer may keep none or all): a global budget
spread by score.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from flexsparse.eval.gates import GateOptions, gate_scores
from flexsparse.eval.head_search import SearchOptions, search_heads
from flexsparse.eval.swapped_attention import attention_swapped
from flexsparse.eval.tasks import passkey_prompt
from flexsparse.eval.text import Corpus
from flexsparse.integrations.serialization import save_config
from flexsparse.integrations.transformers import attention_layers, convert, is_converted, layer_heads, revert
from flexsparse.masks import Causal, Geometry, Pattern, SinkWindow
from flexsparse.routers.selection import (
    entropy_selection,
    hsa_discrepancy,
    layer_entropy,
    retrieval_scores,
    select_modes,
)
from flexsparse.validation import as_float, as_int

SELECTORS = ("hsa", "retrieval", "entropy", "gates", "search")
CAPTURE_NAME = "flexsparse_capture"
SCORES_FILE = "calibration.json"
DEFAULT_SPARSE = SinkWindow(sink=64, window=256)


# ----- running the model with a registered attention function -----------------------------------------------

def _capture_attention(module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask,
                       scaling: float | None = None, dropout: float = 0.0, **kwargs):
    """Records the layer's q/k/v through ``module.flexsparse_capture``, then runs the model's SDPA attention."""
    module.flexsparse_capture(module, query, key, value, scaling)
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                  **kwargs)


def _output_projection(module: nn.Module, in_features: int) -> Tensor:
    for name in ("o_proj", "out_proj", "dense", "c_proj"):
        found = getattr(module, name, None)
        if isinstance(found, nn.Linear) and found.in_features == in_features:
            return found.weight
    raise ValueError(f"{type(module).__name__} has no output projection (o_proj, out_proj, dense or c_proj) taking "
                     f"{in_features} features; the hsa selector needs it")


# ----- calibration inputs -----------------------------------------------------------------------------------

@dataclass
class CalibrationInputs:
    """Token ids ``[N, S]`` of the calibration prompts and, for needle prompts, the bool ``needle_mask``
    ``[N, S]``."""

    ids: Tensor
    needle_mask: Tensor | None = None

    def batches(self, batch_size: int) -> Iterator[tuple[Tensor, Tensor | None]]:
        for start in range(0, len(self.ids), batch_size):
            mask = None if self.needle_mask is None else self.needle_mask[start:start + batch_size]
            yield self.ids[start:start + batch_size], mask


def text_inputs(corpus: Corpus, length: int, samples: int) -> CalibrationInputs:
    """Consecutive windows of the corpus's calibration text."""
    return CalibrationInputs(corpus.windows(length, samples, split="calibration"))


def needle_inputs(corpus: Corpus, tokenizer, length: int, samples: int, seed: int = 0) -> CalibrationInputs:
    """Passkey prompts on calibration haystacks, ending with the question (no answer); the needle mask marks the
    pass key's digits."""
    rng = random.Random(f"calibration/{length}/{seed}")
    prompts = [passkey_prompt(corpus, tokenizer, length, rng, 0.1 + 0.8 * i / max(samples - 1, 1), "calibration",
                              with_answer=False) for i in range(samples)]
    ids = torch.tensor([p.ids for p in prompts], dtype=torch.long)
    mask = torch.zeros(ids.shape, dtype=torch.bool)
    for row, prompt in enumerate(prompts):
        mask[row, list(prompt.needle_positions)] = True
    return CalibrationInputs(ids, mask)


# ----- scores -----------------------------------------------------------------------------------------------

def _progress(iterable, total: int, what: str, enabled: bool):
    if not enabled:
        return iterable
    from tqdm.auto import tqdm

    return tqdm(iterable, total=total, desc=what, leave=False)


@torch.no_grad()
def _captured_scores(model: nn.Module, inputs: CalibrationInputs, batch_size: int, progress: bool,
                     score: Callable[[nn.Module, Tensor, Tensor, Tensor, float | None, Tensor | None], Tensor]
                     ) -> list[Tensor]:
    """Per layer, the sum over batches of ``score(module, q, k, v, scaling, needle_mask)`` ``[H_kv]``."""
    device = next(model.parameters()).device
    totals: dict[int, Tensor] = {}
    current: list = [None]

    def capture(index: int, module: nn.Module):
        def record(module, q, k, v, scaling):
            value = score(module, q, k, v, scaling, current[0]).float().cpu()
            totals[index] = totals[index] + value if index in totals else value
        return record

    batches = -(-len(inputs.ids) // batch_size)
    with attention_swapped(model, CAPTURE_NAME, _capture_attention, "flexsparse_capture", capture) as modules:
        for ids, needle_mask in _progress(inputs.batches(batch_size), batches, "calibration", progress):
            current[0] = None if needle_mask is None else needle_mask.to(device)
            model(input_ids=ids.to(device), use_cache=False)
    return [totals[i] for i in range(len(modules))]


def hsa_scores(model: nn.Module, inputs: CalibrationInputs, sparse: Pattern, *, batch_size: int = 1,
               progress: bool = False) -> Tensor:
    """HSA's discrepancy ``[L, H_kv]`` over every token of ``inputs`` (root of the summed squares)."""
    length = inputs.ids.shape[1]

    def score(module, q, k, v, scaling, needle_mask):
        weight = _output_projection(module, q.shape[1] * q.shape[3])
        return hsa_discrepancy(q, k, v, weight, sparse, backend="dense", max_dense_len=max(8192, length)) ** 2

    return torch.stack(_captured_scores(model, inputs, batch_size, progress, score)).sqrt()


def retrieval_head_scores(model: nn.Module, inputs: CalibrationInputs, *, batch_size: int = 1,
                          progress: bool = False) -> Tensor:
    """Elastic's retrieval score ``[L, H_kv]``, averaged over the needle prompts of ``inputs``."""
    if inputs.needle_mask is None:
        raise ValueError("the retrieval selector needs needle prompts (needle_inputs)")

    def score(module, q, k, v, scaling, needle_mask):
        return retrieval_scores(q, k, needle_mask, scale=scaling) * q.shape[0]

    return torch.stack(_captured_scores(model, inputs, batch_size, progress, score)) / len(inputs.ids)


@torch.no_grad()
def entropy_scores(model: nn.Module, inputs: CalibrationInputs, *, batch_size: int = 1,
                   progress: bool = False) -> Tensor:
    """Flux's layer entropy of each layer's input hidden states ``[L]``, averaged over ``inputs``."""
    device = next(model.parameters()).device
    layers = len(attention_layers(model))
    total = torch.zeros(layers, dtype=torch.float64)
    batches = -(-len(inputs.ids) // batch_size)
    for ids, _ in _progress(inputs.batches(batch_size), batches, "calibration", progress):
        hidden = model(input_ids=ids.to(device), output_hidden_states=True, use_cache=False).hidden_states
        total += torch.stack([layer_entropy(hidden[i]).cpu() for i in range(layers)]) * len(ids)
    return (total / len(inputs.ids)).float()


# ----- checks -----------------------------------------------------------------------------------------------

def check_reach(sparse: Pattern, length: int) -> None:
    """A ValueError when calibration prompts of ``length`` tokens lie within the reach of ``sparse``: every
    query of them attends every earlier key, as a full head does, so no selector's score can tell heads apart
    (HSA's are all 0, trained gates all equal). Content-dependent patterns (XAttention) are not checked."""
    if sparse.is_dynamic:
        return
    attended = sparse.attended(Geometry(sparse.required_heads or 1, length))  # [B', H', length]
    if not bool((attended == torch.arange(1, length + 1)).all()):
        return
    if isinstance(sparse, SinkWindow):
        reach = sparse.sink + sparse.window
        why = f"sink + window = {sparse.sink} + {sparse.window} = {reach:,} >= {length:,}"
        fix = f"calibrate on prompts longer than {reach:,} tokens, or with a smaller sink + window"
    else:
        why = f"{sparse!r} attends every earlier key of {length:,} tokens"
        fix = "calibrate on longer prompts, or with a sparser pattern"
    raise ValueError(f"the calibration prompts fit inside the sparse pattern's reach ({why}): its heads would attend "
                     f"every key there, as full heads do, so every score would be meaningless; {fix}")


def _check_calibrate_arguments(model, tokenizer, method, budget, per_layer, sparse, corpus, length, samples,
                               batch_size, gates, search, seed, progress, tp_size) -> None:
    """:func:`calibrate`'s arguments, each checked before any work (TypeError / ValueError naming it)."""
    attention_layers(model)  # a TypeError unless a transformers model, a ValueError naming a layer flexsparse can't run
    if is_converted(model):
        raise ValueError("model must not be converted (flexsparse.revert(model) first): calibration runs the "
                         "model's own attention")
    if not callable(tokenizer) or not callable(getattr(tokenizer, "decode", None)):
        raise TypeError(f"tokenizer must be the model's tokenizer (callable, with decode), got "
                        f"{type(tokenizer).__name__}")
    if method not in SELECTORS:
        raise ValueError(f"method must be one of {SELECTORS}, got {method!r}")
    as_float("budget", budget, minimum=0.0, maximum=1.0)
    for name, value in (("per_layer", per_layer), ("progress", progress)):
        if not isinstance(value, bool):
            raise TypeError(f"{name} must be a bool, got {type(value).__name__} {value!r}")
    if not isinstance(sparse, Pattern):
        raise TypeError(f"sparse must be a flexsparse Pattern, got {type(sparse).__name__}")
    if corpus is not None and not isinstance(corpus, Corpus):
        raise TypeError(f"corpus must be a flexsparse.eval.Corpus or None, got {type(corpus).__name__}")
    as_int("length", length, minimum=64)
    as_int("samples", samples, minimum=1)
    if batch_size is not None:
        as_int("batch_size", batch_size, minimum=1)
    if not isinstance(gates, GateOptions):
        raise TypeError(f"gates must be a GateOptions, got {type(gates).__name__}")
    if not isinstance(search, SearchOptions):
        raise TypeError(f"search must be a SearchOptions, got {type(search).__name__}")
    as_int("seed", seed)
    as_int("tp_size", tp_size, minimum=1)


# ----- selection and the result -----------------------------------------------------------------------------

def select(scores: Tensor, budget: float, *, per_layer: bool = True, layer_scores: bool = False,
           min_full_per_layer: int | None = None, tp_size: int = 1) -> list[list[str]]:
    """Modes ``"full"`` / ``"sparse"`` per layer and KV head from scores ``[L, H_kv]`` (higher = full).

    ``budget``: fraction of KV heads kept full. ``layer_scores``: the scores rate whole layers (entropy: every
    head of a layer has its layer's score), so whole layers stay full. ``min_full_per_layer``: default 1 with
    ``per_layer`` and a budget above 0 (HSA's rule), else 0. ``tp_size``: tensor-parallel ranks; above 1 every
    layer keeps the same number of full heads on every rank (:func:`~flexsparse.routers.selection.select_modes`)."""
    budget = as_float("budget", budget, minimum=0.0, maximum=1.0)
    if not isinstance(scores, Tensor) or scores.dim() != 2:
        raise ValueError(f"scores must be a tensor [L, H_kv], got {getattr(scores, 'shape', type(scores))}")
    if layer_scores:
        return entropy_selection(scores[:, 0], 1.0 - budget, scores.shape[1], full="full", sparse="sparse",
                                 tp_size=tp_size)
    minimum = int(per_layer and budget > 0) if min_full_per_layer is None else min_full_per_layer
    return select_modes(scores, 1.0 - budget, per_layer=per_layer, min_full_per_layer=minimum, tp_size=tp_size)


@dataclass
class Calibration:
    """A calibration's result: ``scores`` ``[L, H_kv]`` (float32; entropy: the layer's score on each head),
    ``modes`` (``"full"``/``"sparse"`` per layer and KV head), ``patterns`` (``{"full": Causal(), "sparse":
    ...}``) and how they were chosen."""

    method: str
    scores: Tensor
    modes: list[list[str]]
    patterns: dict[str, Pattern]
    budget: float
    per_layer: bool
    search: dict | None = None
    """The search's summary (objective before and after, evaluations), for ``method="search"``."""

    @property
    def full_fraction(self) -> float:
        """Fraction of KV heads kept full."""
        heads = [mode for layer in self.modes for mode in layer]
        return sum(mode == "full" for mode in heads) / len(heads)

    def reselect(self, budget: float, per_layer: bool = True, tp_size: int = 1) -> Calibration:
        """The same scores under another budget (``tp_size``: balanced across tensor-parallel ranks)."""
        if self.method == "search":
            raise ValueError("a searched choice holds for its own budget only; calibrate(method='search') again")
        modes = select(self.scores, budget, per_layer=per_layer, layer_scores=self.method == "entropy",
                       tp_size=tp_size)
        return Calibration(self.method, self.scores, modes, self.patterns, budget, per_layer)

    def convert(self, model: nn.Module, **options) -> nn.Module:
        """``flexsparse.convert(model, patterns, modes, **options)``."""
        return convert(model, self.patterns, self.modes, **options)

    def save(self, model: nn.Module, directory: str | Path, **options) -> Path:
        """Write the configuration (:func:`save_config`, read by :func:`load_config`) and ``calibration.json``
        (method, budget, scores) into ``directory``; the model is converted for the call and reverted after.
        Returns the configuration's path."""
        self.convert(model, **options)
        try:
            path = save_config(model, directory)
        finally:
            revert(model)
        summary = {"method": self.method, "budget": self.budget, "per_layer": self.per_layer,
                   "full_fraction": self.full_fraction, "scores": self.scores.tolist(), "modes": self.modes,
                   "search": self.search}
        (Path(directory) / SCORES_FILE).write_text(json.dumps(summary, indent=1) + "\n")
        return path


def calibration_scores(model: nn.Module, tokenizer, method: str, *, sparse: Pattern = DEFAULT_SPARSE,
                       corpus: Corpus | None = None, length: int = 2048, samples: int = 8,
                       batch_size: int | None = None, gates: GateOptions = GateOptions(), seed: int = 0,
                       progress: bool = False) -> Tensor:
    """A selector's scores ``[L, H_kv]`` on the calibration part of ``corpus`` (default: the pydoc topics); for
    ``search``, the gates' (the search itself runs in :func:`calibrate`, at a budget)."""
    if method not in SELECTORS:
        raise ValueError(f"method must be one of {SELECTORS}, got {method!r}")
    length = as_int("length", length, minimum=64)
    samples = as_int("samples", samples, minimum=1)
    if not isinstance(sparse, Pattern):
        raise TypeError(f"sparse must be a flexsparse Pattern, got {type(sparse).__name__}")
    corpus = Corpus.from_text(tokenizer) if corpus is None else corpus
    device = next(model.parameters()).device
    if batch_size is None:  # gate training keeps activations for the backward: half the tokens per step
        tokens = 8192 if method in ("gates", "search") else 16384
        batch_size = max(1, tokens // length) if device.type == "cuda" else 1
    batch_size = as_int("batch_size", batch_size, minimum=1)
    if method == "hsa":
        return hsa_scores(model, text_inputs(corpus, length, samples), sparse, batch_size=batch_size,
                          progress=progress)
    if method == "retrieval":
        return retrieval_head_scores(model, needle_inputs(corpus, tokenizer, length, samples, seed),
                                     batch_size=batch_size, progress=progress)
    if method == "entropy":
        layer = entropy_scores(model, text_inputs(corpus, length, samples), batch_size=batch_size,
                               progress=progress)
        kv_heads = layer_heads(attention_layers(model)[0][1])[1]
        return layer[:, None].expand(-1, kv_heads).contiguous()
    texts = text_inputs(corpus, length, max(1, samples // 2))  # gates (search starts from the gates' choice)
    needles = needle_inputs(corpus, tokenizer, length, max(1, samples - len(texts.ids)), seed)
    mixed = torch.cat([texts.ids, needles.ids])
    return gate_scores(model, mixed, sparse, options=gates, batch_size=batch_size, seed=seed, progress=progress)


def calibrate(model: nn.Module, tokenizer, *, method: str = "retrieval", budget: float = 1 / 3,
              per_layer: bool = True, sparse: Pattern = DEFAULT_SPARSE, corpus: Corpus | None = None,
              length: int = 2048, samples: int = 8, batch_size: int | None = None,
              gates: GateOptions = GateOptions(), search: SearchOptions = SearchOptions(), seed: int = 0,
              progress: bool = False, tp_size: int = 1) -> Calibration:
    """Choose which KV heads of ``model`` stay full (causal) and which run ``sparse``, from a selector's scores
    on real text.

    Args:
        model: a transformers causal LM, not converted (its attention goes through transformers' registry).
        tokenizer: its tokenizer (builds the calibration prompts).
        method: ``"hsa"``, ``"retrieval"``, ``"entropy"``, ``"gates"`` or ``"search"`` (see the module
            docstring).
        budget: fraction of KV heads kept full (``1/3``: one of three).
        per_layer: the same count in every layer (at least one), or one ranking over the whole model.
        sparse: the pattern of the other heads (default sink 64 + window 256).
        corpus: calibration text (its calibration part is used; default the pydoc topics).
        length, samples: tokens per calibration prompt and number of prompts (gates: half text windows, half
            passkey prompts).
        batch_size: prompts per forward (default on CUDA: 16K tokens per batch, 8K for gates; 1 on CPU).
        gates: training options of the ``gates`` selector (and of ``search``'s starting gates).
        search: options of the ``search`` selector (its windows' length defaults to ``length``).
        seed: seeds the passkey prompts and the gates' batch order.
        progress: progress bars on stderr (and gate training's cost, once its first step is timed).
        tp_size: tensor-parallel ranks the modes are for (transformers' ``tp_plan``); above 1 every layer keeps
            the same number of full heads on every rank, each rank its best-scoring ones.

    Every argument is checked first (a TypeError / ValueError naming it), and calibration prompts that lie within
    ``sparse``'s reach (sink + window >= length: its heads attend every key there) are a ValueError
    (:func:`check_reach`).
    """
    _check_calibrate_arguments(model, tokenizer, method, budget, per_layer, sparse, corpus, length, samples,
                               batch_size, gates, search, seed, progress, tp_size)
    if method == "search" and tp_size != 1:
        raise ValueError("the search selector chooses for one rank (tp_size=1); use gates for tensor parallelism")
    check_reach(sparse, length)
    corpus = Corpus.from_text(tokenizer) if corpus is None else corpus
    scores = calibration_scores(model, tokenizer, method, sparse=sparse, corpus=corpus, length=length,
                                samples=samples, batch_size=batch_size, gates=gates, seed=seed, progress=progress)
    modes = select(scores, budget, per_layer=per_layer, layer_scores=method == "entropy", tp_size=tp_size)
    summary = None
    if method == "search":
        start = torch.tensor([[mode == "full" for mode in layer] for layer in modes])
        full, summary = search_heads(model, tokenizer, corpus, start, scores, sparse,
                                     per_layer=per_layer, length=length, options=search, seed=seed,
                                     progress=progress)
        modes = [["full" if keep else "sparse" for keep in layer] for layer in full.tolist()]
    return Calibration(method, scores, modes, {"full": Causal(), "sparse": sparse}, float(budget), per_layer,
                       summary)
