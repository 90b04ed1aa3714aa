"""Running a transformers model with an attention function of ours, registered for the time of a call.

Calibration captures each layer's q/k/v (:mod:`flexsparse.eval.calibration`, :mod:`flexsparse.eval.xa_calibration`)
and gates mix full and sparse attention (:mod:`flexsparse.eval.gates`) through transformers' attention registry:
:func:`attention_swapped` registers the function (with SDPA's mask), hands each attention module its state, switches
the model to it and restores everything afterwards. No model code is copied or patched.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

from torch import nn
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
from transformers.modeling_utils import AttentionInterface

from flexsparse.integrations.transformers import attention_layers, is_converted


@contextlib.contextmanager
def attention_swapped(model: nn.Module, name: str, attention: Callable, attribute: str,
                      state: Callable[[int, nn.Module], object]) -> Iterator[list[nn.Module]]:
    """Run ``model`` with ``attention`` registered as ``name`` in transformers' attention registry (SDPA's mask);
    each attention module carries ``state(index, module)`` as ``attribute`` meanwhile. Restores the
    implementation and removes the attributes; yields the attention modules."""
    if is_converted(model):
        raise ValueError("calibration runs the model's own attention: revert it first (flexsparse.revert(model))")
    AttentionInterface.register(name, attention)
    AttentionMaskInterface.register(name, sdpa_mask)
    modules = [module for _, module in attention_layers(model)]
    previous = model.config._attn_implementation
    for index, module in enumerate(modules):
        setattr(module, attribute, state(index, module))
    try:
        model.set_attn_implementation(name)
        if model.config._attn_implementation != name:
            raise ValueError(f"{type(model).__name__} refused set_attn_implementation({name!r}); calibration needs "
                             "a model whose attention goes through transformers' registry")
        yield modules
    finally:
        model.set_attn_implementation(previous)
        for module in modules:
            if hasattr(module, attribute):
                delattr(module, attribute)
