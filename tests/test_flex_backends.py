"""Compiled flex's backend as a measured choice: the per-device table bench/tables/flex_backends.py writes (Triton
against FLASH, FlashAttention-4's kernels), its loading and lookups, which launches the flex executor runs on FLASH,
the precedence of a user's kernel_options, their validation, and convert passing them to every layer.

CPU tests fake the device's table (``FLEX_BACKENDS.for_device``), the extra's presence
(:func:`flex.fa4_runs_on`) and the compiled launch (:func:`flex.run_flex`: records the kernel options it is
given, computes with eager flex in float32), so they check the choice and the outputs of the path it takes. The
GPU tests run FLASH for real where the ``fast`` extra is installed: FLASH flex and Triton flex against a float64
dense reference, forward and backward (bf16: |err| <= 3e-2 on outputs, 6e-2 on gradients, relative to the
reference's largest magnitude, as tests/test_gpu.py), and the measured choice end to end.
"""

import json
import warnings

import pytest
import torch
from torch.nn.attention.flex_attention import flex_attention

from flexsparse import HybridAttention
from flexsparse.masks import Causal, Geometry, SinkWindow
from flexsparse.reference import attention as reference
from flexsparse.runtime import buckets, device_tables, flex
from flexsparse.runtime.call import AttentionCall, GroupModes, HeadSelection
from flexsparse.runtime.device_tables import PASSES
from flexsparse.runtime.flex import FLASH_OPTIONS, FlexExecutor, as_kernel_options
from flexsparse.runtime.flex_backend_table import FLEX_BACKENDS, FlexBackendTimes, flash_ratio, flash_time_ratio
from tests.bench_scripts import load_bench

HEADS, KV_HEADS, DIM, BLOCK = 4, 2, 16, 16
NAMES = {0: "NVIDIA H100 80GB HBM3", 1: "NVIDIA A100-SXM4-80GB", 2: "NVIDIA H100 PCIe"}


def row(pattern, pass_name, length, triton_ms, flash_ms):
    return {"pattern": pattern, "pass": pass_name, "length": length, "triton_ms": triton_ms, "flash_ms": flash_ms}


ROWS = [
    # forward: FLASH faster from 64 tokens up (0.8 at 64, 0.5 at 256: 0.65 at 128, halfway in log2 length)
    row("sink_window", "forward", 64, 1.0, 0.8), row("sink_window", "forward", 256, 2.0, 1.0),
    # forward+backward: FLASH slower at 64 (1.5), faster at 256 (0.9); they meet at 64 * 2**(2 * 5/6)
    row("sink_window", "forward_backward", 64, 2.0, 3.0), row("sink_window", "forward_backward", 256, 10.0, 9.0),
]
CROSSING = 64 * 2 ** (2 * 5 / 6)
DEVICE = {"dtype": "bfloat16", "head_dim": DIM, "block_size": BLOCK, "measured": None, "entries": ROWS}
TABLE = {"about": "test", "devices": {
    "H100": DEVICE, "H100 PCIe": {**DEVICE, "head_dim": 128, "entries": ROWS[:1]}}}
SMALL = FLEX_BACKENDS.device_from_json(DEVICE)


@pytest.fixture
def table(tmp_path, monkeypatch):
    """TABLE written to a file, loaded as the process's table; device names faked by index."""
    path = tmp_path / "flex_backends.json"
    path.write_text(json.dumps(TABLE))
    monkeypatch.setattr(FLEX_BACKENDS, "devices", FLEX_BACKENDS.load(path))
    monkeypatch.setattr(device_tables, "cuda_device_name", NAMES.__getitem__)
    return FLEX_BACKENDS.devices


@pytest.fixture
def launches(monkeypatch):
    """Every call looked up in SMALL (whatever its device), FlashAttention-4 present (set ``installed``), compiled
    launches replaced by eager flex in float32 that records the kernel options it is given (``options``)."""
    state = {"options": [], "installed": True}
    monkeypatch.setattr(FLEX_BACKENDS, "for_device", lambda device: SMALL)
    monkeypatch.setattr(flex, "fa4_runs_on", lambda device: state["installed"])

    def fake_run_flex(q, k, v, block_mask, scale, kernel_options=None):
        state["options"].append(kernel_options)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile")
            out = flex_attention(q.float(), k.float(), v.float(), block_mask=block_mask, scale=scale,
                                 enable_gqa=q.shape[1] != k.shape[1])
        return out.to(q.dtype)

    monkeypatch.setattr(flex, "run_flex", fake_run_flex)
    return state


def qkv(q_len=128, kv_len=None, dtype=torch.bfloat16, dim=DIM, batch=1, seed=0):
    gen = torch.Generator().manual_seed(seed)
    make = lambda heads, length: torch.randn(batch, heads, length, dim, generator=gen).to(dtype)
    return make(HEADS, q_len), make(KV_HEADS, kv_len or q_len), make(KV_HEADS, kv_len or q_len)


SSA = SinkWindow(4, 24)


def layer(patterns=None, modes=None, **kwargs):
    patterns = patterns or {"ssa": SSA}
    return HybridAttention(HEADS, KV_HEADS, kwargs.pop("dim", DIM), patterns, modes, backend="flex",
                           block_size=kwargs.pop("block_size", BLOCK), **kwargs)


def dense_reference(attn, q, k, v, modes=None):
    return reference(q, k, v, attn.reference_mask(q, k, modes), scale=q.shape[-1] ** -0.5)


# ----- the table -----------------------------------------------------------------------------------------------------


def test_shipped_table_loads():
    """The shipped table (empty until measured on a device: bench/tables/flex_backends.py --write-table) is what the
    process reads."""
    assert FLEX_BACKENDS.load() == FLEX_BACKENDS.devices
    for found in FLEX_BACKENDS.devices.values():
        assert found.dtype in (torch.bfloat16, torch.float16)
        assert found.settings["head_dim"] >= 1 and found.settings["block_size"] >= 1


def test_lookup_by_device_name(table):
    assert FLEX_BACKENDS.for_device(torch.device("cuda", 0)) is table["H100"]
    assert FLEX_BACKENDS.for_device(torch.device("cuda", 2)) is table["H100 PCIe"]  # the longest matching key
    assert FLEX_BACKENDS.for_device(torch.device("cuda", 1)) is None  # A100: no key
    assert FLEX_BACKENDS.for_device(torch.device("cpu")) is None


def test_ratios_interpolate_in_log_length_from_the_shortest_row_up():
    assert flash_ratio(SMALL, "sink_window", "forward", 64) == pytest.approx(0.8)  # a measured row
    assert flash_ratio(SMALL, "sink_window", "forward", 128) == pytest.approx(0.65)  # halfway in log2
    assert flash_ratio(SMALL, "sink_window", "forward", 1 << 20) == pytest.approx(0.5)  # past: the longest row
    assert flash_ratio(SMALL, "sink_window", "forward", 32) is None  # below the shortest: not measured
    assert flash_ratio(SMALL, "causal", "forward", 128) is None  # a pattern it did not measure
    assert SMALL.rows["sink_window", "forward", 256] == FlexBackendTimes(2.0, 1.0)


def test_flash_time_ratio_needs_the_tables_dtype_head_dim_and_block_size(table):
    cuda = torch.device("cuda", 0)
    assert flash_time_ratio("sink_window", cuda, torch.bfloat16, DIM, BLOCK, 128, False) == pytest.approx(0.65)
    assert flash_time_ratio("sink_window", cuda, torch.bfloat16, DIM, BLOCK, 128, True) == pytest.approx(1.2)
    assert flash_time_ratio("sink_window", cuda, torch.float16, DIM, BLOCK, 128, False) is None
    assert flash_time_ratio("sink_window", cuda, torch.bfloat16, 32, BLOCK, 128, False) is None
    assert flash_time_ratio("sink_window", cuda, torch.bfloat16, DIM, 32, 128, False) is None
    assert flash_time_ratio("sink_window", torch.device("cpu"), torch.bfloat16, DIM, BLOCK, 128, False) is None


def bad(fields):
    data = json.loads(json.dumps(TABLE))
    device = data["devices"]["H100"]
    for key, value in fields.items():
        if key.startswith("row."):
            device["entries"][0][key[4:]] = value
        else:
            device[key] = value
    return data


@pytest.mark.parametrize("data, problem", [
    ([], "expected an object with a 'devices' object"),
    (bad({"dtype": "float32"}), r"devices\['H100'\]: 'dtype' must be bfloat16 or float16"),
    (bad({"dtype": "bfloat17"}), r"'dtype' must name a torch dtype, got 'bfloat17'"),
    (bad({"head_dim": 0}), r"'head_dim' must be a positive integer, got 0"),
    (bad({"block_size": "128"}), r"'block_size' must be a positive integer, got '128'"),
    (bad({"entries": {}}), "expected an object with an 'entries' list"),
    (bad({"row.pattern": ""}), r"entries\[0\]: 'pattern' must be a pattern's name, got ''"),
    (bad({"row.pass": "backward"}), r"entries\[0\]: 'pass' must be one of \('forward', 'forward_backward'\)"),
    (bad({"row.length": 64.0}), r"entries\[0\]: 'length' must be a positive integer, got 64.0"),
    (bad({"row.triton_ms": 0}), r"'triton_ms' must be a positive number of milliseconds, got 0"),
    (bad({"row.flash_ms": float("nan")}), r"'flash_ms' must be a positive number of milliseconds, got nan"),
    (bad({"row.length": 256}), (r"entries\[1\]: a second row for \(pattern, pass, length\) "
                                r"\('sink_window', 'forward', 256\)")),
])
def test_malformed_table_is_a_value_error_naming_the_file_and_the_problem(tmp_path, data, problem):
    path = tmp_path / "broken.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=f"flex backend table {path}.*{problem}"):
        FLEX_BACKENDS.load(path)


# ----- which launches run FLASH ----------------------------------------------------------------------------------------


def test_flash_where_the_table_measured_it_faster(launches):
    """Every head sink+window, a contiguous prefill on the grid, bf16: FLASH (0.65 at 128), and the output is the
    dense reference's."""
    attn = layer()
    q, k, v = qkv(128)
    out = attn(q, k, v)
    assert launches["options"] == [FLASH_OPTIONS]
    torch.testing.assert_close(out.float(), dense_reference(attn, q, k, v).float(), atol=2e-2, rtol=0)


def test_flash_for_the_sparse_heads_of_a_split_plan(launches):
    """Full heads on SDPA, the sink+window heads in one flex launch of their own mask: FLASH."""
    attn = layer({"full": Causal(), "ssa": SSA}, ["full", "ssa"], plan="split")
    q, k, v = qkv(128)
    out = attn(q, k, v)
    assert launches["options"] == [FLASH_OPTIONS]
    torch.testing.assert_close(out.float(), dense_reference(attn, q, k, v).float(), atol=2e-2, rtol=0)


@pytest.mark.parametrize("case", [
    "slower", "below the shortest row", "no row for the pattern", "extra missing", "float16", "float32",
    "head dim", "block size", "off the grid", "decode", "chunk", "mixed fused launch", "per-call mode tensor",
    "bucketed prefill policy", "exact prefill policy off the grid", "inside torch.compile",
])
def test_triton_elsewhere(launches, monkeypatch, case):
    """Each condition of the choice, alone, keeps the launch on torch's default (no kernel options)."""
    kwargs, q_len, kv_len, dtype, modes = {}, 128, None, torch.bfloat16, None
    if case == "slower":
        monkeypatch.setattr(FLEX_BACKENDS, "for_device", lambda device: FLEX_BACKENDS.device_from_json(
            {**DEVICE, "entries": [row("sink_window", "forward", 64, 1.0, 1.1)]}))
    elif case == "below the shortest row":
        q_len = 32
    elif case == "no row for the pattern":
        kwargs["patterns"] = {"full": Causal()}
    elif case == "extra missing":
        launches["installed"] = False
    elif case in ("float16", "float32"):
        dtype = getattr(torch, case)
    elif case == "head dim":
        kwargs["dim"] = 32
    elif case == "block size":
        kwargs["block_size"] = 32
    elif case == "off the grid":
        q_len = 96  # runs at its bucket (128) with position tables
    elif case == "decode":
        q_len, kv_len = 1, 128
    elif case == "chunk":
        q_len, kv_len = 64, 128
    elif case == "mixed fused launch":
        kwargs.update(patterns={"full": Causal(), "ssa": SSA}, modes=["full", "ssa"], plan="fused")
    elif case == "per-call mode tensor":
        kwargs.update(patterns={"full": Causal(), "ssa": SSA})
        modes = torch.tensor([1, 1])
    elif case == "bucketed prefill policy":
        monkeypatch.setattr(buckets, "PREFILL_POLICY", "buckets")
    elif case == "exact prefill policy off the grid":  # runs as it is, at a length FLASH was not measured at
        monkeypatch.setattr(buckets, "PREFILL_POLICY", "exact")
        q_len = 96
    elif case == "inside torch.compile":
        monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    attn = layer(**kwargs)
    q, k, v = qkv(q_len, kv_len, dtype=dtype, dim=kwargs.get("dim", DIM))
    out = attn(q, k, v, modes)
    assert launches["options"] and all(options is None for options in launches["options"])
    torch.testing.assert_close(out.float(), dense_reference(attn, q, k, v, modes).float(), atol=2e-2, rtol=0)


def run_executor(executor, pattern, length, grad):
    """One launch of ``executor`` over every head of a contiguous prefill (gradients flagged, the tensors need
    none: CPU flex has no backward)."""
    q, k, v = qkv(length)
    call = AttentionCall(q, k, v, DIM**-0.5, Geometry(HEADS, length, length, BLOCK), needs_grad=grad,
                         kv_heads=tuple(range(KV_HEADS)))
    modes = GroupModes(torch.zeros(1, HEADS, dtype=torch.long), (0,) * KV_HEADS)
    return executor.run(call, [pattern], modes, HeadSelection.of(tuple(range(KV_HEADS)), call, KV_HEADS))


def test_training_calls_read_the_forward_backward_rows(launches):
    """With gradients: Triton at 128 (FLASH measured 1.2x), FLASH at 256 (0.9x); none under deterministic
    algorithms (FLASH's block-sparse backward has no deterministic form on Hopper)."""
    executor = FlexExecutor([SSA])
    run_executor(executor, SSA, 128, grad=True)
    run_executor(executor, SSA, 256, grad=True)
    run_executor(executor, SSA, 128, grad=False)
    assert launches["options"] == [None, FLASH_OPTIONS, FLASH_OPTIONS]
    launches["options"].clear()
    torch.use_deterministic_algorithms(True)
    try:
        run_executor(executor, SSA, 256, grad=True)
        run_executor(executor, SSA, 256, grad=False)
    finally:
        torch.use_deterministic_algorithms(False)
    assert launches["options"] == [None, FLASH_OPTIONS]


@pytest.mark.parametrize("length", [32, 64, 128, 256, 512, 1024])
def test_forward_backward_switches_once_at_the_interpolated_crossing(launches, length):
    """A training launch is priced (and run) on FLASH exactly where the interpolated forward+backward ratio is
    below 1: lengths past 64 * 2**(5/3) (~203); below the shortest row (64) nothing is measured."""
    q = torch.empty(1, HEADS, length, DIM, dtype=torch.bfloat16, device="meta")
    call = AttentionCall(q, q[:, :KV_HEADS], q[:, :KV_HEADS], 1.0,
                         Geometry(HEADS, length, length, BLOCK, device="meta"), needs_grad=True,
                         kv_heads=tuple(range(KV_HEADS)))
    auto, pinned = FlexExecutor([SSA]), FlexExecutor([SSA], kernel_options={"BACKEND": "TRITON"})
    assert (auto.cost([SSA, SSA], call) < pinned.cost([SSA, SSA], call)) == (length > CROSSING)
    run_executor(auto, SSA, length, grad=True)
    assert launches["options"] == [FLASH_OPTIONS if length > CROSSING else None]


# ----- precedence and cost ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("options", [{"BACKEND": "TRITON"}, {"BACKEND": "FLASH"}, {"BLOCK_M": 32, "BLOCK_N": 32}])
def test_the_users_kernel_options_win(launches, options):
    """Given kernel_options reach every launch as they are, where the table would choose FLASH and where it
    would not (a decode step); an empty dict is no options (the measured choice)."""
    attn = layer(kernel_options=options)
    q, k, v = qkv(128)
    attn(q, k, v)
    attn(q[:, :, -1:], k, v)
    assert launches["options"] == [options, options]
    launches["options"].clear()
    layer(kernel_options={})(q, k, v)
    assert launches["options"] == [FLASH_OPTIONS]


def test_cost_of_a_flash_launch_is_scaled_by_the_measured_ratio(launches):
    """The planner prices a launch FLASH would run at the Triton estimate times FLASH's measured ratio; mixes,
    user options and calls FLASH does not take keep the estimate."""
    q, k, v = qkv(128)
    call = AttentionCall(q, k, v, DIM**-0.5, Geometry(HEADS, 128, 128, BLOCK), needs_grad=False,
                         kv_heads=(0, 1))
    mixed = [SSA, Causal()]
    auto, pinned = FlexExecutor([SSA, Causal()]), FlexExecutor([SSA, Causal()], kernel_options={"BACKEND": "TRITON"})
    assert auto.cost([SSA, SSA], call) == pytest.approx(0.65 * pinned.cost([SSA, SSA], call))
    assert auto.cost(mixed, call) == pytest.approx(pinned.cost(mixed, call))
    assert auto.cost([Causal(), Causal()], call) == pytest.approx(pinned.cost([Causal(), Causal()], call))
    launches["installed"] = False
    assert auto.cost([SSA, SSA], call) == pytest.approx(pinned.cost([SSA, SSA], call))


def test_no_table_no_change(monkeypatch, launches):
    """Without a row for the device (the shipped table is empty) every launch runs torch's default."""
    monkeypatch.setattr(FLEX_BACKENDS, "for_device", lambda device: None)
    attn = layer()
    q, k, v = qkv(128)
    attn(q, k, v)
    assert launches["options"] == [None]


# ----- validation and convert ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("value", [["BACKEND", "FLASH"], "FLASH", {1: "x"}, 3])
def test_bad_kernel_options_are_a_type_error_naming_the_argument(value):
    with pytest.raises(TypeError, match="kernel_options must be a dict of flex_attention kernel options"):
        layer(kernel_options=value)
    with pytest.raises(TypeError, match="kernel_options must be a dict"):
        FlexExecutor([SSA], kernel_options=value)
    assert as_kernel_options("kernel_options", None) is None


def test_kernel_options_with_executors_is_refused():
    with pytest.raises(ValueError, match="give kernel_options or executors, not both"):
        HybridAttention(HEADS, KV_HEADS, DIM, {"ssa": SSA}, executors=[FlexExecutor([SSA])],
                        kernel_options=FLASH_OPTIONS)


def flex_executors(model):
    from flexsparse.integrations.layer import sparse_layers

    return [next(e for e in layer.attention.executors if isinstance(e, FlexExecutor)) for layer in
            sparse_layers(model)]


def test_convert_passes_kernel_options_to_every_layer(launches):
    pytest.importorskip("transformers")
    from flexsparse.integrations import convert, is_converted
    from tests.hf_util import KV_HEADS as MODEL_KV_HEADS
    from tests.hf_util import LAYERS, tiny_model

    modes = [["ssa"] * MODEL_KV_HEADS] * LAYERS
    model = convert(tiny_model("llama"), {"ssa": SSA}, modes, backend="flex", kernel_options={"BACKEND": "TRITON"})
    assert [e.kernel_options for e in flex_executors(model)] == [{"BACKEND": "TRITON"}] * LAYERS
    with torch.no_grad():
        model(torch.randint(1, 50, (1, 32)), use_cache=False)
    assert launches["options"] == [{"BACKEND": "TRITON"}] * LAYERS  # every layer's launch, as given
    convert(model, {"ssa": SSA}, modes, backend="flex")  # reconverting: the default, the measured choice
    assert [e.kernel_options for e in flex_executors(model)] == [{}] * LAYERS
    for value in (["BACKEND"], "FLASH"):
        fresh = tiny_model("llama")
        with pytest.raises(TypeError, match="^kernel_options must be a dict"):
            convert(fresh, {"ssa": SSA}, modes, kernel_options=value)
        assert not is_converted(fresh)


def bench_module():
    return load_bench("tables/flex_backends")


def test_bench_writes_a_table_the_executor_reads(tmp_path, monkeypatch):
    """Bench rows where both backends ran become table rows (ms to 4 digits); rows where one failed are left out;
    other devices' rows are kept; the written table drives the choice."""
    bench = bench_module()
    rows = [{"pattern": "sink_window", "pass": "forward", "length": 8192, "triton_ms": 2.0, "flash_ms": 1.5,
             "flash_over_triton": 0.75},
            {"pattern": "sink_window", "pass": "forward_backward", "length": 8192, "triton_ms": 9.0,
             "flash_skipped": "RuntimeError: refused"},
            {"pattern": "sink_window", "pass": "forward", "length": 32768, "skipped": "past --deadline-s"}]
    path = tmp_path / "flex_backends.json"
    path.write_text(json.dumps({"about": "kept", "devices": {"A100": TABLE["devices"]["H100 PCIe"]}}))
    bench.write_table(path, "H100", bench.table_entries(rows), {"device": "NVIDIA H100 80GB HBM3"})
    loaded = FLEX_BACKENDS.load(path)
    assert set(loaded) == {"A100", "H100"} and json.loads(path.read_text())["about"] == "kept"
    h100 = loaded["H100"]
    assert (h100.dtype, h100.settings) == (torch.bfloat16, {"head_dim": 128, "block_size": 128})
    assert h100.rows == {("sink_window", "forward", 8192): FlexBackendTimes(2.0, 1.5)}
    monkeypatch.setattr(FLEX_BACKENDS, "for_device", lambda device: h100)
    cuda = torch.device("cuda")
    assert flash_time_ratio("sink_window", cuda, torch.bfloat16, 128, 128, 16384, False) == pytest.approx(0.75)
    assert flash_time_ratio("sink_window", cuda, torch.bfloat16, 128, 128, 16384, True) is None


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without CUDA")
def test_bench_refuses_without_cuda_in_one_line(capsys):
    assert bench_module().main([]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "needs a CUDA device" in err


# ----- GPU: FLASH for real ---------------------------------------------------------------------------------------------


def needs_flash():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    from flexsparse.runtime.fa4_executor import fa4_attention

    if fa4_attention() is None:
        pytest.skip("FlashAttention-4 is not installed (the fast extra)")


def gpu_results(attn, q, k, v, grad_out):
    out = attn(q, k, v)
    return (out.detach(), *torch.autograd.grad(out, (q, k, v), grad_out))


def assert_close_to(results, expected, what):
    for name, got, want, tol in zip(("out", "dq", "dk", "dv"), results, expected, (3e-2, 6e-2, 6e-2, 6e-2)):
        error = (got.double() - want.double()).abs().max().item()
        assert error <= tol * max(want.abs().max().item(), 1.0), f"{what}: {name} off by {error}"


def gpu_case(length=1024, heads=8, kv_heads=2):
    gen = torch.Generator(device="cuda").manual_seed(0)
    make = lambda h: torch.randn(1, h, length, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
    q, k, v = make(heads).requires_grad_(), make(kv_heads).requires_grad_(), make(kv_heads).requires_grad_()
    pattern = SinkWindow(128, 256)
    mask = pattern.dense(Geometry(heads, length, length, 128, "cuda"))
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    grad_out = torch.randn_like(q)
    dense = reference(q64, k64, v64, mask, scale=128**-0.5)
    expected = (dense.detach(), *torch.autograd.grad(dense, (q64, k64, v64), grad_out.double()))
    return pattern, (q, k, v, grad_out), expected


@pytest.mark.gpu
def test_gpu_flash_flex_matches_triton_flex_and_the_dense_reference():
    """Sink 128 + window 256 on 8 query / 2 KV heads, 1K tokens, d 128, bf16, block 128: FLASH and Triton flex,
    forward and backward, each within bf16 tolerance of the float64 dense reference and of each other."""
    needs_flash()
    pattern, (q, k, v, grad_out), expected = gpu_case()
    results = {}
    for options in ({"BACKEND": "FLASH"}, {"BACKEND": "TRITON"}):
        attn = HybridAttention(8, 2, 128, {"ssa": pattern}, backend="flex", kernel_options=options).cuda()
        results[options["BACKEND"]] = gpu_results(attn, q, k, v, grad_out)
        assert_close_to(results[options["BACKEND"]], expected, options["BACKEND"])
    assert_close_to(results["FLASH"], results["TRITON"], "FLASH against Triton")


@pytest.mark.gpu
def test_gpu_the_measured_choice_runs_flash_end_to_end(monkeypatch):
    """A table row that has FLASH faster for this device and size: a layer without kernel_options launches FLASH
    (forward and backward) and matches the dense reference; without the row it launches torch's default."""
    needs_flash()
    measured = FLEX_BACKENDS.device_from_json({"dtype": "bfloat16", "head_dim": 128, "block_size": 128, "entries": [
        row("sink_window", p, 1024, 1.0, 0.5) for p in PASSES]})
    monkeypatch.setattr(FLEX_BACKENDS, "for_device", lambda device: measured)
    real_run_flex, seen = flex.run_flex, []

    def spy(q, k, v, block_mask, scale, kernel_options=None):
        seen.append(kernel_options)
        return real_run_flex(q, k, v, block_mask, scale, kernel_options)

    monkeypatch.setattr(flex, "run_flex", spy)
    pattern, (q, k, v, grad_out), expected = gpu_case()
    attn = HybridAttention(8, 2, 128, {"ssa": pattern}, backend="flex").cuda()
    assert_close_to(gpu_results(attn, q, k, v, grad_out), expected, "measured choice")
    assert seen == [FLASH_OPTIONS]
    monkeypatch.setattr(FLEX_BACKENDS, "for_device", lambda device: None)
    gpu_results(HybridAttention(8, 2, 128, {"ssa": pattern}, backend="flex").cuda(), q, k, v, grad_out)
    assert seen == [FLASH_OPTIONS, None]
