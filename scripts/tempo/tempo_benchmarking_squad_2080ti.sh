#!/usr/bin/env bash
# SQuAD fine-tuning on one 2080TI: original vs Tempo, fp32 and fp16, each at the largest batch that
# fits (found by python -m tempo.bench max-batch). See squad_benchmark_common.sh for the options.
GPU_NAME=2080ti PRECISIONS=fp32,fp16 source "$(dirname "$0")/squad_benchmark_common.sh" "$@"
