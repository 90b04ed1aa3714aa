"""RULER (Hsieh et al., 2024) through lm-eval 0.4.13: lm-eval's sample generators, prompts and scoring, and the
model behind lm-eval's model interface (:class:`~flexsparse.eval.harness.FlexsparseLM`). Needs the ``ruler``
extra: ``pip install 'flexsparse[ruler]'`` (lm-eval with nltk, wonderwords, scipy).

The tasks (:data:`RULER_TASKS`) are the six that lm-eval generates offline, from its own synthetic haystacks:

==================  ==========================================================================================
``niah_single_1``   one number under a word key in a repeated filler text ("The grass is green. ...")
``niah_multikey_2`` one number among filler lines that are needles themselves (keys: words)
``niah_multikey_3`` the same with UUID keys and values
``ruler_vt``        variable tracking: the 5 names bound to a value through a chain of assignments (1 example)
``ruler_cwe``       common-word extraction: the 10 words repeated most often in a numbered list
``ruler_fwe``       frequent-word extraction: the 3 most frequent coded words of a Zipf-distributed text
==================  ==========================================================================================

The other RULER tasks need downloads: the essay haystacks (``niah_single_2``, ``niah_single_3``,
``niah_multikey_1``, ``niah_multivalue``, ``niah_multiquery``) read Paul Graham's essays from the Hugging Face hub
and split them into sentences with nltk's ``punkt_tab`` data, which lm-eval downloads when it is imported (a
substitute haystack such as the pydoc text cannot go through lm-eval's essay path without that data, so they are
left out); the QA tasks load SQuAD and HotpotQA. lm-eval's import tries that download; offline it fails at once
and lm-eval carries on.

Samples (:func:`ruler_samples`): lm-eval's generator for the task, called with this package's tokenizer and ``n``
samples instead of lm-eval's 500 (the same samples as the first ``n`` of lm-eval's own: a test checks it), then
lm-eval's task (its YAML configuration: prompt template, answer prefix, generation settings) builds the requests.
The generators draw from Python's global ``random``, numpy's global generator and a module-level generator (cwe);
all are seeded from (task, length, seed) for the call and restored after, so a sample set depends on its arguments
only. A task's prompt is at most ``length`` tokens minus the tokens it generates (``fwe``: lm-eval sizes its
prompt to ``length`` itself and generates 50 tokens beyond).

Scores: lm-eval's ``process_results`` of the task (RULER's ``string_match_all``: the fraction of the expected
strings found in the generation, case-insensitive), a mean per task and length; the ``ruler`` record of a length
is the mean over its tasks (:func:`with_ruler_means`), as the RULER paper and kvpress's leaderboard report.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import io
import logging
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from flexsparse.eval.records import Record

RULER_TASKS = ("niah_single_1", "niah_multikey_2", "niah_multikey_3", "ruler_vt", "ruler_cwe", "ruler_fwe")
"""The RULER tasks lm-eval generates offline, by lm-eval's task names."""

RULER_MEAN = "ruler"
"""The task name of the records holding the mean over RULER tasks at one length."""

INSTALL_HINT = "pip install 'flexsparse[ruler]' (lm-eval 0.4.13 with its ruler extra)"

RULER_MIN_LENGTH = 1024
"""The shortest length accepted: lm-eval's variable-tracking generator loops forever where its one-shot example
(up to 500 tokens) leaves no room for a sample."""

_NIAH = {  # (haystack, key type, value type) of lm-eval's niah_utils functions
    "niah_single_1": ("repeat", "words", "numbers"),
    "niah_multikey_2": ("needle", "words", "numbers"),
    "niah_multikey_3": ("needle", "uuids", "uuids"),
}


def _check(task: str, length: int, n: int) -> None:
    if task not in RULER_TASKS:
        raise ValueError(f"unknown RULER task {task!r}; lm-eval generates these offline: {list(RULER_TASKS)}")
    if not isinstance(length, int) or length < RULER_MIN_LENGTH:
        raise ValueError(f"length must be an integer >= {RULER_MIN_LENGTH} tokens, got {length!r}")
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"n must be an integer >= 1, got {n!r}")


@contextlib.contextmanager
def _quiet():
    """lm-eval's generators print progress bars and sizes, its task builder a warning per task: silenced."""
    logger = logging.getLogger("lm_eval")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            yield
    finally:
        logger.setLevel(level)


@functools.cache
def lm_eval_modules():
    """lm-eval's RULER modules (prepare_niah, niah_utils, vt_utils, cwe_utils, fwe_utils), imported once: the import
    builds RULER's word list (~20 s, ~1 GB); ImportError with the install hint where lm-eval or its ruler extra is
    missing."""
    try:
        with _quiet():
            from lm_eval.tasks.ruler import cwe_utils, fwe_utils, niah_utils, prepare_niah, vt_utils
    except ImportError as err:
        raise ImportError(f"RULER tasks need lm-eval: {INSTALL_HINT} ({err})") from err
    return prepare_niah, niah_utils, vt_utils, cwe_utils, fwe_utils


@functools.cache
def _task_manager():
    """lm-eval's task index of its RULER folder only (the whole index takes longer to build)."""
    from lm_eval.tasks import TaskManager

    prepare_niah = lm_eval_modules()[0]
    return TaskManager(include_defaults=False, include_path=str(Path(prepare_niah.__file__).parent))


def sample_seed(task: str, length: int, seed: int) -> int:
    """The seed lm-eval's generators get for (task, length, seed): 32 bits of a SHA-256 of the three."""
    return int(hashlib.sha256(f"{task}/{length}/{seed}".encode()).hexdigest()[:8], 16)


@contextlib.contextmanager
def seeded_generators(value: int):
    """Python's and numpy's global generators and lm-eval's cwe generator seeded with ``value``; restored after
    (lm-eval's first import, which happens inside, included)."""
    import numpy as np

    saved = random.getstate(), np.random.get_state()
    try:
        cwe = lm_eval_modules()[3].RNG
        kept = cwe.getstate()
        random.seed(value)
        np.random.seed(value)
        cwe.seed(value)
        try:
            yield
        finally:
            cwe.setstate(kept)
    finally:
        random.setstate(saved[0])
        np.random.set_state(saved[1])


def _documents(task: str, length: int, n: int, tokenizer) -> list[dict]:
    """lm-eval's generator of ``task`` for ``n`` samples of ``length`` tokens (what its dataset function does for
    500), in the generators' current random state."""
    prepare_niah, niah_utils, vt_utils, cwe_utils, fwe_utils = lm_eval_modules()
    if task in _NIAH:
        haystack, keys, values = _NIAH[task]
        return prepare_niah.generate_samples(prepare_niah.get_haystack(type_haystack=haystack), max_seq_length=length,
                                             template=niah_utils.TEMPLATE, type_haystack=haystack,
                                             type_needle_k=keys, type_needle_v=values, num_samples=n,
                                             TOKENIZER=tokenizer)
    if task == "ruler_vt":
        example = vt_utils.sys_vartrack_w_noise_random(tokenizer=tokenizer, num_samples=1, max_seq_length=500,
                                                       incremental=5)[0]
        return vt_utils.sys_vartrack_w_noise_random(tokenizer=tokenizer, num_samples=n, max_seq_length=length,
                                                    icl_example=example)
    if task == "ruler_cwe":
        return cwe_utils.sys_word_pair_random(num_samples=n, max_seq_length=length, tokenizer=tokenizer)
    return fwe_utils.sys_kwext(tokenizer=tokenizer, max_seq_length=length, num_samples=n)


def lm_eval_task(task: str, length: int, n: int, seed: int, tokenizer):
    """lm-eval's task ``task`` (a ``ConfigurableTask`` from its YAML) over ``n`` generated samples of ``length``
    tokens, its requests built (``.instances``: one ``generate_until`` request per sample, in order)."""
    _check(task, length, n)
    import datasets

    with _quiet(), seeded_generators(sample_seed(task, length, seed)):
        documents = _documents(task, length, n, tokenizer)
        if len(documents) != n:
            raise ValueError(f"lm-eval generated {len(documents)} of {n} {task} samples at length {length}: the "
                             "length leaves no room for them")

        def dataset(**_):
            return {"test": datasets.Dataset.from_list(documents, split=datasets.Split.TEST)}

        spec = {"group": "flexsparse_ruler", "task": [{"task": task, "custom_dataset": dataset}]}
        found = _task_manager().load(spec)["tasks"][task]
        found.build_all_requests()
    return found


@dataclass(frozen=True)
class RulerSample:
    """One RULER sample as lm-eval builds it: ``prompt``, exactly the text lm-eval gives the model (``context`` +
    ``question``: the question starts at the last line break of lm-eval's input and runs to the answer prefix the
    model continues, e.g. "... mentioned in the provided text is"); ``answers``, the strings the generation must
    contain; ``max_new_tokens``, the tokens lm-eval lets the model generate (greedy, no stop strings); ``doc``,
    lm-eval's document. :meth:`score` is lm-eval's scoring of a generation. The model reads the prompt encoded
    without special tokens (``tokenizer(prompt, add_special_tokens=False)``, as
    :class:`~flexsparse.eval.text_model.TextModel` does) and no chat template."""

    task: str
    length: int
    prompt: str
    context: str
    question: str
    answers: tuple[str, ...]
    max_new_tokens: int
    doc: dict = field(repr=False, compare=False)
    scorer: Callable = field(repr=False, compare=False)

    def score(self, generation: str) -> float:
        """lm-eval's score of ``generation`` (the text after the prompt): the fraction of ``answers`` in it."""
        return float(self.scorer(self.doc, [generation])[str(self.length)])


def _sample(task: str, length: int, instance, scorer: Callable) -> RulerSample:
    prompt, kwargs = instance.args
    doc = instance.doc
    cut = doc["input"].rindex("\n")
    return RulerSample(task, length, prompt, prompt[:cut], prompt[cut:], tuple(doc["outputs"]),
                       int(kwargs["max_gen_toks"]), dict(doc), scorer)


def ruler_samples(task: str, length: int, n: int, seed: int, tokenizer) -> list[RulerSample]:
    """``n`` samples of the RULER task ``task`` (:data:`RULER_TASKS`) at ``length`` tokens of ``tokenizer`` (a
    transformers tokenizer), from lm-eval's generator and task configuration; the same arguments give the same
    samples. Scoring a generation: ``sample.score(text)``."""
    built = lm_eval_task(task, length, n, seed, tokenizer)
    return [_sample(task, length, instance, built.process_results) for instance in built.instances]


def ruler_scores(lm, task: str, length: int, n: int, seed: int, tokenizer) -> list[float]:
    """Per sample of :func:`ruler_samples`, lm-eval's score of ``lm``'s generation (``lm``: an lm-eval ``LM``, e.g.
    :class:`~flexsparse.eval.harness.FlexsparseLM`): lm-eval's requests in, lm-eval's ``process_results`` out."""
    built = lm_eval_task(task, length, n, seed, tokenizer)
    generations = lm.generate_until(built.instances)
    return [float(built.process_results(instance.doc, [text])[str(length)])
            for instance, text in zip(built.instances, generations)]


def with_ruler_means(records: Sequence[Record]) -> list[Record]:
    """``records`` with a :data:`RULER_MEAN` record after the last RULER record of each (method, model, length):
    the mean of its RULER tasks' values, their summed ``n`` and seconds, their mean density (earlier mean records
    are dropped and recomputed)."""
    kept = [r for r in records if r.task != RULER_MEAN]
    groups: dict[tuple[str, str, int], list[int]] = {}
    for index, r in enumerate(kept):
        if r.task in RULER_TASKS:
            groups.setdefault((r.method, r.model, r.length), []).append(index)
    after = {}
    for (method, model, length), members in groups.items():
        found = [kept[i] for i in members]
        after[members[-1]] = Record(method, RULER_MEAN, length, found[0].metric,
                                    sum(r.value for r in found) / len(found), sum(r.n for r in found),
                                    sum(r.density for r in found) / len(found), found[0].kv_bytes, model,
                                    sum(r.seconds for r in found))
    out = []
    for index, r in enumerate(kept):
        out.append(r)
        if index in after:
            out.append(after[index])
    return out
