"""`flexsparse demo --hf`: a tiny random Llama converted with mixed modes, on CPU, in seconds.

It checks that all-full flexsparse gives the model's own attention (sdpa) logits and tokens, converts the model to
mixed modes (per layer one or no full KV head, the rest sink + window), generates 32 tokens from a padded batch
with the sparse KV cache, checks them against a full recompute through HybridAttention at every step
(``use_cache=False``), and reports the KV memory against the model's own DynamicCache.

The CPU run uses the dense backend (masked SDPA on the patterns' dense references: exact and the fastest on CPU
at these sizes; compiled flex would spend ~25 s compiling on a CPU).
"""

from __future__ import annotations

import time

import torch

from flexsparse.integrations import SparseKVCache, convert, kv_memory_formula, revert
from flexsparse.masks import Causal, SinkWindow

LAYERS, HEADS, KV_HEADS, HEAD_DIM, VOCAB = 4, 8, 4, 16, 256
SINK, WINDOW = 16, 64
PROMPTS = (384, 200)  # tokens per sequence; the shorter one is left-padded
NEW_TOKENS = 32


def _model(device: torch.device):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=HEADS * HEAD_DIM, intermediate_size=256,
                         num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
                         max_position_embeddings=1024, initializer_range=0.1, attn_implementation="sdpa",
                         pad_token_id=0, bos_token_id=None, eos_token_id=None)
    torch.manual_seed(0)
    return LlamaForCausalLM(config).to(device).eval()


def _prompts(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    width = max(PROMPTS)
    ids = torch.zeros(len(PROMPTS), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, n in enumerate(PROMPTS):
        ids[row, width - n:] = torch.randint(1, VOCAB, (n,), generator=gen)
        mask[row, width - n:] = 1
    return ids.to(device), mask.to(device)


def _generate(model, ids, mask, **kwargs):
    return model.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                          do_sample=False, return_dict_in_generate=True, **kwargs)


def _cache(output):
    """The cache of a generate() output (``cache`` from transformers 5.24, ``past_key_values`` before)."""
    found = output.get("cache")
    return output.get("past_key_values") if found is None else found


def _kv_bytes(cache) -> int:
    if isinstance(cache, SparseKVCache):
        return cache.memory_bytes()
    return sum((layer.keys.numel() + layer.values.numel()) * layer.keys.element_size() for layer in cache.layers)


def mixed_modes() -> list[list[str]]:
    """Layer l < 3: KV head l full, the others sink + window; the last layer has no full head."""
    return [["full" if head == layer and layer < LAYERS - 1 else "ssa" for head in range(KV_HEADS)]
            for layer in range(LAYERS)]


def run_hf_demo(device: str = "cpu", backend: str = "dense", threads: int | None = 1) -> dict:
    """Run the demo, print its report and return the numbers. ``threads``: torch CPU threads during the demo
    (its matrices are tiny: one thread beats several, and a busy machine's cores do not slow it down)."""
    previous = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        with torch.no_grad():
            return _run(torch.device(device), backend)
    finally:
        torch.set_num_threads(previous)


def _run(dev: torch.device, backend: str) -> dict:
    start = time.perf_counter()
    model = _model(dev)
    ids, mask = _prompts(dev)
    real = mask.bool()
    own_logits = model(ids, attention_mask=mask).logits
    own = _generate(model, ids, mask)

    patterns = {"full": Causal(), "ssa": SinkWindow(SINK, WINDOW)}
    convert(model, patterns, [["full"] * KV_HEADS] * LAYERS, backend=backend)
    full_error = float((model(ids, attention_mask=mask).logits - own_logits)[real].abs().max())
    all_full = _generate(model, ids, mask)
    full_tokens = int((all_full.sequences == own.sequences)[:, ids.shape[1]:].sum())

    modes = mixed_modes()
    convert(model, patterns, modes, backend=backend)
    began = time.perf_counter()
    sparse = _generate(model, ids, mask)
    generate_s = time.perf_counter() - began
    recomputed = _generate(model, ids, mask, use_cache=False)
    cache_tokens = int((sparse.sequences == recomputed.sequences)[:, ids.shape[1]:].sum())
    length = ids.shape[1] + NEW_TOKENS - 1
    report = {
        "model": f"random Llama, {LAYERS} layers, {HEADS} query / {KV_HEADS} KV heads, head_dim {HEAD_DIM}, fp32",
        "device": str(dev), "backend": backend,
        "prompts": list(PROMPTS), "new_tokens": NEW_TOKENS, "patterns": {k: repr(v) for k, v in patterns.items()},
        "modes": modes,
        "all_full_max_logit_error": full_error,
        "all_full_tokens_equal": f"{full_tokens}/{NEW_TOKENS * len(PROMPTS)}",
        "sparse_cache_tokens_equal_recompute": f"{cache_tokens}/{NEW_TOKENS * len(PROMPTS)}",
        "kv_bytes_dynamic_cache": _kv_bytes(_cache(own)),
        "kv_bytes_sparse_cache": _kv_bytes(_cache(sparse)),
        "kv_bytes_formula": kv_memory_formula(model, len(PROMPTS), length, torch.float32),
        "generate_s": generate_s,
    }
    report["kv_saved"] = report["kv_bytes_dynamic_cache"] / report["kv_bytes_sparse_cache"]
    revert(model)
    report["total_s"] = time.perf_counter() - start
    _print(report)
    return report


def _print(r: dict) -> None:
    mib = lambda b: f"{b / 2**20:.2f} MiB"
    print(f"flexsparse demo --hf: {r['model']} on {r['device']} ({r['backend']} backend)")
    print(f"  prompts of {r['prompts']} tokens (left-padded batch), {r['new_tokens']} new tokens each, "
          f"patterns {r['patterns']}")
    print(f"  all heads full vs the model's own sdpa: max |logit error| {r['all_full_max_logit_error']:.2e}, "
          f"generated tokens equal {r['all_full_tokens_equal']}")
    print("  mixed modes per layer: " + " | ".join(",".join(m) for m in r["modes"]))
    print(f"  sparse KV cache vs full recompute (use_cache=False): tokens equal "
          f"{r['sparse_cache_tokens_equal_recompute']}")
    print(f"  KV memory: DynamicCache {mib(r['kv_bytes_dynamic_cache'])}, sparse cache "
          f"{mib(r['kv_bytes_sparse_cache'])} (formula {mib(r['kv_bytes_formula'])}): {r['kv_saved']:.2f}x less")
    print(f"  generate with the sparse cache: {r['generate_s']:.2f} s; demo total {r['total_s']:.1f} s")
