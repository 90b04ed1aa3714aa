"""The commands' implementations: `flexsparse demo` (demo.py), `flexsparse bench` (bench.py), pictures (pictures.py)."""
