"""Loading a benchmark script of bench/ as a module, for tests of its pure parts (table writing, rows)."""

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCH = Path(__file__).parents[1] / "bench"


def load_bench(script: str) -> ModuleType:
    """bench/<script>.py (``script`` such as ``"tables/esa_crossover"``) as a module; the script puts the checkout
    first on sys.path for the helpers it imports (``bench.common``)."""
    path = BENCH / f"{script}.py"
    spec = importlib.util.spec_from_file_location(f"bench_{script.replace('/', '_')}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module
