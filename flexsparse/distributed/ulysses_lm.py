"""A converted transformers model with sequence parallelism: every converted layer's attention through the Ulysses
exchange (:class:`~flexsparse.distributed.UlyssesAttention`), routers included.

:func:`ulysses_model` switches a model converted by :func:`flexsparse.convert` to an attention function and a mask
function registered under ``"flexsparse_ulysses"``. Each of the P ranks of the group then runs the model on its S/P
consecutive tokens of every sequence (embeddings, projections, RoPE at the global positions, MLPs, logits), and
each layer's attention exchanges q/k/v (after RoPE) into head shards, runs the layer's HybridAttention on the
rank's KV heads (``kv_heads=``: the default modes, a router's per-sequence modes and per-head pattern data follow
their heads), and exchanges the output back. The mask function returns this rank's padding shard; the first layer
all-gathers the whole ``[B, S]`` mask once per forward (one byte a token) and every layer shares the positions and
router boundaries derived from it.

A routed layer's router pools the first and last ``pool_size`` real tokens of each sequence: each rank contributes
the captured states it holds at those slots (zeros elsewhere) and one all-reduce of ``[B, 2*pool_size, heads, d]``
gives every rank the same pooled tokens, hence the same logits and (with the same Gumbel generator state on every
rank) the same decisions as one process. In training the rank mixes the full and sparse outputs of its own heads;
the backward of the routing weights ``[B, G]`` all-reduces their gradient, so every rank's router parameters get
the whole batch's gradient (the sum of the ranks' losses) and stay equal without a DDP all-reduce of their own.
Terms computed from :func:`~flexsparse.integrations.last_routings` (the sparsity regulariser) are the same on every
rank and take their gradient locally: add them on every rank, as one process does.

Only whole-sequence forwards (prefill, training: ``use_cache=False``); decode and ``generate()`` are refused.
:func:`last_exchanges` reads the bytes each layer's exchanges sent.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn
from transformers.masking_utils import AttentionMaskInterface, causal_mask_function
from transformers.modeling_utils import AttentionInterface

from flexsparse.attention import HybridAttention
from flexsparse.distributed.ulysses import ExchangeBytes, UlyssesAttention, shard_sequence
from flexsparse.heads import per_query_head
from flexsparse.integrations.forward_mask import ForwardMask
from flexsparse.integrations.layer import SparseAttentionLayer
from flexsparse.integrations.transformers import check_attention_arguments
from flexsparse.masks import Positions
from flexsparse.routers import Boundary, boundary_positions

ULYSSES_ATTENTION_NAME = "flexsparse_ulysses"
"""The name :func:`ulysses_model` registers in transformers' attention and mask registries."""

_STATE = "flexsparse_ulysses"  # attribute of each converted attention module
IGNORE_INDEX = -100


@dataclass(eq=False)
class UlyssesLayer:
    """What one converted attention module runs under sequence parallelism: its layer state and the exchange
    around the layer's HybridAttention (a plain object, so that it adds nothing to the model's state dict)."""

    layer: SparseAttentionLayer
    ulysses: UlyssesAttention
    rank: int

    @property
    def group(self) -> dist.ProcessGroup | None:
        return self.ulysses.group

    @property
    def world_size(self) -> int:
        return self.ulysses.world_size


class ShardMask:
    """The mask of one sequence-parallel forward: this rank's padding shard ``[B, S/P]`` (None: no padding mask on
    any rank). :meth:`whole` gathers the whole sequence's :class:`~flexsparse.integrations.ForwardMask` at the
    first layer; the other layers of the forward share it (its positions and router boundaries). ``sent``: the
    bytes of this rank's shard the other ranks received (``B*S/P*(P-1)``; 0 without padding or gather)."""

    def __init__(self, padding: Tensor | None, batch: int, length: int, device: torch.device) -> None:
        self.padding, self.batch, self.length, self.device = padding, batch, length, torch.device(device)
        self.sent = 0
        self._whole: ForwardMask | None = None

    @property
    def built(self) -> bool:
        """Whether :meth:`whole` ran (in an earlier layer of this forward)."""
        return self._whole is not None

    def whole(self, group: dist.ProcessGroup | None, world: int) -> ForwardMask:
        if self._whole is None:
            padding = self.padding
            if padding is not None and world > 1:
                mine = padding.to(torch.uint8).contiguous()  # gloo has no bool
                every = [torch.empty_like(mine) for _ in range(world)]
                dist.all_gather(every, mine, group=group)
                padding = torch.cat(every, dim=1).bool()
                self.sent = mine.numel() * (world - 1)
            seq = self.length * world
            self._whole = ForwardMask(padding, self.batch, seq, seq, self.device)
        return self._whole


def ulysses_mask(batch_size: int, q_length: int, kv_length: int, q_offset: int | Tensor | None = None,
                 kv_offset: int = 0, mask_function=causal_mask_function, attention_mask: Tensor | None = None,
                 device: torch.device | str = "cpu", **kwargs) -> ShardMask:
    """transformers mask function: the rank's 2-D padding shard (a :class:`ShardMask`)."""
    if mask_function is not causal_mask_function:
        raise ValueError("flexsparse runs causal attention with a 2-D padding mask; this model asked for another "
                         "mask (a sliding window, packed sequences (position_ids that restart), bidirectional or "
                         "custom mask functions)")
    if q_length != kv_length or kv_offset or (isinstance(q_offset, int) and q_offset):
        raise ValueError(f"a sequence-parallel forward runs whole sequences without cached tokens (got {q_length} "
                         f"queries and {kv_length} keys): pass use_cache=False; decode is not supported")
    padding = None
    if attention_mask is not None:
        padding = attention_mask[:, :kv_length].to(device=device, dtype=torch.bool)
    return ShardMask(padding, batch_size, q_length, device)


def ulysses_attention(module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: ShardMask | None,
                      scaling: float | None = None, dropout: float = 0.0, **kwargs) -> tuple[Tensor, None]:
    """transformers attention function: this rank's q ``[B, H, S/P, d]``, k/v ``[B, H_kv, S/P, d]`` ->
    ``[B, S/P, H, d]``."""
    layer = getattr(module, "flexsparse", None)
    state = getattr(module, _STATE, None)
    if not isinstance(state, UlyssesLayer) or state.layer is not layer:
        raise ValueError(f"attention module {type(module).__name__} (layer {getattr(module, 'layer_idx', '?')}) was "
                         "not prepared by flexsparse.distributed.ulysses_model (call it after flexsparse.convert)")
    check_attention_arguments(layer, module, dropout, kwargs)
    if not isinstance(attention_mask, ShardMask):
        raise TypeError(f"{layer.where}: sequence parallelism needs transformers' 2-D padding mask, got a "
                         f"{type(attention_mask).__name__} mask")
    if layer.take_staged(key, value) is not None or query.shape[2] != key.shape[2]:
        raise ValueError(f"{layer.where}: a sequence-parallel forward runs whole sequences (prefill, training); "
                         "generate(), caches and decode steps are not supported (pass use_cache=False)")
    first = not attention_mask.built
    mask = attention_mask.whole(state.group, state.world_size)
    positions = mask.positions()
    scale = None if scaling is None else float(scaling)
    if layer.router is None:
        out = state.ulysses(query, key, value, positions=positions, scale=scale)
    else:
        out = _routed(state, query, key, value, mask, positions, scale)
    if first:  # the layer that gathered the mask counts it (the call above started a new ExchangeBytes)
        state.ulysses.last_exchange.padding_mask = attention_mask.sent
    return out.transpose(1, 2), None


def _routed(state: UlyssesLayer, query: Tensor, key: Tensor, value: Tensor, mask: ForwardMask,
            positions: Positions | None, scale: float | None) -> Tensor:
    """A routed layer: route from the gathered boundary tokens, then this rank's heads in the routing's modes
    (inference) or the mix of their full and sparse outputs (training)."""
    layer, attn, router = state.layer, state.layer.attention, state.layer.router
    states, layer.captured = layer.captured, None
    batch, shard = query.shape[0], query.shape[2]
    if states is None or tuple(states.shape[:2]) != (batch, shard):
        raise ValueError(f"{layer.where}: the router's states were not captured in this forward (the model did not "
                         "call the hooked projection before attention)")
    seq = shard * state.world_size
    settings = layer.settings
    pool_mask = settings.pool_mask
    if pool_mask is not None and tuple(pool_mask.shape) != (batch, seq):
        raise ValueError(f"{layer.where}: under sequence parallelism the pooling mask must be the whole sequence's "
                         f"[B, S] = [{batch}, {seq}] on every rank, got {tuple(pool_mask.shape)}")
    padding = pool_mask if pool_mask is not None else mask.padding
    boundary = mask.state.router_boundary(
        router.pool_size, batch, seq, states.device, pool_mask,
        lambda: boundary_positions(padding, batch, seq, router.pool_size, states.device))
    picked = boundary_states(states, boundary, state.rank, state.group)
    slots = torch.arange(picked.shape[1], device=picked.device).expand(batch, -1)
    fused = False if router.training else settings.fused
    try:
        routing = router.route(picked, boundary=Boundary(slots, boundary.weights, picked.shape[1]), tau=settings.tau,
                               hard=settings.hard, generator=settings.generator, fused=fused)
    except ValueError as error:
        raise ValueError(f"{layer.where}: {error}") from None
    layer.routing = routing
    layer.prefill_modes = routing.modes(attn.num_kv_heads)
    if not (torch.is_grad_enabled() and routing.weights.requires_grad):
        return state.ulysses(query, key, value, layer.prefill_modes, positions=positions, scale=scale)
    weight = _SumGradient.apply(state.group, routing.sparse_weight)  # [B, G]
    group_size = attn.num_heads // attn.num_kv_heads

    def mix(q: Tensor, k: Tensor, v: Tensor, kv_heads: tuple[int, ...]) -> Tensor:
        full = attn(q, k, v, routing.full_mode, positions=positions, scale=scale, kv_heads=kv_heads)
        sparse = attn(q, k, v, routing.sparse_mode, positions=positions, scale=scale, kv_heads=kv_heads)
        mine = weight.to(full.dtype).expand(batch, attn.num_kv_heads)[:, list(kv_heads)]
        mine = per_query_head(mine, group_size, dim=1)[:, :, None, None]
        return (1 - mine) * full + mine * sparse

    return state.ulysses.on_heads(query, key, value, mix, positions=positions)


def boundary_states(states: Tensor, boundary: Boundary, rank: int, group: dist.ProcessGroup | None) -> Tensor:
    """The whole sequence's states at the ``boundary`` slots, ``[B, 2*pool_size, heads, d]``, on every rank:
    this rank holds ``states`` ``[B, S/P, heads, d]`` of tokens ``rank*S/P ..``; one all-reduce (sum) of the slots
    each rank holds (zeros elsewhere; slots of weight 0 stay zero)."""
    shard = states.shape[1]
    local = boundary.positions - rank * shard  # [B, 2P]
    held = (local >= 0) & (local < shard) & (boundary.weights != 0)
    rows = torch.arange(states.shape[0], device=states.device)[:, None]
    picked = states[rows, local.clamp(0, shard - 1)]  # [B, 2P, heads, d]
    picked = torch.where(held[:, :, None, None], picked, torch.zeros((), dtype=picked.dtype, device=picked.device))
    if dist.get_world_size(group) > 1:
        dist.all_reduce(picked, group=group)
    return picked


class _SumGradient(torch.autograd.Function):
    """Identity forward; the backward sums the gradient over the group's ranks (each rank's heads contribute
    theirs)."""

    @staticmethod
    def forward(ctx, group: dist.ProcessGroup | None, x: Tensor) -> Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Tensor):
        grad = grad.contiguous().clone()
        if dist.get_world_size(ctx.group) > 1:
            dist.all_reduce(grad, group=ctx.group)
        return None, grad


class _SumForward(torch.autograd.Function):
    """The sum over the group's ranks forward; identity backward (each rank's share keeps its gradient)."""

    @staticmethod
    def forward(ctx, group: dist.ProcessGroup | None, x: Tensor) -> Tensor:
        total = x.detach().clone().contiguous()
        dist.all_reduce(total, group=group)
        return total

    @staticmethod
    def backward(ctx, grad: Tensor):
        return None, grad


def register() -> None:
    """Register the sequence-parallel attention and mask functions with transformers (idempotent)."""
    AttentionInterface.register(ULYSSES_ATTENTION_NAME, ulysses_attention)
    AttentionMaskInterface.register(ULYSSES_ATTENTION_NAME, ulysses_mask)


def ulysses_model(model: nn.Module, group: dist.ProcessGroup | None = None) -> nn.Module:
    """Run the converted ``model``'s attention with sequence parallelism over ``group`` (default: the default
    group), in place; returns the model. Every rank calls it on its replica (same weights, same modes).

    The model then takes this rank's tokens: ``model(**shard_batch(input_ids, attention_mask, labels), use_cache=
    False)`` (or :class:`UlyssesCausalLM`), and returns the logits of those tokens ``[B, S/P, V]``. Every
    layer's ``num_heads`` and ``num_kv_heads`` must be divisible by P (ValueError naming the layer).
    ``model.set_attn_implementation("flexsparse")`` returns to one process; converting again also does.
    """
    layers = [(module, module.flexsparse) for module in model.modules()
              if isinstance(getattr(module, "flexsparse", None), SparseAttentionLayer)]
    if not layers:
        raise ValueError("ulysses_model: the model is not converted (flexsparse.convert(model, ...) first)")
    if group is None and not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("ulysses_model needs a process group: call torch.distributed.init_process_group first "
                           "or pass group=")
    exchanges = []
    for _, layer in sorted(layers, key=lambda found: found[1].layer_idx):
        if not isinstance(layer.attention, HybridAttention):
            raise ValueError(f"{layer.where} runs some heads of a tensor-parallel model; sequence parallelism "
                             "needs every head on every rank")
        try:
            exchanges.append((layer, UlyssesAttention(layer.attention, group)))
        except ValueError as error:
            raise ValueError(f"{layer.where}: {error}") from None
    rank = dist.get_rank(group)
    by_layer = dict(exchanges)
    for module, layer in layers:
        setattr(module, _STATE, UlyssesLayer(layer, by_layer[layer], rank))
    register()
    model.set_attn_implementation(ULYSSES_ATTENTION_NAME)
    if model.config._attn_implementation != ULYSSES_ATTENTION_NAME:
        raise ValueError(f"{type(model).__name__} refused set_attn_implementation({ULYSSES_ATTENTION_NAME!r})")
    return model


def last_exchanges(model: nn.Module) -> list[ExchangeBytes]:
    """The bytes this rank sent in each converted layer's last exchanges (:class:`ExchangeBytes`, one per layer,
    in layer order) of a model prepared by :func:`ulysses_model` (the model or a module holding it, e.g. a
    :class:`UlyssesCausalLM`): q/k/v and the output of the last forward, their gradients once its backward has
    run. ``padding_mask``: the first layer's entry counts the padding mask's one all-gather per forward. Not
    counted: the routers' all-reduces (``[B, 2*pool_size, heads, d]`` states forward, ``[B, G]`` gradients
    backward)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    states = [state for module in model.modules()
              if isinstance(state := getattr(module, _STATE, None), UlyssesLayer)
              and state.layer is getattr(module, "flexsparse", None)]  # not left by an earlier conversion
    if not states:
        raise ValueError("last_exchanges: the model was not prepared by flexsparse.distributed.ulysses_model")
    return [state.ulysses.last_exchange for state in sorted(states, key=lambda state: state.layer.layer_idx)]


def shard_batch(input_ids: Tensor, attention_mask: Tensor | None = None, labels: Tensor | None = None,
                group: dist.ProcessGroup | None = None) -> dict[str, Tensor]:
    """This rank's share of a whole batch, as keyword arguments of the model's forward.

    ``input_ids``, ``attention_mask`` and ``labels`` are the whole ``[B, S]`` (S divisible by P). Returns
    ``input_ids`` and ``attention_mask`` (when given) of the rank's S/P tokens, ``position_ids`` ``[1, S/P]``
    (their global positions, as one process numbers them), and with ``labels`` the arguments that make the
    model's loss this rank's share of the whole batch's mean loss (the shares sum to it): ``shift_labels`` (the
    next-token labels of the whole sequence, the rank's slice), ``num_items_in_batch`` (labelled tokens of the
    whole batch) and ``labels`` (the rank's slice, which only makes the model compute the loss).
    """
    if not isinstance(input_ids, Tensor):
        raise TypeError(f"input_ids must be a tensor [B, S], got {type(input_ids).__name__}")
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be the whole batch's token ids [B, S], got shape {tuple(input_ids.shape)}")
    for name, value in (("attention_mask", attention_mask), ("labels", labels)):
        if value is not None and not isinstance(value, Tensor):
            raise TypeError(f"{name} must be a tensor [B, S], got {type(value).__name__}")
        if value is not None and value.shape != input_ids.shape:
            raise ValueError(f"{name} must be a tensor [B, S] = {list(input_ids.shape)}, got {tuple(value.shape)}")
    seq = input_ids.shape[1]
    positions = torch.arange(seq, device=input_ids.device)[None]
    shard = {"input_ids": shard_sequence(input_ids, group, dim=1),
             "position_ids": shard_sequence(positions, group, dim=1)}
    if attention_mask is not None:
        shard["attention_mask"] = shard_sequence(attention_mask, group, dim=1)
    if labels is not None:
        shifted = torch.nn.functional.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)
        shard["labels"] = shard_sequence(labels, group, dim=1)
        shard["shift_labels"] = shard_sequence(shifted, group, dim=1).contiguous()
        shard["num_items_in_batch"] = (shifted != IGNORE_INDEX).sum()
    return shard


class UlyssesCausalLM(nn.Module):
    """A converted causal LM under sequence parallelism that takes whole batches (e.g. for
    :class:`~flexsparse.integrations.RouterTrainer`): :func:`ulysses_model` on construction; ``forward(input_ids,
    attention_mask=None, labels=None, **kwargs)`` with the whole ``[B, S]`` on every rank runs the rank's tokens
    (:func:`shard_batch`, ``use_cache=False``) and returns the model's output: ``logits`` of the rank's tokens
    ``[B, S/P, V]``, ``loss`` the whole batch's (all-reduced; its backward is the rank's share, so each rank's
    backward gives the single-process gradients of the parameters the ranks share, e.g. the routers')."""

    def __init__(self, model: nn.Module, group: dist.ProcessGroup | None = None) -> None:
        super().__init__()
        self.model = ulysses_model(model, group)
        self.group = group

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None, labels: Tensor | None = None,
                **kwargs) -> Mapping:
        kwargs.setdefault("use_cache", False)
        out = self.model(**shard_batch(input_ids, attention_mask, labels, self.group), **kwargs)
        if labels is not None:
            out.loss = _SumForward.apply(self.group, out.loss)
        return out
