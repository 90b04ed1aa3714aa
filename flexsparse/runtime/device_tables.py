"""Per-device tables measured on a GPU and shipped in ``flexsparse/runtime/data/``: the parts every such table
shares. A table file is ``{"devices": {KEY: {"dtype": "bfloat16", "entries": [...], ...}}, ...}``, KEY a
substring of the CUDA device name (``"H100"`` matches ``"NVIDIA H100 80GB HBM3"``; the longest matching key
wins). Each table module parses its own entries (:mod:`~flexsparse.runtime.dense_kernels`,
:mod:`~flexsparse.runtime.esa_kernel_table`)."""

from __future__ import annotations

import functools
import json
import math
import os
from collections.abc import Callable, Mapping
from importlib import resources
from pathlib import Path
from typing import TypeVar

import torch

Entry = TypeVar("Entry")


def shipped_table_path(file: str) -> Path:
    """A table file shipped in the installed package (``file`` relative to ``flexsparse.runtime``)."""
    return Path(str(resources.files("flexsparse.runtime").joinpath(file)))


def read_device_entries(path: Path, what: str) -> dict[str, object]:
    """The ``devices`` object of the table file ``path``; ValueError naming ``what`` and the file otherwise."""
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(f"{what} {path}: cannot be read as JSON ({err})") from err
    devices = data.get("devices") if isinstance(data, dict) else None
    if not isinstance(devices, dict):
        raise ValueError(f"{what} {path}: expected an object with a 'devices' object")
    return devices


def entry_rows_and_dtype(entry: object, what: str, where: str) -> tuple[list, torch.dtype]:
    """A device entry's ``entries`` list and the dtype it was measured at; ValueError naming ``where`` otherwise."""
    if not isinstance(entry, dict) or not isinstance(entry.get("entries"), list):
        raise ValueError(f"{what} {where}: expected an object with an 'entries' list")
    dtype = getattr(torch, str(entry.get("dtype")), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"{what} {where}: 'dtype' must name a torch dtype, got {entry.get('dtype')!r}")
    return entry["entries"], dtype


@functools.cache
def positive_int(value: object) -> bool:
    """Whether a table field holds an int >= 1 (not a bool)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def positive_number(value: object) -> bool:
    """Whether a table field holds a finite number > 0 (not a bool)."""
    return (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
            and value > 0)


def cuda_device_name(index: int) -> str:
    """``torch.cuda.get_device_name(index)``, once per device."""
    return torch.cuda.get_device_name(index)


def device_index(device: torch.device) -> int:
    """A CUDA device's index (the current device where ``device`` names none)."""
    return device.index if device.index is not None else torch.cuda.current_device()


def entry_for_name(table: Mapping[str, Entry], name: str) -> Entry | None:
    """The entry of the longest key of ``table`` contained in the device name ``name``; None if no key is."""
    keys = [key for key in table if key in name]
    return table[max(keys, key=len)] if keys else None


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


def write_device_entry(path: Path, key: str, entry: dict, load: Callable[[Path], object]) -> None:
    """Replaces ``key``'s entry of the table file ``path`` (created if absent), keeps the other devices', and
    writes it only if ``load`` (the table's loader) accepts the result."""
    data = json.loads(path.read_text()) if path.exists() else {"about": "", "devices": {}}
    data["devices"][key] = entry
    tmp = path.with_suffix(".tmp")
    tmp.write_text(table_text(data))
    try:
        load(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    print(f"wrote {len(entry['entries'])} rows for {key!r} to {path}")
