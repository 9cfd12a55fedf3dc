"""In-place RMSNorm: the backward pass reads the output y, never the input x.

    y = x·rstd·w_eff,   rstd = 1 / sqrt(mean(x²) + eps),   w_eff = w       (Llama, Qwen3, EuroBERT, T5, ...)
                                                          w_eff = 1 + w   (Gemma's form: ``unit_offset``)

RMSNorm's output holds the normalized input: x̂ = x·rstd = y / w_eff. So instead of the input the
op keeps y, which is the tensor it returns and which the next layer (a Linear, a residual add)
keeps or reads anyway, plus one fp32 rstd per row. With x̂ recovered,

    dw = Σ_rows g·x̂        dx = rstd·(g·w_eff − x̂·mean(g·w_eff·x̂))

(the derivative of x̂_j = x_j·rstd is rstd·δ_ij − x̂_i·x̂_j·rstd/n; eps enters through rstd only).
Stock RMSNorms keep the input x (fp32: the residual stream, or the fp32 copy they normalise) and the
fp32 x̂: 8 bytes per element under bf16 autocast, against y's 4 here (2 in a bf16 model, where y is
also the next Linear's input); Liger-Kernel's keeps x and rstd, and the next Linear the output.

Recovery and its condition (the rule of tempo.ops.layernorm with β = 0, and the same plan). Let D be
y's dtype, u_D its unit roundoff (fp32 2⁻²⁴, bf16 2⁻⁸, fp16 2⁻¹¹), λ_D its smallest normal number
(fp32 and bf16 2⁻¹²⁶, fp16 2⁻¹⁴), u_c the unit roundoff of the compute dtype (fp32; fp64 when x
or w is fp64). w_eff_j is the value the forward multiplies by, computed in the compute dtype (w_j,
or fl(1 + w_j)); the backward uses the very same value. The stored y_j = fl_D(fl_c(w_eff_j·x̂_j))
is within u_c·|w_eff_j·x̂_j| + u_D·max(|w_eff_j·x̂_j|, λ_D) of w_eff_j·x̂_j (relative rounding, or
half the subnormal spacing, u_D·λ_D, where the product falls below λ_D: y's underflow), so
x̂'_j = y_j·fl(1/w_eff_j) satisfies, to first order,

    |x̂'_j − x̂_j| <= (u_D + 3·u_c)·|x̂_j| + u_D·λ_D/|w_eff_j|.

The first term is the rounding of y itself, which the next layer sees anyway; the second is the
condition of the recovery, κ_j = λ_D/|w_eff_j|. Column j is **recovered** exactly when κ_j <= 1,
i.e. |w_eff_j| >= λ_D, and then

    |x̂'_j − x̂_j| <= (u_D + 3·u_c)·(|x̂_j| + 1)                                           (R)

(fp32 output: 2.4e-7·(|x̂_j| + 1); bf16: 3.9e-3·(|x̂_j| + 1); fp16: 4.9e-4·(|x̂_j| + 1)); the
reciprocal cannot overflow there (1/λ_D <= 2¹²⁶). Every other column, |w_eff_j| < λ_D, is **kept**:
w_j = 0 (Llama form) or w_j = −1 (Gemma form: 1 + w is exact for w in [−2, −½], so w_eff = 0 exactly
there), a w_j that is subnormal in D (1e-6 for an fp16 output, whose λ is 6.1e-5), or a 1 + w_j that
cancels to below λ_D (w_j within 2⁻¹⁴ of −1 for an fp16 output). Underflow is the only way a nonzero
w_eff is refused: a w_eff of 1e-30 is recovered for fp32 and bf16 outputs (λ = 1.2e-38), where y
holds it to the bound (R). The forward keeps x̂_j of the K kept columns for every row in the compute
dtype ([rows, K]) plus their K int64 indices, and the backward reads them instead of dividing
(w_eff_j·x̂_j then taken as w_eff_j times the kept x̂_j; as y_j, with no division, for recovered
columns). Without a weight nothing is kept. There is no clamp: a value is recovered within (R) or
kept. The error of each gradient follows: |δ(dw_j)| <= Σ_rows |g_rj|·(u_D + 3u_c)(|x̂_rj| + 1), and
dx as the stock RMSNorm's with x̂ perturbed by (R). An y_j that overflowed (|w_eff_j·x̂_j| above D's
largest value, fp16 mostly) is ±inf in the stock module's output too.

The plan (which columns are kept, and the finiteness check of w riding on it) is tempo.ops.layernorm's,
shared: ``tempo::layernorm_plan`` with β = None and ``weight_offset`` 1 for the Gemma form, made once
per parameter version on the CUDA path (no host read in a forward whose weight is unchanged), held
per output dtype by the module (``tempo_kept_columns``, refreshed on optimizer steps,
``load_state_dict``, ``.to()``, ``apply_tempo`` and eager forwards; see tempo.ops.layernorm's "The
plan") and handed to ``tempo::rmsnorm_fwd`` as an input, so ``torch.compile`` traces a training step
without a data-dependent shape or a graph break. A non-finite weight raises a ValueError naming the
layer; a weight on another device than the input too.

Dtypes: the statistics, x̂ and x̂·w_eff are computed in fp32 (fp64 when x or w is fp64, reference path
only) and rounded once to the output dtype. The output dtype is the stock module's, a function of
x's and w's dtypes (``DTYPE_RULES``; autocast changes nothing: the stock modules are element-wise
code autocast leaves alone, so they return the same dtype under autocast):

  * "promote" (Llama, Qwen3, EuroBERT, Mistral: ``w * x̂.to(x.dtype)``): promote(x, w). Under bf16
    autocast with fp32 weights the residual stream is fp32, so the output is fp32; with 16-bit
    weights bf16; an fp32-weight norm of a bf16 tensor (Qwen3's q_norm/k_norm of an autocast
    projection) returns fp32.
  * "input" (Gemma, Gemma3, EmbeddingGemma, ``nn.RMSNorm``: ``(x̂·w_eff).type_as(x)``): x's dtype.
  * "weight_if_16bit" (T5, mT5: x̂ cast to w's dtype when w is 16-bit, then ``w * x̂``): w's dtype
    when it is fp16/bf16, else promote(x, w).

The stock modules round x̂ to the 16-bit dtype before multiplying by w (Llama, T5): this op rounds
once, so its 16-bit outputs are as close to the exact ones as the stock's or closer.

Why not the autocast dtype, as InplaceLayerNorm returns (so that the next autocast Linear keeps the
very same storage, 2 bytes per element instead of y's 4 plus the Linear's own bf16 copy)? Because a
norm cannot know what reads its output: Gemma3's post-attention and post-feedforward norms are
added to the fp32 residual stream, the final norm's output is the model's output (its dtype is what
a user sees), and Qwen3's q/k norms feed RoPE. Measured on tiny 2-layer models (h = 32, every
norm's weight with w_eff = 0, 1e-30 and 1e-6 columns) under bf16 autocast with fp32 weights,
rounding every norm's output to bf16 (``tests/test_rmsnorm.py``,
``test_under_autocast_the_stock_dtype_is_returned``) moves the model's output / gradients, as
relative L2, by 1.65e-3 / 3.90e-3 for Llama and 1.64e-3 / 7.30e-3 for Gemma3 (EmbeddingGemma's
geometry), against stock autocast's own distance from fp32 of 2.35e-3 / 3.86e-3 and 8.48e-3 /
1.23e-2: a change of the size of all of autocast's rounding, spent on the norms alone (Llama's
output moves from 2.35e-3 to 2.91e-3 away from fp32), and the model's output turns bf16. Returning
the stock dtype keeps a patched model's numbers those of the stock model: its fp32 outputs and
gradients within 1e-5 of it, and under bf16 autocast the same output (Llama, Gemma3, EuroBERT, T5:
bitwise in these tests; Qwen3's q/k norms, whose bf16 input the stock rounds x̂ to before the fp32
weight, differ by that rounding: 2.6e-3, and 3 % closer to fp32) with gradients as close to the
fp32 model's as the stock ones. What it costs is y kept in fp32 where the stock dtype is fp32 (4
bytes per element, against stock's 8); the projections reading it keep that very tensor instead of
their own bf16 copies (``InputKeepingLinear``, tempo.ops.linear, switched in by apply_tempo).

Which tensor is kept. y, except where x is narrower than y (``keeps_input``: a bf16 x with an fp32
output, as Qwen3's q/k norms of an autocast projection under the "promote" rule): there x (2 bytes
per element instead of 4), and backward first recomputes y from x with the forward op itself (the
same kernel, the same kept-column plan: bitwise the forward's y), then runs the same backward. The
recomputation is one element-wise pass; the gradients are those of the y-keeping op, bit for bit.

No backward, nothing kept: when the output cannot reach a backward pass (grad mode off, or neither
the input nor w requires grad) the op keeps nothing and runs the stock computation (the reference
forward without its kept tensors), returned in the same dtype; except a module in training mode on
the Triton path (``runs_own_forward``), which runs the Triton forward: its rounding differs from the
stock computation's (up to 3.6e-7 measured on a Llama block) and a no-grad pass (reentrant
checkpointing's first) must give the bits its recompute with grad gives.

Rows longer than ``MAX_TRITON_N`` (16384, as the LayerNorm kernels) and dtypes the kernels do not
take (fp64 input or weight) run on the reference path, which keeps exactly the same tensors; both
fallbacks are logged once. Double backward is not supported.

Contents, in order: the dtype rules, Triton kernels, host launchers, the PyTorch reference path, the
``tempo::rmsnorm_fwd`` / ``tempo::rmsnorm_bwd`` custom ops, the functional ``inplace_rmsnorm`` and the
``InplaceRMSNorm`` module.
"""

from __future__ import annotations

import math
from typing import Callable, Optional

import torch
from torch import Tensor, nn

from tempo.ops._backend import (
    TRITON_DTYPES,
    check_float_tensor,
    launch_on,
    log_fallback_once,
    requested_backend,
    resolve_backend,
    runs_own_forward,
)
from tempo.ops._backend import tl, triton  # None without triton (reference path only)
from tempo.ops.layernorm import (
    _WIDE_CHUNK,
    _WIDE_WARPS,
    MAX_TRITON_N,
    KeptColumnPlans,
    _as_shape,
    _device_backward_plan,
    _flat_param,
    _kept_args,
    _no_param_grad,
    _num_warps,
    _partials,
    _ShapeLike,
    _summed_grad,
    call_with_plan,
    check_parameter_devices,
    kept_fake,
    plan_for_forward,
    plan_in_forward,
    recover_xhat,
    recovery_inverse,
)

if triton is not None:
    from tempo.ops.layernorm import _recover  # the one recovery of x̂, shared with the LayerNorms

OP_NAME = "inplace_rmsnorm"
_HALF = (torch.float16, torch.bfloat16)
# The attribute names transformers' RMSNorms keep their eps in (InplaceRMSNorm keeps it under the one
# its original used, so code reading it there finds it).
EPS_NAMES = ("eps", "variance_epsilon", "epsilon")


# ----------------------------------------------------------------------------------------------
# The output dtype of each family's stock module (module docstring, "Dtypes")
# ----------------------------------------------------------------------------------------------
DTYPE_RULES: dict[str, Callable[[torch.dtype, torch.dtype], torch.dtype]] = {
    "promote": torch.promote_types,
    "input": lambda x, w: x,
    "weight_if_16bit": lambda x, w: w if w in _HALF else torch.promote_types(x, w),
}

# The backward's warps: one step above the LayerNorm's. With the LayerNorm's (4 warps at 1024 features, 8
# for the wide row sums), triton 3.6's ptxas (the GPU image's) spills 4-8 bytes of registers in these two
# kernels on sm_80 with kept columns (the compile gate under torch 2.11 found it; triton 3.9 does not).
_ROW_SUMS_WARPS = 16


def _bwd_warps(block_n: int) -> int:
    return max(_num_warps(block_n), 8) if block_n >= 1024 else _num_warps(block_n)


def output_dtype(rule: str, x_dtype: torch.dtype, weight_dtype: Optional[torch.dtype]) -> torch.dtype:
    """The dtype a stock RMSNorm of dtype rule ``rule`` returns for an input of ``x_dtype`` (no weight:
    the input's)."""
    if weight_dtype is None:
        return x_dtype
    return DTYPE_RULES[rule](x_dtype, weight_dtype)


def _compute_dtype(x_dtype: torch.dtype, weight: Optional[Tensor]) -> torch.dtype:
    # fp32 statistics, except with an fp64 input or weight (reference path only): full precision.
    fp64 = x_dtype == torch.float64 or (weight is not None and weight.dtype == torch.float64)
    return torch.float64 if fp64 else torch.float32


def effective_weight(weight: Tensor, unit_offset: bool, compute: torch.dtype) -> Tensor:
    """w_eff in the compute dtype: w, or 1 + w computed there (the value the kernels use too)."""
    w = weight.detach().to(compute)
    return w + 1.0 if unit_offset else w


# ----------------------------------------------------------------------------------------------
# Triton kernels (x, y, grad_y are contiguous [rows, N])
# ----------------------------------------------------------------------------------------------
if triton is not None:

    @triton.jit
    def _rmsnorm_fwd_kernel(
        X, Y, W, RSTD, x_row_stride, y_row_stride, N, eps,
        HAS_WEIGHT: tl.constexpr, UNIT_OFFSET: tl.constexpr, BLOCK_N: tl.constexpr,
    ):
        # One program per row; the statistics, x̂ and x̂·w_eff in fp32, one rounding to y's dtype.
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK_N)
        in_row = cols < N
        x = tl.load(X + row * x_row_stride + cols, mask=in_row, other=0.0).to(tl.float32)
        rstd = tl.math.rsqrt(tl.sum(x * x, axis=0) / N + eps)
        y = x * rstd
        if HAS_WEIGHT:
            w = tl.load(W + cols, mask=in_row, other=0.0).to(tl.float32)
            if UNIT_OFFSET:
                w = w + 1.0
            y = y * w
        tl.store(Y + row * y_row_stride + cols, y.to(Y.dtype.element_ty), mask=in_row)
        tl.store(RSTD + row, rstd)

    @triton.jit
    def _rmsnorm_bwd_kernel(
        DY, Y, W, INV_W, RSTD, SLOTS, KEPT, K, DX, DW_PARTIAL,
        dy_row_stride, y_row_stride, dx_row_stride, M, N, rows_per_program,
        HAS_WEIGHT: tl.constexpr, HAS_KEPT: tl.constexpr, BLOCK_N: tl.constexpr,
    ):
        # Rows of up to BWD_BLOCK_MAX features in registers. Each program walks a contiguous run of
        # rows, writes their dx and accumulates its partial dw in fp32; the host sums the partials
        # (no atomics: deterministic). W is w_eff (the host adds the Gemma form's 1), INV_W its
        # reciprocal with 0 at the kept columns. Apart on purpose from the LayerNorm's kernels, whose
        # dx has a mean term this one lacks (and a β, and two row sums where this has one).
        pid = tl.program_id(0)
        cols = tl.arange(0, BLOCK_N)
        in_row = cols < N
        if HAS_WEIGHT:
            w = tl.load(W + cols, mask=in_row, other=0.0).to(tl.float32)
        dw_acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        first_row = pid.to(tl.int64) * rows_per_program
        for i in range(0, rows_per_program):
            row = first_row + i
            # The last program's run may overhang M: such a row has no live columns.
            live = cols < tl.where(row < M, N, 0)
            dy = tl.load(DY + row * dy_row_stride + cols, mask=live, other=0.0).to(tl.float32)
            y = tl.load(Y + row * y_row_stride + cols, mask=live, other=0.0).to(tl.float32)
            rstd = tl.load(RSTD + tl.minimum(row, M - 1))
            xhat, scaled_xhat = _recover(y, live, cols, row, W, W, INV_W, SLOTS, KEPT, K,
                                         HAS_WEIGHT, False, HAS_KEPT)
            if HAS_WEIGHT:
                dy_w = dy * w
            else:
                dy_w = dy
            mean_dy_scaled = tl.sum(dy * scaled_xhat, axis=0) / N
            dx = rstd * (dy_w - xhat * mean_dy_scaled)
            tl.store(DX + row * dx_row_stride + cols, dx.to(DX.dtype.element_ty), mask=live)
            dw_acc += dy * xhat
        if HAS_WEIGHT:
            tl.store(DW_PARTIAL + pid * N + cols, dw_acc, mask=in_row)

    @triton.jit
    def _rmsnorm_bwd_row_sums_kernel(
        DY, Y, W, INV_W, SLOTS, KEPT, K, SUMS, dy_row_stride, y_row_stride, N,
        HAS_WEIGHT: tl.constexpr, HAS_KEPT: tl.constexpr, CHUNK: tl.constexpr,
    ):
        # Wide rows, step 1: per row Σ g·w_eff·x̂, the one reduction dx needs, CHUNK columns at a time.
        row = tl.program_id(0).to(tl.int64)
        sum_dy_scaled = 0.0
        for start in range(0, N, CHUNK):
            cols = start + tl.arange(0, CHUNK)
            live = cols < N
            dy = tl.load(DY + row * dy_row_stride + cols, mask=live, other=0.0).to(tl.float32)
            y = tl.load(Y + row * y_row_stride + cols, mask=live, other=0.0).to(tl.float32)
            _xhat, scaled_xhat = _recover(y, live, cols, row, W, W, INV_W, SLOTS, KEPT, K,
                                          HAS_WEIGHT, False, HAS_KEPT)
            sum_dy_scaled += tl.sum(dy * scaled_xhat, axis=0)
        tl.store(SUMS + row, sum_dy_scaled)

    @triton.jit
    def _rmsnorm_bwd_wide_kernel(
        DY, Y, W, INV_W, RSTD, SLOTS, KEPT, K, SUMS, DX, DW_PARTIAL,
        dy_row_stride, y_row_stride, dx_row_stride, M, N, rows_per_program,
        HAS_WEIGHT: tl.constexpr, HAS_KEPT: tl.constexpr, CHUNK: tl.constexpr,
    ):
        # Wide rows, step 2: program (p, c) owns columns [c·CHUNK, (c+1)·CHUNK) of a run of rows: dx
        # for them from the row sums of step 1, and that chunk of its partial dw.
        pid = tl.program_id(0)
        cols = tl.program_id(1) * CHUNK + tl.arange(0, CHUNK)
        in_row = cols < N
        if HAS_WEIGHT:
            w = tl.load(W + cols, mask=in_row, other=0.0).to(tl.float32)
        dw_acc = tl.zeros([CHUNK], dtype=tl.float32)
        first_row = pid.to(tl.int64) * rows_per_program
        for i in range(0, rows_per_program):
            row = first_row + i
            live = cols < tl.where(row < M, N, 0)
            dy = tl.load(DY + row * dy_row_stride + cols, mask=live, other=0.0).to(tl.float32)
            y = tl.load(Y + row * y_row_stride + cols, mask=live, other=0.0).to(tl.float32)
            safe_row = tl.minimum(row, M - 1)
            rstd = tl.load(RSTD + safe_row)
            mean_dy_scaled = tl.load(SUMS + safe_row) / N
            xhat, _scaled = _recover(y, live, cols, row, W, W, INV_W, SLOTS, KEPT, K,
                                     HAS_WEIGHT, False, HAS_KEPT)
            if HAS_WEIGHT:
                dy_w = dy * w
            else:
                dy_w = dy
            dx = rstd * (dy_w - xhat * mean_dy_scaled)
            tl.store(DX + row * dx_row_stride + cols, dx.to(DX.dtype.element_ty), mask=live)
            dw_acc += dy * xhat
        if HAS_WEIGHT:
            tl.store(DW_PARTIAL + pid * N + cols, dw_acc, mask=in_row)


# ----------------------------------------------------------------------------------------------
# Host launchers
# ----------------------------------------------------------------------------------------------
def _rmsnorm_fwd_triton(x: Tensor, n: int, weight: Optional[Tensor], eps: float, unit_offset: bool,
                        out_dtype: torch.dtype, kept_cols: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    rows = x.numel() // n
    y = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    rstd = torch.empty((rows,), dtype=torch.float32, device=x.device)
    block_n = triton.next_power_of_2(n)
    with launch_on(x):
        _rmsnorm_fwd_kernel[(rows,)](
            x, y, weight if weight is not None else rstd, rstd, n, n, n, eps,
            HAS_WEIGHT=weight is not None, UNIT_OFFSET=bool(unit_offset), BLOCK_N=block_n,
            num_warps=_num_warps(block_n),
        )
    if kept_cols.numel() == 0:  # the usual case: nothing to gather
        return y, rstd, torch.empty((rows, 0), dtype=torch.float32, device=x.device)
    # x̂ of the kept columns: the kernel's fp32 x·rstd, the same operation on the same values.
    kept_xhat = x.reshape(rows, n)[:, kept_cols].float() * rstd[:, None]
    return y, rstd, kept_xhat


def _rmsnorm_bwd_triton(grad_y: Tensor, y: Tensor, rstd: Tensor, kept_cols: Tensor, kept_xhat: Tensor,
                        weight: Optional[Tensor], unit_offset: bool, x_dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    rows = rstd.numel()
    n = y.numel() // rows
    dx = torch.empty(y.shape, dtype=x_dtype, device=y.device)
    block_n = triton.next_power_of_2(n)
    wide, programs, rows_per_program, chunks = _device_backward_plan(y, rows, n)
    dw_partial = _partials(weight, programs, n, y)
    dummy = rstd  # stands in for absent pointers; never touched (constexpr flags)
    # w_eff in the dtype the kernels read it in: the weight itself, or fp32 1 + w (the forward's value).
    w_eff = (effective_weight(weight, True, torch.float32) if unit_offset else weight) if weight is not None else None
    inv_w = recovery_inverse(w_eff, kept_cols) if w_eff is not None else dummy
    slots, kept_arg, k = _kept_args(kept_cols, kept_xhat, n, dummy)
    w_arg = w_eff if w_eff is not None else dummy
    flags = dict(HAS_WEIGHT=weight is not None, HAS_KEPT=kept_cols.numel() > 0)
    tail = (dw_partial if dw_partial is not None else dummy, n, n, n, rows, n, rows_per_program)
    with launch_on(y):
        if not wide:
            _rmsnorm_bwd_kernel[(programs,)](
                grad_y, y, w_arg, inv_w, rstd, slots, kept_arg, k, dx, *tail,
                **flags, BLOCK_N=block_n, num_warps=_bwd_warps(block_n),
            )
        else:
            sums = torch.empty((rows,), dtype=torch.float32, device=y.device)
            _rmsnorm_bwd_row_sums_kernel[(rows,)](
                grad_y, y, w_arg, inv_w, slots, kept_arg, k, sums, n, n, n,
                **flags, CHUNK=_WIDE_CHUNK, num_warps=_ROW_SUMS_WARPS,
            )
            _rmsnorm_bwd_wide_kernel[(programs, chunks)](
                grad_y, y, w_arg, inv_w, rstd, slots, kept_arg, k, sums, dx, *tail,
                **flags, CHUNK=_WIDE_CHUNK, num_warps=_WIDE_WARPS,
            )
    return dx, _summed_grad(dw_partial, weight, y)


# ----------------------------------------------------------------------------------------------
# Reference implementation (any device, any float dtype; same saved tensors as the kernels). The
# forward runs the stock modules' ops in their order: x.pow(2).mean(-1) + eps, rsqrt, x·rstd, ·w_eff.
# ----------------------------------------------------------------------------------------------
def _normalize(x2d: Tensor, weight: Optional[Tensor], eps: float, unit_offset: bool,
               compute: torch.dtype) -> tuple[Tensor, Tensor, Tensor]:
    """(y in the compute dtype, rstd [rows, 1], x̂) of rows ``x2d``; y is a fresh tensor."""
    s = x2d.to(compute)
    rstd = torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + eps)
    xhat = s * rstd
    y = xhat * effective_weight(weight, unit_offset, compute) if weight is not None else xhat
    return y, rstd, xhat


def _rmsnorm_fwd_reference(x: Tensor, n: int, weight: Optional[Tensor], eps: float, unit_offset: bool,
                           out_dtype: torch.dtype, kept_cols: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    compute = _compute_dtype(x.dtype, weight)
    y, rstd, xhat = _normalize(x.reshape(-1, n), weight, eps, unit_offset, compute)
    kept_xhat = xhat.index_select(1, kept_cols)
    return y.to(out_dtype).view(x.shape), rstd.reshape(-1), kept_xhat


def _rmsnorm_bwd_reference(grad_y: Tensor, y: Tensor, rstd: Tensor, kept_cols: Tensor, kept_xhat: Tensor, n: int,
                           weight: Optional[Tensor], unit_offset: bool, x_dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    compute = rstd.dtype
    g = grad_y.reshape(-1, n).to(compute)
    w_eff = effective_weight(weight, unit_offset, compute) if weight is not None else None
    # x̂ = y / w_eff for recovered columns (error (R)), the kept x̂ for the others.
    xhat = recover_xhat(y.reshape(-1, n), kept_cols, kept_xhat, w_eff, None, compute)
    g_w = g * w_eff if w_eff is not None else g
    dx = (g_w - xhat * (g_w * xhat).mean(-1, keepdim=True)) * rstd.unsqueeze(-1)
    dw = (g * xhat).sum(0).to(weight.dtype) if weight is not None else _no_param_grad(y)
    return dx.view(y.shape).to(x_dtype), dw


# ----------------------------------------------------------------------------------------------
# Custom ops (torch.compile traces them as single nodes; autograd saves y, rstd and the kept x̂).
# ``backend`` is resolved by the caller; the backward op gets the path the forward took.
# ----------------------------------------------------------------------------------------------
def _check_op_backend(backend: str, n: int, dtypes: tuple[torch.dtype, ...], op: str) -> None:
    if backend not in ("triton", "reference"):
        raise ValueError(f"{op}: argument 'backend' must be 'triton' or 'reference', got {backend!r}")
    if backend == "triton" and n > MAX_TRITON_N:
        raise ValueError(f"{op}: the Triton kernels take rows of at most {MAX_TRITON_N} features, got {n}")
    if backend == "triton" and any(d not in TRITON_DTYPES for d in dtypes):
        raise TypeError(f"{op}: the Triton kernels support float32, float16 and bfloat16, got {dtypes}")


def _trailing_numel(t: Tensor, ndim: int) -> int:
    return math.prod(t.shape[t.dim() - ndim:])


@torch.library.custom_op("tempo::rmsnorm_fwd", mutates_args=())
def rmsnorm_fwd(x: Tensor, normalized_ndim: int, weight: Optional[Tensor], kept_cols: Tensor, eps: float,
                unit_offset: bool, out_dtype: torch.dtype, backend: str,
                name: str) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """x: contiguous, normalized over its last ``normalized_ndim`` dims (N features); weight flattened
    to [N] or None; ``kept_cols`` int64 [K] the plan (``plan_for_forward``) -> (y in x's shape and
    out_dtype, rstd [rows] in the compute dtype (fp32; fp64 with an fp64 x or weight), the kept
    columns used, int64 [K] (those of the current weight: ``plan_in_forward``), kept_xhat [rows, K]
    in the compute dtype). ``unit_offset``: w_eff = 1 + w (Gemma's form)."""
    n = _trailing_numel(x, normalized_ndim)
    dtypes = (x.dtype,) + ((weight.dtype,) if weight is not None else ())
    _check_op_backend(backend, n, dtypes, "tempo::rmsnorm_fwd")
    offset = 1.0 if unit_offset else 0.0
    kept_cols = plan_in_forward(kept_cols, weight, None, out_dtype, n, x.device, name, backend, offset)
    with torch.autocast(x.device.type, enabled=False):
        if backend == "triton" and x.numel() > 0:  # empty: no kernel to launch
            y, rstd, kept_xhat = _rmsnorm_fwd_triton(x, n, weight, eps, unit_offset, out_dtype, kept_cols)
        else:
            y, rstd, kept_xhat = _rmsnorm_fwd_reference(x, n, weight, eps, unit_offset, out_dtype, kept_cols)
    return y, rstd, kept_cols, kept_xhat


@rmsnorm_fwd.register_fake
def _(x, normalized_ndim, weight, kept_cols, eps, unit_offset, out_dtype, backend, name):
    rows = math.prod(x.shape[: x.dim() - normalized_ndim])
    compute = _compute_dtype(x.dtype, weight)
    return (x.new_empty(x.shape, dtype=out_dtype), x.new_empty((rows,), dtype=compute),
            *kept_fake(rows, kept_cols, x, compute))


@torch.library.custom_op("tempo::rmsnorm_bwd", mutates_args=())
def rmsnorm_bwd(grad_y: Tensor, y: Tensor, rstd: Tensor, kept_cols: Tensor, kept_xhat: Tensor, normalized_ndim: int,
                weight: Optional[Tensor], unit_offset: bool, x_dtype: torch.dtype,
                backend: str) -> tuple[Tensor, Tensor]:
    """-> (dx in x_dtype and y's shape, dw in w's dtype; empty without a weight). ``backend`` is the
    one the forward ran (recorded in the autograd ctx)."""
    n = _trailing_numel(y, normalized_ndim)
    _check_op_backend(backend, n, (y.dtype,), "tempo::rmsnorm_bwd")
    with torch.autocast(y.device.type, enabled=False):
        if backend == "triton" and y.numel() > 0:
            return _rmsnorm_bwd_triton(grad_y, y, rstd, kept_cols, kept_xhat, weight, unit_offset, x_dtype)
        return _rmsnorm_bwd_reference(grad_y, y, rstd, kept_cols, kept_xhat, n, weight, unit_offset, x_dtype)


@rmsnorm_bwd.register_fake
def _(grad_y, y, rstd, kept_cols, kept_xhat, normalized_ndim, weight, unit_offset, x_dtype, backend):
    dw = weight.new_empty(weight.shape) if weight is not None else y.new_empty((0,), dtype=torch.float32)
    return y.new_empty(y.shape, dtype=x_dtype), dw


def keeps_input(x_dtype: torch.dtype, out_dtype: torch.dtype) -> bool:
    """Whether the op keeps x instead of y: only where x is the narrower of the two (a bf16 input
    with an fp32 output, Qwen3's q/k norms of an autocast projection under the "promote" rule);
    backward then recomputes y from x with the forward's own kernel (module docstring, "Which
    tensor is kept")."""
    return x_dtype.itemsize < out_dtype.itemsize


def _fwd_setup_context(ctx, inputs, output):
    x, normalized_ndim, weight, _plan, eps, unit_offset, out_dtype, backend, name = inputs
    y, rstd, kept_cols, kept_xhat = output
    # The output, not the input: y is the tensor the next layer keeps anyway; x̂ only of the
    # columns where y cannot give it back. Unless x is narrower than y: then x, and y is recomputed.
    ctx.recompute = keeps_input(x.dtype, out_dtype)
    ctx.save_for_backward(x if ctx.recompute else y, rstd, kept_cols, kept_xhat, weight)
    ctx.x_dtype, ctx.normalized_ndim, ctx.unit_offset = x.dtype, normalized_ndim, unit_offset
    ctx.eps, ctx.out_dtype, ctx.name = eps, out_dtype, name
    # The backend the forward ran, not whatever use_backend() says when backward runs (on CUDA
    # that is autograd's device thread).
    ctx.backend = backend
    ctx.mark_non_differentiable(rstd, kept_cols, kept_xhat)


def _fwd_backward(ctx, grad_y, _grad_rstd, _grad_cols, _grad_kept):
    kept, rstd, kept_cols, kept_xhat, weight = ctx.saved_tensors  # kept: y, or x where x is narrower
    y = kept
    if ctx.recompute:  # y from the kept x by the forward's kernel, with the forward's plan: bitwise its y
        y = call_with_plan(torch.ops.tempo.rmsnorm_fwd, kept_cols, kept, ctx.normalized_ndim, weight, kept_cols,
                           ctx.eps, ctx.unit_offset, ctx.out_dtype, ctx.backend, ctx.name)[0]
    dx, dw = torch.ops.tempo.rmsnorm_bwd(grad_y.contiguous(), y, rstd, kept_cols, kept_xhat, ctx.normalized_ndim,
                                         weight, ctx.unit_offset, ctx.x_dtype, ctx.backend)
    return dx, None, dw if weight is not None else None, None, None, None, None, None, None


rmsnorm_fwd.register_autograd(_fwd_backward, setup_context=_fwd_setup_context)


def resolve_rmsnorm_backend(x: Tensor, weight: Optional[Tensor], n: int) -> str:
    """'triton' or 'reference' for rows of ``n`` features (raises as resolve_backend does).

    Where the Triton path would be taken (CUDA, or 'triton' forced) but the kernels cannot take the
    rows, the reference path runs, which keeps exactly the same tensors for backward, logged once:
    a dtype the kernels do not support (fp64 input or weight: they compute in fp32), or rows wider
    than MAX_TRITON_N.
    """
    wanted = requested_backend()
    dtypes = [x.dtype] + ([weight.dtype] if weight is not None else [])
    unsupported = [d for d in dtypes if d not in TRITON_DTYPES]
    if unsupported and (wanted == "triton" or (wanted == "auto" and x.is_cuda)):
        which = "input" if x.dtype == unsupported[0] else "weight"
        log_fallback_once(f"{OP_NAME}:dtype:{which}:{unsupported[0]}",
                          f"{OP_NAME}: {unsupported[0]} {which}s run on the PyTorch reference path; the Triton "
                          "kernels take float32, float16 and bfloat16")
        return "reference"
    backend = resolve_backend(x, OP_NAME)
    if backend == "triton" and n > MAX_TRITON_N:
        log_fallback_once(f"{OP_NAME}:wide", f"{OP_NAME}: rows of more than {MAX_TRITON_N} features (got {n}) "
                          "run on the PyTorch reference path; the Triton forward holds one row per block")
        return "reference"
    return backend


# ----------------------------------------------------------------------------------------------
# Functional API and module
# ----------------------------------------------------------------------------------------------
def inplace_rmsnorm(x: Tensor, normalized_shape: _ShapeLike, weight: Optional[Tensor] = None, eps: float = 1e-6,
                    unit_offset: bool = False, out_dtype: Optional[torch.dtype] = None,
                    name: Optional[str] = None) -> Tensor:
    """RMSNorm over the last ``len(normalized_shape)`` dims, ``x·rsqrt(mean(x²) + eps)·w_eff`` with
    w_eff = w, or 1 + w with ``unit_offset`` (Gemma's form), whose backward keeps y, rstd and x̂ of
    the columns y cannot give back (the module docstring's rule).

    ``out_dtype`` None: x's dtype (``F.rms_norm``'s); the module returns its family's (``dtype_rule``).
    Statistics in fp32 (fp64 with an fp64 x or weight). A non-contiguous x is copied to a contiguous
    one first (the copy is not kept). ``name`` names the layer in errors (a non-finite weight).
    Under torch.compile this functional form plans from w's values in the graph (a data-dependent
    shape, logged once); the module hands the plan it holds instead. Without a backward it runs the
    stock computation and keeps nothing.
    """
    return _inplace_rmsnorm(x, normalized_shape, weight, eps, unit_offset, out_dtype, name, holder=None)


def _inplace_rmsnorm(x: Tensor, normalized_shape: _ShapeLike, weight: Optional[Tensor], eps: float,
                     unit_offset: bool, out_dtype: Optional[torch.dtype], name: Optional[str],
                     holder: Optional[nn.Module]) -> Tensor:
    """``inplace_rmsnorm``; ``holder``: the module whose held plan a compiled forward hands the op."""
    check_float_tensor(x, "input", OP_NAME)
    shape = _as_shape(normalized_shape, OP_NAME)
    if len(shape) == 0 or x.dim() < len(shape) or tuple(x.shape[x.dim() - len(shape):]) != shape:
        raise ValueError(f"{OP_NAME}: argument 'normalized_shape' {shape} must match the trailing dimensions "
                         f"of the input, got input of shape {tuple(x.shape)}")
    if weight is not None:
        check_float_tensor(weight, "weight", OP_NAME)
        if tuple(weight.shape) != shape:
            raise ValueError(f"{OP_NAME}: argument 'weight' of shape {tuple(weight.shape)} must have the "
                             f"normalized_shape {shape}")
    check_parameter_devices(x, weight, None, name or OP_NAME)
    if out_dtype is not None and not out_dtype.is_floating_point:
        raise TypeError(f"{OP_NAME}: argument 'out_dtype' must be a floating-point dtype, got {out_dtype}")
    dtype = out_dtype if out_dtype is not None else x.dtype
    n = math.prod(shape)
    training = holder is not None and holder.training
    # In training mode the Triton path runs without a backward too (runs_own_forward); the
    # reference forward gives the stock computation's bits, so that stands for it.
    own = training and resolve_rmsnorm_backend(x, weight, n) == "triton"
    if not runs_own_forward(own, x, weight):
        # Nothing will be kept: the stock computation, in the dtype the Tempo path returns.
        with torch.autocast(x.device.type, enabled=False):
            y, _rstd, _xhat = _normalize(x.reshape(-1, n), weight.reshape(n) if weight is not None else None,
                                         float(eps), unit_offset, _compute_dtype(x.dtype, weight))
        return y.to(dtype).view(x.shape)
    weight = _flat_param(weight, n)
    backend = resolve_rmsnorm_backend(x, weight, n)
    name = name or OP_NAME
    kept_cols = plan_for_forward(holder, x, weight, None, dtype, n, backend, name, 1.0 if unit_offset else 0.0)
    y, _rstd, _cols, _kept = call_with_plan(torch.ops.tempo.rmsnorm_fwd, kept_cols, x.contiguous(), len(shape),
                                            weight, kept_cols, float(eps), bool(unit_offset), dtype, backend, name)
    return y


class InplaceRMSNorm(KeptColumnPlans):
    """Drop-in RMSNorm, ``x·rsqrt(mean(x²) + eps)·w_eff`` over the last dims, whose backward keeps its
    output y, one fp32 rstd per row, and x̂ of the (usually no) columns whose |w_eff| is below the
    output dtype's smallest normal.

    ``unit_offset``: w_eff = 1 + w (Gemma's form; the weight starts at 0), else w (starts at 1).
    ``dtype_rule``: the output dtype as the stock module returns it (``DTYPE_RULES``: "input", as
    ``nn.RMSNorm``, the default; "promote", Llama's; "weight_if_16bit", T5's). ``eps_name``: the
    attribute the eps lives in (``eps``; ``variance_epsilon`` for a module replacing Llama's), read at
    every forward. One ``weight`` Parameter of ``normalized_shape`` (absent with
    ``elementwise_affine=False``): the state_dict keys of transformers' RMSNorms and ``nn.RMSNorm``.

    Precision: exact by construction for any weight (module docstring): a column's x̂ is either
    recovered from y within (u_D + 3u_c)·(|x̂| + 1) or kept. Non-finite weights raise in the forward,
    naming the layer (``tempo_name``, set by ``name_layernorms``). Without a backward it keeps nothing
    and runs the stock computation, except in training mode on the Triton path (module docstring).
    Double backward is not supported.
    """

    def __init__(self, normalized_shape: _ShapeLike, eps: float = 1e-6, elementwise_affine: bool = True, *,
                 unit_offset: bool = False, dtype_rule: str = "input", eps_name: str = "eps", device=None,
                 dtype=None) -> None:
        super().__init__()
        if dtype_rule not in DTYPE_RULES:
            raise ValueError(f"InplaceRMSNorm: argument 'dtype_rule' must be one of {sorted(DTYPE_RULES)}, "
                             f"got {dtype_rule!r}")
        if eps_name not in EPS_NAMES:
            raise ValueError(f"InplaceRMSNorm: argument 'eps_name' must be one of {EPS_NAMES}, got {eps_name!r}")
        self.normalized_shape = _as_shape(normalized_shape, "InplaceRMSNorm")
        self.eps_name = eps_name
        setattr(self, eps_name, eps)
        self.elementwise_affine = elementwise_affine
        self.unit_offset = bool(unit_offset)
        self.dtype_rule = dtype_rule
        if elementwise_affine:
            self.weight = nn.Parameter(torch.empty(self.normalized_shape, device=device, dtype=dtype))
        else:
            self.register_parameter("weight", None)
        self.reset_parameters()
        self._hold_kept_column_plans()

    def kept_column_parameters(self) -> tuple[Optional[Tensor], Optional[Tensor], float]:
        return self.weight, None, 1.0 if self.unit_offset else 0.0

    def reset_parameters(self) -> None:
        if self.weight is not None:
            # w_eff = 1 at the start in both forms.
            (nn.init.zeros_ if self.unit_offset else nn.init.ones_)(self.weight)

    def forward(self, input: Tensor) -> Tensor:
        weight = self.weight
        out_dtype = output_dtype(self.dtype_rule, input.dtype, weight.dtype if weight is not None else None)
        return _inplace_rmsnorm(input, self.normalized_shape, weight, getattr(self, self.eps_name), self.unit_offset,
                                out_dtype, self.tempo_name or type(self).__name__, holder=self)

    def extra_repr(self) -> str:
        text = f"{self.normalized_shape}, {self.eps_name}={getattr(self, self.eps_name)}"
        if not self.elementwise_affine:
            text += ", elementwise_affine=False"
        return text + f", unit_offset={self.unit_offset}, dtype_rule={self.dtype_rule!r}"


__all__ = ["DTYPE_RULES", "EPS_NAMES", "InplaceRMSNorm", "effective_weight", "inplace_rmsnorm", "output_dtype",
           "resolve_rmsnorm_backend", "rmsnorm_bwd", "rmsnorm_fwd"]
