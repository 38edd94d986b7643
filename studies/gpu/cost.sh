#!/usr/bin/env bash
# What a 3B and an 8B calibration cost on one GPU: `featcal-llm bench` at Llama-3.2-3B and Llama-3.1-8B layer shapes,
# the paper's calibration set (3 experts x 256 sequences x 2048 tokens), bf16 compute, the product's default lambda.
# Two layers are run (the second is the steady state) and extrapolated to the model's depth.
#   OUT=results bash studies/gpu/cost.sh      (wheels for pydantic under .whl/, see setup.sh; TRIANGLE=0 skips the triangle's run)
set -u
OUT=${OUT:-cost-results}; mkdir -p "$OUT"
source studies/gpu/setup.sh
W=${BENCH_WORKDIR:-/tmp/featcal-bench}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" | tee -a "$OUT/gpu.txt"
common=${COMMON:-"--device cuda --dtype bfloat16 --lam 1e-5 --layers 2 --sequences 256 --seq-len 2048 --no-generation --json"}
# Llama-3.1-8B: hidden 4096, MLP 14336, 32 heads / 8 KV heads, 32 layers
timeout "${T8:-210}" python3 -m featcal_llm bench $common ${SHAPES8:---hidden 4096 --intermediate 14336 --heads 32 --kv-heads 8} \
    --extrapolate-to 32 --workdir "$W/8b" $([ "${TRIANGLE:-1}" = 1 ] || echo --clean) > "$OUT/bench-8b.json" 2> "$OUT/bench-8b.log"; echo "8b rc=$?"
# The same 8B layers with each Gram built from its lower block triangle (as on a CPU; off on GPUs until timed), after a
# check that the triangle equals the square on this GPU for bf16 features.
if [ "${TRIANGLE:-1}" = 1 ]; then
  python3 - <<'PY' | tee "$OUT/gram-triangle-check.txt"
import torch
from featcal_llm.maths import stats
x = torch.randn(8192, 4096, device="cuda", dtype=torch.bfloat16)
square = torch.zeros(4096, 4096, device="cuda", dtype=torch.float32)
stats.accumulate_gram(square, x, torch.float32)
stats.GRAM_TRIANGLE_ON_GPU = True
triangle = torch.zeros_like(square)
stats.accumulate_gram(triangle, x, torch.float32)
print("gram triangle vs square: max |difference| / max |square| =", float((triangle - square).abs().max() / square.abs().max()),
      "symmetric", bool(torch.equal(triangle, triangle.T)))
PY
  timeout "${T8:-210}" python3 -m featcal_llm bench $common ${SHAPES8:---hidden 4096 --intermediate 14336 --heads 32 --kv-heads 8} \
      --gram-triangle --extrapolate-to 32 --workdir "$W/8b" --clean > "$OUT/bench-8b-triangle.json" 2> "$OUT/bench-8b-triangle.log"; echo "8b triangle rc=$?"
fi
# Llama-3.2-3B: hidden 3072, MLP 8192, 24 heads / 8 KV heads, 28 layers
[ "${T3:-120}" -gt 0 ] && timeout "${T3:-120}" python3 -m featcal_llm bench $common ${SHAPES3:---hidden 3072 --intermediate 8192 --heads 24 --kv-heads 8} \
    --extrapolate-to 28 --workdir "$W/3b" --clean > "$OUT/bench-3b.json" 2> "$OUT/bench-3b.log"; echo "3b rc=$?"
for f in "$OUT"/bench-*.log; do echo "== $f"; tail -n 3 "$f"; done
python3 - "$OUT" <<'PY'
import json, sys, pathlib
for f in sorted(pathlib.Path(sys.argv[1]).glob("bench-*.json")):
    try:
        s = json.loads(f.read_text())
    except Exception as e:
        print(f.name, "no result:", e); continue
    print(f.name, "per layer s", s["per_layer"]["seconds"], "extrapolated", s["extrapolated"], "memory", s["memory"],
          "run", {k: s["run"][k] for k in ("tokens_per_expert", "padded_tokens", "stats_dtype", "checkpoint_bytes_per_model")})
PY
