"""In-place LayerNorm: the backward pass reads the output y, never the input x.

LayerNorm's output holds the normalized input: x̂ = (y − β) / γ. So instead of the input (plus
mean and rstd) the op keeps y, which is the tensor it returns and which the next layer (a Linear,
a dropout, a residual add) keeps anyway, plus one fp32 rstd per row. With x̂ recovered,

    dβ = Σ_rows g        dγ = Σ_rows g·x̂        dx = rstd·(g·γ − mean(g·γ) − x̂·mean(g·γ·x̂))

Recovery and its condition (exact by construction). Let D be y's dtype, u_D its unit roundoff
(fp32 2⁻²⁴, bf16 2⁻⁸, fp16 2⁻¹¹) and λ_D its smallest normal number (fp32 and bf16 2⁻¹²⁶, fp16
2⁻¹⁴); u_c is the unit roundoff of the compute dtype (fp32; fp64 for fp64 inputs). The stored
y_j is within u_D·max(|y_j|, λ_D) of γ_j·x̂_j + β_j (relative rounding, or half the subnormal
spacing), so x̂'_j = (y_j − β_j)·(1/γ_j) computed in the compute dtype satisfies, to first order,

    |x̂'_j − x̂_j| <= u_D·|x̂_j| + u_D·(|β_j| + λ_D)/|γ_j| + 3·u_c·(|x̂_j| + (|β_j| + λ_D)/|γ_j|).

The first term is the rounding of y itself, which the next layer sees anyway; the second is the
condition of the recovery, κ_j = (|β_j| + λ_D)/|γ_j|. Where γ_j is small against β_j (or is 0),
y_j ≈ β_j carries no information about x̂_j and no clamp can make the gradient right. So column j
is **recovered** only when κ_j <= 1, i.e. |γ_j| >= |β_j| + λ_D, and then

    |x̂'_j − x̂_j| <= (u_D + 3·u_c)·(|x̂_j| + 1)                                          (R)

(fp32 output: 2.4e-7·(|x̂_j| + 1); bf16: 3.9e-3·(|x̂_j| + 1); fp16: 4.9e-4·(|x̂_j| + 1)). Every
other column is **kept**: the forward stores x̂_j of those K columns for every row in the compute
dtype ([rows, K]) plus their K int64 indices, and the backward reads them instead of dividing.
Without γ the rule applies with γ = 1 (a column is kept when |β_j| > 1 − λ_D); without β, with
β = 0 (kept only when |γ_j| < λ_D, e.g. γ_j = 0). The set is that of the forward's γ and β (they
change while training; see "The plan" below for when it is computed). Models with
|γ| ~ 1 and small β (a fresh BERT: γ = 1, β = 0) keep no column, so the bytes stay at y + rstd;
all-MiniLM-L6-v2 keeps 14 of its 13 × 384 columns. In the formulas, γ_j·x̂_j is taken as y_j − β_j
(no division) for recovered columns and as γ_j times the kept x̂_j for kept ones. The error of
each gradient follows from (R): |δ(dγ_j)| <= Σ_rows |g_rj|·(u_D + 3u_c)(|x̂_rj| + 1), and dx as
nn.LayerNorm's with x̂ perturbed by (R). There is no clamp anywhere: a value is recovered within
(R) or kept.

Non-finite γ or β: the forward raises a ValueError naming the layer (``name``) and the column, so
no NaN gradient is made silently. γ or β on another device than the input: a ValueError naming
the layer, before any kernel runs.

The plan (which columns are kept, and the finiteness check that rides on it) needs the N flags on
the host, which on CUDA is a device-to-host copy that stalls the stream. So on the Triton path and
on every device but the CPU it is made once per *version* of γ and β and cached
(``cached_kept_columns``): keyed on the parameter objects (the base of a view, with the view's
geometry), the output dtype's λ_D (fp32 and bf16 share one) and the device, and valid while no
optimizer step has been taken since (any ``torch.optim.Optimizer``, counted by torch's global
post-step hook, which this module registers) and each parameter's version counter, storage
pointer and dtype are those it was made at. PyTorch bumps the version counter at every in-place
write to a tensor or to any view of it: ``load_state_dict``, ``nn.init``, ``with torch.no_grad():
p.copy_(...)`` / ``p[3] = x`` / ``p.mul_(...)``, the foreach and single-tensor optimizers;
replacing the storage (``p.data = t``, ``module.half()``, ``module.to(...)``) changes the pointer
or dtype. The optimizer hook covers what the counter misses inside a step: the fused optimizers
(``AdamW(fused=True)``, HF Trainer's ``adamw_torch_fused``) update in place without bumping it
(torch 2.11 and 2.13), and hand-written optimizers may write through ``.data``. A refresh makes,
in one transfer, the plans of every layer on that device whose γ/β changed: one host read per
training step for a whole model (in the optimizer hook, below), none in a forward, a
recomputation (activation checkpointing) or an eval pass while the parameters stay the same.
**What is not seen**: an in-place write outside an optimizer step that goes through ``.data``
(``p.data.fill_(...)``: ``.data`` has a version counter of its own) or through a fused
multi-tensor op called directly; it leaves the plan of the old values in place (a column that
became unrecoverable would be recovered by division, a non-finite value would not raise). After
such writes call ``refresh_kept_column_plans(model)`` (or ``forget_kept_column_plans()``), or
write under ``torch.no_grad()`` without ``.data``. The CPU reference path makes the plan at every
forward instead (its flags are on the host already: no cache that could go stale).

The plan is an *input* of the forward ops (``kept_cols`` int64 [K]), so the shape of what they
keep ([rows, K]) is known before the call and ``torch.compile`` traces them without a
data-dependent shape. Eager, the module makes it right before the call (``tempo::layernorm_plan``,
cached as above) and the op uses it as it is. Each module also holds the plans of its γ/β per
output dtype (``tempo_kept_columns``: fp32, bf16, fp16 and the parameters' own; a plain attribute,
no buffer), made again outside any forward: at construction, ``name_layernorms`` (``apply_tempo``),
every optimizer step that updates γ/β (the post-step hook: one host read per step on CUDA),
``load_state_dict``, ``.to()``/``.half()``, and every eager forward. Under ``torch.compile`` the
module hands the op that held plan, which the graph takes as an input (a change of K recompiles;
no value of γ/β is read in the graph). The op checks it when it runs against the plan of the
current γ/β (cached: no host read while unchanged on CUDA): the same K but other columns, it uses
the current ones; another K means γ/β were written where no refresh point saw it, and it raises a
RuntimeError naming the layer and ``tempo.refresh_kept_column_plans(model)``: it never computes
with a wrong plan. The functional ``inplace_layernorm`` has no module to hold a plan: compiled, it
plans inside the graph (a data-dependent shape; logged once). The same machinery plans
tempo.ops.rmsnorm's InplaceRMSNorm: the rule with β = None and γ = w, or 1 + w for Gemma's form
(``weight_offset`` 1, part of the cache key); every module holding plans is a ``KeptColumnPlans``
and says which parameters they are of (``kept_column_parameters``), so the optimizer hook,
``name_layernorms`` and ``refresh_kept_column_plans`` reach LayerNorms and RMSNorms alike.

No backward, nothing kept: when the output cannot reach a backward pass (grad mode off, or neither
the input nor γ/β requires grad) the op keeps nothing. It runs ``torch.nn.functional.layer_norm``
(output cast to the dtype the Tempo path would return) unless a module in training mode runs on the
Triton path (``runs_own_forward``): there it runs the Triton forward, whose rounding differs from
aten's (measured on MiniLM: up to 4.8e-7 fp32, one bf16 ULP under autocast), so that a no-grad
pass (reentrant checkpointing's first) gives the bits its recompute with grad gives. The reference
forward is aten's layer_norm on the same fp32 values, bitwise the stock op's, so the stock op
stands for it there. The functional ``inplace_layernorm`` has no training mode: the stock op.

Contents, in order: the recovery rule, the plan per parameter version, the plan handed to the
forward ops (``tempo::layernorm_plan``, the module-held plans, the optimizer hook), Triton kernels,
their host launchers, the PyTorch reference path, the ``tempo::layernorm_fwd`` /
``tempo::layernorm_bwd`` custom ops, the functional ``inplace_layernorm`` and the
``InplaceLayerNorm`` module.
"""

from __future__ import annotations

import math
import numbers
import threading
import weakref
from typing import Optional, Sequence, Union

import torch
from torch import Tensor, nn
from torch.nn import functional as F
from torch.optim.optimizer import register_optimizer_step_post_hook

from tempo.ops._backend import (
    TRITON_DTYPES,
    autocast_dtype_for,
    check_float_tensor,
    launch_on,
    log_fallback_once,
    resolve_backend,
    runs_own_forward,
)
from tempo.ops._backend import tl, triton  # None without triton (reference path only)


OP_NAME = "inplace_layernorm"
# Rows longer than this do not fit one Triton block in the forward; they run on the reference
# path (logged once), which keeps exactly the same tensors for backward.
MAX_TRITON_N = 16384
# dtypes autocast would have cast to its lower-precision type (fp64 is left alone by autocast).
_AUTOCAST_ELIGIBLE = (torch.float32, torch.float16, torch.bfloat16)


# ----------------------------------------------------------------------------------------------
# Which columns are recovered from y and which are kept (the rule of the module docstring)
# ----------------------------------------------------------------------------------------------
def _compute_dtype(weight: Optional[Tensor], bias: Optional[Tensor]) -> torch.dtype:
    return torch.float64 if any(p is not None and p.dtype == torch.float64 for p in (weight, bias)) \
        else torch.float32


def _unrecoverable(gamma: Tensor, beta: Tensor, tiny: float, compute: torch.dtype) -> Tensor:
    # The rule: column j is kept when |γ_j| < |β_j| + λ_D.
    return gamma.to(compute).abs() < beta.to(compute).abs() + tiny


def _effective_gamma(weight: Tensor, n: int, offset: float, compute: torch.dtype) -> Tensor:
    """γ as the forward multiplies by it, flattened to [n]: the weight itself, or ``weight + offset``
    computed in the compute dtype exactly as the kernels and the reference path compute it
    (RMSNorm's Gemma form multiplies by 1 + w: ``offset`` 1)."""
    gamma = weight.detach().reshape(n)
    return gamma.to(compute) + offset if offset else gamma


def unrecoverable_columns(weight: Optional[Tensor], bias: Optional[Tensor], out_dtype: torch.dtype,
                          n: int, device: torch.device, weight_offset: float = 0.0) -> Tensor:
    """Bool [n]: True where x̂_j cannot be recovered from y_j to (R): |γ_j| < |β_j| + λ_D.

    ``weight``/``bias`` flattened to [n] or None (γ = 1, β = 0); γ is ``weight + weight_offset``
    (RMSNorm's (1 + w) form). Computed on the device, no sync.
    """
    compute = _compute_dtype(weight, bias)
    gamma = (_effective_gamma(weight, n, weight_offset, compute) if weight is not None
             else torch.ones(n, dtype=compute, device=device))
    beta = bias.detach() if bias is not None else torch.zeros(n, dtype=compute, device=device)
    return _unrecoverable(gamma, beta, torch.finfo(out_dtype).tiny, compute)


def plan_kept_columns(weight: Optional[Tensor], bias: Optional[Tensor], out_dtype: torch.dtype, n: int,
                      device: torch.device, where: str, weight_offset: float = 0.0) -> Tensor:
    """int64 [K] on ``device``: the columns whose x̂ the forward keeps (ascending).

    Also checks that γ and β are finite, raising a ValueError that names ``where`` (the layer) and
    the first bad column. One host read of n flags (a sync on CUDA); nothing to read without γ/β.
    ``weight_offset``: γ is ``weight + weight_offset`` (1 for RMSNorm's Gemma form, else 0).
    """
    if weight is None and bias is None:
        return torch.empty((0,), dtype=torch.int64, device=device)
    code = _column_code(weight, bias, out_dtype, n, device, weight_offset).cpu()
    bad = torch.nonzero(code > 1).flatten()
    if bad.numel():
        _raise_non_finite(where, weight, bias, int(bad[0]), int(code[int(bad[0])]), bad.numel(), n)
    return torch.nonzero(code).flatten().to(device)


def _column_code(weight: Optional[Tensor], bias: Optional[Tensor], out_dtype: torch.dtype, n: int,
                 device: torch.device, weight_offset: float = 0.0) -> Tensor:
    """uint8 [n] on the device: bit 0 the column is kept, bit 1 γ_j is not finite, bit 2 β_j is not.
    γ and β of any shape holding n elements (flattened here); γ is ``weight + weight_offset``."""
    return _column_codes([(weight, bias, n, weight_offset)], torch.finfo(out_dtype).tiny,
                         _compute_dtype(weight, bias), device)


def _column_codes(items: list[tuple[Optional[Tensor], Optional[Tensor], int, float]], tiny: float,
                  compute: torch.dtype, device: torch.device) -> Tensor:
    """``_column_code`` of several (γ, β, n, weight offset) sharing λ_D (``tiny``) and the compute
    dtype, concatenated: one pass of a few element-wise kernels over all of them, whatever their number."""
    one = torch.ones((), dtype=compute, device=device)
    zero = torch.zeros((), dtype=compute, device=device)
    gammas = [_effective_gamma(w, n, offset, compute) if w is not None else one.expand(n)
              for w, _b, n, offset in items]
    betas = [b.detach().reshape(n) if b is not None else zero.expand(n) for _w, b, n, _offset in items]
    # torch.cat promotes mixed dtypes; the values (and their finiteness) are unchanged by it.
    gamma = torch.cat(gammas) if len(gammas) > 1 else gammas[0]
    beta = torch.cat(betas) if len(betas) > 1 else betas[0]
    code = _unrecoverable(gamma, beta, tiny, compute).to(torch.uint8)
    # Absent parameters stand in as 1 and 0: finite, so their bits stay clear.
    code |= (~torch.isfinite(gamma)).to(torch.uint8) * 2
    code |= (~torch.isfinite(beta)).to(torch.uint8) * 4
    return code


def _raise_non_finite(where: str, weight: Optional[Tensor], bias: Optional[Tensor], col: int, code: int,
                      count: int, n: int) -> None:
    which = "weight (γ)" if code & 2 else "bias (β)"
    value = (weight if code & 2 else bias).detach().reshape(-1)[col].item()  # the error path only
    raise ValueError(f"{where}: {which} holds a non-finite value ({value}) at column {col} "
                     f"({count} bad column(s) of {n}); refusing to normalize with it")


# ----------------------------------------------------------------------------------------------
# The plan per parameter version (the Triton / CUDA path): no host read while γ and β are unchanged
# ----------------------------------------------------------------------------------------------
class _Plan:
    """The kept columns (or the non-finite column) of one (γ, β, λ_D, weight offset) on one device,
    valid while ``_state`` of γ and β (optimizer steps taken, version counters, storage, dtype) is
    the ``versions`` it was made at. ``out_dtype``: the first output dtype of that λ_D it was made
    for (fp32 and bf16 share λ_D = 2⁻¹²⁶, so they share a plan). ``offset``: γ is weight + offset
    (RMSNorm's (1 + w) form: 1; else 0)."""

    __slots__ = ("refs", "shapes", "out_dtype", "n", "device", "offset", "versions", "kept_cols", "error")

    def __init__(self, refs, shapes, out_dtype, n, device, offset=0.0):
        self.refs, self.shapes, self.out_dtype, self.n, self.device = refs, shapes, out_dtype, n, device
        self.offset = offset
        self.versions = None  # never made
        self.kept_cols: Optional[Tensor] = None
        self.error: Optional[tuple[int, int, int]] = None  # (column, code, bad columns)

    def roots(self) -> Optional[tuple[Optional[Tensor], ...]]:
        """The parameters (None where absent), or None when one of them has been freed."""
        roots = tuple(ref() if ref is not None else None for ref in self.refs)
        if any(root is None and ref is not None for root, ref in zip(roots, self.refs)):
            return None
        return roots

    def params(self, roots) -> tuple[Optional[Tensor], ...]:
        """γ and β as the op sees them: the roots, or their views of the recorded geometry."""
        out = []
        for root, shape in zip(roots, self.shapes):
            if root is None:
                out.append(None)
            else:
                root = root.detach()
                out.append(root if shape is None else root.as_strided(*shape))
        return tuple(out)


_plans: dict[tuple, _Plan] = {}
# Backward (and so activation-checkpoint recomputation) runs on autograd's device threads on CUDA.
_plans_lock = threading.RLock()


def _anchor(t: Optional[Tensor]) -> tuple[Optional[Tensor], Optional[tuple]]:
    """(the tensor owning t's version counter: t's base for a view, else t; t's geometry when a view).

    A view shares its base's version counter, so an in-place write through any view of a parameter
    (``param.view(-1)[3] = x``) bumps the counter read here."""
    if t is None:
        return None, None
    base = t._base
    if base is None:
        return t, None
    return base, (tuple(t.shape), tuple(t.stride()), t.storage_offset())


def _cacheable(*params: Optional[Tensor]) -> bool:
    # Plain tensors and Parameters only: inference tensors have no version counter, meta tensors no
    # values, and subclasses (fake tensors, DTensor, ...) may have neither a data pointer nor a
    # counter that means what it means here. Those are planned at every forward, as before.
    return all(p is None or ((type(p) is Tensor or type(p) is nn.Parameter) and not p.is_inference()
                             and not p.is_meta) for p in params)


# Optimizer steps taken in this process (any torch.optim.Optimizer, through torch's global post-step
# hook, registered below): the fused optimizers (AdamW(fused=True), HF Trainer's "adamw_torch_fused",
# SGD(fused=True)) update parameters in place without bumping their version counters (checked on
# torch 2.11 and 2.13), and hand-written optimizers may write through .data; a step makes every
# plan stale.
_optimizer_steps = 0


def _state(roots: tuple[Optional[Tensor], ...]) -> tuple:
    """What a plan is valid for: no optimizer step since, each parameter's version counter, and
    its storage and dtype (so that ``param.data = other``, as ``module.half()`` or ``module.to()``
    do it, is seen too)."""
    return (_optimizer_steps,) + tuple((r._version, r.data_ptr(), r.dtype) if r is not None else None
                                       for r in roots)


def _plan_entry(weight: Optional[Tensor], bias: Optional[Tensor], out_dtype: torch.dtype, n: int,
                device: torch.device, offset: float = 0.0) -> _Plan:
    """The cache entry of (γ = weight + ``offset``, β, λ_D of ``out_dtype``) on ``device``, made (not
    yet refreshed) when missing. Keyed on the parameters' identities (the base of a view, with the
    view's geometry), the offset, λ_D, n and the device. Call with ``_plans_lock`` held."""
    (w_root, w_shape), (b_root, b_shape) = _anchor(weight), _anchor(bias)
    key = (id(w_root), w_shape, id(b_root), b_shape, float(offset), torch.finfo(out_dtype).tiny, n, device)
    plan = _plans.get(key)
    roots = plan.roots() if plan is not None else None
    if roots is None or roots[0] is not w_root or roots[1] is not b_root:
        refs = tuple(weakref.ref(r) if r is not None else None for r in (w_root, b_root))
        plan = _plans[key] = _Plan(refs, (w_shape, b_shape), out_dtype, n, device, float(offset))
    return plan


def _refresh_plans(device: torch.device) -> None:
    """Make every stale plan of ``device`` current: their flags in one transfer, one host read."""
    stale = []
    for key, plan in list(_plans.items()):
        if plan.device != device:
            continue
        roots = plan.roots()
        if roots is None or any(r is not None and r.device != device for r in roots):
            del _plans[key]  # a freed parameter, or one moved to another device (its plan is made there)
            continue
        state = _state(roots)
        if state != plan.versions:
            try:
                params = plan.params(roots)
            except RuntimeError:  # the storage was swapped for a smaller one: the view is gone
                del _plans[key]
                continue
            stale.append((plan, params, state))
    if not stale:
        return
    # Plans sharing λ_D and the compute dtype are flagged in one pass over all their columns.
    groups: dict[tuple, list] = {}
    for item in stale:
        plan, (weight, bias), _state_now = item
        groups.setdefault((torch.finfo(plan.out_dtype).tiny, _compute_dtype(weight, bias)), []).append(item)
    with torch.no_grad():
        ordered, codes = [], []
        for (tiny, compute), items in groups.items():
            codes.append(_column_codes([(w, b, plan.n, plan.offset) for plan, (w, b), _s in items], tiny, compute,
                                       device))
            ordered += items
        code_all = torch.cat(codes) if len(codes) > 1 else codes[0]
        host = code_all.cpu().numpy()  # the one host read
        start = 0
        for plan, _params, state in ordered:
            flags = host[start:start + plan.n]
            bad = (flags > 1).nonzero()[0]
            if bad.size:
                plan.error, plan.kept_cols = (int(bad[0]), int(flags[bad[0]]), int(bad.size)), None
            else:
                k = int(flags.sum())
                # The k flagged columns, ascending, on the device without another host read (a
                # stable sort puts the ones first, in column order).
                code = code_all[start:start + plan.n]
                plan.kept_cols = (torch.sort(code, stable=True, descending=True).indices[:k] if k
                                  else torch.empty((0,), dtype=torch.int64, device=device))
                plan.error = None
            plan.versions = state
            start += plan.n


def cached_kept_columns(weight: Optional[Tensor], bias: Optional[Tensor], out_dtype: torch.dtype, n: int,
                        device: torch.device, where: str, weight_offset: float = 0.0) -> Tensor:
    """``plan_kept_columns`` made once per version of γ and β: a forward whose γ and β are unchanged
    since the plan was made reads nothing from the device (module docstring, "The plan").

    A miss (a new layer, or γ/β written since: the optimizer step) refreshes the plans of every
    layer on ``device`` whose parameters changed, in one transfer: one host read per training step
    for all of a model's LayerNorms and RMSNorms. Raises as ``plan_kept_columns`` does (non-finite γ
    or β)."""
    if (weight is None and bias is None) or not _cacheable(weight, bias):
        return plan_kept_columns(weight, bias, out_dtype, n, device, where, weight_offset)
    device = torch.device(device)
    with _plans_lock:
        plan = _plan_entry(weight, bias, out_dtype, n, device, weight_offset)
        if plan.versions != _state(tuple(_anchor(p)[0] for p in (weight, bias))):
            _refresh_plans(device)
        error, kept = plan.error, plan.kept_cols
    if kept is None and error is None:  # not refreshable (see _refresh_plans): plan this forward alone
        return plan_kept_columns(weight, bias, out_dtype, n, device, where, weight_offset)
    if error is not None:
        _raise_non_finite(where, weight, bias, error[0], error[1], error[2], n)
    # A fresh tensor per call (an op's outputs must not alias across calls); nothing to copy when
    # no column is kept, the usual case.
    return kept.clone() if kept.numel() else torch.empty((0,), dtype=torch.int64, device=device)


def forget_kept_column_plans() -> None:
    """Drop every cached plan: the next forward of each layer makes its plan again. Needed only
    after writing γ or β through ``.data`` (which has a version counter of its own, so the write is
    not seen): see the module docstring. (A compiled model also needs
    ``refresh_kept_column_plans(model)``, which does this for its layers.)"""
    with _plans_lock:
        _plans.clear()


def kept_columns(weight: Optional[Tensor], bias: Optional[Tensor], out_dtype: torch.dtype, n: int,
                 device: torch.device, where: str, backend: str, weight_offset: float = 0.0) -> Tensor:
    """The plan a forward uses: cached per parameter version on the Triton path and on any device
    but the CPU (where a host read stalls the stream); made at every forward on the CPU reference
    path, where reading the flags costs nothing and no cache can go stale."""
    if backend == "triton" or torch.device(device).type != "cpu":
        return cached_kept_columns(weight, bias, out_dtype, n, device, where, weight_offset)
    return plan_kept_columns(weight, bias, out_dtype, n, device, where, weight_offset)


# ----------------------------------------------------------------------------------------------
# The plan handed to the forward ops (an input: its length K gives kept_xhat's shape)
# ----------------------------------------------------------------------------------------------
# Output dtypes a module holds a plan for: the parameters' own and autocast's (fp32 and bf16 share
# λ_D, hence one cached plan; fp16's λ_D is 2⁻¹⁴).
_PLAN_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Every Tempo norm module alive (KeptColumnPlans), for the optimizer hook (weak: a dropped model is
# forgotten).
_live_modules: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()


class KeptColumnPlans(nn.Module):
    """What every Tempo norm whose backward reads its output shares (InplaceLayerNorm,
    DropoutAddLayerNorm, tempo.ops.rmsnorm's InplaceRMSNorm): the kept-column plans of its γ/β, held
    per output dtype for a compiled forward (``tempo_kept_columns``: output dtype -> int64 [K], a
    plain attribute: no buffer, no state_dict key, nothing for DDP to broadcast), and its qualified
    name in its model, which its errors quote (``tempo_name``, set by ``name_layernorms``).

    The plans are made again, outside any forward, at construction (``_hold_kept_column_plans``),
    ``name_layernorms`` (``apply_tempo``), every optimizer step that updates γ/β, ``load_state_dict``,
    ``.to()``/``.half()`` and every eager forward; after other writes to γ/β,
    ``refresh_kept_column_plans(model)``. A subclass says what the plan is of
    (``kept_column_parameters``)."""

    # The layer's qualified name in its model (name_layernorms), quoted by its errors.
    tempo_name: Optional[str] = None

    def kept_column_parameters(self) -> tuple[Optional[Tensor], Optional[Tensor], float]:
        """(weight, bias, weight offset) the forward normalises with: γ = weight + offset, β = bias
        (None where absent)."""
        raise NotImplementedError

    def _hold_kept_column_plans(self) -> None:
        """Called at the end of a subclass's ``__init__``, once its parameters exist."""
        self.tempo_kept_columns: dict[torch.dtype, Tensor] = {}
        _live_modules.add(self)
        _refresh_module_plans([self])

    def __setstate__(self, state) -> None:  # pickle and copy.deepcopy
        super().__setstate__(state)
        self.__dict__.setdefault("tempo_kept_columns", {})
        _live_modules.add(self)

    def _apply(self, fn, recurse=True):
        # .to(), .half(), .cuda(), ...: new storage, dtype or device for γ/β.
        out = super()._apply(fn, recurse)
        _refresh_module_plans([self])
        return out

    def _load_from_state_dict(self, *args, **kwargs) -> None:
        super()._load_from_state_dict(*args, **kwargs)
        _refresh_module_plans([self])


def _refresh_module_plans(modules: Sequence[nn.Module], forget: bool = False) -> None:
    """Make the plans each module holds (``module.tempo_kept_columns``: output dtype -> int64 [K])
    those of its current γ and β (``kept_column_parameters``), in one host read per device.
    ``forget``: re-read γ and β even where their version counters say nothing changed (writes
    through ``.data``). γ/β without values to plan from (meta, fake, inference tensors) leave no
    plan; non-finite ones leave the held plan as it was, for the next forward to raise naming the
    layer."""
    entries = []
    with _plans_lock:
        if forget:  # every cached plan of these γ/β, whatever view of them it was made for
            roots = {id(_anchor(p)[0]) for m in modules for p in m.kept_column_parameters()[:2] if p is not None}
            for plan in _plans.values():
                if any(ref is not None and id(ref()) in roots for ref in plan.refs):
                    plan.versions = None
        for module in modules:
            held = module.tempo_kept_columns
            weight, bias, offset = module.kept_column_parameters()
            if (weight is None and bias is None) or not _cacheable(weight, bias):
                held.clear()  # no γ/β: the forward needs no plan; no values: a compiled forward plans itself
                continue
            n = (weight if weight is not None else bias).numel()
            device = (weight if weight is not None else bias).device
            dtypes = set(_PLAN_DTYPES) | {p.dtype for p in (weight, bias) if p is not None} | set(held)
            for dtype in sorted(dtypes, key=str):
                if not dtype.is_floating_point:
                    continue
                entries.append((held, dtype, _plan_entry(weight, bias, dtype, n, device, offset)))
        for device in {plan.device for _held, _dtype, plan in entries}:
            _refresh_plans(device)
        for held, dtype, plan in entries:
            if plan.kept_cols is not None:
                held[dtype] = plan.kept_cols


def refresh_kept_column_plans(model: nn.Module) -> None:
    """Re-read γ and β of every Tempo LayerNorm and RMSNorm (``KeptColumnPlans``) under ``model``
    and make the kept-column plans its layers hold (which a compiled forward reads) theirs: one host
    read per device.

    Optimizer steps, ``load_state_dict``, ``.to()``/``.half()``, ``apply_tempo`` and every eager
    forward do this already. Call it after writing γ or β another way (``with torch.no_grad():
    ln.weight[3] = 0``, ``ln.weight.data.fill_(...)``) before the next compiled forward: a compiled
    forward that finds its plan out of date with a different number of kept columns raises a
    RuntimeError naming the layer and this function (it cannot change shapes inside its graph)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"refresh_kept_column_plans: argument 'model' must be an nn.Module, "
                        f"got {type(model).__name__}")
    _refresh_module_plans([m for m in model.modules() if isinstance(m, KeptColumnPlans)], forget=True)


@torch.compiler.disable  # a compiled optimizer step runs it as plain Python, after its graph
def _after_optimizer_step(optimizer, args, kwargs) -> None:
    """torch's global optimizer post-step hook: every plan is stale now (``_state``), and the plans
    held by the layers whose γ/β this optimizer steps are made again at once, outside any forward
    (a compiled forward reads them as graph inputs): one host read per step and device. Not while
    a CUDA graph is being captured (no host read can happen there): the next forward's check
    decides then."""
    global _optimizer_steps
    _optimizer_steps += 1
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        return
    stepped = {id(p) for group in optimizer.param_groups for p in group["params"]}
    modules = [m for m in list(_live_modules)
               if any(p is not None and id(p) in stepped for p in m.kept_column_parameters()[:2])]
    if modules:
        _refresh_module_plans(modules)


register_optimizer_step_post_hook(_after_optimizer_step)


@torch.library.custom_op("tempo::layernorm_plan", mutates_args=())
def layernorm_plan(weight: Optional[Tensor], bias: Optional[Tensor], out_dtype: torch.dtype, n: int,
                   backend: str, name: str, weight_offset: float = 0.0) -> Tensor:
    """int64 [K]: the kept columns of γ/β (flattened to [n], at least one given) for an output in
    ``out_dtype`` on the path ``backend`` (``kept_columns``); raises naming the layer ``name`` for a
    non-finite γ or β. γ is ``weight + weight_offset``: LayerNorm's plan is this op with offset 0,
    RMSNorm's with β = None (and offset 1 for Gemma's (1 + w) form). K depends on the values: a
    compiled graph cannot hold this op without a data-dependent shape, so modules hand their held
    plan instead (``plan_for_forward``)."""
    device = (weight if weight is not None else bias).device
    return kept_columns(weight, bias, out_dtype, n, device, name, backend, weight_offset)


@layernorm_plan.register_fake
def _(weight, bias, out_dtype, n, backend, name, weight_offset=0.0):
    k = torch.library.get_ctx().new_dynamic_size(max=n)
    return (weight if weight is not None else bias).new_empty((k,), dtype=torch.int64)


def outputs_with_no_kept_columns(func, args: tuple, kwargs: dict) -> Optional[Tensor]:
    """For counting on fake tensors (tempo.memory's ledger, tempo.movement's traces): the output of
    ``tempo.layernorm_plan`` as it is with K = 0 kept columns, made with γ's (or β's) ``new_empty``;
    None for any other op. Fake γ and β have no values to plan from; K = 0 is what every γ = 1
    layer keeps (a checkpoint's near-zero columns add [rows, K] + K, which a count on real tensors
    shows). The forward ops then give their outputs the shapes of that plan."""
    if str(func.overloadpacket) != "tempo.layernorm_plan":
        return None
    bound = dict(zip([a.name for a in func._schema.arguments], args))
    bound.update(kwargs)
    like = bound["weight"] if bound["weight"] is not None else bound["bias"]
    return like.new_empty((0,), dtype=torch.int64)


# The plan the caller made for this very forward (eager): the op computes with it as it is.
_handed_over = threading.local()


def call_with_plan(op, kept_cols: Tensor, *args):
    """``op(*args)``, a forward op taking the plan ``kept_cols`` (from ``plan_for_forward``). Eager, the
    plan was made for this very call from the current γ/β, and the op is told so (it need not
    make it again: ``plan_in_forward``); in a compiled graph the op checks it when it runs."""
    if torch.compiler.is_compiling():
        return op(*args)
    _handed_over.plan = kept_cols
    try:
        return op(*args)
    finally:
        _handed_over.plan = None


@torch.compiler.disable
def _log_plan_in_graph_once(name: str, module: bool) -> None:
    # Outside the graph (a break here costs nothing more: the plan op breaks it anyway).
    why = ("its module holds no plan for this output dtype and device" if module
           else "the functional form has no module to hold a plan")
    log_fallback_once(f"layernorm_plan:{name}:{module}",
                      f"{name}: under torch.compile the kept-column plan is made from γ/β's values in the "
                      f"graph ({why}): a data-dependent shape, so torch.compile may break the graph here; "
                      "call the module (InplaceLayerNorm, DropoutAddLayerNorm, InplaceRMSNorm) to avoid it")


def plan_for_forward(holder: Optional[nn.Module], x: Tensor, weight: Optional[Tensor], bias: Optional[Tensor],
                     out_dtype: torch.dtype, n: int, backend: str, name: str, weight_offset: float = 0.0) -> Tensor:
    """The kept columns (int64 [K]) a Tempo LayerNorm (or RMSNorm: β None, γ = weight + ``weight_offset``)
    forward hands its op.

    Eager: made now from γ/β (``layernorm_plan``: cached per parameter version on the CUDA path),
    and stored as the plan ``holder`` (the module, or None) holds. Under torch.compile the module's
    held plan, which the graph takes as an input (a change of K recompiles): no value of γ/β is read
    in the graph. The op checks it against the current γ/β when it runs (``plan_in_forward``)."""
    if weight is None and bias is None:
        return x.new_empty((0,), dtype=torch.int64)
    if torch.compiler.is_compiling():
        held = holder.tempo_kept_columns.get(out_dtype) if holder is not None else None
        if held is not None and held.device == x.device:
            return held
        _log_plan_in_graph_once(name, holder is not None)
        return torch.ops.tempo.layernorm_plan(weight, bias, out_dtype, n, backend, name, weight_offset)
    kept = torch.ops.tempo.layernorm_plan(weight, bias, out_dtype, n, backend, name, weight_offset)
    if holder is not None and type(kept) is Tensor:  # not a fake session's stand-in
        holder.tempo_kept_columns[out_dtype] = kept
    return kept


def plan_in_forward(kept_cols: Tensor, weight: Optional[Tensor], bias: Optional[Tensor], out_dtype: torch.dtype,
                    n: int, device: torch.device, name: str, backend: str, weight_offset: float = 0.0) -> Tensor:
    """Inside a forward op: the columns to keep, as a fresh tensor (an output of the op).

    ``kept_cols`` as it is when the caller made it for this very call (eager, ``call_with_plan``);
    else (a compiled graph handing a module's held plan) the current plan (``kept_columns``: no
    host read while γ/β are unchanged on the CUDA path), which must keep as many columns as
    ``kept_cols``, the shape the graph was traced with. A different count means γ/β were written
    where no refresh point saw it: a RuntimeError naming the layer and the fix, never a wrong plan."""
    if weight is None and bias is None:
        return kept_cols.clone()
    if getattr(_handed_over, "plan", None) is kept_cols:
        return kept_cols.clone()
    current = kept_columns(weight, bias, out_dtype, n, device, name, backend, weight_offset)
    if current.numel() != kept_cols.numel():
        raise RuntimeError(
            f"{name}: this forward was handed a kept-column plan of {kept_cols.numel()} column(s) but γ/β now "
            f"need {current.numel()} for a {out_dtype} output: they were written where no refresh point saw "
            f"it (an in-place write under torch.no_grad() or through .data, not an optimizer step, "
            f"load_state_dict or .to()). A compiled graph cannot change that shape itself: call "
            f"tempo.refresh_kept_column_plans(model) after such writes, before the next forward")
    return current


def check_parameter_devices(x: Tensor, weight: Optional[Tensor], bias: Optional[Tensor], where: str) -> None:
    """A ValueError naming the layer when γ or β is not on the input's device (a kernel would read
    another device's memory: an illegal memory access on CUDA, not an error)."""
    for arg, sign, param in (("weight", "γ", weight), ("bias", "β", bias)):
        if param is not None and param.device != x.device:
            raise ValueError(f"{where}: {arg} ({sign}) is on {param.device} but the input is on {x.device}; "
                             f"move the layer to the input's device")


def column_slots(kept_cols: Tensor, n: int) -> Tensor:
    """int32 [n]: −1 for a recovered column, else its slot in the kept [rows, K] block (kernels)."""
    slots = torch.full((n,), -1, dtype=torch.int32, device=kept_cols.device)
    slots[kept_cols] = torch.arange(kept_cols.numel(), dtype=torch.int32, device=kept_cols.device)
    return slots


def recovery_inverse(weight: Tensor, kept_cols: Tensor) -> Tensor:
    """1/γ in fp32 (fp64 for fp64 γ) for recovered columns, 0 for kept ones (never divides by a
    γ the rule refused, so no inf or NaN can appear)."""
    w = weight.detach().to(torch.float64 if weight.dtype == torch.float64 else torch.float32)
    inv = w.reciprocal()
    inv[kept_cols] = 0.0
    return inv


# ----------------------------------------------------------------------------------------------
# Triton kernels
# ----------------------------------------------------------------------------------------------
if triton is not None:

    @triton.jit
    def _layernorm_fwd_kernel(
        X, Y, W, B, RSTD, MEAN,
        x_row_stride, y_row_stride, N, eps,
        HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_KEPT: tl.constexpr, BLOCK_N: tl.constexpr,
    ):
        # One program per row; statistics in fp32 whatever the input dtype.
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK_N)
        in_row = cols < N
        x = tl.load(X + row * x_row_stride + cols, mask=in_row, other=0.0).to(tl.float32)
        mean = tl.sum(x, axis=0) / N
        centered = tl.where(in_row, x - mean, 0.0)
        var = tl.sum(centered * centered, axis=0) / N
        rstd = tl.math.rsqrt(var + eps)
        y = centered * rstd
        if HAS_KEPT:
            # The row mean, from which the host gathers the kept columns' x̂ = (x − mean)·rstd with
            # this kernel's arithmetic (a scatter of them from here spills registers at 16384
            # features: a 64-bit address per element).
            tl.store(MEAN + row, mean)
        if HAS_WEIGHT:
            y = y * tl.load(W + cols, mask=in_row, other=0.0).to(tl.float32)
        if HAS_BIAS:
            y = y + tl.load(B + cols, mask=in_row, other=0.0).to(tl.float32)
        tl.store(Y + row * y_row_stride + cols, y.to(Y.dtype.element_ty), mask=in_row)
        tl.store(RSTD + row, rstd)

    @triton.jit
    def _recover(y, live, cols, row, W, B, INV_W, SLOTS, KEPT, K,
                 HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_KEPT: tl.constexpr):
        # -> (x̂, γ·x̂) of one row chunk: γ·x̂ = y − β and x̂ = (y − β)/γ for recovered columns,
        # the kept x̂ (and γ times it) for the others. Dead columns give 0.
        scaled_xhat = y
        if HAS_BIAS:
            scaled_xhat = tl.where(live, y - tl.load(B + cols, mask=live, other=0.0).to(tl.float32), 0.0)
        if HAS_WEIGHT:
            xhat = scaled_xhat * tl.load(INV_W + cols, mask=live, other=0.0)
        else:
            xhat = scaled_xhat
        if HAS_KEPT:
            slot = tl.load(SLOTS + cols, mask=live, other=-1)
            is_kept = slot >= 0
            kept = tl.load(KEPT + row * K + slot, mask=is_kept, other=0.0)
            xhat = tl.where(is_kept, kept, xhat)
            if HAS_WEIGHT:
                scaled_xhat = tl.where(is_kept, kept * tl.load(W + cols, mask=live, other=0.0).to(tl.float32),
                                       scaled_xhat)
            else:
                scaled_xhat = tl.where(is_kept, kept, scaled_xhat)
        return xhat, scaled_xhat

    @triton.jit
    def _layernorm_bwd_kernel(
        DY, Y, W, B, INV_W, RSTD, SLOTS, KEPT, K, DX, DW_PARTIAL, DB_PARTIAL,
        dy_row_stride, y_row_stride, dx_row_stride, M, N, rows_per_program,
        HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_KEPT: tl.constexpr, BLOCK_N: tl.constexpr,
    ):
        # Rows of up to BWD_BLOCK_MAX features: a row fits in registers. Each program walks a
        # contiguous run of rows, writes their dx, and accumulates its own partial dγ/dβ in fp32
        # registers; the host sums the partials (no atomics: deterministic). Apart on purpose from
        # the wide pair below (a whole row in registers, not a chunk) and from RMSNorm's kernels
        # (rmsnorm.py: no mean term, no β, one row sum).
        pid = tl.program_id(0)
        cols = tl.arange(0, BLOCK_N)
        in_row = cols < N
        if HAS_WEIGHT:
            w = tl.load(W + cols, mask=in_row, other=0.0).to(tl.float32)
        dw_acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        db_acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        first_row = pid.to(tl.int64) * rows_per_program
        for i in range(0, rows_per_program):
            row = first_row + i
            # The last program's run may overhang M: such a row has no live columns. (A tensor
            # mask built from `in_row & (row < M)` is rejected by the interpreter.)
            live = cols < tl.where(row < M, N, 0)
            dy = tl.load(DY + row * dy_row_stride + cols, mask=live, other=0.0).to(tl.float32)
            y = tl.load(Y + row * y_row_stride + cols, mask=live, other=0.0).to(tl.float32)
            # Clamped index instead of a scalar mask; an overhanging row stores nothing anyway.
            rstd = tl.load(RSTD + tl.minimum(row, M - 1))
            xhat, scaled_xhat = _recover(y, live, cols, row, W, B, INV_W, SLOTS, KEPT, K,
                                         HAS_WEIGHT, HAS_BIAS, HAS_KEPT)
            if HAS_WEIGHT:
                dy_w = dy * w
            else:
                dy_w = dy
            mean_dy_w = tl.sum(dy_w, axis=0) / N
            mean_dy_scaled = tl.sum(dy * scaled_xhat, axis=0) / N
            dx = rstd * (dy_w - mean_dy_w - xhat * mean_dy_scaled)
            tl.store(DX + row * dx_row_stride + cols, dx.to(DX.dtype.element_ty), mask=live)
            dw_acc += dy * xhat
            db_acc += dy
        if HAS_WEIGHT:
            tl.store(DW_PARTIAL + pid * N + cols, dw_acc, mask=in_row)
        if HAS_BIAS:
            tl.store(DB_PARTIAL + pid * N + cols, db_acc, mask=in_row)

    @triton.jit
    def _layernorm_bwd_row_sums_kernel(
        DY, Y, W, B, INV_W, SLOTS, KEPT, K, SUMS, dy_row_stride, y_row_stride, N,
        HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_KEPT: tl.constexpr, CHUNK: tl.constexpr,
    ):
        # Wide rows, step 1: per row Σ g·γ and Σ g·γ·x̂, the two reductions dx needs, walking the
        # row in chunks so nothing row-sized sits in registers. (Scalar sums per chunk:
        # chunk-wide fp32 accumulators crash triton 3.9's sm_90 compiler for 16-bit inputs
        # without affine, found by compile_check.)
        row = tl.program_id(0).to(tl.int64)
        sum_dy_w = 0.0
        sum_dy_scaled = 0.0
        for start in range(0, N, CHUNK):
            cols = start + tl.arange(0, CHUNK)
            live = cols < N
            dy = tl.load(DY + row * dy_row_stride + cols, mask=live, other=0.0).to(tl.float32)
            y = tl.load(Y + row * y_row_stride + cols, mask=live, other=0.0).to(tl.float32)
            _xhat, scaled_xhat = _recover(y, live, cols, row, W, B, INV_W, SLOTS, KEPT, K,
                                          HAS_WEIGHT, HAS_BIAS, HAS_KEPT)
            dy_w = dy
            if HAS_WEIGHT:
                dy_w = dy * tl.load(W + cols, mask=live, other=0.0).to(tl.float32)
            sum_dy_w += tl.sum(dy_w, axis=0)
            sum_dy_scaled += tl.sum(dy * scaled_xhat, axis=0)
        tl.store(SUMS + row * 2, sum_dy_w)
        tl.store(SUMS + row * 2 + 1, sum_dy_scaled)

    @triton.jit
    def _layernorm_bwd_wide_kernel(
        DY, Y, W, B, INV_W, RSTD, SLOTS, KEPT, K, SUMS, DX, DW_PARTIAL, DB_PARTIAL,
        dy_row_stride, y_row_stride, dx_row_stride, M, N, rows_per_program,
        HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_KEPT: tl.constexpr, CHUNK: tl.constexpr,
    ):
        # Wide rows, step 2: program (p, c) owns columns [c·CHUNK, (c+1)·CHUNK) of a run of rows:
        # dx for them from the row sums of step 1, and that chunk of its partial dγ/dβ, kept in
        # registers only CHUNK wide (a whole 16384-wide row of accumulators spills).
        pid = tl.program_id(0)
        cols = tl.program_id(1) * CHUNK + tl.arange(0, CHUNK)
        in_row = cols < N
        if HAS_WEIGHT:
            w = tl.load(W + cols, mask=in_row, other=0.0).to(tl.float32)
        dw_acc = tl.zeros([CHUNK], dtype=tl.float32)
        db_acc = tl.zeros([CHUNK], dtype=tl.float32)
        first_row = pid.to(tl.int64) * rows_per_program
        for i in range(0, rows_per_program):
            row = first_row + i
            live = cols < tl.where(row < M, N, 0)
            dy = tl.load(DY + row * dy_row_stride + cols, mask=live, other=0.0).to(tl.float32)
            y = tl.load(Y + row * y_row_stride + cols, mask=live, other=0.0).to(tl.float32)
            safe_row = tl.minimum(row, M - 1)
            rstd = tl.load(RSTD + safe_row)
            mean_dy_w = tl.load(SUMS + safe_row * 2) / N
            mean_dy_scaled = tl.load(SUMS + safe_row * 2 + 1) / N
            xhat, _scaled = _recover(y, live, cols, row, W, B, INV_W, SLOTS, KEPT, K,
                                     HAS_WEIGHT, HAS_BIAS, HAS_KEPT)
            if HAS_WEIGHT:
                dy_w = dy * w
            else:
                dy_w = dy
            dx = rstd * (dy_w - mean_dy_w - xhat * mean_dy_scaled)
            tl.store(DX + row * dx_row_stride + cols, dx.to(DX.dtype.element_ty), mask=live)
            dw_acc += dy * xhat
            db_acc += dy
        if HAS_WEIGHT:
            tl.store(DW_PARTIAL + pid * N + cols, dw_acc, mask=in_row)
        if HAS_BIAS:
            tl.store(DB_PARTIAL + pid * N + cols, db_acc, mask=in_row)


# ----------------------------------------------------------------------------------------------
# Host launchers (x, y, grad_y are [..., N] contiguous: rows of N with row stride N)
# ----------------------------------------------------------------------------------------------
# The one-block backward keeps ~7 row-sized fp32 arrays in registers: at 8192 features that
# spills (measured with `python -m tempo.ops.compile_check`), so wider rows take the two-kernel
# path, CHUNK columns at a time.
BWD_BLOCK_MAX = 4096
_WIDE_CHUNK = 4096
_WIDE_WARPS = 8


def _num_warps(block_n: int) -> int:
    # 16 warps from 4096 features: with 8, triton 3.6 spills registers in the 4096-wide backward
    # (fp32 in, bf16 out) on sm_80 (the compile gate found it).
    if block_n >= 4096:
        return 16
    if block_n >= 2048:
        return 8
    return 4


def _rstd_dtype(x_dtype: torch.dtype) -> torch.dtype:
    # fp32 statistics, except fp64 inputs (reference path only), which keep full precision.
    return torch.float64 if x_dtype == torch.float64 else torch.float32


def _kept_args(kept_cols: Tensor, kept_xhat: Tensor, n: int, dummy: Tensor) -> tuple[Tensor, Tensor, int]:
    """(slots, kept block, K) as the kernels take them; dummies when nothing is kept."""
    k = kept_cols.numel()
    if k == 0:
        return dummy, dummy, 1
    return column_slots(kept_cols, n), kept_xhat, k


def _layernorm_fwd_triton(x: Tensor, n: int, weight: Optional[Tensor], bias: Optional[Tensor], eps: float,
                          out_dtype: torch.dtype, kept_cols: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    rows = x.numel() // n
    # y has x's shape (not a 2-D buffer viewed back): the kernel just writes rows of n.
    y = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    rstd = torch.empty((rows,), dtype=torch.float32, device=x.device)
    has_kept = kept_cols.numel() > 0
    block_n = triton.next_power_of_2(n)
    dummy = rstd  # stands in for absent weight/bias/mean pointers; never touched (constexpr flags)
    mean = torch.empty((rows,), dtype=torch.float32, device=x.device) if has_kept else dummy
    with launch_on(x):
        _layernorm_fwd_kernel[(rows,)](
            x, y, weight if weight is not None else dummy, bias if bias is not None else dummy, rstd, mean,
            n, n, n, eps,
            HAS_WEIGHT=weight is not None, HAS_BIAS=bias is not None, HAS_KEPT=has_kept,
            BLOCK_N=block_n, num_warps=_num_warps(block_n),
        )
    if not has_kept:
        return y, rstd, torch.empty((rows, 0), dtype=torch.float32, device=x.device)
    # x̂ of the columns whose recovery from y would be ill-conditioned: the kernel's fp32
    # (x − mean)·rstd, elementwise the same operations in the same order.
    kept_xhat = (x.reshape(rows, n)[:, kept_cols].float() - mean[:, None]) * rstd[:, None]
    return y, rstd, kept_xhat


def _backward_plan(rows: int, n: int, sms: Optional[int]) -> tuple[bool, int, int, int]:
    """(wide, programs, rows_per_program, column chunks) of the backward for ``sms`` SMs.

    Several programs per SM, not one: one program per SM looping over rows/SMs rows left the
    GPU latency-bound, since a single resident program cannot hide its load latency. Narrow rows
    get up to 8 programs per SM (4 warps each); wider rows hold more registers per program, so
    fewer fit (4096 features: 2). Wide rows run CHUNK-column programs, ~8 per SM counting the
    chunks. Each program still takes several rows at real sizes, so the partial dγ/dβ
    (programs × N fp32 each, summed after) stay small next to dx. ``sms`` None: the
    interpreter, which runs programs one after another, gets at most 4.
    """
    block_n = triton.next_power_of_2(n)
    wide = block_n > BWD_BLOCK_MAX
    chunks = triton.cdiv(n, _WIDE_CHUNK) if wide else 1
    if sms is None:
        programs = min(rows, 4)
    else:
        per_sm = max(1, 8 // chunks) if wide else max(2, min(8, 8192 // block_n))
        programs = min(rows, per_sm * sms)
    programs = max(1, programs)
    rows_per_program = triton.cdiv(rows, programs)
    programs = triton.cdiv(rows, rows_per_program)  # no program left without rows
    return wide, programs, rows_per_program, chunks


def _device_backward_plan(t: Tensor, rows: int, n: int) -> tuple[bool, int, int, int]:
    """``_backward_plan`` for the SMs of ``t``'s device (off CUDA: the interpreter's)."""
    sms = torch.cuda.get_device_properties(t.device).multi_processor_count if t.is_cuda else None
    return _backward_plan(rows, n, sms)


def _partials(param: Optional[Tensor], programs: int, n: int, like: Tensor) -> Optional[Tensor]:
    """The fp32 [programs, n] partial gradients of ``param`` the backward kernels write; None without it."""
    return torch.empty((programs, n), dtype=torch.float32, device=like.device) if param is not None else None


def _summed_grad(partials: Optional[Tensor], param: Optional[Tensor], like: Tensor) -> Tensor:
    """The gradient of ``param`` (its shape and dtype) from its partials; ``_no_param_grad`` without it."""
    # torch's sum over dim 0 is deterministic (no atomics), so the gradient is bit-reproducible.
    return partials.sum(0).view(param.shape).to(param.dtype) if param is not None else _no_param_grad(like)


def _layernorm_bwd_triton(grad_y: Tensor, y: Tensor, rstd: Tensor, kept_cols: Tensor, kept_xhat: Tensor,
                          weight: Optional[Tensor], bias: Optional[Tensor],
                          x_dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor]:
    rows = rstd.numel()
    n = y.numel() // rows
    dx = torch.empty(y.shape, dtype=x_dtype, device=y.device)
    block_n = triton.next_power_of_2(n)
    wide, programs, rows_per_program, chunks = _device_backward_plan(y, rows, n)
    dw_partial, db_partial = _partials(weight, programs, n, y), _partials(bias, programs, n, y)
    dummy = rstd
    inv_w = recovery_inverse(weight, kept_cols) if weight is not None else dummy
    slots, kept_arg, k = _kept_args(kept_cols, kept_xhat, n, dummy)
    w_arg, b_arg = (weight if weight is not None else dummy), (bias if bias is not None else dummy)
    flags = dict(HAS_WEIGHT=weight is not None, HAS_BIAS=bias is not None, HAS_KEPT=kept_cols.numel() > 0)
    tail = (dw_partial if dw_partial is not None else dummy, db_partial if db_partial is not None else dummy,
            n, n, n, rows, n, rows_per_program)
    with launch_on(y):
        if not wide:
            _layernorm_bwd_kernel[(programs,)](
                grad_y, y, w_arg, b_arg, inv_w, rstd, slots, kept_arg, k, dx, *tail,
                **flags, BLOCK_N=block_n, num_warps=_num_warps(block_n),
            )
        else:
            sums = torch.empty((rows, 2), dtype=torch.float32, device=y.device)
            _layernorm_bwd_row_sums_kernel[(rows,)](
                grad_y, y, w_arg, b_arg, inv_w, slots, kept_arg, k, sums, n, n, n,
                **flags, CHUNK=_WIDE_CHUNK, num_warps=_WIDE_WARPS,
            )
            _layernorm_bwd_wide_kernel[(programs, chunks)](
                grad_y, y, w_arg, b_arg, inv_w, rstd, slots, kept_arg, k, sums, dx, *tail,
                **flags, CHUNK=_WIDE_CHUNK, num_warps=_WIDE_WARPS,
            )
    return dx, _summed_grad(dw_partial, weight, y), _summed_grad(db_partial, bias, y)


# ----------------------------------------------------------------------------------------------
# Reference implementation (any device, any float dtype; same saved tensors as the kernels).
# Written for speed on the CPU: aten's fused LayerNorm forward and backward, plus an index per
# kept column.
# ----------------------------------------------------------------------------------------------
def _no_param_grad(like: Tensor) -> Tensor:
    # Custom ops cannot return None: an absent weight/bias gets an empty fp32 gradient.
    return torch.empty((0,), dtype=torch.float32, device=like.device)


def normalize_rows_reference(s: Tensor, normalized_shape: Sequence[int], weight: Optional[Tensor],
                             bias: Optional[Tensor], eps: float, out_dtype: torch.dtype,
                             kept_cols: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """LayerNorm of ``s`` (already in the compute dtype) over its trailing ``normalized_shape``
    -> (y in s's shape and out_dtype (a fresh tensor, not a view), rstd [rows], x̂ of the kept
    columns [rows, K]). weight/bias flattened to [n]. Shared with DropoutAddLayerNorm."""
    shape = list(normalized_shape)
    y, mean, rstd = torch.native_layer_norm(
        s, shape,
        weight.to(s.dtype).view(shape) if weight is not None else None,
        bias.to(s.dtype).view(shape) if bias is not None else None,
        eps,
    )
    n = math.prod(shape)
    rows = s.numel() // n if n else 0
    if kept_cols.numel():
        kept_xhat = (s.reshape(rows, n).index_select(1, kept_cols) - mean.reshape(rows, 1)) * rstd.reshape(rows, 1)
    else:
        kept_xhat = s.new_empty((rows, 0))
    return y.to(out_dtype), rstd.reshape(-1), kept_xhat


def recover_xhat(y2d: Tensor, kept_cols: Tensor, kept_xhat: Tensor, weight: Optional[Tensor],
                 bias: Optional[Tensor], compute: torch.dtype) -> Tensor:
    """x̂ [rows, n] in ``compute``: (y − β)/γ for recovered columns (error (R)), the kept x̂ for
    the others. Always a fresh tensor (y is never written)."""
    xhat = y2d.to(compute, copy=True)
    if bias is not None:
        xhat -= bias.to(compute)
    if weight is not None:
        xhat *= recovery_inverse(weight, kept_cols).to(compute)
    if kept_cols.numel():
        xhat.index_copy_(1, kept_cols, kept_xhat.to(compute))
    return xhat


def normalize_rows_backward_reference(g2d: Tensor, y2d: Tensor, rstd: Tensor, kept_cols: Tensor,
                                      kept_xhat: Tensor, weight: Optional[Tensor], bias: Optional[Tensor],
                                      ) -> tuple[Tensor, Optional[Tensor], Optional[Tensor]]:
    """(d(input) [rows, n] in the compute dtype, dγ or None, dβ or None) from y and the kept x̂.

    aten's fused LayerNorm backward run on the recovered x̂ with mean 0 and rstd 1, then scaled
    by the true rstd: it computes rstd·(g·γ − mean(g·γ) − x̂·mean(g·γ·x̂)), the formula of the
    module docstring, with γ·x̂ from the recovered x̂ (one rounding away from y − β). Shared with
    DropoutAddLayerNorm."""
    compute = rstd.dtype
    rows, n = g2d.shape
    g = g2d.to(compute)
    xhat = recover_xhat(y2d, kept_cols, kept_xhat, weight, bias, compute)
    unit = g.new_ones((rows, 1))
    w = weight.to(compute) if weight is not None else None
    dsum, dw, db = torch.ops.aten.native_layer_norm_backward(
        g, xhat, [n], unit.new_zeros((rows, 1)), unit, w, None, [True, w is not None, False])
    del xhat
    db = g.sum(0) if bias is not None else None
    return dsum.mul_(rstd.unsqueeze(-1)), dw, db


def _layernorm_fwd_reference(x: Tensor, ndim: int, weight: Optional[Tensor], bias: Optional[Tensor], eps: float,
                             out_dtype: torch.dtype, kept_cols: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    return normalize_rows_reference(x.to(_rstd_dtype(x.dtype)), x.shape[x.dim() - ndim:], weight, bias, eps,
                                    out_dtype, kept_cols)


def _layernorm_bwd_reference(grad_y: Tensor, y: Tensor, rstd: Tensor, kept_cols: Tensor, kept_xhat: Tensor,
                             n: int, weight: Optional[Tensor], bias: Optional[Tensor],
                             x_dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor]:
    dx, dw, db = normalize_rows_backward_reference(grad_y.reshape(-1, n), y.reshape(-1, n), rstd, kept_cols,
                                                   kept_xhat, weight, bias)
    dw = dw.to(weight.dtype) if weight is not None else _no_param_grad(y)
    db = db.to(bias.dtype) if bias is not None else _no_param_grad(y)
    return dx.view(y.shape).to(x_dtype), dw, db


# ----------------------------------------------------------------------------------------------
# Custom ops (torch.compile traces them as single nodes; autograd saves y, rstd and the kept x̂)
# ----------------------------------------------------------------------------------------------
def _check_op_backend(backend: str, n: int, dtype: torch.dtype, op: str) -> None:
    if backend not in ("triton", "reference"):
        raise ValueError(f"{op}: argument 'backend' must be 'triton' or 'reference', got {backend!r}")
    if backend == "triton" and n > MAX_TRITON_N:
        raise ValueError(f"{op}: the Triton kernels take rows of at most {MAX_TRITON_N} features, got {n}")
    if backend == "triton" and dtype not in TRITON_DTYPES:
        raise TypeError(f"{op}: the Triton kernels support float32, float16 and bfloat16, got {dtype}")


def _trailing_numel(t: Tensor, ndim: int) -> int:
    return math.prod(t.shape[t.dim() - ndim:])


def kept_fake(rows: int, kept_cols: Tensor, like: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """Fake (kept_cols [K], kept_xhat [rows, K]) of a forward handed the plan ``kept_cols``: K is its
    length, known before the call (torch.compile traces no data-dependent shape)."""
    k = kept_cols.shape[0]
    return kept_cols.new_empty((k,)), like.new_empty((rows, k), dtype=dtype)


@torch.library.custom_op("tempo::layernorm_fwd", mutates_args=())
def layernorm_fwd(x: Tensor, normalized_ndim: int, weight: Optional[Tensor], bias: Optional[Tensor],
                  kept_cols: Tensor, eps: float, out_dtype: torch.dtype, backend: str,
                  name: str) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """x: contiguous, normalized over its last ``normalized_ndim`` dims (N features); weight and bias
    flattened to [N]; ``kept_cols`` int64 [K] the plan (``plan_for_forward``) -> (y in x's shape and
    out_dtype, rstd [rows] fp32 (fp64 for fp64 x), the kept columns used, int64 [K] (those of the
    current γ/β: ``plan_in_forward``), kept_xhat [rows, K] in rstd's dtype).

    ``backend`` ("triton" or "reference") is resolved by the caller, so the backward can be told
    the same one; ``name`` names the layer in errors."""
    n = _trailing_numel(x, normalized_ndim)
    _check_op_backend(backend, n, x.dtype, "tempo::layernorm_fwd")
    kept_cols = plan_in_forward(kept_cols, weight, bias, out_dtype, n, x.device, name, backend)
    if backend == "triton" and x.numel() > 0:  # empty: no kernel to launch
        y, rstd, kept_xhat = _layernorm_fwd_triton(x, n, weight, bias, eps, out_dtype, kept_cols)
    else:
        y, rstd, kept_xhat = _layernorm_fwd_reference(x, normalized_ndim, weight, bias, eps, out_dtype, kept_cols)
    return y, rstd, kept_cols, kept_xhat


@layernorm_fwd.register_fake
def _(x, normalized_ndim, weight, bias, kept_cols, eps, out_dtype, backend, name):
    rows = math.prod(x.shape[: x.dim() - normalized_ndim])
    compute = _rstd_dtype(x.dtype)
    return (x.new_empty(x.shape, dtype=out_dtype), x.new_empty((rows,), dtype=compute),
            *kept_fake(rows, kept_cols, x, compute))


@torch.library.custom_op("tempo::layernorm_bwd", mutates_args=())
def layernorm_bwd(grad_y: Tensor, y: Tensor, rstd: Tensor, kept_cols: Tensor, kept_xhat: Tensor,
                  normalized_ndim: int, weight: Optional[Tensor], bias: Optional[Tensor], x_dtype: torch.dtype,
                  backend: str) -> tuple[Tensor, Tensor, Tensor]:
    """-> (dx in x_dtype and y's shape, dγ in γ's dtype, dβ in β's dtype); an absent γ/β gets an
    empty tensor. ``backend`` is the one the forward ran (recorded in the autograd ctx)."""
    n = _trailing_numel(y, normalized_ndim)
    _check_op_backend(backend, n, y.dtype, "tempo::layernorm_bwd")
    if backend == "triton" and y.numel() > 0:
        return _layernorm_bwd_triton(grad_y, y, rstd, kept_cols, kept_xhat, weight, bias, x_dtype)
    return _layernorm_bwd_reference(grad_y, y, rstd, kept_cols, kept_xhat, n, weight, bias, x_dtype)


@layernorm_bwd.register_fake
def _(grad_y, y, rstd, kept_cols, kept_xhat, normalized_ndim, weight, bias, x_dtype, backend):
    def param_grad(p):
        return p.new_empty(p.shape) if p is not None else y.new_empty((0,), dtype=torch.float32)

    return y.new_empty(y.shape, dtype=x_dtype), param_grad(weight), param_grad(bias)


def _fwd_setup_context(ctx, inputs, output):
    x, normalized_ndim, weight, bias, _plan, _eps, _out_dtype, backend, _name = inputs
    y, rstd, kept_cols, kept_xhat = output
    # The output, not the input: y is the tensor the next layer keeps anyway; x̂ only of the
    # columns where y cannot give it back.
    ctx.save_for_backward(y, rstd, kept_cols, kept_xhat, weight, bias)
    ctx.x_dtype = x.dtype
    ctx.normalized_ndim = normalized_ndim
    # The backend the forward ran, not whatever use_backend() says when backward runs: on CUDA
    # that is autograd's device thread, where the forward thread's use_backend() is not active.
    ctx.backend = backend
    ctx.mark_non_differentiable(rstd, kept_cols, kept_xhat)


def _fwd_backward(ctx, grad_y, _grad_rstd, _grad_cols, _grad_kept):
    y, rstd, kept_cols, kept_xhat, weight, bias = ctx.saved_tensors
    dx, dw, db = torch.ops.tempo.layernorm_bwd(grad_y.contiguous(), y, rstd, kept_cols, kept_xhat,
                                               ctx.normalized_ndim, weight, bias, ctx.x_dtype, ctx.backend)
    return (dx, None, dw if weight is not None else None, db if bias is not None else None,
            None, None, None, None, None)


layernorm_fwd.register_autograd(_fwd_backward, setup_context=_fwd_setup_context)


def resolve_layernorm_backend(x: Tensor, n: int) -> str:
    """'triton' or 'reference' for rows of ``n`` features (raises as resolve_backend does).

    Rows wider than MAX_TRITON_N run on the reference path, which keeps exactly the same tensors
    for backward; that fallback is logged once.
    """
    backend = resolve_backend(x, OP_NAME)
    if backend == "triton" and n > MAX_TRITON_N:
        log_fallback_once(f"{OP_NAME}:wide", f"{OP_NAME}: rows of more than {MAX_TRITON_N} features (got {n}) "
                          "run on the PyTorch reference path; the Triton forward holds one row per block")
        return "reference"
    return backend


# ----------------------------------------------------------------------------------------------
# Functional API and module
# ----------------------------------------------------------------------------------------------
_ShapeLike = Union[int, Sequence[int], torch.Size]


def _as_shape(normalized_shape: _ShapeLike, op: str = OP_NAME) -> tuple[int, ...]:
    if isinstance(normalized_shape, numbers.Integral) and not isinstance(normalized_shape, bool):
        return (int(normalized_shape),)
    try:
        shape = tuple(normalized_shape)
    except TypeError:
        shape = None
    if shape is None or not all(isinstance(s, numbers.Integral) and not isinstance(s, bool) for s in shape):
        raise TypeError(f"{op}: argument 'normalized_shape' must be an int or a sequence of ints, "
                        f"got {normalized_shape!r}")
    return tuple(int(s) for s in shape)


def _output_dtype(x: Tensor, out_dtype: Optional[torch.dtype]) -> torch.dtype:
    if out_dtype is not None:
        return out_dtype
    autocast_dtype = autocast_dtype_for(x)
    if autocast_dtype is not None and x.dtype in _AUTOCAST_ELIGIBLE:
        return autocast_dtype
    return x.dtype


def inplace_layernorm(x: Tensor, normalized_shape: _ShapeLike, weight: Optional[Tensor] = None,
                      bias: Optional[Tensor] = None, eps: float = 1e-5,
                      out_dtype: Optional[torch.dtype] = None, name: Optional[str] = None) -> Tensor:
    """LayerNorm over the last ``len(normalized_shape)`` dims whose backward keeps y, rstd and x̂ of
    the columns y cannot give back (the module docstring's rule).

    Under torch.compile this functional form makes its plan from γ/β's values inside the graph (a
    data-dependent shape: torch.compile may break the graph there, logged once); the modules
    (``InplaceLayerNorm``) hand the plan they hold instead and trace without a break.

    ``out_dtype`` None means: the autocast dtype when autocast is enabled on x's device (and x is
    fp32/fp16/bf16), else x's dtype. Statistics are always computed in fp32 (fp64 for fp64 x).
    A non-contiguous x is copied to a contiguous one first (the copy is not kept for backward).
    ``name`` names the layer in errors (non-finite γ/β). Without a backward (see the module
    docstring) it runs ``F.layer_norm`` and keeps nothing.
    """
    return _inplace_layernorm(x, normalized_shape, weight, bias, eps, out_dtype, name, holder=None)


def _inplace_layernorm(x: Tensor, normalized_shape: _ShapeLike, weight: Optional[Tensor], bias: Optional[Tensor],
                       eps: float, out_dtype: Optional[torch.dtype], name: Optional[str],
                       holder: Optional[nn.Module]) -> Tensor:
    """``inplace_layernorm``; ``holder``: the module whose held plan a compiled forward hands the op."""
    check_float_tensor(x, "input", OP_NAME)
    shape = _as_shape(normalized_shape)
    if len(shape) == 0 or x.dim() < len(shape) or tuple(x.shape[x.dim() - len(shape):]) != shape:
        raise ValueError(
            f"{OP_NAME}: argument 'normalized_shape' {shape} must match the trailing dimensions of "
            f"the input, got input of shape {tuple(x.shape)}"
        )
    for arg, param in (("weight", weight), ("bias", bias)):
        if param is not None:
            check_float_tensor(param, arg, OP_NAME)
            if tuple(param.shape) != shape:
                raise ValueError(f"{OP_NAME}: argument '{arg}' of shape {tuple(param.shape)} must have "
                                 f"the normalized_shape {shape}")
    check_parameter_devices(x, weight, bias, name or OP_NAME)
    if out_dtype is not None and not out_dtype.is_floating_point:
        raise TypeError(f"{OP_NAME}: argument 'out_dtype' must be a floating-point dtype, got {out_dtype}")
    dtype = _output_dtype(x, out_dtype)
    n = math.prod(shape)
    training = holder is not None and holder.training
    # In training mode the Triton path runs without a backward too (runs_own_forward); the
    # reference forward gives aten's bits, so the stock op stands for it.
    own = training and resolve_layernorm_backend(x, n) == "triton"
    if not runs_own_forward(own, x, weight, bias):
        # Nothing will be kept: aten's fused LayerNorm (fp32 under autocast, like nn.LayerNorm),
        # returned in the dtype the Tempo path returns so the model behaves the same either way.
        with torch.autocast(x.device.type, enabled=False):
            compute = _rstd_dtype(x.dtype)
            y = F.layer_norm(x.to(compute), shape, weight.to(compute) if weight is not None else None,
                             bias.to(compute) if bias is not None else None, eps)
        return y.to(dtype)
    # The parameters themselves when 1-D (the usual case; the plan cache knows them by identity),
    # else views of them: contiguous parameters are never copied.
    weight, bias = _flat_param(weight, n), _flat_param(bias, n)
    backend = resolve_layernorm_backend(x, n)
    name = name or OP_NAME
    kept_cols = plan_for_forward(holder, x, weight, bias, dtype, n, backend, name)
    y, _rstd, _cols, _kept = call_with_plan(torch.ops.tempo.layernorm_fwd, kept_cols, x.contiguous(), len(shape),
                                            weight, bias, kept_cols, float(eps), dtype, backend, name)
    return y


def _flat_param(param: Optional[Tensor], n: int) -> Optional[Tensor]:
    if param is None:
        return None
    if param.dim() == 1 and param.is_contiguous():
        return param
    return param.reshape(n).contiguous()


class LayerNormParameters(KeptColumnPlans):
    """What every Tempo LayerNorm module shares with ``nn.LayerNorm``: the constructor, the
    ``weight``/``bias`` parameters (same state_dict keys, so state dicts load in both directions),
    their initialisation and the repr; and, as every ``KeptColumnPlans``, the kept-column plans of
    its γ/β it holds for a compiled forward (``tempo_kept_columns``)."""

    __constants__ = ["normalized_shape", "eps", "elementwise_affine"]
    normalized_shape: tuple[int, ...]
    eps: float
    elementwise_affine: bool

    def __init__(self, normalized_shape: _ShapeLike, eps: float = 1e-5, elementwise_affine: bool = True,
                 bias: bool = True, device=None, dtype=None, op: str = OP_NAME) -> None:
        super().__init__()
        factory_kwargs = {"device": device, "dtype": dtype}
        self.normalized_shape = _as_shape(normalized_shape, op)
        self.eps = eps
        self.elementwise_affine = elementwise_affine
        if elementwise_affine:
            self.weight = nn.Parameter(torch.empty(self.normalized_shape, **factory_kwargs))
            if bias:
                self.bias = nn.Parameter(torch.empty(self.normalized_shape, **factory_kwargs))
            else:
                self.register_parameter("bias", None)
        else:
            self.register_parameter("weight", None)
            self.register_parameter("bias", None)
        self.reset_parameters()
        self._hold_kept_column_plans()

    def kept_column_parameters(self) -> tuple[Optional[Tensor], Optional[Tensor], float]:
        return self.weight, self.bias, 0.0

    def reset_parameters(self) -> None:
        if self.elementwise_affine:
            nn.init.ones_(self.weight)
            if self.bias is not None:
                nn.init.zeros_(self.bias)

    def extra_repr(self) -> str:
        # Borrowed so the repr tracks the installed torch's nn.LayerNorm (2.13 added "bias=").
        return nn.LayerNorm.extra_repr(self)


class InplaceLayerNorm(LayerNormParameters):
    """Drop-in ``nn.LayerNorm`` whose backward keeps its output y, one fp32 rstd per row, and x̂
    of the (usually no) columns whose γ is too small against β to recover it.

    Same constructor, ``weight``/``bias`` parameters, state_dict keys and repr as
    ``nn.LayerNorm``; state dicts load in both directions.

    Precision: exact by construction for any γ and β (module docstring): a column's x̂ is either
    recovered from y within (u_D + 3u_c)·(|x̂| + 1), u_D the unit roundoff of y's dtype, or kept.
    Gradients match nn.LayerNorm's to the rounding of y in its dtype. Non-finite γ or β raise in
    the forward, naming the layer (``tempo_name``, set by ``name_layernorms``). Double backward is
    not supported.

    Dtypes: under ``torch.autocast`` (fp32/fp16/bf16 input) the output is in the autocast dtype,
    computed in fp32 internally, so the next autocast Linear keeps the very same storage; outside
    autocast the output has the input's dtype. (nn.LayerNorm returns fp32 under autocast, and the
    Linear then keeps its own bf16 copy as well.)

    Without a backward (``torch.no_grad()``, ``inference_mode()``, nothing requiring grad) it keeps
    nothing and runs ``F.layer_norm``, except in training mode on the Triton path, where it runs the
    Triton forward so that a no-grad pass gives the bits the pass with grad gives (module docstring).
    """

    def forward(self, input: Tensor) -> Tensor:
        return _inplace_layernorm(input, self.normalized_shape, self.weight, self.bias, self.eps, None,
                                  self.tempo_name or type(self).__name__, holder=self)


def name_layernorms(root: nn.Module) -> None:
    """Give every Tempo LayerNorm and RMSNorm (``KeptColumnPlans``) under ``root`` its qualified name
    (``encoder.layer.5.output.LayerNorm``), which its errors quote, and make the kept-column plans
    they hold those of their γ/β now (``apply_tempo`` calls it after the swaps, which gave the layers
    the model's own γ/β)."""
    modules = []
    for qualified, module in root.named_modules():
        if isinstance(module, KeptColumnPlans):
            module.tempo_name = qualified or type(module).__name__
            modules.append(module)
    _refresh_module_plans(modules)


__all__ = ["InplaceLayerNorm", "KeptColumnPlans", "LayerNormParameters", "cached_kept_columns",
           "forget_kept_column_plans", "inplace_layernorm", "kept_columns", "layernorm_fwd", "layernorm_bwd",
           "layernorm_plan", "name_layernorms", "plan_for_forward", "plan_kept_columns",
           "refresh_kept_column_plans", "unrecoverable_columns"]
