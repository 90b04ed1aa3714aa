"""The ESA executor: ESA heads through flexsparse's Triton gather kernel (:mod:`flexsparse.kernels.esa`).

FlexAttention is the wrong tool for ESA at long lengths: its dilated keys touch 19-60% of the tiles, every one
partial. The gather kernel reads each query's ``attn_length`` keys directly. It takes any whole KV groups of a layer
(the kernel's ``head_offset`` gives each head its own shifts), so in a mixed layer the ESA heads run here beside full
heads on SDPA and sink+window heads on flex. CPU calls and head dims the kernel does not take (not a power of two in
[16, 256]) keep ESA heads on flex. In a sparse KV cache, ESA heads keep every key and a one-token step gathers the
new token's keys (:meth:`EsaExecutor.decode_step`: the kernel on CUDA, its PyTorch form elsewhere).

The crossover with flex is measured, not guessed: ``bench/esa_crossover.py`` times one ESA layer on the kernel and
on flex per (pass, length, attn_length) and writes ``flexsparse/runtime/data/esa_kernel.json``, keyed by a
substring of the CUDA device name (:data:`ESA_KERNEL_TABLE`). Rule: a contiguous prefill call on a device the table
knows, at its dtype, is priced at the kernel's measured seconds per (query head, attended key) for its pass (the
forward+backward row when it needs gradients), interpolated in log length and log ``attn_length`` between measured
rows (the nearest row outside them), and where flex's measured seconds are lower the executor declines the pattern,
so its heads run on flex. Everywhere else (CPU, unknown devices, other dtypes, decode steps, chunks) the constant
:data:`SECONDS_PER_QUERY_KEY` prices the kernel and it takes every call it can run.

The executor recognises its patterns by name (``pattern_names``) and reads their ``attn_length``.
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import torch
from torch import Tensor

from flexsparse.kernels.availability import kernels_preferred_on
from flexsparse.kernels.esa_reference import esa_attention_reference, supports_head_dim
from flexsparse.masks.base import Pattern
from flexsparse.runtime.call import AttentionCall, GroupModes, HeadSelection
from flexsparse.runtime.dense_kernels import PASSES, cuda_device_name
from flexsparse.runtime.executors import Executor

SECONDS_PER_QUERY_KEY = 13.5e-3 / (131072 * 32 * 64)
"""The gather kernel's forward time per (query head, attended key) at head dim 128 where the measured table does
not apply: its forward at 128K for 32 query heads of ``attn_length`` 64 on the H100, the same rate at 8K
(docs/notes/esa-kernel.md); it scales with the head dim."""
CONSTANT_HEAD_DIM = 128
"""The head dim :data:`SECONDS_PER_QUERY_KEY` was measured at."""

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
    return Path(str(resources.files("flexsparse.runtime").joinpath(TABLE_FILE)))


def load_esa_kernel_table(path: str | Path | None = None) -> dict[str, EsaDeviceTable]:
    """The table in ``path`` (default: the shipped one), by device-name substring.

    The file: ``{"devices": {KEY: {"dtype": "bfloat16", "head_dim": 128, "entries": [{"pass": "forward",
    "length": 8192, "attn_length": 64, "kernel_s_per_query_key": 1.6e-12, "flex_s_per_query_key": 9e-12},
    ...]}}}`` (other keys, such as ``"about"`` and ``"measured"``, are notes). Raises ValueError naming the file
    and the field that is wrong.
    """
    path = Path(path) if path is not None else default_table_path()
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(f"ESA kernel table {path}: cannot be read as JSON ({err})") from err
    devices = data.get("devices") if isinstance(data, dict) else None
    if not isinstance(devices, dict):
        raise ValueError(f"ESA kernel table {path}: expected an object with a 'devices' object")
    return {key: device_table_from_json(entry, f"{path}: devices[{key!r}]") for key, entry in devices.items()}


def _positive_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _positive_seconds(value: object) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
            and value > 0)


def device_table_from_json(entry: object, where: str = "device entry") -> EsaDeviceTable:
    """One device's table from its JSON object (``{"dtype": ..., "head_dim": ..., "entries": [...]}``, see
    :func:`load_esa_kernel_table`); ``where`` names it in errors."""
    if not isinstance(entry, dict) or not isinstance(entry.get("entries"), list):
        raise ValueError(f"ESA kernel table {where}: expected an object with an 'entries' list")
    dtype = getattr(torch, str(entry.get("dtype")), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"ESA kernel table {where}: 'dtype' must name a torch dtype, got {entry.get('dtype')!r}")
    head_dim = entry.get("head_dim")
    if not _positive_int(head_dim):
        raise ValueError(f"ESA kernel table {where}: 'head_dim' must be a positive integer, got {head_dim!r}")
    rows: dict[tuple[str, int, int], EsaRates] = {}
    for i, row in enumerate(entry["entries"]):
        at = f"{where}.entries[{i}]"
        if not isinstance(row, dict):
            raise ValueError(f"ESA kernel table {at}: expected an object")
        if row.get("pass") not in PASSES:
            raise ValueError(f"ESA kernel table {at}: 'pass' must be one of {PASSES}, got {row.get('pass')!r}")
        for field in ("length", "attn_length"):
            if not _positive_int(row.get(field)):
                raise ValueError(f"ESA kernel table {at}: {field!r} must be a positive integer, got "
                                 f"{row.get(field)!r}")
        for field in ("kernel_s_per_query_key", "flex_s_per_query_key"):
            if not _positive_seconds(row.get(field)):
                raise ValueError(f"ESA kernel table {at}: {field!r} must be a positive number of seconds, got "
                                 f"{row.get(field)!r}")
        key = (row["pass"], row["length"], row["attn_length"])
        if key in rows:
            raise ValueError(f"ESA kernel table {at}: a second row for (pass, length, attn_length) {key}")
        rows[key] = EsaRates(float(row["kernel_s_per_query_key"]), float(row["flex_s_per_query_key"]))
    return EsaDeviceTable(dtype, head_dim, rows)


ESA_KERNEL_TABLE: dict[str, EsaDeviceTable] = load_esa_kernel_table()
"""The shipped table, by device-name substring. Replace it process-wide with
``flexsparse.runtime.esa_executor.ESA_KERNEL_TABLE = load_esa_kernel_table(path)``; read when a call is planned."""


def device_table(device: torch.device) -> EsaDeviceTable | None:
    """The table of a CUDA device: the longest key of :data:`ESA_KERNEL_TABLE` in its name; None for other devices
    and names no key matches."""
    if device.type != "cuda" or not ESA_KERNEL_TABLE:
        return None
    name = cuda_device_name(device.index if device.index is not None else torch.cuda.current_device())
    keys = [key for key in ESA_KERNEL_TABLE if key in name]
    return ESA_KERNEL_TABLE[max(keys, key=len)] if keys else None


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


def _runs(call: AttentionCall, heads: HeadSelection, modes: tuple[int, ...]) -> list[tuple[int, int, int]]:
    """The selected KV heads as (first position in the selection, count, mode) runs: one mode, consecutive in the
    call's tensors and in the layer (one kernel call each)."""
    runs: list[list[int]] = []
    for i, (local, mode) in enumerate(zip(heads.kv_heads, modes)):
        if runs:
            first, count, run_mode = runs[-1]
            last_local = heads.kv_heads[first + count - 1]
            if (mode == run_mode and local == last_local + 1
                    and call.kv_heads[local] == call.kv_heads[last_local] + 1):
                runs[-1][1] += 1
                continue
        runs.append([i, 1, mode])
    return [tuple(run) for run in runs]


@functools.lru_cache(maxsize=256)
def _consecutive_runs(kv_heads: tuple[int, ...]) -> list[tuple[int, int, int]]:
    """Layer KV heads as (first index, count, the layer's first KV head) runs of consecutive heads."""
    runs: list[list[int]] = []
    for index, head in enumerate(kv_heads):
        if runs and head == runs[-1][2] + runs[-1][1]:
            runs[-1][1] += 1
        else:
            runs.append([index, 1, head])
    return [tuple(run) for run in runs]


class EsaExecutor(Executor):
    """ESA heads on CUDA through the gather kernel (forward, backward, decode, positions)."""

    name = "esa"
    pattern_names = ("esa",)
    """Names of the patterns the gather kernel runs (``Pattern.name``)."""

    def __init__(self, crossover: bool = True) -> None:
        self.crossover = crossover
        """Decline calls the measured table says flex runs faster (False: take every call the kernel can run, as
        benchmarks timing the kernel itself need)."""

    def __repr__(self) -> str:
        return f"EsaExecutor(crossover={self.crossover})"

    def accepts(self, pattern: Pattern, call: AttentionCall) -> bool:
        device = call.q.device
        if not (pattern.name in self.pattern_names and kernels_preferred_on(device)
                and supports_head_dim(call.q.shape[-1])):
            return False
        rates = measured_rates(call, pattern.attn_length) if self.crossover else None
        return rates is None or rates.kernel <= rates.flex

    def cost(self, patterns, call):
        """The kernel's seconds per (query head, attended key), measured (the table) or the constant, times the
        pairs: ``min(attn_length, kv_len)`` keys per query."""
        batch, _, q_len, dim = call.q.shape
        seconds_per_query = 0.0
        for pattern in patterns:
            rates = measured_rates(call, pattern.attn_length)
            rate = rates.kernel if rates is not None else SECONDS_PER_QUERY_KEY * dim / CONSTANT_HEAD_DIM
            seconds_per_query += min(pattern.attn_length, call.geometry.kv_len) * rate
        return batch * call.group_size * q_len * seconds_per_query

    def cache_kind(self, pattern: Pattern) -> str | None:
        return self.name if pattern.name in self.pattern_names else None

    def run(self, call: AttentionCall, patterns: Sequence[Pattern | None], modes: GroupModes,
            heads: HeadSelection) -> Tensor:
        from flexsparse.kernels.esa import esa_attention

        geo, group = call.geometry, call.group_size
        q_positions = key_slots = None
        if not geo.is_contiguous:
            q_positions = geo.positions.q
            key_slots = geo.positions.key_slots()[:, : geo.span].to(torch.int32)
        outputs = []
        for first, count, mode in _runs(call, heads, modes.host):
            local, layer = heads.kv_heads[first], call.kv_heads[heads.kv_heads[first]]
            kv = slice(local, local + count)
            rule = patterns[mode].index_rule
            outputs.append(esa_attention(
                call.q[:, local * group:(local + count) * group], call.k[:, kv], call.v[:, kv], rule,
                call.scale, q_positions=q_positions, key_slots=key_slots, head_offset=layer * group))
        return outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=1)

    def decode_step(self, q: Tensor, keys: Tensor, values: Tensor, pattern: Pattern, kv_heads: Sequence[int],
                    scale: float | None, q_positions: Tensor | None = None,
                    key_slots: Tensor | None = None) -> Tensor:
        """One new token per sequence of the layer's KV heads ``kv_heads`` (one ESA pattern), q ``[B, H_g, 1, d]``,
        against the filled cache slots ``keys``/``values`` ``[B, len(kv_heads), S, d]``; ``q_positions`` and
        ``key_slots`` as :func:`~flexsparse.kernels.esa.esa_attention` takes them (None: slot t holds position t).
        One call per run of consecutive KV heads (the kernel takes whole KV groups of the layer's heads)."""
        if supports_head_dim(q.shape[-1]) and kernels_preferred_on(q.device):
            from flexsparse.kernels.esa import esa_attention as attend  # triton: imported where it runs
        else:
            attend = esa_attention_reference
        group, rule = q.shape[1] // keys.shape[1], pattern.index_rule
        outputs = [attend(q[:, first * group:(first + count) * group], keys[:, first:first + count],
                          values[:, first:first + count], rule, scale, q_positions=q_positions,
                          key_slots=key_slots, head_offset=head * group)
                   for first, count, head in _consecutive_runs(tuple(kv_heads))]
        return outputs[0] if len(outputs) == 1 else torch.cat(outputs, 1)
