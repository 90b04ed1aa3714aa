"""First-order effect of every attention option of every KV head on the calibration objective, from one forward
and backward per calibration batch.

The objective J is the ``search`` selector's (:class:`~flexsparse.eval.head_search.CalibrationObjective`): the mean
next-token NLL of calibration text windows plus ``passkey_weight`` x the mean NLL of the pass key's answer tokens on
calibration passkey prompts. The model runs with every KV head on its *base* option (all full by default). For KV
head h of layer l and option o, let ``delta_t`` be the change of the head's attention output at position t (its
query heads', before the output projection) when it runs o instead of full attention on the same q/k/v, and ``g_t =
dJ / d(attention output at t)``. :func:`option_effects` runs each calibration batch forward with the model's
attention replaced by one that records q/k/v, backpropagates J (the LM head in chunks of positions, each chunk's
gradient taken alone: no ``[B, S, vocab]`` logits kept), and, while the gradient passes a layer's output, computes
that layer's option outputs from its q/k/v (one layer at a time, under no_grad) and accumulates per (layer, KV head,
option):

* the **effect** ``sum_t c_t``, ``c_t = g_t . delta_t`` (summed over the head's query heads): J's change when that
  head alone takes the option, to first order. On SmolLM2-135M at 512 tokens it matched the measured change of 16
  single heads within ~10-30% (e.g. 0.00329 predicted, 0.00295 measured);
* the **magnitude** ``sum_t |c_t|``: the same without cancellation between positions.

Single-head effects do not add up: a head's long-range attention is redundant with the other heads', so most heads
alone change J by little (or lower it, on the calibration prompts), while many of them together raise it much more.
Measured on SmolLM2-135M at 1,024 tokens (options full, windows 64/128/256, XAttention 0.9; 2 text windows and 2
passkey prompts), the greedy budgeted choice on the effects raised J by 0.11-0.15 nats at KV budgets 0.7 and 0.5 and
a tiles budget of 0.75; on the magnitudes by 0.005, 0.020 and 0.007; on :meth:`OptionEffects.scores` (the effect's
positive part plus 0.1 x the magnitude) by 0.001, 0.010 and 0.002. Re-linearised at the chosen configuration (effects
with it as the base), the same score lowered the kv 0.5 choice's increase from 0.010 to 0.007.

The same pass measures what input-dependent options (XAttention) cost: the share of the causal tiles of each KV
head's resolved block table (the mean over its query heads and the calibration prompts).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from flexsparse.eval.head_options import OptionAttention, OptionSet, check_choice, tile_shares
from flexsparse.eval.head_search import CalibrationObjective
from flexsparse.eval.swapped_attention import attention_swapped
from flexsparse.integrations.transformers import attention_layers, layer_heads
from flexsparse.masks import Pattern
from flexsparse.masks.geometry import Geometry
from flexsparse.validation import as_float, as_int

EFFECTS_NAME = "flexsparse_option_effects"
_HEAD_CHUNK = 2048  # positions per LM-head chunk


@dataclass
class OptionEffects:
    """Per (layer, KV head, option), float64 ``[L, H_kv, O]``, at the model on ``base`` (long ``[L, H_kv]``):
    ``effects``, the first-order change of the objective when that head runs the option instead of full attention
    (``sum_t g_t . delta_t``); ``magnitudes``, the same without cancellation between positions
    (``sum_t |g_t . delta_t|``, summed over batches and the head's query heads before the absolute value); ``tiles``,
    the share of the causal tiles the option computes (closed form, or measured for the dynamic options). Full is
    option 0: 0 in both. ``objective``: the base model's objective, from the same forwards."""

    effects: Tensor
    magnitudes: Tensor
    tiles: Tensor
    objective: float
    base: Tensor

    def scores(self, magnitude_weight: float = 0.1) -> Tensor:
        """What a budgeted choice should minimise per (layer, KV head, option), float64 ``[L, H_kv, O]``: the harm
        the first-order effect predicts (its positive part) plus ``magnitude_weight`` x its magnitude (see the
        module docstring); 0 for full."""
        weight = as_float("magnitude_weight", magnitude_weight, minimum=0.0)
        return self.effects.clamp(min=0) + weight * self.magnitudes


class _LayerEffects:
    """One layer's share of the pass: its base modes, its option attentions and the accumulators (shared
    ``[L, H_kv, O]`` tensors: effects, magnitudes, measured tiles and their counts)."""

    def __init__(self, index: int, module: nn.Module, options: OptionSet, base: Tensor,
                 sums: dict[str, Tensor]) -> None:
        self.heads, self.kv_heads, _ = layer_heads(module)
        self.index, self.options, self.base, self.sums = index, options, base[index].tolist(), sums
        self.attention = OptionAttention(options, module, options.length)

    def _resolved(self, q: Tensor, k: Tensor, used: Sequence[int]) -> dict[int, Pattern]:
        """The dynamic options among ``used`` resolved on (detached) q/k."""
        return {o: self.options.options[o].pattern.resolve(q.detach(), k.detach()) for o in used
                if self.options.options[o].pattern.is_dynamic}

    def base_output(self, module: nn.Module, q: Tensor, k: Tensor, v: Tensor, scaling: float | None) -> Tensor:
        """The layer's output ``[B, S, H, d]`` with its heads on their base options (differentiable; dynamic
        options are resolved on detached q/k first, so no estimator runs under autograd)."""
        if not any(self.base):
            return sdpa_attention_forward(module, q, k, v, None, scaling=scaling)[0]
        return self.attention(q, k, v, self.base, scaling, self._resolved(q, k, self.base)).transpose(1, 2)

    @torch.no_grad()
    def accumulate(self, module: nn.Module, q: Tensor, k: Tensor, v: Tensor, scaling: float | None, base: Tensor,
                   grad: Tensor) -> None:
        """Add ``g . (option output - full output)`` per KV head and option (summed, and summed in absolute value
        over positions); measure the dynamic options' tiles."""
        geo = Geometry(num_heads=self.heads, q_len=q.shape[2], block_size=self.options.block_size,
                       device=q.device)
        grad = grad.float()
        group = self.heads // self.kv_heads
        full = base if not any(self.base) else sdpa_attention_forward(module, q, k, v, None, scaling=scaling)[0]
        full = full.float()
        for o in range(1, len(self.options.options)):
            resolved = self._resolved(q, k, [o])
            if resolved:
                shares = tile_shares(resolved[o], geo).view(-1, self.kv_heads, group).mean(-1)  # [B, H_kv]
                self.sums["tiles"][self.index, :, o] += shares.sum(0).to(torch.float64)
                self.sums["counts"][self.index, :, o] += shares.shape[0]
            output = self.attention(q, k, v, [o] * self.kv_heads, scaling, resolved).transpose(1, 2)
            change = (grad * (output.float() - full)).sum(-1)  # [B, S, H]
            change = change.view(*change.shape[:2], self.kv_heads, group).sum(-1)  # [B, S, H_kv]
            self.sums["effects"][self.index, :, o] += change.sum((0, 1)).to(torch.float64)
            self.sums["magnitudes"][self.index, :, o] += change.abs().sum((0, 1)).to(torch.float64)


def _effects_attention(module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask,
                       scaling: float | None = None, dropout: float = 0.0, **kwargs):
    """The layer on its base options; when the objective's gradient reaches the output, the options' effects."""
    if attention_mask is not None:
        raise ValueError("option effects take unpadded batches without an attention mask")
    state: _LayerEffects = module.flexsparse_option_effects
    output = state.base_output(module, query, key, value, scaling)
    if output.requires_grad:
        q, k, v, kept = query.detach(), key.detach(), value.detach(), output.detach()
        output.register_hook(lambda grad: state.accumulate(module, q, k, v, scaling, kept, grad))
    return output, None


def _scored_batches(objective: CalibrationObjective, batch_tokens: int) -> Iterator[tuple[Tensor, Tensor, float]]:
    """The objective as sums: ``(ids [B, S], labels [B, S] (-100: not scored), weight per scored token)``."""
    windows = objective.windows
    text_tokens = windows.shape[0] * (windows.shape[1] - 1)
    per_batch = max(1, batch_tokens // windows.shape[1])
    for start in range(0, len(windows), per_batch):
        ids = windows[start:start + per_batch]
        yield ids, ids, 1.0 / text_tokens
    if not objective.passkeys or not objective.weight:
        return
    answers = sum(int((batch["labels"][:, 1:] != -100).sum()) for batch in objective.passkeys)
    per_batch = max(1, batch_tokens // objective.passkeys[0]["input_ids"].shape[1])
    for start in range(0, len(objective.passkeys), per_batch):
        part = objective.passkeys[start:start + per_batch]
        yield (torch.cat([b["input_ids"] for b in part]), torch.cat([b["labels"] for b in part]),
               objective.weight / answers)


@torch.enable_grad()
def _backward(model: nn.Module, ids: Tensor, labels: Tensor, weight: float) -> float:
    """Forward ``ids``, backpropagate ``weight`` x the summed NLL of the scored next tokens to the input
    embeddings (no parameter gradients); returns that weighted sum."""
    embeds = model.get_input_embeddings()(ids).detach().requires_grad_()
    hidden = model.get_decoder()(inputs_embeds=embeds, use_cache=False).last_hidden_state[:, :-1]
    flat, targets = hidden.reshape(-1, hidden.shape[-1]), labels[:, 1:].reshape(-1)
    scored = torch.nonzero(targets != -100).flatten()
    grad = torch.zeros_like(flat)
    total = 0.0
    head = model.get_output_embeddings()
    for start in range(0, len(scored), _HEAD_CHUNK):
        rows = scored[start:start + _HEAD_CHUNK]
        part = flat[rows].detach().requires_grad_()
        loss = F.cross_entropy(head(part).float(), targets[rows], reduction="sum") * weight
        grad[rows] = torch.autograd.grad(loss, part)[0].to(grad.dtype)
        total += float(loss.detach())
    torch.autograd.grad(flat, embeds, grad_outputs=grad)
    return total


def option_effects(model: nn.Module, objective: CalibrationObjective, options: OptionSet,
                   base: Tensor | None = None, batch_tokens: int | None = None) -> OptionEffects:
    """Every (layer, KV head, option)'s first-order effect on ``objective`` (see the module docstring), from the
    model with its heads on ``base`` (long ``[L, H_kv]``; default all full), in batches of about
    ``batch_tokens`` tokens (default 32K on CUDA, one prompt elsewhere). The model's weights are not changed."""
    layers = attention_layers(model)
    kv_heads = layer_heads(layers[0][1])[1]
    shape = (len(layers), kv_heads, len(options.options))
    base = torch.zeros(shape[:2], dtype=torch.long) if base is None else base
    check_choice(base, options, *shape[:2])
    if objective.max_len > options.length:
        raise ValueError(f"the objective's prompts ({objective.max_len} tokens) are longer than the options' length "
                         f"{options.length}")
    device = next(model.parameters()).device
    batch_tokens = (32768 if device.type == "cuda" else 1) if batch_tokens is None else as_int(
        "batch_tokens", batch_tokens, minimum=1)
    sums = {name: torch.zeros(shape, dtype=torch.float64, device=device)
            for name in ("effects", "magnitudes", "tiles", "counts")}
    state = lambda index, module: _LayerEffects(index, module, options, base, sums)
    total = 0.0
    with attention_swapped(model, EFFECTS_NAME, _effects_attention, "flexsparse_option_effects", state):
        for ids, labels, weight in _scored_batches(objective, batch_tokens):
            total += _backward(model, ids.to(device), labels.to(device), weight)
    sums = {name: value.cpu() for name, value in sums.items()}
    tiles = options.static_tiles()[None, None].expand(shape).clone()
    for o in options.dynamic():
        measured = sums["tiles"][:, :, o] / sums["counts"][:, :, o].clamp(min=1)
        tiles[:, :, o] = torch.where(sums["counts"][:, :, o] > 0, measured, 1.0)
    return OptionEffects(sums["effects"], sums["magnitudes"], tiles, total, base.clone())
