"""What a new user's eval setup gives: the ``eval`` extra installs what ``flexsparse eval`` needs by default
(its quality plot too), and the first load of a GGUF file says on stderr what it is doing before the long
conversion."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def extra(name: str) -> list[str]:
    """The requirement names of one optional-dependency group of pyproject.toml."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    groups = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    return [re.match(r"[A-Za-z0-9._-]+", requirement).group(0) for requirement in groups[name]]


def test_the_eval_extra_holds_what_flexsparse_eval_imports_by_default():
    """``flexsparse eval`` writes quality.png unless --no-plot: matplotlib comes with the eval extra, as do the
    GGUF loader's packages."""
    assert {"transformers", "gguf", "accelerate", "matplotlib"} <= set(extra("eval"))


class StopBeforeConverting(Exception):
    pass


def test_the_first_gguf_load_says_what_it_does(tmp_path, monkeypatch, capsys):
    """Before converting a GGUF file (about a minute for the default model) load_model prints one line on stderr
    naming the file and the cache directory; the conversion itself is stopped here at its first step."""
    transformers = pytest.importorskip("transformers")
    for module in ("gguf", "accelerate"):
        pytest.importorskip(module)
    from flexsparse.eval.models import load_model

    def stop(*args, **kwargs):
        raise StopBeforeConverting

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", stop)
    monkeypatch.setenv("FLEXSPARSE_CACHE", str(tmp_path / "cache"))
    model_file = tmp_path / "tiny.gguf"
    model_file.write_bytes(b"GGUF not really")
    with pytest.raises(StopBeforeConverting):
        load_model(model_file, device="cpu")
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1
    assert "converting tiny.gguf" in lines[0] and str(tmp_path / "cache") in lines[0] and "once" in lines[0]
