"""DuoAttention-style gates: a model run with every KV head's output mixed from its full and its sparse attention.

:func:`gated` runs a transformers causal LM (not converted) with ``out = g full + (1 - g) sparse`` per KV head,
``g = sigmoid(logit)`` from a ``[L, H_kv]`` logits tensor, through an attention function registered in
transformers' registry for the time of the call
(:func:`~flexsparse.eval.swapped_attention.attention_swapped`). :func:`gate_scores` trains the
logits (the model frozen) to keep the full model's last hidden states on real text and passkey prompts, with an L1
penalty pulling every gate to 0: the ``gates`` selector of :mod:`flexsparse.eval.calibration`. Hard gates
(logits of large magnitude) run a choice of full heads without converting the model
(:mod:`flexsparse.eval.head_search`).
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from flexsparse.attention import HybridAttention
from flexsparse.eval.swapped_attention import attention_swapped
from flexsparse.heads import per_query_head
from flexsparse.integrations.transformers import attention_layers, layer_heads
from flexsparse.masks import Causal, Pattern
from flexsparse.validation import as_float, as_int

GATES_NAME = "flexsparse_gates"


@dataclass(frozen=True)
class GateOptions:
    """DuoAttention-style gate training: Adam ``steps`` at learning rate ``lr`` on gate logits that start at
    ``init_logit`` (gate 0.88); loss = relative MSE of the last hidden states + ``sparsity_weight`` x mean gate."""

    steps: int = 200
    lr: float = 0.1
    sparsity_weight: float = 0.05
    init_logit: float = 2.0

    def __post_init__(self) -> None:
        as_int("steps", self.steps, minimum=1)
        as_float("lr", self.lr, positive=True)
        as_float("sparsity_weight", self.sparsity_weight, minimum=0.0)
        as_float("init_logit", self.init_logit)


def _gated_attention(module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask,
                     scaling: float | None = None, dropout: float = 0.0, **kwargs):
    """``g full + (1 - g) sparse`` per KV head, with the gates of ``module.flexsparse_gates``."""
    if attention_mask is not None:
        raise ValueError("gate training runs unpadded batches without an attention mask")
    gates: _LayerGates = module.flexsparse_gates
    full, _ = sdpa_attention_forward(module, query, key, value, None, dropout=dropout, scaling=scaling, **kwargs)
    sparse = gates.attention(query, key, value, modes="sparse", scale=scaling).transpose(1, 2)  # [B, S, H, d]
    mix = per_query_head(gates.values(), query.shape[1] // key.shape[1], dim=0).to(full.dtype)[None, None, :, None]
    return sparse + mix * (full - sparse), None


class _LayerGates:
    """One layer's view of the gate logits (row ``index`` of the shared ``[L, H_kv]`` tensor) and the
    HybridAttention running its sparse branch: compiled flex on CUDA (it has a backward there, and long
    calibration prompts fit), the dense backend elsewhere (CPU flex has no backward)."""

    def __init__(self, index: int, logits: Tensor, module: nn.Module, sparse: Pattern, max_len: int) -> None:
        heads, kv_heads, dim = layer_heads(module)
        self.index, self.logits = index, logits
        backend = "flex" if logits.device.type == "cuda" else "dense"
        self.attention = HybridAttention(heads, kv_heads, dim, {"full": Causal(), "sparse": sparse},
                                         backend=backend, max_dense_len=max_len).to(logits.device)

    def values(self) -> Tensor:
        return torch.sigmoid(self.logits[self.index])


@contextlib.contextmanager
def gated(model: nn.Module, logits: Tensor, sparse: Pattern, max_len: int = 8192) -> Iterator[None]:
    """Run ``model`` with DuoAttention-style gates meanwhile: KV head h of layer l outputs ``g full + (1 - g)
    sparse`` with ``g = sigmoid(logits[l, h])``; ``logits`` ``[L, H_kv]`` (a leaf that requires grad to train
    them). Unpadded inputs of at most ``max_len`` tokens (off CUDA the sparse branch is dense: O(S^2))."""
    layers = attention_layers(model)
    kv_heads = layer_heads(layers[0][1])[1]
    if not isinstance(logits, Tensor) or tuple(logits.shape) != (len(layers), kv_heads):
        raise ValueError(f"logits must be a tensor [L, H_kv] = [{len(layers)}, {kv_heads}], got "
                         f"{getattr(logits, 'shape', type(logits).__name__)}")
    state = lambda index, module: _LayerGates(index, logits, module, sparse, max_len)
    with attention_swapped(model, GATES_NAME, _gated_attention, "flexsparse_gates", state):
        yield


def _steps(steps: int, progress: bool) -> Iterable[int]:
    if not progress:
        return range(steps)
    from tqdm.auto import tqdm

    return tqdm(range(steps), total=steps, desc="gates", leave=False, file=sys.stderr)


def _duration(seconds: float) -> str:
    """``seconds`` as s, min or h."""
    if seconds < 120:
        return f"{seconds:.0f} s"
    return f"{seconds / 60:.0f} min" if seconds < 7200 else f"{seconds / 3600:.1f} h"


def cost_estimate(first_step: float, steps: int, batch: tuple[int, int], device: torch.device) -> str:
    """What gate training will cost, from its first step's seconds: one line (printed once, before the rest)."""
    return (f"gate training: {steps} steps of {batch[0]} x {batch[1]:,} tokens on {device.type}; the first took "
            f"{_duration(first_step)}, so the other {steps - 1} will take about {_duration(first_step * (steps - 1))}"
            " (fewer steps: GateOptions.steps, --gate-steps)")


def gate_scores(model: nn.Module, ids: Tensor, sparse: Pattern, *, options: GateOptions = GateOptions(),
                batch_size: int = 1, seed: int = 0, progress: bool = False) -> Tensor:
    """DuoAttention-style gates ``[L, H_kv]`` in (0, 1), trained on the prompts ``ids`` ``[N, S]`` by distilling
    the full model's last hidden states (see the module docstring). The model's weights are not changed.
    ``progress``: a bar on stderr, and once the first step is timed, one line with what the others will cost
    (:func:`cost_estimate`: on a CPU one step of the default model can take minutes)."""
    steps = as_int("steps", options.steps, minimum=1)
    device = next(model.parameters()).device
    decoder = model.get_decoder()
    layers = attention_layers(model)
    kv_heads = layer_heads(layers[0][1])[1]
    batches = [ids[start:start + batch_size].to(device) for start in range(0, len(ids), batch_size)]
    with torch.no_grad():
        targets = [decoder(input_ids=batch, use_cache=False).last_hidden_state.float() for batch in batches]
    generator = torch.Generator().manual_seed(seed)
    order = torch.randperm(len(batches) * -(-steps // len(batches)), generator=generator) % len(batches)
    logits = nn.Parameter(torch.full((len(layers), kv_heads), float(options.init_logit), device=device))
    optimizer = torch.optim.Adam([logits], lr=as_float("lr", options.lr, positive=True))
    with gated(model, logits, sparse, max(8192, ids.shape[1])), torch.enable_grad():
        started = time.perf_counter()
        for step in _steps(steps, progress):
            if step == 1 and progress:
                from tqdm.auto import tqdm

                tqdm.write(cost_estimate(time.perf_counter() - started, steps, tuple(batches[0].shape), device),
                           file=sys.stderr)
            index = int(order[step])
            hidden = decoder(input_ids=batches[index], use_cache=False).last_hidden_state.float()
            target = targets[index]
            loss = (hidden - target).pow(2).mean() / target.pow(2).mean()
            loss = loss + options.sparsity_weight * torch.sigmoid(logits).mean()
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
    return torch.sigmoid(logits.detach()).cpu()
