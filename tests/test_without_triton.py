"""flexsparse without triton: ``pip install flexsparse[hf]`` on a CPU machine installs none. In a fresh interpreter
where importing triton fails (a meta-path blocker), with the Triton interpreter asked for (TRITON_INTERPRET=1, so
every site that could run a kernel on CPU tensors asks whether it can), a tiny Llama with full, sink+window and ESA
heads converts and generates a left-padded batch with the sparse KV cache: the tokens of a full recompute, and
triton never imported (dense backend: compiled flex would spend ~15 s compiling on a CPU)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

SCRIPT = r'''
import importlib.abc
import sys


class NoTriton(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "triton" or name.startswith("triton."):
            raise ModuleNotFoundError(f"No module named {name!r} (blocked by the test)", name=name)
        return None


sys.meta_path.insert(0, NoTriton())
try:
    import triton  # noqa: F401
except ModuleNotFoundError:
    pass
else:
    raise AssertionError("the blocker let triton through")

import torch

from flexsparse.integrations import SparseKVCache, convert
from flexsparse.kernels.availability import kernel_unavailable, kernels_run_on
from flexsparse.masks import ESA, Causal, SinkWindow
from tests.hf_util import greedy, left_padded, returned_cache, tiny_model

torch.set_num_threads(1)
assert not kernels_run_on(torch.device("cpu")) and "pip install triton" in kernel_unavailable("cpu")
patterns = {"full": Causal(), "ssa": SinkWindow(2, 6), "esa": ESA(0, 1, 3, 4)}
model = convert(tiny_model("llama"), patterns, [["full", "ssa"], ["esa", "ssa"], ["ssa", "full"]], backend="dense")
ids, mask = left_padded([14, 6])
with torch.no_grad():
    out = model.generate(ids, attention_mask=mask, max_new_tokens=12, min_new_tokens=12, do_sample=False,
                         return_dict_in_generate=True)
assert isinstance(returned_cache(out), SparseKVCache)
assert torch.equal(out.sequences[:, ids.shape[1]:], greedy(model, ids, mask, 12, use_cache=False))
assert not any(name == "triton" or name.startswith("triton.") for name in sys.modules)
print("converted and generated without triton")
'''


def test_convert_and_generate_without_triton():
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join(
        [str(root), *filter(None, [os.environ.get("PYTHONPATH")])])}
    done = subprocess.run([sys.executable, "-c", SCRIPT], cwd=root, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    assert "converted and generated without triton" in done.stdout
