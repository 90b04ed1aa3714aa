"""kernels/ depends on no masks/ module (masks/ may import kernels/, not the other way round)."""

import ast
from pathlib import Path

KERNELS = Path(__file__).resolve().parents[1] / "flexsparse" / "kernels"


def _imported_modules(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def test_kernels_import_nothing_of_masks():
    files = sorted(KERNELS.glob("*.py"))
    assert len(files) > 10
    offenders = {path.name: sorted(name for name in _imported_modules(path) if name.startswith("flexsparse.masks"))
                 for path in files}
    assert {name: found for name, found in offenders.items() if found} == {}
