"""BERT pretraining (MLM + NSP), the loop behind ``run_pretraining.py``.

One batch's path: HDF5 shard (or synthetic) -> ``PretrainingBatches`` -> device -> autocast
forward of ``BertForPreTraining`` -> loss / accumulation steps -> backward -> (unscale) -> LAMB
step with global-norm clipping -> poly warm-up schedule -> log / checkpoint.

Flags follow NVIDIA DeepLearningExamples' run_pretraining.py, so existing launch scripts work;
differences worth knowing:
  * ``--train_batch_size`` is per GPU per optimizer step, split into
    ``--gradient_accumulation_steps`` micro-batches (as DLE).
  * ``--max_tokens N`` replaces ``--train_batch_size``: each micro-batch holds whole sequences up
    to N tokens per GPU (real tokens with ``--unpad``, the padded batch with ``--no-unpad``;
    ``--token_batching bucket|pack``; tempo/bert/data/token_budget.py), every sequence of a shard
    once per epoch; ``--max_tokens auto`` asks the planner (tempo.plan). The loss keeps its
    normalisation for any micro-batch sizes: a step's loss is the MLM mean over all of the step's
    masked tokens plus the NSP mean over all of its sequences, on every rank together (each
    micro-batch's loss is weighted by its share of them; ``token_budget.loss_weights``), as one batch
    of all those sequences gives. Each step logs its sequences, real and padded tokens.
  * ``--init_checkpoint`` loads weights on its own (HF safetensors, DLE .pt, or one of our
    checkpoints); it no longer needs ``--resume_from_checkpoint``.
  * ``--resume_from_checkpoint`` with no checkpoint in output_dir warns and starts fresh.
  * ``--phase2 --resume_from_checkpoint`` over a phase-1 checkpoint keeps the weights and LAMB
    moments and restarts the step count, schedule and data for phase 2, as DLE; phase-2
    checkpoints are numbered ``phase1_end_step + step``.
  * Checkpoints are safetensors + a weights_only file, written atomically, last 3 kept.
  * Mixed precision is torch.amp: ``--bf16`` (no loss scaling) or ``--fp16``/``--amp`` (GradScaler).
  * ``--tempo/--no-tempo`` and ``--attention {eager,tempo,sdpa}`` choose the layers.
  * A step with a NaN/inf loss or gradient norm (fp32/bf16) stops the run with exit status 1 and
    a line naming the step (``--on_nonfinite skip``: skipped, logged and counted); no checkpoint
    holding NaN/inf is written. Each shard's values are checked against the config when the
    loader opens it (DLE's NSP labels are 0/1: a -1 is an error naming the row).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import warnings
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from tempo.bert.config import BertConfig, add_gelu_approximate_flag
from tempo.bert.model import BertForPreTraining
from tempo.train.checkpointing import install_sigterm_handler, save_checkpoint
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
from tempo.train.optim import PolyWarmUpScheduler, bert_param_groups, make_optimizer
from tempo.train.runtime import (
    Runtime,
    UsageError,
    check_model_fits,
    check_output_dir,
    configure_matmul_precision,
    format_rate,
    mean_over_ranks,
    peak_memory_bytes,
    precision_from_flags,
    run_main,
    seed_everything,
    setup_runtime,
    shard_fsdp2,
    sum_over_ranks,
    teardown_runtime,
    wrap_ddp,
)
from tempo.train.step import StepClock, TrainStep, default_excluded_steps
from tempo.utils import (
    int_in,
    non_negative_int,
    non_negative_number,
    positive_int,
    positive_int_or_unset,
    positive_number,
    proportion,
)

PROG = "run_pretraining.py"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description="BERT pretraining (DLE-compatible flags).")
    # Required in DLE; input_dir may be omitted with --synthetic_data.
    p.add_argument("--input_dir", type=str, default=None, help="directory of HDF5 shards (DLE format)")
    p.add_argument("--config_file", type=str, required=True, help="BERT config JSON")
    p.add_argument("--output_dir", type=str, required=True, help="checkpoints and logs go here")
    p.add_argument("--vocab_file", type=str, default=None,
                   help="vocab.txt; checked against the config's vocab_size when given")
    p.add_argument("--init_checkpoint", type=str, default=None,
                   help="initial weights: HF safetensors file/dir, DLE .pt, or one of our checkpoint dirs")
    p.add_argument("--max_seq_length", type=positive_int, default=512)
    p.add_argument("--max_predictions_per_seq", type=positive_int, default=80)
    p.add_argument("--train_batch_size", type=positive_int, default=32,
                   help="sequences per GPU per optimizer step (split over accumulation steps)")
    p.add_argument("--learning_rate", type=positive_number, default=5e-5)
    p.add_argument("--max_steps", type=positive_int, default=1000, help="optimizer steps of this phase")
    p.add_argument("--warmup_proportion", type=proportion, default=0.01)
    p.add_argument("--gradient_accumulation_steps", type=positive_int, default=1)
    p.add_argument("--seed", type=non_negative_int, default=42)
    p.add_argument("--fp16", "--amp", dest="fp16", action="store_true", help="fp16 autocast + GradScaler")
    p.add_argument("--bf16", action="store_true", help="bf16 autocast")
    p.add_argument("--tf32", action="store_true", help="allow TF32 matmuls in fp32 runs (Ampere+)")
    p.add_argument("--log_freq", type=positive_number, default=1.0, help="log every N steps")
    p.add_argument("--checkpoint_activations", action="store_true", help="recompute each layer in backward")
    p.add_argument("--resume_from_checkpoint", action="store_true")
    p.add_argument("--resume_step", type=int_in(-1), default=-1, help="checkpoint step to resume (-1 = latest)")
    p.add_argument("--num_steps_per_checkpoint", type=positive_int, default=100)
    p.add_argument("--phase2", action="store_true")
    p.add_argument("--phase1_end_step", type=non_negative_int, default=7038)
    p.add_argument("--do_train", action="store_true", help="accepted for DLE compatibility (training always runs)")
    p.add_argument("--json-summary", "--json_summary", dest="json_summary", type=str, default=None,
                   help="DLLogger JSON lines file (default: <output_dir>/dllogger.json)")
    p.add_argument("--skip_checkpoint", action="store_true")
    p.add_argument("--num_workers", type=non_negative_int, default=2, help="data-loader worker processes")
    p.add_argument("--disable_progress_bar", action="store_true")
    p.add_argument("--steps_this_run", type=positive_int_or_unset, default=-1,
                   help="stop after this many steps in this run (-1 = no limit)")
    p.add_argument("--local_rank", type=int_in(-1), default=-1,
                   help="set by torch.distributed.launch; torchrun uses env")
    p.add_argument("--allreduce_post_accumulation", action="store_true",
                   help="accepted for DLE compatibility: DDP always all-reduces once per optimizer step")
    p.add_argument("--allreduce_post_accumulation_fp16", action="store_true", help="accepted, no effect")
    # Beyond DLE.
    p.add_argument("--synthetic_data", action="store_true", help="random batches (benchmarks), no input_dir")
    p.add_argument("--optimizer", choices=["lamb", "adamw", "adamw_fused"], default="lamb")
    p.add_argument("--parallel", choices=["ddp", "fsdp2"], default="ddp",
                   help="under torchrun: ddp (a replica per GPU) or fsdp2 (fully_shard per block and the root; "
                        "checkpoints sharded through torch.distributed.checkpoint, resumable at any world size)")
    p.add_argument("--weight_decay", type=non_negative_number, default=0.01)
    p.add_argument("--no_cuda", action="store_true", help="train on the CPU even when a GPU is present")
    p.add_argument("--warmup_steps_excluded", type=non_negative_int, default=None,
                   help="steps left out of the throughput figure (default: 10%% of the run, at least 1)")
    add_training_flags(p, nonfinite_flag=True)
    add_tempo_flags(p)
    add_token_budget_flags(p)
    add_gelu_approximate_flag(p)
    return p


def validate_args(args: argparse.Namespace, config: Any) -> None:
    """Everything we can check before touching data or writing anything."""
    if args.input_dir is None and not args.synthetic_data:
        raise UsageError("--input_dir is required (or pass --synthetic_data)")
    if args.input_dir is not None and not args.synthetic_data:
        if not os.path.isdir(args.input_dir):
            raise UsageError(f"--input_dir {args.input_dir!r} does not exist or is not a directory")
    if args.max_tokens is None and args.train_batch_size % args.gradient_accumulation_steps:
        raise UsageError(f"--train_batch_size {args.train_batch_size} is not divisible by "
                         f"--gradient_accumulation_steps {args.gradient_accumulation_steps}")
    if args.max_tokens is not None and args.synthetic_data:
        raise UsageError("--max_tokens needs --input_dir: --synthetic_data batches are full-length rows of a "
                         "fixed batch size (pass --train_batch_size)")
    check_max_tokens(args, args.max_seq_length)
    if args.max_seq_length > config.max_position_embeddings:
        raise UsageError(f"--max_seq_length {args.max_seq_length} exceeds max_position_embeddings "
                         f"{config.max_position_embeddings} of {args.config_file}")
    if args.max_predictions_per_seq > args.max_seq_length:
        raise UsageError("--max_predictions_per_seq cannot exceed --max_seq_length")
    if not 0.0 <= args.warmup_proportion < 1.0:
        raise UsageError(f"--warmup_proportion must be in [0, 1), got {args.warmup_proportion}")
    if args.vocab_file:
        from tempo.bert.data.tokenization import load_vocab

        vocab_size = len(load_vocab(args.vocab_file))
        if vocab_size > config.vocab_size:
            raise UsageError(f"--vocab_file {args.vocab_file} has {vocab_size} tokens, more than "
                             f"vocab_size {config.vocab_size} in {args.config_file}")
    if args.parallel == "fsdp2" and "WORLD_SIZE" not in os.environ:
        raise UsageError("--parallel fsdp2 needs torchrun (torchrun --nproc_per_node N run_pretraining.py ...): "
                         "FSDP2 shards over a process group")
    if args.init_checkpoint and not os.path.exists(args.init_checkpoint):
        raise UsageError(f"--init_checkpoint {args.init_checkpoint!r} does not exist")
    check_model_fits(config, args.config_file, torch.device("cpu") if args.no_cuda else None)


def make_batches(args: argparse.Namespace, config: Any, rt: Runtime):
    """The stream of micro-batches: ``--train_batch_size / --gradient_accumulation_steps`` sequences
    each, or (``args.max_tokens``, a number by now) whole sequences up to that many tokens."""
    if args.max_tokens is not None:
        micro_batch, token_budget = None, token_budget_from_args(args, args.max_tokens)
    else:
        micro_batch, token_budget = args.train_batch_size // args.gradient_accumulation_steps, None
    if args.synthetic_data:
        from tempo.bert.data.synthetic import SyntheticPretrainingBatches

        return SyntheticPretrainingBatches(micro_batch, args.max_seq_length, args.max_predictions_per_seq,
                                           config.vocab_size, seed=args.seed + rt.rank)
    from tempo.bert.data.pretraining_dataset import PretrainingBatches

    return PretrainingBatches(args.input_dir, micro_batch, seed=args.seed, rank=rt.rank,
                              world_size=rt.world_size, num_workers=args.num_workers,
                              max_seq_length=args.max_seq_length,
                              max_predictions_per_seq=args.max_predictions_per_seq,
                              vocab_size=config.vocab_size, type_vocab_size=config.type_vocab_size,
                              token_budget=token_budget)


def _restore(args, model, optimizer, scheduler, scaler, batches) -> tuple[int, Path | None, bool]:
    """Apply --resume_from_checkpoint / --init_checkpoint.

    Returns (step of this phase, checkpoint used, whether this run starts phase 2 from phase 1).
    """
    from tempo.train.checkpointing import latest_checkpoint, list_checkpoints, load_checkpoint

    if args.resume_from_checkpoint:
        if args.resume_step >= 0:
            by_step = dict(list_checkpoints(args.output_dir))
            if args.resume_step not in by_step:
                raise UsageError(f"--resume_step {args.resume_step}: no complete checkpoint of that step in "
                                 f"{args.output_dir} (found steps {sorted(by_step) or 'none'})")
            ckpt = by_step[args.resume_step]
        else:
            ckpt = latest_checkpoint(args.output_dir)
        if ckpt is not None:
            state = load_checkpoint(ckpt, model, optimizer, scheduler, scaler)
            extra = state.get("extra") or {}
            if args.phase2 and extra.get("phase", 1) == 1:
                # Phase 1 -> 2: keep weights and LAMB moments; the caller restarts the schedule,
                # and the step counters restart here (bias correction too), as DLE does.
                _reset_optimizer_steps(optimizer)
                print(f"{PROG}: starting phase 2 from phase-1 checkpoint {ckpt}")
                return 0, ckpt, True
            if state.get("data_state") is not None:
                batches.load_state_dict(state["data_state"])
            return int(extra.get("phase_step", state["step"])), ckpt, False
        warnings.warn(f"--resume_from_checkpoint: no checkpoint in {args.output_dir}; starting fresh",
                      stacklevel=1)
    if args.init_checkpoint:
        from tempo.bert.hf_interop import load_pretrained

        report = load_pretrained(model, args.init_checkpoint)
        for line in report.lines():
            print(f"{PROG}: init_checkpoint: {line}")
        if report.format == "dle" and args.gelu_approximate is None:
            from tempo.bert.hf_interop import dle_gelu_note

            print(f"{PROG}: {dle_gelu_note(model.config)}")
    return 0, None, False


def _reset_optimizer_steps(optimizer: torch.optim.Optimizer) -> None:
    for group in optimizer.param_groups:
        if "step" in group:  # LAMB counts per group
            group["step"] = 0
    for state in optimizer.state.values():  # torch's AdamW counts per parameter
        if "step" in state:
            state["step"] = torch.zeros_like(state["step"]) if torch.is_tensor(state["step"]) else 0


def train(args: argparse.Namespace) -> dict[str, Any]:
    config = BertConfig.from_json_file(args.config_file).with_gelu(args.gelu_approximate)
    validate_args(args, config)
    precision = precision_from_flags(args.fp16, args.bf16, args.tf32)
    rt = setup_runtime(args.local_rank, force_cpu=args.no_cuda, group=args.parallel == "fsdp2")
    try:
        return _train(args, config, precision, rt)
    finally:
        teardown_runtime(rt)


def pretraining_loss(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> Any:
    """A DLE batch through BertForPreTraining: the output carries loss and mlm_loss. A batch with
    ``loss_weights`` ([MLM weight, NSP weight], see ``weigh_micro_batches``) gets its MLM and NSP
    means scaled by them."""
    out = model(input_ids=batch["input_ids"], token_type_ids=batch["segment_ids"],
                attention_mask=batch["input_mask"], masked_lm_positions=batch["masked_lm_positions"],
                masked_lm_labels=batch["masked_lm_labels"], next_sentence_labels=batch["next_sentence_labels"])
    weights = batch.get("loss_weights")
    if weights is None:
        return out
    mlm_loss, nsp_loss = out.mlm_loss * weights[0], out.nsp_loss * weights[1]
    return out._replace(loss=mlm_loss + nsp_loss, mlm_loss=mlm_loss, nsp_loss=nsp_loss)


def weigh_micro_batches(micro_batches: list[dict[str, torch.Tensor]], rt: Runtime) -> None:
    """Token-budget micro-batches differ in size: give each its ``loss_weights`` so that the step's
    loss is the MLM mean over all the step's masked tokens plus the NSP mean over all its sequences,
    over every rank (one all-reduce of two counts per step under DDP)."""
    from tempo.bert.data.token_budget import loss_weights

    masked = [int((b["masked_lm_labels"] >= 0).sum()) for b in micro_batches]  # host tensors: no sync
    sequences = [len(b["next_sentence_labels"]) for b in micro_batches]
    totals = sum_over_ranks([sum(masked), sum(sequences)], rt)
    k = len(micro_batches)
    mlm = loss_weights(masked, totals[0], k, rt.world_size)
    nsp = loss_weights(sequences, totals[1], k, rt.world_size)
    for batch, w_mlm, w_nsp in zip(micro_batches, mlm, nsp):
        batch["loss_weights"] = torch.tensor([w_mlm, w_nsp], dtype=torch.float32)


def _build(args, config, precision, rt, choice) -> tuple[Any, ...]:
    """Model, optimizer, schedule and data, restored from a checkpoint when asked."""
    model = BertForPreTraining(config, choice, checkpoint_activations=args.checkpoint_activations,
                               unpad=args.unpad).to(rt.device)
    if args.max_tokens == "auto":  # planned as the model will run: its parameters whole, before sharding
        _plan_max_tokens(args, model, rt, precision)
    fsdp2 = args.parallel == "fsdp2"
    if fsdp2:
        shard_fsdp2(model)  # before the optimizer: it steps over the shards
    optimizer = make_optimizer(args.optimizer, bert_param_groups(model, args.weight_decay), lr=args.learning_rate)

    def new_schedule() -> Any:
        return PolyWarmUpScheduler(optimizer, warmup=args.warmup_proportion, total_steps=args.max_steps,
                                   base_lr=args.learning_rate)

    scheduler = new_schedule()
    train_step = TrainStep(model, optimizer, pretraining_loss, precision, rt.device, scheduler=scheduler,
                           max_grad_norm=args.max_grad_norm, train_model=model if fsdp2 else wrap_ddp(model, rt),
                           distributed=rt.distributed, track=("mlm_loss",), on_nonfinite=args.on_nonfinite,
                           log=lambda message: rt.is_main and print(f"{PROG}: warning: {message}", file=sys.stderr))
    batches = make_batches(args, config, rt)
    step, resumed_from, starts_phase2 = _restore(args, model, optimizer, scheduler, train_step.scaler, batches)
    train_step.steps = step  # its messages name this phase's step
    if starts_phase2:
        train_step.scheduler = scheduler = new_schedule()  # phase 1's schedule came with the checkpoint
    if resumed_from is None or starts_phase2:
        seed_everything(args.seed + 1000 * rt.rank)  # dropout streams differ per rank
    elif rt.rank > 0:
        # Only rank 0's RNG state is checkpointed: other ranks re-derive theirs from the step,
        # so their dropout after a resume differs from an uninterrupted run (rank 0's does not).
        seed_everything(args.seed + 1000 * rt.rank + step)
    return model, optimizer, scheduler, train_step, batches, step, resumed_from


def _plan_max_tokens(args: argparse.Namespace, model: torch.nn.Module, rt: Runtime, precision: str) -> None:
    """--max_tokens auto: the planner's tokens per step, for the lengths of the first shard."""
    from tempo.bert.data.pretraining_dataset import list_shards
    from tempo.bert.data.pretraining_dataset import shard_lengths

    args.max_tokens = planned_max_tokens(model, shard_lengths(list_shards(args.input_dir)[0]), rt.device, precision,
                                         args.optimizer, args.memory_budget, world_size=rt.world_size,
                                         parallel=args.parallel if rt.distributed else None)
    check_max_tokens(args, args.max_seq_length)
    if rt.is_main:
        print(f"{PROG}: --max_tokens auto: {args.max_tokens} tokens per micro-batch (tempo.plan)")


def _train(args: argparse.Namespace, config: BertConfig, precision: str, rt: Runtime) -> dict[str, Any]:
    if rt.is_main:
        check_output_dir(args.output_dir)
    configure_matmul_precision(precision)
    seed_everything(args.seed)  # same init on every rank (DDP also broadcasts rank 0's weights)
    choice = tempo_choice_from_args(args)
    model, optimizer, scheduler, train_step, batches, step, resumed_from = _build(args, config, precision, rt, choice)

    logger = JsonLogger((args.json_summary or os.path.join(args.output_dir, "dllogger.json")) if rt.is_main else None)
    if rt.is_main:
        logger.parameters({**vars(args), "precision": precision, "world_size": rt.world_size,
                           "tempo_options": str(choice), "device": str(rt.device),
                           "torch": torch.__version__, "resumed_from": str(resumed_from) if resumed_from else None})
        print(f"{PROG}: {config.num_hidden_layers} layers, h={config.hidden_size}, {precision}, {choice}, "
              f"device {rt.device}, world size {rt.world_size}, starting at step {step}")
        if args.max_tokens is not None:
            counted = "real" if args.unpad else "padded"
            print(f"{PROG}: micro-batches of whole sequences up to {args.max_tokens} {counted} tokens per GPU "
                  f"({args.token_batching}; --train_batch_size unused), {args.gradient_accumulation_steps} per step")

    steps_left = args.max_steps - step
    if args.steps_this_run > 0:
        steps_left = min(steps_left, args.steps_this_run)
    excluded = args.warmup_steps_excluded
    if excluded is None:
        excluded = default_excluded_steps(steps_left)
    phase = 2 if args.phase2 else 1
    step_offset = args.phase1_end_step if args.phase2 else 0  # checkpoint numbering, as DLE

    def checkpoint(step_now: int) -> None:
        # FSDP2: every rank writes its shards (tempo.train.checkpointing); otherwise rank 0 alone.
        if args.skip_checkpoint or not (rt.is_main or args.parallel == "fsdp2"):
            return
        save_checkpoint(args.output_dir, step_offset + step_now, model, optimizer, scheduler, train_step.scaler,
                        data_state=batches.state_dict(),
                        extra={"phase": phase, "phase_step": step_now, "config": config.to_dict(),
                               "tempo_options": str(choice)})

    losses, clock, stop, step = _loop(args, rt, train_step, batches, step, steps_left, excluded, logger, checkpoint)
    if step % args.num_steps_per_checkpoint != 0 and not stop.requested:
        checkpoint(step)  # the run's last step is always resumable

    summary = {
        "e2e_train_time": clock.elapsed,
        "training_sequences_per_second": clock.samples_per_second,
        "training_real_tokens_per_second": clock.tokens_per_second,
        "unpad": bool(args.unpad),
        "final_loss": losses[-1] if losses else float("nan"),
        "steps": clock.steps,
        "global_step": step,
        "timed_steps": clock.timed_steps,
        "precision": precision,
        "tempo_options": str(choice),
        "skipped_steps": train_step.skipped_steps,
        "micro_batch_size": None if args.max_tokens else args.train_batch_size // args.gradient_accumulation_steps,
        "max_tokens": args.max_tokens,
        "activation_bytes_per_micro_batch": train_step.activation_bytes,
        "stopped_by_sigterm": bool(stop.requested),
        **peak_memory_bytes(rt.device),
    }
    if rt.is_main:
        logger.summary(summary)
        logger.close()
        speed = summary["training_sequences_per_second"]
        print(f"{PROG}: done: {clock.steps} steps in {summary['e2e_train_time']:.1f} s, "
              f"{format_rate(speed)}, {summary['training_real_tokens_per_second']:.0f} real tokens/s "
              f"({'unpadded' if args.unpad else 'padded'}; first {excluded} steps excluded), "
              f"final loss {summary['final_loss']:.4f}")
    if math.isnan(summary["final_loss"]):
        warnings.warn("final loss is NaN", stacklevel=1)
    return summary


def _loop(args, rt, train_step, batches, step, steps_left, excluded, logger, checkpoint):
    """The training loop: one TrainStep per iteration, logging and checkpoints in between."""
    stop = install_sigterm_handler()
    data_iter = iter(batches)
    progress = tqdm(total=steps_left, disable=args.disable_progress_bar or not rt.is_main,
                    desc="pretraining", unit="step", dynamic_ncols=True)
    log_every = max(1, int(args.log_freq))
    losses: list[float] = []
    clock = StepClock(rt.device, excluded)
    train_step.model.train()
    while clock.steps < steps_left:
        rt.follow_load()  # CPU: torch's threads follow the cores other work leaves free
        clock.begin_step()
        micro_batches = [next(data_iter) for _ in range(args.gradient_accumulation_steps)]
        padded_tokens = sum(b["input_ids"].numel() for b in micro_batches)
        if args.max_tokens is not None:
            weigh_micro_batches(micro_batches, rt)
        out = train_step(micro_batches)
        clock.end_step(out.samples * rt.world_size, out.tokens * rt.world_size)
        step += 1
        if clock.steps % log_every == 0 or clock.steps == steps_left:
            loss_value = mean_over_ranks(out.loss, rt)  # a sync: only on log steps
            losses.append(loss_value)
            if rt.is_main:
                logger.log(step, {"loss": loss_value, "mlm_loss": out.extras["mlm_loss"].item(),
                                  "learning_rate": out.lr, "step_time_s": clock.step_times[-1],
                                  "sequences": out.samples, "real_tokens": out.tokens,
                                  "padded_tokens": padded_tokens})
                progress.set_postfix(loss=f"{loss_value:.4f}", lr=f"{out.lr:.2e}")
                if args.disable_progress_bar:
                    print(f"step {step}/{args.max_steps} | loss {loss_value:.4f} | lr {out.lr:.3e} | "
                          f"{out.samples} seq, {out.tokens} real / {padded_tokens} padded tokens | "
                          f"{clock.step_times[-1] * 1000:.0f} ms")
        progress.update(1)
        if step % args.num_steps_per_checkpoint == 0:
            checkpoint(step)
        if stop.requested:
            if args.skip_checkpoint:
                print(f"{PROG}: SIGTERM received at step {step}: stopping without a checkpoint (--skip_checkpoint)",
                      file=sys.stderr)
            else:
                print(f"{PROG}: SIGTERM received: checkpoint at step {step}, stopping", file=sys.stderr)
            checkpoint(step)  # writes nothing under --skip_checkpoint
            break
    progress.close()
    clock.stop()
    return losses, clock, stop, step


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return run_main(lambda: train(args) and 0, PROG)


if __name__ == "__main__":
    sys.exit(main())
