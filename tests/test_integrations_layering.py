"""integrations/ imports nothing of eval/ (eval/ builds on integrations/, not the other way round): every import
statement of every integrations module, lazy ones inside functions and relative ones included."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "flexsparse"


def _imported_modules(source: str, package: str) -> set[str]:
    """Absolute names a module of ``package`` (dotted) imports; ``from .. import x`` resolved against it."""
    parts = package.split(".")
    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(parts[: len(parts) - node.level + 1]) if node.level else ""
            module = ".".join(part for part in (base, node.module or "") if part)
            names.add(module)
            names.update(f"{module}.{alias.name}" for alias in node.names)
    return names


def _eval_imports(names: set[str]) -> list[str]:
    return sorted(name for name in names if name == "flexsparse.eval" or name.startswith("flexsparse.eval."))


def test_the_check_sees_lazy_and_relative_imports():
    source = "from ..eval import text\nfrom . import routing\n\ndef f():\n    import flexsparse.eval.tasks\n"
    names = _imported_modules(source, "flexsparse.integrations")
    assert "flexsparse.integrations.routing" in names
    assert _eval_imports(names) == ["flexsparse.eval", "flexsparse.eval.tasks", "flexsparse.eval.text"]


def test_integrations_import_nothing_of_eval():
    files = sorted((PACKAGE / "integrations").glob("*.py"))
    assert len(files) > 5
    offenders = {path.name: _eval_imports(_imported_modules(path.read_text(), "flexsparse.integrations"))
                 for path in files}
    assert {name: found for name, found in offenders.items() if found} == {}


def test_the_cache_sits_below_runtime_and_integrations():
    """cache/ (a sparse KV cache's storage) imports nothing of runtime/, integrations/ or transformers: executors
    and the transformers Cache build on it, not the other way round."""
    bad = []
    for path in sorted((PACKAGE / "cache").glob("*.py")):
        names = _imported_modules(path.read_text(), "flexsparse.cache")
        bad += [f"{path.name}: {name}" for name in sorted(names)
                if name.split(".")[0] == "transformers" or name.startswith(("flexsparse.runtime", "flexsparse.integrations"))]
    assert not bad, bad
