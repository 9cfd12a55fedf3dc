#!/usr/bin/env bash
# scripts/run_squad.sh with the Tempo layers switched on, whatever patch_tempo.sh last set.
# Same positional arguments as scripts/run_squad.sh; EXTRA_ARGS adds more run_squad.py flags.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
EXTRA_ARGS="--tempo ${EXTRA_ARGS:-}" exec "$here/../run_squad.sh" "$@"
