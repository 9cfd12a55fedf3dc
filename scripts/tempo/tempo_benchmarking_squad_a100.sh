#!/usr/bin/env bash
# SQuAD fine-tuning on one A100: original vs Tempo, tf32 (for fp32) and bf16 (for fp16), each at the largest batch that
# fits (found by python -m tempo.bench max-batch). See squad_benchmark_common.sh for the options.
GPU_NAME=a100 PRECISIONS=tf32,bf16 source "$(dirname "$0")/squad_benchmark_common.sh" "$@"
