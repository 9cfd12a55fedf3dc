#!/usr/bin/env bash
# SQuAD fine-tuning on one V100: original vs Tempo, fp32 and fp16, each at the largest batch that
# fits (found by python -m tempo.bench max-batch). See squad_benchmark_common.sh for the options.
GPU_NAME=v100 PRECISIONS=fp32,fp16 source "$(dirname "$0")/squad_benchmark_common.sh" "$@"
