"""Saving and loading a converted model's flexsparse configuration: JSON, plus safetensors for learned weights.

``save_config(model, directory)`` writes ``directory/flexsparse.json``::

    {"format": "flexsparse.convert", "version": 1,
     "model": {"class": "LlamaForCausalLM", "num_layers": 3, "num_heads": [4, 4, 4], "num_kv_heads": [2, 2, 2]},
     "options": {"block_size": 128, "backend": "auto", "plan": "auto"},
     "patterns": {"full": {"type": "causal"}, "ssa": {"type": "sink_window", "sink": 128, "window": 2048, "unit": 1}},
     "layers": [{"modes": ["full", "ssa"]}, {"modes": ["ssa", "ssa"]},
                {"modes": ["ssa", "full"], "patterns": {...},      # "patterns" only where a layer has its own
                 "router": {"kind": "head", "head_dim": 128, ...}}], # "router" only on routed layers
     "weights": "flexsparse.safetensors"}                            # only when some layer has learned tensors

Each pattern is its ``Pattern.config()`` (``"type"``: its registered name, then its constructor's arguments) and
comes back through ``Pattern.from_config``: a registered pattern class needs nothing here. Every entry names
every argument of its pattern (and every router entry every key ``Router.config()`` writes): a file that lacks one
is refused, naming the pattern and the argument, rather than loaded with a default that may not be what was saved.
Files written before the registry hold the same entries (XAttention's ``compile``, which they lack, is optional).

Learned tensors (parameters and persistent buffers of each layer's flexsparse state: its router's weights) are
stored in ``flexsparse.safetensors`` under ``layers.<index>.<name>`` (``layers.3.router.task_mlp.0.weight``).
``load_config(model, directory)`` rebuilds each layer's router from its config (``Router.from_config``),
converts ``model`` with the saved patterns, modes, options and routers, then loads those tensors.

Under tensor parallelism (a model sharded with ``tp_plan``, converted on every rank) the file is the global
configuration, the one the single-process converted model writes: the layers' head counts and every KV head's
modes, the routers and their weights (the same on every rank). The rank of coordinate 0 in the tensor-parallel
group writes it; the others write nothing (call it on every rank or on that one; synchronise, e.g. with
``dist.barrier()``, before another process reads the files). ``load_config`` reads it on one process or on every
rank of a tensor-parallel model.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from flexsparse.integrations.layer import sparse_layers
from flexsparse.integrations.transformers import attention_layers, convert, layer_heads
from flexsparse.masks import Pattern
from flexsparse.routers import Router

CONFIG_FILE = "flexsparse.json"
WEIGHTS_FILE = "flexsparse.safetensors"
FORMAT, VERSION = "flexsparse.convert", 1


def _patterns_to_dict(patterns) -> dict:
    return {name: p.config() for name, p in patterns.items()}


def save_config(model: nn.Module, directory: str | Path) -> Path:
    """Write the converted model's flexsparse configuration (and learned tensors, if any) into ``directory``;
    returns the JSON file's path. On a tensor-parallel model only the group's first rank writes (the global
    configuration); the other ranks return the path without writing."""
    layers = sparse_layers(model)
    if not layers:
        raise ValueError("save_config: the model was not converted by flexsparse.convert")
    directory = Path(directory)
    path = directory / CONFIG_FILE
    from flexsparse.integrations.tensor_parallel import tensor_parallel_rank  # it imports transformers.py

    placement = tensor_parallel_rank(model)
    if placement is not None and placement[0] != 0:
        return path
    heads = [layer_heads(module)[:2] for _, module in attention_layers(model)]  # the config's: every rank's
    directory.mkdir(parents=True, exist_ok=True)
    shared = _patterns_to_dict(layers[0].patterns)
    entries = []
    tensors: dict[str, torch.Tensor] = {}
    for layer in layers:
        entry = {"modes": layer.mode_names}
        own = _patterns_to_dict(layer.patterns)
        if own != shared:
            entry["patterns"] = own
        if layer.router is not None:
            entry["router"] = layer.router.config()
        entries.append(entry)
        for name, tensor in layer.state_dict().items():
            tensors[f"layers.{layer.layer_idx}.{name}"] = tensor.detach().cpu().contiguous()
    config = {
        "format": FORMAT, "version": VERSION,
        "model": {"class": type(model).__name__, "num_layers": len(layers),
                  "num_heads": [num_heads for num_heads, _ in heads],
                  "num_kv_heads": [num_kv for _, num_kv in heads]},
        "options": dict(layers[0].options),
        "patterns": shared,
        "layers": entries,
    }
    if tensors:
        from safetensors.torch import save_file

        save_file(tensors, str(directory / WEIGHTS_FILE))
        config["weights"] = WEIGHTS_FILE
    path.write_text(json.dumps(config, indent=2) + "\n")
    return path


_ENTRIES = {"model": dict, "patterns": dict, "layers": list, "options": dict, "weights": str}
"""The entries of a configuration and their JSON types ("model" and "layers" are required)."""
_JSON_NAMES = {dict: "object", list: "list", str: "string"}
_OPTIONS = ("block_size", "backend", "plan")
"""The options save_config writes (convert's keyword arguments)."""


def _read_config(path: Path) -> dict:
    """The JSON of ``path``, checked for the entries :func:`load_config` reads; a ValueError names the file."""
    try:
        config = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{path} is not valid JSON ({err})") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path} must hold a JSON object, got a {type(config).__name__}")
    if config.get("format") != FORMAT:
        raise ValueError(f"{path} is not a flexsparse configuration (format {config.get('format')!r})")
    if config.get("version") != VERSION:
        raise ValueError(f"{path} has version {config.get('version')!r}; this flexsparse reads version {VERSION}")
    for key, kind in _ENTRIES.items():
        if key not in config and key in ("model", "layers"):
            raise ValueError(f"{path} has no {key!r} entry")
        if key in config and not isinstance(config[key], kind):
            raise ValueError(f"{path}: {key!r} must be a JSON {_JSON_NAMES[kind]}, got {type(config[key]).__name__}")
    unknown = sorted(set(config.get("options", {})) - set(_OPTIONS))
    if unknown:
        raise ValueError(f"{path}: 'options' has unknown keys {unknown}; known: {list(_OPTIONS)}")
    model, layers = config["model"], config["layers"]
    count = model.get("num_layers")
    if not isinstance(count, int) or any(not isinstance(model.get(key), list) or len(model[key]) != count
                                         for key in ("num_heads", "num_kv_heads")):
        raise ValueError(f"{path}: 'model' must give num_layers and num_heads / num_kv_heads lists of that length, "
                         f"got {model!r}")
    if len(layers) != count:
        raise ValueError(f"{path}: 'layers' has {len(layers)} entries, 'model' says num_layers={count}")
    for index, entry in enumerate(layers):
        if (not isinstance(entry, dict) or not isinstance(entry.get("modes"), list)
                or not isinstance(entry.get("patterns", config.get("patterns")), dict)):
            raise ValueError(f"{path}: layers[{index}] must be an object with a 'modes' list and 'patterns' (its "
                             f"own or the shared ones), got {entry!r}")
    return config


def _config_path(directory: str | Path) -> Path:
    directory = Path(directory)
    return directory / CONFIG_FILE if directory.is_dir() else directory


def _layer_patterns(config: dict) -> list[dict[str, Pattern]]:
    """Each layer's patterns by name, built from the configuration's entries."""
    return [{name: Pattern.from_config(spec) for name, spec in entry.get("patterns", config["patterns"]).items()}
            for entry in config["layers"]]


def check_config(directory: str | Path) -> Path:
    """Check, without a model, that ``directory`` (or the file itself) holds a configuration :func:`load_config`
    reads: its entries, every pattern and router config, each layer's modes among its patterns, the weights file
    present. Returns the JSON file's path; a ValueError names it and what is wrong (whether it fits a model is
    :func:`load_config`'s to check)."""
    path = _config_path(directory)
    if not path.is_file():
        raise ValueError(f"{path}: no saved flexsparse configuration there (flexsparse.save_config writes one)")
    config = _read_config(path)
    try:
        for index, (entry, patterns) in enumerate(zip(config["layers"], _layer_patterns(config))):
            unknown = sorted({mode for mode in entry["modes"] if isinstance(mode, str)} - set(patterns))
            if unknown:
                raise ValueError(f"layers[{index}] has modes {unknown} that its patterns {sorted(patterns)} lack")
            if entry.get("router") is not None:
                Router.from_config(entry["router"])
    except (TypeError, ValueError) as err:
        raise (TypeError if isinstance(err, TypeError) else ValueError)(f"{path}: {err}") from err
    if "weights" in config and not (path.parent / config["weights"]).is_file():
        raise ValueError(f"{path}: its learned tensors {config['weights']!r} are not beside it")
    return path


def load_config(model: nn.Module, directory: str | Path) -> nn.Module:
    """Convert ``model`` as the saved configuration says (patterns, modes, options) and load its learned tensors;
    returns the model. The model must have the saved layer and head counts. A file that is not such a
    configuration (bad JSON, missing or malformed entries) is a ValueError naming it."""
    path = _config_path(directory)
    config = _read_config(path)
    saved = config["model"]
    modules = attention_layers(model)
    if len(modules) != saved["num_layers"]:
        raise ValueError(f"{path} was saved for {saved['num_layers']} layers, the model has {len(modules)}")
    for index, ((_, module), heads, kv_heads) in enumerate(zip(modules, saved["num_heads"], saved["num_kv_heads"])):
        found = layer_heads(module)[:2]
        if found != (heads, kv_heads):
            raise ValueError(f"layer {index}: {path} was saved for {heads} query / {kv_heads} KV heads, the model "
                             f"has {found[0]} / {found[1]}")
    routers = [entry.get("router") for entry in config["layers"]]
    factory = None
    if any(routers):
        factory = lambda index: None if routers[index] is None else Router.from_config(routers[index])
    try:
        patterns = _layer_patterns(config)
        convert(model, patterns, [entry["modes"] for entry in config["layers"]], router=factory,
                **config.get("options", {}))
    except (TypeError, ValueError) as err:
        raise (TypeError if isinstance(err, TypeError) else ValueError)(f"{path}: {err}") from err
    if "weights" in config:
        from safetensors.torch import load_file

        tensors = load_file(str(path.parent / config["weights"]))
        for layer in sparse_layers(model):
            prefix = f"layers.{layer.layer_idx}."
            own = {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}
            unknown = sorted(set(own) - set(layer.state_dict()))
            if unknown:
                raise ValueError(f"layer {layer.layer_idx}: {path} holds learned tensors {unknown} that this "
                                 "flexsparse cannot rebuild (a newer version saved them)")
            layer.load_state_dict(own, strict=True)
    return model
