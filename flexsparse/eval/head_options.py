"""The attention options a KV head may take in a budgeted search, their costs at a length, and a model run with
every KV head on one of them without converting it.

Options (:func:`head_options`): ``full`` (causal attention), ``window_W`` (``sink`` + window W,
:class:`~flexsparse.masks.SinkWindow`) for each window W, and ``xa_T`` (:class:`~flexsparse.masks.XAttention` at
threshold T) for each threshold. Their costs at length L, as fractions of a full head's:

* ``tiles``: the share of the causal ``block_size`` x ``block_size`` attention tiles the head computes at L. Closed
  form for full and sink + window heads (:meth:`OptionSet.static_tiles`, from the patterns' block classes); measured
  on the calibration inputs for XAttention, whose selection depends on the input (:func:`tile_shares` of its
  resolved block table);
* ``kv``: the share of a full KV cache's bytes the head keeps at L: 1 for full and XAttention heads (every key
  stays), ``min(L, sink + W) / L`` for a sink + window head.

:func:`options_applied` runs a transformers causal LM with KV head h of layer l on option ``choice[l, h]``, through
an attention function registered for the time of the call: layers whose heads are all full run the model's own
SDPA attention, the others a :class:`~flexsparse.HybridAttention` with the options their row uses as its patterns
(:class:`OptionAttention`), on the dense backend (no compilation, any device; O(S^2) masks, in chunks of rows).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from flexsparse.attention import HybridAttention
from flexsparse.eval.swapped_attention import attention_swapped
from flexsparse.integrations.transformers import attention_layers, convert, layer_heads
from flexsparse.masks import Causal, Pattern, SinkWindow, XAttention
from flexsparse.masks.geometry import EMPTY, Geometry
from flexsparse.validation import as_float, as_int

DEFAULT_WINDOWS = (128, 256, 512, 1024, 2048)
DEFAULT_XA_THRESHOLDS = (0.9, 0.8)
FULL = "full"
OPTIONS_NAME = "flexsparse_head_options"


@dataclass(frozen=True)
class HeadOption:
    """One option: its ``name`` (a mode name), ``pattern``, and the tokens a head on it keeps in the KV cache
    (``kv_tokens``; None: every token)."""

    name: str
    pattern: Pattern
    kv_tokens: int | None = None


@dataclass(frozen=True)
class OptionSet:
    """The options of every KV head (``full`` first), at the budget's ``length`` and tile ``block_size``."""

    options: tuple[HeadOption, ...]
    length: int
    block_size: int

    @property
    def names(self) -> list[str]:
        return [option.name for option in self.options]

    def patterns(self) -> dict[str, Pattern]:
        """Mode name -> pattern, in option order."""
        return {option.name: option.pattern for option in self.options}

    def dynamic(self) -> list[int]:
        """Indices of the options whose tiles depend on the input (XAttention)."""
        return [i for i, option in enumerate(self.options) if option.pattern.is_dynamic]

    def kv_shares(self) -> Tensor:
        """Share of a full head's KV-cache bytes each option keeps at ``length``, float64 ``[O]``."""
        return torch.tensor([1.0 if option.kv_tokens is None else min(self.length, option.kv_tokens) / self.length
                             for option in self.options], dtype=torch.float64)

    def static_tiles(self) -> Tensor:
        """Share of the causal tiles each option computes at ``length``, float64 ``[O]`` (closed form; NaN for the
        dynamic options, measured on inputs instead)."""
        geo = Geometry(num_heads=1, q_len=self.length, block_size=self.block_size)
        return torch.tensor([float("nan") if option.pattern.is_dynamic else
                             float(tile_shares(option.pattern, geo).mean()) for option in self.options],
                            dtype=torch.float64)

    def floors(self) -> dict[str, float]:
        """The lowest cost per kind a head could take before any input is seen: for tiles, XAttention counts at
        its least (the first key tile and the diagonal tile of every query tile: what a sink of 1 and a window of
        1 compute, which its selection always keeps)."""
        geo = Geometry(num_heads=1, q_len=self.length, block_size=self.block_size)
        least_xa = float(tile_shares(SinkWindow(sink=1, window=1), geo).mean())
        tiles = self.static_tiles()
        return {"tiles": float(torch.where(tiles.isnan(), least_xa, tiles).min()),
                "kv": float(self.kv_shares().min())}

    def describe(self) -> list[dict]:
        """JSON-ready: every option's name, pattern config and closed-form costs."""
        tiles, kv = self.static_tiles(), self.kv_shares()
        return [{"name": option.name, "pattern": option.pattern.config(),
                 "tiles": None if option.pattern.is_dynamic else float(tiles[i]), "kv": float(kv[i])}
                for i, option in enumerate(self.options)]


def tile_shares(pattern: Pattern, geo: Geometry) -> Tensor:
    """Share of the causal tiles of ``geo`` that a static (or resolved) ``pattern`` computes: float64 ``[B', H']``
    (its block classes' batch and head rows)."""
    computed = (pattern.block_classes(geo) != EMPTY).sum((-1, -2), dtype=torch.float64)
    causal = (Causal().block_classes(geo) != EMPTY).sum(dtype=torch.float64)
    return computed / causal


def head_options(length: int, windows: Sequence[int] | None = None, sink: int = 64,
                 xa_thresholds: Sequence[float] = DEFAULT_XA_THRESHOLDS, block_size: int = 128,
                 xa_stride: int = 16) -> OptionSet:
    """The options at ``length`` tokens: full, sink + window for each of ``windows`` (None: those of
    :data:`DEFAULT_WINDOWS` that stay below ``length``), XAttention at each of ``xa_thresholds`` (stride
    ``xa_stride``, its blocks of ``block_size``, which is also the tile the ``tiles`` cost counts).

    ValueError: a length of one tile, a window that reaches every key at ``length`` (it is full attention there),
    a threshold outside (0, 1), repeated values, or no sparse option left."""
    length = as_int("length", length, minimum=1)
    block_size = as_int("block_size", block_size, minimum=16)
    sink = as_int("sink", sink, minimum=0)
    if length <= block_size:
        raise ValueError(f"length {length} fits in one tile of {block_size} tokens: every option computes it; "
                         "budget a longer length")
    if windows is None:
        windows = [w for w in DEFAULT_WINDOWS if sink + w < length]
    elif isinstance(windows, (int, str, bytes)):
        raise TypeError(f"windows must be a sequence of ints, got {windows!r}")
    windows = [as_int("windows", w, minimum=1) for w in windows]
    for window in windows:
        if sink + window >= length:
            raise ValueError(f"window {window}: sink {sink} + window {window} reaches every key at length {length}, "
                             f"so that option is full attention there; give windows below {length - sink} or "
                             "budget a longer length")
    if isinstance(xa_thresholds, (int, float, str, bytes)):
        raise TypeError(f"xa_thresholds must be a sequence of floats, got {xa_thresholds!r}")
    thresholds = [as_float("xa_thresholds", t) for t in xa_thresholds]
    for threshold in thresholds:
        if not 0.0 < threshold < 1.0:
            raise ValueError(f"xa_thresholds must be in (0, 1) (1 keeps every tile: full attention), got {threshold}")
    for name, values in (("windows", windows), ("xa_thresholds", thresholds)):
        if len(set(values)) != len(values):
            raise ValueError(f"{name} repeats a value: {values}")
    if not windows and not thresholds:
        raise ValueError(f"no sparse option at length {length}: every default window with sink {sink} reaches the "
                         "whole length and no XAttention threshold is given")
    options = [HeadOption(FULL, Causal())]
    options += [HeadOption(f"window_{w}", SinkWindow(sink=sink, window=w), sink + w) for w in sorted(windows)]
    options += [HeadOption(f"xa_{t:g}", XAttention(threshold=t, stride=xa_stride, block_size=block_size))
                for t in sorted(thresholds, reverse=True)]
    return OptionSet(tuple(options), length, block_size)


def check_choice(choice: Tensor, options: OptionSet, layers: int, kv_heads: int) -> None:
    """A choice must be a long tensor ``[layers, kv_heads]`` of option indices."""
    if (not isinstance(choice, Tensor) or choice.dtype != torch.long or tuple(choice.shape) != (layers, kv_heads)
            or bool(((choice < 0) | (choice >= len(options.options))).any())):
        raise ValueError(f"choice must be a long tensor [{layers}, {kv_heads}] of option indices < "
                         f"{len(options.options)}, got {getattr(choice, 'dtype', type(choice).__name__)} "
                         f"{tuple(getattr(choice, 'shape', ()))}")


class OptionAttention:
    """One layer's attention over the options, on the dense backend: a row of option indices (one per KV head)
    runs on a :class:`~flexsparse.HybridAttention` of just the options it uses (fewer masks built and gathered),
    built on first use and kept, unless ``resolved`` patterns (option index -> the dynamic option resolved on these
    inputs) are given."""

    def __init__(self, options: OptionSet, module: nn.Module, max_len: int) -> None:
        self.options, self.max_len = options, max_len
        self.shape = layer_heads(module)
        self.device = next(module.parameters()).device
        self.kept: dict[tuple[int, ...], HybridAttention] = {}

    def _build(self, used: tuple[int, ...], resolved: dict[int, Pattern]) -> HybridAttention:
        patterns = {self.options.options[o].name: resolved.get(o, self.options.options[o].pattern) for o in used}
        return HybridAttention(*self.shape, patterns, backend="dense", max_dense_len=self.max_len).to(self.device)

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, row: Sequence[int], scale: float | None = None,
                 resolved: dict[int, Pattern] | None = None) -> Tensor:
        """Attention ``[B, H, S, d]`` of q ``[B, H, S, d]``, k/v ``[B, H_kv, S, d]`` with KV head h on option
        ``row[h]``."""
        used = tuple(sorted(set(row)))
        if resolved:
            attention = self._build(used, resolved)
        elif used in self.kept:
            attention = self.kept[used]
        else:
            attention = self.kept[used] = self._build(used, {})
        return attention(q, k, v, modes=[used.index(o) for o in row], scale=scale)


class _LayerOptions:
    """One layer's row of the shared choice and the attention running it."""

    def __init__(self, index: int, module: nn.Module, options: OptionSet, choice: Tensor, max_len: int) -> None:
        self.index, self.choice = index, choice
        self.attention = OptionAttention(options, module, max_len)

    def modes(self) -> list[int]:
        return self.choice[self.index].tolist()


def _option_attention(module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask,
                      scaling: float | None = None, dropout: float = 0.0, **kwargs):
    """Each KV head on its option of ``module.flexsparse_head_options``; an all-full layer on the model's SDPA."""
    if attention_mask is not None:
        raise ValueError("a head-options run takes unpadded batches without an attention mask")
    state: _LayerOptions = module.flexsparse_head_options
    modes = state.modes()
    if not any(modes):
        return sdpa_attention_forward(module, query, key, value, None, dropout=dropout, scaling=scaling, **kwargs)
    return state.attention(query, key, value, modes, scaling).transpose(1, 2), None


@contextlib.contextmanager
def options_applied(model: nn.Module, options: OptionSet, choice: Tensor, max_len: int | None = None
                    ) -> Iterator[None]:
    """Meanwhile ``model`` runs KV head h of layer l on option ``choice[l, h]``; ``choice`` (long ``[L, H_kv]``,
    on the CPU) may be changed in place between forwards. Unpadded inputs of at most ``max_len`` tokens (default
    ``options.length``)."""
    layers = attention_layers(model)
    check_choice(choice, options, len(layers), layer_heads(layers[0][1])[1])
    if choice.device.type != "cpu":
        raise ValueError("choice must be on the CPU (its rows are read on the host)")
    max_len = options.length if max_len is None else as_int("max_len", max_len, minimum=1)
    state = lambda index, module: _LayerOptions(index, module, options, choice, max_len)
    with attention_swapped(model, OPTIONS_NAME, _option_attention, "flexsparse_head_options", state):
        yield


def convert_choice(model: nn.Module, options: OptionSet, choice: Tensor, **convert_options) -> nn.Module:
    """``flexsparse.convert`` with KV head h of layer l on option ``choice[l, h]`` (the patterns the choice uses,
    in option order, shared by every layer)."""
    layers = attention_layers(model)
    check_choice(choice, options, len(layers), layer_heads(layers[0][1])[1])
    used = sorted(set(choice.flatten().tolist()))
    patterns = {options.options[i].name: options.options[i].pattern for i in used}
    modes = [[options.options[i].name for i in row] for row in choice.tolist()]
    return convert(model, patterns, modes, **convert_options)
