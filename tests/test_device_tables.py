"""The measured-table type every per-device table uses: its checks (a malformed file is refused naming the file
and the field), the lookup by device name, the series over length (nearest and interpolated in log2 length), and
writing a device's rows. CPU only: a CUDA device's name is faked (:func:`device_tables.cuda_device_name`)."""

import json
import math
from typing import NamedTuple

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from flexsparse.runtime import device_tables
from flexsparse.runtime.device_tables import PASSES, Field, LogSeries, MeasuredTable


class Times(NamedTuple):
    fast_ms: float
    slow_ms: float


def row(pass_name, length, window, fast_ms, slow_ms):
    return {"pass": pass_name, "length": length, "window": window, "fast_ms": fast_ms, "slow_ms": slow_ms}


TABLE = {"about": "test", "devices": {
    "H100": {"dtype": "bfloat16", "head_dim": 64, "measured": {"note": "ignored"}, "entries": [
        row("forward", 1024, 8, 1.0, 4.0), row("forward", 4096, 8, 3.0, 8.0), row("forward", 1024, 32, 2.0, 2.0),
        row("forward_backward", 2048, 8, 5.0, 6.0)]},
    "H100 PCIe": {"dtype": "float16", "head_dim": 128, "entries": [row("forward", 1024, 8, 1.0, 1.0)]},
}}


def too_slow(entry: dict) -> str | None:
    return "'fast_ms' must not exceed 'slow_ms'" if entry["fast_ms"] > entry["slow_ms"] else None


def kind(path) -> MeasuredTable:
    """A table of two times per (pass, length, window), read as their ratio along length."""
    return MeasuredTable(
        "test table", path, key=("pass", "length", "window"), settings=("head_dim",),
        dtypes=(torch.bfloat16, torch.float16),
        fields=(Field.one_of("pass", PASSES), Field.positive_int("length"), Field.positive_int("window"),
                Field.positive_number("fast_ms", "milliseconds"), Field.positive_number("slow_ms", "milliseconds")),
        row=lambda r: Times(float(r["fast_ms"]), float(r["slow_ms"])), value=lambda t: t.fast_ms / t.slow_ms,
        row_problem=too_slow)


@pytest.fixture
def table(tmp_path, monkeypatch):
    path = tmp_path / "table.json"
    path.write_text(json.dumps(TABLE))
    monkeypatch.setattr(device_tables, "cuda_device_name",
                        {0: "NVIDIA H100 80GB HBM3", 1: "NVIDIA H100 PCIe", 2: "NVIDIA A100-SXM4-80GB"}.__getitem__)
    return kind(path)


def test_loads_at_construction_with_rows_settings_and_series_by_the_key_without_length(table):
    h100 = table.devices["H100"]
    assert (h100.dtype, h100.settings) == (torch.bfloat16, {"head_dim": 64})
    assert h100.rows["forward", 4096, 8] == Times(3.0, 8.0)
    assert set(h100.series) == {("forward", 8), ("forward", 32), ("forward_backward", 8)}
    assert h100.series["forward", 8] == LogSeries((1024, 4096), (0.25, 0.375))
    assert table.load() == table.devices  # a second load of the same file: equal tables
    assert table.devices["H100 PCIe"].dtype == torch.float16


def test_lookup_by_the_longest_key_in_the_device_name(table):
    assert table.for_name("NVIDIA H100 80GB HBM3") is table.devices["H100"]
    assert table.for_name("NVIDIA H100 PCIe") is table.devices["H100 PCIe"]
    assert table.for_name("NVIDIA A100-SXM4-80GB") is None
    assert table.for_device(torch.device("cuda", 0)) is table.devices["H100"]
    assert table.for_device(torch.device("cuda", 1)) is table.devices["H100 PCIe"]
    assert table.for_device(torch.device("cuda", 2)) is None  # device not found: no table
    assert table.for_device(torch.device("cpu")) is None
    table.devices = {}
    assert table.for_device(torch.device("cuda", 0)) is None


def bad(change):
    data = json.loads(json.dumps(TABLE))
    change(data["devices"]["H100"])
    return data


def set_row(field, value):
    return lambda device: device["entries"][0].update({field: value})


@pytest.mark.parametrize("data, problem", [
    ({"devices": []}, r"expected an object with a 'devices' object"),
    (bad(lambda d: d.pop("entries")), r"devices\['H100'\]: expected an object with an 'entries' list"),
    (bad(lambda d: d.update(dtype="bfloat17")), r"devices\['H100'\]: 'dtype' must name a torch dtype, got 'bfloat17'"),
    (bad(lambda d: d.update(dtype="float32")), r"'dtype' must be bfloat16 or float16, got 'float32'"),
    (bad(lambda d: d.update(head_dim=True)), r"devices\['H100'\]: 'head_dim' must be a positive integer, got True"),
    (bad(lambda d: d.pop("head_dim")), r"'head_dim' must be a positive integer, got None"),
    (bad(lambda d: d["entries"].append([])), r"entries\[4\]: expected an object"),
    (bad(set_row("pass", "backward")), r"entries\[0\]: 'pass' must be one of \('forward', 'forward_backward'\)"),
    (bad(set_row("length", 0)), r"entries\[0\]: 'length' must be a positive integer, got 0"),
    (bad(set_row("window", [8])), r"entries\[0\]: 'window' must be a positive integer, got \[8\]"),
    (bad(set_row("slow_ms", math.inf)), r"'slow_ms' must be a positive number of milliseconds, got inf"),
    (bad(lambda d: d["entries"][0].pop("fast_ms")), r"'fast_ms' must be a positive number of milliseconds, got None"),
    (bad(set_row("fast_ms", 9.0)), r"entries\[0\]: 'fast_ms' must not exceed 'slow_ms'"),
    (bad(set_row("length", 4096)), r"entries\[1\]: a second row for \(pass, length, window\) \('forward', 4096, 8\)"),
])
def test_a_malformed_table_is_refused_naming_the_file_and_the_field(tmp_path, data, problem):
    path = tmp_path / "broken.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=f"test table {path}: .*{problem}"):
        kind(path)


def test_an_unreadable_or_absent_table_is_refused(tmp_path):
    path = tmp_path / "broken.json"
    path.write_text("{not json")
    with pytest.raises(ValueError, match=f"test table {path}: cannot be read as JSON"):
        kind(path)
    with pytest.raises(ValueError, match="cannot be read as JSON"):
        kind(tmp_path / "absent.json")


def test_nearest_and_interpolated_in_log2_length():
    series = LogSeries.of({4096: 3.0, 1024: 1.0, 65536: 5.0})
    assert series.lengths == (1024, 4096, 65536)
    assert series.interpolated(2048) == pytest.approx(2.0)  # halfway in log2 between 1K and 4K
    assert series.interpolated(16384) == pytest.approx(4.0)
    assert series.interpolated(4096) == 3.0 and series.interpolated(1) == 1.0 and series.interpolated(1 << 20) == 5.0
    assert series.nearest(2048) == 1.0  # a tie in log2: the shorter length
    assert series.nearest(2049) == 3.0 and series.nearest(100) == 1.0 and series.nearest(1 << 20) == 5.0
    times = LogSeries.of({1024: Times(1.0, 10.0), 4096: Times(3.0, 30.0)}).interpolated(2048)
    assert type(times) is Times and times == pytest.approx((2.0, 20.0))  # named tuples: field by field


@given(points=st.dictionaries(st.integers(1, 1 << 20), st.floats(-1e6, 1e6), min_size=1, max_size=6),
       length=st.integers(1, 1 << 21))
def test_interpolated_stays_between_its_neighbours_and_is_exact_at_measured_lengths(points, length):
    series = LogSeries.of(points)
    value = series.interpolated(length)
    lower = [x for x in series.lengths if x <= length] or [series.lengths[0]]
    upper = [x for x in series.lengths if x >= length] or [series.lengths[-1]]
    lo, hi = points[lower[-1]], points[upper[0]]
    assert min(lo, hi) - 1e-6 <= value <= max(lo, hi) + 1e-6
    assert series.nearest(length) in (lo, hi)
    for x, y in points.items():
        assert series.interpolated(x) == y and series.nearest(x) == y


def test_write_replaces_one_device_and_keeps_the_others(table, tmp_path, capsys):
    path = tmp_path / "table.json"
    entry = {"dtype": "bfloat16", "head_dim": 64, "measured": {"date": "today"},
             "entries": [row("forward", 8192, 8, 1.0, 2.0)]}
    table.write(path, "H100", entry)
    assert "wrote 1 rows for 'H100'" in capsys.readouterr().out
    loaded = table.load(path)
    assert set(loaded) == {"H100", "H100 PCIe"} and set(loaded["H100"].rows) == {("forward", 8192, 8)}
    data = json.loads(path.read_text())
    assert data["about"] == "test" and data["devices"]["H100"] == entry
    assert f"    {json.dumps(entry['entries'][0])}" in path.read_text().splitlines()  # one line per row
    before = path.read_text()
    with pytest.raises(ValueError, match="'length' must be a positive integer"):
        table.write(path, "A100", {**entry, "entries": [row("forward", -1, 8, 1.0, 2.0)]})
    assert path.read_text() == before and not path.with_suffix(".tmp").exists()  # refused: nothing written
    new = tmp_path / "new.json"
    table.write(new, "A100", entry)
    assert set(table.load(new)) == {"A100"}


def test_the_shipped_tables_use_the_type():
    from flexsparse.runtime.dense_kernels import DENSE_KERNELS
    from flexsparse.runtime.esa_kernel_table import ESA_KERNEL
    from flexsparse.runtime.flex_backend_table import FLEX_BACKENDS

    for shipped in (DENSE_KERNELS, ESA_KERNEL, FLEX_BACKENDS):
        assert shipped.shipped_path.is_file() and shipped.shipped_path.parent.name == "data"
        assert shipped.load() == shipped.devices
