"""Traffic of any prompt length, batch size and padding width runs a bounded number of compiled flex variants
(:mod:`flexsparse.runtime.buckets`), and the real rows of a bucketed call equal the exact-length run.

Which calls recompile is decided by dynamo's guards, whatever backend compiles the graphs, so most tests here
compile flexsparse's flex_attention with a backend that runs the graphs eagerly and records each variant's
shapes: inductor's CPU code generation takes 10-30 s per variant on 2 cores, this backend about 1 s (its calls
run flex's math reference). ``test_inductor_runs_batch_parts_and_padded_buckets`` runs the real inductor path.
Tolerances: fp32 outputs and logits within 1e-4 of the dense backend (masked SDPA at the exact length;
observed ~3e-6).
"""

from unittest.mock import patch

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch._dynamo.utils import counters

import flexsparse.runtime.buckets as buckets
import flexsparse.runtime.compiled as compiled
from flexsparse import HybridAttention, Positions
from flexsparse.masks import ESA, Causal, Geometry, SinkWindow, TriangleMix, XAttention
from tests.util import block_mask_grid

pytestmark = pytest.mark.compiled

HEADS, KV_HEADS, DIM, BLOCK = 4, 2, 8, 16
PATTERNS = {
    "full": Causal(),
    "ssa": SinkWindow(sink=3, window=9),
    "esa": ESA(2, 4, 6, HEADS),
    "ta": TriangleMix(sink=2, window=6, last_q=5),
    "xa": XAttention(0.7, stride=4, block_size=16),
}
TOL = 1e-4


class ShapeRecorder:
    """A dynamo backend that runs graphs eagerly and records the (q, k) shapes of each compiled variant."""

    def __init__(self) -> None:
        self.shapes: list[tuple[tuple[int, ...], tuple[int, ...]]] = []

    def __call__(self, graph_module, inputs):
        names = [node.name for node in graph_module.graph.nodes if node.op == "placeholder"]
        shape = dict(zip(names, (tuple(t.shape) if isinstance(t, torch.Tensor) else None for t in inputs)))
        self.shapes.append((shape["l_q_"], shape["l_k_"]))
        return graph_module


RECORDER = ShapeRecorder()


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny matrices: one thread avoids contention with other processes on a 2-core machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module", autouse=True)
def recording_dynamo_backend():
    """flexsparse's compiled flex_attention through dynamo with the recording backend (module docstring)."""
    torch._dynamo.reset()
    recorded = torch.compile(compiled._flexsparse_flex_attention, dynamic=False, backend=RECORDER)
    with patch.object(compiled, "_compiled_flex_attention", recorded):
        yield
    torch._dynamo.reset()


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Every test counts its own variants."""
    torch._dynamo.reset()
    RECORDER.shapes.clear()


def variants() -> int:
    return len(RECORDER.shapes)


def assert_bucket_shapes(block: int) -> None:
    """Every compiled variant has bucket shapes: a power-of-two batch part, keys on the grid, queries as many
    as the keys (prefill) or a power of two."""
    for (batch, _, q_len, _), (_, _, kv_len, _) in RECORDER.shapes:
        assert batch.bit_count() == 1 and buckets.is_kv_bucket(kv_len, block), (batch, q_len, kv_len)
        assert q_len == kv_len or q_len.bit_count() == 1, (batch, q_len, kv_len)


def random_qkv(batch, q_len, kv_len, gen):
    make = lambda heads, length: torch.randn(batch, heads, length, DIM, generator=gen)
    return make(HEADS, q_len), make(KV_HEADS, kv_len), make(KV_HEADS, kv_len)


def assert_real_rows_equal(out, expected, real=None):
    """Rows of real queries (``real`` bool ``[B, Q]``, None: all) equal; rows of padding queries are 0."""
    out, expected = out.transpose(1, 2), expected.transpose(1, 2)
    real = torch.ones(out.shape[:2], dtype=torch.bool) if real is None else real
    torch.testing.assert_close(out[real], expected[real], atol=TOL, rtol=0)
    assert not out[~real].any(), "padding query rows are 0"


def random_padding(batch, width, gen):
    """A left-padding mask ``[batch, width]`` of random lengths."""
    return padding_mask(torch.randint(1, width + 1, (batch,), generator=gen).tolist(), width, left=True)


def padding_mask(lengths, width, left):
    mask = torch.zeros(len(lengths), width, dtype=torch.bool)
    for row, n in enumerate(lengths):
        mask[row, width - n:] = left
        mask[row, :n] |= not left
    return mask


# ----- the rules ------------------------------------------------------------------------------------------

@given(n=st.integers(1, 5000), block=st.sampled_from([16, 32, 64, 128]))
def test_kv_buckets_are_the_grid_of_block_times_powers_of_two(n, block):
    bucket = buckets.kv_bucket(n, block)
    assert bucket >= n and bucket % block == 0 and (bucket // block).bit_count() == 1
    assert bucket < 2 * n or bucket == block  # at most twice the length (one block at least)
    assert buckets.is_kv_bucket(n, block) == (n % block == 0 and (n // block).bit_count() == 1)
    assert buckets.is_kv_bucket(bucket, block)


@given(batch=st.integers(1, 300))
def test_batch_parts_are_distinct_powers_of_two_covering_the_batch(batch):
    parts = buckets.batch_parts(batch)
    assert [start for start, _ in parts] == [sum(size for _, size in parts[:i]) for i in range(len(parts))]
    sizes = [size for _, size in parts]
    assert sum(sizes) == batch and sizes == sorted(set(sizes), reverse=True)
    assert all(size.bit_count() == 1 for size in sizes)


def test_prefill_policies_and_a_bad_policy():
    geo = Geometry(HEADS, 40, 40, BLOCK)
    on_grid = Geometry(HEADS, 64, 64, BLOCK)
    assert buckets.compiled_geometry(on_grid) is on_grid  # "grid": exact on the grid
    bucketed = buckets.compiled_geometry(geo)
    assert (bucketed.q_len, bucketed.kv_len, bucketed.span) == (64, 64, 40) and not bucketed.is_contiguous
    with patch.object(buckets, "PREFILL_POLICY", "buckets"):
        assert not buckets.compiled_geometry(on_grid).is_contiguous
    with patch.object(buckets, "PREFILL_POLICY", "exact"):
        assert buckets.compiled_geometry(geo) is geo
    with patch.object(buckets, "PREFILL_POLICY", "fast"), pytest.raises(ValueError, match="PREFILL_POLICY"):
        buckets.compiled_geometry(geo)


# ----- bucketed masks: real rows as at the exact length -----------------------------------------------------

@given(
    name=st.sampled_from(list(PATTERNS)),
    kv_len=st.integers(1, 150),
    queries=st.sampled_from(["prefill", "chunk", "decode"]),
    padding=st.sampled_from(["none", "left", "right"]),
    batch=st.integers(1, 3),
    data=st.data(),
)
def test_bucketed_masks_equal_the_exact_masks_on_real_rows(name, kv_len, queries, padding, batch, data):
    """What the kernel computes at the bucketed geometry (full tiles, partial tiles through mask_mod), cut to
    the real rows and slots, is the pattern's dense mask at the exact geometry; padding rows and slots attend
    and are attended by nothing."""
    q_len = {"prefill": kv_len, "decode": 1, "chunk": data.draw(st.integers(1, kv_len))}[queries]
    if padding == "none":
        positions = None if q_len == kv_len else Positions.contiguous(q_len, kv_len)
    else:
        lengths = data.draw(st.lists(st.integers(1, kv_len), min_size=batch, max_size=batch))
        positions = Positions.from_padding_mask(padding_mask(lengths, kv_len, padding == "left"), q_len)
    geo = Geometry(HEADS, q_len, kv_len, BLOCK, positions=positions)
    pattern = PATTERNS[name]
    if pattern.is_dynamic:
        q, k, _ = random_qkv(geo.batch, q_len, kv_len, torch.Generator().manual_seed(kv_len))
        pattern = pattern.resolve(q, k, geo)
    with patch.object(buckets, "PREFILL_POLICY", "buckets"):  # contiguous prefill: tables, on the grid too
        run_geo = buckets.compiled_geometry(geo)
    assert not run_geo.is_contiguous and buckets.is_kv_bucket(run_geo.kv_len, BLOCK)
    assert run_geo.span == geo.span
    computed = block_mask_grid(pattern, run_geo, geo.batch)
    exact = pattern.dense(geo).expand(geo.batch, HEADS, q_len, kv_len)
    assert torch.equal(computed[:, :, :q_len, :kv_len], exact)
    assert not computed[:, :, :, kv_len:].any() and not computed[:, :, q_len:].any()


# ----- outputs --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", list(PATTERNS))
@settings(max_examples=8)
@given(seq=st.integers(1, 32), data=st.data())
def test_bucketed_outputs_equal_the_exact_length_run(name, seq, data):
    """Compiled flex at the bucket against the dense backend at the exact length, for every pattern kind: a
    prefill of ``seq`` tokens, or, for a second draw, a left-padded batch of three (two parts: 2 + 1)."""
    gen = torch.Generator().manual_seed(seq)
    modes = [name, "ssa" if name != "ssa" else "full"]
    flex = HybridAttention(HEADS, KV_HEADS, DIM, PATTERNS, modes, block_size=BLOCK, backend="flex")
    dense = HybridAttention(HEADS, KV_HEADS, DIM, PATTERNS, modes, block_size=BLOCK, backend="dense")
    mask = None
    if data.draw(st.booleans()):
        lengths = [seq, data.draw(st.integers(1, seq)), data.draw(st.integers(1, seq))]
        mask = padding_mask(lengths, seq, left=True)
    q, k, v = random_qkv(1 if mask is None else 3, seq, seq, gen)
    with patch.object(buckets, "PREFILL_POLICY", "buckets"):  # two variants per pattern kind: buckets 16, 32
        out = flex(q, k, v, key_padding_mask=mask)
    expected = dense(q, k, v, key_padding_mask=mask)
    assert_real_rows_equal(out, expected, mask)


def test_hybrid_attention_serves_any_length_and_batch_with_bounded_variants():
    """24 calls of random lengths (1..128 keys) and batch sizes (1..7): prefill unpadded or left-padded,
    decode steps, chunks. Every output equals the dense backend's; every variant has bucket shapes, at most
    three layouts (positions as arithmetic, shared tables, per-batch tables) per bucket shape reached."""
    gen = torch.Generator().manual_seed(0)
    modes = ["ta", "ssa"]
    flex = HybridAttention(HEADS, KV_HEADS, DIM, PATTERNS, modes, block_size=BLOCK, backend="flex")
    dense = HybridAttention(HEADS, KV_HEADS, DIM, PATTERNS, modes, block_size=BLOCK, backend="dense")
    draw = lambda low, high: int(torch.randint(low, high + 1, (1,), generator=gen))
    reachable = set()
    for call in range(24):
        batch, kv_len = draw(1, 7), draw(1, 128)
        q_len = [kv_len, kv_len, 1, draw(1, kv_len)][call % 4]
        mask = random_padding(batch, kv_len, gen) if call % 4 == 1 else None
        q, k, v = random_qkv(batch, q_len, kv_len, gen)
        out = flex(q, k, v, key_padding_mask=mask)
        expected = dense(q, k, v, key_padding_mask=mask)
        assert_real_rows_equal(out, expected, mask)
        lengths = buckets.compiled_lengths(q_len, kv_len, BLOCK)
        reachable |= {(size,) + lengths for _, size in buckets.batch_parts(batch)}
    assert_bucket_shapes(BLOCK)
    assert variants() <= 3 * len(reachable), RECORDER.shapes


def test_inductor_runs_batch_parts_and_padded_buckets():
    """The real inductor path: a left-padded batch of 3 runs in two parts (2 + 1, each with its rows of the
    position tables); a second batch of other lengths in the same bucket compiles nothing new."""
    modes = ["ta", "ssa"]
    flex = HybridAttention(HEADS, KV_HEADS, DIM, PATTERNS, modes, block_size=BLOCK, backend="flex")
    dense = HybridAttention(HEADS, KV_HEADS, DIM, PATTERNS, modes, block_size=BLOCK, backend="dense")
    gen = torch.Generator().manual_seed(5)
    with patch.object(compiled, "_compiled_flex_attention", None):  # inductor's, not the recorder
        for call, (width, lengths) in enumerate([(40, [40, 17, 33]), (57, [3, 57, 41])]):
            q, k, v = random_qkv(3, width, width, gen)
            mask = padding_mask(lengths, width, left=True)
            with torch.compiler.set_stance("fail_on_recompile" if call else "default"):
                out = flex(q, k, v, key_padding_mask=mask)
            assert_real_rows_equal(out, dense(q, k, v, key_padding_mask=mask), mask)


# ----- a converted model ------------------------------------------------------------------------------------

def test_converted_llama_serves_any_prompt_length_batch_and_padding():
    """100 unpadded prompt lengths, 40 generate() calls of other lengths, 25 padded widths and batch sizes 3
    to 8 (forward and generate): no RecompileLimitError, at most 24 compiled variants (20 observed), logits as
    the dense backend's."""
    pytest.importorskip("transformers")
    from flexsparse.integrations import convert
    from tests.hf_util import tiny_model

    patterns = {"ta": TriangleMix(sink=2, window=6, last_q=5), "ssa": SinkWindow(2, 6)}
    modes = [["ta", "ssa"]]
    model = tiny_model("llama", num_hidden_layers=1)
    reference = tiny_model("llama", num_hidden_layers=1)
    convert(model, patterns, modes, block_size=BLOCK)
    convert(reference, patterns, modes, block_size=BLOCK, backend="dense")
    gen = torch.Generator().manual_seed(0)
    worst = 0.0

    def compare(ids, mask=None):
        nonlocal worst
        with torch.no_grad():
            got, expected = model(ids, attention_mask=mask).logits, reference(ids, attention_mask=mask).logits
        real = torch.ones(ids.shape, dtype=torch.bool) if mask is None else mask.bool()
        worst = max(worst, (got - expected)[real].abs().max().item())

    def generate(ids, mask):
        kwargs = dict(attention_mask=mask, max_new_tokens=2, min_new_tokens=2, do_sample=False,
                      output_logits=True, return_dict_in_generate=True)
        with torch.no_grad():
            got, expected = model.generate(ids, **kwargs), reference.generate(ids, **kwargs)
        assert torch.equal(got.sequences, expected.sequences)
        for a, b in zip(got.logits, expected.logits):
            torch.testing.assert_close(a, b, atol=TOL, rtol=0)

    for seq in torch.randperm(100, generator=gen).tolist():
        compare(torch.randint(1, 96, (1, seq + 1), generator=gen))
    for seq in range(101, 141):
        ids = torch.randint(1, 96, (1, seq), generator=gen)
        generate(ids, torch.ones_like(ids))
    for width in range(30, 55):
        ids = torch.randint(1, 96, (2, width), generator=gen)
        mask = padding_mask([width, width // 2 + 1], width, left=True).long()
        compare(ids * mask, mask)
    for batch in range(3, 9):
        width = 40 + 3 * batch
        ids = torch.randint(1, 96, (batch, width), generator=gen)
        mask = random_padding(batch, width, gen).long()
        compare(ids * mask, mask)
        generate(ids * mask, mask)
    assert worst <= TOL
    assert_bucket_shapes(BLOCK)
    assert variants() <= 24, RECORDER.shapes


# ----- GPU training -----------------------------------------------------------------------------------------

@pytest.mark.gpu
def test_gpu_training_over_varied_lengths_and_batches_compiles_a_bounded_set():
    """Forward and backward through compiled flex (inductor) on CUDA over 6 lengths and batch sizes 1 to 3:
    outputs and gradients as the float64 reference (bf16 tolerances of tests/test_gpu.py), variants at most
    the key buckets x 2 batch part sizes x 2 layouts (arithmetic on the grid, tables)."""
    from flexsparse.reference import attention as reference

    heads, kv_heads, dim = 8, 4, 64
    patterns = {"full": Causal(), "ssa": SinkWindow(64, 256), "ta": TriangleMix(64, 256, last_q=128),
                "esa": ESA(3, 8, 64, heads)}
    lengths = [100, 129, 200, 256, 300, 500]
    with patch.object(compiled, "_compiled_flex_attention", None):  # inductor's, not the recorder
        attn = HybridAttention(heads, kv_heads, dim, patterns, list(patterns), backend="flex", plan="fused")
        gen = torch.Generator(device="cuda").manual_seed(0)
        before = counters["stats"]["unique_graphs"]
        for index, seq in enumerate(lengths):
            batch = 1 + index % 3
            q, k, v = (torch.randn(batch, h, seq, dim, device="cuda", dtype=torch.bfloat16, generator=gen)
                       .requires_grad_() for h in (heads, kv_heads, kv_heads))
            out = attn(q, k, v)
            grad = torch.randn_like(out)
            out.backward(grad)
            q2, k2, v2 = (t.detach().double().requires_grad_() for t in (q, k, v))
            expected = reference(q2, k2, v2, attn.reference_mask(q.detach(), k.detach()))
            expected.backward(grad.double())
            for what, a, b, tol in (("out", out, expected, 3e-2), ("dq", q.grad, q2.grad, 6e-2),
                                    ("dk", k.grad, k2.grad, 6e-2), ("dv", v.grad, v2.grad, 6e-2)):
                error, scale = (a.double() - b).abs().max().item(), b.abs().max().item()
                assert error <= tol * max(scale, 1.0), f"{what} at {seq} tokens, batch {batch}: {error:.3g}"
        key_buckets = len({buckets.kv_bucket(n, 128) for n in lengths})
        assert counters["stats"]["unique_graphs"] - before <= key_buckets * 2 * 2
