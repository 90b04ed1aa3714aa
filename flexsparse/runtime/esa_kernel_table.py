"""The measured table of ESA's gather kernel against compiled flex, per device: what
:class:`~flexsparse.runtime.esa_executor.EsaExecutor` prices the kernel at and where it gives ESA heads to flex.

``bench/tables/esa_crossover.py`` times one ESA layer on the kernel and on flex per (pass, length, attn_length) and writes
``flexsparse/runtime/data/esa_kernel.json``, keyed by a substring of the CUDA device name (:data:`ESA_KERNEL`, a
:class:`~flexsparse.runtime.device_tables.MeasuredTable`; the longest matching key wins). :func:`measured_rates`
gives a call's rates in seconds per (query head, attended key): only for a contiguous prefill call on a device the
table knows, at its dtype, the forward+backward row when the call needs gradients, interpolated in log length and
log ``attn_length`` between measured rows (the nearest row outside them) and scaled by the head dim; None
everywhere else.
"""

from __future__ import annotations

from typing import NamedTuple

from flexsparse.runtime.call import AttentionCall
from flexsparse.runtime.device_tables import PASSES, DeviceTable, Field, LogSeries, MeasuredTable


class EsaRates(NamedTuple):
    """Seconds per (query head, attended key) of one ESA layer on the gather kernel and on compiled flex: the
    layer's time over ``heads x length x min(attn_length, length)`` pairs."""

    kernel: float
    flex: float

    def scaled(self, factor: float) -> EsaRates:
        return EsaRates(self.kernel * factor, self.flex * factor)


ESA_KERNEL: MeasuredTable[EsaRates, EsaRates] = MeasuredTable(
    "ESA kernel table", "data/esa_kernel.json", key=("pass", "length", "attn_length"), settings=("head_dim",),
    fields=(Field.one_of("pass", PASSES), Field.positive_int("length"), Field.positive_int("attn_length"),
            Field.positive_number("kernel_s_per_query_key", "seconds"),
            Field.positive_number("flex_s_per_query_key", "seconds")),
    row=lambda row: EsaRates(float(row["kernel_s_per_query_key"]), float(row["flex_s_per_query_key"])))
"""The table: ``{"devices": {KEY: {"dtype": "bfloat16", "head_dim": 128, "entries": [{"pass": "forward",
"length": 8192, "attn_length": 64, "kernel_s_per_query_key": 1.6e-12, "flex_s_per_query_key": 9e-12}, ...]}}}``,
loaded at import; a device's series are by ``(pass, attn_length)``."""


def rates(table: DeviceTable[EsaRates, EsaRates], pass_name: str, length: int, attn_length: int) -> EsaRates | None:
    """A device's rates at ``length`` and ``attn_length`` for ``pass_name``, interpolated linearly in log length,
    then in log attn_length, between measured rows (the nearest row outside them); None: the pass has no row."""
    at_length = {window: series.interpolated(length) for (row_pass, window), series in table.series.items()
                 if row_pass == pass_name}
    return LogSeries.of(at_length).interpolated(attn_length) if at_length else None


def measured_rates(call: AttentionCall, attn_length: int) -> EsaRates | None:
    """The table's rates for this call's pass, length and ``attn_length``, at the call's head dim; None where the
    table does not apply (see the module docstring)."""
    geo = call.geometry
    if not geo.is_contiguous or geo.q_len != geo.kv_len:
        return None
    table = ESA_KERNEL.for_device(call.q.device)
    if table is None or call.q.dtype != table.dtype:
        return None
    found = rates(table, PASSES[1] if call.needs_grad else PASSES[0], geo.kv_len, attn_length)
    return None if found is None else found.scaled(call.q.shape[-1] / table.settings["head_dim"])
