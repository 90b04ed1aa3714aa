"""One launch for a decode step's device-side bounds (:class:`~flexsparse.cache.device_steps.DeviceSteps`).

Before each replayed decode step the sparse cache computes, from its device counters, every group's slot range and
write slot and the model's positions, then advances the counters. As separate PyTorch ops that is about a dozen
tiny kernels, inside a CUDA graph about 25 us on an H100: a third of a one-layer step at 131K cached tokens. This
kernel does it in one program.

Per row b (``tokens`` the slots filled so far, ``real[b]`` the real tokens among them, padding first):

* every-key groups: ``lo = tokens - real[b]``, ``hi = tokens + 1``, ``slot = tokens``;
* ring r of ``(sink, window, capacity)``: ``lo = 0`` (never written), ``hi = min(real[b] + 1, capacity)``,
  ``slot = real[b]`` below the sink, else ``sink + (real[b] - sink) % window``;
* ``position_ids[b] = next_positions[b]``, ``cache_position = tokens``;

then ``tokens``, ``real`` and ``next_positions`` advance by one: the PyTorch ops of
:meth:`~flexsparse.cache.device_steps.DeviceSteps.begin_step` off CUDA, in one program.
"""

from __future__ import annotations

import triton
import triton.language as tl

from flexsparse.kernels.launch import CompiledLaunch


@triton.jit
def _step_bounds_kernel(tokens, real, next_positions, every, rings, ring_params, position_ids, cache_position,
                        B, B_PAD: tl.constexpr, RINGS: tl.constexpr):
    rows = tl.arange(0, B_PAD)
    ok = rows < B
    filled = tl.load(tokens)
    real_b = tl.load(real + rows, mask=ok, other=0)
    tl.store(every + rows, filled - real_b, mask=ok)  # lo
    tl.store(every + B + rows, tl.zeros_like(real_b) + filled + 1, mask=ok)  # hi
    tl.store(every + 2 * B + rows, tl.zeros_like(real_b) + filled, mask=ok)  # slot
    for r in tl.static_range(RINGS):
        sink = tl.load(ring_params + 3 * r)
        window = tl.load(ring_params + 3 * r + 1)
        capacity = tl.load(ring_params + 3 * r + 2)
        slot = tl.where(real_b < sink, real_b, sink + (real_b - sink) % window)
        tl.store(rings + (3 * r + 1) * B + rows, tl.minimum(real_b + 1, capacity), mask=ok)
        tl.store(rings + (3 * r + 2) * B + rows, slot, mask=ok)
    position = tl.load(next_positions + rows, mask=ok, other=0)
    tl.store(position_ids + rows, position, mask=ok)
    tl.store(next_positions + rows, position + 1, mask=ok)
    tl.store(real + rows, real_b + 1, mask=ok)
    tl.store(cache_position, filled)
    tl.store(tokens, filled + 1)


def step_bounds_launch(batch: int, rings: int) -> CompiledLaunch:
    """The kernel for ``batch`` rows and ``rings`` ring shapes, its integers fixed; call it with (tokens ``[1]``,
    real ``[B]``, next_positions ``[B, 1]``, every ``[3, B]``, rings ``[R, 3, B]``, ring_params ``[R, 3]``,
    position_ids ``[B, 1]``, cache_position ``[1]``), all int64 contiguous on one device."""
    return CompiledLaunch(_step_bounds_kernel, (1,), (batch,),
                          dict(B_PAD=max(16, triton.next_power_of_2(batch)), RINGS=rings), dict(num_warps=1))
