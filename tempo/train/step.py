"""The one training step, and the clock around it.

Pretraining, SQuAD fine-tuning, the training benchmark and tempo.plan.confirm's measurements all call
``TrainStep``, so what the benchmark times is exactly what the trainers run:

  micro-batches -> device -> autocast forward -> loss / accumulation steps -> backward
  (DDP all-reduce on the last micro-batch only) -> unscale (fp16) -> clip -> optimizer step
  -> scheduler step (only when the optimizer stepped) -> zero grads.

Clipping policy (one for every caller): gradients are clipped to a global L2 norm of
``max_grad_norm`` (the trainers' ``--max_grad_norm``, default 1.0 as DLE; 0 or None: no
clipping), measured on the true (unscaled) gradients. LAMB clips inside its own step with the
same norm (as apex's FusedLAMB does), so the step leaves it to LAMB instead of clipping twice.

Skipped steps: fp16's GradScaler skips a step whose gradients overflowed (the scale then drops);
LAMB skips a step whose gradient norm is not finite. Either way the scheduler does not advance
(DLE's rule: the schedule follows the steps actually taken) and ``skipped_steps`` counts it.

Non-finite guard (fp32/bf16/tf32; ``on_nonfinite``): a step whose loss or gradient norm is NaN/inf
never changes the weights, the optimizer state or the schedule. With "stop" (the default) the step
raises ``NonFiniteError`` naming the step, the loss, the gradient norm and where the first
non-finite number is (the first parameter, in model order, whose gradient -- or, when the loss
itself is not finite, whose value -- is NaN/inf, with its optimizer group); the trainers turn it
into one line and exit status 1, and no checkpoint of that state is written. With "skip" the step
is skipped, logged (``log``) and counted (``nonfinite_steps``, and in ``skipped_steps``). fp16 runs
keep GradScaler's skip-and-rescale: an overflow there is routine, counted in ``skipped_steps``.
One host sync per step, whatever the optimizer:
  * each micro-batch's loss is multiplied by 1 where it is finite and by NaN where it is not (a
    device-side ``where``, exact for finite losses), so a non-finite loss makes every gradient NaN
    -- on every DDP rank, through the all-reduce -- and the gradient norm alone decides;
  * LAMB decides on the device and returns a 0-d bool: reading it is the step's one sync (as before);
  * other optimizers: the global norm (which clipping needs anyway) is read once, then the step
    (and the clipping, with that norm) runs only if it is finite.
The diagnosis after a bad step costs a few more syncs, on that step only.

The first micro-batch of the first step runs under the activation ledger (saved-tensor hooks only,
no change to the math): ``activation_bytes`` is what autograd kept for that micro-batch.
"""

from __future__ import annotations

import contextlib
import math
import sys
import time
from dataclasses import dataclass, field
from collections.abc import Mapping
from typing import Any, Callable, Optional, Sequence

import torch
from torch import nn

from tempo.memory import ActivationLedger
from tempo.train.runtime import NonFiniteError, autocast_context, make_grad_scaler, synchronize

ON_NONFINITE = ("stop", "skip")

LossFn = Callable[[nn.Module, Any], Any]


def to_device(batch: Any, device: torch.device) -> Any:
    """Tensors of a batch (a tensor, a mapping such as a dict or transformers' BatchEncoding, a list
    or tuple of them) moved to ``device``; a mapping comes back as a dict."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, Mapping):
        return {k: to_device(v, device) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(to_device(v, device) for v in batch)
    return batch


def _loss_of(out: Any) -> torch.Tensor:
    loss = out.loss if hasattr(out, "loss") else out[0] if isinstance(out, (tuple, list)) else out
    return loss if loss.dim() == 0 else loss.float().mean()


_MASK_KEYS = ("input_mask", "attention_mask")  # DLE's and transformers' names for the 0/1 padding mask


def _first_tensor(batch: Any) -> Optional[torch.Tensor]:
    if isinstance(batch, torch.Tensor):
        return batch
    values = batch.values() if isinstance(batch, Mapping) else batch if isinstance(batch, (list, tuple)) else ()
    return next((v for v in values if isinstance(v, torch.Tensor)), None)


def _real_tokens(batch: Any) -> int:
    """Real (non-padding) tokens of a batch, counted on the host before it moves to the device
    (no sync): the non-zeros of its padding mask (``input_mask`` or ``attention_mask``) in a mapping
    (a dict, transformers' BatchEncoding); else every element of its first tensor (a bare tensor of
    ids, a tuple or list whose first tensor is the ids: no mask to read)."""
    if isinstance(batch, Mapping):
        for key in _MASK_KEYS:
            if isinstance(batch.get(key), torch.Tensor):
                return int(batch[key].count_nonzero())
    first = _first_tensor(batch)
    return first.numel() if first is not None else 0


def _batch_size(batch: Any) -> int:
    first = _first_tensor(batch)
    return first.shape[0] if first is not None and first.dim() > 0 else 0


@dataclass
class StepResult:
    loss: torch.Tensor            # mean loss over the step's micro-batches, detached, on the device (no sync)
    extras: dict[str, torch.Tensor]  # the same mean for each tracked output field (e.g. mlm_loss)
    stepped: bool                 # False: the optimizer skipped this step (overflow / non-finite norm)
    lr: float                     # the learning rate this step used
    samples: int                  # sequences this process trained on in this step
    nonfinite: bool = False       # the guard found a NaN/inf loss or gradient norm (and skipped the step)
    tokens: int = 0               # real (non-padding) tokens among them


class TrainStep:
    """Call with a sequence of micro-batches; returns a StepResult. See the module docstring.

    ``loss_fn(model, batch)`` returns the loss (a scalar tensor) or a model output with ``.loss``;
    ``track`` names further output fields whose step means are reported (e.g. ``("mlm_loss",)``).
    ``train_model`` is the module to run (DDP-wrapped or compiled); ``model`` the plain one.
    ``on_nonfinite`` ("stop" | "skip") and ``log`` (where skip notices go; default stderr): the
    non-finite guard, see the module docstring. ``steps`` may be set to the run's step count after a
    resume, so that messages name the run's step.
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, loss_fn: LossFn, precision: str,
                 device: torch.device, scheduler: Any = None, max_grad_norm: Optional[float] = 1.0,
                 train_model: Optional[nn.Module] = None, distributed: bool = False,
                 measure_activations: bool = True, track: Sequence[str] = (), on_nonfinite: str = "stop",
                 log: Optional[Callable[[str], None]] = None):
        self.model = model
        self.train_model = train_model if train_model is not None else model
        self.optimizer = optimizer
        self.loss_fn = loss_fn
        self.precision = precision
        self.device = device
        self.scheduler = scheduler
        self.scaler = make_grad_scaler(precision, device)
        self.distributed = distributed
        self.track = tuple(track)
        # LAMB (ours) clips the global norm inside its step; everything else is clipped here.
        self.clip_in_optimizer = hasattr(optimizer, "max_grad_norm")
        if self.clip_in_optimizer:
            optimizer.max_grad_norm = max_grad_norm or None
        self.max_grad_norm = max_grad_norm or None
        self.activation_bytes: Optional[int] = None if measure_activations else -1
        self.skipped_steps = 0
        self.steps = 0
        if on_nonfinite not in ON_NONFINITE:
            raise ValueError(f"on_nonfinite must be one of {ON_NONFINITE}, got {on_nonfinite!r}")
        self.on_nonfinite = on_nonfinite
        self.guard = self.scaler is None  # fp16: GradScaler's overflow handling instead
        self.nonfinite_steps = 0
        self.log = log if log is not None else (lambda message: print(f"warning: {message}", file=sys.stderr))

    def _forward_backward(self, batch: Any, accumulation: int, last: bool, sums: dict[str, torch.Tensor]) -> None:
        ledger = ActivationLedger(self.model) if self.activation_bytes is None else contextlib.nullcontext()
        sync = contextlib.nullcontext()
        if self.distributed and not last and hasattr(self.train_model, "no_sync"):
            sync = self.train_model.no_sync()  # all-reduce once per step, after the last micro-batch
        if hasattr(self.train_model, "set_requires_gradient_sync"):  # FSDP2: reduce-scatter once per step
            self.train_model.set_requires_gradient_sync(last)
        with sync:
            with ledger, autocast_context(self.precision, self.device):
                out = self.loss_fn(self.train_model, batch)
                loss = _loss_of(out) / accumulation  # the step's loss is the mean over micro-batches
            if self.activation_bytes is None:
                self.activation_bytes = ledger.activation_bytes
            if self.guard:  # x 1 (exact) when finite, x NaN otherwise: every gradient turns NaN
                poison = torch.where(torch.isfinite(loss.detach()), 1.0, float("nan")).to(loss.dtype)
                (loss * poison).backward()
            else:
                (self.scaler.scale(loss) if self.scaler is not None else loss).backward()
        sums["loss"] += loss.detach()
        for name in self.track:
            sums[name] += getattr(out, name).detach() / accumulation

    def _guarded_step(self) -> tuple[bool, Optional[torch.Tensor]]:
        """fp32/bf16: (stepped, the gradient norm when it was not finite, else None). One sync."""
        if self.clip_in_optimizer:  # LAMB: the norm and the skip are decided on the device
            taken = self.optimizer.step()
            if not isinstance(taken, torch.Tensor):
                return taken is not False, None
            if bool(taken):  # the step's one sync
                return True, None
            return False, getattr(self.optimizer, "last_grad_norm", None)
        params = [p for p in self.model.parameters() if p.grad is not None]
        if not params:
            return self.optimizer.step() is not False, None
        norm = torch.nn.utils.get_total_norm([p.grad for p in params])
        if not bool(torch.isfinite(norm)):  # the step's one sync
            return False, norm
        if self.max_grad_norm is not None:
            torch.nn.utils.clip_grads_with_norm_(params, self.max_grad_norm, norm)
        return self.optimizer.step() is not False, None

    def _diagnose(self, loss: torch.Tensor, norm: Optional[torch.Tensor]) -> tuple[str, bool]:
        """(what went non-finite and where, whether parameters hold NaN/inf now). A bad step only:
        these reads sync."""
        group_of = {id(p): g for g, group in enumerate(self.optimizer.param_groups) for p in group["params"]}
        named = list(self.model.named_parameters())

        def first(bad: list[tuple[str, torch.Tensor]], what: str) -> str:
            name, tensor = bad[0]
            return (f"{what}: {name} (optimizer group {group_of.get(id(tensor), '-')}; {len(bad)} of {len(named)} "
                    "tensors)")

        loss_value = loss.item()
        norm_text = f"{norm.item():.4g}" if norm is not None else "not finite"
        parts = [f"step {self.steps + 1} ({self.precision}): non-finite loss or gradients: loss {loss_value:.4g}, "
                 f"gradient norm {norm_text}"]
        bad_params = [(n, p) for n, p in named if not bool(torch.isfinite(p.detach()).all())]
        if math.isfinite(loss_value):
            bad_grads = [(n, p) for n, p in named if p.grad is not None and not bool(torch.isfinite(p.grad).all())]
            parts.append(first(bad_grads, "first non-finite gradient") if bad_grads
                         else "every gradient tensor is finite but their norm overflowed")
        elif not bad_params:
            parts.append("the loss is not finite with every parameter finite: the forward pass overflowed "
                         "(learning rate too high, or extreme input values)")
        else:
            parts.append("the loss is not finite")
        if bad_params:
            parts.append(first(bad_params, "parameters holding NaN/inf now, first"))
        return "; ".join(parts), bool(bad_params)

    def _optimizer_step(self) -> bool:
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)  # clip (here or in LAMB) the true gradients
        if self.max_grad_norm is not None and not self.clip_in_optimizer:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.max_grad_norm)
        if self.scaler is not None:
            scale_before = self.scaler.get_scale()
            self.scaler.step(self.optimizer)
            self.scaler.update()
            return self.scaler.get_scale() >= scale_before  # the scale drops exactly on skipped steps
        taken = self.optimizer.step()
        if isinstance(taken, torch.Tensor):  # LAMB decides on the device: a 0-d bool tensor
            return bool(taken)  # one sync, after the whole step is queued; keeps DLE's schedule rule
        return taken is not False

    def __call__(self, micro_batches: Sequence[Any]) -> StepResult:
        if not micro_batches:
            raise ValueError("a training step needs at least one micro-batch")
        sums = {name: torch.zeros((), device=self.device) for name in ("loss",) + self.track}
        samples = tokens = 0
        for i, batch in enumerate(micro_batches):
            tokens += _real_tokens(batch)  # before the move: a host count, no device sync
            batch = to_device(batch, self.device)
            samples += _batch_size(batch)
            self._forward_backward(batch, len(micro_batches), i == len(micro_batches) - 1, sums)
        nonfinite = False
        if self.guard:
            stepped, bad_norm = self._guarded_step()
            nonfinite = not stepped and (bad_norm is not None)
            if nonfinite:
                message, params_bad = self._diagnose(sums["loss"], bad_norm)
                if self.on_nonfinite == "stop" or params_bad:
                    self.optimizer.zero_grad(set_to_none=True)
                    why = ("skipping cannot help: the parameters themselves hold NaN/inf" if params_bad else
                           "pass --on_nonfinite skip to skip such steps instead")
                    raise NonFiniteError(f"{message}; stopped without applying this step ({why})")
                self.nonfinite_steps += 1
                self.log(f"{message}; step skipped ({self.nonfinite_steps} so far)")
        else:
            stepped = self._optimizer_step()
        lr = self.optimizer.param_groups[0]["lr"]  # the rate this step used, for the log
        if stepped and self.scheduler is not None:
            self.scheduler.step()
        if not stepped:
            self.skipped_steps += 1
        self.optimizer.zero_grad(set_to_none=True)
        self.steps += 1
        loss = sums.pop("loss")
        return StepResult(loss=loss, extras=sums, stepped=stepped, lr=lr, samples=samples, nonfinite=nonfinite,
                          tokens=tokens)


@dataclass
class StepClock:
    """Wall time of a run, with the first ``excluded`` steps (allocator and kernel warm-up) left out.

    ``per_step=True`` synchronizes the device after every step so each step's time is its own (the
    benchmark's p20/p50/p80); the trainers keep it off and synchronize only at the boundaries.
    """

    device: torch.device
    excluded: int
    per_step: bool = False
    step_times: list[float] = field(default_factory=list)
    start: float = field(default_factory=time.perf_counter)
    timed_start: Optional[float] = None
    timed_samples: int = 0
    timed_tokens: int = 0
    steps: int = 0
    end: Optional[float] = None
    _t0: float = 0.0

    def __post_init__(self) -> None:
        if self.excluded == 0:
            synchronize(self.device)
            self.timed_start = time.perf_counter()

    def begin_step(self) -> None:
        if self.per_step:
            synchronize(self.device)
        self._t0 = time.perf_counter()

    def end_step(self, samples: int, tokens: int = 0) -> None:
        if self.per_step:
            synchronize(self.device)
        self.step_times.append(time.perf_counter() - self._t0)
        self.steps += 1
        if self.timed_start is not None:
            self.timed_samples += samples
            self.timed_tokens += tokens
        if self.steps == self.excluded:
            synchronize(self.device)
            self.timed_start = time.perf_counter()

    def stop(self) -> None:
        synchronize(self.device)
        self.end = time.perf_counter()

    @property
    def elapsed(self) -> float:
        return (self.end or time.perf_counter()) - self.start

    @property
    def timed_steps(self) -> int:
        return max(0, self.steps - self.excluded)

    def _rate(self, count: int) -> float:
        """``count`` per second over the timed steps; NaN when no step was timed (a run too short)."""
        if self.timed_start is None or count == 0:
            return float("nan")
        end = self.end if self.end is not None else time.perf_counter()
        return count / (end - self.timed_start) if end > self.timed_start else float("nan")

    @property
    def samples_per_second(self) -> float:
        return self._rate(self.timed_samples)

    @property
    def tokens_per_second(self) -> float:
        """Real (non-padding) tokens/s over the timed steps."""
        return self._rate(self.timed_tokens)


def default_excluded_steps(steps: int) -> int:
    """Warm-up steps left out of a throughput figure: 10% of the run, at least 1 (so a one-step run
    has no timed step and reports its speed as n/a rather than a warm-up figure)."""
    return max(1, steps // 10)
