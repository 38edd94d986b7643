#!/usr/bin/env bash
# What `refine:` costs at Llama-3.1-8B on one GPU: `featcal_llm.benchmark.refine_memory` at its shapes (random weights,
# bf16 compute, float32 masters, params auto), 3 experts x 16 records x 2048 tokens, 4 steps of 8 records, a check
# every 2 steps; the GPU's peak (teachers' pass and training apart) against the memory model, and the default run's
# time (3 x 256 x 2048 tokens, 40 steps) extrapolated from the measured parts.
#   OUT=results bash studies/gpu/refine.sh      (wheels for pydantic under .whl/, see setup.sh)
set -u
OUT=${OUT:-refine-results}; mkdir -p "$OUT"
source studies/gpu/setup.sh
python3 -c "import torch, transformers, peft; print('torch', torch.__version__, 'transformers', transformers.__version__, 'peft', peft.__version__)"
# the 8B checkpoints (16 GB each) go where there is room; with under 70 GB free the merged model teaches itself
W=$(df --output=avail,target . /tmp /dev/shm 2>/dev/null | tail -n +2 | sort -n | tail -1 | awk '{print $2}')/featcal-refine
mkdir -p "$W"; FREE=$(df --output=avail "$W" | tail -1); echo "workdir $W, $((FREE / 1048576)) GiB free"
TEACHERS=1; [ "$FREE" -lt $((70 * 1048576)) ] && TEACHERS=0
timeout "${T8:-480}" python3 -m featcal_llm.benchmark.refine_memory --device cuda --llama-8b --params auto --experts 3 \
    --records ${RECORDS:-16} --length 2048 --steps ${STEPS:-4} --eval-every 2 --batch-tokens 8192 --teacher-checkpoints $TEACHERS \
    --workdir "$W" --json "$OUT/refine-8b.json" 2>&1 | grep -v "Writing model shards" | tee "$OUT/refine-8b.log"
echo "rc=${PIPESTATUS[0]}"
nvidia-smi --query-gpu=memory.used,memory.total --format=csv,noheader
rm -rf "$W"
