"""Tiny random transformers causal LMs (fp32, CPU) and helpers for the integration tests."""

from __future__ import annotations

import pytest
import torch

from flexsparse.masks import Causal, SinkWindow

transformers = pytest.importorskip("transformers")

VOCAB, LAYERS, HEADS, KV_HEADS, HEAD_DIM = 96, 3, 4, 2, 16

PATTERNS = {"full": Causal(), "ssa": SinkWindow(2, 6), "ssa2": SinkWindow(0, 5)}
"""Patterns to convert the tiny models with: full heads and two sink+window rings (8 and 5 slots)."""
MIXED = [["full", "ssa"], ["ssa2", "ssa2"], ["ssa", "full"]]
"""Modes [LAYERS][KV_HEADS] over PATTERNS: full + ring, two rings, ring + full."""


def tiny_config(kind: str, **overrides):
    common = dict(vocab_size=VOCAB, hidden_size=HEADS * HEAD_DIM, intermediate_size=96, num_hidden_layers=LAYERS,
                  num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=256,
                  initializer_range=0.1, attn_implementation="sdpa", pad_token_id=0, eos_token_id=None,
                  bos_token_id=None)
    if kind == "llama":
        return transformers.LlamaConfig(**{**common, **overrides})
    if kind == "qwen3":
        return transformers.Qwen3Config(**{**common, "head_dim": HEAD_DIM, **overrides})
    if kind == "mistral":
        return transformers.MistralConfig(**{**common, "head_dim": HEAD_DIM, "sliding_window": None, **overrides})
    raise ValueError(kind)


MODEL_CLASSES = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM", "mistral": "MistralForCausalLM"}


def tiny_model(kind: str = "llama", seed: int = 0, **overrides):
    torch.manual_seed(seed)
    model = getattr(transformers, MODEL_CLASSES[kind])(tiny_config(kind, **overrides))
    return model.eval()


def byte_tokenizer():
    """A transformers tokenizer of single bytes (ids 0-255, byte-level) with ``<eos>`` (id 256) as its EOS and pad
    token and no BOS: real tokenizer behaviour (batch encodings, decoding, special tokens) without a download."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    core = Tokenizer(models.BPE(vocab={char: i for i, char in enumerate(alphabet)}, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<eos>", pad_token="<eos>")


def left_padded(lengths: list[int], seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and attention mask ``[B, max(lengths)]`` with the padding on the left."""
    gen = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.zeros(len(lengths), width, dtype=torch.long)
    mask = torch.zeros(len(lengths), width, dtype=torch.long)
    for row, n in enumerate(lengths):
        ids[row, width - n:] = torch.randint(1, VOCAB, (n,), generator=gen)
        mask[row, width - n:] = 1
    return ids, mask


def right_padded(lengths: list[int], seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    ids, mask = left_padded(lengths, seed)
    for row, n in enumerate(lengths):
        ids[row] = torch.roll(ids[row], -(ids.shape[1] - n))
        mask[row] = torch.roll(mask[row], -(ids.shape[1] - n))
    return ids, mask


def returned_cache(output):
    """The cache a ``generate(..., return_dict_in_generate=True)`` output holds (``cache`` from transformers 5.24,
    ``past_key_values`` before)."""
    found = output.get("cache")
    return output.get("past_key_values") if found is None else found


def kv_tensor_bytes(cache) -> int:
    """Bytes of the distinct floating-point tensors reachable from a cache object through its attributes, lists,
    tuples and dicts (the keys and values it holds, whatever its class), not entering modules (a converted
    layer's state, which the cache refers to)."""
    seen, storages, total = set(), set(), 0
    pending = [cache]
    while pending:
        obj = pending.pop()
        if id(obj) in seen or isinstance(obj, torch.nn.Module):
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            storage = obj.untyped_storage()
            if obj.is_floating_point() and storage.data_ptr() not in storages:
                storages.add(storage.data_ptr())
                total += storage.nbytes()
        elif isinstance(obj, dict):
            pending.extend(obj.values())
        elif isinstance(obj, (list, tuple)):
            pending.extend(obj)
        elif hasattr(obj, "__dict__") or hasattr(obj, "__slots__"):
            pending.extend(getattr(obj, "__dict__", {}).values())
            pending.extend(getattr(obj, name) for name in getattr(obj, "__slots__", ()) if hasattr(obj, name))
    return total


def greedy(model, ids, mask, new_tokens: int, **kwargs) -> torch.Tensor:
    """``generate``'s greedy tokens after the prompt, ``[B, new_tokens]``."""
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                             do_sample=False, **kwargs)
    return out[:, ids.shape[1]:]


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny matrices: one thread avoids contention with other processes on a 2-core machine (60x faster)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
