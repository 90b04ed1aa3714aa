"""A sparse KV cache's decode steps driven from the device (for CUDA graphs): :class:`DeviceSteps`."""

from __future__ import annotations

import torch
from torch import Tensor

from flexsparse.cache.capacity import ring_slot_of
from flexsparse.cache.stores import KVStore, RingStore
from flexsparse.cache.views import StepView
from flexsparse.kernels.availability import kernels_preferred_on


class DeviceSteps:
    """A cache's decode-step state on the device, shared by its layers.

    Counters, int64 on the cache's device: ``tokens`` ``[1]``, the slots each row filled before the next step
    (padding included); ``real`` ``[B]``, the real tokens of each row among them; ``next_positions`` ``[B, 1]``,
    the next step's position ids. :meth:`begin_step` computes a step's static buffers from them -- the model's
    ``position_ids`` ``[B, 1]`` and ``cache_position`` ``[1]``, each store's lo/hi/slot ``[B]`` -- and advances
    them by one token, all on the device: a recorded step reads and advances the same tensors at every replay.
    ``rings``: (sink, window, capacity) of every ring store the steps serve.
    """

    def __init__(self, tokens: int, real: Tensor, positions: Tensor, rings: set[tuple[int, int, int]]) -> None:
        device, batch = real.device, real.shape[0]
        self.tokens = torch.full((1,), tokens, dtype=torch.long, device=device)
        self.real = real.to(torch.long).clone()
        self.next_positions = positions.to(device, torch.long).contiguous().clone()
        self.position_ids = self.next_positions.clone()
        self.cache_position = self.tokens.clone()
        self.ring_params = sorted(rings)  # (sink, window, capacity) per ring shape
        self._every = torch.zeros(3, batch, dtype=torch.long, device=device)  # lo, hi, slot of every-key stores
        self._rings = torch.zeros(max(1, len(self.ring_params)), 3, batch, dtype=torch.long, device=device)
        self._ring_index = {key: r for r, key in enumerate(self.ring_params)}
        self._launch = None
        if kernels_preferred_on(device):  # one launch instead of a dozen tiny ops (flexsparse.kernels.decode_steps)
            from flexsparse.kernels.decode_steps import step_bounds_launch  # triton: imported where it runs

            self._launch = step_bounds_launch(batch, len(self.ring_params))
            self._ring_table = torch.tensor(self.ring_params or [(0, 1, 0)], dtype=torch.long, device=device)

    def begin_step(self) -> None:
        """This step's buffers from the counters, then the counters one token on (device work only: no host int
        enters a tensor, no sync): one kernel on CUDA, PyTorch ops elsewhere."""
        if self._launch is not None:
            self._launch(self.tokens, self.real, self.next_positions, self._every, self._rings, self._ring_table,
                         self.position_ids, self.cache_position)
            return
        self.step_with_torch()

    def step_with_torch(self) -> None:
        """:meth:`begin_step` as PyTorch ops (the path off CUDA; the kernel's reference)."""
        lo, hi, slot = self._every
        torch.sub(self.tokens, self.real, out=lo)  # a row's real tokens are its last slots (every slot: no padding)
        hi.copy_(self.tokens + 1)
        slot.copy_(self.tokens)
        for r, (sink, window, capacity) in enumerate(self.ring_params):  # ring lo stays 0
            torch.clamp(self.real + 1, max=capacity, out=self._rings[r, 1])
            self._rings[r, 2].copy_(ring_slot_of(self.real, sink, window))  # the new token is real token `real`
        self.position_ids.copy_(self.next_positions)
        self.cache_position.copy_(self.tokens)
        self.tokens += 1
        self.real += 1
        self.next_positions += 1

    def view(self, store: KVStore) -> StepView:
        """The step's view of one store (its bounds: static buffers of this state)."""
        if isinstance(store, RingStore):
            lo, hi, slot = self._rings[self._ring_index[(store.sink, store.window, store.capacity)]].unbind(0)
        else:
            lo, hi, slot = self._every.unbind(0)
        return StepView(store.capacity, slot, lo, hi)
