"""Every ```python block of README.md runs as written (each in a fresh namespace, in a scratch directory): on a CPU
at the small sizes the blocks pick there, on a GPU at theirs."""

import re
from pathlib import Path

import pytest
import torch

README = Path(__file__).resolve().parent.parent / "README.md"
FENCE = re.compile(r"^```(\w*)\n(.*?)^```$", re.DOTALL | re.MULTILINE)

pytestmark = pytest.mark.filterwarnings("ignore:.*flex_attention called without torch.compile.*")


def fenced_blocks() -> list[tuple[str, int, str]]:
    """(language, line number, code) of every fenced block of the README."""
    text = README.read_text()
    return [(m.group(1), text.count("\n", 0, m.start()) + 1, m.group(2)) for m in FENCE.finditer(text)]


PYTHON = [(line, code) for language, line, code in fenced_blocks() if language == "python"]


def test_the_readme_has_its_python_blocks():
    """The parse finds the blocks (Example, transformers, routers, verifier), and no block is in another language
    that would go unchecked: python runs here, bash are the install and test commands, plain text the layout."""
    assert len(PYTHON) >= 4
    assert {language for language, _, _ in fenced_blocks()} <= {"python", "bash", ""}


@pytest.mark.parametrize("line,code", PYTHON, ids=[f"line-{line}" for line, _ in PYTHON])
def test_python_block_runs(line, code, tmp_path, monkeypatch):
    if "transformers" in code:
        pytest.importorskip("transformers")
    monkeypatch.chdir(tmp_path)  # blocks may write files (save_config)
    torch.manual_seed(0)
    exec(compile(code, f"README.md, block at line {line}", "exec"), {"__name__": "__readme__"})  # noqa: S102
