"""Per-device tables measured on a GPU and shipped in ``flexsparse/runtime/data/``: one type for all of them.

A table file is ``{"about": "...", "devices": {KEY: {"dtype": "bfloat16", SETTING: int, ..., "entries":
[ROW, ...]}}}``: per device the dtype and settings (head dim, block size) its rows were measured at, and rows
of measured fields keyed by some of them (``pass``, ``length``, ...). KEY is a substring of the CUDA device name
(``"H100"`` matches ``"NVIDIA H100 80GB HBM3"``; the longest matching key wins). Other keys (``"about"``,
``"measured"``) are notes. :class:`MeasuredTable` reads, checks, looks up and writes one kind of table
(:mod:`~flexsparse.runtime.dense_kernels`, :mod:`~flexsparse.runtime.esa_kernel_table`,
:mod:`~flexsparse.runtime.flex_backend_table`); each device's rows are grouped once into
:class:`LogSeries` over their length, read between measured lengths in log2 length.
"""

from __future__ import annotations

import bisect
import functools
import json
import math
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Generic, TypeVar

import torch

Row = TypeVar("Row")
Value = TypeVar("Value")

PASSES = ("forward", "forward_backward")
"""The passes a table measures: inference, and a training step's forward and backward."""


@functools.cache
def cuda_device_name(index: int) -> str:
    """``torch.cuda.get_device_name(index)``, once per device."""
    return torch.cuda.get_device_name(index)


def positive_number(value: object) -> bool:
    """Whether a table field holds a finite number > 0 (not a bool)."""
    return (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
            and value > 0)


@dataclass(frozen=True)
class Field:
    """A required field of a table row: its name, the check its value passes, and what the check expects (the end
    of "``name`` must be ...")."""

    name: str
    valid: Callable[[object], bool]
    expected: str

    @classmethod
    def positive_int(cls, name: str) -> Field:
        return cls(name, lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 1, "a positive integer")

    @classmethod
    def positive_number(cls, name: str, unit: str) -> Field:
        return cls(name, positive_number, f"a positive number of {unit}")

    @classmethod
    def one_of(cls, name: str, choices: tuple[str, ...]) -> Field:
        return cls(name, lambda v: v in choices, f"one of {choices}")


@dataclass(frozen=True)
class LogSeries(Generic[Value]):
    """Values measured at increasing lengths, read between them linearly in log2 length. Values are floats or
    named tuples of floats (interpolated field by field); :meth:`nearest` takes any value."""

    lengths: tuple[int, ...]
    values: tuple[Value, ...]

    @classmethod
    def of(cls, points: Mapping[int, Value]) -> LogSeries[Value]:
        lengths = tuple(sorted(points))
        return cls(lengths, tuple(points[length] for length in lengths))

    def _around(self, length: int) -> int:
        """The index of the first measured length >= ``length`` (len(lengths) past the last)."""
        return bisect.bisect_left(self.lengths, length)

    def nearest(self, length: int) -> Value:
        """The value at the measured length nearest to ``length`` in log2 (the shorter one on a tie)."""
        i = self._around(length)
        if i in (0, len(self.lengths)):
            return self.values[min(i, len(self.lengths) - 1)]
        lo, hi = self.lengths[i - 1], self.lengths[i]
        shorter = math.log2(length) - math.log2(lo) <= math.log2(hi) - math.log2(length)
        return self.values[i - 1] if shorter else self.values[i]

    def interpolated(self, length: int) -> Value:
        """Linear in log2 length between the measured lengths around ``length``; the nearest one's value outside
        them."""
        i = self._around(length)
        if i in (0, len(self.lengths)) or self.lengths[i] == length:
            return self.values[min(i, len(self.lengths) - 1)]
        lo, hi = self.lengths[i - 1], self.lengths[i]
        t = (math.log2(length) - math.log2(lo)) / (math.log2(hi) - math.log2(lo))
        a, b = self.values[i - 1], self.values[i]
        if isinstance(a, tuple):
            return type(a)(*(x + t * (y - x) for x, y in zip(a, b, strict=True)))
        return a + t * (b - a)


@dataclass(frozen=True)
class DeviceTable(Generic[Row, Value]):
    """One device's part of a table: the dtype and settings (``{"head_dim": 128}``) its rows were measured at,
    its rows by key, and the values read from them as series over length, by the rest of the key (key
    ``(pass, length, attn_length)``: series by ``(pass, attn_length)``)."""

    dtype: torch.dtype
    settings: Mapping[str, int]
    rows: Mapping[tuple, Row]
    series: Mapping[tuple, LogSeries[Value]]


class MeasuredTable(Generic[Row, Value]):
    """One kind of measured table: its file format and checks, its devices (the shipped file's, loaded once, at
    construction) and their lookup by CUDA device, and the writing of a device's rows.

    ``what`` names the table in errors; ``file``: the shipped file, relative to ``flexsparse.runtime`` (or
    absolute); ``key``: the row fields that identify a row, one of them ``"length"``; ``fields``: every required
    row field and its check; ``row``: a checked row's measurement (what :attr:`DeviceTable.rows` holds);
    ``value``: what a row's series holds (default: the row); ``settings``: device-level positive integers;
    ``dtypes``: the dtypes allowed (default: any); ``row_problem``: checks across a row's fields, a problem (the
    end of an error) or None.

    :attr:`devices` holds the shipped table by device-name substring, read on every lookup; replace it
    process-wide with ``table.devices = table.load(path)`` (``{}``: no device is known).
    """

    def __init__(self, what: str, file: str | Path, *, key: tuple[str, ...], fields: Sequence[Field],
                 row: Callable[[dict], Row], value: Callable[[Row], Value] | None = None,
                 settings: tuple[str, ...] = (), dtypes: tuple[torch.dtype, ...] | None = None,
                 row_problem: Callable[[dict], str | None] | None = None) -> None:
        if "length" not in key or not set(key) <= {f.name for f in fields}:
            raise ValueError(f"key must name checked fields, one of them 'length', got {key!r}")
        self.what, self.file, self.key, self.fields = what, file, key, tuple(fields)
        self.row, self.value, self.settings, self.dtypes = row, value or (lambda r: r), settings, dtypes
        self.row_problem = row_problem
        self.devices: dict[str, DeviceTable[Row, Value]] = self.load()

    @property
    def shipped_path(self) -> Path:
        """The shipped table file (in the installed package)."""
        if Path(self.file).is_absolute():
            return Path(self.file)
        return Path(str(resources.files("flexsparse.runtime").joinpath(str(self.file))))

    def load(self, path: str | Path | None = None) -> dict[str, DeviceTable[Row, Value]]:
        """The table in ``path`` (default: the shipped one), by device-name substring. Raises ValueError naming the
        file and the field that is wrong."""
        path = Path(path) if path is not None else self.shipped_path
        try:
            data = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as err:
            raise ValueError(f"{self.what} {path}: cannot be read as JSON ({err})") from err
        devices = data.get("devices") if isinstance(data, dict) else None
        if not isinstance(devices, dict):
            raise ValueError(f"{self.what} {path}: expected an object with a 'devices' object")
        return {key: self.device_from_json(entry, f"{path}: devices[{key!r}]") for key, entry in devices.items()}

    def device_from_json(self, entry: object, where: str = "device entry") -> DeviceTable[Row, Value]:
        """One device's table from its JSON object (see the module docstring); ``where`` names it in errors."""
        if not isinstance(entry, dict) or not isinstance(entry.get("entries"), list):
            raise ValueError(f"{self.what} {where}: expected an object with an 'entries' list")
        dtype = getattr(torch, str(entry.get("dtype")), None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"{self.what} {where}: 'dtype' must name a torch dtype, got {entry.get('dtype')!r}")
        if self.dtypes is not None and dtype not in self.dtypes:
            names = " or ".join(str(d).removeprefix("torch.") for d in self.dtypes)
            raise ValueError(f"{self.what} {where}: 'dtype' must be {names}, got {entry.get('dtype')!r}")
        for name in self.settings:
            self._check(Field.positive_int(name), entry, where)
        rows: dict[tuple, Row] = {}
        for i, row in enumerate(entry["entries"]):
            at = f"{where}.entries[{i}]"
            if not isinstance(row, dict):
                raise ValueError(f"{self.what} {at}: expected an object")
            for field in self.fields:
                self._check(field, row, at)
            problem = self.row_problem(row) if self.row_problem is not None else None
            if problem is not None:
                raise ValueError(f"{self.what} {at}: {problem}")
            key = tuple(row[name] for name in self.key)
            if key in rows:
                raise ValueError(f"{self.what} {at}: a second row for ({', '.join(self.key)}) {key}")
            rows[key] = self.row(row)
        return DeviceTable(dtype, {name: entry[name] for name in self.settings}, rows, self._series(rows))

    def _check(self, field: Field, obj: dict, where: str) -> None:
        if not field.valid(obj.get(field.name)):
            raise ValueError(f"{self.what} {where}: {field.name!r} must be {field.expected}, got "
                             f"{obj.get(field.name)!r}")

    def _series(self, rows: Mapping[tuple, Row]) -> dict[tuple, LogSeries[Value]]:
        """The rows' values as series over length, by the rest of their key."""
        at = self.key.index("length")
        grouped: dict[tuple, dict[int, Value]] = {}
        for key, row in rows.items():
            grouped.setdefault(key[:at] + key[at + 1:], {})[key[at]] = self.value(row)
        return {rest: LogSeries.of(points) for rest, points in grouped.items()}

    def for_name(self, name: str) -> DeviceTable[Row, Value] | None:
        """The table of the longest key of :attr:`devices` contained in the device name ``name``; None if no key
        is."""
        keys = [key for key in self.devices if key in name]
        return self.devices[max(keys, key=len)] if keys else None

    def for_device(self, device: torch.device) -> DeviceTable[Row, Value] | None:
        """The table of a CUDA device (:meth:`for_name` of its name); None for other devices."""
        if device.type != "cuda" or not self.devices:
            return None
        return self.for_name(cuda_device_name(device.index if device.index is not None
                                              else torch.cuda.current_device()))

    def write(self, path: Path, key: str, entry: dict) -> None:
        """Replaces ``key``'s entry of the table file ``path`` (created if absent), keeps the other devices', and
        writes it only if :meth:`load` accepts the result."""
        data = json.loads(path.read_text()) if path.exists() else {"about": "", "devices": {}}
        data["devices"][key] = entry
        tmp = path.with_suffix(".tmp")
        tmp.write_text(table_text(data))
        try:
            self.load(tmp)
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
        print(f"wrote {len(entry['entries'])} rows for {key!r} to {path}")


def table_text(data: dict) -> str:
    """A table file's text: one line per device field and per entry, so diffs show which rows changed."""
    lines = ["{", f' "about": {json.dumps(data.get("about", ""))},', ' "devices": {']
    devices = list(data["devices"].items())
    for i, (key, device) in enumerate(devices):
        lines.append(f"  {json.dumps(key)}: {{")
        lines += [f"   {json.dumps(field)}: {json.dumps(value)}," for field, value in device.items()
                  if field != "entries"]
        entries = device["entries"]
        lines.append('   "entries": [')
        lines += [f"    {json.dumps(e)}" + ("," if j < len(entries) - 1 else "") for j, e in enumerate(entries)]
        lines += ["   ]", "  }" + ("," if i < len(devices) - 1 else "")]
    lines += [" }", "}"]
    return "\n".join(lines) + "\n"
