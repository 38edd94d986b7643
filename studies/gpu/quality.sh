#!/usr/bin/env bash
# The quality study (docs/studies/quality.md) on one GPU machine, from the repository root:
#   bash studies/gpu/quality.sh GGUF DATA [BUDGET_S] [more `studies.quality run` options, e.g. --phases core,head]
# Wheels under .whl/ are installed first (setup.sh); results.md, results.json, state.json and log.txt
# are copied into $OUT after every row.
set -euo pipefail
gguf=$1 data=$2 budget=${3:-330}
shift $(( $# < 3 ? $# : 3 ))
source "$(dirname "$0")/setup.sh"
out=${OUT:-quality-results}
mkdir -p "$out"
python3 -m studies.quality run --gguf "$gguf" --data "$data" --workdir /tmp/quality-work --device cuda \
    --budget-s "$budget" --results-dir "$out" "$@" 2>&1 | tee "$out/log.txt"
