#!/usr/bin/env bash
# The GPU check, one command: every CUDA test (pytest -m gpu), op and layer benchmarks, pretraining
# throughput and largest batch (s=128/512; original, Tempo, Tempo+sdpa), SQuAD s=384, and a summary
# beside the anchors, within 25 minutes on one H100 (the stage limits add up to 1,500 s). A thin
# wrapper around `python -m tempo.bench gpu-suite` (see its --help); arguments pass through, e.g.
#   scripts/gpu_check.sh                      # everything, results/<gpu>/<time>/summary.md
#   scripts/gpu_check.sh --dry-run            # the stage commands, their limits, each part's sum
#   scripts/gpu_check.sh --part 1 --out-dir results/h100/run1   # where a command may take 10 minutes:
#   scripts/gpu_check.sh --part 2 --out-dir results/h100/run1   #   the three parts one after another,
#   scripts/gpu_check.sh --part 3 --out-dir results/h100/run1   #   one summary.md in the end
# Without a CUDA GPU it exits 1 with one line. PYTHON picks the interpreter (default: python).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
TEMPO_GPU_CHECK_COMMAND="scripts/gpu_check.sh${*:+ $*}"
export TEMPO_GPU_CHECK_COMMAND
exec "${PYTHON:-python}" -m tempo.bench gpu-suite "$@"
