"""A converted tiny Llama under sequence parallelism (flexsparse.distributed.ulysses_model) against the same model
in one process: logits, loss and gradients with mixed static modes, and a routed model trained one step by
RouterTrainer (router gradients, decisions, loss), on 2 and 4 gloo processes on CPU, with the bytes each layer
exchanged (last_exchanges); argument errors in-process."""

from __future__ import annotations

import os
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import flexsparse
from flexsparse.distributed import ExchangeBytes, UlyssesCausalLM, last_exchanges, shard_batch, ulysses_model
from flexsparse.integrations import RouterTrainer, last_routings
from flexsparse.masks import Causal, SinkWindow, TriangleMix
from flexsparse.routers import SparsityConstraint
from tests.conftest import LOOPBACK
from tests.hf_util import left_padded, tiny_model
from tests.test_distributed import START, FakeGroup, free_port

pytestmark = pytest.mark.filterwarnings("ignore:.*flex_attention called without torch.compile.*")

B, S = 2, 32
ATOL = 1e-5
SHAPE = {"hidden_size": 128, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 16,
         "num_hidden_layers": 2}
PATTERNS = {"full": Causal(), "ssa": SinkWindow(4, 8), "tri": TriangleMix(2, 6, 4)}
MODES = [["full", "ssa", "tri", "ssa"], ["ssa", "tri", "full", "ssa"]]


def static_model():
    return flexsparse.convert(tiny_model("llama", **SHAPE), PATTERNS, MODES, block_size=16, backend="dense")


def routed_model():
    return flexsparse.convert(tiny_model("llama", **SHAPE), PATTERNS, router="head", block_size=16, backend="dense",
                              router_options={"pool_size": 3, "full": "full", "sparse": "ssa"})


def whole_batch() -> dict:
    """Row 1 left-padded by 5 tokens (the pooled tokens cross a shard boundary at P = 4); labels on real tokens;
    the routers pool the prompt (every real token but the last 6)."""
    ids, mask = left_padded([S, S - 5], seed=1)
    prompt = mask.bool().clone()
    prompt[:, -6:] = False
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100),
            "prompt_mask": prompt, "task": ["qa", "code"]}


def expected_exchange(grad_out: bool, grad_qkv: bool, padding_mask: bool) -> ExchangeBytes:
    """ExchangeBytes' formulas for SHAPE at B x S, float32, this group's P ranks."""
    world = dist.get_world_size()
    heads, kv_heads, dim = SHAPE["num_attention_heads"], SHAPE["num_key_value_heads"], SHAPE["head_dim"]
    qkv = B * S * (heads + 2 * kv_heads) * dim * 4 * (world - 1) // world**2
    out = B * S * heads * dim * 4 * (world - 1) // world**2
    return ExchangeBytes(qkv=qkv, out=out, grad_out=out if grad_out else 0, grad_qkv=qkv if grad_qkv else 0,
                         padding_mask=B * S // world * (world - 1) if padding_mask else 0)


def gathered(x: torch.Tensor, dim: int = 1) -> torch.Tensor:
    every = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(every, x.contiguous())
    return torch.cat(every, dim=dim)


def summed(grad: torch.Tensor) -> torch.Tensor:
    """The DDP-style all-reduce of a replicated parameter's gradient (the user's job for model parameters)."""
    grad = grad.clone()
    dist.all_reduce(grad)
    return grad


def check_static() -> None:
    batch = whole_batch()
    reference = static_model()
    expected = reference(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                         labels=batch["labels"])
    expected.loss.backward()
    model = ulysses_model(static_model())
    out = model(**shard_batch(batch["input_ids"], batch["attention_mask"], batch["labels"]), use_cache=False)
    assert out.logits.shape[1] == S // dist.get_world_size()
    torch.testing.assert_close(gathered(out.logits), expected.logits, atol=ATOL, rtol=0)
    torch.testing.assert_close(summed(out.loss.detach()), expected.loss.detach(), atol=ATOL, rtol=0)
    out.loss.backward()  # the rank's share of the loss
    # every parameter trains: both layers exchange q/k/v gradients; the first layer gathered the padding mask
    assert last_exchanges(model) == [expected_exchange(True, True, padding_mask=True),
                                     expected_exchange(True, True, padding_mask=False)]
    checked = 0
    for (name, mine), (_, theirs) in zip(model.named_parameters(), reference.named_parameters()):
        if name.endswith(("q_proj.weight", "k_proj.weight", "embed_tokens.weight")):
            assert theirs.grad.abs().sum() > 0, name
            torch.testing.assert_close(summed(mine.grad), theirs.grad, atol=ATOL, rtol=0,
                                       msg=lambda m, name=name: f"gradient of {name}: {m}")
            checked += 1
    assert checked == 5


def trainer(model) -> RouterTrainer:
    return RouterTrainer(model, SparsityConstraint({"qa": 0.6, "code": 0.3}), total_steps=4, progress=False,
                         generator=torch.Generator().manual_seed(3))


def check_routed() -> None:
    batch = whole_batch()
    reference = routed_model()
    expected_record = trainer(reference).step(batch)
    expected_routings = last_routings(reference)
    model = UlyssesCausalLM(routed_model())
    record = trainer(model).step(batch)  # the same Gumbel draws on every rank (its generator, same seed)
    # a frozen model: the first layer's q/k/v need no gradient (grad_qkv = 0), its output does (routing weights);
    # the second layer's q/k/v depend on the first layer's routing
    assert last_exchanges(model) == [expected_exchange(True, False, padding_mask=True),
                                     expected_exchange(True, True, padding_mask=False)]
    assert last_exchanges(model) == last_exchanges(model.model)
    routings = last_routings(model)
    decisions = torch.cat([r.is_sparse.flatten() for r in expected_routings])
    assert decisions.any() and not decisions.all()  # both modes trained: full and sparse outputs mixed
    for mine, theirs in zip(routings, expected_routings):
        torch.testing.assert_close(mine.logits, theirs.logits, atol=ATOL, rtol=0)
        assert torch.equal(mine.is_sparse, theirs.is_sparse)
    for key in ("loss", "lm_loss", "regulariser", "grad_norm"):
        assert record[key] == pytest.approx(expected_record[key], abs=ATOL), key
    params = flexsparse.integrations.router_parameters(model)
    expected_params = flexsparse.integrations.router_parameters(reference)
    assert len(params) == len(expected_params) > 0
    for index, (mine, theirs) in enumerate(zip(params, expected_params)):
        assert theirs.grad.abs().sum() > 0, index
        # no all-reduce here: the routing weights' backward sums the ranks' gradients already
        torch.testing.assert_close(mine.grad, theirs.grad, atol=ATOL, rtol=0,
                                   msg=lambda m, index=index: f"router parameter {index}: {m}")
        torch.testing.assert_close(mine.detach(), theirs.detach(), atol=ATOL, rtol=0)

    reference.eval()
    model.eval()
    with torch.no_grad():  # inference: routed per sequence from the gathered boundary tokens
        expected = reference(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        out = model(batch["input_ids"], batch["attention_mask"]).logits
    torch.testing.assert_close(gathered(out), expected, atol=ATOL, rtol=0)
    assert last_exchanges(model) == [expected_exchange(False, False, padding_mask=True),
                                     expected_exchange(False, False, padding_mask=False)]
    for mine, theirs in zip(last_routings(model), last_routings(reference)):
        assert torch.equal(mine.is_sparse, theirs.is_sparse)


def run_checks(rank: int, world: int, port: int, check: str) -> None:
    torch.set_num_threads(1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", LOOPBACK)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    try:
        {"static": check_static, "routed": check_routed}[check]()
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("check", ["static", "routed"])
def test_matches_single_process(world, check):
    mp.start_processes(run_checks, args=(world, free_port(), check), nprocs=world, start_method=START)


# ----- in-process ------------------------------------------------------------------------------------------------


def test_heads_not_divisible_by_group_size():
    with pytest.raises(ValueError, match=r"layer 0 \(model.layers.0.self_attn\): .*3 ranks.*num_heads=8 and "
                                         r"num_kv_heads=4 not divisible by 3"):
        ulysses_model(static_model(), FakeGroup(3))
    with pytest.raises(ValueError, match="not converted"):
        ulysses_model(tiny_model("llama"), FakeGroup(2))
    with pytest.raises(ValueError, match="not prepared by flexsparse.distributed.ulysses_model"):
        last_exchanges(static_model())


def test_one_rank_is_the_model_and_refuses_decode(one_rank_group):
    batch = whole_batch()
    with torch.no_grad():
        expected = static_model()(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        model = ulysses_model(static_model())
        out = model(**shard_batch(batch["input_ids"], batch["attention_mask"]), use_cache=False).logits
        torch.testing.assert_close(out, expected, atol=ATOL, rtol=0)
        assert last_exchanges(model) == [ExchangeBytes()] * SHAPE["num_hidden_layers"]  # nothing to exchange
        with pytest.raises(ValueError, match="whole sequences"):
            model.generate(batch["input_ids"], attention_mask=batch["attention_mask"], max_new_tokens=2)
    with pytest.raises(ValueError, match="labels must be a tensor"):
        shard_batch(batch["input_ids"], labels=batch["labels"][:, 1:])
