"""The measured table of compiled flex's two backends per device: torch's default (Triton) kernels and FLASH
(``kernel_options={"BACKEND": "FLASH"}``: flex on FlashAttention-4's CuTe kernels, the ``fast`` extra).

``bench/flex_backends.py`` times one layer (B=1, 32 query / 8 KV heads, d=128, bf16, one pattern on every
head) on both backends per (pattern, pass, length) and writes ``flexsparse/runtime/data/flex_backends.json``,
keyed by a substring of the CUDA device name (:data:`FLEX_BACKEND_TABLE`; the longest matching key wins). The
flex executor (:class:`~flexsparse.runtime.flex.FlexExecutor`) reads :func:`flash_time_ratio`, FLASH's time
over Triton's for a pattern, a pass and a length, and runs a launch on FLASH only where it is below 1 (and
the launch is one FLASH runs: see :mod:`flexsparse.runtime.flex`). A ratio exists only on a device the table
knows, at its dtype, head dim and block size, for a pattern name it measured, at lengths from its shortest row
up: linear in log2 length between measured rows, the longest row's past it, none below the shortest (short
calls are bound by the launch, which was not measured). Everywhere else flex runs torch's default backend, as
without the table.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from flexsparse.runtime.dense_kernels import PASSES
from flexsparse.runtime.device_tables import (
    cuda_device_name,
    device_index,
    entry_for_name,
    entry_rows_and_dtype,
    positive_int,
    positive_number,
    read_device_entries,
    shipped_table_path,
)

TABLE_FILE = "data/flex_backends.json"
"""The shipped table, relative to the ``flexsparse.runtime`` package."""
FLASH_DTYPES = (torch.bfloat16, torch.float16)
"""The dtypes FlashAttention-4 runs (a table measured at another dtype is refused)."""


@dataclass(frozen=True)
class FlexBackendTimes:
    """One layer's milliseconds on compiled flex's Triton kernels and on FLASH."""

    triton_ms: float
    flash_ms: float

    @property
    def flash_ratio(self) -> float:
        """FLASH's time over Triton's (below 1: FLASH is faster)."""
        return self.flash_ms / self.triton_ms


@dataclass(frozen=True)
class FlexBackendDeviceTable:
    """One device's measured times: the dtype, head dim and block size (BlockMask tile) they were measured at,
    by (pattern name, pass, length)."""

    dtype: torch.dtype
    head_dim: int
    block_size: int
    rows: Mapping[tuple[str, str, int], FlexBackendTimes]

    @functools.cached_property
    def _ratios_by_length(self) -> dict[tuple[str, str], dict[int, float]]:
        """FLASH/Triton ratios by (pattern, pass), then length: grouped once, read per planned call."""
        grouped: dict[tuple[str, str], dict[int, float]] = {}
        for (pattern, pass_name, length), times in self.rows.items():
            grouped.setdefault((pattern, pass_name), {})[length] = times.flash_ratio
        return grouped

    def flash_ratio(self, pattern: str, pass_name: str, length: int) -> float | None:
        """FLASH's time over Triton's for ``pattern`` (a ``Pattern.name``) at ``length`` (see the module
        docstring); None where the table has no row for the pattern and pass, or ``length`` is below its
        shortest row."""
        ratios = self._ratios_by_length.get((pattern, pass_name))
        if not ratios or length < min(ratios):
            return None
        lengths = sorted(ratios)
        if length >= lengths[-1]:
            return ratios[lengths[-1]]
        upper = next(i for i, at in enumerate(lengths) if at >= length)
        if lengths[upper] == length:
            return ratios[length]
        lo, hi = lengths[upper - 1], lengths[upper]
        t = (math.log2(length) - math.log2(lo)) / (math.log2(hi) - math.log2(lo))
        return ratios[lo] + t * (ratios[hi] - ratios[lo])


def default_table_path() -> Path:
    """The shipped table file (in the installed package)."""
    return shipped_table_path(TABLE_FILE)


def load_flex_backend_table(path: str | Path | None = None) -> dict[str, FlexBackendDeviceTable]:
    """The table in ``path`` (default: the shipped one), by device-name substring.

    The file: ``{"devices": {KEY: {"dtype": "bfloat16", "head_dim": 128, "block_size": 128, "entries":
    [{"pattern": "sink_window", "pass": "forward", "length": 8192, "triton_ms": 1.9, "flash_ms": 1.4},
    ...]}}}`` (other keys, such as ``"about"`` and ``"measured"``, are notes). Raises ValueError naming the
    file and the field that is wrong.
    """
    path = Path(path) if path is not None else default_table_path()
    devices = read_device_entries(path, "flex backend table")
    return {key: device_table_from_json(entry, f"{path}: devices[{key!r}]") for key, entry in devices.items()}




def device_table_from_json(entry: object, where: str = "device entry") -> FlexBackendDeviceTable:
    """One device's table from its JSON object (``{"dtype": ..., "head_dim": ..., "block_size": ...,
    "entries": [...]}``, see :func:`load_flex_backend_table`); ``where`` names it in errors."""
    what = "flex backend table"
    rows_json, dtype = entry_rows_and_dtype(entry, what, where)
    if dtype not in FLASH_DTYPES:
        raise ValueError(f"{what} {where}: 'dtype' must be bfloat16 or float16 (what FLASH runs), got "
                         f"{entry.get('dtype')!r}")
    for field in ("head_dim", "block_size"):
        if not positive_int(entry.get(field)):
            raise ValueError(f"{what} {where}: {field!r} must be a positive integer, got "
                             f"{entry.get(field)!r}")
    rows: dict[tuple[str, str, int], FlexBackendTimes] = {}
    for i, row in enumerate(rows_json):
        at = f"{where}.entries[{i}]"
        if not isinstance(row, dict):
            raise ValueError(f"{what} {at}: expected an object")  # noqa: TRY004 -- a malformed file
        if not isinstance(row.get("pattern"), str) or not row["pattern"]:
            raise ValueError(f"{what} {at}: 'pattern' must be a pattern's name, got {row.get('pattern')!r}")
        if row.get("pass") not in PASSES:
            raise ValueError(f"{what} {at}: 'pass' must be one of {PASSES}, got {row.get('pass')!r}")
        if not positive_int(row.get("length")):
            raise ValueError(f"{what} {at}: 'length' must be a positive integer, got {row.get('length')!r}")
        for field in ("triton_ms", "flash_ms"):
            if not positive_number(row.get(field)):
                raise ValueError(f"{what} {at}: {field!r} must be a positive number of milliseconds, got "
                                 f"{row.get(field)!r}")
        key = (row["pattern"], row["pass"], row["length"])
        if key in rows:
            raise ValueError(f"{what} {at}: a second row for (pattern, pass, length) {key}")
        rows[key] = FlexBackendTimes(float(row["triton_ms"]), float(row["flash_ms"]))
    return FlexBackendDeviceTable(dtype, entry["head_dim"], entry["block_size"], rows)


FLEX_BACKEND_TABLE: dict[str, FlexBackendDeviceTable] = load_flex_backend_table()
"""The shipped table, by device-name substring. Replace it process-wide with
``flexsparse.runtime.flex_backend_table.FLEX_BACKEND_TABLE = load_flex_backend_table(path)`` (``{}``: flex
never chooses FLASH itself); read when a call is planned and run."""


def device_table(device: torch.device) -> FlexBackendDeviceTable | None:
    """The table of a CUDA device: the longest key of :data:`FLEX_BACKEND_TABLE` in its name; None for other
    devices and names no key matches."""
    if device.type != "cuda" or not FLEX_BACKEND_TABLE:
        return None
    return entry_for_name(FLEX_BACKEND_TABLE, cuda_device_name(device_index(device)))


def flash_time_ratio(pattern: str, device: torch.device, dtype: torch.dtype, head_dim: int, block_size: int,
                     length: int, grad: bool) -> float | None:
    """FLASH's measured time over Triton's for a compiled flex launch of ``pattern`` (a ``Pattern.name``) on
    every head, over ``length`` queries and keys, with a backward when ``grad``; None where the table does not
    apply (see the module docstring)."""
    table = device_table(device)
    if table is None or (dtype, head_dim, block_size) != (table.dtype, table.head_dim, table.block_size):
        return None
    return table.flash_ratio(pattern, PASSES[1] if grad else PASSES[0], length)
