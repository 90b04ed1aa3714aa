"""Several devices on torch.distributed: sequence-parallel attention (DeepSpeed-Ulysses style all-to-all), of one
layer or of a converted transformers model (:mod:`.ulysses_lm`), and tensor-parallel inference of transformers
models sharded by transformers (``distributed_config=DistributedConfig(tp_plan="auto")``;
:mod:`flexsparse.integrations.tensor_parallel`, re-exported here). The
names of both modules are imported on first use: they need transformers."""

from flexsparse.distributed.ulysses import ExchangeBytes, UlyssesAttention, shard_sequence

_TENSOR_PARALLEL = ("RankAttention", "TensorParallelLayer", "rank_kv_heads", "rank_tiles", "tensor_parallel_rank")
_ULYSSES_MODEL = ("ULYSSES_ATTENTION_NAME", "UlyssesCausalLM", "last_exchanges", "shard_batch", "ulysses_model")


def __getattr__(name: str):
    if name in _TENSOR_PARALLEL:
        from flexsparse.integrations import tensor_parallel

        return getattr(tensor_parallel, name)
    if name in _ULYSSES_MODEL:
        from flexsparse.distributed import ulysses_lm

        return getattr(ulysses_lm, name)
    raise AttributeError(f"module 'flexsparse.distributed' has no attribute {name!r}")


__all__ = [
    "ULYSSES_ATTENTION_NAME",
    "ExchangeBytes",
    "RankAttention",
    "TensorParallelLayer",
    "UlyssesAttention",
    "UlyssesCausalLM",
    "last_exchanges",
    "rank_kv_heads",
    "rank_tiles",
    "shard_batch",
    "shard_sequence",
    "tensor_parallel_rank",
    "ulysses_model",
]
