#!/usr/bin/env bash
# Prints "Tempo" or "Original": the layers run_pretraining.py and run_squad.py use by default.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$repo" && exec "${PYTHON:-python3}" -m tempo.bert.tempo_switch check
