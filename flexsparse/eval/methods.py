"""Attention methods to evaluate, from short specs: ``name`` or ``name:key=value,...``.

==============  ============================================================================================
``full``        the model's own attention (SDPA), unconverted: the reference
``ssa``         every KV head sink + window (``sink=64,window=256``)
``index``       the first ``full=1`` KV heads of every layer full, the others sink + window
``xa``          XAttention on every head (``threshold=0.9,stride=16,block_size=128``); ``calibrated=1``:
                per-(layer, head) thresholds calibrated so that XA keeps ``threshold`` of the *true* attention
                mass on ``quantile=0.95`` of the query rows, trying strides ``stride``, ``stride/2``,
                ``stride/4`` per layer (:mod:`flexsparse.eval.xa_calibration`), on the calibration
                windows (``calibration_length`` tokens; once per run and setting)
``triangle``    TriangleMix on every head (``sink=64,window=256,last_q=128``)
``esa``         ESA on every head (``attn_length=256``); a model not trained with ESA loses its quality
``hsa``         calibrated selectors (:mod:`flexsparse.eval.calibration`): ``budget=0.3333`` of the
``retrieval``   KV heads full (``global=1``: one ranking over the model instead of the same count per layer),
``entropy``     the others sink + window (``sink``, ``window``); scores come from the calibration part of the
``gates``       corpus, never from the evaluated text, and are computed once per run and selector; ``search``
``search``      refines the gates' choice on the model's own loss (:mod:`flexsparse.eval.head_search`;
                ``passkey=0.1``: the weight of the passkey answers' NLL in it)
==============  ============================================================================================

A saved configuration (``flexsparse.save_config`` or ``flexsparse calibrate --out DIR``, routers included) is a
method too: :class:`ConfigMethod`.
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from flexsparse.eval.calibration import SELECTORS, calibration_scores, check_reach, select
from flexsparse.eval.gates import GateOptions
from flexsparse.eval.head_search import SearchOptions, search_heads
from flexsparse.eval.text import Corpus
from flexsparse.eval.xa_calibration import calibrate_xa, check_calibration
from flexsparse.integrations import check_config, convert, is_converted, load_config, revert
from flexsparse.integrations.layer import sparse_layers
from flexsparse.integrations.transformers import attention_layers, layer_heads
from flexsparse.masks import ESA, Causal, Pattern, SinkWindow, TriangleMix, XAttention
from flexsparse.specs import split_spec

BACKENDS = ("dense", "flex", "flex_eager")


@dataclass
class Setup:
    """What methods are applied with: the model and tokenizer, the corpus (calibration part for selectors),
    the attention ``backend`` and ``block_size``, and the calibration settings. ``scores`` caches calibration
    scores per (selector, sparse pattern)."""

    model: nn.Module
    tokenizer: object
    corpus: Corpus
    backend: str = "dense"
    block_size: int = 128
    calibration_length: int = 2048
    calibration_samples: int = 8
    gates: GateOptions = GateOptions()
    search: SearchOptions = SearchOptions()
    seed: int = 0
    progress: bool = False
    scores: dict = field(default_factory=dict)
    searched: dict = field(default_factory=dict)
    """The search selector's choices per (sparse pattern, budget, per layer) and their summaries."""

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {self.backend!r}")

    def shape(self) -> tuple[int, int, int]:
        """(layers, query heads, KV heads) of the model."""
        layers = attention_layers(self.model)
        heads, kv_heads, _ = layer_heads(layers[0][1])
        return len(layers), heads, kv_heads

    def convert(self, patterns, modes) -> None:
        convert(self.model, patterns, modes, backend=self.backend, block_size=self.block_size)

    def check_calibration_text(self, length: int) -> None:
        """A ValueError unless calibration prompts of ``length`` tokens fit the model's context and the corpus's
        calibration part."""
        context = getattr(self.model.config.get_text_config(decoder=True), "max_position_embeddings", None)
        if context is not None and length > context:
            raise ValueError(f"calibration length {length:,} exceeds the model's context of {context:,} tokens")
        self.corpus.windows(length, 1, split="calibration")


class Method(ABC):
    """An attention method: ``name`` (its spec) and :meth:`apply`, which converts the model (or leaves it
    unconverted: the model's own attention)."""

    name: str

    @abstractmethod
    def apply(self, setup: Setup) -> None:
        """Convert ``setup.model`` for this method (the runner reverts it afterwards)."""

    def check(self, calibration_length: int, setup: Setup | None = None) -> None:
        """Refuse (ValueError) before any forward what :meth:`apply` would refuse later: without ``setup`` what
        the settings alone decide (the command line checks before it loads a model), with one also what its
        model and corpus decide. Default: nothing to check."""


@dataclass
class FullMethod(Method):
    name: str = "full"

    def apply(self, setup: Setup) -> None:
        return None


@dataclass
class StaticMethod(Method):
    """The first ``full_heads`` KV heads of every layer full (causal), the others in ``pattern(layer, layers,
    query heads)``; return one shared object for every layer where the pattern does not depend on the layer (the
    layers then share masks and compiled kernels)."""

    name: str
    pattern: Callable[[int, int, int], Pattern]
    full_heads: int = 0

    def apply(self, setup: Setup) -> None:
        layers, heads, kv_heads = setup.shape()
        if self.full_heads > kv_heads:
            raise ValueError(f"method {self.name!r}: full={self.full_heads} exceeds the {kv_heads} KV heads per "
                             "layer")
        patterns = [{"full": Causal(), "sparse": self.pattern(i, layers, heads)} for i in range(layers)]
        modes = [["full"] * self.full_heads + ["sparse"] * (kv_heads - self.full_heads)] * layers
        setup.convert(patterns, modes)

    def check(self, calibration_length: int, setup: Setup | None = None) -> None:
        """With a setup: converts the model as :meth:`apply` does (no forward), then reverts it."""
        if setup is not None:
            try:
                self.apply(setup)
            finally:
                if is_converted(setup.model):
                    revert(setup.model)


@dataclass
class SelectedMethod(Method):
    """Heads chosen by a calibration selector under a budget; the others run ``sparse``."""

    name: str
    selector: str
    sparse: SinkWindow
    budget: float = 1 / 3
    per_layer: bool = True
    passkey_weight: float | None = None
    """search: the weight of the passkey answers' NLL in its objective (None: the setup's)."""

    def apply(self, setup: Setup) -> None:
        scored = "gates" if self.selector == "search" else self.selector  # the search starts from the gates
        key = (scored, self.sparse.sink, self.sparse.window)
        if key not in setup.scores:
            setup.scores[key] = calibration_scores(
                setup.model, setup.tokenizer, scored, sparse=self.sparse, corpus=setup.corpus,
                length=setup.calibration_length, samples=setup.calibration_samples, gates=setup.gates,
                seed=setup.seed, progress=setup.progress)
        modes = select(setup.scores[key], self.budget, per_layer=self.per_layer,
                       layer_scores=self.selector == "entropy")
        if self.selector == "search":
            modes = self._searched(setup, key, modes)
        setup.convert({"full": Causal(), "sparse": self.sparse}, modes)

    def check(self, calibration_length: int, setup: Setup | None = None) -> None:
        """Calibration prompts beyond the sparse pattern's reach; with a setup, within the model and the text."""
        try:
            check_reach(self.sparse, calibration_length)
            if setup is not None:
                setup.check_calibration_text(calibration_length)
        except ValueError as err:
            raise ValueError(f"method {self.name!r} at calibration length {calibration_length:,}: {err}") from None

    def _searched(self, setup: Setup, key: tuple, modes: list[list[str]]) -> list[list[str]]:
        options = setup.search
        if self.passkey_weight is not None:
            options = dataclasses.replace(options, passkey_weight=self.passkey_weight)
        found = (key, self.budget, self.per_layer, options)
        if found not in setup.searched:
            start = torch.tensor([[mode == "full" for mode in layer] for layer in modes])
            full, summary = search_heads(setup.model, setup.tokenizer, setup.corpus, start, setup.scores[key],
                                         self.sparse, per_layer=self.per_layer, length=setup.calibration_length,
                                         options=options, seed=setup.seed, progress=setup.progress)
            setup.searched[found] = ([["full" if keep else "sparse" for keep in layer] for layer in full.tolist()],
                                     summary)
        return setup.searched[found][0]


@dataclass
class CalibratedXAMethod(Method):
    """XAttention on every head with thresholds calibrated to keep ``target`` of the true attention mass on
    ``quantile`` of the query rows (:func:`~flexsparse.eval.xa_calibration.calibrate_xa`), at the
    antidiagonal stride of ``strides`` that keeps the fewest blocks per layer."""

    name: str
    target: float = 0.9
    quantile: float = 0.95
    strides: tuple[int, ...] = (16, 8, 4)
    block_size: int = 128

    def apply(self, setup: Setup) -> None:
        key = ("xa", self.target, self.quantile, self.strides, self.block_size, setup.calibration_length)
        if key not in setup.scores:
            setup.scores[key] = calibrate_xa(
                setup.model, setup.tokenizer, self.target, self.quantile, corpus=setup.corpus,
                length=setup.calibration_length, samples=setup.calibration_samples, strides=self.strides,
                block_size=self.block_size, progress=setup.progress)
        layers, _, kv_heads = setup.shape()
        patterns = [{"xa": pattern} for pattern in setup.scores[key].patterns()]
        setup.convert(patterns, [["xa"] * kv_heads] * layers)

    def check(self, calibration_length: int, setup: Setup | None = None) -> None:
        """Calibration prompts of at least one XA block; with a setup, within the model and the text."""
        try:
            if calibration_length < self.block_size:
                raise ValueError(f"calibration prompts need at least block_size ({self.block_size}) tokens")
            if setup is not None:
                setup.check_calibration_text(calibration_length)
        except ValueError as err:
            raise ValueError(f"method {self.name!r} at calibration length {calibration_length:,}: {err}") from None


@dataclass
class ConfigMethod(Method):
    """A saved configuration (:func:`flexsparse.save_config`), run on ``setup.backend``."""

    directory: Path
    name: str = ""

    def __post_init__(self) -> None:
        self.directory = Path(self.directory)
        if not self.name:
            self.name = f"config:{self.directory.name}"

    def check(self, calibration_length: int, setup: Setup | None = None) -> None:
        """The file is a configuration (:func:`check_config`); with a setup, it loads into the model (which is
        reverted after)."""
        if setup is None:
            check_config(self.directory)
            return
        try:
            load_config(setup.model, self.directory)
        finally:
            if is_converted(setup.model):
                revert(setup.model)

    def apply(self, setup: Setup) -> None:
        load_config(setup.model, self.directory)
        for layer in sparse_layers(setup.model):  # the saved backend is the saving machine's; run this run's
            layer.attention.backend = setup.backend
            layer.options["backend"] = setup.backend


_OPTIONS = {
    "full": set(), "ssa": {"sink", "window"}, "index": {"full", "sink", "window"},
    "xa": {"threshold", "stride", "block_size", "calibrated", "quantile"},
    "triangle": {"sink", "window", "last_q"}, "esa": {"attn_length"},
    **{name: {"budget", "global", "sink", "window"} for name in SELECTORS},
    "search": {"budget", "global", "sink", "window", "passkey"},
}


def parse_method(spec: str) -> Method:
    """A method from its spec (see the module docstring); ValueError naming the spec on bad input."""
    name, options = split_spec(spec)
    if name not in _OPTIONS:
        raise ValueError(f"unknown method {name!r} in {spec!r}; known: {sorted(_OPTIONS)} (or --config DIR)")
    unknown = sorted(set(options) - _OPTIONS[name])
    if unknown:
        raise ValueError(f"method {spec!r}: unknown options {unknown}; {name} takes {sorted(_OPTIONS[name])}")
    try:
        window = SinkWindow(sink=int(options.get("sink", 64)), window=int(options.get("window", 256)))
        if name == "full":
            return FullMethod(spec)
        if name in ("ssa", "index"):
            full = int(options.get("full", 1)) if name == "index" else 0
            return StaticMethod(spec, lambda *_: window, full_heads=full)
        if name == "xa" and int(options.get("calibrated", 0)):
            stride, block_size = int(options.get("stride", 16)), int(options.get("block_size", 128))
            strides = tuple(s for s in (stride, stride // 2, stride // 4) if s >= 1 and block_size % s == 0)
            target, quantile = float(options.get("threshold", 0.9)), float(options.get("quantile", 0.95))
            check_calibration(target, quantile, strides, block_size)
            return CalibratedXAMethod(spec, target, quantile, strides, block_size)
        if name == "xa":
            if "quantile" in options:
                raise ValueError("quantile is an option of calibrated XA (calibrated=1)")
            xa = XAttention(threshold=float(options.get("threshold", 0.9)), stride=int(options.get("stride", 16)),
                            block_size=int(options.get("block_size", 128)))
            return StaticMethod(spec, lambda *_: xa)
        if name == "triangle":
            triangle = TriangleMix(window.sink, window.window, int(options.get("last_q", 128)))
            return StaticMethod(spec, lambda *_: triangle)
        if name == "esa":
            attn_length = int(options.get("attn_length", 256))
            ESA(0, 1, attn_length, 1)  # checks the options now, not after the model is loaded
            return StaticMethod(spec, lambda layer, layers, heads: ESA(layer, layers, attn_length, heads))
        budget = float(options.get("budget", 1 / 3))
        if not 0.0 <= budget <= 1.0:
            raise ValueError(f"budget must be in [0, 1], got {budget}")
        weight = float(options["passkey"]) if "passkey" in options else None
        if weight is not None and weight < 0:
            raise ValueError(f"passkey must be a weight >= 0, got {weight}")
        return SelectedMethod(spec, name, window, budget, per_layer=not options.get("global", 0),
                              passkey_weight=weight)
    except (TypeError, ValueError) as err:
        raise ValueError(f"method {spec!r}: {err}") from None
