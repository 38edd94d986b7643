#!/usr/bin/env bash
# The quality study (docs/studies/quality.md) on one GPU machine, from the repository root:
#   bash studies/gpu/quality.sh GGUF DATA [BUDGET_S] [more `studies.quality run` options, e.g. --phases core,head]
# Wheels under .whl/ (pydantic, pydantic-core, annotated-types, typing-inspection, mergekit, immutables, gguf) are
# installed into /tmp/site first when present (once per machine); results.md, results.json, state.json and log.txt
# are copied into $OUT after every row.
set -euo pipefail
gguf=$1 data=$2 budget=${3:-330}
shift $(( $# < 3 ? $# : 3 ))
if [ ! -d /tmp/site ] && compgen -G ".whl/*.whl" >/dev/null; then  # an earlier call on this machine may have done it
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
fi
[ -d /tmp/site ] && export PYTHONPATH=/tmp/site
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
out=${OUT:-quality-results}
mkdir -p "$out"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
python3 -m studies.quality run --gguf "$gguf" --data "$data" --workdir /tmp/quality-work --device cuda \
    --budget-s "$budget" --results-dir "$out" "$@" 2>&1 | tee "$out/log.txt"
