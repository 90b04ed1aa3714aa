"""A converted model's one-token decode step captured in a CUDA graph and replayed per token.

At batch 1 a decode step of a converted model is bound by host time (Python, launches), not by its kernels.
:class:`GraphDecoder` records the model's whole decode forward (embedding, every layer with its sparse KV cache's
one-launch step, the head) once in a ``torch.cuda.CUDAGraph`` and replays it per token: the host then copies the
new token ids into a static input, replays, and advances each cache layer's token count.

What makes the step replayable: the cache runs device-side steps (:meth:`SparseKVCache.start_device_steps`): the
step's bounds (each group's slot range and write slot), its position ids and cache position are computed on the
device from device counters at the start of the step, and the counters advance on the device inside it. The
cache's buffers have their full capacity (its ``max_length``) before the capture, so no step reallocates.

Eligible: a converted model on CUDA whose cache is a :class:`SparseKVCache` with a ``max_length`` and a prompt
cached, every layer's heads at most two groups whose decode reads every earlier key or a sink and window (the
one-launch step of :class:`~flexsparse.runtime.fused_decode.FusedDecodeExecutor`), padding at most a left-padded
prompt, the same batch and dtype at every step, no more tokens than the cache's capacity. Anything else is
refused with a ValueError naming why (heads whose decode reads their own pattern such as ESA's, routed layers,
other padding, ...). ``generate()`` uses it with ``flexsparse.convert(..., decode_graphs=True)``
(:class:`GraphDecodeForward`).

Exactness: a replay runs the kernels of the eager one-launch step on the same values (the bounds and positions
equal the eager path's), so greedy tokens equal the eager path's (tests/test_graph_decode.py).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence

import torch
from torch import Tensor, nn

from flexsparse.cache import DeviceSteps
from flexsparse.integrations.kv_cache import SparseKVCache
from flexsparse.integrations.layer import SparseAttentionLayer
from flexsparse.kernels.availability import kernel_unavailable

WARMUP_STEPS = 2
"""Steps a :class:`GraphDecoder` runs eagerly (with the device-side state) before it captures the next one: the
first prepares the decode kernels' plans and compiles them, the second runs them as the capture will."""


class GraphDecoder:
    """One-token decode steps of a converted ``model`` over its prefilled sparse KV ``cache``, replayed from a CUDA
    graph (see the module docstring).

    ``forward``: the forward to record (default ``model.forward``; generate()'s override passes the forward it
    replaces). ``attention_mask`` ``[B, >= tokens]``: the cached tokens' 2-D padding mask (needed after a
    left-padded prompt), ``position_ids`` ``[B, 1]``: the first step's (later steps count on by one); see
    :meth:`SparseKVCache.start_device_steps`. ``capture``: None captures on CUDA and refuses elsewhere; False runs
    every step's recorded function eagerly instead (the same device-side state, no graph: for checking a model
    where the decode kernels run without CUDA, the Triton interpreter). Every new token is real (generate()'s
    decode).

    :meth:`step` takes the new token ids ``[B, 1]`` and returns the step's logits ``[B, 1, V]`` as a new tensor.
    The first ``WARMUP_STEPS`` steps run eagerly, the next one is captured and replayed, later ones replay. The
    cache's device-side state stays on until :meth:`close`.
    """

    def __init__(self, model: nn.Module, cache: SparseKVCache, *, forward: Callable | None = None,
                 attention_mask: Tensor | None = None, position_ids: Tensor | None = None,
                 capture: bool | None = None) -> None:
        if not isinstance(cache, SparseKVCache):
            raise TypeError(f"decode graphs need flexsparse's SparseKVCache, got {type(cache).__name__}")
        layer = cache.layers[0]
        device = getattr(layer, "device", None)
        if device is None or layer.tokens == 0:
            raise ValueError("decode graphs start after a prefill: the cache holds no prompt yet")
        if capture is None or capture:
            if device.type != "cuda":
                raise ValueError(f"decode graphs need CUDA (torch.cuda.CUDAGraph); the cache is on {device}")
            capture = True
        elif kernel_unavailable(device) is not None:
            raise ValueError(f"device-side decode steps need the decode kernels, which do not run on {device}: "
                             f"{kernel_unavailable(device)}")
        if any(layer.max_length is None for layer in cache.layers):  # the buffers could still grow
            raise ValueError("decode graphs need a SparseKVCache built with max_length (its buffers get their "
                             "full capacity before the capture; generate() passes its own)")
        self.model, self.cache, self.capture = model, cache, capture
        self.forward = model.forward if forward is None else forward
        self.batch, self.device = layer.batch, device
        self.steps: DeviceSteps = cache.start_device_steps(attention_mask, position_ids)
        self.input_ids = torch.zeros(self.batch, 1, dtype=torch.long, device=device)
        self._arguments = self._forward_arguments()
        self._warmup_left = WARMUP_STEPS
        self._graph: torch.cuda.CUDAGraph | None = None
        self._logits: Tensor | None = None  # the graph's output
        self._buffers: list[Tensor] | None = None  # the cache buffers the graph holds
        self.output = None
        """The forward's output of the last eager step (a transformers ModelOutput; its logits are that step's)."""

    def _forward_arguments(self) -> dict:
        """The recorded forward's keyword arguments besides the input ids: the cache, the device-side positions,
        no mask (device-side steps read none)."""
        parameters = inspect.signature(self.forward).parameters
        cache_name = "cache" if "cache" in parameters else "past_key_values"
        arguments = {cache_name: self.cache, "position_ids": self.steps.position_ids, "attention_mask": None,
                     "use_cache": True, "return_dict": True}
        if "cache_position" in parameters:  # transformers versions whose models take it
            arguments["cache_position"] = self.steps.cache_position
        return arguments

    @torch.no_grad()
    def forward_step(self) -> Tensor:
        """The function a graph records: the step's bounds and positions from the device counters (which then
        advance), and the model's forward on the static ``input_ids``; returns the logits ``[B, 1, V]``. Its
        Python advances the host-side state as any forward does (a replay does that by
        :meth:`SparseKVCache.replayed_step`)."""
        self.steps.begin_step()
        self.output = self.forward(input_ids=self.input_ids, **self._arguments)
        return self.output.logits

    @torch.no_grad()
    def step(self, input_ids: Tensor) -> Tensor:
        """One decode step of the new token ids ``[B, 1]``: logits ``[B, 1, V]`` (a new tensor)."""
        if not isinstance(input_ids, Tensor) or tuple(input_ids.shape) != (self.batch, 1) or \
                input_ids.dtype.is_floating_point or input_ids.device != self.device:
            got = (f"{list(input_ids.shape)} {input_ids.dtype} on {input_ids.device}"
                   if isinstance(input_ids, Tensor) else type(input_ids).__name__)
            raise ValueError(f"input_ids must be integer token ids [{self.batch}, 1] on {self.device} (the batch "
                             f"the graph was made for), got {got}")
        if self.cache.layers[0].device_steps is not self.steps:
            raise ValueError("the sparse KV cache left this decoder's device-side steps (stop_device_steps, reset "
                             "or another decoder); build a new GraphDecoder")
        tokens, room = self.cache.get_seq_length(0), self.cache.room()
        if tokens + 1 > room:
            raise ValueError(f"the sparse KV cache holds {room} tokens per sequence and is full; a decode graph "
                             "cannot grow it (build the cache with a larger max_length)")
        self.input_ids.copy_(input_ids)
        if self._graph is not None:
            self._check_buffers()
            self._graph.replay()
            self.cache.replayed_step()
            return self._logits.clone()
        if not self.capture or self._warmup_left > 0:
            self._warmup_left -= 1
            return self._eager_step()
        return self._capture()

    def _eager_step(self) -> Tensor:
        if not self.capture:
            return self.forward_step()
        side = torch.cuda.Stream(self.device)  # warm-up on a side stream, as before a capture (PyTorch's advice)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            logits = self.forward_step()
        torch.cuda.current_stream(self.device).wait_stream(side)
        return logits

    def _capture(self) -> Tensor:
        """Record this step (its Python runs once, advancing the host-side state), then replay it: the step."""
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self._logits = self.forward_step()
        self._graph, self._buffers = graph, self._cache_buffers()
        graph.replay()
        return self._logits.clone()

    def _cache_buffers(self) -> list[Tensor]:
        return [t for layer in self.cache.layers for store in layer.stores for t in (store.keys, store.values)]

    def _check_buffers(self) -> None:
        """The graph writes and reads the buffers it was recorded with: refuse when the cache holds others."""
        if any(a is not b for a, b in zip(self._buffers, self._cache_buffers())):
            raise ValueError("the sparse KV cache's buffers changed since the decode graph was captured (reset, "
                             "reordered or grown); build a new GraphDecoder")

    def close(self) -> None:
        """Release the graph and return the cache to host-driven steps (its host-side state is current)."""
        self.cache.stop_device_steps()
        self._graph = self._logits = self._buffers = None


def decode_graphs_refusal_of(layers: Sequence[SparseAttentionLayer]) -> str | None:
    """Why a model of these converted layers cannot graph its decode steps whatever the device and prompt (None:
    it can, given a CUDA device and at most a left-padded prompt): routed layers, heads whose decode reads their
    own pattern (not every earlier key, nor a sink and window), more than two head groups in a layer."""
    for layer in layers:
        if layer.router is not None:
            return f"{layer.where} is routed (its modes are chosen per sequence, so generate() uses a DynamicCache)"
        own = [group for group in layer.groups
               if group.pattern is None or not group.pattern.decode_reads.attends_every_stored_key]
        if own:
            which = repr(own[0].pattern) if own[0].pattern is not None else "mixed"
            return (f"{layer.where} has {which} heads (KV heads {list(own[0].kv_heads)}), whose decode reads their "
                    "own pattern; decode graphs take heads whose decode reads every earlier key or a sink and window")
        if len(layer.groups) > 2:
            return f"{layer.where} has {len(layer.groups)} head groups; the one-launch decode step takes two at most"
    return None


_FORWARD_INPUTS = {"input_ids", "attention_mask", "position_ids", "cache_position", "past_key_values", "cache",
                   "use_cache", "return_dict", "logits_to_keep", "inputs_embeds"}
"""The forward arguments a graphed decode step takes (any other one must be None or False)."""


class GraphDecodeForward:
    """A converted model's forward during one ``generate()`` with decode graphs (``convert(...,
    decode_graphs=True)``): one-token steps over the generation's :class:`SparseKVCache` go through a
    :class:`GraphDecoder` made at the first of them (the eager warm-up steps, then replays); every other call
    (the prefill) goes to ``previous``, the forward it stands in for. A step it cannot serve raises a ValueError
    naming why; a call to ``previous`` while graphed steps run ends them first (the cache then runs host-driven
    steps, and a later one-token step makes a new decoder)."""

    capture: bool | None = None
    """The decoders' ``capture`` (None: CUDA graphs; tests set False to run the device-side steps eagerly under
    the Triton interpreter)."""

    def __init__(self, model: nn.Module, cache: SparseKVCache, previous: Callable) -> None:
        self.model, self.cache, self.previous = model, cache, previous
        self.decoder: GraphDecoder | None = None
        # generate() reads the forward's signature (whether it takes position_ids, logits_to_keep, cache): keep it
        self.__signature__ = inspect.signature(previous)

    def __call__(self, *args, **kwargs):
        ids = kwargs.get("input_ids")
        cache = next((kwargs[name] for name in ("cache", "past_key_values") if kwargs.get(name) is not None), None)
        decode = (not args and cache is self.cache and isinstance(ids, Tensor) and ids.dim() == 2
                  and ids.shape[1] == 1 and kwargs.get("inputs_embeds") is None and cache.get_seq_length(0) > 0)
        if not decode:
            self.close()
            return self.previous(*args, **kwargs)
        other = sorted(name for name, value in kwargs.items() if name not in _FORWARD_INPUTS and value is not None
                       and value is not False)
        if other:
            raise ValueError(f"decode graphs run the model's plain decode step; generate() asked for "
                             f"{', '.join(other)} (convert without decode_graphs for these)")
        if self.decoder is None:
            self.decoder = GraphDecoder(self.model, self.cache, forward=self.previous,
                                        attention_mask=kwargs.get("attention_mask"),
                                        position_ids=kwargs.get("position_ids"), capture=self.capture)
        logits = self.decoder.step(ids)
        output = self.decoder.output
        return type(output)(**{**output, "logits": logits})

    def close(self) -> None:
        """End the graphed steps (the cache back to host-driven steps)."""
        if self.decoder is not None:
            self.decoder.close()
            self.decoder = None
