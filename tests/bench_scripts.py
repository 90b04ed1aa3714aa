"""Loading a benchmark script of bench/ as a module, for tests of its pure parts (table writing, rows)."""

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCH = Path(__file__).parents[1] / "bench"


def load_bench(name: str) -> ModuleType:
    """bench/<name>.py as a module; bench/ goes on sys.path first, as when the script runs, for the helpers it
    imports from beside it."""
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    spec = importlib.util.spec_from_file_location(f"{name}_bench", BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
