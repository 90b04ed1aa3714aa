"""flexsparse inside transformers causal LMs, through transformers' own registries (no model code copied or patched).

:func:`convert` registers two functions under the name ``"flexsparse"`` and switches the model to it with
``model.set_attn_implementation``:

* an attention function (``AttentionInterface``), called by every attention module with its q/k/v; it runs the
  module's :class:`~flexsparse.integrations.layer.SparseAttentionLayer` (kept on the module as
  ``module.flexsparse``: a HybridAttention and the layer's modes);
* a mask function (``AttentionMaskInterface``), called once per forward by ``create_causal_mask``; instead of a
  4-D mask it returns a :class:`~flexsparse.integrations.forward_mask.ForwardMask` holding the 2-D padding mask,
  from which every layer takes shared token positions.

``generate()`` gets a :class:`~flexsparse.integrations.kv_cache.SparseKVCache` through transformers' public
API only: the converted *instance*'s ``generate`` (the class is untouched) passes one, sized for the generation,
as the cache argument of transformers' own ``generate`` (``past_key_values=``; ``cache=`` from transformers
5.24), unless the call brings its own cache or asks for none. A call the sparse cache cannot serve is refused with
a ValueError saying what to pass (a static ``cache_implementation``, assisted generation); another dynamic
``cache_implementation`` is honoured with a warning that every head then keeps every key. :func:`revert` removes
the wrapper and the per-module state and restores the model's previous attention implementation.
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Mapping, Sequence

import torch
from torch import Tensor, nn
from transformers.masking_utils import AttentionMaskInterface, causal_mask_function
from transformers.modeling_utils import AttentionInterface, PreTrainedModel

from flexsparse.integrations.forward_mask import ForwardMask
from flexsparse.integrations.graph_decode import GraphDecodeForward, decode_graphs_refusal_of
from flexsparse.integrations.kv_cache import SparseKVCache
from flexsparse.integrations.layer import RouterSettings, SparseAttentionLayer, sparse_layers
from flexsparse.integrations.routing import (
    RouterFactory,
    attach_router,
    check_router,
    routed_layer_attention,
    router_factory,
)
from flexsparse.masks import Pattern
from flexsparse.runtime.flex import as_kernel_options
from flexsparse.runtime.modes import mode_index
from flexsparse.validation import as_int

ATTENTION_NAME = "flexsparse"
"""The name flexsparse registers in transformers' attention and mask registries."""

_UNSUPPORTED_KWARGS = ("softcap", "s_aux", "sinks")
_CACHE_ARGUMENTS = ("cache", "past_key_values", "cache_params")  # generate()'s names for a cache, new and old
_DYNAMIC_CACHES = ("offloaded", "quantized")  # transformers' other dynamic caches: every head keeps every key
_ASSISTED_SETTINGS = ("prompt_lookup_num_tokens", "assistant_early_exit", "use_mtp")


# ----- the registered functions ----------------------------------------------------------------------------------

def flexsparse_mask(batch_size: int, q_length: int, kv_length: int, q_offset: int | Tensor | None = None,
                    kv_offset: int = 0, mask_function=causal_mask_function, attention_mask: Tensor | None = None,
                    device: torch.device | str = "cpu", **kwargs) -> ForwardMask:
    """transformers mask function: the 2-D padding mask of this forward, cut or padded to ``kv_length`` keys.
    ``q_offset``: the queries' first key slot (transformers passes the cached length); None: the last slots."""
    if mask_function is not causal_mask_function:
        raise ValueError("flexsparse runs causal attention with a 2-D padding mask; this model asked for another "
                         "mask (a sliding window, packed sequences, bidirectional or custom mask functions)")
    if kv_offset:
        raise ValueError(f"flexsparse needs every cached key (kv_offset 0), got kv_offset={kv_offset}")
    padding = None
    if attention_mask is not None:
        padding = attention_mask[:, :kv_length].to(device=device, dtype=torch.bool)
        if padding.shape[1] < kv_length:  # a static cache's empty slots
            padding = torch.nn.functional.pad(padding, (0, kv_length - padding.shape[1]), value=False)
    # queries follow the cached tokens; in a static cache that is not the end of the keys (its offset is a tensor:
    # one host sync per forward, static caches only)
    q_start = int(q_offset) if q_offset is not None and q_length < kv_length else None
    return ForwardMask(padding, batch_size, q_length, kv_length, device, q_start)


def check_attention_arguments(layer: SparseAttentionLayer, module: nn.Module, dropout: float, kwargs: dict) -> None:
    """ValueError for what a converted layer cannot run: the model's own sliding window, softcap / sinks, or
    attention dropout in training (every flexsparse attention function checks these)."""
    if kwargs.get("sliding_window") is not None:
        raise ValueError(f"{layer.where}: the model asks for its own sliding window "
                         f"({kwargs['sliding_window']}); flexsparse replaces the layer's attention pattern, see "
                         "flexsparse.convert")
    for name in _UNSUPPORTED_KWARGS:
        if kwargs.get(name) is not None:
            raise ValueError(f"{layer.where}: flexsparse does not support the attention argument {name!r}")
    if dropout and module.training:
        raise ValueError(f"{layer.where}: flexsparse has no attention dropout (got dropout={dropout}); set the "
                         "model's attention_dropout to 0")


def flexsparse_attention(module: nn.Module, query: Tensor, key: Tensor, value: Tensor,
                         attention_mask: ForwardMask | None, scaling: float | None = None, dropout: float = 0.0,
                         **kwargs) -> tuple[Tensor, None]:
    """transformers attention function: q ``[B, H, S_q, d]``, k/v ``[B, H_kv, S_kv, d]`` -> ``[B, S_q, H, d]``."""
    layer = getattr(module, "flexsparse", None)
    if not isinstance(layer, SparseAttentionLayer):
        raise ValueError(f"attention module {type(module).__name__} (layer {getattr(module, 'layer_idx', '?')}) "
                         "was not converted by flexsparse.convert")
    check_attention_arguments(layer, module, dropout, kwargs)
    if attention_mask is not None and not isinstance(attention_mask, ForwardMask):
        raise ValueError(f"{layer.where}: flexsparse needs transformers' 2-D padding mask, got a "
                         f"{type(attention_mask).__name__} mask (a prepared 4-D mask, or a model that builds its own "
                         "masks instead of create_causal_mask)")
    scale = None if scaling is None else float(scaling)
    if layer.router is not None:
        if attention_mask is not None and attention_mask.kv_len != key.shape[2]:
            raise ValueError(f"{layer.where}: the mask covers {attention_mask.kv_len} keys, the layer got "
                             f"{key.shape[2]}")
        return routed_layer_attention(layer, query, key, value, attention_mask, scale).transpose(1, 2), None
    cache_layer = layer.take_staged(key, value)
    if cache_layer is not None:
        out = cache_layer.attend(query, key, value, attention_mask, scale)
    else:
        if attention_mask is not None and attention_mask.kv_len != key.shape[2]:
            raise ValueError(f"{layer.where}: the mask covers {attention_mask.kv_len} keys, the layer got "
                             f"{key.shape[2]}")
        positions = None if attention_mask is None else attention_mask.positions()
        out = layer.attention(query, key, value, positions=positions, scale=scale)
    return out.transpose(1, 2), None


def register() -> None:
    """Register flexsparse's attention and mask functions with transformers (idempotent)."""
    AttentionInterface.register(ATTENTION_NAME, flexsparse_attention)
    AttentionMaskInterface.register(ATTENTION_NAME, flexsparse_mask)


# ----- finding a model's attention layers ------------------------------------------------------------------------

def _text_config(model: nn.Module):
    config = getattr(model, "config", None)
    if not isinstance(model, PreTrainedModel) or config is None:
        raise TypeError(f"model must be a transformers PreTrainedModel, got {type(model).__name__}")
    if getattr(config, "is_encoder_decoder", False):
        raise ValueError("flexsparse.convert supports decoder-only causal LMs, got an encoder-decoder model")
    return config.get_text_config(decoder=True)


def _routes_through_registry(module: nn.Module) -> bool:
    """Whether the module's forward calls transformers' attention registry (the source names it)."""
    try:
        source = inspect.getsource(type(module).forward)
    except (OSError, TypeError):
        return False
    return "ALL_ATTENTION_FUNCTIONS" in source


def _check_model_window(model: nn.Module, config) -> None:
    """ValueError for a model whose config defines a sliding window (``config.sliding_window``) that flexsparse
    cannot take over: one window for every layer (Mistral, Phi-3, ...; the message says how to convert it), or a
    window no layer uses while the model still builds its masks (Gemma 2/3 with every layer full)."""
    window = getattr(config, "sliding_window", None)
    if window is None:
        return
    name = type(model).__name__
    layer_types = getattr(config, "layer_types", None)
    if layer_types is None:
        raise ValueError(
            f"{name} attends within its own sliding window in every layer (config.sliding_window={window}: each "
            f"token sees only its last {window} tokens). flexsparse replaces each layer's attention with your "
            "patterns, so convert the model without its window: load it with from_pretrained(..., "
            "sliding_window=None) or set model.config.sliding_window = None before convert, and use the pattern "
            f"SinkWindow(sink=0, window={window}) where you want the model's own attention (Causal() attends "
            "every token)")
    if "sliding_attention" not in layer_types:
        raise ValueError(
            f"{name} defines a sliding window (config.sliding_window={window}) that none of its layers uses "
            "(layer_types are all full attention): models such as Gemma 2/3 still build a sliding-window mask at "
            "every forward, which flexsparse's attention cannot take. Convert a model whose layers and config "
            "agree: full attention everywhere without a window (config.sliding_window=None, where the model "
            "allows it), or its own sliding layers (flexsparse refuses those by layer)")


def attention_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(path, module)`` of each decoder layer's self-attention, in layer order; ValueError naming the layer when
    a layer has none, several, or one that does not call transformers' attention registry, is not causal, uses
    the model's own sliding window or logit softcapping (and for the model windows of :func:`_check_model_window`).
    """
    config = _text_config(model)
    num_layers = as_int("num_hidden_layers", config.num_hidden_layers, minimum=1)
    found: dict[int, list[tuple[str, nn.Module]]] = {}
    for path, module in model.named_modules():
        index = getattr(module, "layer_idx", None)
        if isinstance(index, int) and isinstance(getattr(module, "head_dim", None), int) and hasattr(module, "config"):
            found.setdefault(index, []).append((path, module))
    layer_types = getattr(config, "layer_types", None)
    layers = []
    for index in range(num_layers):
        candidates = found.get(index, [])
        if len(candidates) != 1:
            what = "no attention module" if not candidates else f"{len(candidates)} attention modules " + \
                ", ".join(path for path, _ in candidates)
            raise ValueError(f"layer {index}: found {what} (a module with layer_idx={index} and head_dim); "
                             "flexsparse.convert supports models whose layers have one self-attention module")
        path, module = candidates[0]
        where = f"layer {index} ({path}, {type(module).__name__})"
        if not _routes_through_registry(module):
            raise ValueError(f"{where} does not call transformers' attention registry (ALL_ATTENTION_FUNCTIONS); "
                             "flexsparse can only replace attention that goes through it")
        if getattr(module, "is_causal", True) is not True:
            raise ValueError(f"{where} is not causal; flexsparse supports causal self-attention only")
        layer_type = None if layer_types is None else layer_types[index]
        window = getattr(module, "sliding_window", None)
        if (layer_type not in (None, "full_attention")) or window is not None:
            raise ValueError(f"{where} uses the model's own {layer_type or 'sliding-window'} attention "
                             f"(sliding_window={window}); flexsparse replaces a layer's attention with your patterns, "
                             "so convert a model built with full attention (e.g. sliding_window=None) and express a "
                             "window as a pattern, e.g. SinkWindow(sink=0, window=...)")
        softcap = getattr(module, "attn_logit_softcapping", None)
        if softcap is not None:
            raise ValueError(f"{where} caps its attention logits (attn_logit_softcapping={softcap}, as Gemma 2 "
                             "does); flexsparse's attention has no logit softcapping")
        layers.append((path, module))
    _check_model_window(model, config)
    return layers


# ----- convert / revert --------------------------------------------------------------------------------------------

def _layer_patterns(patterns, num_layers: int) -> list[Mapping[str, Pattern]]:
    if isinstance(patterns, Mapping):
        return [patterns] * num_layers
    if isinstance(patterns, Sequence) and not isinstance(patterns, (str, bytes)):
        if len(patterns) != num_layers:
            raise ValueError(f"patterns has {len(patterns)} per-layer entries, the model has {num_layers} layers")
        for index, entry in enumerate(patterns):
            if not isinstance(entry, Mapping):
                raise TypeError(f"patterns for layer {index} must map names to Patterns, got {type(entry).__name__}")
        return list(patterns)
    raise TypeError("patterns must map names to Patterns (shared by every layer), or be one such mapping per layer, "
                    f"got {type(patterns).__name__}")


def _layer_modes(modes, patterns: list[Mapping[str, Pattern]], kv_heads: list[int],
                 tp_size: int = 1) -> list[list[int]]:
    """Per layer, per KV head mode indices; errors name the layer and the head (and, under tensor parallelism
    over ``tp_size`` ranks, modes given for one rank's heads instead of the layer's)."""
    if isinstance(modes, (str, bytes)) or not isinstance(modes, Sequence):
        raise TypeError(f"modes must be one list of per-KV-head pattern names or indices per layer, got "
                        f"{type(modes).__name__}")
    if len(modes) != len(patterns):
        raise ValueError(f"modes has {len(modes)} layers, the model has {len(patterns)}")
    result = []
    for index, (layer_modes, layer_patterns, heads) in enumerate(zip(modes, patterns, kv_heads)):
        if isinstance(layer_modes, Tensor):
            layer_modes = layer_modes.tolist()
        if isinstance(layer_modes, (str, bytes)) or not isinstance(layer_modes, Sequence):
            raise TypeError(f"modes for layer {index} must be a list of per-KV-head names or indices, got "
                            f"{type(layer_modes).__name__}")
        if len(layer_modes) != heads:
            if tp_size > 1 and len(layer_modes) * tp_size == heads:
                raise ValueError(f"modes for layer {index} has {len(layer_modes)} entries, one rank's share of its "
                                 f"{heads} KV heads under tensor parallelism over {tp_size} ranks: give the modes "
                                 f"of all {heads} KV heads (the same modes as on one device) on every rank")
            raise ValueError(f"modes for layer {index} has {len(layer_modes)} entries, layer {index} has {heads} "
                             "KV heads")
        names = list(layer_patterns)
        result.append([mode_index(names, mode, f"modes for layer {index}, KV head {head}")
                       for head, mode in enumerate(layer_modes)])
    return result


def _tensor_parallel_heads(model: PreTrainedModel, layers: list[tuple[str, nn.Module]],
                           heads: list[tuple[int, int, int]]) -> list[range] | None:
    """Each layer's KV heads on this rank when transformers sharded the model by heads (``tp_plan``), else None.
    ValueError naming the layer when its KV heads do not divide among the ranks or k_proj is not sharded so."""
    from flexsparse.integrations.tensor_parallel import (  # it imports this package
        check_sharded_heads,
        rank_kv_heads,
        tensor_parallel_rank,
    )

    placement = tensor_parallel_rank(model)
    if placement is None:
        return None
    rank, size = placement
    result = []
    for index, ((path, module), (_, num_kv, dim)) in enumerate(zip(layers, heads)):
        where = f"layer {index} ({path})"
        result.append(rank_kv_heads(num_kv, size, rank, where))
        check_sharded_heads(module, num_kv, dim, size, where)
    return result


def layer_heads(module: nn.Module) -> tuple[int, int, int]:
    """(query heads, KV heads, head_dim) of an attention module."""
    config = module.config
    num_heads = as_int("num_attention_heads", config.num_attention_heads, minimum=1)
    num_kv = getattr(config, "num_key_value_heads", None) or num_heads
    return num_heads, as_int("num_key_value_heads", num_kv, minimum=1), module.head_dim


def convert(model: PreTrainedModel, patterns: Mapping[str, Pattern] | Sequence[Mapping[str, Pattern]],
            modes: Sequence[Sequence[str | int]] | None = None, *, router: str | RouterFactory | None = None,
            router_options: Mapping | None = None, block_size: int = 128, backend: str = "auto",
            plan: str = "auto", decode_graphs: bool = False,
            kernel_options: dict | None = None) -> PreTrainedModel:
    """Run ``model``'s attention through flexsparse, in place; returns the model.

    ``patterns``: name -> Pattern shared by every layer, or one such mapping per layer. ``modes``: one list per
    layer of per-KV-head pattern names or indices (with a router: optional, the layers' default modes, all the
    router's full pattern when None). ``block_size``, ``backend``, ``plan``, ``kernel_options``:
    HybridAttention's, for every layer. ``kernel_options``: a dict passed to every compiled flex_attention launch
    as it is, overriding flexsparse's own choice of flex's backend; None (default) runs each launch on torch's
    Triton kernels or, where the device's measured table has them faster, on FlashAttention-4's
    (:mod:`flexsparse.runtime.flex`); :func:`save_config` does not write it. A converted
    model's forward runs every layer through its HybridAttention (padded batches included) and its ``generate()``
    uses a :class:`SparseKVCache` (see :func:`sparse_generate_cache`). Converting a converted model replaces its
    configuration. Models with their own sliding window or logit softcapping are refused (ValueError saying what
    to convert instead).

    ``router``: ``"head"`` (a :class:`~flexsparse.routers.HeadRouter` per layer, one decision per sequence and KV
    head, from key states), ``"layer"`` (:class:`~flexsparse.routers.LayerRouter`, one per sequence and layer,
    from query states), or a function ``layer_idx -> Router | None`` (None: that layer keeps its static modes).
    ``router_options`` (with "head" / "layer"): ``pool_size``, ``init_std``, and ``full`` / ``sparse``, the names
    of the two patterns a router chooses between (default: the first full pattern and the first other one). A
    routed model chooses each sequence's modes at prefill and reuses them at decode; ``generate()`` then uses a
    DynamicCache (every head keeps every key). See :mod:`flexsparse.integrations.routing`.

    Tensor parallelism: a model loaded with ``from_pretrained(..., distributed_config=DistributedConfig(tp_plan=
    "auto"))`` (transformers shards q/k/v
    by heads; each rank's attention receives its own heads) is converted on every rank with the same, global
    ``modes``; each rank runs its contiguous block of KV heads in their modes and its sparse KV cache holds them
    only (:mod:`flexsparse.integrations.tensor_parallel`). ValueError when a layer's KV heads are not divisible by
    the tensor-parallel size. Routers run there too: convert gives every rank the router weights of the group's
    first rank; a head router decides the rank's KV heads, a layer router gathers every head's pooled query
    states over the group, so each rank makes the single-process model's decisions for its heads.

    ``decode_graphs``: ``generate()`` runs each decode step (one token over the SparseKVCache) as the replay of a
    CUDA graph captured after two eager steps (:mod:`flexsparse.integrations.graph_decode`): the same kernels on
    the same values, so the same greedy tokens, with far less host time per step at small batches. It needs every
    layer's heads in at most two groups of full and token-exact SinkWindow heads (ValueError here otherwise: ESA
    and other patterns, routers), and at generate() a CUDA device and a prompt without padding or left-padded
    (ValueError naming why otherwise; beam search, which reorders the cache, is refused too).
    """
    if not isinstance(decode_graphs, bool):
        raise TypeError(f"decode_graphs must be a bool, got {type(decode_graphs).__name__}")
    kernel_options = as_kernel_options("kernel_options", kernel_options)
    register()
    layers = attention_layers(model)
    per_layer = _layer_patterns(patterns, len(layers))
    heads = [layer_heads(module) for _, module in layers]
    rank_heads = _tensor_parallel_heads(model, layers, heads)
    routers: list = [None] * len(layers)
    if router is not None:
        factory = router_factory(router, router_options, per_layer, [dim for _, _, dim in heads])
        for index, ((path, _), layer_patterns, (_, _, dim)) in enumerate(zip(layers, per_layer, heads)):
            routers[index] = factory(index)
            check_router(routers[index], index, f"layer {index} ({path})", dim, layer_patterns)
    elif router_options is not None:
        raise TypeError("router_options needs a router (router='head' or 'layer')")
    if modes is None:
        unrouted = [index for index, found in enumerate(routers) if found is None]
        if unrouted:
            raise ValueError(f"modes is required for layers without a router (layers {unrouted})")
        modes = [[found.full_mode] * kv for found, (_, kv, _) in zip(routers, heads)]
    tp_size = 1 if rank_heads is None else heads[0][1] // len(rank_heads[0])
    mode_indices = _layer_modes(modes, per_layer, [kv for _, kv, _ in heads], tp_size)
    group = None
    if rank_heads is not None and any(found is not None for found in routers):
        from flexsparse.integrations.tensor_parallel import tensor_parallel_group

        group = tensor_parallel_group(model)
    states = []
    for index, ((path, module), layer_patterns, (num_heads, num_kv, dim), layer_modes, layer_router) in enumerate(
            zip(layers, per_layer, heads, mode_indices, routers)):
        options = {"block_size": block_size, "backend": backend, "plan": plan,
                   "kernel_options": kernel_options}
        try:
            if rank_heads is None:
                state = SparseAttentionLayer(index, path, num_heads, num_kv, dim, layer_patterns, layer_modes,
                                             router=layer_router, **options)
            else:
                from flexsparse.integrations.tensor_parallel import TensorParallelLayer  # imports this module

                state = TensorParallelLayer(index, path, num_heads, num_kv, dim, layer_patterns, layer_modes,
                                            kv_heads=rank_heads[index], group=group, router=layer_router,
                                            **options)
        except (TypeError, ValueError) as err:
            raise type(err)(f"layer {index} ({path}): {err}") from err
        state.train(model.training)  # a router samples (Gumbel) only in training mode, as the model does
        parameter = next(module.parameters(), None)
        states.append(state if parameter is None else state.to(parameter.device))
    if group is not None:
        from flexsparse.integrations.tensor_parallel import broadcast_routers

        broadcast_routers(states, group)  # every rank decides with the same weights
    if decode_graphs:
        refusal = decode_graphs_refusal_of(states)
        if refusal is not None:
            raise ValueError(f"decode_graphs=True: {refusal}")
    previous = getattr(model, "_flexsparse_previous_attention", None) or model.config._attn_implementation
    _detach(model)
    settings = RouterSettings()
    for (path, module), state in zip(layers, states):
        module.flexsparse = state
        if state.router is not None:
            attach_router(module, state, settings, f"layer {state.layer_idx} ({path})")
    model.set_attn_implementation(ATTENTION_NAME)
    if model.config._attn_implementation != ATTENTION_NAME:
        _detach(model)
        raise ValueError(f"{type(model).__name__} does not let transformers set its attention implementation "
                         "(set_attn_implementation refused), so flexsparse cannot route its attention")
    model._flexsparse_previous_attention = previous
    model._flexsparse_decode_graphs = decode_graphs
    installed = model.__dict__.get("generate")
    if not isinstance(installed, _GenerateWithSparseCache):
        model.generate = _GenerateWithSparseCache(model, installed)
    return model


def revert(model: PreTrainedModel) -> PreTrainedModel:
    """Undo :func:`convert`: the model's previous attention implementation, no flexsparse state, its own
    ``generate``."""
    if not sparse_layers(model):
        raise ValueError("revert: the model was not converted by flexsparse.convert")
    _detach(model)
    previous = model.__dict__.pop("_flexsparse_previous_attention", None) or "sdpa"
    model.__dict__.pop("_flexsparse_decode_graphs", None)
    installed = model.__dict__.pop("generate", None)
    if isinstance(installed, _GenerateWithSparseCache) and installed.previous is not None:
        model.generate = installed.previous
    model.set_attn_implementation(previous)
    return model


def _detach(model: nn.Module) -> None:
    """Remove every flexsparse state from the model's modules (caches built on them refuse further use)."""
    for module in list(model.modules()):
        state = getattr(module, "flexsparse", None)
        if isinstance(state, SparseAttentionLayer):
            state.attached = False
            state.remove_hooks()
            del module.flexsparse


def is_converted(model: nn.Module) -> bool:
    return bool(sparse_layers(model))


def layer_modes(model: nn.Module) -> list[list[str]]:
    """Each converted layer's per-KV-head mode names."""
    return [layer.mode_names for layer in sparse_layers(model)]


# ----- generate() ---------------------------------------------------------------------------------------------------

def cache_argument(model: PreTrainedModel) -> str:
    """The keyword under which ``model``'s forward and ``generate()`` take a cache: ``"cache"`` from transformers
    5.24, ``"past_key_values"`` before (5.24 still accepts it, with a deprecation warning)."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def _generate_call(model: PreTrainedModel, args: tuple, kwargs: dict) -> dict | None:
    """``generate(*args, **kwargs)``'s arguments by name, its ``**kwargs`` among them; None when they do not bind
    to its signature (generate() itself then reports the call's error)."""
    signature = inspect.signature(type(model).generate)
    try:
        bound = signature.bind(model, *args, **kwargs)
    except TypeError:
        return None
    call = {}
    for name, value in bound.arguments.items():
        kind = signature.parameters[name].kind
        if kind is inspect.Parameter.VAR_KEYWORD:
            call.update(value)
        elif kind is not inspect.Parameter.VAR_POSITIONAL:
            call[name] = value
    return call


def sparse_generate_cache(model: PreTrainedModel, *args, **kwargs) -> SparseKVCache | None:
    """The cache a converted model's ``generate(*args, **kwargs)`` gets: a :class:`SparseKVCache` sized for the
    generation, or None where the call keeps what it asked for (its own cache, ``use_cache=False``, transformers'
    other dynamic caches with a warning, a routed model's DynamicCache, an assistant model's with a warning).
    ValueError for calls the sparse cache cannot serve: static caches (generate() prepares 4-D masks for them)
    and assisted generation (it crops the cache); the message names what to pass instead."""
    call = _generate_call(model, args, kwargs)
    if call is None:
        return None
    given = next((call[name] for name in _CACHE_ARGUMENTS if call.get(name) is not None), None)
    if getattr(given, "is_compileable", False):
        raise ValueError("generate() with a static (compileable) cache prepares 4-D masks, which flexsparse's "
                         "attention does not take; use the default sparse KV cache or a DynamicCache (a static "
                         "cache works in direct model calls)")
    if given is not None:
        return None
    configs = [config for config in (call.get("generation_config"), getattr(model, "generation_config", None))
               if config is not None]

    def setting(name: str):
        """As generate() resolves it: the call's keyword, then its generation_config, then the model's."""
        if name in call:
            return call[name]
        return next((getattr(config, name) for config in configs if getattr(config, name, None) is not None), None)

    name = cache_argument(model)
    implementation = setting("cache_implementation")
    if implementation == "hybrid":  # generate() drops it: the old default of sliding-window models' configs
        implementation = None
    if setting("use_cache") is False:
        return None
    if implementation not in (None, "dynamic", *_DYNAMIC_CACHES):
        raise ValueError(f"generate(cache_implementation={implementation!r}): flexsparse's attention serves "
                         "dynamic caches only (a static cache makes generate() prepare 4-D masks); leave "
                         "cache_implementation unset for the sparse KV cache, or pass "
                         f"{name}=transformers.DynamicCache()")
    if implementation in _DYNAMIC_CACHES:
        warnings.warn(f"generate(cache_implementation={implementation!r}) builds transformers' own cache, in which "
                      "every head of the converted model keeps every key; flexsparse's SparseKVCache (the default "
                      "without cache_implementation) keeps only what each head attends", stacklevel=3)
        return None
    if any(layer.router is not None for layer in sparse_layers(model)):
        return None  # modes chosen per sequence: every head keeps every key (see convert)
    if setting("is_assistant"):
        warnings.warn("a converted model generating as an assistant uses transformers' DynamicCache (every head "
                      "keeps every key): assisted generation crops the cache, which flexsparse's SparseKVCache "
                      "cannot", stacklevel=3)
        return None
    if call.get("assistant_model") is not None or any(setting(option) for option in _ASSISTED_SETTINGS):
        raise ValueError("assisted generation (an assistant model, prompt lookup, early exit or multi-token "
                         "prediction) crops the cache after rejected tokens, which flexsparse's SparseKVCache "
                         f"cannot; pass {name}=transformers.DynamicCache() to generate this way (every head then "
                         "keeps every key)")
    return SparseKVCache(model, max_length=_generation_length(call, setting))


def _generation_length(call: Mapping, setting) -> int | None:
    """The most tokens generate() caches, as transformers sizes its caches (the prompt plus ``max_new_tokens``,
    else ``max_length``, minus the last token, which is never cached); None when the call sets neither (the cache
    grows)."""
    prompt = next((t.shape[1] for t in (call.get("inputs_embeds"), call.get("inputs"), call.get("input_ids"))
                   if isinstance(t, Tensor) and t.dim() >= 2), None)
    new_tokens, max_length = setting("max_new_tokens"), setting("max_length")
    if new_tokens is not None:
        return None if prompt is None else max(1, prompt + int(new_tokens) - 1)
    return None if max_length is None else max(1, int(max_length) - 1)


class _GenerateWithSparseCache:
    """A converted model's ``generate``: transformers' own (or the instance's earlier override, ``previous``),
    given the cache of :func:`sparse_generate_cache` as its cache argument. With ``convert(...,
    decode_graphs=True)`` the model's forward is, for the call, a
    :class:`~flexsparse.integrations.graph_decode.GraphDecodeForward`: its decode steps replay a CUDA graph."""

    def __init__(self, model: PreTrainedModel, previous=None) -> None:
        self.model = model
        self.previous = previous

    def __call__(self, *args, **kwargs):
        model = self.model
        cache = sparse_generate_cache(model, *args, **kwargs)
        if cache is not None:
            for name in _CACHE_ARGUMENTS:  # an explicit None under another name would clash with ours
                if name in kwargs and kwargs[name] is None:
                    del kwargs[name]
            kwargs[cache_argument(model)] = cache
        generate = self.previous if self.previous is not None else type(model).generate.__get__(model)
        if not getattr(model, "_flexsparse_decode_graphs", False):
            return generate(*args, **kwargs)
        if cache is None:
            cache = next((kwargs[name] for name in _CACHE_ARGUMENTS if kwargs.get(name) is not None), None)
        if not isinstance(cache, SparseKVCache):
            raise ValueError("the model was converted with decode_graphs=True, which replays decode steps over "
                             f"flexsparse's SparseKVCache; this generate() call uses {type(cache).__name__} "
                             "(use_cache=False, another cache or cache_implementation); convert without "
                             "decode_graphs for it")
        installed = model.__dict__.get("forward")
        model.forward = GraphDecodeForward(model, cache, model.forward)
        try:
            return generate(*args, **kwargs)
        finally:
            model.forward.close()
            if installed is None:
                del model.forward
            else:
                model.forward = installed
