"""What the receptive-field verifier reports."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ReceptiveFieldReport:
    """What :func:`~flexsparse.verify.receptive_field` found for a stack of layers over ``seq_len`` positions.

    ``hole_free`` and ``first_hole`` are always exact. The rest is exact when computed: when the computation
    stopped early (``stopped_early`` says why), ``coverage`` is None and ``complete_depth`` is None unless a hole
    makes it certain that no depth completes.
    """

    seq_len: int
    num_layers: int
    hole_free: bool
    first_hole: tuple[int, int] | None
    """(query, key): the smallest query with an unreachable key k <= query, and its smallest such key."""
    coverage: list[float] | None = field(default_factory=list)
    """Fraction of causal (query, key) pairs connected after each layer (None: not computed)."""
    complete_depth: int | None = None
    """Layers after which every query reaches every earlier key (None if never, or not computed)."""
    positions_done: int | None = None
    """Positions 0 .. positions_done - 1 have their sets computed in every layer (seq_len unless stopped early)."""
    stopped_early: str | None = None
    """Why the computation stopped before the last position (None: the report is complete)."""

    def __post_init__(self) -> None:
        if self.positions_done is None:
            self.positions_done = self.seq_len

    def __str__(self) -> str:
        hole = "hole-free" if self.hole_free else f"HOLE at query {self.first_hole[0]}, key {self.first_hole[1]}"
        lines = [f"receptive field over {self.seq_len:,} positions, {self.num_layers} layers: {hole}"]
        for depth, cov in enumerate(self.coverage or [], 1):
            lines.append(f"  after layer {depth:>3}: {cov:8.4%} of causal pairs connected")
        if self.complete_depth is not None:
            lines.append(f"  complete after {self.complete_depth} layer(s)")
        if self.stopped_early:
            not_computed = "coverage" + ("" if self.complete_depth is not None or not self.hole_free
                                         else " and complete depth")
            lines.append(f"  stopped early after {self.positions_done:,} of {self.seq_len:,} positions "
                         f"({self.stopped_early}): {not_computed} not computed")
        return "\n".join(lines)
