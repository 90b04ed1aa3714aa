"""Regenerate tests/data/esa_golden.json from the float32 re-implementation of the authors' index code.

    python -m tests.data.make_esa_golden
"""

import json
from pathlib import Path

from tests.esa_float_reference import esa_float_indices

CONFIGS = [  # (seq_len, num_layers, num_heads, attn_length)
    (48, 4, 4, 8),
    (96, 6, 3, 12),
    (33, 1, 1, 5),
    (20, 2, 5, 32),
    (70, 5, 8, 16),
]


def main() -> None:
    tables = []
    for seq, layers, heads, w in CONFIGS:
        keys = []
        for layer in range(layers):
            index, valid = esa_float_indices(range(seq), layer, layers, w, heads)
            keys.append([[index[h, i][valid[h, i]].tolist() for i in range(seq)] for h in range(heads)])
        tables.append(dict(seq_len=seq, num_layers=layers, num_heads=heads, attn_length=w, keys=keys))
    path = Path(__file__).with_name("esa_golden.json")
    path.write_text(json.dumps(tables, separators=(",", ":")))
    print(f"wrote {path} ({path.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
