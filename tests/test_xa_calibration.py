"""XAttention calibrated to keep a target share of the true attention mass (eval.xa_calibration).

Checks: the blockwise true mass and the kept share equal a brute-force dense softmax (GQA, odd lengths,
chunked queries, bottom-right queries); captured q/k give the model's own eager attention weights; the
thresholds found by bisection are the lowest that cover the target; on the real default model the calibrated
per-head thresholds keep the target on the quantile of every (layer, head)'s rows (re-measured through
XAttention.select) where the uncalibrated threshold does not; the calibrated eval method runs and measures a
density below 1.
"""

import pytest
import torch

from tests.hf_util import VOCAB, one_thread, tiny_model  # noqa: F401  (autouse fixture)
from tests.real_model import real_corpus, real_model, requires_model


def _brute_kept(q, k, table, block, scale):
    """Dense float64 softmax over the keys at positions <= q_start + i, summed over the kept (query, key)
    pairs of the table expanded to tokens."""
    q_len, kv_len, group = q.shape[2], k.shape[2], q.shape[1] // k.shape[1]
    scores = q.double() @ k.double().repeat_interleave(group, 1).transpose(-1, -2) * scale
    causal = torch.arange(kv_len)[None, :] <= (kv_len - q_len + torch.arange(q_len))[:, None]
    probs = torch.softmax(scores.masked_fill(~causal, float("-inf")), -1)
    kept = table.repeat_interleave(block, 2).repeat_interleave(block, 3)[:, :, :q_len, :kv_len]
    return (probs * kept).sum(-1)


@pytest.mark.parametrize("q_len,kv_len,chunk_bytes", [(50, 50, 1 << 30), (37, 70, 1 << 30), (50, 50, 4096)])
def test_kept_mass_equals_a_brute_force_dense_softmax(q_len, kv_len, chunk_bytes, monkeypatch):
    from flexsparse.eval import xa_calibration
    from flexsparse.eval.xa_calibration import kept_mass, true_block_mass

    monkeypatch.setattr(xa_calibration, "_CHUNK_BYTES", chunk_bytes)  # 4096: a few queries per chunk
    gen = torch.Generator().manual_seed(q_len + kv_len)
    q = torch.randn(2, 4, q_len, 8, generator=gen) * 2
    k = torch.randn(2, 2, kv_len, 8, generator=gen)
    block = 16
    table = torch.rand(2, 4, -(-q_len // block), -(-kv_len // block), generator=gen) < 0.5
    got = kept_mass(q, k, table, block, scale=0.4)
    torch.testing.assert_close(got.double(), _brute_kept(q, k, table, block, 0.4), atol=1e-5, rtol=0)
    mass = true_block_mass(q, k, block, scale=0.4)
    torch.testing.assert_close(mass.sum(-1), torch.ones(2, 4, q_len), atol=1e-5, rtol=0)  # each row sums to 1
    everything = torch.ones(1, 1, *table.shape[2:], dtype=torch.bool)
    every_block = kept_mass(q, k, everything, block, 0.4)
    torch.testing.assert_close(every_block, torch.ones(2, 4, q_len), atol=1e-5, rtol=0)


def test_kept_fraction_rejects_a_table_of_the_wrong_shape():
    from flexsparse.eval.xa_calibration import kept_fraction

    with pytest.raises(ValueError, match="table must be bool"):
        kept_fraction(torch.rand(1, 2, 40, 3), torch.ones(1, 2, 2, 3, dtype=torch.bool), 16)


def test_captured_qk_give_the_models_eager_attention_weights():
    from flexsparse.eval.xa_calibration import capture_qk, true_block_mass

    model = tiny_model("llama")
    ids = torch.randint(1, VOCAB, (2, 40), generator=torch.Generator().manual_seed(0))
    probs = {}
    def record(layer, q, k, scaling):  # block_size 1: the attention weights themselves
        probs[layer] = true_block_mass(q, k, 1, scaling)
    with torch.no_grad():
        with capture_qk(model, record):
            captured_logits = model(ids).logits
        model.set_attn_implementation("eager")
        try:
            out = model(ids, output_attentions=True)
        finally:
            model.set_attn_implementation("sdpa")
    assert model.config._attn_implementation == "sdpa"
    assert not any(hasattr(m, "flexsparse_qk_capture") for m in model.modules())
    torch.testing.assert_close(captured_logits, out.logits, atol=1e-5, rtol=1e-5)  # outputs unchanged
    for layer, weights in enumerate(out.attentions):
        torch.testing.assert_close(probs[layer], weights, atol=1e-5, rtol=1e-5)


def test_bisection_finds_the_lowest_threshold_that_covers_the_target():
    from flexsparse.eval.xa_calibration import calibrate_thresholds, covered_share, true_block_mass
    from flexsparse.kernels.xa_estimate import antidiagonal_block_mass
    from flexsparse.masks.xa_selection import select_blocks

    gen = torch.Generator().manual_seed(3)
    q = torch.randn(2, 4, 256, 16, generator=gen) * 1.5
    k = torch.randn(2, 2, 256, 16, generator=gen) * 1.5
    block, target, quantile, steps = 32, 0.9, 0.9, 12
    true = true_block_mass(q, k, block)
    estimate = antidiagonal_block_mass(q, k, 8, block)
    found = calibrate_thresholds(true, estimate, block, target, quantile, max_threshold=0.999, steps=steps)
    def covered(threshold):
        table = select_blocks(estimate, threshold, q_len=256, kv_len=256, block_size=block)
        return covered_share(true, table, block, target)
    assert found.shape == (4,) and bool(((found > 0) & (found <= 1)).all())
    assert bool((covered(found) >= quantile).all())
    step = 0.999 / 2**steps
    lower = (found - step).clamp(min=0)
    inner = (found < 0.999) & (found > step)  # lower by one step must fail
    assert bool((covered(lower)[inner] < quantile).all())
    assert inner.any()


def _tiny_corpus(tokens: int):
    from flexsparse.eval.text import Corpus

    ids = torch.randint(1, VOCAB, (tokens,), generator=torch.Generator().manual_seed(5))
    return Corpus(ids, ids.flip(0), ())


def test_calibration_on_a_tiny_model_covers_every_head_and_leaves_it_unconverted():
    from flexsparse.eval.xa_calibration import calibrate_xa
    from flexsparse.integrations import is_converted

    model = tiny_model("llama")
    cal = calibrate_xa(model, None, 0.95, 0.9, corpus=_tiny_corpus(600), length=128, samples=3,
                       strides=(8, 4), block_size=16)
    assert cal.thresholds.shape == (3, 4) and cal.windows == 3 and set(cal.strides) <= {8, 4}
    assert all(s.worst_head >= 0.9 and s.low >= 0.95 - 1e-6 for s in cal.after)  # rank 0.1 of the rows
    assert not is_converted(model) and model.config._attn_implementation == "sdpa"
    cal.convert(model, backend="dense")
    assert is_converted(model)


@pytest.mark.parametrize("kwargs,message", [
    ({"target": 0.0}, "target"), ({"quantile": 1.5}, "quantile"), ({"strides": 16}, "strides"),
    ({"strides": (16, 12)}, "strides"), ({"block_size": 8}, "block_size")])
def test_calibration_settings_are_checked(kwargs, message):
    from flexsparse.eval.xa_calibration import check_calibration

    settings = {"target": 0.9, "quantile": 0.95, "strides": (16, 8), "block_size": 128} | kwargs
    with pytest.raises((ValueError, TypeError), match=message):
        check_calibration(**settings)


@requires_model
def test_calibrated_xa_keeps_the_target_on_the_real_model_where_threshold_alone_does_not():
    from flexsparse.eval.xa_calibration import calibrate_xa, capture_qk, kept_mass

    loaded = real_model()
    target, quantile, block, length = 0.9, 0.95, 64, 512
    cal = calibrate_xa(loaded.model, loaded.tokenizer, target, quantile, corpus=real_corpus(), length=length,
                       samples=1, strides=(16, 8), block_size=block)
    assert cal.thresholds.shape == (30, 9)
    assert bool(((cal.thresholds > 0) & (cal.thresholds <= 1)).all())
    assert len({tuple(t.tolist()) for t in cal.thresholds}) > 1 and bool((cal.thresholds.std(-1) > 0).any())
    assert min(s.worst_head for s in cal.before) < quantile  # uncalibrated, some head misses the target
    assert all(s.worst_head >= quantile for s in cal.after)
    # re-measured through the patterns themselves (XAttention.select on the captured q/k)
    patterns = cal.patterns()
    covered = {}

    def record(layer, q, k, scaling):
        kept = kept_mass(q, k, patterns[layer].select(q, k), block, scaling)
        covered[layer] = (kept >= target).float().mean((0, 2))

    window = real_corpus().windows(length, 1, split="calibration")
    with torch.no_grad(), capture_qk(loaded.model, record):
        loaded.model(input_ids=window, use_cache=False)
    assert min(float(c.min()) for c in covered.values()) >= quantile


@requires_model
def test_calibrated_xa_method_runs_in_the_evaluation():
    from flexsparse.eval.methods import CalibratedXAMethod, parse_method
    from flexsparse.eval.runner import evaluate

    method = parse_method("xa:calibrated=1,stride=16,block_size=64")
    assert isinstance(method, CalibratedXAMethod) and method.strides == (16, 8, 4)
    records = evaluate(real_model(), [parse_method("full"), method], ["perplexity"], [512], 1,
                       calibration_length=512, calibration_samples=1)
    full, xa = [r for r in records if r.domain == "pydoc"]  # calibrated on pydoc; also measured on the code domain
    assert [r.domain for r in records] == ["pydoc", "code"] * 2
    assert xa.method == "xa:calibrated=1,stride=16,block_size=64" and 0.0 < xa.density < 1.0
    assert xa.value < 1.1 * full.value


@pytest.mark.parametrize("spec,message", [("xa:quantile=0.9", "calibrated=1"),
                                          ("xa:calibrated=1,quantile=1.5", "quantile"),
                                          ("xa:calibrated=1,threshold=0", "target")])
def test_calibrated_xa_spec_errors(spec, message):
    from flexsparse.eval.methods import parse_method

    with pytest.raises(ValueError, match=message):
        parse_method(spec)
