#!/usr/bin/env bash
# BERT pretraining in two phases with DeepLearningExamples' defaults (per GPU), on modern PyTorch.
#   scripts/run_pretraining.sh [NUM_GPUS] [PRECISION=bf16|fp16|fp32]
# Environment overrides: DATA_PHASE1, DATA_PHASE2 (HDF5 shard dirs), CONFIG, OUTPUT_DIR,
# BATCH1/BATCH2 (sequences per GPU per step), ACCUM1/ACCUM2, LR1/LR2, STEPS1/STEPS2, TEMPO=--tempo
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export TEMPO_PATCH_FILE="${TEMPO_PATCH_FILE:-$repo/.tempo_patch}"  # the state patch_tempo.sh writes
num_gpus="${1:-1}"
precision="${2:-bf16}"
case "$precision" in
  bf16) prec_flag="--bf16" ;;
  fp16) prec_flag="--fp16" ;;
  fp32) prec_flag="" ;;
  *) echo "precision must be bf16, fp16 or fp32, got '$precision'" >&2; exit 2 ;;
esac
: "${DATA_PHASE1:?set DATA_PHASE1 to a directory of s=128 HDF5 shards}"
: "${DATA_PHASE2:?set DATA_PHASE2 to a directory of s=512 HDF5 shards}"
config="${CONFIG:-$repo/configs/bert_large.json}"
out="${OUTPUT_DIR:-$repo/results/pretraining}"
tempo_flag="${TEMPO:-}"

# DLE phase 1: s=128, 20 predictions, LAMB lr 6e-3, 7038 steps of 65536 sequences (8 GPUs x 8192).
torchrun --standalone --nproc_per_node="$num_gpus" "$repo/run_pretraining.py" \
  --input_dir="$DATA_PHASE1" --config_file="$config" --output_dir="$out" \
  --max_seq_length=128 --max_predictions_per_seq=20 \
  --train_batch_size="${BATCH1:-8192}" --gradient_accumulation_steps="${ACCUM1:-128}" \
  --learning_rate="${LR1:-6e-3}" --warmup_proportion=0.2843 --max_steps="${STEPS1:-7038}" \
  --num_steps_per_checkpoint=200 --resume_from_checkpoint --do_train \
  --json-summary="$out/dllogger_phase1.json" $prec_flag $tempo_flag

# DLE phase 2: s=512, 80 predictions, lr 4e-3, 1563 steps, continuing from phase 1's weights.
torchrun --standalone --nproc_per_node="$num_gpus" "$repo/run_pretraining.py" \
  --input_dir="$DATA_PHASE2" --config_file="$config" --output_dir="$out" \
  --max_seq_length=512 --max_predictions_per_seq=80 \
  --train_batch_size="${BATCH2:-4096}" --gradient_accumulation_steps="${ACCUM2:-256}" \
  --learning_rate="${LR2:-4e-3}" --warmup_proportion=0.128 --max_steps="${STEPS2:-1563}" \
  --num_steps_per_checkpoint=200 --resume_from_checkpoint --phase2 \
  --phase1_end_step="${STEPS1:-7038}" --do_train \
  --json-summary="$out/dllogger_phase2.json" $prec_flag $tempo_flag
