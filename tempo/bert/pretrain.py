"""BERT pretraining (MLM + NSP), the loop behind ``run_pretraining.py``.

One batch's path: HDF5 shard (or synthetic) -> ``PretrainingBatches`` -> device -> autocast
forward of ``BertForPreTraining`` -> loss / accumulation steps -> backward -> (unscale) -> LAMB
step with global-norm clipping -> poly warm-up schedule -> log / checkpoint.

Flags follow NVIDIA DeepLearningExamples' run_pretraining.py, so existing launch scripts work;
differences worth knowing:
  * ``--train_batch_size`` is per GPU per optimizer step, split into
    ``--gradient_accumulation_steps`` micro-batches (as DLE).
  * ``--init_checkpoint`` loads weights on its own (HF safetensors, DLE .pt, or one of our
    checkpoints); it no longer needs ``--resume_from_checkpoint``.
  * ``--resume_from_checkpoint`` with no checkpoint in output_dir warns and starts fresh.
  * ``--phase2 --resume_from_checkpoint`` over a phase-1 checkpoint keeps the weights and LAMB
    moments and restarts the step count, schedule and data for phase 2, as DLE; phase-2
    checkpoints are numbered ``phase1_end_step + step``.
  * Checkpoints are safetensors + a weights_only file, written atomically, last 3 kept.
  * Mixed precision is torch.amp: ``--bf16`` (no loss scaling) or ``--fp16``/``--amp`` (GradScaler).
  * ``--tempo/--no-tempo`` and ``--attention {eager,tempo,sdpa}`` choose the layers.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from tempo.bert.dllog import JsonLogger
from tempo.memory import ActivationLedger
from tempo.bert.runtime import (
    Runtime,
    UsageError,
    autocast_context,
    check_output_dir,
    configure_matmul_precision,
    make_grad_scaler,
    no_sync_if,
    peak_memory_bytes,
    precision_from_flags,
    run_main,
    seed_everything,
    setup_runtime,
    synchronize,
    teardown_runtime,
)
from tempo.bert.tempo_switch import add_tempo_flags, tempo_options_from_args

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
    p.add_argument("--max_seq_length", type=int, default=512)
    p.add_argument("--max_predictions_per_seq", type=int, default=80)
    p.add_argument("--train_batch_size", type=int, default=32,
                   help="sequences per GPU per optimizer step (split over accumulation steps)")
    p.add_argument("--learning_rate", type=float, default=5e-5)
    p.add_argument("--max_steps", type=int, default=1000, help="optimizer steps of this phase")
    p.add_argument("--warmup_proportion", type=float, default=0.01)
    p.add_argument("--gradient_accumulation_steps", type=int, default=1)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--fp16", "--amp", dest="fp16", action="store_true", help="fp16 autocast + GradScaler")
    p.add_argument("--bf16", action="store_true", help="bf16 autocast")
    p.add_argument("--tf32", action="store_true", help="allow TF32 matmuls in fp32 runs (Ampere+)")
    p.add_argument("--log_freq", type=float, default=1.0, help="log every N steps")
    p.add_argument("--checkpoint_activations", action="store_true", help="recompute each layer in backward")
    p.add_argument("--resume_from_checkpoint", action="store_true")
    p.add_argument("--resume_step", type=int, default=-1, help="checkpoint step to resume (-1 = latest)")
    p.add_argument("--num_steps_per_checkpoint", type=int, default=100)
    p.add_argument("--phase2", action="store_true")
    p.add_argument("--phase1_end_step", type=int, default=7038)
    p.add_argument("--do_train", action="store_true", help="accepted for DLE compatibility (training always runs)")
    p.add_argument("--json-summary", "--json_summary", dest="json_summary", type=str, default=None,
                   help="DLLogger JSON lines file (default: <output_dir>/dllogger.json)")
    p.add_argument("--skip_checkpoint", action="store_true")
    p.add_argument("--num_workers", type=int, default=2, help="data-loader worker processes")
    p.add_argument("--disable_progress_bar", action="store_true")
    p.add_argument("--steps_this_run", type=int, default=-1, help="stop after this many steps in this run")
    p.add_argument("--local_rank", type=int, default=-1, help="set by torch.distributed.launch; torchrun uses env")
    p.add_argument("--allreduce_post_accumulation", action="store_true",
                   help="accepted for DLE compatibility: DDP always all-reduces once per optimizer step")
    p.add_argument("--allreduce_post_accumulation_fp16", action="store_true", help="accepted, no effect")
    # Beyond DLE.
    p.add_argument("--synthetic_data", action="store_true", help="random batches (benchmarks), no input_dir")
    p.add_argument("--optimizer", choices=["lamb", "adamw", "adamw_fused"], default="lamb")
    p.add_argument("--weight_decay", type=float, default=0.01)
    p.add_argument("--no_cuda", action="store_true", help="train on the CPU even when a GPU is present")
    p.add_argument("--warmup_steps_excluded", type=int, default=None,
                   help="steps left out of the throughput figure (default: 10%% of the run, at least 1)")
    add_tempo_flags(p)
    return p


def validate_args(args: argparse.Namespace, config: Any) -> None:
    """Everything we can check before touching data or writing anything."""
    if args.input_dir is None and not args.synthetic_data:
        raise UsageError("--input_dir is required (or pass --synthetic_data)")
    if args.input_dir is not None and not args.synthetic_data:
        if not os.path.isdir(args.input_dir):
            raise UsageError(f"--input_dir {args.input_dir!r} does not exist or is not a directory")
    for name in ("train_batch_size", "max_steps", "gradient_accumulation_steps", "max_seq_length",
                 "max_predictions_per_seq", "num_steps_per_checkpoint"):
        if getattr(args, name) <= 0:
            raise UsageError(f"--{name} must be positive, got {getattr(args, name)}")
    if args.train_batch_size % args.gradient_accumulation_steps:
        raise UsageError(f"--train_batch_size {args.train_batch_size} is not divisible by "
                         f"--gradient_accumulation_steps {args.gradient_accumulation_steps}")
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
    if args.init_checkpoint and not os.path.exists(args.init_checkpoint):
        raise UsageError(f"--init_checkpoint {args.init_checkpoint!r} does not exist")


def make_batches(args: argparse.Namespace, config: Any, rt: Runtime):
    micro_batch = args.train_batch_size // args.gradient_accumulation_steps
    if args.synthetic_data:
        from tempo.bert.data.synthetic import SyntheticPretrainingBatches

        return SyntheticPretrainingBatches(micro_batch, args.max_seq_length, args.max_predictions_per_seq,
                                           config.vocab_size, seed=args.seed + rt.rank)
    from tempo.bert.data.pretraining_dataset import PretrainingBatches

    return PretrainingBatches(args.input_dir, micro_batch, seed=args.seed, rank=rt.rank,
                              world_size=rt.world_size, num_workers=args.num_workers,
                              max_seq_length=args.max_seq_length,
                              max_predictions_per_seq=args.max_predictions_per_seq)


def _to_device(batch: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}


def _restore(args, model, optimizer, scheduler, scaler, batches) -> tuple[int, Path | None, bool]:
    """Apply --resume_from_checkpoint / --init_checkpoint.

    Returns (step of this phase, checkpoint used, whether this run starts phase 2 from phase 1).
    """
    from tempo.bert.checkpointing import latest_checkpoint, list_checkpoints, load_checkpoint

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

        load_pretrained(model, args.init_checkpoint)
        print(f"{PROG}: initialised weights from {args.init_checkpoint}")
    return 0, None, False


def _reset_optimizer_steps(optimizer: torch.optim.Optimizer) -> None:
    for group in optimizer.param_groups:
        if "step" in group:  # LAMB counts per group
            group["step"] = 0
    for state in optimizer.state.values():  # torch's AdamW counts per parameter
        if "step" in state:
            state["step"] = torch.zeros_like(state["step"]) if torch.is_tensor(state["step"]) else 0


def train(args: argparse.Namespace) -> dict[str, Any]:
    from tempo.bert.checkpointing import install_sigterm_handler, save_checkpoint
    from tempo.bert.config import BertConfig
    from tempo.bert.model import BertForPreTraining
    from tempo.bert.optim import PolyWarmUpScheduler, bert_param_groups, make_optimizer

    config = BertConfig.from_json_file(args.config_file)
    validate_args(args, config)
    precision = precision_from_flags(args.fp16, args.bf16, args.tf32)
    rt = setup_runtime(args.local_rank, force_cpu=args.no_cuda)
    try:
        return _train(args, config, precision, rt, BertForPreTraining, PolyWarmUpScheduler,
                      bert_param_groups, make_optimizer, save_checkpoint, install_sigterm_handler)
    finally:
        teardown_runtime(rt)


def _train(args, config, precision, rt, BertForPreTraining, PolyWarmUpScheduler, bert_param_groups,
           make_optimizer, save_checkpoint, install_sigterm_handler) -> dict[str, Any]:
    if rt.is_main:
        check_output_dir(args.output_dir)
    configure_matmul_precision(precision)
    seed_everything(args.seed)  # same init on every rank (DDP also broadcasts rank 0's weights)
    options = tempo_options_from_args(args)

    model = BertForPreTraining(config, options, checkpoint_activations=args.checkpoint_activations)
    model.to(rt.device)
    optimizer = make_optimizer(args.optimizer, bert_param_groups(model, args.weight_decay), lr=args.learning_rate)
    def new_schedule() -> Any:
        return PolyWarmUpScheduler(optimizer, warmup=args.warmup_proportion, total_steps=args.max_steps,
                                   base_lr=args.learning_rate)

    scheduler = new_schedule()
    scaler = make_grad_scaler(precision, rt.device)
    batches = make_batches(args, config, rt)
    step, resumed_from, starts_phase2 = _restore(args, model, optimizer, scheduler, scaler, batches)
    if starts_phase2:
        scheduler = new_schedule()  # phase 1's schedule was restored with the checkpoint
    if resumed_from is None or starts_phase2:
        seed_everything(args.seed + 1000 * rt.rank)  # dropout streams differ per rank
    elif rt.rank > 0:
        # Only rank 0's RNG state is checkpointed: other ranks re-derive theirs from the step,
        # so their dropout after a resume differs from an uninterrupted run (rank 0's does not).
        seed_everything(args.seed + 1000 * rt.rank + step)

    train_model = model
    if rt.distributed:
        from torch.nn.parallel import DistributedDataParallel as DDP

        train_model = DDP(model, device_ids=[rt.local_rank] if rt.device.type == "cuda" else None)

    logger = JsonLogger((args.json_summary or os.path.join(args.output_dir, "dllogger.json")) if rt.is_main else None)
    if rt.is_main:
        logger.parameters({**vars(args), "precision": precision, "world_size": rt.world_size,
                           "tempo_options": str(options), "device": str(rt.device),
                           "torch": torch.__version__, "resumed_from": str(resumed_from) if resumed_from else None})
        print(f"{PROG}: {config.num_hidden_layers} layers, h={config.hidden_size}, {precision}, {options}, "
              f"device {rt.device}, world size {rt.world_size}, starting at step {step}")

    steps_left = args.max_steps - step
    if args.steps_this_run > 0:
        steps_left = min(steps_left, args.steps_this_run)
    excluded = args.warmup_steps_excluded
    if excluded is None:
        excluded = max(1, steps_left // 10) if steps_left > 1 else 0
    sequences_per_step = args.train_batch_size * rt.world_size
    log_every = max(1, int(args.log_freq))
    phase = 2 if args.phase2 else 1
    step_offset = args.phase1_end_step if args.phase2 else 0  # checkpoint numbering, as DLE

    def checkpoint(step_now: int) -> None:
        if args.skip_checkpoint or not rt.is_main:
            return
        save_checkpoint(args.output_dir, step_offset + step_now, model, optimizer, scheduler, scaler,
                        data_state=batches.state_dict(),
                        extra={"phase": phase, "phase_step": step_now, "config": config.to_dict(),
                               "tempo_options": str(options)})

    stop = install_sigterm_handler()
    data_iter = iter(batches)
    progress = tqdm(total=steps_left, disable=args.disable_progress_bar or not rt.is_main,
                    desc="pretraining", unit="step", dynamic_ncols=True)
    activation_bytes: int | None = None
    losses: list[float] = []
    step_times: list[float] = []
    timed_start = None
    run_start = time.perf_counter()
    steps_done = 0
    model.train()
    while steps_done < steps_left:
        step_start = time.perf_counter()
        step_loss = torch.zeros((), device=rt.device)
        step_mlm = torch.zeros((), device=rt.device)
        for micro in range(args.gradient_accumulation_steps):
            batch = _to_device(next(data_iter), rt.device)
            last_micro = micro == args.gradient_accumulation_steps - 1
            # The very first micro-batch runs under the activation ledger: the bytes autograd
            # keeps for backward are part of the summary (hooks only, no change to the math).
            ledger = ActivationLedger(model) if activation_bytes is None else contextlib.nullcontext()
            with no_sync_if(train_model, rt.distributed and not last_micro):
                with ledger, autocast_context(precision, rt.device):
                    out = train_model(input_ids=batch["input_ids"], token_type_ids=batch["segment_ids"],
                                      attention_mask=batch["input_mask"],
                                      masked_lm_positions=batch["masked_lm_positions"],
                                      masked_lm_labels=batch["masked_lm_labels"],
                                      next_sentence_labels=batch["next_sentence_labels"])
                    loss = out.loss / args.gradient_accumulation_steps  # mean over the whole step
                if activation_bytes is None:
                    activation_bytes = ledger.activation_bytes
                (scaler.scale(loss) if scaler else loss).backward()
            step_loss += loss.detach()
            step_mlm += out.mlm_loss.detach() / args.gradient_accumulation_steps
        if scaler is not None:
            scaler.unscale_(optimizer)  # LAMB clips the true gradient norm
            scale_before = scaler.get_scale()
            scaler.step(optimizer)
            scaler.update()
            stepped = scaler.get_scale() >= scale_before  # the scale drops exactly on skipped steps
        else:
            stepped = optimizer.step() is not False  # LAMB returns False on non-finite gradients
        lr = optimizer.param_groups[0]["lr"]  # the rate this step used, for the log
        if stepped:
            scheduler.step()  # as DLE: the schedule follows the steps actually taken
        optimizer.zero_grad(set_to_none=True)
        step += 1
        steps_done += 1

        if steps_done == excluded:
            synchronize(rt.device)
            timed_start = time.perf_counter()
        if steps_done % log_every == 0 or steps_done == steps_left:
            if rt.distributed:
                torch.distributed.all_reduce(step_loss)
                step_loss /= rt.world_size
            loss_value = step_loss.item()  # a sync: only on log steps
            losses.append(loss_value)
            step_times.append(time.perf_counter() - step_start)
            if rt.is_main:
                logger.log(step, {"loss": loss_value, "mlm_loss": step_mlm.item(), "learning_rate": lr,
                                  "step_time_s": step_times[-1]})
                progress.set_postfix(loss=f"{loss_value:.4f}", lr=f"{lr:.2e}")
                if args.disable_progress_bar:
                    print(f"step {step}/{args.max_steps} | loss {loss_value:.4f} | lr {lr:.3e} | "
                          f"{step_times[-1] * 1000:.0f} ms")
        progress.update(1)
        if step % args.num_steps_per_checkpoint == 0:
            checkpoint(step)
        if stop.requested:
            print(f"{PROG}: SIGTERM received: checkpoint at step {step}, stopping", file=sys.stderr)
            checkpoint(step)
            break
    progress.close()
    synchronize(rt.device)
    end = time.perf_counter()
    if step % args.num_steps_per_checkpoint != 0 and not stop.requested:
        checkpoint(step)  # the run's last step is always resumable

    timed_steps = steps_done - excluded
    throughput = (timed_steps * sequences_per_step / (end - timed_start)
                  if timed_start is not None and timed_steps > 0 else float("nan"))
    summary = {
        "e2e_train_time": end - run_start,
        "training_sequences_per_second": throughput,
        "final_loss": losses[-1] if losses else float("nan"),
        "steps": steps_done,
        "global_step": step,
        "timed_steps": timed_steps,
        "precision": precision,
        "tempo_options": str(options),
        "skipped_steps": getattr(optimizer, "skipped_steps", 0),
        "micro_batch_size": args.train_batch_size // args.gradient_accumulation_steps,
        "activation_bytes_per_micro_batch": activation_bytes,
        "stopped_by_sigterm": bool(stop.requested),
        **peak_memory_bytes(rt.device),
    }
    if rt.is_main:
        logger.summary(summary)
        logger.close()
        print(f"{PROG}: done: {steps_done} steps in {summary['e2e_train_time']:.1f} s, "
              f"{throughput:.1f} seq/s (first {excluded} steps excluded), final loss {summary['final_loss']:.4f}")
    if math.isnan(summary["final_loss"]):
        warnings.warn("final loss is NaN", stacklevel=1)
    return summary


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return run_main(lambda: train(args) and 0, PROG)


if __name__ == "__main__":
    sys.exit(main())
