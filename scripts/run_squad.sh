#!/usr/bin/env bash
# SQuAD fine-tuning / prediction with DeepLearningExamples' run_squad.sh arguments (positional,
# all optional). Paths are relative to the repository root unless given absolute.
#
#   scripts/run_squad.sh [init_checkpoint] [epochs] [batch_size] [learning_rate] [warmup_proportion]
#                        [precision] [num_gpu] [seed] [squad_dir] [vocab_file] [out_dir] [mode]
#                        [config_file] [max_steps]
#
#   precision: fp32 | tf32 | fp16 | bf16      mode: train | eval | prediction | "train eval"
#   init_checkpoint default: the installed MiniLM (config.json and vocab.txt come from its folder).
#   squad_dir must hold train-v1.1.json and dev-v1.1.json; make a small one with
#     python -m tempo.bert.data.qa_generator --out_dir data/qa --num_train 2000 --num_dev 300
#   Tempo layers follow scripts/tempo/patch_tempo.sh; add EXTRA_ARGS="--tempo" (or --no-tempo)
#   to override, or any other run_squad.py flag.
set -euo pipefail
cd "$(dirname "$0")/.."

minilm() { python -c 'from tempo.bert.hf_interop import minilm_dir; print(minilm_dir())'; }

init_checkpoint=${1:-"$(minilm)"}
epochs=${2:-"2.0"}
batch_size=${3:-"32"}
learning_rate=${4:-"3e-5"}
warmup_proportion=${5:-"0.1"}
precision=${6:-"fp32"}
num_gpu=${7:-"1"}
seed=${8:-"1"}
squad_dir=${9:-"data/squad/v1.1"}
vocab_file=${10:-""}
OUT_DIR=${11:-"results/SQuAD"}
mode=${12:-"train eval"}
CONFIG_FILE=${13:-""}
max_steps=${14:-"-1"}

case "$precision" in
  fp32) precision_flags=() ;;
  tf32) precision_flags=(--tf32) ;;
  fp16) precision_flags=(--fp16) ;;
  bf16) precision_flags=(--bf16) ;;
  *) echo "run_squad.sh: error: precision must be fp32, tf32, fp16 or bf16, got '$precision'" >&2; exit 1 ;;
esac

args=(--init_checkpoint "$init_checkpoint" --bert_model bert-large-uncased --do_lower_case
      --max_seq_length 384 --doc_stride 128 --seed "$seed" --output_dir "$OUT_DIR"
      --json-summary "$OUT_DIR/dllogger.json" --max_steps "$max_steps" "${precision_flags[@]}")
[ -n "$vocab_file" ] && args+=(--vocab_file "$vocab_file")
[ -n "$CONFIG_FILE" ] && args+=(--config_file "$CONFIG_FILE")

case "$mode" in
  *train*) args+=(--do_train --train_file "$squad_dir/train-v1.1.json" --train_batch_size "$batch_size"
                  --learning_rate "$learning_rate" --warmup_proportion "$warmup_proportion"
                  --num_train_epochs "$epochs") ;;
esac
case "$mode" in
  *eval*|*prediction*) args+=(--do_predict --predict_file "$squad_dir/dev-v1.1.json" --predict_batch_size "$batch_size") ;;
esac
case "$mode" in
  *eval*) args+=(--do_eval) ;;
esac

mkdir -p "$OUT_DIR"
if [ "$num_gpu" -gt 1 ]; then
  launcher=(torchrun --nproc_per_node="$num_gpu" run_squad.py)
else
  launcher=(python run_squad.py)
fi
# shellcheck disable=SC2086  # EXTRA_ARGS is a list of flags on purpose
set -x
"${launcher[@]}" "${args[@]}" ${EXTRA_ARGS:-} 2>&1 | tee "$OUT_DIR/logfile.txt"
exit "${PIPESTATUS[0]}"
