#!/usr/bin/env bash
# Get the default model (a 98 MB GGUF) and the pure-Python `gguf` package onto a GPU machine without internet
# whose transfers take at most 64 MiB each: split the file here, send the pieces in two runs, join them there.
#
#   here:          bench/quality/ship_model.sh split            # bench/results/ship/: part-aa, part-ab (<= 50 MB each),
#                                                       # model.sha256, the gguf wheel (pip download --no-deps)
#   device run 1:  carry bench/results/ship/part-aa and the gguf-*.whl;  command: bench/quality/ship_model.sh stash
#   device run 2:  carry bench/results/ship/part-ab and model.sha256, right after run 1 (the machine keeps /tmp
#                  while warm, ~30 s); command:
#                  bench/quality/ship_model.sh stash && bench/quality/ship_model.sh join && \
#                  PYTHONPATH=/tmp/flexsparse-ship/site:. python bench/quality/quality_smollm2.py \
#                      --model /tmp/flexsparse-ship/SmolLM2-135M-Instruct.Q4_1.gguf --out $OUT/quality
#
# `join` writes the file under its own name, checks its SHA-256 and installs the wheel into
# /tmp/flexsparse-ship/site (gguf needs numpy, pyyaml and tqdm, which transformers already requires; its `requests`
# import is only for downloads). Loading the GGUF also needs `accelerate` (transformers' GGUF path requires it).
set -euo pipefail
cd "$(dirname "$0")/../.."
SHIP=bench/results/ship
STASH=/tmp/flexsparse-ship
PYTHON=${PYTHON:-python}

case "${1:-}" in
  split)
    model=$("$PYTHON" -c "from flexsparse.eval.models import default_model_path; print(default_model_path())")
    rm -rf "$SHIP" && mkdir -p "$SHIP"
    split -b 50M "$model" "$SHIP/part-"
    (cd "$(dirname "$model")" && sha256sum "$(basename "$model")") > "$SHIP/model.sha256"
    "$PYTHON" -m pip download --no-deps --quiet gguf -d "$SHIP"
    ls -l "$SHIP"
    ;;
  stash)
    mkdir -p "$STASH"
    found=$(ls "$SHIP" 2>/dev/null || true)
    [ -n "$found" ] || { echo "ship_model.sh stash: nothing carried under $SHIP" >&2; exit 2; }
    cp "$SHIP"/* "$STASH"/
    ls -l "$STASH"
    ;;
  join)
    name=$(awk '{print $2}' "$STASH/model.sha256")
    cat "$STASH"/part-* > "$STASH/$name"
    (cd "$STASH" && sha256sum -c model.sha256)
    "$PYTHON" -m pip install --quiet --no-deps --no-index --target "$STASH/site" "$STASH"/gguf-*.whl
    ;;
  *)
    echo "usage: bench/quality/ship_model.sh split | stash | join" >&2
    exit 2
    ;;
esac
