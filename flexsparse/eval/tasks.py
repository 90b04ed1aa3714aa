"""Evaluation tasks on real text: perplexity on held-out windows, passkey retrieval, and RULER-style tasks
(multi-key and multi-value needles, variable tracking, common-word extraction) on real-text haystacks; and, by
lm-eval's task names, the RULER tasks lm-eval generates (:mod:`flexsparse.eval.ruler`, kind ``ruler``).

A retrieval task builds prompts of exactly ``length`` tokens (common-word lists: at most ``length``, left-padded
in a batch) from pieces tokenized separately. Two ways of scoring:

* ``forced`` (passkey, multikey): the prompt ends with the answer (the value's own tokens; a whitespace token
  before it belongs to the question); a prompt scores 1 when the model's greedy choice at every answer token is
  that token, given the answer's previous tokens. This is exactly whether greedy decoding would produce the
  answer, computed in one forward (no generation).
* ``generate`` (multivalue, vartrack, cwe): greedy generation of ``max_new_tokens`` after the prompt; the score
  is the fraction of the expected strings found in the generated text.

Needle depths are spread evenly over 10-90% of the haystack across a task's prompts; keys and values come from a
seeded generator: the same seed gives the same prompts.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

from flexsparse.eval.ruler import RULER_TASKS
from flexsparse.eval.text import Corpus, encode, insert_at_depths

# Nouns for the keys of multi-key and multi-value needles.
KEY_WORDS = (
    "lantern", "harbor", "orchid", "glacier", "compass", "meadow", "falcon", "canyon", "violin", "pepper",
    "marble", "thistle", "anchor", "saffron", "beacon", "walnut", "cobalt", "heron", "quartz", "juniper",
    "kettle", "lagoon", "mosaic", "nectar", "otter", "pebble", "quiver", "raven", "sparrow", "tundra",
    "umbrella", "velvet", "willow", "yarrow", "zephyr", "bramble", "cinder", "dynamo", "ember", "fjord",
)


@dataclass(frozen=True)
class Prompt:
    """One prompt: ``ids`` (for forced tasks ending with the answer, its last ``answer_len`` tokens), the
    ``expected`` strings a generation must contain, ``max_new_tokens`` to generate (0: forced), and the
    ``needle_positions`` of its key facts (indices into ``ids``; calibration reads retrieval heads from them)."""

    ids: list[int]
    answer_len: int = 0
    expected: tuple[str, ...] = ()
    max_new_tokens: int = 0
    needle_positions: tuple[int, ...] = ()


@dataclass(frozen=True)
class Task:
    """A task: its ``name``, ``metric`` (what its records' value is) and ``kind`` (perplexity, forced,
    generate, ruler)."""

    name: str
    metric: str
    kind: str

    def prompts(self, corpus: Corpus, tokenizer, length: int, trials: int, seed: int = 0,
                split: str = "evaluation") -> list[Prompt]:
        """``trials`` prompts of ``length`` tokens on haystacks of the corpus's ``split``."""
        if self.kind == "perplexity":
            raise ValueError("perplexity has windows, not prompts (Corpus.windows)")
        if self.kind == "ruler":
            raise ValueError(f"{self.name}'s samples come from lm-eval: flexsparse.eval.ruler.ruler_samples")
        rng = random.Random(f"{self.name}/{length}/{seed}")
        builder = _BUILDERS[self.name]
        return [builder(corpus, tokenizer, length, rng, _depth(i, trials), split) for i in range(trials)]


def _depth(index: int, count: int) -> float:
    """Needle depth of prompt ``index`` of ``count``: evenly spaced over 10-90%."""
    return 0.5 if count == 1 else 0.1 + 0.8 * index / (count - 1)


def _number(rng: random.Random, digits: int) -> str:
    return str(rng.randrange(10 ** (digits - 1), 10**digits))


def _fill(corpus: Corpus, length: int, fixed: int, rng: random.Random, split: str, what: str) -> list[int]:
    room = length - fixed
    if room < 16:
        raise ValueError(f"length {length} leaves {room} tokens of haystack for {what}; use a longer length")
    return corpus.haystack(room, rng, split)


def _spread(depth: float, count: int) -> list[float]:
    """``count`` depths spread over the haystack around ``depth`` (several needles of one prompt)."""
    return [0.1 + 0.8 * (((depth - 0.1) / 0.8 + i / count) % 1.0) for i in range(count)]


def _answer(tokenizer, question: str, answer: str) -> tuple[list[int], list[int]]:
    """Token ids of ``question`` and of ``answer`` after it; whitespace-only tokens that open the answer (SmolLM2
    writes " 41072" as " " + digits) end the question instead, so the answer is the value's own tokens."""
    asked, told = encode(tokenizer, question), encode(tokenizer, answer)
    while len(told) > 1 and not tokenizer.decode(told[:1]).strip():
        asked, told = asked + told[:1], told[1:]
    return asked, told


def _locate(ids: list[int], needle: list[int], start: int = 0) -> int:
    for i in range(start, len(ids) - len(needle) + 1):
        if ids[i:i + len(needle)] == needle:
            return i
    raise AssertionError("needle not found in its own prompt")


def passkey_prompt(corpus: Corpus, tokenizer, length: int, rng: random.Random, depth: float,
                   split: str = "evaluation", with_answer: bool = True) -> Prompt:
    """A pass key (5 digits) stated once at ``depth`` of a real-text haystack, asked for at the end."""
    key = _number(rng, 5)
    intro = encode(tokenizer, "There is a pass key hidden inside a lot of irrelevant text. Find it and memorize "
                              "it. I will quiz you about the pass key.\n\n")
    needle = encode(tokenizer, f"\nThe pass key is {key}. Remember it. {key} is the pass key.\n")
    question, answer = _answer(tokenizer, "\n\nWhat is the pass key? The pass key is", f" {key}")
    answer = answer if with_answer else []
    hay = _fill(corpus, length, len(intro) + len(needle) + len(question) + len(answer), rng, split, "passkey")
    ids = intro + insert_at_depths(hay, [needle], [depth]) + question + answer
    start, digits = _locate(ids, needle), encode(tokenizer, key)
    first = start + _locate(needle, digits)
    second = start + _locate(needle, digits, first - start + len(digits))
    positions = tuple(range(first, first + len(digits))) + tuple(range(second, second + len(digits)))
    return Prompt(ids, len(answer), (key,), 0, positions)


def _multikey(corpus: Corpus, tokenizer, length: int, rng: random.Random, depth: float, split: str) -> Prompt:
    keys = rng.sample(KEY_WORDS, 4)
    values = [_number(rng, 6) for _ in keys]
    asked = rng.randrange(len(keys))
    intro = encode(tokenizer, "Some secret numbers are hidden inside the text below. Memorize them.\n\n")
    needles = [encode(tokenizer, f"\nThe secret number of the {k} is {v}.\n") for k, v in zip(keys, values)]
    question, answer = _answer(tokenizer, f"\n\nWhat is the secret number of the {keys[asked]}? The secret "
                                          f"number of the {keys[asked]} is", f" {values[asked]}")
    fixed = len(intro) + sum(map(len, needles)) + len(question) + len(answer)
    hay = _fill(corpus, length, fixed, rng, split, "multikey")
    ids = intro + insert_at_depths(hay, needles, _spread(depth, len(needles))) + question + answer
    return Prompt(ids, len(answer), (values[asked],))


def _multivalue(corpus: Corpus, tokenizer, length: int, rng: random.Random, depth: float, split: str) -> Prompt:
    key = rng.choice(KEY_WORDS)
    values = [_number(rng, 6) for _ in range(4)]
    intro = encode(tokenizer, "Some secret numbers are hidden inside the text below. Memorize them.\n\n")
    needles = [encode(tokenizer, f"\nOne secret number of the {key} is {v}.\n") for v in values]
    question = encode(tokenizer, f"\n\nList every secret number of the {key} mentioned in the text. The secret "
                                 f"numbers of the {key} are")
    hay = _fill(corpus, length, len(intro) + sum(map(len, needles)) + len(question), rng, split, "multivalue")
    ids = intro + insert_at_depths(hay, needles, _spread(depth, len(needles))) + question
    return Prompt(ids, 0, tuple(values), 48)


def _vartrack(corpus: Corpus, tokenizer, length: int, rng: random.Random, depth: float, split: str) -> Prompt:
    value = _number(rng, 5)
    names = ["".join(rng.choice("ABCDEFGHIJKLMNOPQRSTUVWXYZ") for _ in range(5)) for _ in range(5)]
    intro = encode(tokenizer, "Memorize the variable assignments hidden inside the text below.\n\n")
    statements = [f"\nVAR {names[0]} = {value}.\n"]
    statements += [f"\nVAR {b} = VAR {a}.\n" for a, b in zip(names, names[1:])]
    needles = [encode(tokenizer, s) for s in statements]
    question = encode(tokenizer, f"\n\nWhich variables are assigned the value {value} in the text above, directly "
                                 f"or through other variables? The variables assigned the value {value} are")
    hay = _fill(corpus, length, len(intro) + sum(map(len, needles)) + len(question), rng, split, "vartrack")
    first = 0.1 + 0.4 * (depth - 0.1) / 0.8  # the chain runs forward from its first statement
    depths = [first + (0.9 - first) * i / (len(needles) - 1) for i in range(len(needles))]
    ids = intro + insert_at_depths(hay, needles, depths) + question
    return Prompt(ids, 0, tuple(names), 40)


def _common_words(corpus: Corpus, tokenizer, length: int, rng: random.Random, depth: float, split: str) -> Prompt:
    """A numbered list of words from the real text: 10 words repeated many times, the others once."""
    if len(corpus.words) < 64:
        raise ValueError(f"the text has {len(corpus.words)} distinct words; common-word extraction needs 64")
    intro = encode(tokenizer, "Below is a numbered list of words. Some words appear many times.\n\n")
    question = encode(tokenizer, "\n\nWhich 10 words appear most often in the list above? The 10 most frequent "
                                 "words in the list are")
    room = length - len(intro) - len(question)
    pool = rng.sample(corpus.words, min(len(corpus.words), 10 + room // 3))
    sizes = [len(encode(tokenizer, f"{100 + i}. {word}\n")) for i, word in enumerate(pool[:200])]
    entries = max(int(room / (sum(sizes) / len(sizes))), 20)
    repeats = max(2, entries // 40)
    common, rare = pool[:10], pool[10:]
    words = common * repeats + rare[: max(0, entries - 10 * repeats)]
    rng.shuffle(words)
    body: list[int] = []
    number = 1
    for word in words:  # an entry that does not fit is left out; a later, shorter one may fit
        entry = encode(tokenizer, f"{number}. {word}\n")
        if len(body) + len(entry) <= room:
            body += entry
            number += 1
    return Prompt(intro + body + question, 0, tuple(common), 48)


_BUILDERS = {
    "passkey": passkey_prompt,
    "multikey": _multikey,
    "multivalue": _multivalue,
    "vartrack": _vartrack,
    "cwe": _common_words,
}

TASKS = {
    "perplexity": Task("perplexity", "perplexity", "perplexity"),
    "passkey": Task("passkey", "accuracy", "forced"),
    "multikey": Task("multikey", "accuracy", "forced"),
    "multivalue": Task("multivalue", "recall", "generate"),
    "vartrack": Task("vartrack", "recall", "generate"),
    "cwe": Task("cwe", "recall", "generate"),
    **{name: Task(name, "accuracy", "ruler") for name in RULER_TASKS},
}
"""Every task by name."""

DEFAULT_TASKS = ("perplexity", "passkey", "multikey", "multivalue", "vartrack", "cwe")

SUITES = {"default": DEFAULT_TASKS, "ruler": RULER_TASKS}
"""The task lists of ``flexsparse eval --suite``."""


def get_task(name: str) -> Task:
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; known: {sorted(TASKS)}")
    return TASKS[name]


def recall(expected: Sequence[str], text: str) -> float:
    """Fraction of the expected strings found in ``text`` (case-insensitive)."""
    lowered = text.lower()
    return sum(e.lower() in lowered for e in expected) / len(expected)
