#!/usr/bin/env bash
# Shared by tempo_benchmarking_squad_<gpu>.sh: original vs Tempo at the largest batch that fits.
# Caller sets GPU_NAME and PRECISIONS. Environment (all optional): CONFIG_FILE (default
# configs/bert_large.json), TRAIN_FILE (default: a generated QA set; shapes are padded to
# MAX_SEQ_LENGTH, so memory and speed match real SQuAD), VOCAB_FILE, INIT_CHECKPOINT,
# MAX_SEQ_LENGTH (384), STEPS (50, throughput run), PROBE_STEPS (3). Extra arguments go to
# python -m tempo.bench.squad_benchmark. Results: results/squad_benchmark/$GPU_NAME/<timestamp>/.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."

if ! python -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)'; then
  echo "$(basename "$0"): error: no CUDA GPU visible; this benchmark measures GPU memory" >&2
  exit 1
fi

bench_args=(--gpu "$GPU_NAME" --precisions "$PRECISIONS"
            --config_file "${CONFIG_FILE:-configs/bert_large.json}"
            --max_seq_length "${MAX_SEQ_LENGTH:-384}" --steps "${STEPS:-50}" --probe_steps "${PROBE_STEPS:-3}")
[ -n "${TRAIN_FILE:-}" ] && bench_args+=(--train_file "$TRAIN_FILE")
[ -n "${VOCAB_FILE:-}" ] && bench_args+=(--vocab_file "$VOCAB_FILE")
[ -n "${INIT_CHECKPOINT:-}" ] && bench_args+=(--init_checkpoint "$INIT_CHECKPOINT")

python -m tempo.bench.squad_benchmark "${bench_args[@]}" "$@"
