"""The measured table of ESA's gather kernel against compiled flex, per device: what
:class:`~flexsparse.runtime.esa_executor.EsaExecutor` prices the kernel at and where it gives ESA heads to flex.

``bench/esa_crossover.py`` times one ESA layer on the kernel and on flex per (pass, length, attn_length) and writes
``flexsparse/runtime/data/esa_kernel.json``, keyed by a substring of the CUDA device name (:data:`ESA_KERNEL_TABLE`;
the longest matching key wins). :func:`measured_rates` gives a call's rates in seconds per (query head, attended
key): only for a contiguous prefill call on a device the table knows, at its dtype, the forward+backward row when
the call needs gradients, interpolated in log length and log ``attn_length`` between measured rows (the nearest
row outside them) and scaled by the head dim; None everywhere else.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from flexsparse.runtime.call import AttentionCall
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

TABLE_FILE = "data/esa_kernel.json"
"""The shipped table of measured rates, relative to the ``flexsparse.runtime`` package."""


@dataclass(frozen=True)
class EsaRates:
    """Seconds per (query head, attended key) of one ESA layer on the gather kernel and on compiled flex: the
    layer's time over ``heads x length x min(attn_length, length)`` pairs."""

    kernel: float
    flex: float

    def scaled(self, factor: float) -> EsaRates:
        return EsaRates(self.kernel * factor, self.flex * factor)


@dataclass(frozen=True)
class EsaDeviceTable:
    """One device's measured rates: the dtype and head dim they were measured at, by (pass, length,
    attn_length)."""

    dtype: torch.dtype
    head_dim: int
    rows: Mapping[tuple[str, int, int], EsaRates]

    def rates(self, pass_name: str, length: int, attn_length: int) -> EsaRates | None:
        """Rates at ``length`` and ``attn_length`` for ``pass_name``, interpolated linearly in log length, then in
        log attn_length, between measured rows (the nearest row outside them); None: the pass has no row."""
        by_window: dict[int, dict[int, EsaRates]] = {}
        for (row_pass, row_length, row_window), rates in self.rows.items():
            if row_pass == pass_name:
                by_window.setdefault(row_window, {})[row_length] = rates
        if not by_window:
            return None
        at_length = {window: _interpolated(rows, length) for window, rows in by_window.items()}
        return _interpolated(at_length, attn_length)


def _interpolated(points: Mapping[int, EsaRates], x: int) -> EsaRates:
    """Linear in log2(x) between the measured points around ``x``; the nearest one outside them."""
    xs = sorted(points)
    if x <= xs[0]:
        return points[xs[0]]
    if x >= xs[-1]:
        return points[xs[-1]]
    upper = next(i for i, at in enumerate(xs) if at >= x)
    lo, hi = xs[upper - 1], xs[upper]
    t = (math.log2(x) - math.log2(lo)) / (math.log2(hi) - math.log2(lo))
    a, b = points[lo], points[hi]
    return EsaRates(a.kernel + t * (b.kernel - a.kernel), a.flex + t * (b.flex - a.flex))


def default_table_path() -> Path:
    """The shipped table file (in the installed package)."""
    return shipped_table_path(TABLE_FILE)


def load_esa_kernel_table(path: str | Path | None = None) -> dict[str, EsaDeviceTable]:
    """The table in ``path`` (default: the shipped one), by device-name substring.

    The file: ``{"devices": {KEY: {"dtype": "bfloat16", "head_dim": 128, "entries": [{"pass": "forward",
    "length": 8192, "attn_length": 64, "kernel_s_per_query_key": 1.6e-12, "flex_s_per_query_key": 9e-12},
    ...]}}}`` (other keys, such as ``"about"`` and ``"measured"``, are notes). Raises ValueError naming the file
    and the field that is wrong.
    """
    path = Path(path) if path is not None else default_table_path()
    devices = read_device_entries(path, "ESA kernel table")
    return {key: device_table_from_json(entry, f"{path}: devices[{key!r}]") for key, entry in devices.items()}




def device_table_from_json(entry: object, where: str = "device entry") -> EsaDeviceTable:
    """One device's table from its JSON object (``{"dtype": ..., "head_dim": ..., "entries": [...]}``, see
    :func:`load_esa_kernel_table`); ``where`` names it in errors."""
    rows_json, dtype = entry_rows_and_dtype(entry, "ESA kernel table", where)
    head_dim = entry.get("head_dim")
    if not positive_int(head_dim):
        raise ValueError(f"ESA kernel table {where}: 'head_dim' must be a positive integer, got {head_dim!r}")
    rows: dict[tuple[str, int, int], EsaRates] = {}
    for i, row in enumerate(rows_json):
        at = f"{where}.entries[{i}]"
        if not isinstance(row, dict):
            raise ValueError(f"ESA kernel table {at}: expected an object")
        if row.get("pass") not in PASSES:
            raise ValueError(f"ESA kernel table {at}: 'pass' must be one of {PASSES}, got {row.get('pass')!r}")
        for field in ("length", "attn_length"):
            if not positive_int(row.get(field)):
                raise ValueError(f"ESA kernel table {at}: {field!r} must be a positive integer, got "
                                 f"{row.get(field)!r}")
        for field in ("kernel_s_per_query_key", "flex_s_per_query_key"):
            if not positive_number(row.get(field)):
                raise ValueError(f"ESA kernel table {at}: {field!r} must be a positive number of seconds, got "
                                 f"{row.get(field)!r}")
        key = (row["pass"], row["length"], row["attn_length"])
        if key in rows:
            raise ValueError(f"ESA kernel table {at}: a second row for (pass, length, attn_length) {key}")
        rows[key] = EsaRates(float(row["kernel_s_per_query_key"]), float(row["flex_s_per_query_key"]))
    return EsaDeviceTable(dtype, head_dim, rows)


ESA_KERNEL_TABLE: dict[str, EsaDeviceTable] = load_esa_kernel_table()
"""The shipped table, by device-name substring. Replace it process-wide with
``flexsparse.runtime.esa_kernel_table.ESA_KERNEL_TABLE = load_esa_kernel_table(path)``; read when a call is planned."""


def device_table(device: torch.device) -> EsaDeviceTable | None:
    """The table of a CUDA device: the longest key of :data:`ESA_KERNEL_TABLE` in its name; None for other devices
    and names no key matches."""
    if device.type != "cuda" or not ESA_KERNEL_TABLE:
        return None
    return entry_for_name(ESA_KERNEL_TABLE, cuda_device_name(device_index(device)))


def measured_rates(call: AttentionCall, attn_length: int) -> EsaRates | None:
    """The table's rates for this call's pass, length and ``attn_length``, at the call's head dim; None where the
    table does not apply (see the module docstring)."""
    geo = call.geometry
    if not geo.is_contiguous or geo.q_len != geo.kv_len:
        return None
    table = device_table(call.q.device)
    if table is None or call.q.dtype != table.dtype:
        return None
    rates = table.rates(PASSES[1] if call.needs_grad else PASSES[0], geo.kv_len, attn_length)
    return None if rates is None else rates.scaled(call.q.shape[-1] / table.head_dim)
