"""Several devices on torch.distributed: sequence-parallel attention (DeepSpeed-Ulysses style all-to-all), and
tensor-parallel inference of transformers models sharded with ``tp_plan="auto"`` (:mod:`.tensor_parallel`; its
names are imported on first use: they need transformers)."""

from flexsparse.distributed.ulysses import ExchangeBytes, UlyssesAttention, shard_sequence

_TENSOR_PARALLEL = ("RankAttention", "TensorParallelLayer", "rank_kv_heads", "rank_tiles", "tensor_parallel_rank")


def __getattr__(name: str):
    if name in _TENSOR_PARALLEL:
        from flexsparse.distributed import tensor_parallel

        return getattr(tensor_parallel, name)
    raise AttributeError(f"module 'flexsparse.distributed' has no attribute {name!r}")


__all__ = ["ExchangeBytes", "RankAttention", "TensorParallelLayer", "UlyssesAttention", "rank_kv_heads", "rank_tiles",
           "shard_sequence", "tensor_parallel_rank"]
