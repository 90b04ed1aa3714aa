"""Sequence-parallel attention in the DeepSpeed-Ulysses style, on torch.distributed.

Each of the P ranks of a process group holds S/P consecutive tokens of q, k and v for every head. One all-to-all
turns these sequence shards into head shards (every rank: the whole sequence for H/P query heads and their
H_kv/P KV heads), the unchanged :class:`~flexsparse.HybridAttention` runs that rank's heads (its ``kv_heads=``
argument, which also splits default and per-call modes), and one all-to-all turns the output back into sequence
shards. Both exchanges are autograd functions whose backward is the reverse exchange, so outputs and gradients of
the shards equal those of one process running the whole sequence.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn

from flexsparse.attention import HybridAttention
from flexsparse.masks.geometry import Positions

HEAD_DIM, SEQ_DIM = 1, 2  # of q, k, v and the output [B, heads, S, d]

HeadsCall = Callable[[Tensor, Tensor, Tensor, tuple[int, ...]], Tensor]
"""``attend(q, k, v, kv_heads) -> out`` on one rank's heads over the whole sequence
(:meth:`UlyssesAttention.on_heads`)."""


@dataclass
class ExchangeBytes:
    """Bytes this rank sent to the other ranks in one call, per exchange (its own chunk stays local).

    With batch B, whole sequence S, H query and H_kv KV heads, head_dim d, element size e bytes and P ranks, per
    layer and rank: ``qkv = B*S*(H + 2*H_kv)*d*e*(P-1)/P**2`` and ``out = B*S*H*d*e*(P-1)/P**2``. Summed over the
    ranks a forward moves ``2*B*S*(H + H_kv)*d*e*(P-1)/P``. A backward exchange runs only where autograd needs
    it: ``grad_out = out`` when the output needs a gradient, ``grad_qkv = qkv`` when any of q, k, v does (all
    three gradients are exchanged then), else 0 -- e.g. ``grad_qkv = 0`` in the first layer of a frozen model
    whose routers train (its q/k/v come from frozen weights; only its output, through the routing weights, needs
    a gradient), and both 0 without a backward. The backward fills the counts of the call it belongs to (a later
    call's :attr:`UlyssesAttention.last_exchange` is a new object). ``padding_mask``: bytes of this rank's mask
    shard that the others receive when the mask is given as a shard (``B*S/P*(P-1)``, one byte a token), else 0.
    """

    qkv: int = 0
    out: int = 0
    grad_out: int = 0
    grad_qkv: int = 0
    padding_mask: int = 0

    @property
    def forward(self) -> int:
        """The all-to-all bytes of the forward (q/k/v in, output back)."""
        return self.qkv + self.out

    @property
    def backward(self) -> int:
        """The all-to-all bytes of the backward (0 until it has run)."""
        return self.grad_out + self.grad_qkv


def _all_to_all(tensors: tuple[Tensor, ...], group: dist.ProcessGroup | None, world: int, scatter_dim: int,
                gather_dim: int) -> tuple[tuple[Tensor, ...], int]:
    """Split each tensor along ``scatter_dim`` into ``world`` chunks, send chunk j to rank j, and concatenate the
    chunks received along ``gather_dim`` in rank order. All tensors go in one collective (one buffer
    ``[world, total]``, one copy in and one out). Returns the results and the bytes sent to other ranks."""
    shapes = []
    for t in tensors:
        shape = list(t.shape)
        shape[scatter_dim] //= world
        shapes.append(shape)
    sizes = [math.prod(shape) for shape in shapes]
    send = tensors[0].new_empty(world, sum(sizes))
    offset = 0
    for t, shape, size in zip(tensors, shapes, sizes):
        chunks = t.unflatten(scatter_dim, (world, -1)).movedim(scatter_dim, 0)  # [world, *shape]
        send[:, offset:offset + size].view(world, *shape).copy_(chunks)
        offset += size
    received = torch.empty_like(send)
    dist.all_to_all_single(received, send, group=group)
    results, offset = [], 0
    for shape, size in zip(shapes, sizes):
        chunks = received[:, offset:offset + size].view(world, *shape)
        results.append(chunks.movedim(0, gather_dim).flatten(gather_dim, gather_dim + 1))
        offset += size
    return tuple(results), send.numel() * send.element_size() * (world - 1) // world


class _Exchange(torch.autograd.Function):
    """:func:`_all_to_all` with autograd: the backward exchanges the gradients with the two dimensions swapped.
    ``on_forward`` / ``on_backward`` receive the bytes each direction sent."""

    @staticmethod
    def forward(ctx, group: dist.ProcessGroup | None, world: int, scatter_dim: int, gather_dim: int,
                on_forward: Callable[[int], None], on_backward: Callable[[int], None], *tensors: Tensor):
        ctx.args = (group, world, scatter_dim, gather_dim, on_backward)
        results, sent = _all_to_all(tensors, group, world, scatter_dim, gather_dim)
        on_forward(sent)
        return results

    @staticmethod
    def backward(ctx, *grads: Tensor):
        group, world, scatter_dim, gather_dim, on_backward = ctx.args
        results, sent = _all_to_all(grads, group, world, gather_dim, scatter_dim)
        on_backward(sent)
        return (None,) * 6 + results


def _recorder(stats: ExchangeBytes, name: str) -> Callable[[int], None]:
    return lambda sent: setattr(stats, name, sent)


def shard_sequence(x: Tensor, group: dist.ProcessGroup | None = None, dim: int = SEQ_DIM) -> Tensor:
    """This rank's S/P consecutive tokens of ``x`` along ``dim`` (a view): dim 2 for q/k/v ``[B, heads, S, d]``,
    dim 1 for a padding mask ``[B, S]``. Raises a ValueError when S is not divisible by the group size."""
    if not isinstance(x, Tensor):
        raise TypeError(f"x must be a tensor, got {type(x).__name__}")
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    length = x.shape[dim]
    if length % world:
        raise ValueError(f"sequence length {length} (dim {dim}) is not divisible by the group size {world}: pad "
                         f"the batch to a multiple of {world} tokens and mark the padding in key_padding_mask")
    shard = length // world
    return x.narrow(dim, rank * shard, shard)


class UlyssesAttention(nn.Module):
    """A :class:`~flexsparse.HybridAttention` over a sequence sharded across the ranks of a process group.

    Args:
        attn: the layer; it runs unchanged on each rank's heads (any backend; on CPU, training needs "dense" or
            "auto", as without sequence parallelism).
        group: the process group whose P ranks hold the sequence shards (the default group if None; it must be
            initialised). ``num_heads`` and ``num_kv_heads`` must both be divisible by P.

    ``forward(q, k, v, modes=None, *, key_padding_mask=None, positions=None, scale=None)`` takes this rank's
    shard: q ``[B, H, S/P, d]`` and k/v ``[B, H_kv, S/P, d]``, rank r holding tokens ``r*S/P`` to
    ``(r+1)*S/P - 1`` (:func:`shard_sequence`), and returns its output shard ``[B, H, S/P, d]``. Self-attention
    over the whole sequence (prefill, training): queries and keys are the same tokens. ``modes`` (default, one
    name/index, or a tensor ``[H_kv]`` / ``[B, H_kv]``) describes every KV head of the layer and must be the same
    on every rank. ``key_padding_mask`` (bool ``[B, S]``, True = real token): the whole sequence's mask,
    identical on every rank (no communication), or this rank's shard ``[B, S/P]``, which is all-gathered (bytes
    in ``last_exchange.padding_mask``). ``positions`` are the whole sequence's (S query rows), identical on every
    rank. ``last_exchange`` (:class:`ExchangeBytes`) counts the bytes of the last call; ``attn.last_stats``
    describes this rank's heads only.

    Every rank must hold as many tokens (the all-to-all has one chunk size). The first call checks that with one
    small all-gather, so that a wrong split raises a ValueError on every rank instead of hanging the all-to-all;
    later calls trust the shapes (a check per call would be a host sync per layer on GPUs). Checked on every call
    without communication: a whole ``key_padding_mask`` or ``positions`` covers P shards.
    """

    def __init__(self, attn: HybridAttention, group: dist.ProcessGroup | None = None) -> None:
        super().__init__()
        if not isinstance(attn, HybridAttention):
            raise TypeError(f"attn must be a flexsparse.HybridAttention, got {type(attn).__name__}")
        if group is None and not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("UlyssesAttention needs a process group: call torch.distributed.init_process_group "
                               "first or pass group=")
        world = dist.get_world_size(group)
        uneven = [f"{name}={count}" for name, count in (("num_heads", attn.num_heads),
                                                         ("num_kv_heads", attn.num_kv_heads)) if count % world]
        if uneven:
            raise ValueError(f"Ulysses gives each of the group's {world} ranks an equal share of the heads: "
                             f"{' and '.join(uneven)} not divisible by {world}")
        self.attn, self.group, self.world_size = attn, group, world
        self.last_exchange = ExchangeBytes()
        self._shards_checked = world == 1

    def forward(self, q: Tensor, k: Tensor, v: Tensor, modes: Tensor | int | str | None = None, *,
                key_padding_mask: Tensor | None = None, positions: Positions | None = None,
                scale: float | None = None) -> Tensor:
        self._begin(q, k, v)
        mask = self._whole_mask(key_padding_mask, q, self.last_exchange)

        def attend(q: Tensor, k: Tensor, v: Tensor, kv_heads: tuple[int, ...]) -> Tensor:
            return self.attn(q, k, v, modes, key_padding_mask=mask, positions=positions, scale=scale,
                             kv_heads=kv_heads)

        return self._exchanged(q, k, v, attend, positions)

    def on_heads(self, q: Tensor, k: Tensor, v: Tensor, attend: HeadsCall, *,
                 positions: Positions | None = None) -> Tensor:
        """Like :meth:`forward`, with ``attend(q, k, v, kv_heads)`` run on this rank's heads instead of the layer:
        q ``[B, H/P, S, d]``, k/v ``[B, H_kv/P, S, d]`` (the whole sequence), ``kv_heads`` the layer's indices of
        those KV heads (ascending), returning ``[B, H/P, S, d]``. For several layer calls per exchange, e.g. the
        full and sparse outputs a router's training mixes. ``positions``: only checked (whole sequence)."""
        self._begin(q, k, v)
        return self._exchanged(q, k, v, attend, positions)

    def _begin(self, q: Tensor, k: Tensor, v: Tensor) -> None:
        self._check_shards(q, k, v)
        if not self._shards_checked:
            self._check_same_shape_on_every_rank(q)
        self.last_exchange = ExchangeBytes()

    def _exchanged(self, q: Tensor, k: Tensor, v: Tensor, attend: HeadsCall, positions: Positions | None) -> Tensor:
        self._check_positions(positions, q)
        world, stats = self.world_size, self.last_exchange
        if world == 1:
            return attend(q, k, v, tuple(range(self.attn.num_kv_heads)))
        q, k, v = _Exchange.apply(self.group, world, HEAD_DIM, SEQ_DIM, _recorder(stats, "qkv"),
                                  _recorder(stats, "grad_qkv"), q, k, v)
        share = self.attn.num_kv_heads // world
        rank = dist.get_rank(self.group)
        out = attend(q, k, v, tuple(range(rank * share, (rank + 1) * share)))
        (out,) = _Exchange.apply(self.group, world, SEQ_DIM, HEAD_DIM, _recorder(stats, "out"),
                                 _recorder(stats, "grad_out"), out)
        return out

    def _check_shards(self, q: Tensor, k: Tensor, v: Tensor) -> None:
        """What the exchange needs before it communicates (the layer checks the rest on the whole sequence)."""
        for name, t, heads in (("q", q, self.attn.num_heads), ("k", k, self.attn.num_kv_heads),
                               ("v", v, self.attn.num_kv_heads)):
            if not isinstance(t, Tensor):
                raise TypeError(f"{name} must be a tensor, got {type(t).__name__}")
            if t.dim() != 4 or t.shape[HEAD_DIM] != heads:
                raise ValueError(f"{name} must be this rank's sequence shard [B, {heads}, S/P, d] (every head), "
                                 f"got shape {tuple(t.shape)}")
            if t.shape[0] != q.shape[0] or t.shape[SEQ_DIM] != q.shape[SEQ_DIM] or t.shape[3] != q.shape[3]:
                raise ValueError(f"q, k and v must hold the same tokens: shapes {tuple(q.shape)}, "
                                 f"{tuple(k.shape)}, {tuple(v.shape)} differ in batch, length or head_dim")
            if t.device != q.device:
                raise ValueError(f"{name} is on {t.device} but q is on {q.device}")
            if t.dtype != q.dtype:
                raise TypeError(f"{name} has dtype {t.dtype} but q has {q.dtype}")

    def _check_positions(self, positions: Positions | None, q: Tensor) -> None:
        whole = q.shape[SEQ_DIM] * self.world_size
        if isinstance(positions, Positions) and (positions.q.shape[1], positions.kv.shape[1]) != (whole, whole):
            raise ValueError(f"positions must be the whole sequence's ({whole} query rows and key slots: P x "
                             f"{q.shape[SEQ_DIM]}), got {positions.q.shape[1]} and {positions.kv.shape[1]}")

    def _check_same_shape_on_every_rank(self, q: Tensor) -> None:
        mine = torch.tensor([q.shape[0], q.shape[SEQ_DIM]], device=q.device)
        every = [torch.empty_like(mine) for _ in range(self.world_size)]
        dist.all_gather(every, mine, group=self.group)
        batches, lengths = zip(*(t.tolist() for t in every))
        if len(set(lengths)) > 1 or len(set(batches)) > 1:
            raise ValueError(f"the ranks hold shards of different sizes (batch {list(batches)}, tokens "
                             f"{list(lengths)}): each must hold S/P tokens of the same batch; split the sequence "
                             f"with shard_sequence (S divisible by P)")
        self._shards_checked = True

    def _whole_mask(self, mask: Tensor | None, q: Tensor, stats: ExchangeBytes) -> Tensor | None:
        """The whole sequence's padding mask ``[B, S]``: as given, or all-gathered from the ranks' shards."""
        if mask is None:
            return None
        batch, shard = q.shape[0], q.shape[SEQ_DIM]
        whole = shard * self.world_size
        if not isinstance(mask, Tensor):
            raise TypeError(f"key_padding_mask must be a bool tensor [B, S], got {type(mask).__name__}")
        if mask.dtype.is_floating_point or mask.dtype.is_complex:
            raise TypeError(f"key_padding_mask must be bool (True = real token), got {mask.dtype}")
        if mask.device != q.device:
            raise ValueError(f"key_padding_mask is on {mask.device} but q is on {q.device}")
        if mask.dim() != 2 or mask.shape[0] != batch or mask.shape[1] not in (whole, shard):
            raise ValueError(f"key_padding_mask must be the whole sequence's [B, S] = [{batch}, {whole}] or this "
                             f"rank's shard [B, S/P] = [{batch}, {shard}], got {tuple(mask.shape)}")
        if mask.shape[1] == whole:
            return mask
        mine = (mask != 0).to(torch.uint8).contiguous()  # gloo has no bool
        every = [torch.empty_like(mine) for _ in range(self.world_size)]
        dist.all_gather(every, mine, group=self.group)
        stats.padding_mask = mine.numel() * (self.world_size - 1)
        return torch.cat(every, dim=1).bool()

    def extra_repr(self) -> str:
        return f"world_size={self.world_size}"
