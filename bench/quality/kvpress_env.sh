#!/usr/bin/env bash
# kvpress's own environment for bench/quality/kvpress_beside.py (kvpress 0.5.5 pins transformers < 5.3,
# flexsparse needs >= 5.17: they cannot share one). Its Python is `run --kvpress-python` (default
# /tmp/kvpress-venv/bin/python; the folder is $KVPRESS_VENV).
#
#   bash bench/quality/kvpress_env.sh                  # build a venv here: torch 2.13.0 (the CPU build),
#                                                      # kvpress 0.5.5, gguf, accelerate, lm-eval[ruler] 0.4.13
#   bash bench/quality/kvpress_env.sh --print          # print the commands instead of running them
#   bash bench/quality/kvpress_env.sh --download-wheels DIR [--python-version 3.12] [--all]
#       (here, after the build) the wheels a machine without internet needs for the kvpress step, pinned to the
#       built venv's versions (a package published as source only is built into a wheel): DIR/part-1 holds
#       what the H200 image lacks or holds in a version kvpress's transformers 5.2 refuses (kvpress,
#       transformers 5.2.0, tokenizers 0.22.2, huggingface-hub, datasets and its dill/multiprocess/fsspec,
#       fire, termcolor, cachetools, gguf); --all adds every other requirement (no torch) in part-2... for a
#       bare machine.
#       Each part is at most 60 MiB; DIR/requirements.txt lists every pin.
#   bash bench/quality/kvpress_env.sh --from-wheels DIR
#       (there) install DIR's part-*/*.whl offline into $KVPRESS_VENV/site (pip --target, no dependency
#       resolution) and write $KVPRESS_VENV/bin/python, which runs this machine's python3 (its torch) with
#       that folder first on PYTHONPATH, so kvpress's transformers 5.2 shadows the image's only there.
set -euo pipefail

VENV="${KVPRESS_VENV:-/tmp/kvpress-venv}"
TOP_PACKAGES=(kvpress==0.5.5 gguf accelerate)
SAMPLE_PACKAGES=("lm-eval[ruler]==0.4.13")
# what the H200 image (KINDS.md's package list, 2026-11) lacks, or holds in a version transformers 5.2 refuses
# at import (tokenizers 0.23.2 > 0.23.0)
IMAGE_LACKS="kvpress transformers tokenizers huggingface-hub datasets dill multiprocess fsspec fire termcolor
cachetools gguf"
PART_MIB=60
HERE="$(cd "$(dirname "$0")" && pwd)"

usage() { sed -n '2,20p' "$0" | sed 's/^# \{0,1\}//'; }

mode=build dir="" python_version="" print=0 all=0
while [[ $# -gt 0 ]]; do
    case "$1" in
        --print) print=1 ;;
        --download-wheels) mode=download dir="${2:?--download-wheels needs a folder}"; shift ;;
        --from-wheels) mode=from dir="${2:?--from-wheels needs a folder}"; shift ;;
        --python-version) python_version="${2:?--python-version needs a version such as 3.12}"; shift ;;
        --all) all=1 ;;
        -h|--help) usage; exit 0 ;;
        *) echo "error: unknown argument $1 (see --help)" >&2; exit 2 ;;
    esac
    shift
done

run() { if [[ $print == 1 ]]; then printf '%q ' "$@"; echo; else "$@"; fi; }

if [[ $mode == build ]]; then
    run python3 -m venv "$VENV"
    run "$VENV/bin/pip" install --quiet torch==2.13.0 "${TOP_PACKAGES[@]}" "${SAMPLE_PACKAGES[@]}"
    [[ $print == 1 ]] || "$VENV/bin/python" -c 'import kvpress, lm_eval, transformers, torch
print("kvpress venv: transformers", transformers.__version__, "torch", torch.__version__)'
    exit 0
fi

if [[ $mode == from ]]; then
    [[ -d $dir ]] || { echo "error: --from-wheels $dir is not a folder" >&2; exit 2; }
    shopt -s nullglob
    wheels=("$dir"/part-*/*.whl)
    [[ ${#wheels[@]} -gt 0 ]] || { echo "error: no wheels under $dir/part-*/" >&2; exit 2; }
    base="$(command -v python3)"
    run "$base" -m pip install --quiet --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$VENV/site" "${wheels[@]}"
    run mkdir -p "$VENV/bin"
    if [[ $print == 1 ]]; then
        echo "# and $VENV/bin/python: PYTHONPATH=$VENV/site exec $base \"\$@\""
        exit 0
    fi
    printf '#!/usr/bin/env bash\nPYTHONPATH="%s${PYTHONPATH:+:$PYTHONPATH}" exec %q "$@"\n' "$VENV/site" "$base" \
        > "$VENV/bin/python"
    chmod +x "$VENV/bin/python"
    "$VENV/bin/python" -c 'import kvpress, transformers, torch
print("kvpress env: transformers", transformers.__version__, "torch", torch.__version__, "cuda",
      torch.cuda.is_available())'
    exit 0
fi

# --download-wheels
[[ -x $VENV/bin/python ]] || { echo "error: build the venv first (bash $0): its versions are the pins" >&2; exit 2; }
if [[ $print == 1 ]]; then
    echo "# pins: $VENV/bin/python $HERE/kvpress_wheels.py pins $dir/requirements.txt ${TOP_PACKAGES[*]}"
    echo "# then pip download --no-deps --only-binary=:all: (or pip wheel --no-deps) each pin into $dir/all,"
    echo "# then $VENV/bin/python $HERE/kvpress_wheels.py parts $dir $PART_MIB $all $IMAGE_LACKS"
    exit 0
fi
mkdir -p "$dir/all"
"$VENV/bin/python" "$HERE/kvpress_wheels.py" pins "$dir/requirements.txt" "${TOP_PACKAGES[@]}"
platform_args=()
if [[ -n $python_version ]]; then
    platform_args=(--python-version "$python_version" --implementation cp --platform manylinux_2_28_x86_64
                   --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
                   --platform manylinux1_x86_64)
fi
while read -r requirement; do  # a package published as source only (fire) is built into a wheel here
    "$VENV/bin/pip" download --quiet --no-deps --only-binary=:all: "${platform_args[@]}" -d "$dir/all" \
        "$requirement" 2>/dev/null || "$VENV/bin/pip" wheel --quiet --no-deps -w "$dir/all" "$requirement"
done < "$dir/requirements.txt"
# shellcheck disable=SC2086
"$VENV/bin/python" "$HERE/kvpress_wheels.py" parts "$dir" "$PART_MIB" "$all" $IMAGE_LACKS
