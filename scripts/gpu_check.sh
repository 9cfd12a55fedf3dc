#!/usr/bin/env bash
# The GPU check, one command. With no arguments: the quick plan, at most 7 minutes on one H100 (no
# stage starts after 6.5 minutes; the stage limits add up to 420 s): environment, every Triton
# kernel's forward and backward against fp64, memory truth (max_memory_allocated of a BERT-large
# step, stock sdpa vs apply_tempo, beside the ledger's prediction), one-layer speed (eager and
# torch.compile) beside tempo.movement's projections, and the largest batch at s = 512; results and
# summary.md in results/<gpu>/<time>/. A thin wrapper around `python -m tempo.bench gpu-suite`
# (see its --help: tempo/bench/gpu_suite.py runs both plans, gpu_quick.py holds the quick plan's
# stage bodies); arguments pass through, e.g.
#   scripts/gpu_check.sh                      # the quick plan
#   scripts/gpu_check.sh --dry-run            # its stages, limits and deadlines (any machine)
#   scripts/gpu_check.sh --tarball "$OUT/gpu_quick.tar.gz"   # also one file to carry back (+ summary.md)
#   scripts/gpu_check.sh --full               # the 25-minute suite (pytest -m gpu, benchmarks, max-batch)
#   scripts/gpu_check.sh --part 1 --out-dir results/h100/run1   # the full suite where a command may take
#   scripts/gpu_check.sh --part 2 --out-dir results/h100/run1   #   10 minutes: its three parts one after
#   scripts/gpu_check.sh --part 3 --out-dir results/h100/run1   #   another, one summary.md in the end
# Without a CUDA GPU it exits 1 with one line. PYTHON picks the interpreter (default: python).
# Where the checkout has no .git (a copied working tree), TEMPO_GIT_COMMIT=<sha> names the commit.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
TEMPO_GPU_CHECK_COMMAND="scripts/gpu_check.sh${*:+ $*}"
export TEMPO_GPU_CHECK_COMMAND
exec "${PYTHON:-python}" -m tempo.bench gpu-suite "$@"
