"""Static, gradient-free mode selection from calibration tensors: which KV heads (or layers) stay full.

Three scores, one ranking rule:

* :func:`hsa_discrepancy` (HSA, seed 001, Eq. 4 and Algorithm 1): per KV head, the norm of the change in the
  layer's output ``O_h W_O^h`` when that head runs sliding-window (here: any sparse pattern) instead of full
  attention. Replacing one head changes only its own output, so the loop of Algorithm 1 is two HybridAttention
  calls (every head full, every head sparse) and one quadratic form per head with the Gram matrix
  ``W_O^h^T W_O^h`` (never the ``[B, S, H_kv, D]`` projections). The norm is the Frobenius norm over every token
  of the calibration batch.
* :func:`retrieval_scores` (Elastic Attention, seed 000, Appendix B.1, Eq. 9): per head, the attention mass the
  last real token puts on the needle tokens, averaged over the calibration sequences; a KV head scores the mean of
  its query heads.
* :func:`layer_entropy` (Flux Attention, seed 003, Appendix C.1): the von Neumann entropy of a layer's
  trace-normalised Gram matrix ``X^T X / tr(X^T X)`` over its top-K eigenvalues, averaged over sequences (the
  paper's formula: uncentred).

:func:`select_modes` keeps the highest-scoring units full: ``floor((1 - rho) * N)`` of them (Elastic's Appendix
B.2 and Flux's C.2 rule; HSA's ``rho * H`` sparse heads when that is an integer), per layer (HSA) or over the whole
model (the appendices), at least ``min_full_per_layer`` per layer, optionally the first and last layers all full.
Ties go to the lower (layer, head) index; every function is deterministic. The result is one list of per-KV-head
mode names (or indices) per layer, the form the transformers drop-in takes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from flexsparse.attention import HybridAttention
from flexsparse.heads import per_query_head
from flexsparse.masks.base import Pattern
from flexsparse.masks.window import Causal
from flexsparse.validation import as_float, as_int

Mode = str | int


# ----- scores ---------------------------------------------------------------------------------------------------


def _check_qkv(q: Tensor, k: Tensor, v: Tensor | None) -> None:
    named = [("q", q), ("k", k)] + ([("v", v)] if v is not None else [])
    for name, t in named:
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D [B, heads, S, d], got shape {tuple(t.shape)}")
    for name, t in named[1:]:
        if t.shape[0] != q.shape[0] or t.shape[-1] != q.shape[-1]:
            raise ValueError(f"{name} has shape {tuple(t.shape)}, q has {tuple(q.shape)} (batch and d must agree)")
        if q.shape[1] % t.shape[1]:
            raise ValueError(f"q's {q.shape[1]} heads must be a multiple of {name}'s {t.shape[1]} KV heads")


@torch.no_grad()
def hsa_discrepancy(q: Tensor, k: Tensor, v: Tensor, o_proj_weight: Tensor, sparse: Pattern, *,
                    full: Pattern | None = None, key_padding_mask: Tensor | None = None, backend: str = "auto",
                    block_size: int = 128, max_dense_len: int = 8192) -> Tensor:
    """HSA's discrepancy per KV head, float32 ``[H_kv]``.

    Args:
        q: ``[B, H, S, d]``, k/v ``[B, H_kv, S, d]``: one layer's calibration queries, keys (after RoPE) and values.
        o_proj_weight: the layer's output projection weight ``[D, H * d]`` (``nn.Linear`` layout).
        sparse: the pattern a sparsified head would run (HSA: ``SinkWindow``).
        full: the pattern it runs now (default causal).
        key_padding_mask: ``[B, S]``, True = real token (padding rows contribute nothing).
        backend, block_size, max_dense_len: for the two HybridAttention calls (flex on GPU; "dense" at small
            sizes on CPU).
    """
    _check_qkv(q, k, v)
    batch, heads, seq, dim = q.shape
    kv_heads = k.shape[1]
    if not isinstance(o_proj_weight, Tensor) or o_proj_weight.dim() != 2 or o_proj_weight.shape[1] != heads * dim:
        shape = tuple(o_proj_weight.shape) if isinstance(o_proj_weight, Tensor) else type(o_proj_weight).__name__
        raise ValueError(f"o_proj_weight must be [D, H * d] = [D, {heads * dim}], got {shape}")
    attn = HybridAttention(heads, kv_heads, dim, {"full": Causal() if full is None else full, "sparse": sparse}, backend=backend,
                           block_size=block_size, max_dense_len=max_dense_len)
    modes = torch.zeros(batch, kv_heads, dtype=torch.long, device=q.device)
    out_full = attn(q, k, v, modes=modes, key_padding_mask=key_padding_mask)
    out_sparse = attn(q, k, v, modes=modes + 1, key_padding_mask=key_padding_mask)
    group = heads // kv_heads
    diff = (out_full.float() - out_sparse.float()).permute(0, 2, 1, 3)  # [B, S, H, d]
    diff = diff.reshape(batch, seq, kv_heads, group * dim)
    w = o_proj_weight.to(device=q.device, dtype=torch.float32).reshape(-1, kv_heads, group * dim)
    gram = torch.einsum("ohk,ohl->hkl", w, w)  # W_O^h^T W_O^h, [H_kv, G d, G d]
    squared = (torch.einsum("bshk,hkl->bshl", diff, gram) * diff).sum(dim=(0, 1, 3))
    return squared.clamp(min=0).sqrt()


@torch.no_grad()
def retrieval_scores(q: Tensor, k: Tensor, needle_mask: Tensor, *, key_padding_mask: Tensor | None = None,
                     scale: float | None = None) -> Tensor:
    """Elastic's retrieval score per KV head, float32 ``[H_kv]``: the attention weight from each sequence's last
    real token to its needle tokens, summed over the needle, averaged over sequences and over each KV head's query
    heads.

    ``q`` ``[B, H, S, d]`` and ``k`` ``[B, H_kv, S, d]`` as the layer's attention uses them (after RoPE);
    ``needle_mask`` bool ``[B, S]`` (True at needle tokens); ``key_padding_mask`` ``[B, S]`` (True = real).
    Only the last query row is computed: O(S) per head.
    """
    _check_qkv(q, k, None)
    batch, heads, seq, dim = q.shape
    kv_heads = k.shape[1]
    for name, mask in (("needle_mask", needle_mask), ("key_padding_mask", key_padding_mask)):
        if mask is not None and (not isinstance(mask, Tensor) or mask.dtype != torch.bool
                                 or tuple(mask.shape) != (batch, seq)):
            shape = tuple(mask.shape) if isinstance(mask, Tensor) else type(mask).__name__
            raise ValueError(f"{name} must be a bool tensor [B, S] = [{batch}, {seq}], got {shape}")
    real = torch.ones(batch, seq, dtype=torch.bool, device=q.device) if key_padding_mask is None else key_padding_mask
    last = torch.where(real, torch.arange(seq, device=q.device), -1).amax(1)  # [B]
    if bool((last < 0).any()):
        raise ValueError("key_padding_mask has a sequence without real tokens")
    scale = dim**-0.5 if scale is None else as_float("scale", scale, positive=True)
    query = q[torch.arange(batch, device=q.device), :, last].float()  # [B, H, d]
    keys = per_query_head(k.float(), heads // kv_heads, dim=1)  # [B, H, S, d]
    scores = torch.einsum("bhd,bhsd->bhs", query, keys) * scale
    visible = real & (torch.arange(seq, device=q.device) <= last[:, None])
    weights = scores.masked_fill(~visible[:, None], float("-inf")).softmax(-1)
    per_head = (weights * needle_mask[:, None].float()).sum(-1).mean(0)  # [H]
    return per_head.view(kv_heads, -1).mean(-1)


@torch.no_grad()
def layer_entropy(hidden_states: Tensor, *, key_padding_mask: Tensor | None = None,
                  top_k: int | None = None) -> Tensor:
    """Flux's layer entropy, a float64 0-d tensor: ``-sum_{i <= K} l_i log l_i`` over the K largest eigenvalues
    ``l`` of ``X^T X / tr(X^T X)`` per sequence (padding rows dropped), averaged over sequences.

    ``hidden_states`` ``[B, S, D]`` (or ``[S, D]``) of one layer; ``top_k`` K (None: every eigenvalue). The
    eigenvalues come from the smaller of the ``D x D`` and ``S x S`` Gram matrices (the same nonzero spectrum).
    """
    if not isinstance(hidden_states, Tensor) or hidden_states.dim() not in (2, 3):
        shape = tuple(hidden_states.shape) if isinstance(hidden_states, Tensor) else type(hidden_states).__name__
        raise ValueError(f"hidden_states must be [B, S, D] or [S, D], got {shape}")
    x = hidden_states if hidden_states.dim() == 3 else hidden_states[None]
    x = x.double()
    if key_padding_mask is not None:
        if not isinstance(key_padding_mask, Tensor) or key_padding_mask.dtype != torch.bool \
                or tuple(key_padding_mask.shape) != tuple(x.shape[:2]):
            raise ValueError(f"key_padding_mask must be a bool tensor [B, S] = {list(x.shape[:2])}")
        x = x * key_padding_mask[..., None]
    if top_k is not None:
        top_k = as_int("top_k", top_k, minimum=1)
    gram = x.transpose(1, 2) @ x if x.shape[2] <= x.shape[1] else x @ x.transpose(1, 2)
    trace = gram.diagonal(dim1=1, dim2=2).sum(-1, keepdim=True)  # [B, 1]
    if bool((trace <= 0).any()):
        raise ValueError("hidden_states has a sequence whose real rows are all zero (or no real rows)")
    eig = torch.linalg.eigvalsh(gram).flip(-1).clamp(min=0) / trace  # descending, sums to 1
    if top_k is not None:
        eig = eig[:, :top_k]
    terms = torch.where(eig > 0, -eig * torch.log(eig.clamp(min=torch.finfo(eig.dtype).tiny)), 0.0)
    return terms.sum(-1).mean()


# ----- selection ------------------------------------------------------------------------------------------------


def _scores_matrix(scores: Tensor | Sequence) -> list[list[float]]:
    if isinstance(scores, Tensor):
        table = scores.detach().double().cpu()
        if table.dim() == 1:
            table = table[:, None]
        if table.dim() != 2 or table.numel() == 0:
            raise ValueError(f"scores must be [L, U] (or [L]) with L, U >= 1, got shape {tuple(scores.shape)}")
        rows = table.tolist()
    elif isinstance(scores, Sequence) and scores:
        rows = [torch.as_tensor(row).detach().double().cpu().reshape(-1).tolist() for row in scores]
    else:
        raise TypeError("scores must be a tensor [L, U] or a non-empty sequence of per-layer scores")
    if len({len(row) for row in rows}) != 1 or not rows[0]:
        raise ValueError(f"scores must give every layer the same number (>= 1) of units, got "
                         f"{[len(r) for r in rows]}")
    if any(math.isnan(s) for row in rows for s in row):
        raise ValueError("scores must not contain NaN")
    return rows


def _check_mode(name: str, mode: object) -> Mode:
    if isinstance(mode, str) and mode:
        return mode
    return as_int(name, mode, minimum=0)


def _balanced_keep(rows: list[list[float]], quota: int | None, per_layer_full: int, forced: set[int],
                   tp_size: int) -> set[tuple[int, int]]:
    """The full (layer, head) pairs with the same number on every tensor-parallel rank in each layer (rank r: the
    r-th contiguous block of heads), each rank's best-scoring heads first: per layer ``ceil(per_layer_full / P)``
    per rank, then (``quota``: a model-wide count of full heads, None per layer) whole stripes (the j-th best head
    of every rank of a layer, ranked by their summed scores) until at least ``quota`` heads are full."""
    units = len(rows[0])
    share = units // tp_size
    order = [[sorted(range(r * share, (r + 1) * share), key=lambda h: (-row[h], h)) for r in range(tp_size)]
             for row in rows]  # per layer and rank, its heads best first
    depth = [share if layer in forced else -(-per_layer_full // tp_size) for layer in range(len(rows))]
    if quota is not None:
        stripes = sorted(((layer, j) for layer in range(len(rows)) for j in range(depth[layer], share)),
                         key=lambda lj: (-sum(rows[lj[0]][heads[lj[1]]] for heads in order[lj[0]]), lj))
        missing = max(0, quota - tp_size * sum(depth))
        for layer, _ in stripes[: -(-missing // tp_size)]:
            depth[layer] += 1  # stripes of a layer come best first: its sums do not increase with j
    return {(layer, heads[j]) for layer in range(len(rows)) for heads in order[layer] for j in range(depth[layer])}


def select_modes(scores: Tensor | Sequence, rho: float, *, per_layer: bool, min_full_per_layer: int = 0,
                 keep_first_last_full: bool = False, num_kv_heads: int | None = None, full: Mode = "full",
                 sparse: Mode = "sparse", tp_size: int = 1) -> list[list[Mode]]:
    """Modes per layer and KV head from importance scores (higher = keep full).

    Args:
        scores: ``[L, U]`` (or a list of L rows): U = H_kv for head scores, U = 1 (or ``[L]``) for layer scores.
        rho: target fraction of sparse units in [0, 1].
        per_layer: apply the ``floor((1 - rho) * U)`` full quota in each layer (HSA), else
            ``floor((1 - rho) * L * U)`` over the whole model (Elastic B.2, Flux C.2).
        min_full_per_layer: full units every layer keeps whatever the quota (HSA: 1).
        keep_first_last_full: layers 0 and L - 1 all full (their units count towards a model-wide quota).
        num_kv_heads: expands layer scores (U = 1) to this many KV heads; for head scores it must equal U.
        full, sparse: the mode names (or pattern indices) to emit.
        tp_size: tensor-parallel ranks P (transformers' ``tp_plan``: rank r holds the r-th contiguous block of
            ``H_kv / P`` KV heads). Above 1, every layer keeps the same number of full heads on every rank, each
            rank its best-scoring ones: per layer the full count rounded up to a multiple of P (``per_layer``),
            or model-wide whole stripes of P heads (the j-th best of every rank of a layer) by their summed
            scores until the quota is met. Layer scores (U = 1) are balanced as they are.

    Constraints win over the quota: the result may be less sparse than ``rho``, never sparser.
    """
    rows = _scores_matrix(scores)
    rho = as_float("rho", rho, minimum=0.0, maximum=1.0)
    full, sparse = _check_mode("full", full), _check_mode("sparse", sparse)
    if full == sparse:
        raise ValueError(f"full and sparse must differ, both are {full!r}")
    layers, units = len(rows), len(rows[0])
    min_full = as_int("min_full_per_layer", min_full_per_layer, minimum=0, maximum=units)
    width = units
    if num_kv_heads is not None:
        width = as_int("num_kv_heads", num_kv_heads, minimum=1)
        if units not in (1, width):
            raise ValueError(f"num_kv_heads ({width}) must equal the {units} units per layer of scores")
    tp_size = as_int("tp_size", tp_size, minimum=1)
    if width % tp_size:
        raise ValueError(f"{width} KV heads per layer are not divisible by tp_size={tp_size}: tensor parallelism "
                         "gives every rank a whole block of KV heads")
    forced = {0, layers - 1} if keep_first_last_full else set()
    quota = lambda n: math.floor((1.0 - rho) * n + 1e-9)
    if tp_size > 1 and units > 1:
        keep = _balanced_keep(rows, None if per_layer else quota(layers * units),
                              max(min_full, quota(units)) if per_layer else min_full, forced, tp_size)
        return [[full if (layer, h) in keep else sparse for h in range(width)] for layer in range(layers)]
    rank = lambda items: sorted(items, key=lambda lu: (-rows[lu[0]][lu[1]], lu))
    keep: set[tuple[int, int]] = {(layer, u) for layer in forced for u in range(units)}
    for layer in range(layers):
        if layer in forced:
            continue
        ranked = rank((layer, u) for u in range(units))
        keep.update(ranked[: max(min_full, quota(units)) if per_layer else min_full])
    if not per_layer:
        remaining = rank((layer, u) for layer in range(layers) for u in range(units) if (layer, u) not in keep)
        keep.update(remaining[: max(0, quota(layers * units) - len(keep))])
    return [[full if (layer, 0 if units == 1 else h) in keep else sparse for h in range(width)]
            for layer in range(layers)]


def hsa_selection(discrepancy: Tensor | Sequence, rho: float, *, keep_first_last_full: bool = False,
                  full: Mode = "full", sparse: Mode = "sparse", tp_size: int = 1) -> list[list[Mode]]:
    """HSA's Algorithm 1 per layer: the ``floor((1 - rho) * H_kv)`` KV heads with the largest discrepancy stay
    full, at least one per layer. ``discrepancy`` ``[L, H_kv]`` (rows of :func:`hsa_discrepancy`); ``tp_size``:
    as in :func:`select_modes`."""
    return select_modes(discrepancy, rho, per_layer=True, min_full_per_layer=1,
                        keep_first_last_full=keep_first_last_full, full=full, sparse=sparse, tp_size=tp_size)


def retrieval_selection(scores: Tensor | Sequence, rho: float, *, min_full_per_layer: int = 0,
                        keep_first_last_full: bool = False, full: Mode = "full",
                        sparse: Mode = "sparse", tp_size: int = 1) -> list[list[Mode]]:
    """Elastic's Appendix B.2: the ``floor((1 - rho) * L * H_kv)`` heads with the highest retrieval scores over
    the whole model stay full. ``scores`` ``[L, H_kv]`` (rows of :func:`retrieval_scores`); ``tp_size``: as in
    :func:`select_modes`."""
    return select_modes(scores, rho, per_layer=False, min_full_per_layer=min_full_per_layer,
                        keep_first_last_full=keep_first_last_full, full=full, sparse=sparse, tp_size=tp_size)


def entropy_selection(entropies: Tensor | Sequence, rho: float, num_kv_heads: int, *,
                      keep_first_last_full: bool = False, full: Mode = "full",
                      sparse: Mode = "sparse", tp_size: int = 1) -> list[list[Mode]]:
    """Flux's Appendix C.2: the ``floor((1 - rho) * L)`` layers with the highest entropy stay full, every KV head
    of a layer in its layer's mode (balanced across tensor-parallel ranks as it is; ``tp_size`` checks that
    ``num_kv_heads`` divides among them). ``entropies`` ``[L]`` (values of :func:`layer_entropy`)."""
    if isinstance(entropies, Sequence) and not isinstance(entropies, Tensor):
        entropies = torch.as_tensor([float(e) for e in entropies])
    if not isinstance(entropies, Tensor) or entropies.dim() != 1:
        raise ValueError("entropies must be one value per layer, [L]")
    return select_modes(entropies, rho, per_layer=False, keep_first_last_full=keep_first_last_full,
                        num_kv_heads=num_kv_heads, full=full, sparse=sparse, tp_size=tp_size)
