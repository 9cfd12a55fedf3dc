#!/usr/bin/env bash
# Prints "Tempo" or "Original": the layers run_pretraining.py and run_squad.py use by default.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
export TEMPO_PATCH_FILE="${TEMPO_PATCH_FILE:-$repo/.tempo_patch}"  # where the trainers look, wherever they run from
cd "$repo" && exec "${PYTHON:-python3}" -m tempo.train.flags check
