"""XAttention calibrated on a real model to keep a target share of the *true* attention mass.

XAttention keeps, per query block, key blocks until ``threshold`` of its *estimated* (antidiagonal) mass. The
estimate can be far off: on SmolLM2-135M at 8K tokens a threshold of 0.9 keeps only 0.70-0.72 of the exact
softmax mass per query in some layers. This module measures the true kept mass and calibrates the thresholds:

* :func:`true_block_mass`: the exact softmax mass of each query in each key block ``[B, H, S_q, KB]``,
  computed per KV head and chunk of queries (no ``[H, S, S]`` float32 tensor at once);
* :func:`kept_fraction` / :func:`kept_mass`: per query, the share of its mass inside a block table's kept
  blocks;
* :func:`capture_qk`: runs a transformers model with a registered attention function that hands each layer's
  query (after RoPE), keys and scaling to a callback, then runs the model's own SDPA attention;
* :func:`calibrate_xa`: per (layer, query head), the lowest estimator threshold whose selection keeps at least
  ``target`` of the true mass on at least ``quantile`` of the query rows of the calibration windows
  (bisection; thresholds up to ``max_threshold``, 1.0 = every causal block where that is not enough), per
  layer at the antidiagonal stride (of ``strides``) that needs the fewest blocks. The result converts a model
  with one :class:`~flexsparse.masks.XAttention` per layer (per-head thresholds) and reports the true-mass
  statistics of the uncalibrated and the calibrated selection per layer.

Calibration text is the calibration part of a :class:`~flexsparse.eval.text.Corpus`, never the evaluated part.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from flexsparse.eval.swapped_attention import attention_swapped
from flexsparse.eval.text import Corpus
from flexsparse.integrations.transformers import attention_layers, convert, layer_heads
from flexsparse.kernels.xa_estimate import antidiagonal_block_mass
from flexsparse.masks import XAttention
from flexsparse.masks.xa_selection import select_blocks
from flexsparse.validation import as_float, as_int

CAPTURE_NAME = "flexsparse_qk_capture"
_CHUNK_BYTES = 256 << 20  # true_block_mass: float32 scores held at once (per KV head and query chunk)


# ----- the true mass ----------------------------------------------------------------------------------------

def true_block_mass(q: Tensor, k: Tensor, block_size: int, scale: float | None = None,
                    q_start: int | None = None) -> Tensor:
    """Exact causal softmax mass of each query in each key block, float32 ``[B, H_q, S_q, KB]``.

    q ``[B, H_q, S_q, d]``, k ``[B, H_kv, S_kv, d]`` (H_kv divides H_q; query head h reads key head ``h //
    (H_q / H_kv)``); query row i sits at position ``q_start + i`` (default ``S_kv - S_q``) and sees the keys
    at positions <= it; ``KB = ceil(S_kv / block_size)``; ``scale`` default ``d ** -0.5``. Each row sums to 1.
    Computed in float32, per KV head and chunk of queries (about 256 MiB of scores at a time).
    """
    if not isinstance(q, Tensor) or not isinstance(k, Tensor) or q.dim() != 4 or k.dim() != 4:
        raise TypeError("q and k must be 4-D tensors [B, heads, seq, head_dim]")
    batch, heads, q_len, dim = q.shape
    kv_heads, kv_len = k.shape[1], k.shape[2]
    if k.shape[0] != batch or k.shape[3] != dim or heads % kv_heads:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)}: batch and head_dim must match and the "
                         "KV heads must divide the query heads")
    block_size = as_int("block_size", block_size, minimum=1)
    q_start = kv_len - q_len if q_start is None else as_int("q_start", q_start, minimum=0)
    if q_start + q_len > kv_len:
        raise ValueError(f"queries end at position {q_start + q_len}, past the {kv_len} keys")
    scale = dim**-0.5 if scale is None else as_float("scale", scale, minimum=0.0)
    group = heads // kv_heads
    kv_blocks = -(-kv_len // block_size)
    out = torch.zeros(batch, heads, q_len, kv_blocks, dtype=torch.float32, device=q.device)
    rows = max(1, _CHUNK_BYTES // (batch * group * kv_len * 4))
    keys = torch.arange(kv_len, device=q.device)
    for h in range(kv_heads):
        keys_h = k[:, h].float()  # [B, S_kv, d]
        for first in range(0, q_len, rows):
            last = min(first + rows, q_len)
            seen = q_start + last  # keys the chunk's last query sees
            part = q[:, h * group:(h + 1) * group, first:last].float()  # [B, G, R, d]
            scores = torch.einsum("bgrd,bsd->bgrs", part, keys_h[:, :seen]) * scale
            hidden = keys[None, :seen] > (q_start + torch.arange(first, last, device=q.device))[:, None]
            probs = torch.softmax(scores.masked_fill(hidden, float("-inf")), dim=-1)
            blocks = -(-seen // block_size)
            probs = F.pad(probs, (0, blocks * block_size - seen))
            sums = probs.unflatten(-1, (blocks, block_size)).sum(-1)
            out[:, h * group:(h + 1) * group, first:last, :blocks] = sums
    return out


def kept_fraction(block_mass: Tensor, table: Tensor, block_size: int) -> Tensor:
    """Per query, the share of its mass in the kept blocks, float32 ``[B, H, S_q]``.

    ``block_mass`` ``[B, H, S_q, KB]`` (:func:`true_block_mass`); ``table`` bool ``[B', H', QB, KB]`` (B', H'
    1 or B, H) whose row r holds query rows ``r * block_size .. (r + 1) * block_size - 1`` (XAttention's
    tables: query blocks from query row 0, key blocks from key 0).
    """
    q_len, kv_blocks = block_mass.shape[2:]
    q_blocks = -(-q_len // block_size)
    if table.dtype != torch.bool or table.dim() != 4 or tuple(table.shape[2:]) != (q_blocks, kv_blocks):
        raise ValueError(f"table must be bool [B, H, {q_blocks}, {kv_blocks}] for block_mass "
                         f"{tuple(block_mass.shape)} at block_size {block_size}, got {table.dtype} "
                         f"{tuple(table.shape)}")
    padded = F.pad(block_mass, (0, 0, 0, q_blocks * block_size - q_len))
    kept = (padded.unflatten(2, (q_blocks, block_size)) * table[:, :, :, None, :]).sum(-1)
    return kept.flatten(2)[:, :, :q_len]


def kept_mass(q: Tensor, k: Tensor, table: Tensor, block_size: int, scale: float | None = None) -> Tensor:
    """Per query, the share of its exact softmax mass inside ``table``'s kept blocks, float32 ``[B, H_q,
    S_q]`` (queries bottom-right aligned against the keys, as :meth:`XAttention.select` gives its tables)."""
    return kept_fraction(true_block_mass(q, k, block_size, scale), table, block_size)


# ----- capturing q/k ----------------------------------------------------------------------------------------

def _capture_attention(module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask,
                       scaling: float | None = None, dropout: float = 0.0, **kwargs):
    """Hands q/k to ``module.flexsparse_qk_capture``, then runs the model's SDPA attention."""
    module.flexsparse_qk_capture(query, key, scaling)
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                  **kwargs)


@contextlib.contextmanager
def capture_qk(model: nn.Module, record: Callable[[int, Tensor, Tensor, float], None]) -> Iterator[None]:
    """Meanwhile every forward of ``model`` calls ``record(layer, q, k, scaling)`` in each attention layer,
    with q ``[B, H_q, S, d]`` after RoPE, k ``[B, H_kv, S, d]`` and the layer's softmax scaling; the model's
    outputs are unchanged (its own SDPA attention). Restores the attention implementation afterwards."""

    def hand_to_record(index: int, module: nn.Module):
        default = layer_heads(module)[2] ** -0.5
        return lambda query, key, scaling: record(index, query, key, default if scaling is None else float(scaling))

    with attention_swapped(model, CAPTURE_NAME, _capture_attention, "flexsparse_qk_capture", hand_to_record):
        yield


# ----- calibration ------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class MassStats:
    """One layer's selection, over every (window, query head, query) row: ``low``, the ``1 - quantile``
    quantile of the true kept mass; ``covered``, the share of rows keeping at least ``target``;
    ``worst_head``, the lowest per-head share; ``mean`` kept mass; ``density``, the share of causal blocks
    kept."""

    low: float
    covered: float
    worst_head: float
    mean: float
    density: float


def causal_blocks(q_len: int, kv_len: int, block_size: int, device: torch.device) -> Tensor:
    """bool ``[QB, KB]``: key blocks holding a key at or before some query of the block (bottom-right)."""
    q_start = kv_len - q_len
    last = torch.clamp(q_start + (torch.arange(-(-q_len // block_size), device=device) + 1) * block_size,
                       max=kv_len) - 1
    return torch.arange(-(-kv_len // block_size), device=device)[None, :] <= (last // block_size)[:, None]


def mass_stats(kept: Tensor, table: Tensor, causal: Tensor, target: float, quantile: float) -> MassStats:
    """:class:`MassStats` of kept shares ``[B, H, S]`` and the table ``[B, H, QB, KB]`` they come from, with
    the causal blocks ``[QB, KB]``."""
    rows = kept.transpose(0, 1).reshape(kept.shape[1], -1)  # [H, B * S]
    flat = rows.flatten()
    rank = max(1, int((1.0 - quantile) * flat.numel() + 0.5))
    low = flat.kthvalue(min(rank, flat.numel())).values
    per_head = (rows >= target).float().mean(-1)
    density = (table & causal).float().sum() / (causal.float().sum() * table.shape[0] * table.shape[1])
    covered = (flat >= target).float().mean()
    return MassStats(float(low), float(covered), float(per_head.min()), float(flat.mean()), float(density))


def covered_share(block_mass: Tensor, table: Tensor, block_size: int, target: float) -> Tensor:
    """Per head of a table ``[B, H, QB, KB]`` and true block masses ``[B, H, S, KB]``, the share of query rows
    keeping at least ``target`` of their mass ``[H]``."""
    return (kept_fraction(block_mass, table, block_size) >= target).float().mean((0, 2))


def calibrate_thresholds(block_mass: Tensor, estimate: Tensor, block_size: int, target: float,
                         quantile: float, max_threshold: float = 0.999, steps: int = 14) -> Tensor:
    """Per query head, the lowest threshold (in (0, ``max_threshold``], else 1.0) whose selection on the
    estimated masses ``estimate`` ``[B, H, QB, KB]`` keeps at least ``target`` of the true mass
    (``block_mass`` ``[B, H, S, KB]``, a prefill: queries and keys alike) on at least ``quantile`` of the
    rows; float32 ``[H]``, to ``max_threshold / 2**steps``.
    The kept set of XAttention's rules grows with the threshold, so the share covered does too: bisection."""
    heads, length = estimate.shape[1], block_mass.shape[2]
    select = lambda t: select_blocks(estimate, t, q_len=length, kv_len=length, block_size=block_size)
    ok = lambda t: covered_share(block_mass, select(t), block_size, target) >= quantile
    hi = torch.full((heads,), float(max_threshold), device=estimate.device)
    reachable = ok(hi)
    lo = torch.zeros_like(hi)
    for _ in range(steps):
        mid = (lo + hi) / 2
        good = ok(mid)
        hi, lo = torch.where(good, mid, hi), torch.where(good, lo, mid)
    return torch.where(reachable, hi, torch.ones_like(hi)).float()


@dataclass
class XACalibration:
    """Calibrated XAttention: ``thresholds`` ``[L, H_q]`` and ``strides`` (one per layer) of XAttention at
    ``block_size``; ``before`` / ``after``: per layer, :class:`MassStats` of XAttention at
    ``threshold=target`` and stride ``strides_tried[0]`` / of the calibrated selection, on the calibration
    windows (``windows`` of ``length`` tokens)."""

    thresholds: Tensor
    strides: list[int]
    block_size: int
    target: float
    quantile: float
    length: int
    windows: int
    strides_tried: tuple[int, ...]
    before: list[MassStats]
    after: list[MassStats]

    def patterns(self) -> list[XAttention]:
        """One XAttention per layer (per-query-head thresholds)."""
        return [XAttention(threshold=t.tolist(), stride=s, block_size=self.block_size)
                for t, s in zip(self.thresholds, self.strides)]

    def convert(self, model: nn.Module, **options) -> nn.Module:
        """``flexsparse.convert`` with every KV head of layer l on ``patterns()[l]`` (as mode ``"xa"``)."""
        kv_heads = layer_heads(attention_layers(model)[0][1])[1]
        patterns = [{"xa": pattern} for pattern in self.patterns()]
        return convert(model, patterns, [["xa"] * kv_heads] * len(patterns), **options)

    def as_dict(self) -> dict:
        """JSON-ready: thresholds, strides, settings and the per-layer statistics."""
        return {"target": self.target, "quantile": self.quantile, "block_size": self.block_size,
                "length": self.length, "windows": self.windows, "strides_tried": list(self.strides_tried),
                "strides": self.strides, "thresholds": self.thresholds.tolist(),
                "before": [asdict(s) for s in self.before], "after": [asdict(s) for s in self.after]}


class _LayerInputs:
    """What calibration keeps of one layer, over the calibration batches: the true block masses
    ``[B, H, S, KB]`` and the estimated masses per stride ``[B, H, QB, KB]``."""

    def __init__(self) -> None:
        self.true: list[Tensor] = []
        self.estimates: dict[int, list[Tensor]] = {}

    def add(self, q: Tensor, k: Tensor, scaling: float, strides: Sequence[int], block_size: int) -> None:
        self.true.append(true_block_mass(q, k, block_size, scaling))
        compiled = q.device.type == "cuda"  # as XAttention estimates on this device
        for stride in strides:
            estimate = antidiagonal_block_mass(q, k, stride, block_size, compiled)
            self.estimates.setdefault(stride, []).append(estimate)


def check_calibration(target: float, quantile: float, strides: Sequence[int], block_size: int,
                      max_threshold: float = 0.999) -> tuple:
    """The settings of :func:`calibrate_xa`, checked (ValueError/TypeError naming the argument) and
    normalised: ``(target, quantile, strides, block_size, max_threshold)``."""
    target = as_float("target", target, minimum=0.0, maximum=1.0)
    quantile = as_float("quantile", quantile, minimum=0.0, maximum=1.0)
    max_threshold = as_float("max_threshold", max_threshold, minimum=0.0, maximum=1.0)
    if target <= 0.0 or quantile <= 0.0 or max_threshold <= 0.0:
        raise ValueError(f"target, quantile and max_threshold must be in (0, 1], got {target}, {quantile}, "
                         f"{max_threshold}")
    block_size = as_int("block_size", block_size, minimum=16)
    if isinstance(strides, int) or not isinstance(strides, Iterable):
        raise TypeError(f"strides must be a sequence of ints, got {strides!r}")
    strides = tuple(as_int("strides", s, minimum=1) for s in strides)
    if not strides or any(block_size % s for s in strides):
        raise ValueError(f"strides must be non-empty and divide block_size ({block_size}), got {strides}")
    XAttention(target, strides[0], block_size)  # the pattern's own checks
    return target, quantile, strides, block_size, max_threshold


@torch.no_grad()
def calibrate_xa(model: nn.Module, tokenizer, target: float = 0.9, quantile: float = 0.95, *,
                 corpus: Corpus | None = None, length: int = 8192, samples: int = 3,
                 strides: Sequence[int] = (16, 8, 4), block_size: int = 128, max_threshold: float = 0.999,
                 batch_size: int | None = None, progress: bool = False) -> XACalibration:
    """Calibrate XAttention's thresholds on ``model`` so that it keeps ``target`` of the true attention mass
    on ``quantile`` of the query rows of every (layer, query head).

    Args:
        model: a transformers causal LM, not converted.
        tokenizer: its tokenizer (for the default corpus).
        target, quantile: the true kept mass to reach, and the share of query rows that must reach it.
        corpus: its calibration part gives the windows (default: the pydoc topics).
        length, samples: tokens per calibration window and number of windows (as many as the calibration part
            holds, at most ``samples``); calibrate at the length you run (the estimate's error depends on it).
        strides: antidiagonal strides tried per layer (coarsest first); a layer takes the one that keeps the
            fewest blocks, the coarser on ties.
        block_size: XAttention's block size.
        max_threshold: the largest estimator threshold tried before keeping every causal block (1.0).
        batch_size: windows per forward (default: all of them on CUDA, 1 on CPU).
    Returns an :class:`XACalibration` (patterns, ``convert``, per-layer statistics before and after).
    """
    settings = check_calibration(target, quantile, strides, block_size, max_threshold)
    target, quantile, strides, block_size, max_threshold = settings
    length = as_int("length", length, minimum=block_size)
    samples = as_int("samples", samples, minimum=1)
    corpus = Corpus.from_text(tokenizer) if corpus is None else corpus
    windows = corpus.windows(length, samples, split="calibration")
    device = next(model.parameters()).device
    batch_size = as_int("batch_size", batch_size, minimum=1) if batch_size is not None else (
        len(windows) if device.type == "cuda" else 1)
    layers = [_LayerInputs() for _ in attention_layers(model)]
    record = lambda index, q, k, scaling: layers[index].add(q, k, scaling, strides, block_size)
    batches = windows.split(batch_size)
    if progress:
        from tqdm.auto import tqdm

        batches = tqdm(batches, desc="xa calibration", leave=False)
    with capture_qk(model, record):
        for ids in batches:
            model(input_ids=ids.to(device), use_cache=False)
    causal = causal_blocks(length, length, block_size, device)
    thresholds, chosen, before, after = [], [], [], []
    for layer in layers:
        true = torch.cat(layer.true)
        estimates = {s: torch.cat(parts) for s, parts in layer.estimates.items()}
        del layer.true, layer.estimates

        def select(stride: int, threshold: Tensor | float, estimates=estimates) -> Tensor:
            return select_blocks(estimates[stride], threshold, q_len=length, kv_len=length,
                                 block_size=block_size)

        first = select(strides[0], target)
        before.append(mass_stats(kept_fraction(true, first, block_size), first, causal, target, quantile))
        best = None
        for stride in strides:
            found = calibrate_thresholds(true, estimates[stride], block_size, target, quantile, max_threshold)
            table = select(stride, found)
            kept_blocks = int((table & causal).sum())
            if best is None or kept_blocks < best[0]:
                best = (kept_blocks, stride, found, table)
        _, stride, found, table = best
        thresholds.append(found.cpu())
        chosen.append(stride)
        after.append(mass_stats(kept_fraction(true, table, block_size), table, causal, target, quantile))
    return XACalibration(torch.stack(thresholds), chosen, block_size, target, quantile, length, len(windows),
                         strides, before, after)
