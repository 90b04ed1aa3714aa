"""UlyssesAttention (sequence parallel on torch.distributed) against one process running the whole sequence:
outputs and q/k/v gradients on 2 and 4 gloo processes on CPU (loopback only), the exchanged bytes against the
formula, and the argument errors (in-process, with a fake or a one-rank group)."""

from __future__ import annotations

import os
import re
import socket
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from flexsparse import ESA, Causal, HybridAttention, Positions, SinkWindow, TriangleMix, XAttention
from flexsparse.distributed import UlyssesAttention, shard_sequence
from tests.conftest import LOOPBACK

pytestmark = pytest.mark.filterwarnings("ignore:.*flex_attention called without torch.compile.*")

B, H, H_KV, D, S = 2, 8, 4, 16, 32
ATOL = 1e-5


def layer() -> HybridAttention:
    patterns = {"full": Causal(), "ssa": SinkWindow(4, 16), "esa": ESA(1, 4, 8, H), "tri": TriangleMix(2, 6, 4)}
    return HybridAttention(H, H_KV, D, patterns, ["full", "ssa", "esa", "tri"], block_size=8, backend="dense")


def padding_mask() -> torch.Tensor:
    """Row 0 left-padded by 5 tokens, row 1 right-padded by 7: both cross shard boundaries at P = 2 and 4."""
    mask = torch.ones(B, S, dtype=torch.bool)
    mask[0, :5] = False
    mask[1, -7:] = False
    return mask


def exchange_bytes(world: int, element_size: int = 4) -> tuple[int, int]:
    """(q/k/v in, output back) bytes one rank sends to the others: of its S/P tokens, the (P-1)/P of the heads
    that other ranks run."""
    tokens = B * S // world
    return (tokens * (H + 2 * H_KV) * D * element_size * (world - 1) // world,
            tokens * H * D * element_size * (world - 1) // world)


def check_against_whole(sp: UlyssesAttention, modes=None, mask_given=None, **kwargs) -> None:
    """The rank's output shard and q/k/v gradient shards equal the slices of the single-process run (on the
    whole sequence, same seed on every rank). ``mask_given``: "whole" or "shard" padding mask; kwargs go to both
    calls."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(B, H, S, D, generator=gen)
    k, v = (torch.randn(B, H_KV, S, D, generator=gen) for _ in range(2))
    weight = torch.randn(B, H, S, D, generator=gen)
    mask = None if mask_given is None else padding_mask()
    whole = [t.clone().requires_grad_() for t in (q, k, v)]
    expected = sp.attn(*whole, modes, key_padding_mask=mask, **kwargs)
    shards = [shard_sequence(t).clone().requires_grad_() for t in (q, k, v)]
    given = shard_sequence(mask, dim=1) if mask_given == "shard" else mask
    out = sp(*shards, modes, key_padding_mask=given, **kwargs)
    torch.testing.assert_close(out, shard_sequence(expected), atol=ATOL, rtol=0)
    (expected * weight).sum().backward()
    (out * shard_sequence(weight)).sum().backward()
    for name, shard, full in zip("qkv", shards, whole):
        assert full.grad.abs().sum() > 0, f"{name}: the reference gradient is zero (the test would be vacuous)"
        torch.testing.assert_close(shard.grad, shard_sequence(full.grad), atol=ATOL, rtol=0,
                                   msg=lambda m, name=name: f"gradient of {name}: {m}")


def checks(rank: int, world: int) -> None:
    """Everything one rank runs inside one process group."""
    sp = UlyssesAttention(layer())
    qkv_bytes, out_bytes = exchange_bytes(world)

    check_against_whole(sp)  # default modes: every pattern (full, sink+window, ESA, TriangleMix) on some head
    assert (sp.last_exchange.qkv, sp.last_exchange.out) == (qkv_bytes, out_bytes)
    assert (sp.last_exchange.grad_qkv, sp.last_exchange.grad_out) == (qkv_bytes, out_bytes)
    assert sp.last_exchange.forward == sp.last_exchange.backward == qkv_bytes + out_bytes
    assert sp.last_exchange.padding_mask == 0

    per_input = torch.tensor([[1, 2, 0, 3], [3, 0, 2, 1]])  # a router's [B, H_kv] decision
    check_against_whole(sp, per_input, mask_given="whole")
    assert sp.last_exchange.padding_mask == 0
    check_against_whole(sp, per_input[1], mask_given="shard")  # [H_kv]; the mask shards all-gathered
    assert sp.last_exchange.padding_mask == B * S // world * (world - 1)
    check_against_whole(sp, "tri", positions=Positions.from_padding_mask(padding_mask(), S))
    # XA resolved on each rank's heads with their own per-head thresholds (one KV head per rank at P = 4)
    thresholds = [0.3, 0.95, 0.5, 0.8, 0.6, 0.4, 0.9, 0.7]
    xa = HybridAttention(H, H_KV, D, {"full": Causal(), "xa": XAttention(thresholds, stride=4, block_size=16)},
                         ["xa", "full", "xa", "xa"], block_size=8, backend="dense")
    check_against_whole(UlyssesAttention(xa))
    check_against_whole(UlyssesAttention(xa), mask_given="whole")

    with pytest.raises(ValueError, match="not divisible by the group size"):
        shard_sequence(torch.zeros(B, H, S + 1, D))
    # a wrong split on the first call: every rank raises (none waits in the all-to-all)
    length = S // world + (rank == 0)
    q, k = torch.zeros(B, H, length, D), torch.zeros(B, H_KV, length, D)
    tokens = [S // world + 1] + [S // world] * (world - 1)
    with pytest.raises(ValueError, match=r"shards of different sizes \(batch \[2, 2.*tokens " + re.escape(str(tokens))):
        UlyssesAttention(layer())(q, k, k)


def run_checks(rank: int, world: int, port: int) -> None:
    torch.set_num_threads(1)  # first: no thread pool inherited through fork
    os.environ.setdefault("GLOO_SOCKET_IFNAME", LOOPBACK)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    try:
        checks(rank, world)
    finally:
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# fork: the children start with torch imported (a spawned child imports it again: seconds per process)
START = "fork" if "fork" in mp.get_all_start_methods() else "spawn"


@pytest.mark.parametrize("world", [2, 4])
def test_matches_single_process(world):
    mp.start_processes(run_checks, args=(world, free_port()), nprocs=world, start_method=START)


# ----- in-process: errors, and one rank ------------------------------------------------------------------------


class FakeGroup:
    """A process group that only tells its size: enough for the checks made before any communication."""

    def __init__(self, size: int) -> None:
        self._size = size

    def size(self) -> int:
        return self._size


@pytest.mark.parametrize("heads, kv_heads, world, named", [
    (8, 2, 4, "num_kv_heads=2 not"),
    (6, 3, 2, "num_kv_heads=3 not"),
    (6, 6, 4, "num_heads=6 and num_kv_heads=6 not"),
])
def test_heads_not_divisible_by_group_size(heads, kv_heads, world, named):
    attn = HybridAttention(heads, kv_heads, D, Causal(), backend="dense")
    with pytest.raises(ValueError, match=f"{world} ranks.*{named} divisible by {world}"):
        UlyssesAttention(attn, FakeGroup(world))
    UlyssesAttention(attn, FakeGroup(1))


def test_needs_a_layer_and_a_process_group():
    with pytest.raises(TypeError, match="HybridAttention"):
        UlyssesAttention(torch.nn.Identity(), FakeGroup(2))
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="init_process_group"):
        UlyssesAttention(layer())


def test_one_rank_is_the_layer(one_rank_group):
    sp = UlyssesAttention(layer())
    check_against_whole(sp, torch.tensor([0, 1, 2, 3]), mask_given="whole")
    assert sp.last_exchange.forward == sp.last_exchange.backward == 0
    assert shard_sequence(torch.zeros(B, H, S + 1, D)).shape[2] == S + 1


def test_shard_errors(one_rank_group):
    sp = UlyssesAttention(layer())
    q, k = torch.zeros(B, H, S, D), torch.zeros(B, H_KV, S, D)
    with pytest.raises(ValueError, match=r"k must be this rank's sequence shard \[B, 4, S/P, d\]"):
        sp(q, q, q)
    with pytest.raises(ValueError, match="same tokens"):
        sp(q, k[:, :, 1:], k[:, :, 1:])
    with pytest.raises(TypeError, match="v has dtype torch.float64"):
        sp(q, k, k.double())
    with pytest.raises(ValueError, match=r"key_padding_mask must be the whole sequence's \[B, S\] = \[2, 32\]"):
        sp(q, k, k, key_padding_mask=torch.ones(B, S - 1, dtype=torch.bool))
    with pytest.raises(TypeError, match="key_padding_mask must be bool"):
        sp(q, k, k, key_padding_mask=torch.ones(B, S))
    with pytest.raises(ValueError, match=r"positions must be the whole sequence's \(32 query rows"):
        sp(q, k, k, positions=Positions.contiguous(S - 1, S))
    with pytest.raises(TypeError, match="x must be a tensor"):
        shard_sequence([1, 2])
