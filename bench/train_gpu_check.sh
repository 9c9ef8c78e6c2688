#!/usr/bin/env bash
# GPU check of the trainer: the 125M config at T=2048, NSA then --attention-mode dense, on the shared wiki
# parquet with the GPT-2 tokenizer (local files only: no `datasets`, no network), one GPU, bf16.
# Prints one table (tokens/s, MFU, peak memory, loss curve, validation loss). Usage:
#   bash bench/train_gpu_check.sh                    # 80 steps each, 8 x 2048 tokens per step
#   STEPS=100 MB=16 EXTRA="--compile" bash bench/train_gpu_check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
DATA=${DATA:-../shared/data}
STEPS=${STEPS:-80}
MB=${MB:-8}
OUT=${OUT:-bench/results/train_gpu_check}
PY=${PY:-python}
# dense: SDPA (a boolean document mask with packed documents); dense-flex: FlexAttention (the documents as a block
# mask), the fair dense baseline with packed documents (issue 20)
for run in nsa dense dense-flex; do
  mode=${run%%-*}
  impl=(); [[ $run == dense-flex ]] && impl=(--attn-implementation flex_attention)
  rm -rf "$OUT/$run"
  $PY train_accelerate.py --dataset "$DATA/wiki-summaries-en.parquet" --tokenizer "$DATA/gpt2-tokenizer" \
    --model 125m --attention-mode "$mode" "${impl[@]}" --seq-len 2048 --micro-batch-size "$MB" --max-steps "$STEPS" \
    --lr 6e-4 --warmup-steps 10 --log-every 10 --eval-every "$STEPS" --val-tokens 65536 --save-every 0 \
    --shuffle-buffer 1000 --report-to none --mixed-precision bf16 --stall-timeout 900 \
    --output-dir "$OUT/$run" ${EXTRA:-} 2>&1 | tail -n 30
done
$PY bench/train_gpu_summary.py "$OUT/nsa" "$OUT/dense" "$OUT/dense-flex"
