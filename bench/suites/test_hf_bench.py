"""pytest-benchmark suite of the transformers integration on a CUDA GPU (the full report with 128K, batch 8 and
end-to-end generate() is ``flexsparse bench --hf``).

One decode step of one layer at 32K cached tokens (Qwen3-8B-like attention, bf16, rho = 0.75): flexsparse's
attention function with its sparse KV cache (the default one-launch step, and the per-group calls), all-full SDPA
over the whole cache, and the ideal hybrid (two SDPA calls on pre-split caches); and generate() on a small Llama-shaped model, flexsparse against sdpa + DynamicCache.
Each round is one synchronised call (latency, host overhead included).

    pytest bench/suites/test_hf_bench.py --benchmark-only --benchmark-group-by=param:batch
"""

import pytest
import torch

from flexsparse.integrations import convert, revert
from flexsparse.tools.bench_hf import HfBenchConfig, decode_setup, generate_timed, llama_from_config

pytestmark = pytest.mark.gpu

CONFIG = HfBenchConfig(decode_seq=32768, decode_extra=2048, e2e_layers=2, e2e_intermediate=4096, new_tokens=16)


@pytest.fixture(scope="module", params=[1, 8], ids=lambda b: f"batch{b}")
def setup(request):
    return decode_setup(CONFIG, request.param)


def _timed(benchmark, fn, **info):
    def run():
        fn()
        torch.cuda.synchronize()

    run()
    benchmark.extra_info.update(device=torch.cuda.get_device_name(), **info)
    benchmark.pedantic(run, rounds=20, warmup_rounds=3)


@pytest.mark.parametrize("name", ["flexsparse", "flexsparse_per_group", "sdpa_all_full", "ideal_two_sdpa"])
def test_decode_step(benchmark, setup, name):
    _timed(benchmark, setup.timed[name], batch=setup.batch, seq=setup.seq, kv_bytes=setup.kv_bytes,
           kv_bytes_all_full=setup.kv_bytes_all_full)
    assert setup.kv_bytes == setup.kv_bytes_formula


@pytest.fixture(scope="module")
def small_llama():
    return llama_from_config(CONFIG, CONFIG.e2e_layers, CONFIG.e2e_intermediate, CONFIG.e2e_vocab)


@pytest.mark.parametrize("attention", ["flexsparse", "sdpa"])
def test_generate_8k_prompt_16_tokens(benchmark, small_llama, attention):
    if attention == "flexsparse":
        convert(small_llama, CONFIG.patterns(), [CONFIG.modes()] * CONFIG.e2e_layers, backend="flex")
    ids = torch.randint(1, CONFIG.e2e_vocab, (1, 8192), device="cuda")
    try:
        generate_timed(small_llama, ids, 2, torch.device("cuda"))  # compiles
        benchmark.extra_info.update(device=torch.cuda.get_device_name(), prompt=8192, new_tokens=16)
        benchmark.pedantic(lambda: generate_timed(small_llama, ids, 16, torch.device("cuda")), rounds=3,
                           warmup_rounds=0)
    finally:
        if attention == "flexsparse":
            revert(small_llama)
