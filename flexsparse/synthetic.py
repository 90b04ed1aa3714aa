"""Queries and keys whose attention has the structure of a trained model's, for tests and benchmarks of sparsity.

Random Gaussian q/k give nearly flat attention, on which every sparse pattern looks bad (XAttention keeps ~90% of
the blocks at threshold 0.9). Trained models' attention is peaked: most heads put a large share on the first
token (the *attention sink*), many concentrate on recent tokens (*locality*, with a long tail that RoPE's
frequencies make decay with distance), retrieval heads pick out a few far tokens (*needles*), some heads attend
to scattered "anchor" tokens from everywhere (vertical stripes), and heads of one layer differ. This module plants
each of those in q and k, so the logit ``q_i . k_j / sqrt(d)`` of a query at position i and a key at j is

    noise        N(0, sigma_h^2)                          every pair (content that matches by chance)
  + locality     L_h * c_h(i - j)                         c_h(0) = 1, decays as RoPE pairs dephase
  + sink         S_h                                      j = 0 only
  + anchors      A_h                                      j in a random 1% of positions (shared by a group)
  + needles      N_h                                      j = a needle's 4-16 tokens, i in the needle's readers

up to cross terms of the order of the noise. The first half of the head dimensions carries locality the way RoPE
builds it: q and k hold one shared direction rotated by their positions, q_i = R(i) (a * f_h), k_j = R(j) a, with
rotation frequencies 10000^(-2m / (d/2)); ``c_h(t)`` is the energy-weighted mean of cos(t theta_m) over the
frequencies head h keeps (``f_h`` drops those below 1 / width_h), so each query head of a group has its own
window width while the keys are shared, as under GQA. The second half carries content: Gaussian noise and
orthonormal directions for the sink, the anchors and the needles (keys carry each feature with norm 2 sqrt(d),
queries with the coefficient that gives the logit above). A needle is a run of 4-16 keys whose direction its
readers' queries carry too: the queries in a random span after it, plus the last 5% of the sequence (a question at
the end of a prompt).

Every KV head (and its group of query heads) gets a *kind*, cycling through ``KINDS`` (3 local, 2 retrieval,
2 anchors, 1 diffuse in 8):

``local``      strong sink (logit 16-22), window peak 16-24 over 64-1024 tokens, no needles: a streaming head;
``retrieval``  sink 14-18, broad window (peak 10-16 over 256-2048 tokens), 4 needles at logit 20;
``anchors``    sink 14-20, window peak 12-18 over 64-1024 tokens, anchor stripes at logit 12;
``diffuse``    weak sink and window (4-6), noise 1.0-1.5: a head that reads everything.

Each query head scales its group's strengths by its own factor in [0.6, 1.4] and draws its own window width and
noise (0.6-1.0 outside diffuse heads). Measured at 4K-16K tokens (exact softmax): key 0 takes 29-57% of a local
head's attention and its last 256 tokens 34-60%; a diffuse head gives key 0 about 4%. Parameters are drawn anew
for each length. Generated on ``device`` with a seeded generator: the same seed gives the same tensors on the same
device type.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from flexsparse.validation import as_int

KINDS = ("local", "retrieval", "anchors", "local", "retrieval", "anchors", "local", "diffuse")
_ROPE_BASE = 10000.0


@dataclass
class SyntheticInputs:
    """Generated attention inputs and what was planted in them.

    ``q`` ``[B, H_q, S_q, d]`` (the last S_q positions, bottom-right aligned), ``k`` and ``v`` ``[B, H_kv, S, d]``;
    ``kinds[g]`` is KV head g's kind; ``needles[g]`` lists (first key, last key, first reader query position) of its
    needles (absolute positions; readers are also every query in the last 5% of the sequence).
    """

    q: Tensor
    k: Tensor
    v: Tensor
    kinds: list[str]
    needles: list[list[tuple[int, int, int]]]

    @property
    def qkv(self) -> tuple[Tensor, Tensor, Tensor]:
        return self.q, self.k, self.v


def _orthonormal(gen: torch.Generator, count: int, dim: int, device: torch.device) -> Tensor:
    """``count`` orthonormal random vectors ``[count, dim]`` (count <= dim)."""
    basis, _ = torch.linalg.qr(torch.randn(dim, count, generator=gen, device=device))
    return basis.T


def _rotary(x: Tensor, positions: Tensor) -> Tensor:
    """RoPE rotation of ``x`` ``[r]`` to every position: ``[P, r]`` (pair m turns by p * 10000^(-2m / r))."""
    dim = x.shape[-1]
    angle = positions.to(torch.float32)[:, None] * _frequencies(dim, x.device)[None, :]
    cos, sin = angle.cos(), angle.sin()
    even, odd = x[0::2], x[1::2]
    out = torch.empty(positions.numel(), dim, device=x.device)
    out[:, 0::2] = even * cos - odd * sin
    out[:, 1::2] = even * sin + odd * cos
    return out


def _frequencies(dim: int, device: torch.device) -> Tensor:
    return _ROPE_BASE ** (-torch.arange(0, dim, 2, device=device, dtype=torch.float32) / dim)


# per kind: (sink, window peak, window width in tokens, anchor, needle, noise std), logits; (lo, hi) are ranges
_STRENGTHS = {
    "local": ((16.0, 22.0), (16.0, 24.0), (64.0, 1024.0), 0.0, 0.0, (0.6, 1.0)),
    "retrieval": ((14.0, 18.0), (10.0, 16.0), (256.0, 2048.0), 0.0, 20.0, (0.6, 1.0)),
    "anchors": ((14.0, 20.0), (12.0, 18.0), (64.0, 1024.0), 12.0, 0.0, (0.6, 1.0)),
    "diffuse": ((4.0, 6.0), (4.0, 6.0), (1024.0, 8192.0), 0.0, 0.0, (1.0, 1.5)),
}
_NEEDLES = 4


def synthetic_attention_inputs(batch: int = 1, heads: int = 8, kv_heads: int = 2, seq_len: int = 4096,
                               head_dim: int = 128, *, q_len: int | None = None, seed: int = 0,
                               device: str | torch.device = "cpu",
                               dtype: torch.dtype = torch.float32) -> SyntheticInputs:
    """Inputs with sinks, locality, anchors, needles and per-head differences (see the module docstring).

    KV head g has kind ``KINDS[g % 8]``; batch elements share the kinds but draw their own positions and noise.
    ``head_dim`` must be a multiple of 4 and at least 16.
    """
    batch, heads, kv_heads = as_int("batch", batch, 1), as_int("heads", heads, 1), as_int("kv_heads", kv_heads, 1)
    seq_len, head_dim = as_int("seq_len", seq_len, 1), as_int("head_dim", head_dim, 16)
    q_len = seq_len if q_len is None else as_int("q_len", q_len, 1, seq_len)
    if heads % kv_heads:
        raise ValueError(f"heads ({heads}) must be a multiple of kv_heads ({kv_heads})")
    if head_dim % 4:
        raise ValueError(f"head_dim must be a multiple of 4 (two halves of rotary pairs), got {head_dim}")
    device = torch.device(device)
    gen = torch.Generator(device=device).manual_seed(seed)
    rand = lambda *shape: torch.rand(*shape, generator=gen, device=device)
    uniform = lambda lo, hi: lo + (hi - lo) * float(rand(()))
    group, half, root_d = heads // kv_heads, head_dim // 2, math.sqrt(head_dim)
    feature_norm = 2 * root_d  # content features of keys; a query coefficient c adds c * feature_norm / sqrt(d)
    positions = torch.arange(seq_len, device=device)
    q_out = torch.empty(batch, heads, q_len, head_dim, device=device, dtype=dtype)
    k_out = torch.empty(batch, kv_heads, seq_len, head_dim, device=device, dtype=dtype)
    v_out = torch.empty(batch, kv_heads, seq_len, head_dim, device=device, dtype=dtype)
    kinds = [KINDS[g % len(KINDS)] for g in range(kv_heads)]
    needles: list[list[tuple[int, int, int]]] = [[] for _ in range(kv_heads)]
    for b in range(batch):
        for g in range(kv_heads):
            sink_range, peak_range, width_range, anchor_logit, needle_logit, noise_range = _STRENGTHS[kinds[g]]
            local_dir = _orthonormal(gen, 1, half, device)[0]
            sink_dir, anchor_dir, *needle_dirs = _orthonormal(gen, 2 + _NEEDLES, half, device)
            keys = torch.zeros(seq_len, head_dim, device=device)
            keys[:, :half] = _rotary(local_dir, positions) * root_d
            keys[:, half:] = torch.randn(seq_len, half, generator=gen, device=device)
            keys[0, half:] += sink_dir * feature_norm
            if anchor_logit:
                anchors = rand(seq_len) < 0.01
                anchors[0] = False
                keys[anchors, half:] += anchor_dir * feature_norm
            readers = []
            for direction in needle_dirs[: _NEEDLES if needle_logit else 0]:
                first = 1 + int(rand(()) * (seq_len - 1))
                last = min(seq_len - 1, first + 3 + int(rand(()) * 13))
                start = min(seq_len - 1, last + 1 + int(rand(()) * seq_len * 0.1))
                reads = torch.zeros(seq_len, dtype=torch.bool, device=device)
                reads[start:start + max(1, int(rand(()) * seq_len * 0.05))] = True
                reads[int(seq_len * 0.95):] = True
                reads[: last + 1] = False
                keys[first:last + 1, half:] += direction * feature_norm
                readers.append((direction, reads))
                if b == 0:
                    needles[g].append((first, last, start))
            k_out[b, g] = keys.to(dtype)
            v_out[b, g] = torch.randn(seq_len, head_dim, generator=gen, device=device).to(dtype)
            for j in range(group):
                scale = uniform(0.6, 1.4)
                noise = uniform(*noise_range)
                width = math.exp(uniform(math.log(width_range[0]), math.log(width_range[1])))
                keep = (_frequencies(half, device) >= 1.0 / width).to(torch.float32).repeat_interleave(2)
                kept_energy = max(float((local_dir * keep).square().sum()), 1e-6)
                query = torch.zeros(seq_len, head_dim, device=device)
                # window: q.k / sqrt(d) = coefficient * sqrt(d) * (kept energy) / sqrt(d) at distance 0
                peak = uniform(*peak_range) * scale
                query[:, :half] = _rotary(local_dir * keep, positions) * (peak / kept_energy)
                # content noise: logit std = noise (the keys' content half is N(0, 1) per dim)
                content = torch.randn(seq_len, half, generator=gen, device=device) * (noise * root_d / half**0.5)
                content += sink_dir * (uniform(*sink_range) * scale * root_d / feature_norm)
                content += anchor_dir * (anchor_logit * scale * root_d / feature_norm)
                for direction, reads in readers:
                    content[reads] += direction * (needle_logit * scale * root_d / feature_norm)
                query[:, half:] = content
                q_out[b, g * group + j] = query[seq_len - q_len:].to(dtype)
    return SyntheticInputs(q_out, k_out, v_out, kinds, needles)
