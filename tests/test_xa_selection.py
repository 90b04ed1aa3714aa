"""XAttention's block selection: the rules against a literal re-implementation of the reference's, their
guarantees (hypothesis), geometry (bottom-right offsets, padding), the Triton kernel against the torch rule."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from flexsparse.kernels.xa_estimate import block_mass_torch
from flexsparse.masks import xa_selection
from flexsparse.masks.xa_selection import estimate_and_select, select_blocks, select_blocks_torch
from flexsparse.synthetic import synthetic_attention_inputs


def literal_reference_selection(mass, threshold, chunk_blocks):
    """mit-han-lab/x-attention's prefill selection (``find_blocks_chunked`` per chunk, then its causal tril),
    written out one row at a time, for batch 1 (its advanced indexing mixes batch elements).

    mass ``[1, H, QB, QB]`` (square prefill, zero above the diagonal), threshold ``[H]``; rows in chunks of
    ``chunk_blocks`` query blocks.
    """
    _, heads, q_blocks, kv_blocks = mass.shape
    width = -(-kv_blocks // chunk_blocks) * chunk_blocks  # keys padded to whole chunks
    keep = torch.zeros(mass.shape, dtype=torch.bool)
    for h in range(heads):
        for qb in range(q_blocks):
            chunk, r = divmod(qb, chunk_blocks)
            start = chunk * chunk_blocks  # the key block of the chunk's first diagonal
            row = [float(x) for x in mass[0, h, qb]] + [0.0] * (width - kv_blocks)
            forced = [j == 0 for j in range(width)]
            for j in range(start, start + chunk_blocks):  # the chunk's identity block overwrites these columns
                forced[j] = j == start + r
            others = sorted((0.0 if forced[j] else row[j] for j in range(width)), reverse=True)
            placed = [0.0, sum(row[j] for j in range(width) if forced[j])] + others[:-2]
            before = [sum(([0.0] + placed)[: p + 1]) for p in range(width)]
            order = sorted(range(width), key=lambda j: -(100000 * (1 + row[j]) if forced[j] else row[j]))
            required = sum(row) * float(threshold[h])
            kept = list(forced)
            for p in range(width):
                kept[order[p] if before[p] < required else 0] = True  # dropped places select column 0
            for j in range(kv_blocks):
                keep[0, h, qb, j] = kept[j] and j <= qb and j < start + chunk_blocks
    return keep


def causal_masses(heads, blocks, seed, power=3.0):
    gen = torch.Generator().manual_seed(seed)
    mass = torch.rand(1, heads, blocks, blocks, generator=gen) ** power + 1e-6
    return mass * torch.ones(blocks, blocks).tril()


@given(blocks=st.integers(1, 12), seed=st.integers(0, 10_000),
       thresholds=st.lists(st.floats(0.05, 0.99), min_size=3, max_size=3))
def test_plus_one_is_the_reference_rule_of_its_first_chunk(blocks, seed, thresholds):
    mass, threshold = causal_masses(3, blocks, seed), torch.tensor(thresholds)
    expected = literal_reference_selection(mass, threshold, chunk_blocks=blocks)
    assert torch.equal(select_blocks_torch(mass, threshold, rule="plus_one"), expected)


@given(blocks=st.integers(2, 12), chunk=st.integers(1, 6), seed=st.integers(0, 10_000),
       threshold=st.floats(0.05, 0.99))
def test_minimal_is_the_reference_rule_past_its_first_chunk(blocks, chunk, seed, threshold):
    """Past the first chunk the reference keeps the minimal set; everywhere plus_one keeps a superset of it."""
    mass, thresholds = causal_masses(2, blocks, seed), torch.full((2,), threshold)
    reference = literal_reference_selection(mass, thresholds, chunk_blocks=chunk)
    minimal = select_blocks_torch(mass, thresholds, rule="minimal")
    plus_one = select_blocks_torch(mass, thresholds, rule="plus_one")
    assert torch.equal(minimal[:, :, chunk:], reference[:, :, chunk:])
    assert torch.equal(plus_one[:, :, :chunk], reference[:, :, :chunk])
    assert not (reference & ~plus_one).any()


def test_plus_one_matches_the_reference_on_realistic_inputs():
    inputs = synthetic_attention_inputs(1, 8, 8, 1024, 64, seed=4)
    mass = block_mass_torch(inputs.q, inputs.k, 8, 64)
    threshold = torch.tensor([0.9, 0.9, 0.8, 0.95, 0.9, 0.7, 0.9, 0.9])
    expected = literal_reference_selection(mass, threshold, chunk_blocks=16)
    assert torch.equal(select_blocks(mass, threshold), expected)


geometries = st.tuples(st.integers(1, 150), st.integers(0, 100), st.sampled_from([16, 32]), st.integers(0, 200))


@given(geometry=geometries, rule=st.sampled_from(["plus_one", "minimal"]), seed=st.integers(0, 10_000),
       thresholds=st.lists(st.floats(0.05, 1.0), min_size=2, max_size=2))
def test_selection_guarantees(geometry, rule, seed, thresholds):
    """In every valid row: the kept *estimated* mass reaches the threshold, the sink and the diagonal band are
    kept, nothing past the row's last position is kept; minimal cannot drop its lightest ranked block; plus_one is
    minimal plus at most one block. Offsets that are not block-aligned give a two-block diagonal band."""
    q_len, extra, block, cut = geometry
    kv_len = q_len + extra
    valid = torch.tensor([kv_len, max(0, kv_len - cut)])
    q_blocks, kv_blocks = -(-q_len // block), -(-kv_len // block)
    gen = torch.Generator().manual_seed(seed)
    mass = torch.rand(2, 2, q_blocks, kv_blocks, generator=gen) ** 4
    threshold = torch.tensor(thresholds)
    geo = dict(q_len=q_len, kv_len=kv_len, block_size=block, kv_valid_len=valid)
    keep = select_blocks_torch(mass, threshold, rule=rule, **geo)
    diag_lo, diag_hi, row_ok = xa_selection.block_rows(q_blocks, kv_blocks, mass.device, **geo)
    kb = torch.arange(kv_blocks)
    causal = (kb <= diag_hi[:, None, :, None]) & row_ok[:, None, :, None]
    band = causal & (kb >= diag_lo[:, None, :, None])
    padding = (~row_ok)[:, None, :].expand(2, 2, q_blocks)
    assert not (keep & ~causal)[~padding].any()
    assert keep[..., 0].all() and (keep[padding].sum(-1) == 1).all()  # padding rows: the sink only
    assert not (band & ~keep).any()
    row_mass = (mass * causal).sum(-1)
    kept = (mass * keep).sum(-1)
    assert (kept >= threshold.view(1, 2, 1) * row_mass - 1e-6).all()
    minimal = select_blocks_torch(mass, threshold, rule="minimal", **geo)
    if rule == "minimal":  # dropping the lightest kept block beyond the sink and the band falls short
        ranked_kept = keep & ~band & (kb != 0)
        lightest = torch.where(ranked_kept, mass, float("inf")).min(-1).values
        has = ranked_kept.any(-1)
        assert ((kept - lightest)[has] < (threshold.view(1, 2, 1) * row_mass)[has] + 1e-6).all()
    else:  # the margin: one block, and one more where the uncredited sink ranks below heavier blocks
        assert not (minimal & ~keep).any()
        assert (keep & ~minimal).sum(-1).max() <= 2


def test_threshold_one_keeps_every_causal_block():
    mass = causal_masses(2, 6, 0)
    for rule in ("plus_one", "minimal"):
        assert torch.equal(select_blocks(mass, 1.0, rule=rule)[0, 0], torch.ones(6, 6, dtype=torch.bool).tril())
    table = select_blocks(mass, torch.tensor([0.2, 1.0]))
    assert table[0, 1].sum() == 21 and table[0, 0].sum() < 21


def test_chunked_prefill_rows_see_their_keys():
    """40 queries at positions 90..129 of 130 keys, blocks of 16: query block 0 spans keys 90..105, so its
    diagonal band is key blocks 5 and 6; the last query block (positions 122..129) ends in key block 8."""
    mass = torch.rand(1, 1, 3, 9)
    keep = select_blocks(mass, 0.1, q_len=40, kv_len=130, block_size=16, rule="minimal")[0, 0]
    assert keep[0, [0, 5, 6]].all() and not keep[0, 7:].any()
    assert keep[2, [0, 7, 8]].all()


def test_planted_needle_is_kept_beside_a_sink_and_a_window():
    """A needle of 8 keys, read strongly by the last queries of a sink+window head, keeps its block."""
    inputs = synthetic_attention_inputs(1, 2, 1, 2048, 64, seed=1)  # a local head: sink and window
    q, k = inputs.q.clone(), inputs.k.clone()
    gen = torch.Generator().manual_seed(0)
    direction = torch.randn(64, generator=gen)
    direction /= direction.norm()
    k[0, 0, 704:712] += direction * 24  # key block 11 (of 64 tokens), one stride-8 group
    q[0, :, 1800:] += direction * 12
    for rule in ("plus_one", "minimal"):
        table = estimate_and_select(q, k, 0.9, 8, 64, rule=rule)
        assert table[0, :, 1856 // 64:, 11].all()
        assert table[0, :, 1856 // 64:, 3:10].float().mean() < 0.5  # while ordinary blocks are dropped


def test_estimate_and_select_chunks_equal_one_pass(monkeypatch):
    q, k = synthetic_attention_inputs(2, 4, 2, 300, 32, seed=2).qkv[:2]
    valid = torch.tensor([300, 170])
    whole = estimate_and_select(q, k, 0.8, 4, 32, kv_valid_len=valid)
    monkeypatch.setattr(xa_selection, "_MASS_CHUNK_BYTES", 1)  # one query block per chunk
    assert torch.equal(estimate_and_select(q, k, 0.8, 4, 32, kv_valid_len=valid), whole)
    expected = select_blocks(block_mass_torch(q, k, 4, 32, kv_valid_len=valid), 0.8, q_len=300, kv_len=300,
                             block_size=32, kv_valid_len=valid)
    assert torch.equal(whole, expected)


@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        (dict(rule="fewest"), ValueError, "rule"),
        (dict(threshold=[0.5, 0.5, 0.5]), ValueError, "threshold"),
        (dict(q_len=60), ValueError, "block_size"),
        (dict(block_size=16, q_len=60, kv_len=60), ValueError, "blocks"),
        (dict(backend="cuda"), ValueError, "backend"),
    ],
)
def test_selection_rejects_bad_arguments(kwargs, error, match):
    args = dict(threshold=0.9) | kwargs
    with pytest.raises(error, match=match):
        select_blocks(causal_masses(2, 3, 0), args.pop("threshold"), **args)
    with pytest.raises(TypeError, match="mass"):
        select_blocks(torch.ones(3, 3, dtype=torch.bool), 0.9)


# ----- the Triton kernel ------------------------------------------------------------------------------------

triton = pytest.importorskip("triton")


def distinct_masses(batch, heads, q_blocks, kv_blocks, seed):
    """Distinct dyadic masses: sums are exact in any order, so both implementations cut at the same place."""
    gen = torch.Generator().manual_seed(seed)
    n = batch * heads * q_blocks * kv_blocks
    return ((torch.randperm(n, generator=gen).float() + 1) ** 2 / 1024).view(batch, heads, q_blocks, kv_blocks)


@pytest.mark.parametrize("shape,geometry,valid", [
    ((1, 3, 8, 8), {}, None),
    ((2, 3, 5, 9), dict(q_len=70, kv_len=140, block_size=16), [140, 100]),
    ((1, 2, 6, 6), dict(q_len=90, kv_len=90, block_size=16), None),
    ((2, 2, 4, 7), dict(q_len=64, kv_len=100, block_size=16, q_start=20), [90, 35]),
])
@pytest.mark.parametrize("rule", ["plus_one", "minimal"])
def test_triton_selection_matches_torch(shape, geometry, valid, rule):
    device = "cuda" if torch.cuda.is_available() else "cpu"
    mass = distinct_masses(*shape, seed=len(geometry)).to(device)
    threshold = torch.tensor([0.5, 0.9, 1.0][: shape[1]], device=device)
    kwargs = geometry | dict(rule=rule, kv_valid_len=None if valid is None else torch.tensor(valid, device=device))
    assert torch.equal(select_blocks(mass, threshold, backend="triton", **kwargs),
                       select_blocks(mass, threshold, backend="torch", **kwargs))


@pytest.mark.gpu
def test_triton_selection_matches_torch_on_estimated_masses():
    q, k = synthetic_attention_inputs(1, 32, 8, 8192, 128, seed=0, device="cuda", dtype=torch.bfloat16).qkv[:2]
    threshold = torch.linspace(0.7, 0.95, 32, device="cuda")
    for rule in ("plus_one", "minimal"):
        mass = block_mass_torch(q, k, 16, 128)
        fast = select_blocks(mass, threshold, rule=rule, backend="triton")
        exact = select_blocks(mass, threshold, rule=rule, backend="torch")
        assert (fast != exact).float().mean() < 1e-4  # only equal masses at the cut-off may differ


@pytest.mark.gpu
def test_estimate_and_select_does_not_recompile():
    from flexsparse.kernels.xa_estimate_triton import compiled_variants

    make = lambda seed: torch.randn(1, 8, 4096, 128, device="cuda", dtype=torch.bfloat16,
                                    generator=torch.Generator("cuda").manual_seed(seed))
    estimate_and_select(make(0), make(1)[:, :2], 0.9, 16, 128)
    variants = compiled_variants()
    for seed in range(10):
        estimate_and_select(make(2 + seed), make(20 + seed)[:, :2], torch.full((8,), 0.9, device="cuda"), 16, 128)
    assert compiled_variants() == variants
