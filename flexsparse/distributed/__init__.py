"""Several devices on torch.distributed: sequence-parallel attention (DeepSpeed-Ulysses style all-to-all)."""

from flexsparse.distributed.ulysses import ExchangeBytes, UlyssesAttention, shard_sequence

__all__ = ["ExchangeBytes", "UlyssesAttention", "shard_sequence"]
