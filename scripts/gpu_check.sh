#!/usr/bin/env bash
# The GPU check, one command: GPU tests, op and layer benchmarks, pretraining throughput and
# largest batch (s=128/512; original, Tempo, Tempo+sdpa), SQuAD s=384, and a summary beside the
# anchors, within ~20 minutes on one H100. A thin wrapper around `python -m tempo.bench gpu-suite`
# (see its --help); arguments pass through, e.g.
#   scripts/gpu_check.sh                      # everything, results/<gpu>/<time>/summary.md
#   scripts/gpu_check.sh --dry-run            # print the stage commands (any machine)
#   scripts/gpu_check.sh --stages maxbatch --time-limit 1800
# Without a CUDA GPU it exits 1 with one line. PYTHON picks the interpreter (default: python).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
TEMPO_GPU_CHECK_COMMAND="scripts/gpu_check.sh${*:+ $*}"
export TEMPO_GPU_CHECK_COMMAND
exec "${PYTHON:-python}" -m tempo.bench gpu-suite "$@"
