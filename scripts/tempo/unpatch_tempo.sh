#!/usr/bin/env bash
# Back to the original layers (nn.GELU, nn.LayerNorm, eager attention) by default.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
export TEMPO_PATCH_FILE="${TEMPO_PATCH_FILE:-$repo/.tempo_patch}"  # where the trainers look, wherever they run from
cd "$repo" && exec "${PYTHON:-python3}" -m tempo.train.flags unpatch
