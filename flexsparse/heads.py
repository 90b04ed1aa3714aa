"""Grouped-query attention's two kinds of head: a layer of ``H`` query heads and ``H_kv`` KV heads shares each KV
head among a group of ``group_size = H // H_kv`` consecutive query heads (query head ``h`` reads KV head
``h // group_size``). These are the one place that goes from KV heads to their query heads."""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor


def query_heads(kv_heads: Sequence[int], group_size: int) -> list[int]:
    """The query heads of KV heads ``kv_heads``, in order: ``group_size`` per KV head."""
    return [h * group_size + i for h in kv_heads for i in range(group_size)]


def per_query_head(values: Tensor, group_size: int, dim: int) -> Tensor:
    """``values`` with one entry per KV head on ``dim`` (``[.., H_kv, ..]``) as one per query head
    (``[.., H, ..]``): each KV head's entry repeated for its ``group_size`` query heads (a copy)."""
    return values.repeat_interleave(group_size, dim=dim)
