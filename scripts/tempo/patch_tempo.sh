#!/usr/bin/env bash
# Make run_pretraining.py and run_squad.py use the Tempo layers by default.
# Nothing is copied over source files: a state file at the repo root records the choice.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
export TEMPO_PATCH_FILE="${TEMPO_PATCH_FILE:-$repo/.tempo_patch}"  # where the trainers look, wherever they run from
cd "$repo" && exec "${PYTHON:-python3}" -m tempo.train.flags patch
