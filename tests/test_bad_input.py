"""Bad input answered clearly (issue 21): float64 on the CPU, per-call mode lists, batch 0, NaN/inf and empty pooling
masks in routers, padding-only rows in last_stats, what NaN inputs give per backend, corrupted saved configs."""

import json
import math

import pytest
import torch

from flexsparse import HybridAttention
from flexsparse.masks import Causal, SinkWindow
from flexsparse.reference import attention as reference
from flexsparse.routers import HeadRouter, LayerRouter, boundary_pool
from tests.test_hybrid_attention import qkv

pytestmark = pytest.mark.filterwarnings("ignore:.*flex_attention called without torch.compile.*")

PATTERNS = {"full": Causal(), "ssa": SinkWindow(sink=2, window=8)}


def layer(backend="flex_eager", **kwargs):
    return HybridAttention(4, 2, 16, PATTERNS, ["full", "ssa"], block_size=16, backend=backend, **kwargs)


# ----- float64 on the CPU ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("backend,grad", [("auto", False), ("auto", True), ("dense", False), ("dense", True),
                                          ("flex_eager", False)])  # flex_eager has no CPU backward
def test_float64_runs_on_the_cpu(backend, grad):
    """auto runs dense for float64 on the CPU (compiled flex cannot); the uncompiled backends take it as it is."""
    attn = layer(backend)
    q, k, v = (t.double().detach().requires_grad_(grad) for t in qkv(2, 4, 2, 40))
    out = attn(q, k, v)
    assert out.dtype == torch.float64
    torch.testing.assert_close(out, reference(q, k, v, attn.reference_mask(q, k)), atol=1e-12, rtol=0)
    if grad:
        out.sum().backward()
        assert q.grad.dtype == torch.float64 and torch.isfinite(q.grad).all()


def test_compiled_flex_refuses_float64_on_the_cpu_naming_the_dtype():
    q, k, v = (t.double() for t in qkv(1, 4, 2, 40))
    with pytest.raises(TypeError, match=r"backend='flex'.*float32, float16 or bfloat16 on CPU.*torch.float64"):
        layer("flex")(q, k, v)


def test_auto_names_why_it_ran_dense_when_too_long():
    attn = layer("auto", max_dense_len=32)
    q, k, v = (t.double() for t in qkv(1, 4, 2, 40))
    with pytest.raises(ValueError, match=r"max_dense_len=32.*backend='auto' runs dense on CPU for torch.float64"):
        attn(q, k, v)


# ----- per-call modes as a list ----------------------------------------------------------------------------------

def test_per_call_modes_take_a_list_or_tuple_of_names_or_indices():
    attn = HybridAttention(8, 4, 16, PATTERNS, ["ssa"] * 4, block_size=16, backend="flex_eager", plan="split")
    q, k, v = qkv(2, 8, 4, 40)
    as_tensor = attn(q, k, v, modes=torch.tensor([0, 1, 1, 0]))  # fused (a tensor is not read on the host)
    default = HybridAttention(8, 4, 16, PATTERNS, [0, 1, 1, 0], block_size=16, backend="flex_eager", plan="split")
    expected = default(q, k, v)  # split: full heads through SDPA
    torch.testing.assert_close(expected, as_tensor, atol=1e-5, rtol=0)
    for modes in ([0, 1, 1, 0], (0, 1, 1, 0), ["full", "ssa", "ssa", "full"], ["full", 1, "ssa", 0]):
        torch.testing.assert_close(attn(q, k, v, modes=modes), expected, atol=0, rtol=0)
    torch.testing.assert_close(attn.reference_mask(q, k, [0, 1, 1, 0]),
                               attn.reference_mask(q, k, torch.tensor([0, 1, 1, 0])))
    from flexsparse.runtime.call import AttentionCall

    _, host = attn._q_modes(q, ["full"] * 4)  # known on the host: planned like default modes
    assert host == (0, 0, 0, 0)
    call = AttentionCall(q, k, v, 0.25, attn._geometry(q, k, None, None), needs_grad=False, kv_heads=(0, 1, 2, 3))
    assert [g.executor.name for g in attn._planners["flex_eager"].groups(call, host)] == ["sdpa"]


@pytest.mark.parametrize("modes,error,match", [
    ([0, 1, 1], ValueError, r"one entry per KV head \(4\), got 3"),
    (["full", "nope", "ssa", "ssa"], ValueError, "unknown pattern 'nope'"),
    ([0, 1, 2, 0], ValueError, "KV head 2 must be a pattern name or an index < 2, got 2"),
    ([0, 1.0, 1, 0], ValueError, "got 1.0"),
    ({0: 1}, TypeError, "sequence of pattern names/indices or a tensor"),
])
def test_bad_per_call_mode_lists(modes, error, match):
    attn = HybridAttention(8, 4, 16, PATTERNS, block_size=16, backend="flex_eager")
    q, k, v = qkv(1, 8, 4, 40)
    with pytest.raises(error, match=match):
        attn(q, k, v, modes=modes)


# ----- batch 0 ---------------------------------------------------------------------------------------------------

def test_batch_zero_is_refused():
    q, k, v = qkv(1, 4, 2, 40)
    with pytest.raises(ValueError, match="batch 0"):
        layer()(q[:0], k[:0], v[:0])
    for router, heads in ((HeadRouter(16, 4), 2), (LayerRouter(16, 4), 4)):
        with pytest.raises(ValueError, match=rf"B >= 1 .*\(0, 10, {heads}, 16\)"):
            router.route(torch.randn(0, 10, heads, 16))
    with pytest.raises(ValueError, match="states have batch 0"):
        boundary_pool(torch.randn(0, 10, 2, 16))


# ----- routers: NaN/inf states, nothing to pool ------------------------------------------------------------------

@pytest.mark.parametrize("cls,heads", [(HeadRouter, 2), (LayerRouter, 4)])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
@pytest.mark.parametrize("training", [False, True])
def test_routers_refuse_nan_and_inf_states_they_pool(cls, heads, bad, training):
    """On a CPU always (no device sync to pay); a bad token the router does not pool changes nothing."""
    router = cls(16, pool_size=3).train(training)
    states = torch.randn(3, 20, heads, 16)
    clean = router.eval().route(states)
    router.train(training)
    unread = states.clone()
    unread[1, 10] = bad  # tokens 3..16 are not pooled (P = 3 at each end of 20)
    assert torch.equal(router.eval().route(unread).logits, clean.logits)
    router.train(training)
    pooled = states.clone()
    pooled[2, 18, 0, 5] = bad
    with pytest.raises(ValueError, match=r"states the router pools hold NaN or inf \(sequences \[2\]\)"):
        router.route(pooled)
    mask = torch.ones(3, 20, dtype=torch.bool)
    mask[2, 17:] = False  # token 18 is padding now: not pooled
    router.route(pooled, mask)


@pytest.mark.usefixtures("triton_interpreter_scalars")  # the CPU run: conftest.py
@pytest.mark.parametrize("cls,heads", [(HeadRouter, 2), (LayerRouter, 4)])
def test_the_fused_kernel_path_refuses_them_too(cls, heads):
    """The fused kernel (interpreted on a CPU, so checked; on CUDA with check_finite) reads the same tokens."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    router = cls(16, pool_size=3, check_finite=True).to(device).eval()
    states = torch.randn(2, 20, heads, 16, device=device)
    states[0, 1] = float("nan")
    with torch.no_grad(), pytest.raises(ValueError, match=r"hold NaN or inf \(sequences \[0\]\)"):
        router.route(states, fused=True)


def test_router_weights_with_nan_are_named():
    router = HeadRouter(16, pool_size=3).eval()
    with torch.no_grad():
        router.router_mlp[-1].bias[0] = float("nan")
    with pytest.raises(ValueError, match="pooled states are finite.*weights hold NaN/inf"):
        router.route(torch.randn(2, 20, 2, 16))


def test_check_finite_is_a_bool_and_not_part_of_the_config():
    with pytest.raises(TypeError, match="check_finite must be a bool"):
        HeadRouter(16, check_finite=1)
    router = LayerRouter(16, check_finite=True)
    assert router.check_finite and "check_finite" not in router.config()


@pytest.mark.gpu
def test_check_finite_refuses_nan_states_on_cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    states = torch.randn(2, 50, 2, 16, device="cuda")
    states[1, 0] = float("nan")
    for fused in (False, True):
        with torch.no_grad():
            HeadRouter(16, 4).cuda().eval().route(states, fused=fused)  # no sync on the hot path: not checked
            with pytest.raises(ValueError, match=r"NaN or inf \(sequences \[1\]\)"):
                HeadRouter(16, 4, check_finite=True).cuda().eval().route(states, fused=fused)


def test_routers_refuse_a_mask_with_nothing_to_pool():
    router = HeadRouter(16, pool_size=3)
    states = torch.randn(2, 10, 2, 16)
    with pytest.raises(ValueError, match=r"no token to pool in rows \[0, 1\]"):
        router.route(states, torch.zeros(2, 10, dtype=torch.bool))
    mask = torch.ones(2, 10, dtype=torch.bool)
    mask[1] = False
    with pytest.raises(ValueError, match=r"no token to pool in rows \[1\]"):
        LayerRouter(16, pool_size=3).route(torch.randn(2, 10, 4, 16), mask)


# ----- last_stats and padding-only rows --------------------------------------------------------------------------

@pytest.mark.parametrize("backend", ["dense", "flex_eager"])
def test_last_stats_count_a_padding_only_row_as_nothing(backend):
    attn = layer(backend)
    q, k, v = qkv(3, 4, 2, 48)
    mask = torch.ones(3, 48, dtype=torch.bool)
    mask[0, :20] = False  # left-padded
    mask[1] = False  # padding only
    attn(q, k, v, key_padding_mask=mask)
    padded = attn.last_stats.as_dict()
    rows = [0, 2]
    attn(q[rows], k[rows], v[rows], key_padding_mask=mask[rows])
    assert padded == pytest.approx(attn.last_stats.as_dict(), abs=1e-6)
    attn(q[1:2], k[1:2], v[1:2], key_padding_mask=mask[1:2])  # nothing real at all: no ratio
    stats = attn.last_stats.as_dict()
    assert all(math.isnan(value) for value in stats.values()), stats


def test_last_stats_of_a_decode_step_whose_new_token_is_padding():
    """Decode of two sequences, the second one's new token is padding: the stats are the first one's."""
    attn = layer("dense")
    q, k, v = qkv(2, 4, 2, 40)
    mask = torch.ones(2, 40, dtype=torch.bool)
    mask[1, -1] = False
    attn(q[:, :, -1:], k, v, key_padding_mask=mask)
    both = attn.last_stats.as_dict()
    attn(q[:1, :, -1:], k[:1], v[:1], key_padding_mask=mask[:1])
    assert both == pytest.approx(attn.last_stats.as_dict(), abs=1e-6)


# ----- what a NaN gives without check_finite (docs/guide/hybrid-attention.md, "NaN and inf") ----------------

def nan_rows(backend, where):
    """Rows ``[head, query]`` that come out NaN when token 30 of k, v or q holds NaN; and the pattern's mask."""
    attn = HybridAttention(2, 2, 16, PATTERNS, ["full", "ssa"], block_size=16, backend=backend)
    inputs = dict(zip("qkv", qkv(1, 2, 2, 64)))
    inputs[where][0, :, 30] = float("nan")
    out = attn(inputs["q"], inputs["k"], inputs["v"])
    return out[0].isnan().any(-1), attn.reference_mask(inputs["q"], inputs["k"])[0]


def test_nan_key_on_dense_spoils_every_row_of_its_heads():
    rows, _ = nan_rows("dense", "k")
    assert rows.all()


def test_nan_key_on_flex_eager_spoils_exactly_the_rows_that_attend_it():
    rows, mask = nan_rows("flex_eager", "k")
    assert torch.equal(rows, mask[:, :, 30])
    assert rows[0, 30:].all() and rows[1, 30:38].all() and not rows[1, 38:].any()  # full head; window 8


@pytest.mark.parametrize("backend", ["dense", "flex_eager"])
def test_nan_value_spoils_every_row_and_nan_query_its_own_row(backend):
    rows, _ = nan_rows(backend, "v")
    assert rows.all()
    rows, _ = nan_rows(backend, "q")
    expected = torch.zeros_like(rows)
    expected[:, 30] = True
    assert torch.equal(rows, expected)


# ----- load_config on corrupted files ----------------------------------------------------------------------------

def test_load_config_names_the_file_and_what_is_wrong(tmp_path):
    pytest.importorskip("transformers")
    from flexsparse import convert, load_config, save_config
    from tests.hf_util import tiny_model

    save_config(convert(tiny_model(), PATTERNS, [["full", "ssa"]] * 3, backend="dense"), tmp_path)
    path = tmp_path / "flexsparse.json"
    good = json.loads(path.read_text())
    cases = [
        ("{not json", "is not valid JSON"),
        ("[1, 2]", "must hold a JSON object, got a list"),
        (json.dumps({k: v for k, v in good.items() if k != "model"}), "has no 'model' entry"),
        (json.dumps({**good, "model": [3]}), "'model' must be a JSON object, got list"),
        (json.dumps({**good, "model": {"num_layers": 3}}), "'model' must give num_layers and num_heads"),
        (json.dumps({**good, "layers": good["layers"][:2]}), "'layers' has 2 entries, 'model' says num_layers=3"),
        (json.dumps({**good, "layers": [1, 2, 3]}), r"layers\[0\] must be an object with a 'modes' list"),
        (json.dumps({**good, "patterns": {"full": {"type": "nope"}}}), "unknown pattern type 'nope'"),
        (json.dumps({**good, "options": {"colour": 1}}), r"'options' has unknown keys \['colour'\]"),
        (json.dumps({**good, "layers": [{"modes": ["full", "xx"]}] * 3}), "unknown pattern 'xx'"),
    ]
    for text, message in cases:
        path.write_text(text)
        with pytest.raises(ValueError, match=message) as info:
            load_config(tiny_model(), tmp_path)
        assert str(path) in str(info.value)
    path.write_bytes(b"\xff\xfe\x00")
    with pytest.raises(ValueError, match="is not valid JSON"):
        load_config(tiny_model(), path)
