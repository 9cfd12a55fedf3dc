#!/usr/bin/env bash
# Back to the original layers (nn.GELU, nn.LayerNorm, eager attention) by default.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$repo" && exec "${PYTHON:-python3}" -m tempo.bert.tempo_switch unpatch
