"""Length buckets for compiled calls whose lengths change from call to call (decode, chunks, padded batches).

Compiled flex_attention specialises on sequence lengths, so a decode loop whose key length grows by one per step
would compile once per step. Calls with position tables (padding, decode, chunked prefill, caches) therefore run
at bucketed lengths: keys up to ``block_size x 2^k``, queries up to the next power of two. The added rows and slots
are padding (position -1 / ``span``): their tiles are empty and skipped, so the cost is the copy of q/k/v into the
padded length (none when the caller's buffers already have a bucket length, as a KV cache's capacity does).
A process thus compiles about log2(S_max / block_size) variants per pattern set. Contiguous prefill (no tables)
runs at its exact length.
"""

from __future__ import annotations


def next_power_of_two(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def kv_bucket(kv_len: int, block_size: int) -> int:
    """Keys: ``block_size`` times a power of two."""
    return block_size * next_power_of_two(-(-kv_len // block_size))


def q_bucket(q_len: int, block_size: int) -> int:
    """Queries: the next power of two (short decode chunks stay short, so flex's decoding kernel applies)."""
    return next_power_of_two(q_len)
