"""Running an evaluation: every method on every task and length, as :class:`~flexsparse.eval.records.Record`s.

For each method the model is converted once (calibrated methods calibrate first, on the calibration corpus's
calibration part), every task and length runs, and the model is reverted. Perplexity is measured on the held-out
part of every text domain (:mod:`flexsparse.eval.domains`), a record each. Prompts run in batches of about
``batch_tokens`` tokens. Perplexity and forced-answer tasks take one forward per batch without a cache; the LM head
runs on the needed positions only, in chunks (a full ``[B, S, vocab]`` logits tensor at 8K tokens would take
gigabytes). Generation tasks run ``generate()`` (greedy; a converted model uses the sparse KV cache); RULER tasks
run through lm-eval (:mod:`flexsparse.eval.ruler`) with the model behind its model interface.

Density is measured, not computed from a formula: a forward hook on every converted layer's HybridAttention reads
``last_stats.block_density`` after each prefill call over all its heads, and a record holds the mean over layers
and prefills (XAttention's depends on the input).
"""

from __future__ import annotations

import contextlib
import math
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from flexsparse.eval.domains import domain_corpus, evaluation_domains
from flexsparse.eval.gates import GateOptions
from flexsparse.eval.head_search import SearchOptions
from flexsparse.eval.methods import Method, Setup
from flexsparse.eval.models import LoadedModel
from flexsparse.eval.records import Record
from flexsparse.eval.ruler import RULER_MIN_LENGTH, lm_eval_modules, ruler_scores
from flexsparse.eval.tasks import Prompt, Task, get_task, recall
from flexsparse.eval.text import Corpus
from flexsparse.eval.text_model import TextModel, greedy_generate, hidden_states, lm_logits
from flexsparse.integrations import is_converted, kv_memory_formula, revert
from flexsparse.integrations.layer import sparse_layers
from flexsparse.integrations.transformers import attention_layers, layer_heads
from flexsparse.runtime import compiled

_HEAD_CHUNK = 2048  # positions per LM-head chunk (2048 x 49,152 float32 logits: 400 MB)


class DensityMeter:
    """Block densities of the prefill calls of a converted model's layers while active (a context manager)."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.values: list[Tensor] = []
        self._handles: list = []

    def _hook(self, module, args, kwargs, output) -> None:
        q, k = args[0], args[1]
        if q.shape[2] == k.shape[2] and kwargs.get("kv_heads") is None:
            self.values.append(module.last_stats.block_density.detach().float())

    def __enter__(self) -> DensityMeter:
        for layer in sparse_layers(self.model):
            self._handles.append(layer.attention.register_forward_hook(self._hook, with_kwargs=True))
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def density(self) -> float:
        """Mean density over the recorded calls; 1.0 for an unconverted model (its own full attention)."""
        if not sparse_layers(self.model):
            return 1.0
        if not self.values:
            raise RuntimeError("no prefill call of a converted layer was recorded")
        return float(torch.stack([v.to(self.values[0].device) for v in self.values]).mean())


def kv_bytes(model: nn.Module, length: int) -> int:
    """KV cache bytes of one sequence of ``length`` tokens under the model's current attention."""
    layers = sparse_layers(model)
    dtype = next(model.parameters()).dtype
    if layers and not any(layer.router is not None for layer in layers):
        return kv_memory_formula(model, 1, length, dtype)
    itemsize = torch.empty((), dtype=dtype).element_size()
    total = 0
    for _, module in attention_layers(model):
        _, kv_heads, dim = layer_heads(module)
        total += 2 * kv_heads * dim * itemsize * length
    return total


# ----- model calls ------------------------------------------------------------------------------------------

def _batches(items: Sequence, size: int) -> Iterator[Sequence]:
    for start in range(0, len(items), size):
        yield items[start:start + size]


@torch.no_grad()
def perplexity(model: nn.Module, windows: Tensor, batch_size: int, progress=None) -> float:
    """exp(mean next-token NLL) over every predicted token of ``windows`` ``[N, S]``."""
    device = next(model.parameters()).device
    nll, count = 0.0, 0
    for batch in _batches(windows, batch_size):
        ids = batch.to(device)
        hidden = hidden_states(model, ids)[:, :-1]
        hidden = hidden.reshape(-1, hidden.shape[-1])
        targets = ids[:, 1:].reshape(-1)
        for start in range(0, len(targets), _HEAD_CHUNK):
            part = slice(start, start + _HEAD_CHUNK)
            nll += float(F.cross_entropy(lm_logits(model, hidden[part]), targets[part], reduction="sum"))
        count += len(targets)
        if progress is not None:
            progress(len(batch))
    return math.exp(nll / count)


@torch.no_grad()
def forced_accuracy(model: nn.Module, prompts: Sequence[Prompt], batch_size: int, progress=None) -> list[float]:
    """Per prompt 1.0 when greedy decoding reproduces its answer (every answer token is the argmax given the
    previous ones), else 0.0. Prompts of one batch must have one length."""
    device = next(model.parameters()).device
    scores = []
    for batch in _batches(prompts, batch_size):
        ids = torch.tensor([p.ids for p in batch], dtype=torch.long, device=device)
        hidden = hidden_states(model, ids)
        longest = max(p.answer_len for p in batch)
        predicted = lm_logits(model, hidden[:, -longest - 1:-1]).argmax(-1)  # [B, longest]
        for row, prompt in enumerate(batch):
            answer = ids[row, -prompt.answer_len:]
            scores.append(float(bool((predicted[row, -prompt.answer_len:] == answer).all())))
        if progress is not None:
            progress(len(batch))
    return scores


def generated_recall(model: nn.Module, tokenizer, prompts: Sequence[Prompt], batch_size: int,
                     progress=None) -> list[float]:
    """Per prompt, the fraction of its expected strings in the greedy generation (left-padded batches of
    ``batch_size`` prompts: :func:`~flexsparse.eval.text_model.greedy_generate`)."""
    widest = max(len(p.ids) for p in prompts)
    generated = greedy_generate(model, tokenizer, [p.ids for p in prompts], [p.max_new_tokens for p in prompts],
                                batch_size * widest, progress)
    return [recall(prompt.expected, tokenizer.decode(tokens, skip_special_tokens=True))
            for prompt, tokens in zip(prompts, generated)]


# ----- the evaluation ---------------------------------------------------------------------------------------

def _bar(total: int, description: str, enabled: bool):
    if not enabled:
        return contextlib.nullcontext(None)
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=description, leave=False, file=sys.stderr)


class OverallProgress:
    """One bar on stderr over every (method, task, length) run of an evaluation, with the time left: runs are
    weighted by their tokens (length x trials), so the estimate holds when lengths differ. A context manager;
    ``enabled=False`` shows nothing."""

    FORMAT = "{desc} {percentage:3.0f}%|{bar:24}| {elapsed} elapsed, about {remaining} left"

    def __init__(self, runs: Sequence[tuple[str, str, int]], trials: int, enabled: bool) -> None:
        self.runs, self.trials, self.enabled = list(runs), trials, enabled
        self.done = 0
        self._bar = None

    def __enter__(self) -> OverallProgress:
        if self.enabled:
            from tqdm.auto import tqdm

            total = sum(length * self.trials for _, _, length in self.runs)
            self._bar = tqdm(total=total, desc=self._description("starting"), bar_format=self.FORMAT,
                             file=sys.stderr, position=0, leave=True)
        return self

    def __exit__(self, *exc) -> None:
        if self._bar is not None:
            self._bar.close()

    def _description(self, what: str) -> str:
        return f"eval {self.done}/{len(self.runs)} runs ({what})"

    def preparing(self, method: str) -> None:
        """Say that ``method`` is preparing (a calibrated one calibrates before its first run)."""
        if self._bar is not None:
            self._bar.set_description_str(self._description(f"preparing {method}"))

    def starting(self, method: str, task: str, length: int) -> None:
        if self._bar is not None:
            self._bar.set_description_str(self._description(f"{method} {task} {length:,}"))

    def finished(self, length: int) -> None:
        self.done += 1
        if self._bar is not None:
            self._bar.set_description_str(self._description("done" if self.done == len(self.runs) else "next"),
                                          refresh=False)
            self._bar.update(length * self.trials)


def run_task(setup: Setup, task: Task, length: int, trials: int, batch_tokens: int, seed: int, method: str,
             model_name: str, progress: bool, text: Corpus | None = None) -> Record:
    """One task at one length under the model's current attention; perplexity on ``text``'s held-out windows
    (default: the setup's corpus, whose held-out part also gives the retrieval tasks their haystacks)."""
    model = setup.model
    batch_size = max(1, batch_tokens // length)
    text = setup.corpus if text is None else text
    domain = "" if task.kind == "ruler" else text.name
    start = time.perf_counter()
    with DensityMeter(model) as meter:
        if task.kind == "perplexity":
            windows = text.windows(length, trials)
            with _bar(len(windows), f"{method} {task.name} {text.name} {length}", progress) as bar:
                value = perplexity(model, windows, batch_size, bar.update if bar is not None else None)
            n = len(windows)
        elif task.kind == "ruler":
            from flexsparse.eval.harness import FlexsparseLM

            with _bar(trials, f"{method} {task.name} {length}", progress) as bar:
                update = bar.update if bar is not None else None
                lm = FlexsparseLM(TextModel(model, setup.tokenizer, batch_tokens), update)
                scores = ruler_scores(lm, task.name, length, trials, seed, setup.tokenizer)
            value, n = sum(scores) / len(scores), len(scores)
        else:
            prompts = task.prompts(setup.corpus, setup.tokenizer, length, trials, seed)
            with _bar(len(prompts), f"{method} {task.name} {length}", progress) as bar:
                update = bar.update if bar is not None else None
                if task.kind == "forced":
                    scores = forced_accuracy(model, prompts, batch_size, update)
                else:
                    scores = generated_recall(model, setup.tokenizer, prompts, batch_size, update)
            value, n = sum(scores) / len(scores), len(scores)
    return Record(method, task.name, length, task.metric, value, n, meter.density(), kv_bytes(model, length),
                  model_name, time.perf_counter() - start, domain)


def default_backend(device: torch.device, lengths: Sequence[int]) -> str:
    """``dense`` on CPU and up to 8,192 tokens (no compilation; exact), compiled ``flex`` beyond."""
    return "flex" if device.type == "cuda" and max(lengths) > 8192 else "dense"


def evaluate(loaded: LoadedModel, methods: Sequence[Method], tasks: Sequence[str] = ("perplexity", "passkey"),
             lengths: Sequence[int] = (2048,), trials: int = 20, *,
             task_lengths: Mapping[str, Sequence[int]] | None = None,
             corpus: Corpus | None = None, domains: Sequence[Corpus] | None = None,
             backend: str | None = None, batch_tokens: int | None = None,
             calibration_length: int = 2048, calibration_samples: int = 8, gates: GateOptions = GateOptions(),
             search: SearchOptions = SearchOptions(), seed: int = 0, progress: bool = False,
             on_record: Callable[[Record], None] | None = None) -> list[Record]:
    """Evaluate ``methods`` on ``tasks`` at ``lengths`` (per task: ``task_lengths[task]`` where given).

    Args:
        loaded: the model (:func:`~flexsparse.eval.models.load_model`); it is converted per method and reverted.
        methods: :func:`~flexsparse.eval.methods.parse_method`'s or
            :class:`~flexsparse.eval.methods.ConfigMethod`.
        tasks: names from :data:`~flexsparse.eval.tasks.TASKS` (RULER tasks need lm-eval:
            :mod:`flexsparse.eval.ruler`).
        trials: prompts per task and length; perplexity: windows (as many as the held-out text holds, at most this).
        corpus: the calibration text (default: the pydoc domain); calibrated methods read its first part, the
            retrieval tasks take their haystacks from the rest.
        domains: the corpora perplexity is measured on, a record per domain (their held-out parts; names
            distinct); default :func:`~flexsparse.eval.domains.evaluation_domains`: every built-in domain when
            ``corpus`` is one, else ``corpus`` alone.
        backend: HybridAttention backend of converted methods (default :func:`default_backend`).
        batch_tokens: tokens per forward (default 32K on CUDA, 4K on CPU).
        calibration_length, calibration_samples, gates, search: settings of calibrated methods.
        progress: one bar over every (method, task, length) run with the time left, and bars inside runs, on
            stderr.
        on_record: called with each record as soon as it is measured (e.g. to write partial results).
    Returns the records in the order measured.

    Every input is checked before the first forward (ValueError): lengths against the model's context and the
    text, each method against the model (:meth:`~flexsparse.eval.methods.Method.check`: a saved configuration
    loads into it, calibration prompts reach beyond the sparse pattern).
    """
    model = loaded.model
    if is_converted(model):
        raise ValueError("evaluate an unconverted model (flexsparse.revert(model) first): methods convert it")
    task_lengths = dict(task_lengths or {})
    plan = [(get_task(name), list(task_lengths.get(name, lengths))) for name in tasks]
    context = loaded.max_length
    for task, task_sizes in plan:
        for length in task_sizes:
            if not isinstance(length, int) or length < 64:
                raise ValueError(f"lengths must be integers >= 64, got {length!r}")
            if context is not None and length > context:
                raise ValueError(f"length {length:,} exceeds the model's context of {context:,} tokens")
            if task.kind == "ruler" and length < RULER_MIN_LENGTH:
                raise ValueError(f"RULER tasks need lengths >= {RULER_MIN_LENGTH:,} tokens, got {length:,}")
    if not isinstance(trials, int) or trials < 1:
        raise ValueError(f"trials must be an integer >= 1, got {trials!r}")
    for name, value in (("batch_tokens", batch_tokens), ("calibration_samples", calibration_samples)):
        if value is not None and (not isinstance(value, int) or value < 1):
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    if not isinstance(calibration_length, int) or calibration_length < 64:
        raise ValueError(f"calibration_length must be an integer >= 64, got {calibration_length!r}")
    if any(task.kind == "ruler" for task, _ in plan):
        lm_eval_modules()  # imported now, not inside the first RULER record's time
    corpus = domain_corpus(loaded.tokenizer) if corpus is None else corpus
    if any(task.kind == "perplexity" for task, _ in plan):
        domains = evaluation_domains(loaded.tokenizer, corpus) if domains is None else tuple(domains)
        names = [text.name for text in domains]
        if not domains or len(set(names)) != len(names):
            raise ValueError(f"domains must be corpora with distinct names, got {names}")
    device = loaded.device
    every_length = [n for _, sizes in plan for n in sizes]
    setup = Setup(model, loaded.tokenizer, corpus,
                  backend or default_backend(device, every_length), calibration_length=calibration_length,
                  calibration_samples=calibration_samples, gates=gates, search=search, seed=seed,
                  progress=progress)
    if batch_tokens is None:
        batch_tokens = 32768 if device.type == "cuda" else 4096
    # every method and length is its own compiled flex variant: raise the per-process limit for this run
    compiled.MAX_COMPILED_VARIANTS = max(compiled.MAX_COMPILED_VARIANTS, 8 * len(methods) * len(every_length))
    for length in sorted(set(every_length)):  # the held-out texts hold a window of every length
        setup.corpus.windows(length, 1)
    for task, sizes in plan:
        for text in domains if task.kind == "perplexity" else ():
            for length in sizes:
                text.windows(length, 1)
    for method in methods:
        method.check(calibration_length, setup)
    texts = {task.name: (domains if task.kind == "perplexity" else (corpus,)) for task, _ in plan}
    records: list[Record] = []
    runs = [(method.name, task.name, length) for method in methods for task, sizes in plan for length in sizes
            for _ in texts[task.name]]
    with OverallProgress(runs, trials, progress) as overall:
        for method in methods:
            torch.manual_seed(seed)
            try:
                overall.preparing(method.name)
                method.apply(setup)
                for task, task_sizes in plan:
                    for length in task_sizes:
                        for text in texts[task.name]:
                            overall.starting(method.name, task.name, length)
                            record = run_task(setup, task, length, trials, batch_tokens, seed, method.name,
                                              loaded.name, progress, text)
                            overall.finished(length)
                            records.append(record)
                            if on_record is not None:
                                on_record(record)
            finally:
                if is_converted(model):
                    revert(model)
    return records
