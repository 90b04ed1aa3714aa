"""Tensor-parallel inference (transformers' ``DistributedConfig(tp_plan="auto")`` + flexsparse.convert with
global modes) against one process running the converted model: prefill logits of padded batches, greedy
generate() tokens, the sparse KV cache's bytes per rank, on 2 and 4 gloo processes on CPU (loopback only), Llama
and Qwen3 tiny configs; the errors; the balanced selection of full heads and the per-rank tile counts
(in-process)."""

from __future__ import annotations

import json
import os
import socket
import warnings
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file

pytest.importorskip("accelerate")  # transformers' tp_plan needs it (the eval extra)

from transformers import AutoModelForCausalLM, DistributedConfig, LlamaConfig, Qwen3Config

import flexsparse
from flexsparse import ESA, Causal, HybridAttention, SinkWindow, TriangleMix
from flexsparse.distributed import (
    RankAttention,
    TensorParallelLayer,
    rank_kv_heads,
    rank_tiles,
    tensor_parallel_rank,
)
from flexsparse.integrations import (
    SparseKVCache,
    cache_argument,
    fused_routers,
    kv_memory_formula,
    last_routings,
)
from flexsparse.integrations.routing import routed_layers
from flexsparse.masks.geometry import Geometry
from flexsparse.routers import (
    HeadRouter,
    LayerRouter,
    Router,
    Routing,
    boundary_positions,
    mix_full_sparse,
    routed_attention,
)
from flexsparse.routers.base import mlp
from flexsparse.routers.selection import select_modes
from tests.conftest import LOOPBACK

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")

LAYERS, HEADS, KV_HEADS, HEAD_DIM = 2, 8, 4, 16
SINK, WINDOW = 2, 4
ATOL = 1e-5
NEW_TOKENS = 6


def tiny_config(kind: str):
    shared = {"vocab_size": 128, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": LAYERS,
              "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM,
              "max_position_embeddings": 256, "tie_word_embeddings": False}
    return LlamaConfig(**shared) if kind == "llama" else Qwen3Config(**shared)


def layer_patterns() -> list[dict]:
    """Every cache kind per layer: full (Causal, TriangleMix), ring (SinkWindow) and ESA with per-head shifts."""
    return [{"full": Causal(), "ssa": SinkWindow(SINK, WINDOW), "tri": TriangleMix(2, 4, 2),
             "esa": ESA(layer, LAYERS, 4, HEADS)} for layer in range(LAYERS)]


MODES = [["full", "ssa", "ssa", "esa"], ["ssa", "tri", "esa", "full"]]


def inputs() -> tuple[torch.Tensor, torch.Tensor]:
    """A left-padded batch: row 0 holds 4 padding tokens before 8 real ones, row 1 is 12 real tokens."""
    ids = torch.randint(1, 128, (2, 12), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[0, :4] = 0
    ids[0, :4] = 0
    return ids, mask


def rank_formula(modes: list[list[str]], heads: range, batch: int, tokens: int) -> int:
    """KV bytes of the rank's heads (fp32): every-key heads keep every token, rings ``min(S, sink + window)``."""
    kept = sum(min(tokens, SINK + WINDOW) if layer[h] == "ssa" else tokens for layer in modes for h in heads)
    return 2 * batch * HEAD_DIM * 4 * kept


def generate_with_cache(model, ids, mask):
    cache = SparseKVCache(model, max_length=ids.shape[1] + NEW_TOKENS - 1)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False,
                         pad_token_id=0, **{cache_argument(model): cache})
    return out, cache


def load_sharded(path: str):
    """The saved model, sharded over the process group by transformers' tensor parallelism, as the distributed
    guide loads it: ``distributed_config`` (built after the process group's environment is set), not the
    deprecated ``tp_plan=`` argument, which transformers 5.24 warns about."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                     distributed_config=DistributedConfig(tp_plan="auto")).eval()
    assert not [w for w in caught if "tp_plan" in str(w.message)], [str(w.message) for w in caught]
    return model


def check_model(path: str, rank: int, world: int) -> None:
    """The converted TP model's logits, tokens and cache bytes against the converted single-process model."""
    ids, mask = inputs()
    single = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    sharded = load_sharded(path)
    assert tensor_parallel_rank(sharded) == (rank, world)
    assert tensor_parallel_rank(single) is None
    for model in (single, sharded):
        flexsparse.convert(model, layer_patterns(), MODES, block_size=4, backend="dense")
    heads = rank_kv_heads(KV_HEADS, world, rank)
    with torch.no_grad():
        expected = single(ids, attention_mask=mask).logits
        got = sharded(ids, attention_mask=mask).logits
    real = mask.bool()
    torch.testing.assert_close(got[real], expected[real], atol=ATOL, rtol=0)
    assert flexsparse.integrations.layer_modes(sharded) == MODES  # global modes on every rank

    tokens_single, cache_single = generate_with_cache(single, ids, mask)
    tokens_sharded, cache_sharded = generate_with_cache(sharded, ids, mask)
    assert torch.equal(tokens_sharded, tokens_single)
    assert tokens_sharded.shape[1] == ids.shape[1] + NEW_TOKENS

    cached = ids.shape[1] + NEW_TOKENS - 1
    report = cache_sharded.memory_report()
    assert report.tokens == cached
    mine = rank_formula(MODES, heads, ids.shape[0], cached)
    assert report.used_bytes == report.allocated_bytes == mine
    assert kv_memory_formula(sharded, ids.shape[0], cached, torch.float32) == mine
    every = torch.tensor([mine])
    gathered = [torch.zeros_like(every) for _ in range(world)]
    dist.all_gather(gathered, every)
    assert sum(int(t) for t in gathered) == cache_single.memory_report().used_bytes

    # modes for the rank's heads only, instead of the layer's: named in the error
    local = [layer[heads.start:heads.stop] for layer in MODES]
    with pytest.raises(ValueError, match=f"one rank's share of its {KV_HEADS} KV heads under tensor parallelism "
                                         f"over {world} ranks"):
        flexsparse.convert(sharded, layer_patterns(), local, block_size=4, backend="dense")


# ----- routers under tensor parallelism ---------------------------------------------------------------------------

ROUTED_PATTERNS = {"full": Causal(), "ssa": SinkWindow(SINK, WINDOW)}
ROUTER_OPTIONS = {"pool_size": 3, "init_std": 0.3}  # logits of order 1: decisions far from ties
ROUTER_SEED = 7  # rank 0's router weights; with it the batch's decisions mix full and sparse


def flat_router_weights(model) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for layer in routed_layers(model) for p in layer.router.parameters()])


def copy_routers(source, target) -> None:
    for mine, theirs in zip(routed_layers(target), routed_layers(source)):
        mine.router.load_state_dict(theirs.router.state_dict())


def routed_pair(path: str, kind: str, rank: int):
    """The sharded model converted with ``router=kind`` (each rank seeds its routers differently: convert must
    give every rank rank 0's weights) and the single-process model converted with the same routers."""
    single = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    sharded = load_sharded(path)
    torch.manual_seed(ROUTER_SEED + 1000 * rank)
    flexsparse.convert(sharded, ROUTED_PATTERNS, router=kind, router_options=ROUTER_OPTIONS, block_size=4,
                       backend="dense")
    flexsparse.convert(single, ROUTED_PATTERNS, router=kind, router_options=ROUTER_OPTIONS, block_size=4,
                       backend="dense")
    copy_routers(sharded, single)
    return single, sharded


def check_routed(path: str, kind: str, rank: int, world: int) -> None:
    """Per-rank decisions, prefill logits and generate() tokens of a routed TP model against one process."""
    ids, mask = inputs()
    single, sharded = routed_pair(path, kind, rank)
    mine = flat_router_weights(sharded)
    every = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(every, mine)
    for other in every:
        assert torch.equal(other, mine)  # rank 0's weights on every rank, each rank having seeded its own
    with torch.no_grad():
        expected = single(ids, attention_mask=mask).logits
        got = sharded(ids, attention_mask=mask).logits
    heads = rank_kv_heads(KV_HEADS, world, rank)
    all_modes = []
    for theirs, ours in zip(last_routings(single), last_routings(sharded)):
        modes = theirs.modes(KV_HEADS)
        all_modes.append(modes)
        if kind == "head":
            assert ours.logits.shape == (ids.shape[0], len(heads), 2)
            torch.testing.assert_close(ours.logits, theirs.logits[:, heads.start:heads.stop], atol=1e-5, rtol=0)
        else:
            assert ours.logits.shape == (ids.shape[0], 1, 2)
            torch.testing.assert_close(ours.logits, theirs.logits, atol=1e-5, rtol=0)
        margin = (theirs.logits[..., 1] - theirs.logits[..., 0]).abs().min()
        assert margin > 1e-3, f"the test's routers decide too close to a tie ({float(margin)})"
        assert torch.equal(ours.modes(len(heads)), modes[:, heads.start:heads.stop])
    decided = torch.stack(all_modes)
    assert (decided == 0).any() and (decided == 1).any(), "the test's routers must choose both patterns"
    real = mask.bool()
    torch.testing.assert_close(got[real], expected[real], atol=ATOL, rtol=0)
    # the fused router kernel (the interpreter on CPU) on the rank's states, or the gathered pooled ones
    with fused_routers(single), fused_routers(sharded), torch.no_grad():
        expected_fused = single(ids, attention_mask=mask).logits
        got_fused = sharded(ids, attention_mask=mask).logits
    for theirs, ours in zip(last_routings(single), last_routings(sharded)):
        assert ours.fused and theirs.fused
        assert torch.equal(ours.modes(len(heads)), theirs.modes(KV_HEADS)[:, heads.start:heads.stop])
    torch.testing.assert_close(got_fused[real], expected_fused[real], atol=ATOL, rtol=0)
    generate = {"attention_mask": mask, "max_new_tokens": NEW_TOKENS, "do_sample": False, "pad_token_id": 0}
    tokens_single, tokens_sharded = single.generate(ids, **generate), sharded.generate(ids, **generate)
    assert torch.equal(tokens_sharded, tokens_single)
    assert tokens_sharded.shape[1] == ids.shape[1] + NEW_TOKENS


def check_saved(path: str, rank: int, world: int, directory: str) -> None:
    """save_config on every rank of a routed TP model (rank 0 writes) = the single-process model's file; loaded
    on one process and on the TP ranks, the logits of the single-process converted model."""
    ids, mask = inputs()
    single, sharded = routed_pair(path, "head", rank)
    tp_dir, single_dir = os.path.join(directory, "tp"), os.path.join(directory, f"single{rank}")
    written = flexsparse.save_config(sharded, tp_dir)
    flexsparse.save_config(single, single_dir)
    dist.barrier()
    assert os.path.exists(written)
    assert json.loads(written.read_text()) == json.loads((Path(single_dir) / "flexsparse.json").read_text())
    tp_tensors = load_file(os.path.join(tp_dir, "flexsparse.safetensors"))
    single_tensors = load_file(os.path.join(single_dir, "flexsparse.safetensors"))
    assert tp_tensors.keys() == single_tensors.keys()
    assert all(torch.equal(tp_tensors[k], single_tensors[k]) for k in tp_tensors)
    with torch.no_grad():
        expected = single(ids, attention_mask=mask).logits
        loaded = flexsparse.load_config(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval(),
                                        tp_dir)
        got_single = loaded(ids, attention_mask=mask).logits
        reloaded = load_sharded(path)
        got_sharded = flexsparse.load_config(reloaded, tp_dir)(ids, attention_mask=mask).logits
    real = mask.bool()
    assert torch.equal(got_single[real], expected[real])
    torch.testing.assert_close(got_sharded[real], expected[real], atol=ATOL, rtol=0)
    assert flexsparse.integrations.layer_modes(reloaded) == flexsparse.integrations.layer_modes(single)


def run_checks(rank: int, world: int, port: int, paths: list[str], checks: tuple[str, ...] = ("model",),
               directory: str | None = None) -> None:
    torch.set_num_threads(1)  # first: no thread pool inherited through fork
    os.environ.update(GLOO_SOCKET_IFNAME=LOOPBACK, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    try:
        for path in paths:
            for check in checks:
                if check == "model":
                    check_model(path, rank, world)
                elif check == "saved":
                    check_saved(path, rank, world, directory)
                else:
                    check_routed(path, check, rank, world)
    finally:
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


START = "fork" if "fork" in mp.get_all_start_methods() else "spawn"


@pytest.fixture(scope="module")
def saved_models(tmp_path_factory) -> dict[str, str]:
    paths = {}
    for kind in ("llama", "qwen3"):
        torch.manual_seed(0)
        config = tiny_config(kind)
        path = tmp_path_factory.mktemp(kind)
        AutoModelForCausalLM.from_config(config).save_pretrained(path)
        paths[kind] = str(path)
    return paths


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
@pytest.mark.parametrize("world", [2, 4])
def test_matches_single_process(saved_models, kind, world):
    mp.start_processes(run_checks, args=(world, free_port(), [saved_models[kind]]), nprocs=world,
                       start_method=START)


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
@pytest.mark.parametrize("world", [2, 4])
def test_routers_match_single_process(saved_models, kind, world):
    mp.start_processes(run_checks, args=(world, free_port(), [saved_models[kind]], ("head", "layer")),
                       nprocs=world, start_method=START)


def test_save_config_round_trip(saved_models, tmp_path):
    mp.start_processes(run_checks, args=(2, free_port(), [saved_models["qwen3"]], ("saved",), str(tmp_path)),
                       nprocs=2, start_method=START)


# ----- in-process: detection and errors ------------------------------------------------------------------------


class FakeMesh:
    """A 1-D device mesh that only tells its size and this process's coordinate."""

    ndim = 1
    mesh_dim_names = ("tp",)

    def __init__(self, rank: int, size: int) -> None:
        self.rank, self._size = rank, size

    def size(self) -> int:
        return self._size

    def get_local_rank(self) -> int:
        return self.rank


def test_rank_kv_heads():
    assert [rank_kv_heads(8, 4, r) for r in range(4)] == [range(2), range(2, 4), range(4, 6), range(6, 8)]
    assert rank_kv_heads(3, 1, 0) == range(3)
    with pytest.raises(ValueError, match="layer 2 has 6 KV heads, not divisible by the tensor-parallel size 4"):
        rank_kv_heads(6, 4, 1, "layer 2")


def test_kv_heads_not_divisible(saved_models):
    model = AutoModelForCausalLM.from_pretrained(saved_models["llama"], dtype=torch.float32)
    model._tp_size, model._device_mesh = 8, FakeMesh(3, 8)
    assert tensor_parallel_rank(model) == (3, 8)
    with pytest.raises(ValueError, match=r"layer 0 \(model.layers.0.self_attn\) has 4 KV heads, not divisible by "
                                         "the tensor-parallel size 8"):
        flexsparse.convert(model, layer_patterns(), MODES, backend="dense")
    model._tp_size, model._device_mesh = 2, FakeMesh(1, 2)  # k_proj not sharded: refused, not misread
    with pytest.raises(ValueError, match="this rank's k_proj holds 64 rows, expected 4 KV heads x head_dim 16 / "
                                         "tensor-parallel size 2 = 32"):
        flexsparse.convert(model, layer_patterns(), MODES, backend="dense")


# ----- balanced selection and per-rank cost -------------------------------------------------------------------


def full_per_rank(modes: list[list[str]], tp_size: int) -> list[list[int]]:
    share = len(modes[0]) // tp_size
    return [[layer[r * share:(r + 1) * share].count("full") for r in range(tp_size)] for layer in modes]


@settings(max_examples=60, deadline=None)
@given(layers=st.integers(1, 4), share=st.integers(1, 4), tp_size=st.sampled_from([1, 2, 4]),
       rho=st.floats(0.0, 1.0), per_layer=st.booleans(), min_full=st.integers(0, 2), first_last=st.booleans(),
       seed=st.integers(0, 10_000))
def test_balanced_selection(layers, share, tp_size, rho, per_layer, min_full, first_last, seed):
    heads = share * tp_size
    min_full = min(min_full, heads)
    scores = torch.rand(layers, heads, generator=torch.Generator().manual_seed(seed))
    options = {"per_layer": per_layer, "min_full_per_layer": min_full, "keep_first_last_full": first_last}
    plain = select_modes(scores, rho, **options)
    balanced = select_modes(scores, rho, tp_size=tp_size, **options)
    if tp_size == 1:
        assert balanced == plain
    counts = full_per_rank(balanced, tp_size)
    for layer, per_rank in enumerate(counts):
        assert len(set(per_rank)) == 1, f"layer {layer}: full heads per rank {per_rank}"
        assert sum(per_rank) >= min_full
        # each rank keeps its own best-scoring heads full
        for r in range(tp_size):
            block = scores[layer, r * share:(r + 1) * share]
            chosen = [h for h in range(share) if balanced[layer][r * share + h] == "full"]
            best = sorted(range(share), key=lambda h: (-float(block[h]), h))[:len(chosen)]
            assert sorted(chosen) == sorted(best)
    total = lambda modes: sum(layer.count("full") for layer in modes)
    assert total(balanced) >= total(plain)  # never sparser than asked
    if per_layer:  # at most the plain count rounded up to a multiple of tp_size, per layer
        for mine, theirs in zip(full_per_rank(balanced, tp_size), plain):
            assert sum(mine) == -(-theirs.count("full") // tp_size) * tp_size
    else:
        assert total(balanced) < total(plain) + tp_size * layers


def test_balanced_selection_example():
    scores = torch.tensor([[9.0, 8.0, 1.0, 0.0], [0.0, 1.0, 2.0, 3.0]])
    assert select_modes(scores, 0.5, per_layer=True) == [["full", "full", "sparse", "sparse"],
                                                          ["sparse", "sparse", "full", "full"]]
    assert select_modes(scores, 0.5, per_layer=True, tp_size=2) == [["full", "sparse", "full", "sparse"],
                                                                     ["sparse", "full", "sparse", "full"]]
    with pytest.raises(ValueError, match="4 KV heads per layer are not divisible by tp_size=3"):
        select_modes(scores, 0.5, per_layer=True, tp_size=3)
    layer_scores = torch.tensor([1.0, 2.0])
    assert select_modes(layer_scores, 0.5, per_layer=False, num_kv_heads=4, tp_size=2) == [
        ["sparse"] * 4, ["full"] * 4]


def brute_force_tiles(pattern, heads: int, length: int, block: int) -> torch.Tensor:
    """Tiles with any attended key per query head, from the dense reference."""
    dense = pattern.dense(Geometry(heads, length, length, block))[0].expand(heads, -1, -1)
    blocks = -(-length // block)
    padded = torch.zeros(heads, blocks * block, blocks * block, dtype=torch.bool)
    padded[:, :length, :length] = dense
    return padded.view(heads, blocks, block, blocks, block).any(4).any(2).sum((1, 2))


def test_rank_tiles():
    length, block, heads = 200, 16, 8
    patterns = layer_patterns()
    patterns = [{**p, "ssa": SinkWindow(16, 48)} for p in patterns]
    tiles = rank_tiles(patterns, MODES, heads, length, 2, block_size=block)
    assert tiles.shape == (2, LAYERS)
    group = heads // KV_HEADS
    for layer, layer_modes in enumerate(MODES):
        per_head = torch.cat([brute_force_tiles(patterns[layer][m], heads, length, block)
                              [h * group:(h + 1) * group] for h, m in enumerate(layer_modes)])
        expected = per_head.view(2, -1).sum(1)
        assert tiles[:, layer].tolist() == expected.tolist()
    assert rank_tiles(patterns, MODES, heads, length, 1, block_size=block)[0].tolist() == tiles.sum(0).tolist()
    balanced = [["full", "ssa", "full", "ssa"]] * LAYERS
    unbalanced = [["full", "full", "ssa", "ssa"]] * LAYERS
    even = rank_tiles(patterns, balanced, heads, length, 2, block_size=block)
    uneven = rank_tiles(patterns, unbalanced, heads, length, 2, block_size=block)
    assert even[0].tolist() == even[1].tolist() and even.sum() == uneven.sum()
    assert uneven.max() > even.max()
    with pytest.raises(ValueError, match="layer 0 has 4 KV heads, not divisible by the tensor-parallel size 3"):
        rank_tiles(patterns, MODES, heads, length, 3)
    with pytest.raises(ValueError, match="names unknown pattern 'nope'"):
        rank_tiles(patterns, [["nope"] * 4] * 2, heads, length, 2)


def test_calibration_selects_for_tp_size():
    from flexsparse.eval.calibration import Calibration, select

    scores = torch.tensor([[9.0, 8.0, 1.0, 0.0], [0.0, 1.0, 2.0, 3.0]])
    balanced = [["full", "sparse", "full", "sparse"], ["sparse", "full", "sparse", "full"]]
    assert select(scores, 0.5, tp_size=2) == balanced
    calibration = Calibration("retrieval", scores, select(scores, 0.5), {"full": Causal(), "sparse": SinkWindow(2, 4)},
                              0.5, True)
    assert calibration.reselect(0.5, tp_size=2).modes == balanced
    assert calibration.reselect(0.5).modes == calibration.modes
    entropy = torch.tensor([[1.0] * 4, [2.0] * 4])
    assert select(entropy, 0.5, layer_scores=True, tp_size=4) == [["sparse"] * 4, ["full"] * 4]
    with pytest.raises(ValueError, match="not divisible by tp_size=3"):
        select(entropy, 0.5, layer_scores=True, tp_size=3)


# ----- in-process: routers on one rank's heads --------------------------------------------------------------------


def test_routed_attention_on_rank_heads():
    """A rank's RankAttention under a routing of its KV heads = the layer's routed output for those heads, in the
    training mix (forward and the routing logits' gradient) and the inference call."""
    layer = HybridAttention(HEADS, KV_HEADS, HEAD_DIM, ROUTED_PATTERNS, [0] * KV_HEADS, block_size=4,
                            backend="dense")
    heads = range(2, 4)
    rank = RankAttention(layer, heads)
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(2, HEADS, 12, HEAD_DIM, generator=gen)
    k, v = (torch.randn(2, KV_HEADS, 12, HEAD_DIM, generator=gen) for _ in range(2))
    logits = torch.randn(2, KV_HEADS, 2, generator=gen, requires_grad=True)
    group = HEADS // KV_HEADS
    q_rank, k_rank, v_rank = q[:, 2 * group:4 * group], k[:, 2:4], v[:, 2:4]

    def routing(part: torch.Tensor) -> Routing:
        soft = part.softmax(-1)
        hard = torch.nn.functional.one_hot(soft.argmax(-1), 2).to(soft.dtype)
        return Routing(part, hard + soft - soft.detach(), 0, 1)  # straight-through, as a router's training

    whole = mix_full_sparse(layer, q, k, v, routing(logits))
    (whole_grad,) = torch.autograd.grad(whole[:, 2 * group:4 * group].square().sum(), logits)
    mine = mix_full_sparse(rank, q_rank, k_rank, v_rank, routing(logits[:, 2:4]))
    (mine_grad,) = torch.autograd.grad(mine.square().sum(), logits)
    torch.testing.assert_close(mine, whole[:, 2 * group:4 * group], atol=ATOL, rtol=0)
    torch.testing.assert_close(mine_grad, whole_grad, atol=ATOL, rtol=0)  # zero outside the rank's heads
    assert mine_grad[:, 2:4].abs().sum() > 0
    with torch.no_grad():
        decided = routing(logits.detach())
        expected = routed_attention(layer, q, k, v, decided)[:, 2 * group:4 * group]
        got = routed_attention(rank, q_rank, k_rank, v_rank, routing(logits.detach()[:, 2:4]))
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)
    assert decided.is_sparse.any() and not decided.is_sparse.all()
    with pytest.raises(ValueError, match="routing decides 4 KV heads, attn has num_kv_heads=2"):
        routed_attention(rank, q_rank, k_rank, v_rank, decided)


class PerQueryHeadRouter(Router):
    """A router that decides per query head: neither a head router nor head-averaging (no kind: not
    registered)."""

    def __init__(self, head_dim: int) -> None:
        super().__init__(head_dim)
        self.task_mlp = mlp([head_dim, head_dim, head_dim])
        self.router_mlp = mlp([head_dim, head_dim, head_dim, 2])

    def forward(self, states, key_padding_mask=None, *, boundary=None):
        return self.router_mlp(self.task_mlp(self.pool(states, key_padding_mask, boundary)))


def test_tensor_parallel_router_errors():
    options = {"block_size": 4, "backend": "dense", "plan": "auto", "kv_heads": range(2)}
    args = (0, "layers.0", HEADS, KV_HEADS, HEAD_DIM, ROUTED_PATTERNS, [0] * KV_HEADS)
    with pytest.raises(ValueError, match="router for layer 0 \\(PerQueryHeadRouter\\) neither decides each KV "
                                         "head"):
        TensorParallelLayer(*args, router=PerQueryHeadRouter(HEAD_DIM), **options)
    with pytest.raises(ValueError, match="a LayerRouter averages every head: a tensor-parallel rank needs the "
                                         "process group"):
        TensorParallelLayer(*args, router=LayerRouter(HEAD_DIM), **options)
    state = TensorParallelLayer(*args, router=HeadRouter(HEAD_DIM), **options)  # per KV head: no group needed
    states = torch.randn(2, 12, 2, HEAD_DIM)
    boundary = boundary_positions(None, 2, 12, 3, "cpu")
    assert state.router_states(states, boundary) == (states, boundary)
