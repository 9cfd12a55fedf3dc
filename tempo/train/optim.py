"""Optimizers and learning-rate schedules for BERT training.

`Lamb` follows the semantics of apex's FusedLAMB as used by DLE BERT
pre-training, written with `torch._foreach_*` multi-tensor ops instead of a
CUDA extension. `PolyWarmUpScheduler` / `LinearWarmUpScheduler` follow the DLE
schedules. `make_optimizer` is the single factory shared by trainers and
benchmarks.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

__all__ = [
    "Lamb",
    "bert_param_groups",
    "PolyWarmUpScheduler",
    "LinearWarmUpScheduler",
    "make_optimizer",
    "OPTIMIZER_CHOICES",
]

logger = logging.getLogger(__name__)

_LOW_PRECISION = (torch.float16, torch.bfloat16)


def _state_dtype(param: torch.Tensor) -> torch.dtype:
    # Moments are never kept below fp32; fp64 params keep fp64 moments.
    return torch.float32 if param.dtype in _LOW_PRECISION else param.dtype


class Lamb(Optimizer):
    """LAMB with apex FusedLAMB semantics (adam_w_mode=True), deciding skips on the device.

    Per step:
      1. global L2 norm of all gradients of all groups; if it is not finite the
         step is skipped: parameters, moments and step counters stay exactly as
         they were (``skipped_steps += 1``), which lets bf16 runs without a
         GradScaler skip bad steps too;
      2. gradients are scaled by ``max_grad_norm / max(norm, max_grad_norm)``
         (into a scratch copy: ``p.grad`` is left untouched);
      3. ``m = b1*m + b3*g`` with ``b3 = 1-b1`` (``grad_averaging``) or 1,
         ``v = b2*v + (1-b2)*g*g``, moments in fp32 (or fp64 for fp64 params);
      4. ``u = m_hat / (sqrt(v_hat) + eps) + wd*p``;
      5. ``p -= lr * ratio * u`` with the per-tensor trust ratio
         ``||p|| / ||u||`` (1.0 when either norm is 0).

    As in apex, the trust ratio is only applied in groups with non-zero weight
    decay unless ``use_nvlamb=True`` (then it is applied everywhere). DLE uses
    the apex default, so bias / LayerNorm parameters get plain Adam-style
    updates scaled by lr.

    No host sync: the skip decision is a 0-d bool tensor on the device. A
    skipped step runs the same kernels with the scaled gradients zeroed and the
    moment decay, learning rate and step increment multiplied away, so it
    leaves every parameter and state bit-identical (needs ``eps > 0``, the
    usual case, so that the discarded update is finite). The step counter is
    kept per param group in ``group["step"]`` (as apex) as a 0-d float32 tensor
    on the parameters' device (exact up to 2**24 steps) that advances only on
    steps that were taken; checkpoints holding an int there load fine.
    Parameters seen for the first time get zero moments even when that step
    is skipped (equivalent to having no state: the next taken step is the
    same as a fresh optimizer's first).

    ``step()`` returns a 0-d bool tensor on the parameters' device, True when
    parameters were updated; ``bool(...)`` / ``if opt.step():`` read it (a
    sync at that point, not inside the step). It returns plain ``False`` when
    no parameter had a gradient. ``self.last_step_taken`` keeps the same value;
    ``self.last_grad_norm`` the pre-clipping global gradient norm as a 0-d
    tensor (inf/nan on a skip; ``float(...)`` syncs); ``self.skipped_steps``
    is an int (reading it syncs).

    With fp16 and ``torch.amp.GradScaler`` use the usual
    ``scaler.unscale_(opt)`` (optional) + ``scaler.step(opt)`` + ``scaler.update()``;
    the scaler passes ``step()``'s return value through, or returns None
    when it skipped the step itself (the scaler syncs on its own inf check).

    Memory: the scaled gradients are one flat scratch buffer per (device,
    dtype) bucket in the moments' dtype (as large as the gradients in fp32),
    alive during the step only, after the activations are gone.

    Global clipping assumes every rank holds the full gradients (DDP); with
    sharded gradients the norm would have to be all-reduced first.
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-6,
        weight_decay: float = 0.01,
        bias_correction: bool = True,
        max_grad_norm: float | None = 1.0,
        grad_averaging: bool = True,
        use_nvlamb: bool = False,
    ) -> None:
        if not lr >= 0.0:
            raise ValueError(f"invalid learning rate: {lr}")
        if not eps >= 0.0:
            raise ValueError(f"invalid eps: {eps}")
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"invalid betas: {betas}")
        if not weight_decay >= 0.0:
            raise ValueError(f"invalid weight_decay: {weight_decay}")
        if max_grad_norm is not None and max_grad_norm < 0.0:
            raise ValueError(f"invalid max_grad_norm: {max_grad_norm}")
        defaults = dict(
            lr=lr,
            betas=tuple(betas),
            eps=eps,
            weight_decay=weight_decay,
            bias_correction=bias_correction,
            grad_averaging=grad_averaging,
            use_nvlamb=use_nvlamb,
        )
        super().__init__(params, defaults)
        # Clipping is global over all groups, so it is not a per-group option.
        self.max_grad_norm = max_grad_norm
        self._skipped_base = 0  # skips restored from a state dict
        self._skipped: torch.Tensor | None = None  # skips counted on the device since
        self.last_step_taken: bool | torch.Tensor = False
        self.last_grad_norm: torch.Tensor | None = None

    @property
    def skipped_steps(self) -> int:
        """Steps skipped for a non-finite gradient norm (reading it syncs with the device)."""
        return self._skipped_base + (int(self._skipped) if self._skipped is not None else 0)

    @skipped_steps.setter
    def skipped_steps(self, value: int) -> None:
        self._skipped_base, self._skipped = int(value), None

    # -- state dict -------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        state["skipped_steps"] = self.skipped_steps
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # torch's loader casts floating state to the param dtype, which would
        # silently turn fp32 moments of bf16/fp16 params into low precision, so
        # the per-param state is restored here instead.
        state_dict = dict(state_dict)
        self.skipped_steps = int(state_dict.pop("skipped_steps", 0))
        saved_state = state_dict.get("state", {})
        super().load_state_dict({**state_dict, "state": {}})
        id_to_param = {}
        for saved_group, group in zip(state_dict["param_groups"], self.param_groups):
            id_to_param.update(zip(saved_group["params"], group["params"]))
        for param_id, param_state in saved_state.items():
            if param_id not in id_to_param:
                raise ValueError(f"optimizer state refers to unknown parameter id {param_id}")
            param = id_to_param[param_id]
            self.state[param] = {
                key: (
                    value.to(device=param.device, dtype=_state_dtype(param), copy=True)
                    if torch.is_tensor(value) and value.is_floating_point()
                    else value
                )
                for key, value in param_state.items()
            }
        # The loaded step counters are moved to their parameters' device at the next step.

    # -- step -------------------------------------------------------------

    def _global_grad_norm(self, grads: list[torch.Tensor]) -> torch.Tensor:
        """The L2 norm of all ``grads`` as a 0-d tensor on the first gradient's device (no sync).

        fp32, or fp64 when a gradient is fp64 (so fp64 runs clip exactly)."""
        buckets: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = defaultdict(list)
        for grad in grads:
            buckets[(grad.device, grad.dtype)].append(grad)
        device = grads[0].device
        total_dtype = torch.float64 if any(g.dtype == torch.float64 for g in grads) else torch.float32
        total_sq = torch.zeros((), dtype=total_dtype, device=device)
        for (_, dtype), bucket in buckets.items():
            # fp16 squares overflow early, so reduce low precision in fp32.
            norm_dtype = torch.float32 if dtype in _LOW_PRECISION else dtype
            norms = torch._foreach_norm(bucket, 2, dtype=norm_dtype)
            bucket_norm = torch.linalg.vector_norm(torch.stack(norms)).to(device=device, dtype=total_dtype)
            total_sq = total_sq + bucket_norm * bucket_norm
        return total_sq.sqrt()

    @torch.no_grad()
    def step(self, closure=None) -> bool | torch.Tensor:  # type: ignore[override]
        """Take one LAMB step; returns whether parameters were updated (see the class docstring)."""
        if closure is not None:
            with torch.enable_grad():
                closure()

        grads = []
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is not None:
                    if param.grad.is_sparse:
                        raise RuntimeError("Lamb does not support sparse gradients")
                    grads.append(param.grad)
        if not grads:
            self.last_step_taken = False
            return False

        grad_norm = self._global_grad_norm(grads)
        self.last_grad_norm = grad_norm
        taken = torch.isfinite(grad_norm)
        # Factor applied to the gradients: the clip factor, or 0 on a skipped step (the
        # non-finite entries that 0 * inf leaves as NaN are zeroed in _scaled_grads).
        if self.max_grad_norm:
            clip = self.max_grad_norm / torch.clamp(grad_norm, min=self.max_grad_norm)
        else:
            clip = torch.ones_like(grad_norm)
        scale = torch.where(taken, clip, torch.zeros_like(clip))

        for group in self.param_groups:
            self._update_group(group, scale, taken)
        skipped = (~taken).to(torch.int64)
        self._skipped = skipped if self._skipped is None else self._skipped + skipped.to(self._skipped.device)
        self.last_step_taken = taken
        return taken

    def _update_group(self, group: dict[str, Any], scale: torch.Tensor, taken: torch.Tensor) -> None:
        buckets: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = defaultdict(list)
        for param in group["params"]:
            if param.grad is None:
                continue
            state = self.state[param]
            if not state:
                state["exp_avg"] = torch.zeros_like(
                    param, dtype=_state_dtype(param), memory_format=torch.preserve_format
                )
                state["exp_avg_sq"] = torch.zeros_like(
                    param, dtype=_state_dtype(param), memory_format=torch.preserve_format
                )
            buckets[(param.device, param.dtype)].append(param)
        if not buckets:
            return

        device = next(iter(buckets))[0]
        step = group.get("step", 0)
        if not torch.is_tensor(step):  # a new group, or a state dict with an int step
            step = torch.tensor(float(step), dtype=torch.float32, device=device)
        elif step.device != device or step.dtype != torch.float32:
            step = step.to(device=device, dtype=torch.float32)
        # Advances only on taken steps. Out of place: a state_dict() taken earlier shares the
        # old tensor and must not change under its holder.
        step = step + taken.to(device=device, dtype=torch.float32)
        group["step"] = step

        for (bucket_device, _), params in buckets.items():
            self._update_bucket(
                params,
                group=group,
                step=step.to(bucket_device),
                scale=scale.to(bucket_device),
                taken=taken.to(bucket_device),
            )

    def _scaled_grads(self, params: list[torch.Tensor], dtype: torch.dtype,
                      scale: torch.Tensor) -> list[torch.Tensor]:
        """scale * p.grad for each param, as views of one fresh flat buffer in ``dtype``.

        One buffer means a handful of kernels whatever the number of tensors: cat, cast,
        scale, and the zeroing of the NaN/inf that a skipped step's 0 * inf leaves."""
        flat = torch.cat([p.grad.reshape(-1) for p in params])
        flat = flat.to(dtype) if flat.dtype != dtype else flat  # cat made a copy: p.grad is untouched
        flat.mul_(scale.to(dtype))
        flat.nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)  # a no-op on taken steps (all finite)
        return [g.view_as(p) for g, p in zip(flat.split([p.numel() for p in params]), params)]

    def _update_bucket(
        self,
        params: list[torch.Tensor],
        *,
        group: dict[str, Any],
        step: torch.Tensor,
        scale: torch.Tensor,
        taken: torch.Tensor,
    ) -> None:
        exp_avgs = [self.state[p]["exp_avg"] for p in params]
        exp_avg_sqs = [self.state[p]["exp_avg_sq"] for p in params]
        dtype = exp_avgs[0].dtype
        low_precision = params[0].dtype in _LOW_PRECISION
        # Math runs in the moments' dtype; low-precision params work on fp32
        # copies that are written back at the end.
        work_params = [p.float() for p in params] if low_precision else params
        grads = self._scaled_grads(params, dtype, scale)  # zeros on a skipped step

        beta1, beta2 = group["betas"]
        # .get: groups restored from state dicts written by other LAMB versions
        beta3 = 1.0 - beta1 if group.get("grad_averaging", True) else 1.0
        one = torch.ones((), dtype=dtype, device=step.device)
        # On a skipped step the moments decay by 1 and gain 0 * 0: unchanged, bit for bit.
        torch._foreach_mul_(exp_avgs, torch.where(taken, torch.full_like(one, beta1), one))
        torch._foreach_add_(exp_avgs, grads, alpha=beta3)
        torch._foreach_mul_(exp_avg_sqs, torch.where(taken, torch.full_like(one, beta2), one))
        torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=1.0 - beta2)
        del grads

        if group.get("bias_correction", True):
            # step is >= 1 on taken steps; clamped so a skipped first step (step 0) stays finite.
            t = torch.clamp(step.to(dtype), min=1.0)
            bias_correction1 = 1.0 - torch.pow(beta1, t)
            bias_correction2 = 1.0 - torch.pow(beta2, t)
        else:
            bias_correction1 = bias_correction2 = one
        weight_decay = group["weight_decay"]
        use_trust_ratio = group.get("use_nvlamb", False) or weight_decay != 0.0
        # lr on taken steps, 0 on skipped ones: p - 0 * u == p.
        lr = torch.where(taken, torch.full_like(one, group["lr"]), torch.zeros_like(one))

        # update = (m / bc1) / (sqrt(v / bc2) + eps) + wd * p, built in one buffer
        update = torch._foreach_div(exp_avg_sqs, bias_correction2)
        torch._foreach_sqrt_(update)
        torch._foreach_add_(update, group["eps"])
        torch._foreach_reciprocal_(update)
        torch._foreach_mul_(update, exp_avgs)
        torch._foreach_div_(update, bias_correction1)
        if weight_decay != 0.0:
            torch._foreach_add_(update, work_params, alpha=weight_decay)

        if use_trust_ratio:
            # Norms in fp64: an fp32 norm overflows above ~1.8e19, and on a skipped step lr = 0
            # times an inf/NaN ratio would still write NaN into the weights.
            param_norms = torch.stack(torch._foreach_norm(work_params, 2, dtype=torch.float64))
            update_norms = torch.stack(torch._foreach_norm(update, 2, dtype=torch.float64))
            both_nonzero = (param_norms != 0) & (update_norms != 0)
            ratios = torch.where(
                both_nonzero, param_norms / torch.where(both_nonzero, update_norms, 1.0), 1.0
            ).to(lr.dtype)
            step_sizes = torch.where(taken, ratios * lr, torch.zeros_like(ratios))
            torch._foreach_mul_(update, list(step_sizes.unbind(0)))
        else:
            torch._foreach_mul_(update, lr)
        torch._foreach_sub_(work_params, update)

        if low_precision:
            torch._foreach_copy_(params, work_params)


# -- parameter groups ------------------------------------------------------


def bert_param_groups(model: nn.Module, weight_decay: float = 0.01) -> list[dict[str, Any]]:
    """Split trainable parameters into [decay, no_decay] groups as DLE does.

    No decay: every parameter of a module whose class name contains
    "LayerNorm" (nn.LayerNorm, custom in-place LayerNorms, ...) and every
    parameter named ``*.bias``. Tied parameters appear once. Both groups are
    always returned (possibly empty) so group indices are stable.
    """
    no_decay_ids = set()
    for module in model.modules():
        if "LayerNorm" in type(module).__name__:
            no_decay_ids.update(id(p) for p in module.parameters(recurse=False))
    decay, no_decay = [], []
    for name, param in model.named_parameters():  # deduplicates tied params
        if not param.requires_grad:
            continue
        if id(param) in no_decay_ids or name.rsplit(".", 1)[-1] == "bias":
            no_decay.append(param)
        else:
            decay.append(param)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


# -- learning-rate schedules -----------------------------------------------


class _WarmUpScheduler(LRScheduler):
    """Shared plumbing: the k-th optimizer step (1-based) runs with lr f(k).

    Call ``scheduler.step()`` after each optimizer step that was taken
    (``Lamb.step()`` returned True), as DLE ties the schedule to the
    optimizer's step count. Right after construction the groups hold f(1).
    """

    def __init__(
        self,
        optimizer: Optimizer,
        warmup: float,
        total_steps: int,
        base_lr: float | None = None,
        last_epoch: int = -1,
    ) -> None:
        if total_steps <= 0:
            raise ValueError(f"total_steps must be positive, got {total_steps}")
        if not 0.0 <= warmup < 1.0:
            raise ValueError(f"warmup is a fraction of total_steps in [0, 1), got {warmup}")
        self.warmup = float(warmup)
        self.total_steps = int(total_steps)
        if base_lr is not None:
            for group in optimizer.param_groups:
                group["lr"] = base_lr
                group["initial_lr"] = base_lr
        super().__init__(optimizer, last_epoch)

    def _factor(self, progress: float) -> float:
        raise NotImplementedError

    def lr_factor(self, step: int) -> float:
        """Multiplier of the base lr used for optimizer step ``step`` (1-based)."""
        progress = min(step / self.total_steps, 1.0)
        if progress < self.warmup:
            return progress / self.warmup
        return self._factor(progress)

    def get_lr(self) -> list[float]:
        factor = self.lr_factor(self.last_epoch + 1)
        return [base_lr * factor for base_lr in self.base_lrs]

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        # Make the optimizer agree with the restored schedule even if its own
        # state was not restored (or was restored before this scheduler).
        for group, lr in zip(self.optimizer.param_groups, self._last_lr):
            group["lr"] = lr


class PolyWarmUpScheduler(_WarmUpScheduler):
    """DLE pre-training schedule: linear warm-up over ``warmup * total_steps``
    steps, then ``base_lr * (1 - step/total_steps) ** degree``."""

    def __init__(
        self,
        optimizer: Optimizer,
        warmup: float,
        total_steps: int,
        degree: float = 0.5,
        base_lr: float | None = None,
        last_epoch: int = -1,
    ) -> None:
        self.degree = float(degree)
        super().__init__(optimizer, warmup, total_steps, base_lr=base_lr, last_epoch=last_epoch)

    def _factor(self, progress: float) -> float:
        return (1.0 - progress) ** self.degree


class LinearWarmUpScheduler(_WarmUpScheduler):
    """DLE SQuAD schedule: linear warm-up, then linear decay from base_lr at
    the end of warm-up to 0 at ``total_steps``."""

    def _factor(self, progress: float) -> float:
        return max((1.0 - progress) / (1.0 - self.warmup), 0.0)


# -- factory ---------------------------------------------------------------

OPTIMIZER_CHOICES = ("lamb", "adamw", "adamw_fused")


def _make_fused_adamw(param_groups, lr, kwargs) -> Optimizer:
    try:
        return torch.optim.AdamW(param_groups, lr=lr, fused=True, **kwargs)
    except RuntimeError as err:
        # Raised for devices/dtypes without a fused kernel.
        logger.info("fused AdamW unavailable for these params (%s); using foreach AdamW", err)
        return torch.optim.AdamW(param_groups, lr=lr, foreach=True, **kwargs)


def make_optimizer(
    name: str,
    param_groups: Iterable[Any],
    lr: float,
    *,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float | None = None,
    weight_decay: float = 0.01,
    **kwargs: Any,
) -> Optimizer:
    """Build an optimizer by name: one of ``OPTIMIZER_CHOICES``.

    ``weight_decay`` is the default for groups that do not set their own (the
    groups from `bert_param_groups` do). ``eps`` defaults to 1e-6 for LAMB (DLE)
    and 1e-8 for AdamW (torch). Extra keyword arguments go to the optimizer,
    e.g. ``max_grad_norm`` / ``use_nvlamb`` for LAMB.
    """
    key = name.lower()
    param_groups = list(param_groups)
    if key == "lamb":
        return Lamb(
            param_groups,
            lr=lr,
            betas=betas,
            eps=1e-6 if eps is None else eps,
            weight_decay=weight_decay,
            **kwargs,
        )
    if key in ("adamw", "adamw_fused"):
        adamw_kwargs = dict(
            betas=betas, eps=1e-8 if eps is None else eps, weight_decay=weight_decay, **kwargs
        )
        if key == "adamw_fused":
            return _make_fused_adamw(param_groups, lr, adamw_kwargs)
        return torch.optim.AdamW(param_groups, lr=lr, **adamw_kwargs)
    raise ValueError(f"unknown optimizer {name!r}; choose one of {', '.join(OPTIMIZER_CHOICES)}")
