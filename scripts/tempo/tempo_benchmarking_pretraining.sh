#!/usr/bin/env bash
# BERT-large pretraining on synthetic data, phase 1 (s=128, 20 predictions) and phase 2
# (s=512, 80 predictions), bf16: original vs Tempo vs Tempo+sdpa, each at the largest batch that
# fits (python -m tempo.bench max-batch, one fresh process per probe), then timed at that batch.
# Writes results/<gpu>/<timestamp>-pretraining/ (max-batch and train JSON, report.md, plots) and
# prints a summary table.
#
# Environment (all optional):
#   PYTHON=python3  MODEL=bert_large  PRECISION=bf16  OPTIMIZER=lamb  STEPS=30  WARMUP=10
#   MAX_BATCH_CAP=2048  RESULTS_ROOT=results  PHASES="1:128:20 2:512:80"  (phase:seq:predictions)
#   TEMPO_LAYERS=gelu,layernorm,attention   (the Tempo layers of the "tempo" rows)
#   EXTRA_ARGS=""   extra train flags, e.g. a CPU dry run:
#     MODEL=bert_tiny PRECISION=fp32 PHASES="1:32:8" STEPS=2 WARMUP=1 \
#       EXTRA_ARGS="--device cpu --memory-budget 200MiB" scripts/tempo/tempo_benchmarking_pretraining.sh
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$repo"
PYTHON=${PYTHON:-python3}
MODEL=${MODEL:-bert_large}
PRECISION=${PRECISION:-bf16}
OPTIMIZER=${OPTIMIZER:-lamb}
STEPS=${STEPS:-30}
WARMUP=${WARMUP:-10}
MAX_BATCH_CAP=${MAX_BATCH_CAP:-2048}
RESULTS_ROOT=${RESULTS_ROOT:-results}
PHASES=${PHASES:-"1:128:20 2:512:80"}
TEMPO_LAYERS=${TEMPO_LAYERS:-gelu,layernorm,attention}
read -r -a extra <<< "${EXTRA_ARGS:-}"

label=$("$PYTHON" -c "import torch; from tempo.bench.hardware import device_label; \
print(device_label('cuda' if torch.cuda.is_available() and '--device cpu' not in '${EXTRA_ARGS:-}' else 'cpu'))")
out="$RESULTS_ROOT/$label/$(date +%Y%m%d-%H%M%S)-pretraining"
mkdir -p "$out"
echo "results: $out"

declare -A variant_flags=(
  [original]="--attention eager"
  [tempo]="--tempo-layers $TEMPO_LAYERS"
  [tempo-sdpa]="--tempo-layers ${TEMPO_LAYERS/,attention/} --attention sdpa"
)
variants=(original tempo tempo-sdpa)

for phase_spec in $PHASES; do
  IFS=: read -r phase seq preds <<< "$phase_spec"
  for variant in "${variants[@]}"; do
    read -r -a vflags <<< "${variant_flags[$variant]}"
    common=(--model "$MODEL" --seq-len "$seq" --max-predictions "$preds" --precision "$PRECISION"
            --optimizer "$OPTIMIZER" "${vflags[@]}" "${extra[@]}")
    tag="phase${phase}_${variant}"
    echo "== phase $phase (s=$seq), $variant: largest batch"
    if ! "$PYTHON" -m tempo.bench max-batch "${common[@]}" --max "$MAX_BATCH_CAP" --out "$out/max_batch_$tag.json"; then
      echo "   max-batch failed for $tag (see above); skipping its timed run"
      continue
    fi
    batch=$("$PYTHON" -c "import json,sys; print(json.load(open(sys.argv[1]))['max_batch'] or 0)" "$out/max_batch_$tag.json")
    if [[ "$batch" -lt 1 ]]; then
      echo "   not even batch 1 fits for $tag"
      continue
    fi
    echo "== phase $phase (s=$seq), $variant: timing at batch $batch"
    "$PYTHON" -m tempo.bench train "${common[@]}" --batch-size "$batch" --steps "$STEPS" --warmup "$WARMUP" \
      --out "$out/train_$tag.json" || echo "   timed run failed for $tag"
  done
done

"$PYTHON" - "$out" <<'PY'
import json, sys
from pathlib import Path

out = Path(sys.argv[1])
print("\n| phase | s | variant | max batch | samples/s | step p50 ms | MFU | activations/sample | peak alloc |")
print("|---|---|---|---|---|---|---|---|---|")
order = {"original": 0, "tempo": 1, "tempo-sdpa": 2}
def key(path):
    phase, variant = path.stem[len("max_batch_"):].split("_", 1)
    return phase, order.get(variant, 9)
for path in sorted(out.glob("max_batch_*.json"), key=key):
    tag = path.stem[len("max_batch_"):]
    phase, variant = tag.split("_", 1)
    mb = json.loads(path.read_text())
    train = out / f"train_{tag}.json"
    r = json.loads(train.read_text()) if train.is_file() else None
    def cell(x, fmt, unit=""):
        return "-" if x is None else format(x, fmt) + unit
    if r:
        a, m = r["anatomy"], r["memory"]
        per_sample = a.get("activations_per_sample")
        print(f"| {phase[5:]} | {r['config']['seq_len']} | {variant} | {mb['max_batch']} | {r['samples_per_s']:.1f} "
              f"| {r['step_time_ms']['p50']:.1f} | {cell(r['mfu'] and 100 * r['mfu'], '.1f', '%')} "
              f"| {cell(per_sample and per_sample / 2**20, '.1f', ' MiB')} "
              f"| {cell(m.get('peak_allocated_bytes') and m['peak_allocated_bytes'] / 2**30, '.2f', ' GiB')} |")
    else:
        print(f"| {phase[5:]} | - | {variant} | {mb.get('max_batch')} | - | - | - | - | - |"
              + (f"  error: {mb['error'].strip().splitlines()[-1]}" if mb.get("error") else ""))
PY
"$PYTHON" -m tempo.bench report "$out"
