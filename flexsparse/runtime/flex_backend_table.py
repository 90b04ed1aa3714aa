"""The measured table of compiled flex's two backends per device: torch's default (Triton) kernels and FLASH
(``kernel_options={"BACKEND": "FLASH"}``: flex on FlashAttention-4's CuTe kernels, the ``fast`` extra).

``bench/tables/flex_backends.py`` times one layer (B=1, 32 query / 8 KV heads, d=128, bf16, one pattern on every
head) on both backends per (pattern, pass, length) and writes ``flexsparse/runtime/data/flex_backends.json``,
keyed by a substring of the CUDA device name (:data:`FLEX_BACKENDS`, a
:class:`~flexsparse.runtime.device_tables.MeasuredTable`; the longest matching key wins). The flex executor
(:class:`~flexsparse.runtime.flex.FlexExecutor`) reads :func:`flash_time_ratio`, FLASH's time over Triton's for a
pattern, a pass and a length, and runs a launch on FLASH only where it is below 1 (and the launch is one FLASH
runs: see :mod:`flexsparse.runtime.flex`). A ratio exists only on a device the table knows, at its dtype, head dim
and block size, for a pattern name it measured, at lengths from its shortest row up: linear in log2 length between
measured rows, the longest row's past it, none below the shortest (short calls are bound by the launch, which was
not measured). Everywhere else flex runs torch's default backend, as without the table.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from flexsparse.runtime.device_tables import PASSES, DeviceTable, Field, MeasuredTable


class FlexBackendTimes(NamedTuple):
    """One layer's milliseconds on compiled flex's Triton kernels and on FLASH."""

    triton_ms: float
    flash_ms: float

    @property
    def flash_ratio(self) -> float:
        """FLASH's time over Triton's (below 1: FLASH is faster)."""
        return self.flash_ms / self.triton_ms


FLEX_BACKENDS: MeasuredTable[FlexBackendTimes, float] = MeasuredTable(
    "flex backend table", "data/flex_backends.json", key=("pattern", "pass", "length"),
    settings=("head_dim", "block_size"), dtypes=(torch.bfloat16, torch.float16),
    fields=(Field("pattern", lambda p: isinstance(p, str) and p != "", "a pattern's name"),
            Field.one_of("pass", PASSES), Field.positive_int("length"),
            Field.positive_number("triton_ms", "milliseconds"), Field.positive_number("flash_ms", "milliseconds")),
    row=lambda row: FlexBackendTimes(float(row["triton_ms"]), float(row["flash_ms"])),
    value=lambda times: times.flash_ratio)
"""The table: ``{"devices": {KEY: {"dtype": "bfloat16", "head_dim": 128, "block_size": 128, "entries":
[{"pattern": "sink_window", "pass": "forward", "length": 8192, "triton_ms": 1.9, "flash_ms": 1.4}, ...]}}}``
(dtype: one FLASH runs), loaded at import (``FLEX_BACKENDS.devices = {}``: flex never chooses FLASH itself); a
device's series are FLASH/Triton ratios by ``(pattern, pass)``."""


def flash_ratio(table: DeviceTable[FlexBackendTimes, float], pattern: str, pass_name: str,
                length: int) -> float | None:
    """A device's FLASH time over Triton's for ``pattern`` (a ``Pattern.name``) at ``length`` (see the module
    docstring); None where the table has no row for the pattern and pass, or ``length`` is below its shortest
    row."""
    series = table.series.get((pattern, pass_name))
    if series is None or length < series.lengths[0]:
        return None
    return series.interpolated(length)


def flash_time_ratio(pattern: str, device: torch.device, dtype: torch.dtype, head_dim: int, block_size: int,
                     length: int, grad: bool) -> float | None:
    """FLASH's measured time over Triton's for a compiled flex launch of ``pattern`` (a ``Pattern.name``) on
    every head, over ``length`` queries and keys, with a backward when ``grad``; None where the table does not
    apply (see the module docstring)."""
    table = FLEX_BACKENDS.for_device(device)
    if table is None or (dtype, head_dim, block_size) != (table.dtype, table.settings["head_dim"],
                                                          table.settings["block_size"]):
        return None
    return flash_ratio(table, pattern, PASSES[1] if grad else PASSES[0], length)
