#!/usr/bin/env bash
# Every GPU check and figure the README reports, in one place. Each step writes its log (and JSON where
# the script has one) under $OUT; steps run in the order given (default: all). Usage:
#   bash bench/gpu_session.sh                         # tests attention tune model generate profile train
#   bash bench/gpu_session.sh tests attention         # a subset (each step fits a 10-minute slot)
#   OUT=/tmp/run FLA_WHEEL=wheels/fla_core-0.6.0-py3-none-any.whl bash bench/gpu_session.sh attention
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench/results/gpu_session}
PY=${PY:-python}
mkdir -p "$OUT"
steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(tests attention tune model generate profile train)
{ date -u; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader || echo "no nvidia-smi";
  $PY -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__,
'transformers', transformers.__version__)"; git rev-parse --short HEAD 2>/dev/null || true; } | tee "$OUT/env.txt"
if [ -n "${FLA_WHEEL:-}" ]; then  # fla-core for the comparison column; report whether it imports
  $PY -m pip install --quiet --no-deps "$FLA_WHEEL" || true
  $PY -c "from fla.ops.nsa import parallel_nsa; print('fla import ok')" 2>&1 | tail -1 | tee -a "$OUT/env.txt"
fi
for step in "${steps[@]}"; do
  echo "== $step" | tee -a "$OUT/env.txt"
  case "$step" in
    tests)      $PY -m pytest -q tests/test_triton_kernels.py tests/test_model_triton.py -k gpu -rA 2>&1 | tail -n 40 ;;
    attention)  $PY bench/bench_attention.py --json "$OUT/attention.json" ;;
    # launch variants (tiles, warps, top-n insertion) with per-kernel times: where the defaults come from
    tune)       $PY bench/tune_kernels.py --json "$OUT/tune.json" ;;
    model)      $PY bench/bench_model.py --seq-lens 2048 8192 --steps 5 --warmup 2 ;;
    # generate(): per-token latency and prefill against a HF Llama of the same size, default and static
    # (compiled) caches; prompts 4k and 64k (each static model compiles once per prompt length)
    generate)   $PY bench/bench_generate.py --prompt-lens 4096 65536 --json "$OUT/generate.json" ;;
    profile)    $PY bench/profile_nsa.py ;;
    train)      DATA=${DATA:-../shared/data} STEPS=${STEPS:-50} MB=${MB:-8} OUT="$OUT/train" bash bench/train_gpu_check.sh ;;
    *)          echo "unknown step $step (tests attention tune model generate profile train)"; exit 2 ;;
  esac 2>&1 | tee "$OUT/$step.log" || echo "== $step exited non-zero (log: $OUT/$step.log)" | tee -a "$OUT/env.txt"
done
