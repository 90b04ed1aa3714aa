"""Real text for evaluation and calibration: corpora, their token streams, and haystacks.

The default corpus is Python's own language documentation, ``pydoc_data.topics`` (every CPython ships it: about
465,000 characters, 113,000 tokens of SmolLM2's tokenizer); ``--text FILE ...`` takes the user's own, and
:mod:`flexsparse.eval.domains` adds text of another kind. A corpus is tokenized once and split in two disjoint
parts: the first ``calibration_fraction`` of its tokens for calibration (:mod:`flexsparse.eval.calibration`), the
rest held out for evaluation (perplexity windows and the haystacks of the retrieval tasks), so a calibrated
configuration is never scored on the text it saw.
"""

from __future__ import annotations

import os
import random
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

CALIBRATION_FRACTION = 0.25


def default_text() -> str:
    """Python's language documentation (``pydoc_data.topics``), topics in name order, blank lines between."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[name].strip() for name in sorted(topics))


def read_texts(paths: Sequence[str | os.PathLike]) -> str:
    """The files' UTF-8 text, joined by blank lines."""
    if isinstance(paths, (str, os.PathLike)) or not paths:
        raise ValueError(f"texts must be a non-empty list of file paths, got {paths!r}")
    parts = []
    for path in paths:
        with open(path, encoding="utf-8") as file:
            parts.append(file.read().strip())
    if not any(parts):
        raise ValueError(f"the text files {[str(p) for p in paths]} are empty")
    return "\n\n".join(parts)


def encode(tokenizer, text: str) -> list[int]:
    """Token ids of ``text`` without special tokens (prompts are built by concatenating such pieces)."""
    return tokenizer(text, add_special_tokens=False)["input_ids"]


@dataclass(frozen=True)
class Corpus:
    """A tokenized corpus: ``calibration`` and ``evaluation`` token streams (int64 ``[N]``, disjoint),
    ``words``, the distinct words of the evaluation part (:func:`text_words`), and ``name``, the text domain it
    holds (records of measurements on it carry the name)."""

    calibration: Tensor
    evaluation: Tensor
    words: tuple[str, ...]
    name: str = "text"

    @classmethod
    def from_text(cls, tokenizer, text: str | None = None,
                  calibration_fraction: float = CALIBRATION_FRACTION, name: str | None = None) -> Corpus:
        """Tokenize ``text`` (default :func:`default_text`) and split it; ``name`` defaults to ``"pydoc"`` for the
        default text, else ``"text"``."""
        if not 0.0 < calibration_fraction < 1.0:
            raise ValueError(f"calibration_fraction must be in (0, 1), got {calibration_fraction}")
        if name is not None and (not isinstance(name, str) or not name):
            raise ValueError(f"name must be a non-empty string, got {name!r}")
        ids = torch.tensor(encode(tokenizer, default_text() if text is None else text), dtype=torch.long)
        cut = int(len(ids) * calibration_fraction)
        held_out = ids[cut:]
        return cls(ids[:cut], held_out, tuple(text_words(tokenizer.decode(held_out.tolist()))),
                   name or ("pydoc" if text is None else "text"))

    def part(self, split: str) -> Tensor:
        if split not in ("calibration", "evaluation"):
            raise ValueError(f"split must be 'calibration' or 'evaluation', got {split!r}")
        return self.calibration if split == "calibration" else self.evaluation

    def windows(self, length: int, count: int, split: str = "evaluation") -> Tensor:
        """Up to ``count`` consecutive non-overlapping windows of ``length`` tokens, ``[n, length]`` (n >= 1);
        ValueError when the split holds fewer than ``length`` tokens."""
        tokens = self.part(split)
        available = len(tokens) // length
        if available < 1:
            raise ValueError(f"the {split} text holds {len(tokens):,} tokens, fewer than one window of {length:,}; "
                             "give a longer --text")
        n = min(count, available)
        return tokens[: n * length].view(n, length)

    def haystack(self, length: int, rng: random.Random, split: str = "evaluation") -> list[int]:
        """``length`` consecutive tokens of the split from a random offset (wrapping around its end)."""
        tokens = self.part(split)
        if length > len(tokens):
            raise ValueError(f"the {split} text holds {len(tokens):,} tokens, fewer than a haystack of "
                             f"{length:,}; give a longer --text")
        start = rng.randrange(len(tokens))
        return torch.cat([tokens, tokens[:length]])[start:start + length].tolist()


def text_words(text: str, min_length: int = 4) -> list[str]:
    """The distinct alphabetic lowercase words of ``text`` with at least ``min_length`` letters, sorted."""
    found = set()
    for raw in text.split():
        word = raw.strip(".,;:()[]{}\"'`*!?<>=-_/\\|#").lower()
        if len(word) >= min_length and word.isascii() and word.isalpha():
            found.add(word)
    return sorted(found)


def insert_at_depths(haystack: list[int], needles: Sequence[list[int]], depths: Sequence[float]) -> list[int]:
    """``haystack`` with each needle inserted at its depth (fraction of the haystack, in [0, 1]), needles in
    order of depth; the result has ``len(haystack) + sum(len(needle))`` tokens."""
    if len(needles) != len(depths):
        raise ValueError(f"{len(needles)} needles but {len(depths)} depths")
    order = sorted(range(len(needles)), key=lambda i: depths[i])
    out, previous = [], 0
    for i in order:
        if not 0.0 <= depths[i] <= 1.0:
            raise ValueError(f"needle depths must be in [0, 1], got {depths[i]}")
        cut = round(depths[i] * len(haystack))
        out += haystack[previous:cut] + list(needles[i])
        previous = cut
    return out + haystack[previous:]
