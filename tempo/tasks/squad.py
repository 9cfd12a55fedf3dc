"""SQuAD fine-tuning and prediction, the loop behind ``run_squad.py``.

One run: check flags and files -> read the SQuAD JSON files and build (or load cached) features
-> load --init_checkpoint into BertForQuestionAnswering -> train (AdamW, linear warm-up/decay,
autocast, accumulation, DDP) -> save the model -> predict -> write predictions -> score them.

Flags follow NVIDIA DeepLearningExamples' run_squad.py, so existing launch scripts work;
differences worth knowing:
  * ``--config_file``/``--vocab_file`` default to config.json/vocab.txt next to
    ``--init_checkpoint`` (a HF folder such as MiniLM's, or a folder we saved).
  * ``--init_checkpoint`` takes a HF safetensors file/folder, a DLE .pt, a run_pretraining.py
    checkpoint folder (ckpt_N) or its output_dir (the latest checkpoint is used).
  * ``--max_steps`` (other than -1) overrides ``--num_train_epochs`` (the data repeats as needed).
  * ``--max_tokens N`` replaces ``--train_batch_size``: each micro-batch holds whole windows up to
    N tokens per GPU (real tokens with ``--unpad``, the padded batch with ``--no-unpad``;
    ``--token_batching bucket|pack``; tempo/bert/data/token_budget.py), every window once per
    epoch (steps per epoch: those of the first epoch); ``--max_tokens auto`` asks the planner
    (tempo.plan). A step's loss stays the mean over all of its windows, on every rank together,
    whatever the micro-batch sizes (each micro-batch's loss weighted by its share of the windows;
    ``token_budget.loss_weights``). Each logged step has its sequences, real and padded tokens.
  * ``--do_lower_case`` defaults from ``--bert_model`` (``*-cased`` -> off), else on; pass
    ``--no-do_lower_case`` for cased vocabularies.
  * Scoring runs in-process whenever the predict file has answers (``--do_eval`` is implied;
    ``--eval_script`` is accepted and ignored); a file without answers gets predictions only.
  * The fine-tuned model is saved (``model.safetensors`` + ``config.json`` + ``vocab.txt``, HF
    layout, atomic) before prediction starts, so a failure there never loses the training.
  * ``training_sequences_per_second`` leaves out the first 10% of the steps (warm-up of the
    allocator and kernels); ``train_results.json`` has HF's whole-run figures.
  * A step with a NaN/inf loss or gradient norm (fp32/bf16) stops the run with exit status 1 and
    a line naming the step (``--on_nonfinite skip``: skipped, logged and counted); a model holding
    NaN/inf is never saved. v2.0: ``is_impossible`` must agree with the answers (an error naming
    the question, or ``--skip_inconsistent_questions``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from tempo.train.dllog import JsonLogger
from tempo.train.flags import (
    add_tempo_flags,
    add_token_budget_flags,
    add_training_flags,
    check_max_tokens,
    planned_max_tokens,
    tempo_choice_from_args,
    token_budget_from_args,
)
from tempo.train.optim import LinearWarmUpScheduler, bert_param_groups, make_optimizer
from tempo.train.runtime import (
    Runtime,
    UsageError,
    autocast_context,
    check_model_fits,
    check_output_dir,
    format_rate,
    configure_matmul_precision,
    mean_over_ranks,
    peak_memory_bytes,
    precision_from_flags,
    run_main,
    seed_everything,
    setup_runtime,
    sum_over_ranks,
    synchronize,
    teardown_runtime,
    wrap_ddp,
)
from tempo.train.step import StepClock, TrainStep, default_excluded_steps
from tempo.utils import (
    atomic_path,
    atomic_write,
    finite_number,
    int_in,
    non_negative_int,
    non_negative_number,
    positive_int,
    positive_int_or_unset,
    positive_number,
    proportion,
)

PROG = "run_squad.py"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description="BERT SQuAD fine-tuning and prediction (DLE-compatible flags).")
    p.add_argument("--bert_model", type=str, default="bert-large-uncased",
                   help="accepted for DLE compatibility; '*-cased' makes --do_lower_case default to off")
    p.add_argument("--output_dir", type=str, required=True, help="model, predictions and logs go here")
    p.add_argument("--init_checkpoint", type=str, default=None,
                   help="HF safetensors file/folder, DLE .pt, or a run_pretraining.py checkpoint (dir)")
    p.add_argument("--config_file", type=str, default=None, help="BERT config JSON (default: next to the checkpoint)")
    p.add_argument("--vocab_file", type=str, default=None, help="vocab.txt (default: next to the checkpoint)")
    p.add_argument("--train_file", type=str, default=None, help="SQuAD JSON for training")
    p.add_argument("--predict_file", type=str, default=None, help="SQuAD JSON to predict (and score, if it has answers)")
    p.add_argument("--max_seq_length", type=positive_int, default=384)
    p.add_argument("--doc_stride", type=positive_int, default=128)
    p.add_argument("--max_query_length", type=positive_int, default=64)
    p.add_argument("--do_train", action="store_true")
    p.add_argument("--do_predict", action="store_true")
    p.add_argument("--do_eval", action="store_true", help="score predictions (implied when the predict file has answers)")
    p.add_argument("--eval_script", type=str, default=None, help="accepted for DLE compatibility; scoring is built in")
    p.add_argument("--train_batch_size", type=positive_int, default=32, help="sequences per GPU per optimizer step")
    p.add_argument("--predict_batch_size", type=positive_int, default=8)
    p.add_argument("--learning_rate", type=positive_number, default=5e-5)
    p.add_argument("--num_train_epochs", type=non_negative_number, default=3.0)
    p.add_argument("--max_steps", type=positive_int_or_unset, default=-1,
                   help="optimizer steps; overrides --num_train_epochs (-1 = not set)")
    p.add_argument("--warmup_proportion", type=proportion, default=0.1)
    p.add_argument("--gradient_accumulation_steps", type=positive_int, default=1)
    p.add_argument("--seed", type=non_negative_int, default=42)
    p.add_argument("--fp16", "--amp", dest="fp16", action="store_true", help="fp16 autocast + GradScaler")
    p.add_argument("--bf16", action="store_true", help="bf16 autocast")
    p.add_argument("--tf32", action="store_true", help="allow TF32 matmuls in fp32 runs (Ampere+)")
    p.add_argument("--n_best_size", type=positive_int, default=20)
    p.add_argument("--max_answer_length", type=positive_int, default=30)
    p.add_argument("--do_lower_case", action=argparse.BooleanOptionalAction, default=None)
    p.add_argument("--version_2_with_negative", action="store_true", help="SQuAD v2.0: questions may have no answer")
    p.add_argument("--null_score_diff_threshold", type=finite_number, default=0.0)
    p.add_argument("--skip_inconsistent_questions", action="store_true",
                   help="leave out (and count) questions whose is_impossible disagrees with their answers "
                        "instead of stopping with an error naming the first")
    p.add_argument("--json-summary", "--json_summary", dest="json_summary", type=str, default=None,
                   help="DLLogger JSON lines file (default: <output_dir>/dllogger.json)")
    p.add_argument("--skip_checkpoint", action="store_true", help="do not save the fine-tuned model")
    p.add_argument("--skip_cache", action="store_true", help="neither read nor write the feature cache")
    p.add_argument("--cache_dir", type=str, default=None, help="feature cache folder (default: next to the data)")
    p.add_argument("--log_freq", type=positive_int, default=50, help="log every N steps")
    p.add_argument("--disable-progress-bar", "--disable_progress_bar", dest="disable_progress_bar", action="store_true")
    p.add_argument("--checkpoint_activations", action="store_true", help="recompute each layer in backward")
    p.add_argument("--local_rank", type=int_in(-1), default=-1,
                   help="set by torch.distributed.launch; torchrun uses env")
    p.add_argument("--no_cuda", action="store_true", help="run on the CPU even when a GPU is present")
    p.add_argument("--num_workers", type=non_negative_int, default=2, help="data-loader worker processes")
    add_training_flags(p, nonfinite_flag=True)
    add_tempo_flags(p)
    add_token_budget_flags(p)
    from tempo.bert.config import add_gelu_approximate_flag

    add_gelu_approximate_flag(p)
    return p


# ---------------------------------------------------------------------------------------------
# Flags and files, checked before any work is done
# ---------------------------------------------------------------------------------------------
def _resolve_init_checkpoint(path: str | None) -> str | None:
    """A run_pretraining.py output_dir means its newest checkpoint."""
    if path and os.path.isdir(os.path.join(path, "checkpoints")):
        from tempo.train.checkpointing import latest_checkpoint

        latest = latest_checkpoint(path)
        if latest is None:
            raise UsageError(f"--init_checkpoint {path!r}: no complete checkpoint under {path}/checkpoints")
        return str(latest)
    return path


def _beside_checkpoint(checkpoint: str | None, name: str) -> str | None:
    if not checkpoint:
        return None
    folder = checkpoint if os.path.isdir(checkpoint) else os.path.dirname(checkpoint)
    candidate = os.path.join(folder, name)
    return candidate if os.path.isfile(candidate) else None


def resolve_args(args: argparse.Namespace) -> None:
    """Fill defaults that depend on other flags; raise UsageError for impossible combinations."""
    if not (args.do_train or args.do_predict):
        raise UsageError("nothing to do: pass --do_train and/or --do_predict")
    if args.do_train and not args.train_file:
        raise UsageError("--do_train needs --train_file")
    if args.do_predict and not args.predict_file:
        raise UsageError("--do_predict needs --predict_file")
    for flag in ("train_file", "predict_file"):
        path = getattr(args, flag)
        if path and getattr(args, "do_train" if flag == "train_file" else "do_predict") and not os.path.isfile(path):
            raise UsageError(f"--{flag} {path!r} does not exist or is not a file")
    if args.init_checkpoint and not os.path.exists(args.init_checkpoint):
        raise UsageError(f"--init_checkpoint {args.init_checkpoint!r} does not exist")
    args.init_checkpoint = _resolve_init_checkpoint(args.init_checkpoint)
    args.config_file = args.config_file or _beside_checkpoint(args.init_checkpoint, "config.json")
    args.vocab_file = args.vocab_file or _beside_checkpoint(args.init_checkpoint, "vocab.txt")
    if not args.config_file:
        raise UsageError("--config_file is required (no config.json next to --init_checkpoint)")
    if not args.vocab_file:
        raise UsageError("--vocab_file is required (no vocab.txt next to --init_checkpoint)")
    if args.do_lower_case is None:
        name = args.bert_model.lower()
        args.do_lower_case = not (name.endswith("-cased") or "-cased-" in name)
    if args.max_tokens is None and args.train_batch_size % args.gradient_accumulation_steps:
        raise UsageError(f"--train_batch_size {args.train_batch_size} is not divisible by "
                         f"--gradient_accumulation_steps {args.gradient_accumulation_steps}")
    if args.do_train:
        check_max_tokens(args, args.max_seq_length)
    if args.max_query_length + 3 >= args.max_seq_length:
        raise UsageError(f"--max_seq_length {args.max_seq_length} leaves no room for the context after "
                         f"--max_query_length {args.max_query_length} and 3 special tokens")
    if not 0.0 <= args.warmup_proportion < 1.0:
        raise UsageError(f"--warmup_proportion must be in [0, 1), got {args.warmup_proportion}")
    if args.do_train and args.max_steps <= 0 and args.num_train_epochs <= 0:
        raise UsageError("--num_train_epochs must be positive (or pass --max_steps)")


def _check_model_fits(args: argparse.Namespace, config: Any, tokenizer: Any) -> None:
    if args.max_seq_length > config.max_position_embeddings:
        raise UsageError(f"--max_seq_length {args.max_seq_length} exceeds max_position_embeddings "
                         f"{config.max_position_embeddings} of {args.config_file}")
    if tokenizer.vocab_size > config.vocab_size:
        raise UsageError(f"--vocab_file {args.vocab_file} has {tokenizer.vocab_size} tokens, more than "
                         f"vocab_size {config.vocab_size} in {args.config_file}")
    check_model_fits(config, args.config_file, torch.device("cpu") if args.no_cuda else None)


# ---------------------------------------------------------------------------------------------
# Small helpers
# ---------------------------------------------------------------------------------------------
def _write_json(obj: Any, path: str | os.PathLike) -> None:
    """Atomic JSON write: a reader never sees half a predictions file."""
    with atomic_write(path) as fh:
        json.dump(obj, fh, indent=2, ensure_ascii=False)
        fh.write("\n")


def _tensors(features: Any, names: tuple[str, ...]) -> torch.utils.data.TensorDataset:
    return torch.utils.data.TensorDataset(*(torch.from_numpy(getattr(features, n)) for n in names))


def save_finetuned(model: torch.nn.Module, config: Any, vocab_file: str, output_dir: str) -> Path:
    """HF layout in output_dir, so that it works as --init_checkpoint (and in transformers)."""
    from tempo.bert.hf_interop import save_hf_checkpoint
    from tempo.train.checkpointing import NonFiniteCheckpointError, nonfinite_tensors

    bad = nonfinite_tensors(model)
    if bad:  # e.g. NaN initial weights that every (skipped) step left as they were
        raise NonFiniteCheckpointError(f"refusing to save the fine-tuned model to {output_dir}: "
                                       f"{bad[0]} holds NaN/inf")
    out = save_hf_checkpoint(model, output_dir, config)
    target = out / "vocab.txt"
    if not (target.exists() and os.path.samefile(vocab_file, target)):
        with atomic_path(target) as tmp:
            shutil.copyfile(vocab_file, tmp)
    return out


# ---------------------------------------------------------------------------------------------
# Training
# ---------------------------------------------------------------------------------------------
def _train_loader(args: argparse.Namespace, model: torch.nn.Module, features: Any, rt: Runtime,
                  precision: str) -> tuple[torch.utils.data.DataLoader, Any]:
    """(loader, the sampler to set_epoch under DDP or with --max_tokens, else None): micro-batches of
    ``--train_batch_size / --gradient_accumulation_steps`` windows, or of whole windows up to
    ``--max_tokens`` tokens, cut to their longest."""
    dataset = _tensors(features, ("input_ids", "segment_ids", "input_mask", "start_positions", "end_positions"))
    common = dict(num_workers=args.num_workers, pin_memory=rt.device.type == "cuda",
                  persistent_workers=args.num_workers > 0)
    if args.max_tokens is not None:
        from tempo.bert.data.token_budget import TokenBudgetBatchSampler, TrimPadding, mask_lengths

        lengths = mask_lengths(features.input_mask)
        if args.max_tokens == "auto":
            optimizer = "adamw_fused" if rt.device.type == "cuda" else "adamw"  # as train() makes it
            args.max_tokens = planned_max_tokens(model, lengths, rt.device, precision, optimizer, args.memory_budget)
            check_max_tokens(args, args.max_seq_length)
            if rt.is_main:
                print(f"{PROG}: --max_tokens auto: {args.max_tokens} tokens per micro-batch (tempo.plan)")
        budget = token_budget_from_args(args, args.max_tokens)
        batches = TokenBudgetBatchSampler.from_budget(lengths, budget, seed=args.seed, num_replicas=rt.world_size,
                                                      rank=rt.rank)
        collate = TrimPadding((0, 1, 2), 2, budget.pad_to_multiple_of)  # input_ids, segment_ids, input_mask
        return torch.utils.data.DataLoader(dataset, batch_sampler=batches, collate_fn=collate, **common), batches
    if rt.distributed:
        sampler = torch.utils.data.DistributedSampler(dataset, num_replicas=rt.world_size, rank=rt.rank,
                                                      shuffle=True, seed=args.seed)
    else:
        sampler = torch.utils.data.RandomSampler(dataset, generator=torch.Generator().manual_seed(args.seed))
    loader = torch.utils.data.DataLoader(dataset, batch_size=args.train_batch_size // args.gradient_accumulation_steps,
                                         sampler=sampler, **common)
    return loader, sampler if rt.distributed else None


def weigh_micro_batches(micro_batches: list[list[torch.Tensor]], rt: Runtime) -> list[tuple[torch.Tensor, ...]]:
    """Token-budget micro-batches differ in size: each gets a loss weight (a sixth element) so that
    the step's loss is the mean over all the step's windows, over every rank (one all-reduce of a
    count per step under DDP). Every window counts: its answer lies inside it or at [CLS] (0)."""
    from tempo.bert.data.token_budget import loss_weights

    sequences = [len(b[0]) for b in micro_batches]
    (total,) = sum_over_ranks([sum(sequences)], rt)
    weights = loss_weights(sequences, total, len(micro_batches), rt.world_size)
    return [(*b, torch.tensor(w, dtype=torch.float32)) for b, w in zip(micro_batches, weights)]


def train(args: argparse.Namespace, model: torch.nn.Module, features: Any, rt: Runtime, precision: str,
          logger: JsonLogger) -> dict[str, Any]:
    loader, epoch_sampler = _train_loader(args, model, features, rt, precision)
    steps_per_epoch = math.ceil(len(loader) / args.gradient_accumulation_steps)
    total_steps = args.max_steps if args.max_steps > 0 else math.ceil(steps_per_epoch * args.num_train_epochs)

    optimizer = make_optimizer("adamw_fused" if rt.device.type == "cuda" else "adamw",
                               bert_param_groups(model, weight_decay=0.01), lr=args.learning_rate)
    scheduler = LinearWarmUpScheduler(optimizer, warmup=args.warmup_proportion, total_steps=total_steps,
                                      base_lr=args.learning_rate)
    train_step = TrainStep(model, optimizer, squad_loss, precision, rt.device, scheduler=scheduler,
                           max_grad_norm=args.max_grad_norm, train_model=wrap_ddp(model, rt),
                           distributed=rt.distributed, measure_activations=False, on_nonfinite=args.on_nonfinite,
                           log=lambda message: rt.is_main and print(f"{PROG}: warning: {message}", file=sys.stderr))
    seed_everything(args.seed + 1000 * rt.rank)  # dropout streams differ per rank

    if rt.is_main:
        per_step = (f"up to {args.max_tokens} {'real' if args.unpad else 'padded'} tokens x "
                    f"{args.gradient_accumulation_steps} micro-batches ({args.token_batching}; "
                    "--train_batch_size unused)" if args.max_tokens is not None
                    else f"{args.train_batch_size} sequences")
        print(f"{PROG}: training on {len(features)} windows, {total_steps} steps of {per_step} x {rt.world_size} "
              f"GPU(s) ({steps_per_epoch} steps per epoch)")
    progress = tqdm(total=total_steps, desc="fine-tuning", unit="step", dynamic_ncols=True,
                    disable=args.disable_progress_bar or not rt.is_main)
    micro_batches = _endless(loader, epoch_sampler)
    loss_sum = torch.zeros((), device=rt.device)
    last_loss = float("nan")
    sequences = 0
    clock = StepClock(rt.device, default_excluded_steps(total_steps))
    model.train()
    for step in range(1, total_steps + 1):
        rt.follow_load()  # CPU: torch's threads follow the cores other work leaves free
        clock.begin_step()
        micro = [next(micro_batches) for _ in range(args.gradient_accumulation_steps)]
        tokens = sum(int(batch[2].count_nonzero()) for batch in micro)  # input_mask, on the host
        padded_tokens = sum(batch[0].numel() for batch in micro)
        if args.max_tokens is not None:
            micro = weigh_micro_batches(micro, rt)
        out = train_step(micro)
        clock.end_step(out.samples * rt.world_size, tokens * rt.world_size)
        sequences += out.samples * rt.world_size
        loss_sum += out.loss
        if step % args.log_freq == 0 or step == total_steps:
            last_loss = mean_over_ranks(out.loss, rt)  # a sync: only on log steps
            if rt.is_main:
                logger.log(step, {"loss": last_loss, "learning_rate": out.lr, "sequences": out.samples,
                                  "real_tokens": tokens, "padded_tokens": padded_tokens})
                progress.set_postfix(loss=f"{last_loss:.4f}", lr=f"{out.lr:.2e}")
                if args.disable_progress_bar:
                    print(f"step {step}/{total_steps} | loss {last_loss:.4f} | lr {out.lr:.3e} | {out.samples} seq, "
                          f"{tokens} real / {padded_tokens} padded tokens")
        progress.update(1)
    progress.close()
    clock.stop()
    return {
        "e2e_train_time": clock.elapsed,
        "training_sequences_per_second": clock.samples_per_second,
        "training_real_tokens_per_second": clock.tokens_per_second,
        "final_loss": last_loss,
        "train_loss": mean_over_ranks(loss_sum, rt) / total_steps,
        "train_steps": total_steps,
        "train_sequences": sequences,
        "epochs": sequences / (len(features) or 1),
        "timed_steps": clock.timed_steps,
        "skipped_steps": train_step.skipped_steps,
    }


def squad_loss(model: torch.nn.Module, batch: tuple[torch.Tensor, ...]) -> Any:
    """A batch of windows through BertForQuestionAnswering; a sixth element, when present, is the
    micro-batch's loss weight (``weigh_micro_batches``)."""
    input_ids, segment_ids, input_mask, start, end, *weight = batch
    out = model(input_ids=input_ids.long(), token_type_ids=segment_ids.long(), attention_mask=input_mask.long(),
                start_positions=start.long(), end_positions=end.long())
    return out._replace(loss=out.loss * weight[0]) if weight else out


def _endless(loader: torch.utils.data.DataLoader, sampler: Any) -> Any:
    """Micro-batches epoch after epoch; a DistributedSampler or token-budget sampler reshuffles by epoch."""
    epoch = 0
    while True:
        yield from loader
        epoch += 1
        if sampler is not None:
            sampler.set_epoch(epoch)


# ---------------------------------------------------------------------------------------------
# Prediction and scoring
# ---------------------------------------------------------------------------------------------
@torch.no_grad()
def predict_logits(args: argparse.Namespace, model: torch.nn.Module, features: Any, rt: Runtime,
                   precision: str) -> tuple[np.ndarray, np.ndarray, dict[str, float]]:
    """Start/end logits of every window, in feature order, as float32 [N, L] arrays."""
    dataset = _tensors(features, ("input_ids", "segment_ids", "input_mask"))
    loader = torch.utils.data.DataLoader(dataset, batch_size=args.predict_batch_size, shuffle=False,
                                         num_workers=args.num_workers, pin_memory=rt.device.type == "cuda")
    model.eval()
    starts, ends = [], []
    synchronize(rt.device)
    t0 = time.perf_counter()
    for input_ids, segment_ids, input_mask in tqdm(loader, desc="predicting", unit="batch", dynamic_ncols=True,
                                                   disable=args.disable_progress_bar):
        with autocast_context(precision, rt.device):
            out = model(input_ids=input_ids.to(rt.device).long(), token_type_ids=segment_ids.to(rt.device).long(),
                        attention_mask=input_mask.to(rt.device).long())
        starts.append(out.start_logits.float().cpu())
        ends.append(out.end_logits.float().cpu())
    synchronize(rt.device)
    elapsed = time.perf_counter() - t0
    timing = {"e2e_inference_time": elapsed, "inference_sequences_per_second": len(dataset) / elapsed}
    return torch.cat(starts).numpy(), torch.cat(ends).numpy(), timing


def write_predictions(args: argparse.Namespace, data: Any, features: Any, start_logits: np.ndarray,
                      end_logits: np.ndarray) -> tuple[dict[str, str], dict[str, float] | None]:
    """predictions.json, nbest_predictions.json (and null_odds.json for v2) in output_dir."""
    from tempo.tasks.squad_metrics import WindowLogits, extract_answers

    windows_of: dict[int, list[WindowLogits]] = {}
    for i, example_index in enumerate(features.example_index.tolist()):
        windows_of.setdefault(example_index, []).append(
            WindowLogits(start_logits[i], end_logits[i], features.offsets[i], features.max_context[i]))
    predictions: dict[str, str] = {}
    nbest: dict[str, list[dict[str, Any]]] = {}
    null_odds: dict[str, float] = {}
    for index, example in enumerate(data.examples):
        text, candidates, score_diff = extract_answers(
            example.context, windows_of[index], n_best_size=args.n_best_size,
            max_answer_length=args.max_answer_length, version_2_with_negative=args.version_2_with_negative,
            null_score_diff_threshold=args.null_score_diff_threshold)
        predictions[example.qas_id] = text
        nbest[example.qas_id] = candidates
        if score_diff is not None:
            null_odds[example.qas_id] = score_diff
    _write_json(predictions, os.path.join(args.output_dir, "predictions.json"))
    _write_json(nbest, os.path.join(args.output_dir, "nbest_predictions.json"))
    if args.version_2_with_negative:
        _write_json(null_odds, os.path.join(args.output_dir, "null_odds.json"))
        return predictions, null_odds
    return predictions, None


def score(args: argparse.Namespace, data: Any, predictions: dict[str, str],
          null_odds: dict[str, float] | None) -> dict[str, float]:
    """Official v1.1/v2.0 metrics, plus DLE's names for the headline pair (exact_match, F1)."""
    from tempo.tasks.squad_metrics import evaluate_v1, evaluate_v2

    if args.version_2_with_negative:
        metrics = evaluate_v2(data.dataset, predictions, null_odds)
        return {"exact_match": metrics["exact"], "F1": metrics["f1"], **metrics}
    metrics = evaluate_v1(data.dataset, predictions)
    return {"exact_match": metrics["exact_match"], "F1": metrics["f1"]}


# ---------------------------------------------------------------------------------------------
# The run
# ---------------------------------------------------------------------------------------------
def run(args: argparse.Namespace) -> dict[str, Any]:
    from tempo.bert.config import BertConfig
    from tempo.bert.data.squad import load_or_build_features, read_squad
    from tempo.bert.data.tokenization import WordPieceTokenizer
    from tempo.bert.hf_interop import load_pretrained
    from tempo.bert.model import BertForQuestionAnswering

    resolve_args(args)
    config = BertConfig.from_json_file(args.config_file).with_gelu(args.gelu_approximate)
    tokenizer = WordPieceTokenizer(args.vocab_file, lower_case=args.do_lower_case)
    _check_model_fits(args, config, tokenizer)
    precision = precision_from_flags(args.fp16, args.bf16, args.tf32)
    options = tempo_choice_from_args(args)
    # Read both files first: a malformed predict file must fail before hours of training.
    skip = args.skip_inconsistent_questions
    train_data = (read_squad(args.train_file, args.version_2_with_negative, for_training=True, skip_inconsistent=skip)
                  if args.do_train else None)
    predict_data = (read_squad(args.predict_file, args.version_2_with_negative, skip_inconsistent=skip)
                    if args.do_predict else None)

    rt = setup_runtime(args.local_rank, force_cpu=args.no_cuda)
    try:
        autocast_context(precision, rt.device)  # fails now for --fp16 on a CPU
        if rt.is_main:
            check_output_dir(args.output_dir)
        configure_matmul_precision(precision)
        logger = JsonLogger((args.json_summary or os.path.join(args.output_dir, "dllogger.json")) if rt.is_main else None)
        progress = not args.disable_progress_bar and rt.is_main
        feature_args = dict(max_seq_length=args.max_seq_length, doc_stride=args.doc_stride,
                            max_query_length=args.max_query_length, cache_dir=args.cache_dir,
                            use_cache=not args.skip_cache, progress=progress)
        train_features = predict_features = None
        if train_data is not None:
            train_features, cache = load_or_build_features(train_data, tokenizer, for_training=True, **feature_args)
            if rt.is_main:
                print(f"{PROG}: {len(train_data.examples)} training questions -> {len(train_features)} windows"
                      + (f" (cache {cache})" if cache else ""))
        if predict_data is not None and rt.is_main:
            predict_features, _ = load_or_build_features(predict_data, tokenizer, for_training=False, **feature_args)

        seed_everything(args.seed)  # same initial head on every rank
        model = BertForQuestionAnswering(config, options, checkpoint_activations=args.checkpoint_activations,
                                         unpad=args.unpad)
        if args.init_checkpoint:
            report = load_pretrained(model, args.init_checkpoint)
            if rt.is_main:
                for line in report.lines():
                    print(f"{PROG}: init_checkpoint: {line}")
                if report.format == "dle" and args.gelu_approximate is None:
                    from tempo.bert.hf_interop import dle_gelu_note

                    print(f"{PROG}: {dle_gelu_note(config)}")
        elif rt.is_main:
            print(f"{PROG}: warning: no --init_checkpoint; fine-tuning from random weights", file=sys.stderr)
        model.to(rt.device)
        if rt.is_main:
            logger.parameters({**vars(args), "precision": precision, "world_size": rt.world_size,
                               "tempo_options": str(options), "device": str(rt.device), "torch": torch.__version__})
            print(f"{PROG}: {config.num_hidden_layers} layers, h={config.hidden_size}, {precision}, {options}, "
                  f"device {rt.device}, world size {rt.world_size}")

        summary: dict[str, Any] = {"precision": precision, "tempo_options": str(options), "unpad": bool(args.unpad)}
        if train_features is not None:
            train_summary = train(args, model, train_features, rt, precision, logger)
            summary.update(train_summary)
            if rt.is_main:
                # Saved before predicting: whatever happens next, the training is kept.
                if not args.skip_checkpoint:
                    print(f"{PROG}: saved the fine-tuned model to {save_finetuned(model, config, args.vocab_file, args.output_dir)}")
                _write_json({"train_runtime": train_summary["e2e_train_time"],
                             "train_samples_per_second": train_summary["train_sequences"] / train_summary["e2e_train_time"],
                             "train_steps_per_second": train_summary["train_steps"] / train_summary["e2e_train_time"],
                             "train_loss": train_summary["train_loss"], "train_samples": len(train_features),
                             "epoch": train_summary["epochs"], "global_step": train_summary["train_steps"]},
                            os.path.join(args.output_dir, "train_results.json"))
                logger.summary({**train_summary, **peak_memory_bytes(rt.device)})
                print(f"{PROG}: trained {train_summary['train_steps']} steps in {train_summary['e2e_train_time']:.1f} s, "
                      f"{format_rate(train_summary['training_sequences_per_second'])}, "
                      f"{train_summary['training_real_tokens_per_second']:.0f} real tokens/s "
                      f"({'unpadded' if args.unpad else 'padded'}), final loss {train_summary['final_loss']:.4f}")

        if predict_features is not None:
            start_logits, end_logits, timing = predict_logits(args, model, predict_features, rt, precision)
            predictions, null_odds = write_predictions(args, predict_data, predict_features, start_logits, end_logits)
            print(f"{PROG}: wrote predictions for {len(predictions)} questions to {args.output_dir} "
                  f"({timing['inference_sequences_per_second']:.1f} windows/s)")
            inference_summary: dict[str, Any] = dict(timing)
            if predict_data.has_gold:
                metrics = score(args, predict_data, predictions, null_odds)
                _write_json(metrics, os.path.join(args.output_dir, "eval_results.json"))
                inference_summary.update(metrics)
                print(f"{PROG}: exact_match {metrics['exact_match']:.2f}, F1 {metrics['F1']:.2f}")
            else:
                print(f"{PROG}: note: {args.predict_file} has no answers: predictions only, no scores")
            logger.summary({**inference_summary, **peak_memory_bytes(rt.device)})
            summary.update(inference_summary)
        summary.update(peak_memory_bytes(rt.device))
        logger.close()
        return summary
    finally:
        teardown_runtime(rt)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return run_main(lambda: run(args) and 0, PROG)


if __name__ == "__main__":
    sys.exit(main())
