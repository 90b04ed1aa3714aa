"""The Pattern protocol, and the union and intersection of patterns.

A pattern decides which keys each query may attend, by token position (:mod:`flexsparse.masks.geometry`). For a
:class:`Geometry` it gives

1. ``mask_mod(geo)``: a FlexAttention ``mask_mod(b, h, q_idx, kv_idx) -> bool`` closure;
2. ``block_classes(geo)``: for every (query tile, key tile) whether it is empty, partial or full, in closed form;
   :meth:`Pattern.block_mask` turns this into a ``BlockMask`` with full tiles marked;
3. ``dense(geo)``: the boolean reference ``[B', H', Q, KV]`` built independently of ``mask_mod``, for tests;
4. ``attended(geo)``: how many keys each query attends, ``[B', H', Q]``;
5. ``key_runs(geo, positions)``: the attended keys of given positions as runs, for the receptive-field verifier.

Every pattern class with its own ``name`` registers itself under it (:func:`pattern_class`,
:func:`registered_patterns`): text specs (:mod:`flexsparse.specs`) and saved configurations find it there.
``pattern.config()`` describes a pattern as JSON data, ``Pattern.from_config`` rebuilds it; by default from the
arguments its constructor was called with, so a new pattern needs no code for either. A config names every
argument (a saved file that lost one is refused, not completed with a default that may differ from the saved
value), except those a class lists in ``optional_arguments``: how to compute, never what is attended.

``B'`` is 1 unless the geometry's positions differ per batch element, and ``H'`` is 1 for patterns that treat
all heads alike; both broadcast. Every pattern is causal: a key at a later position is never attended.
"""

from __future__ import annotations

import enum

import functools
import inspect
import numbers
import operator
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask

from flexsparse.masks.blocks import block_mask_from_classes
from flexsparse.masks.geometry import EMPTY, FULL, Geometry, classify

if TYPE_CHECKING:
    from typing_extensions import Self

MaskMod = Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]

_REGISTRY: dict[str, type[Pattern]] = {}


def registered_patterns() -> Mapping[str, type[Pattern]]:
    """Every registered pattern class by its ``name`` (a read-only view that follows new registrations)."""
    return MappingProxyType(_REGISTRY)


def pattern_class(name: str) -> type[Pattern]:
    """The pattern class registered under ``name``; a ValueError lists the known names."""
    if not isinstance(name, str) or name not in _REGISTRY:
        raise ValueError(f"unknown pattern type {name!r}; known: {sorted(_REGISTRY)}")
    return _REGISTRY[name]


def _register(cls: type[Pattern]) -> None:
    """Register ``cls`` under its own ``name``. Defining the same class again (its module reloaded) replaces it;
    another class with a taken name is a ValueError."""
    name = cls.__dict__["name"]
    if not isinstance(name, str) or not name.isidentifier():
        raise ValueError(f"{cls.__qualname__}.name must be an identifier (it is a spec and JSON name), got {name!r}")
    taken = _REGISTRY.get(name)
    if taken is not None and (taken.__module__, taken.__qualname__) != (cls.__module__, cls.__qualname__):
        raise ValueError(f"pattern name {name!r} of {cls.__module__}.{cls.__qualname__} is taken by "
                         f"{taken.__module__}.{taken.__qualname__}; give the class another name")
    _REGISTRY[name] = cls


def _to_json(value: Any, where: str) -> Any:
    """A constructor argument as JSON data: patterns as their configs, tensors and tuples as lists."""
    if isinstance(value, Pattern):
        return value.config()
    if isinstance(value, Tensor):
        return value.tolist()
    if isinstance(value, (list, tuple)):
        return [_to_json(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    raise TypeError(f"cannot describe {where} ({type(value).__name__}) in JSON: override config() and from_config()")


def _from_json(value: Any) -> Any:
    """The inverse of :func:`_to_json` for what JSON can tell apart: dicts are pattern configs."""
    if isinstance(value, dict):
        return Pattern.from_config(value)
    if isinstance(value, list):
        return [_from_json(v) for v in value]
    return value


def runs_from_rows(rows: Tensor) -> tuple[Tensor, Tensor]:
    """Runs of True in boolean rows ``[..., KV]`` as (first, last) ``[..., R]``, empty runs (1, 0) padded last."""
    padded = torch.nn.functional.pad(rows.to(torch.int8), (1, 1))
    step = padded.diff(dim=-1)
    starts, ends = step == 1, step == -1  # [..., KV + 1]
    count = starts.sum(-1)
    width = max(int(count.max()) if count.numel() else 0, 1)
    positions = torch.arange(step.shape[-1], device=rows.device)
    order_s = torch.argsort((~starts).to(torch.int8), dim=-1, stable=True)[..., :width]
    order_e = torch.argsort((~ends).to(torch.int8), dim=-1, stable=True)[..., :width]
    valid = torch.arange(width, device=rows.device) < count[..., None]
    first = torch.where(valid, positions[order_s], 1)
    last = torch.where(valid, positions[order_e] - 1, 0)
    return first, last


def normalize_runs(first: Tensor, last: Tensor) -> tuple[Tensor, Tensor]:
    """Sort runs ``[..., R]`` by first key (empty ones last) and merge overlapping or adjacent ones."""
    empty = first > last
    big = torch.iinfo(first.dtype).max
    order = torch.argsort(torch.where(empty, big, first), dim=-1, stable=True)
    first, last, empty = first.gather(-1, order), last.gather(-1, order), empty.gather(-1, order)
    reach = torch.where(empty, -2, last).cummax(-1).values  # furthest key covered by runs so far
    opens = ~empty & torch.cat([torch.ones_like(empty[..., :1]), first[..., 1:] > reach[..., :-1] + 1], -1)
    group = opens.cumsum(-1) - 1  # merged run index of each run
    merged_first = torch.full_like(first, 1).scatter_reduce(-1, group.clamp(min=0), torch.where(opens, first, big),
                                                            "amin", include_self=False)
    merged_last = torch.zeros_like(last).scatter_reduce(-1, group.clamp(min=0), torch.where(empty, -1, last),
                                                        "amax", include_self=False)
    valid = torch.arange(first.shape[-1], device=first.device) < opens.sum(-1, keepdim=True)
    return torch.where(valid, merged_first, 1), torch.where(valid, merged_last, 0)


def run_lengths(first: Tensor, last: Tensor) -> Tensor:
    """Keys covered by disjoint runs ``[R, ...]``, summed over R."""
    return torch.clamp(last - first + 1, min=0).sum(0)


class DecodeReads(enum.Enum):
    """What a one-token decode query of a pattern reads among the earlier keys, which decides what a sparse KV cache
    keeps for the pattern's heads and who decodes them (:attr:`Pattern.decode_reads`)."""

    EVERY_EARLIER_KEY = "every earlier key"
    """Every key up to the query (full causal attention, and patterns whose last query is inside a full band)."""
    SINK_AND_WINDOW = "sink and window"
    """Exactly the first ``sink`` and the last ``window`` keys: a cache keeps them in a ring of ``sink + window``
    slots, every one of which the query attends (the pattern has ``sink`` and ``window`` attributes)."""
    OWN_PATTERN = "own pattern"
    """Some keys, as the pattern's own mask says: the cache keeps every key, and an executor that decodes the
    pattern (or a plan over the whole buffer) selects them."""

    @property
    def attends_every_stored_key(self) -> bool:
        """Whether the query attends every key a store of what it reads holds (every key, or the ring)."""
        return self is not DecodeReads.OWN_PATTERN


class Pattern(ABC):
    """An attention pattern. Subclasses implement the capabilities for a :class:`Geometry`.

    A subclass that sets its own ``name`` (an identifier) is registered under it. Its constructor's arguments are
    recorded at construction: :meth:`config` describes them as JSON data, :meth:`from_config` passes them back.
    """

    name: ClassVar[str] = ""
    optional_arguments: ClassVar[tuple[str, ...]] = ()
    """Constructor parameters a config may leave out (they take their defaults): ones that change how the pattern is
    computed, never which keys it attends, and that files written before they existed lack."""
    is_full: bool = False
    """True for full causal attention (FA): such heads count as dense in MSR/ESR and may run on SDPA."""

    __signature__: ClassVar[inspect.Signature]
    _arguments: tuple[tuple[Any, ...], dict[str, Any]]

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        init = cls.__init__
        parameters = [] if init is object.__init__ else list(inspect.signature(init).parameters.values())[1:]
        cls.__signature__ = inspect.Signature(parameters)  # the constructor's, also what inspect.signature(cls) says
        if cls.__dict__.get("name"):
            _register(cls)

    def __new__(cls, *args: Any, **kwargs: Any) -> Self:
        """Record the constructor's arguments for :meth:`config` (lists as tuples: later edits do not count);
        they are matched to the parameters only there."""
        pattern = super().__new__(cls)
        snapshot = lambda value: tuple(value) if isinstance(value, list) else value
        pattern._arguments = (tuple(map(snapshot, args)), {key: snapshot(v) for key, v in kwargs.items()})
        return pattern

    def config(self) -> dict[str, Any]:
        """JSON data that :meth:`from_config` rebuilds this pattern from: ``{"type": name, argument: value, ...}``
        with the constructor's arguments (defaults included; tensors and tuples as lists, patterns as configs).

        A TypeError where that cannot describe it: a class not registered under its name (a subclass without its
        own ``name``), or an argument JSON cannot carry.
        """
        kind = type(self)
        if _REGISTRY.get(kind.name) is not kind:
            raise TypeError(f"cannot describe {self!r} ({kind.__name__}) in JSON: only a class registered under its "
                            f"own name can be (registered: {sorted(_REGISTRY)})")
        args, kwargs = self._arguments
        bound = kind.__signature__.bind(*args, **kwargs)
        bound.apply_defaults()
        described: dict[str, Any] = {"type": kind.name}
        for key, value in bound.arguments.items():
            described[key] = _to_json(value, f"{kind.__name__} argument {key!r}")
        return described

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> Pattern:
        """The pattern a :meth:`config` dict describes; on ``Pattern`` the class is looked up by ``config["type"]``.

        The config names every constructor argument (``*parts`` included) but those in ``optional_arguments``:
        a missing one is a ValueError naming the pattern and the argument, as are unknown keys and values the
        constructor refuses.
        """
        if not isinstance(config, Mapping) or "type" not in config:
            raise ValueError(f"a pattern config is a dict with a 'type', got {config!r}")
        kind = pattern_class(config["type"])
        if kind is not cls:
            if not issubclass(kind, cls):
                raise ValueError(f"{cls.__name__}.from_config got a config of {kind.__name__} ({config['type']!r})")
            return kind.from_config(config)
        arguments = {key: _from_json(value) for key, value in config.items() if key != "type"}
        parameters = cls.__signature__.parameters
        unknown = sorted(set(arguments) - set(parameters))
        if unknown:
            raise ValueError(f"config of {cls.name!r} has unknown keys {unknown}; known: {list(parameters)}")
        missing = [key for key, p in parameters.items() if key not in arguments and key not in cls.optional_arguments
                   and p.kind is not p.VAR_KEYWORD]
        if missing:
            raise ValueError(f"config of {cls.name!r} lacks {missing}: a config names every argument of its pattern "
                             f"({list(parameters)}), so that it loads as it was saved")
        positional = [arguments.pop(key) for key, p in parameters.items() if p.kind is p.VAR_POSITIONAL]
        try:
            return cls(*(positional[0] if positional else ()), **arguments)
        except TypeError as err:  # a value of the wrong kind: the config is bad data
            raise ValueError(f"bad arguments in the config {dict(config)!r}: {err}") from err

    def resolve(self, q: Tensor, k: Tensor, geo: Geometry | None = None,
                query_heads: Tensor | None = None) -> Pattern:
        """The static pattern for these queries/keys. Content-dependent patterns (XA) override this.
        ``query_heads`` (int64 ``[H']``): q holds only these query heads of the layer (k their KV heads); the
        result still describes the layer's ``geo.num_heads`` heads (rows of other heads are never read)."""
        return self

    @property
    def decode_reads(self) -> DecodeReads:
        """What a one-token decode query reads (:class:`DecodeReads`): every earlier key for a full static pattern,
        else its own pattern; a subclass whose decode reads less states it (a class attribute or property)."""
        return DecodeReads.EVERY_EARLIER_KEY if self.is_full and not self.is_dynamic else DecodeReads.OWN_PATTERN

    @property
    def is_dynamic(self) -> bool:
        """Whether :meth:`resolve` depends on q/k (then the pattern is resolved on every call)."""
        return False

    @abstractmethod
    def mask_mod(self, geo: Geometry) -> MaskMod:
        """FlexAttention mask_mod for this geometry (``h`` is the query head)."""

    @abstractmethod
    def block_classes(self, geo: Geometry) -> Tensor:
        """int8 ``[B', H', QB, KB]`` of EMPTY / PARTIAL / FULL from the tile bounds, without an O(Q*KV) scan."""

    @abstractmethod
    def dense(self, geo: Geometry) -> Tensor:
        """Boolean reference ``[B', H', Q, KV]`` (small sizes; O(B' H' Q KV))."""

    def attended(self, geo: Geometry) -> Tensor:
        """Keys attended per query, int64 ``[B', H', Q]``. Default: counted from :meth:`dense`."""
        return self.dense(geo).sum(-1)

    @property
    def required_heads(self) -> int | None:
        """The number of query heads this pattern is defined for, or None if it treats every head alike."""
        return None

    def key_runs(self, geo: Geometry, positions: Tensor) -> tuple[Tensor, Tensor]:
        """Keys attended by the given query positions (one sequence, ``geo`` contiguous) as runs.

        Returns (first, last), integer ``[R, H', P]`` (slot-major, the layout the receptive-field verifier
        scans): per head and query, R runs ``first..last`` (inclusive), the non-empty ones first, ascending and
        disjoint, then empty ones (first > last). Default: read off :meth:`dense` (small sizes); patterns with
        structure override it.
        """
        dense = self.dense(geo)
        if dense.shape[0] != 1:
            raise ValueError(f"key_runs needs a pattern without a batch dimension; {self!r} has {dense.shape[0]}")
        first, last = runs_from_rows(dense[0][:, positions.long() - geo.offset])
        return first.permute(2, 0, 1), last.permute(2, 0, 1)

    def union_key_runs(self, geo: Geometry, positions: Tensor) -> tuple[Tensor, Tensor]:
        """Runs of the keys any head attends, ``[R, P]``: first and last keys both non-decreasing along R
        (repeats allowed), empty runs last. What the receptive-field verifier reads.

        Default: the heads' :meth:`key_runs` sorted together and merged.
        """
        first, last = (t.reshape(t.shape[0] * t.shape[1], -1).T for t in self.key_runs(geo, positions))
        first, last = normalize_runs(first, last)
        return first.T, last.T

    def block_mask(self, geo: Geometry) -> BlockMask:
        """BlockMask with partial and full tiles from :meth:`block_classes` (padding tiles made exact)."""
        return block_mask_from_classes(geo.restrict(self.block_classes(geo)), geo, self.mask_mod(geo))

    def __or__(self, other: Pattern) -> Pattern:
        return Union(self, other)

    def __and__(self, other: Pattern) -> Pattern:
        return Intersection(self, other)

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


def check_patterns(patterns: Sequence[Pattern], what: str) -> tuple[Pattern, ...]:
    """The patterns as a non-empty tuple, or a TypeError / ValueError naming ``what``."""
    if isinstance(patterns, Pattern) or not isinstance(patterns, Sequence):
        raise TypeError(f"{what} takes a sequence of Pattern instances, got {type(patterns).__name__}")
    patterns = tuple(patterns)
    if not patterns:
        raise ValueError(f"{what} needs at least one pattern")
    for p in patterns:
        if not isinstance(p, Pattern):
            raise TypeError(f"{what} takes Pattern instances, got {type(p).__name__}")
    return patterns


def required_heads_of(parts: Sequence[Pattern]) -> int | None:
    """The head count the parts are defined for (None if none requires one); differing counts are an error."""
    heads = {p.required_heads for p in parts} - {None}
    if len(heads) > 1:
        raise ValueError(f"parts are defined for different head counts: {sorted(heads)}")
    return heads.pop() if heads else None


class _Combination(Pattern):
    """Parts joined pair by pair with ``join`` (``|`` for Union, ``&`` for Intersection)."""

    symbol: str
    join: Callable[[Tensor, Tensor], Tensor]

    def __init__(self, *parts: Pattern) -> None:
        self.parts = check_patterns(parts, type(self).__name__)
        required_heads_of(self.parts)
        if any(p.is_dynamic for p in self.parts):
            raise ValueError(f"{type(self).__name__} of a content-dependent pattern: resolve it on q/k first")

    def __repr__(self) -> str:
        return f" {self.symbol} ".join(map(repr, self.parts))

    @property
    def required_heads(self) -> int | None:
        return required_heads_of(self.parts)

    def mask_mod(self, geo: Geometry) -> MaskMod:
        mods, join = [p.mask_mod(geo) for p in self.parts], self.join

        def combined_mask(b, h, q_idx, kv_idx):
            result = mods[0](b, h, q_idx, kv_idx)
            for mod in mods[1:]:
                result = join(result, mod(b, h, q_idx, kv_idx))
            return result

        return combined_mask

    def block_classes(self, geo: Geometry) -> Tensor:
        stacked = torch.stack(torch.broadcast_tensors(*[p.block_classes(geo) for p in self.parts]))
        return self._classes(stacked == FULL, stacked == EMPTY)

    def dense(self, geo: Geometry) -> Tensor:
        return functools.reduce(self.join, (p.dense(geo) for p in self.parts))

    def key_runs(self, geo: Geometry, positions: Tensor) -> tuple[Tensor, Tensor]:
        runs = [p.key_runs(geo, positions) for p in self.parts]
        heads = max(first.shape[1] for first, _ in runs)
        runs = [(f.expand(-1, heads, -1), l.expand(-1, heads, -1)) for f, l in runs]
        return self._combined_runs(runs)  # each subclass: [R_i, H', P] parts -> [R, H', P] ascending, disjoint

    def attended(self, geo: Geometry) -> Tensor:
        """Closed form from the key runs, O(H' Q R): no dense mask, so it works at any length.

        Positions that differ per batch element are counted per element (one host read of the sequence ends).
        """
        positions = geo.q_positions()  # [B', Q]
        ends = [geo.kv_len] if geo.is_contiguous else geo.sequence_ends().tolist()
        counts = []
        for b, end in enumerate(ends):
            row = positions[b if positions.shape[0] > 1 else 0]
            real = row >= 0
            line = Geometry(geo.num_heads, max(end, 1), device=geo.device)
            first, last = self.key_runs(line, torch.where(real, row, 0))
            counts.append(torch.where(real, run_lengths(first, last), 0))
        return torch.stack(counts)


class Union(_Combination):
    """A query attends a key if any part lets it."""

    name, symbol, join = "union", "|", staticmethod(operator.or_)

    @property
    def is_full(self) -> bool:
        return any(p.is_full for p in self.parts)

    @staticmethod
    def _classes(full: Tensor, empty: Tensor) -> Tensor:
        return classify(full=full.any(0), empty=empty.all(0))

    def _combined_runs(self, runs):
        first = torch.cat([f for f, _ in runs]).permute(1, 2, 0)
        last = torch.cat([l for _, l in runs]).permute(1, 2, 0)
        first, last = normalize_runs(first, last)
        return first.permute(2, 0, 1), last.permute(2, 0, 1)


class Intersection(_Combination):
    """A query attends a key if every part lets it."""

    name, symbol, join = "intersection", "&", staticmethod(operator.and_)

    @property
    def is_full(self) -> bool:
        return all(p.is_full for p in self.parts)

    @staticmethod
    def _classes(full: Tensor, empty: Tensor) -> Tensor:
        return classify(full=full.all(0), empty=empty.any(0))

    def _combined_runs(self, runs):
        """Pairwise intersections of the runs of two parts (O(R_a R_b) per query), folded over the parts."""
        first, last = runs[0]
        for other_first, other_last in runs[1:]:
            lo = torch.maximum(first[:, None], other_first[None])  # [R_a, R_b, H', P]
            hi = torch.minimum(last[:, None], other_last[None])
            first, last = lo.flatten(0, 1), hi.flatten(0, 1)
        empty = first > last
        first, last = torch.where(empty, 1, first), torch.where(empty, 0, last)
        first, last = normalize_runs(first.permute(1, 2, 0), last.permute(1, 2, 0))
        return first.permute(2, 0, 1), last.permute(2, 0, 1)
