"""Text domains: evaluation on text of more than one kind, so that how well a calibration generalizes is measured.

Heads, gates and thresholds are fitted on the calibration part of one corpus; the held-out part of that same
corpus is text of the same kind, and scoring on it alone hides how much a fitted configuration depends on the kind
of text it saw (SmolLM2 with a third of its KV heads full, fitted on the pydoc text: 1.041x full attention's
perplexity at 8K on held-out pydoc, 1.082x on text of another kind). Two built-in domains, both read from the
running interpreter's own files (no download, nothing shipped with this package):

``pydoc``  Python's language documentation, ``pydoc_data.topics`` (:func:`~flexsparse.eval.text.default_text`):
           English prose of a reference manual with short code examples; ~113K tokens of SmolLM2's tokenizer.
``code``   Python source: the standard library's own ``.py`` files of :data:`STDLIB_MODULES` (argparse,
           dataclasses, difflib, ...), in that order, as installed (:func:`stdlib_source`); ~120K tokens.

Source code is the kind of text most unlike the documentation that every CPython install carries: the stdlib's
pure-Python modules are installed wherever the pydoc topics are (the test suite's data files are not: distributions
ship them apart or not at all), and code differs from prose in vocabulary, line structure, indentation and
repetition (names defined far above are used again far below). The modules are ones that have been single
pure-Python files from 3.10 to 3.14, so every supported interpreter has them; their text differs by version, as the
pydoc topics do.

Calibration reads one domain (``pydoc`` by default: :func:`domain_corpus`); evaluation measures perplexity on the
held-out part of every domain (:func:`evaluation_domains`), and records carry the domain's name. A user's own text
(``--text FILE``) replaces the built-in domains: it is then the only domain, named ``text``.
"""

from __future__ import annotations

import sysconfig
from collections.abc import Callable
from pathlib import Path

from flexsparse.eval.text import Corpus, default_text

STDLIB_MODULES = ("argparse", "dataclasses", "difflib", "fractions", "heapq", "inspect", "statistics", "textwrap")
"""The standard library modules whose source makes the ``code`` domain, in this order."""


def stdlib_source(modules: tuple[str, ...] = STDLIB_MODULES) -> str:
    """The source of the standard library's ``modules`` (``<stdlib>/<name>.py`` of the running interpreter),
    joined by blank lines; FileNotFoundError naming the file where an installation lacks the source."""
    root = Path(sysconfig.get_path("stdlib"))
    parts = []
    for name in modules:
        path = root / f"{name}.py"
        if not path.is_file():
            raise FileNotFoundError(f"the code domain reads the standard library's source, and {path} is not "
                                    "installed; evaluate on the pydoc domain alone or give --text FILE")
        parts.append(path.read_text(encoding="utf-8").strip())
    return "\n\n".join(parts)


DOMAINS: dict[str, Callable[[], str]] = {"pydoc": default_text, "code": stdlib_source}
"""The built-in domains: name -> a function returning the domain's text."""

DEFAULT_CALIBRATION_DOMAIN = "pydoc"


def domain_corpus(tokenizer, name: str = DEFAULT_CALIBRATION_DOMAIN) -> Corpus:
    """The built-in domain ``name`` tokenized and split (:meth:`Corpus.from_text`), named ``name``."""
    if name not in DOMAINS:
        raise ValueError(f"unknown text domain {name!r}; known: {sorted(DOMAINS)}")
    return Corpus.from_text(tokenizer, DOMAINS[name](), name=name)


def evaluation_domains(tokenizer, corpus: Corpus) -> tuple[Corpus, ...]:
    """The corpora perplexity is measured on by default: every built-in domain when ``corpus`` (the calibration
    corpus) is one of them, ``corpus`` itself reused, the others tokenized now; else ``corpus`` alone (the user's
    own text replaces the built-in domains)."""
    if corpus.name not in DOMAINS:
        return (corpus,)
    return tuple(corpus if name == corpus.name else domain_corpus(tokenizer, name) for name in DOMAINS)
