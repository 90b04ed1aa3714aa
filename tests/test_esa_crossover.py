"""The measured ESA crossover: the table bench/tables/esa_crossover.py writes, its loading and lookups (by device
name, pass, length and attn_length), and the planner sending ESA heads to the kernel or to flex as the table says.

CPU tests fake a CUDA device's name (:func:`device_tables.cuda_device_name`) or, for plans, the table's lookup
(``ESA_KERNEL.for_device``) and the kernel's availability (:func:`kernels_preferred_on`). Plans are made at real sizes
on the meta device (32/8 heads, d 128, 2K to 32K): costs need shapes only, and flex accepts meta calls with
gradients (it refuses CPU ones: no CPU backward).
"""

import json
import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from flexsparse.masks import ESA, Causal, Geometry
from flexsparse.runtime import device_tables, esa_executor
from flexsparse.runtime.call import AttentionCall
from flexsparse.runtime.esa_executor import SECONDS_PER_QUERY_KEY, EsaExecutor
from flexsparse.runtime.esa_kernel_table import ESA_KERNEL, EsaRates, rates
from flexsparse.runtime.executors import SdpaExecutor
from flexsparse.runtime.flex import FlexExecutor
from flexsparse.runtime.plan import Planner
from tests.bench_scripts import load_bench

PS = 1e-12
NAMES = {0: "NVIDIA H100 80GB HBM3", 1: "NVIDIA A100-SXM4-80GB", 2: "NVIDIA H100 PCIe"}
HEADS, KV_HEADS, DIM = 32, 8, 128
META = torch.device("meta")


def entry(pass_name, length, attn_length, kernel_ps, flex_ps):
    return {"pass": pass_name, "length": length, "attn_length": attn_length,
            "kernel_s_per_query_key": kernel_ps * PS, "flex_s_per_query_key": flex_ps * PS}


H100_ROWS = [
    # forward: the kernel is faster at every length
    entry("forward", 2048, 64, 60, 240), entry("forward", 8192, 64, 50, 300), entry("forward", 32768, 64, 40, 600),
    # forward+backward: flex is faster up to 8K, the kernel at 32K; linear in log2 length the rates meet at
    # t = 0.2 of the two octaves from 8K: 8K * 2**0.4 (10810)
    entry("forward_backward", 2048, 64, 500, 250), entry("forward_backward", 8192, 64, 400, 300),
    entry("forward_backward", 32768, 64, 300, 700),
    entry("forward_backward", 8192, 256, 200, 100),
]
CROSSING = 8192 * 2**0.4
TABLE = {"about": "test", "devices": {
    "H100": {"dtype": "bfloat16", "head_dim": 128, "measured": None, "entries": H100_ROWS},
    "H100 PCIe": {"dtype": "bfloat16", "head_dim": 64, "entries": [entry("forward", 4096, 64, 7, 8)]},
}}
H100 = ESA_KERNEL.device_from_json(TABLE["devices"]["H100"])


@pytest.fixture
def table(tmp_path, monkeypatch):
    """TABLE written to a file, loaded as the process's table; device names faked by index."""
    path = tmp_path / "esa_kernel.json"
    path.write_text(json.dumps(TABLE))
    monkeypatch.setattr(ESA_KERNEL, "devices", ESA_KERNEL.load(path))
    monkeypatch.setattr(device_tables, "cuda_device_name", NAMES.__getitem__)
    return ESA_KERNEL.devices


@pytest.fixture
def meta_as_h100(monkeypatch):
    """Meta-device calls looked up as an H100 whose kernel runs (the table is set on the returned dict's "table";
    None: no table)."""
    state = {"table": H100}
    monkeypatch.setattr(ESA_KERNEL, "for_device", lambda device: state["table"])
    monkeypatch.setattr(esa_executor, "kernels_preferred_on", lambda device: True)
    return state


def meta_call(length, grad, kv_len=None, dtype=torch.bfloat16, dim=DIM, batch=1):
    kv_len = kv_len or length
    q = torch.empty(batch, HEADS, length, dim, device=META, dtype=dtype)
    k = torch.empty(batch, KV_HEADS, kv_len, dim, device=META, dtype=dtype)
    return AttentionCall(q, k, k, dim**-0.5, Geometry(HEADS, length, kv_len, device=META), needs_grad=grad,
                         kv_heads=tuple(range(KV_HEADS)))


def plan(length, grad, attn_length=64):
    """(executor name, KV heads) of a split plan of 4 ESA heads and 4 full heads, at real sizes."""
    patterns = [Causal(), ESA(4, 8, attn_length, HEADS)]
    executors = [SdpaExecutor(), EsaExecutor(), FlexExecutor(patterns)]
    planner = Planner("split", patterns, KV_HEADS, executors, ["full", "esa"])
    groups = planner.groups(meta_call(length, grad), (1, 1, 1, 1, 0, 0, 0, 0))
    return [(g.executor.name, g.heads.kv_heads) for g in groups]


ESA_HEADS, FULL_HEADS = (0, 1, 2, 3), (4, 5, 6, 7)


def test_shipped_table_loads():
    """The shipped table (empty until measured on a device: bench/tables/esa_crossover.py --write-table) is what the
    process reads."""
    assert ESA_KERNEL.load() == ESA_KERNEL.devices
    for table in ESA_KERNEL.devices.values():
        assert table.dtype == torch.bfloat16 and table.settings == {"head_dim": DIM}
        assert {p for p, _, _ in table.rows} == {"forward", "forward_backward"}


def test_lookup_by_device_name(table):
    assert ESA_KERNEL.for_device(torch.device("cuda", 0)) is table["H100"]
    assert ESA_KERNEL.for_device(torch.device("cuda", 2)) is table["H100 PCIe"]  # the longest matching key
    assert ESA_KERNEL.for_device(torch.device("cuda", 1)) is None  # A100: no key
    assert ESA_KERNEL.for_device(torch.device("cpu")) is None


def test_rates_interpolate_in_log_length_and_attn_length(table):
    h100 = table["H100"]
    assert rates(h100, "forward", 8192, 64) == EsaRates(50 * PS, 300 * PS)  # a measured row
    assert rates(h100, "forward", 1024, 64) == rates(h100, "forward", 2048, 64)  # below: the shortest row
    assert rates(h100, "forward", 1 << 20, 64) == rates(h100, "forward", 32768, 64)  # above: the longest
    half = rates(h100, "forward", 4096, 64)  # halfway in log2 between 2K and 8K
    assert (half.kernel, half.flex) == pytest.approx((55 * PS, 270 * PS))
    mid = rates(h100, "forward_backward", 8192, 128)  # halfway in log2 between attn_length 64 and 256
    assert (mid.kernel, mid.flex) == pytest.approx((300 * PS, 200 * PS))
    assert rates(h100, "forward", 8192, 256) == rates(h100, "forward", 8192, 64)  # only 64 measured: nearest
    assert rates(table["H100 PCIe"], "forward_backward", 4096, 64) is None  # no row for the pass


def test_planner_sends_esa_heads_to_flex_where_the_table_says_flex_is_faster(meta_as_h100):
    """Training at 2K and 8K: flex measured faster, the ESA heads go to flex; at 32K and 16K (interpolated) the
    kernel. Inference: the kernel at every length. Full heads stay on SDPA."""
    for length in (2048, 8192):
        assert plan(length, grad=True) == [("flex", ESA_HEADS), ("sdpa", FULL_HEADS)]
    for length in (16384, 32768):
        assert plan(length, grad=True) == [("esa", ESA_HEADS), ("sdpa", FULL_HEADS)]
    for length in (2048, 8192, 32768):
        assert plan(length, grad=False) == [("esa", ESA_HEADS), ("sdpa", FULL_HEADS)]
    assert plan(8192, grad=True, attn_length=256) == [("flex", ESA_HEADS), ("sdpa", FULL_HEADS)]


@given(length=st.integers(1024, 65536))
def test_the_decision_switches_once_at_the_interpolated_crossing(length):
    """Forward+backward rates interpolated in log length: flex below 8K * 2**0.4, the kernel above."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ESA_KERNEL, "for_device", lambda device: H100)
        patch.setattr(esa_executor, "kernels_preferred_on", lambda device: True)
        accepted = EsaExecutor().accepts(ESA(4, 8, 64, HEADS), meta_call(length, grad=True))
    if abs(math.log2(length) - math.log2(CROSSING)) > 1e-6:
        assert accepted == (length > CROSSING)


def test_without_the_table_the_choice_is_todays(meta_as_h100):
    """No table (CPU, unknown devices): the kernel takes every ESA call it can run, priced by the constant."""
    meta_as_h100["table"] = None
    for length in (2048, 8192, 32768):
        for grad in (False, True):
            assert plan(length, grad) == [("esa", ESA_HEADS), ("sdpa", FULL_HEADS)]
    call = meta_call(8192, grad=True, batch=2)
    esa = ESA(4, 8, 64, HEADS)
    assert EsaExecutor().cost([esa, esa], call) == pytest.approx(2 * 4 * 8192 * 2 * 64 * SECONDS_PER_QUERY_KEY)


def test_cost_is_the_measured_kernel_rate_of_the_calls_pass(meta_as_h100):
    """The forward row without gradients, the forward+backward row with them; scaled with the head dim; the
    constant where the table does not apply (other dtypes, chunks)."""
    esa = ESA(4, 8, 64, HEADS)
    pairs = lambda call: call.q.shape[0] * 4 * call.q.shape[2] * 64  # one KV head: 4 query heads
    forward, backward = meta_call(8192, grad=False), meta_call(8192, grad=True)
    assert EsaExecutor().cost([esa], forward) == pytest.approx(pairs(forward) * 50 * PS)
    assert EsaExecutor().cost([esa], backward) == pytest.approx(pairs(backward) * 400 * PS)
    half_dim = meta_call(8192, grad=True, dim=64)
    assert EsaExecutor().cost([esa], half_dim) == pytest.approx(pairs(half_dim) * 200 * PS)
    constant = lambda call: pairs(call) * SECONDS_PER_QUERY_KEY * call.q.shape[-1] / 128
    fp16 = meta_call(8192, grad=True, dtype=torch.float16)
    assert EsaExecutor().cost([esa], fp16) == pytest.approx(constant(fp16))
    assert EsaExecutor().accepts(esa, fp16)  # flex's faster row is for bf16
    chunk = meta_call(512, grad=True, kv_len=8192)
    assert EsaExecutor().cost([esa], chunk) == pytest.approx(constant(chunk))
    assert EsaExecutor().accepts(esa, chunk)


def test_crossover_off_takes_every_call(meta_as_h100):
    """EsaExecutor(crossover=False) (benchmarks timing the kernel) accepts where the table prefers flex."""
    esa, call = ESA(4, 8, 64, HEADS), meta_call(2048, grad=True)
    assert not EsaExecutor().accepts(esa, call)
    assert EsaExecutor(crossover=False).accepts(esa, call)
    assert not EsaExecutor(crossover=False).accepts(Causal(), call)


def bad(path_fields):
    data = json.loads(json.dumps(TABLE))
    device = data["devices"]["H100"]
    for key, value in path_fields.items():
        if key.startswith("row."):
            device["entries"][0][key[4:]] = value
        else:
            device[key] = value
    return data


@pytest.mark.parametrize("data, problem", [
    ([], "expected an object with a 'devices' object"),
    ({"about": "no devices"}, "expected an object with a 'devices' object"),
    (bad({"dtype": "bfloat17"}), r"devices\['H100'\]: 'dtype' must name a torch dtype, got 'bfloat17'"),
    (bad({"head_dim": 0}), r"'head_dim' must be a positive integer, got 0"),
    (bad({"entries": {}}), "expected an object with an 'entries' list"),
    (bad({"row.pass": "backward"}), r"entries\[0\]: 'pass' must be one of \('forward', 'forward_backward'\)"),
    (bad({"row.length": 2048.0}), r"entries\[0\]: 'length' must be a positive integer, got 2048.0"),
    (bad({"row.attn_length": True}), r"'attn_length' must be a positive integer, got True"),
    (bad({"row.kernel_s_per_query_key": -1.0}), r"'kernel_s_per_query_key' must be a positive number"),
    (bad({"row.flex_s_per_query_key": None}), r"'flex_s_per_query_key' must be a positive number"),
    (bad({"row.length": 8192}), (r"entries\[1\]: a second row for \(pass, length, attn_length\) "
                                 r"\('forward', 8192, 64\)")),
])
def test_malformed_table_is_a_value_error_naming_the_file_and_the_problem(tmp_path, data, problem):
    path = tmp_path / "broken.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=f"ESA kernel table {path}.*{problem}"):
        ESA_KERNEL.load(path)


def test_unreadable_table_is_a_value_error(tmp_path):
    path = tmp_path / "esa.json"
    path.write_text("{not json")
    with pytest.raises(ValueError, match=f"ESA kernel table {path}: cannot be read as JSON"):
        ESA_KERNEL.load(path)
    with pytest.raises(ValueError, match="cannot be read as JSON"):
        ESA_KERNEL.load(tmp_path / "absent.json")


def bench_module():
    return load_bench("tables/esa_crossover")


def test_bench_writes_a_table_the_executor_reads(tmp_path, monkeypatch):
    """Bench rows (ms) become rates per (query head, attended key); rows where one side failed are left out; other
    devices' rows are kept; the written table drives the decision."""
    bench = bench_module()
    rows = []
    for length, kernel_ms, flex_ms in ((2048, 1.0, 0.5), (32768, 25.0, 76.0)):
        for executor, ms in (("kernel", kernel_ms), ("flex", flex_ms)):
            rate = ms * 1e-3 / (HEADS * length * 64)
            rows.append({"executor": executor, "pass": "forward_backward", "length": length, "attn_length": 64,
                         "ms": ms, "rate": rate})
    rows.append({"executor": "kernel", "pass": "forward", "length": 2048, "attn_length": 64, "ms": 0.2,
                 "rate": 1e-12})
    rows.append({"executor": "flex", "pass": "forward", "length": 2048, "attn_length": 64, "skipped": "OOM"})
    path = tmp_path / "esa_kernel.json"
    path.write_text(json.dumps({"about": "kept", "devices": {"A100": TABLE["devices"]["H100 PCIe"]}}))
    bench.write_table(path, "H100", bench.table_entries(rows), {"device": "NVIDIA H100 80GB HBM3"})
    loaded = ESA_KERNEL.load(path)
    assert set(loaded) == {"A100", "H100"} and json.loads(path.read_text())["about"] == "kept"
    assert set(loaded["H100"].rows) == {("forward_backward", 2048, 64), ("forward_backward", 32768, 64)}
    assert rates(loaded["H100"], "forward_backward", 2048, 64).kernel == pytest.approx(1e-3 / (HEADS * 2048 * 64),
                                                                                     rel=1e-3)
    monkeypatch.setattr(ESA_KERNEL, "for_device", lambda device: loaded["H100"])
    monkeypatch.setattr(esa_executor, "kernels_preferred_on", lambda device: True)
    assert plan(2048, grad=True) == [("flex", ESA_HEADS), ("sdpa", FULL_HEADS)]
    assert plan(32768, grad=True) == [("esa", ESA_HEADS), ("sdpa", FULL_HEADS)]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without CUDA")
def test_bench_refuses_without_cuda_in_one_line(capsys):
    assert bench_module().main([]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "needs a CUDA device" in err
