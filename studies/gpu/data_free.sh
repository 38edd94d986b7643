#!/usr/bin/env bash
# The data-free start study (studies/data_free_start.py) on one GPU machine, from the repository root:
#   bash studies/gpu/data_free.sh GGUF DATA [BUDGET_S] [more `studies.data_free_start` options, e.g. --settings real,auto]
# DATA is a folder written by `python -m studies.quality prepare` (DATA/<kind>/{train,cal,test}.jsonl). Wheels under
# .whl/ are installed first (setup.sh); results.md, results.json and run-logs.tar.gz (every FeatCal run's
# log) are copied into $OUT after every setting, log.txt as it goes. No FeatCal run starts after BUDGET_S seconds
# (default 420: on one H200 the experts, real, auto and the other start of both families fit; auto_x4 does not).
set -euo pipefail
gguf=$1 data=$2 budget=${3:-420}
shift $(( $# < 3 ? $# : 3 ))
source "$(dirname "$0")/setup.sh"
out=${OUT:-data-free-results}
mkdir -p "$out"
python3 -m studies.data_free_start --gguf "$gguf" --data "$data" --workdir /tmp/data-free-work --device cuda \
    --budget-s "$budget" --results-dir "$out" "$@" 2>&1 | tee "$out/log.txt"
