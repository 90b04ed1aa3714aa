"""The one-launch decode step: a layer's whole one-token step over up to two stores in one kernel call.

:class:`FusedDecodeExecutor` decodes heads whose store holds only keys the query attends (every earlier key, or a
sink + window ring) when the step's views give each row a slot range (no padding, or a left-padded prompt): it
writes the new token into both stores and attends both in one call of
:class:`~flexsparse.kernels.decode.DecodeStep` (prepared once per set of buffers; no per-group copies, no cat).
It prefers CUDA; the cache's ``one_launch_decode=True`` also runs it under the Triton interpreter.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import Tensor

from flexsparse.kernels.availability import kernels_preferred_on, kernels_run_on
from flexsparse.kernels.decode_reference import MAX_HEAD_DIM, DecodeGroup
from flexsparse.masks import Pattern
from flexsparse.runtime.call import AttentionCall, GroupModes, HeadSelection
from flexsparse.runtime.executors import Executor

if TYPE_CHECKING:
    from flexsparse.kernels.decode import DecodeStep
    from flexsparse.runtime.decode import DecodeCall

MAX_GROUPS = 2
"""The stores one launch takes (the kernel's two buffer sets)."""


class FusedDecodeExecutor(Executor):
    """A layer's decode step in one kernel call (decode only: it runs no prefill or chunk)."""

    name = "fused_decode"
    fuses_decode = True
    writes_new_token = True

    def __init__(self) -> None:
        self._step: DecodeStep | None = None  # prepared for the last step's buffers

    def accepts(self, pattern: Pattern, call: AttentionCall) -> bool:
        return False

    def cost(self, patterns, call):
        return float("inf")

    def run(self, call: AttentionCall, patterns, modes: GroupModes, heads: HeadSelection) -> Tensor:
        raise TypeError("the fused decode executor runs decode steps only")

    def accepts_decode(self, call: DecodeCall) -> bool:
        """Up to two stores of consecutive KV heads, each read whole over a per-row slot range, head dims the
        kernel takes, on a device where the kernels run (preferred there, unless the cache asks for them)."""
        device = call.q.device
        if call.fused is False or not (kernels_preferred_on(device) if call.fused is None else kernels_run_on(device)):
            return False
        return (call.q.shape[2] == 1 and len(call.groups) <= MAX_GROUPS and call.q.shape[-1] <= MAX_HEAD_DIM
                and all(group.pattern is not None and group.pattern.decode_reads.attends_every_stored_key
                        and group.view.ranged and group.store.heads.slice is not None for group in call.groups))

    def decode(self, call: DecodeCall) -> Tensor:
        """Write the new token into every store and attend them: ``[B, H, 1, d]`` of the layer's query heads."""
        groups = [DecodeGroup(group.store.keys, group.store.values, group.store.heads.slice.start, group.view.lo,
                              group.view.hi, group.view.slot) for group in call.groups]
        step = self._step
        if step is None or not step.accepts(call.q, call.key, call.value, groups, call.scale):
            from flexsparse.kernels.decode import DecodeStep  # triton: imported where it runs

            step = self._step = DecodeStep(call.q, call.key, call.value, groups, call.scale)
        return step(call.q, call.key, call.value, groups)
