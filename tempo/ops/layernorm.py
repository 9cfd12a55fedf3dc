"""In-place LayerNorm: the backward pass reads the output y, never the input x.

LayerNorm's output already holds the normalized input: x̂ = (y − β) / γ. So instead of the
input (plus mean and rstd) the op keeps only y, which is the tensor it returns and which the
next layer (a Linear, a dropout, a residual add) keeps anyway, plus one fp32 rstd per row. With
x̂ recovered, the gradients are

    dβ = Σ_rows g        dγ = Σ_rows g·x̂        dx = rstd·(g·γ − mean(g·γ) − x̂·mean(g·(y − β)))

(g·γ·x̂ = g·(y − β) needs no division). Without an affine transform x̂ = y.

Contents, in order: Triton kernels, their host launchers, the PyTorch reference path, the
``tempo::layernorm_fwd`` / ``tempo::layernorm_bwd`` custom ops, the functional
``inplace_layernorm`` and the ``InplaceLayerNorm`` module.
"""

from __future__ import annotations

import math
import numbers
from typing import Optional, Sequence, Union

import torch
from torch import Tensor, nn

from tempo.ops._backend import (
    TRITON_DTYPES,
    autocast_dtype_for,
    check_float_tensor,
    log_fallback_once,
    resolve_backend,
)

try:  # CPU-only machines may lack triton: the reference path still works there
    import triton
    import triton.language as tl
except Exception:  # pragma: no cover - depends on the install
    triton = None
    tl = None

OP_NAME = "inplace_layernorm"
# γ_j is clamped away from zero (keeping its sign) before dividing y − β by it:
# |γ_j| >= τ = max(GAMMA_REL_FLOOR · max_k |γ_k|, GAMMA_ABS_FLOOR).
GAMMA_REL_FLOOR = 1e-6
GAMMA_ABS_FLOOR = 1e-12
# Rows longer than this do not fit one Triton block in the forward; they run on the reference
# path (logged once), which keeps exactly the same tensors for backward.
MAX_TRITON_N = 16384
# dtypes autocast would have cast to its lower-precision type (fp64 is left alone by autocast).
_AUTOCAST_ELIGIBLE = (torch.float32, torch.float16, torch.bfloat16)


def xhat_bound(n: int) -> float:
    """|x̂_j| <= sqrt(n − 1) for any row of n features (Cauchy–Schwarz, Σ x̂ = 0, Σ x̂² < n)."""
    return math.sqrt(max(n - 1, 0))


# ----------------------------------------------------------------------------------------------
# Triton kernels
# ----------------------------------------------------------------------------------------------
if triton is not None:

    @triton.jit
    def _layernorm_fwd_kernel(
        X, Y, W, B, RSTD,
        x_row_stride, y_row_stride, N, eps,
        HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr,
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
        if HAS_WEIGHT:
            y = y * tl.load(W + cols, mask=in_row, other=0.0).to(tl.float32)
        if HAS_BIAS:
            y = y + tl.load(B + cols, mask=in_row, other=0.0).to(tl.float32)
        tl.store(Y + row * y_row_stride + cols, y.to(Y.dtype.element_ty), mask=in_row)
        tl.store(RSTD + row, rstd)

    @triton.jit
    def _layernorm_bwd_kernel(
        DY, Y, W, B, INV_W, RSTD, DX, DW_PARTIAL, DB_PARTIAL,
        dy_row_stride, y_row_stride, dx_row_stride, M, N, rows_per_program, xhat_max,
        HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr,
    ):
        # Rows of up to BWD_BLOCK_MAX features: a row fits in registers. Each program walks a
        # contiguous run of rows, writes their dx, and accumulates its own partial dγ/dβ in fp32
        # registers; the host sums the partials (no atomics: deterministic).
        pid = tl.program_id(0)
        cols = tl.arange(0, BLOCK_N)
        in_row = cols < N
        if HAS_WEIGHT:
            w = tl.load(W + cols, mask=in_row, other=0.0).to(tl.float32)
            inv_w = tl.load(INV_W + cols, mask=in_row, other=0.0).to(tl.float32)
        if HAS_BIAS:
            b = tl.load(B + cols, mask=in_row, other=0.0).to(tl.float32)
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
            # γ·x̂ = y − β exactly; x̂ itself needs the division by (clamped) γ.
            scaled_xhat = y
            if HAS_BIAS:
                scaled_xhat = tl.where(live, y - b, 0.0)
            if HAS_WEIGHT:
                xhat = scaled_xhat * inv_w
                dy_w = dy * w
            else:
                xhat = scaled_xhat
                dy_w = dy
            xhat = tl.minimum(tl.maximum(xhat, -xhat_max), xhat_max)
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
        DY, Y, W, B, SUMS, dy_row_stride, y_row_stride, N,
        HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr, CHUNK: tl.constexpr,
    ):
        # Wide rows, step 1: per row Σ g·γ and Σ g·(y − β) (= Σ g·γ·x̂), the two reductions dx
        # needs, walking the row in chunks so nothing row-sized sits in registers. (Scalar sums
        # per chunk: chunk-wide fp32 accumulators crash triton 3.9's sm_90 compiler for 16-bit
        # inputs without affine, found by compile_check.)
        row = tl.program_id(0).to(tl.int64)
        sum_dy_w = 0.0
        sum_dy_scaled = 0.0
        for start in range(0, N, CHUNK):
            cols = start + tl.arange(0, CHUNK)
            live = cols < N
            dy = tl.load(DY + row * dy_row_stride + cols, mask=live, other=0.0).to(tl.float32)
            y = tl.load(Y + row * y_row_stride + cols, mask=live, other=0.0).to(tl.float32)
            scaled_xhat = y
            if HAS_BIAS:
                scaled_xhat = tl.where(live, y - tl.load(B + cols, mask=live, other=0.0).to(tl.float32), 0.0)
            dy_w = dy
            if HAS_WEIGHT:
                dy_w = dy * tl.load(W + cols, mask=live, other=0.0).to(tl.float32)
            sum_dy_w += tl.sum(dy_w, axis=0)
            sum_dy_scaled += tl.sum(dy * scaled_xhat, axis=0)
        tl.store(SUMS + row * 2, sum_dy_w)
        tl.store(SUMS + row * 2 + 1, sum_dy_scaled)

    @triton.jit
    def _layernorm_bwd_wide_kernel(
        DY, Y, W, B, INV_W, RSTD, SUMS, DX, DW_PARTIAL, DB_PARTIAL,
        dy_row_stride, y_row_stride, dx_row_stride, M, N, rows_per_program, xhat_max,
        HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr, CHUNK: tl.constexpr,
    ):
        # Wide rows, step 2: program (p, c) owns columns [c·CHUNK, (c+1)·CHUNK) of a run of rows:
        # dx for them from the row sums of step 1, and that chunk of its partial dγ/dβ, kept in
        # registers only CHUNK wide (a whole 16384-wide row of accumulators spills).
        pid = tl.program_id(0)
        cols = tl.program_id(1) * CHUNK + tl.arange(0, CHUNK)
        in_row = cols < N
        if HAS_WEIGHT:
            w = tl.load(W + cols, mask=in_row, other=0.0).to(tl.float32)
            inv_w = tl.load(INV_W + cols, mask=in_row, other=0.0).to(tl.float32)
        if HAS_BIAS:
            b = tl.load(B + cols, mask=in_row, other=0.0).to(tl.float32)
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
            scaled_xhat = y
            if HAS_BIAS:
                scaled_xhat = tl.where(live, y - b, 0.0)
            if HAS_WEIGHT:
                xhat = scaled_xhat * inv_w
                dy_w = dy * w
            else:
                xhat = scaled_xhat
                dy_w = dy
            xhat = tl.minimum(tl.maximum(xhat, -xhat_max), xhat_max)
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
    if block_n >= 8192:
        return 16
    if block_n >= 2048:
        return 8
    return 4


def _rstd_dtype(x_dtype: torch.dtype) -> torch.dtype:
    # fp32 statistics, except fp64 inputs (reference path only), which keep full precision.
    return torch.float64 if x_dtype == torch.float64 else torch.float32


def _layernorm_fwd_triton(x: Tensor, n: int, weight: Optional[Tensor], bias: Optional[Tensor], eps: float,
                          out_dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    rows = x.numel() // n
    # y has x's shape (not a 2-D buffer viewed back): the kernel just writes rows of n.
    y = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    rstd = torch.empty((rows,), dtype=torch.float32, device=x.device)
    block_n = triton.next_power_of_2(n)
    dummy = rstd  # stands in for absent weight/bias pointers; never read (constexpr flags)
    _layernorm_fwd_kernel[(rows,)](
        x, y, weight if weight is not None else dummy, bias if bias is not None else dummy, rstd,
        n, n, n, eps,
        HAS_WEIGHT=weight is not None, HAS_BIAS=bias is not None, BLOCK_N=block_n,
        num_warps=_num_warps(block_n),
    )
    return y, rstd


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


def _layernorm_bwd_triton(grad_y: Tensor, y: Tensor, rstd: Tensor, weight: Optional[Tensor],
                          bias: Optional[Tensor], x_dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor]:
    rows = rstd.numel()
    n = y.numel() // rows
    dx = torch.empty(y.shape, dtype=x_dtype, device=y.device)
    block_n = triton.next_power_of_2(n)
    sms = torch.cuda.get_device_properties(y.device).multi_processor_count if y.is_cuda else None
    wide, programs, rows_per_program, chunks = _backward_plan(rows, n, sms)
    partial_shape = (programs, n)
    dw_partial = torch.empty(partial_shape, dtype=torch.float32, device=y.device) if weight is not None else None
    db_partial = torch.empty(partial_shape, dtype=torch.float32, device=y.device) if bias is not None else None
    inv_w = _safe_inverse_gamma(weight.float()) if weight is not None else None
    dummy = rstd
    w_arg, b_arg = (weight if weight is not None else dummy), (bias if bias is not None else dummy)
    flags = dict(HAS_WEIGHT=weight is not None, HAS_BIAS=bias is not None)
    tail = (dw_partial if dw_partial is not None else dummy, db_partial if db_partial is not None else dummy,
            n, n, n, rows, n, rows_per_program, xhat_bound(n))
    if not wide:
        _layernorm_bwd_kernel[(programs,)](
            grad_y, y, w_arg, b_arg, inv_w if inv_w is not None else dummy, rstd, dx, *tail,
            **flags, BLOCK_N=block_n, num_warps=_num_warps(block_n),
        )
    else:
        sums = torch.empty((rows, 2), dtype=torch.float32, device=y.device)
        _layernorm_bwd_row_sums_kernel[(rows,)](
            grad_y, y, w_arg, b_arg, sums, n, n, n, **flags, CHUNK=_WIDE_CHUNK, num_warps=_WIDE_WARPS,
        )
        _layernorm_bwd_wide_kernel[(programs, chunks)](
            grad_y, y, w_arg, b_arg, inv_w if inv_w is not None else dummy, rstd, sums, dx, *tail,
            **flags, CHUNK=_WIDE_CHUNK, num_warps=_WIDE_WARPS,
        )
    # torch's sum over dim 0 is deterministic (no atomics), so dγ/dβ are bit-reproducible.
    dw = dw_partial.sum(0).to(weight.dtype) if weight is not None else _empty_param_grad(None, y)
    db = db_partial.sum(0).to(bias.dtype) if bias is not None else _empty_param_grad(None, y)
    return dx, dw, db


# ----------------------------------------------------------------------------------------------
# Reference implementation (any device, any float dtype; same saved tensors as the kernels)
# ----------------------------------------------------------------------------------------------
def _safe_inverse_gamma(weight: Tensor) -> Tensor:
    """1 / γ with γ clamped away from zero, keeping its sign (γ = 0 counts as positive).

    τ = max(GAMMA_REL_FLOOR · max|γ|, GAMMA_ABS_FLOOR); computed on the device, no host sync.
    """
    if weight.numel() == 0:
        return weight.clone()
    tau = torch.clamp(weight.abs().amax() * GAMMA_REL_FLOOR, min=GAMMA_ABS_FLOOR)
    safe = torch.where(weight >= 0, torch.maximum(weight, tau), torch.minimum(weight, -tau))
    return safe.reciprocal()


def _empty_param_grad(param: Optional[Tensor], like: Tensor) -> Tensor:
    # Custom ops cannot return None: an absent weight/bias gets an empty gradient.
    return torch.empty((0,), dtype=param.dtype if param is not None else torch.float32, device=like.device)


def _layernorm_fwd_reference(x: Tensor, ndim: int, weight: Optional[Tensor], bias: Optional[Tensor], eps: float,
                             out_dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    # Reduces over the trailing ``ndim`` dims of x as it is, so y comes out in x's shape without
    # a view of some 2-D buffer.
    compute = _rstd_dtype(x.dtype)
    dims = tuple(range(x.dim() - ndim, x.dim()))
    shape = x.shape[x.dim() - ndim:]
    xc = x.to(compute)
    centered = xc - xc.mean(dim=dims, keepdim=True)
    rstd = torch.rsqrt((centered * centered).mean(dim=dims, keepdim=True) + eps)
    y = centered * rstd
    if weight is not None:
        y = y * weight.to(compute).view(shape)
    if bias is not None:
        y = y + bias.to(compute).view(shape)
    return y.to(out_dtype), rstd.reshape(-1)


def _layernorm_bwd_reference(grad_y: Tensor, y: Tensor, rstd: Tensor, ndim: int, weight: Optional[Tensor],
                             bias: Optional[Tensor], x_dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor]:
    compute = rstd.dtype  # fp32, or fp64 for fp64 inputs
    dims = tuple(range(y.dim() - ndim, y.dim()))
    shape = y.shape[y.dim() - ndim:]
    n = math.prod(shape)
    g = grad_y.to(compute)
    scaled_xhat = y.to(compute)  # γ·x̂
    if bias is not None:
        scaled_xhat = scaled_xhat - bias.to(compute).view(shape)
    if weight is not None:
        w = weight.to(compute).view(shape)
        xhat = scaled_xhat * _safe_inverse_gamma(w)
        g_w = g * w
    else:
        xhat = scaled_xhat
        g_w = g
    xhat = xhat.clamp(-xhat_bound(n), xhat_bound(n))
    mean_g_w = g_w.mean(dim=dims, keepdim=True)
    mean_g_scaled = (g * scaled_xhat).mean(dim=dims, keepdim=True)
    dx = rstd.view(y.shape[: y.dim() - ndim] + (1,) * ndim) * (g_w - mean_g_w - xhat * mean_g_scaled)
    dw = (g * xhat).reshape(-1, n).sum(0).to(weight.dtype) if weight is not None else _empty_param_grad(None, y)
    db = g.reshape(-1, n).sum(0).to(bias.dtype) if bias is not None else _empty_param_grad(None, y)
    return dx.to(x_dtype), dw, db


# ----------------------------------------------------------------------------------------------
# Custom ops (torch.compile traces them as single nodes; autograd saves only y and rstd)
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


@torch.library.custom_op("tempo::layernorm_fwd", mutates_args=())
def layernorm_fwd(x: Tensor, normalized_ndim: int, weight: Optional[Tensor], bias: Optional[Tensor], eps: float,
                  out_dtype: torch.dtype, backend: str) -> tuple[Tensor, Tensor]:
    """x: contiguous, normalized over its last ``normalized_ndim`` dims (N features); weight and bias
    flattened to [N] -> (y in x's shape and out_dtype, rstd [rows] fp32 (fp64 for fp64 x)).

    ``backend`` ("triton" or "reference") is resolved by the caller, so the backward can be told
    the same one."""
    n = _trailing_numel(x, normalized_ndim)
    _check_op_backend(backend, n, x.dtype, "tempo::layernorm_fwd")
    if backend == "triton" and x.numel() > 0:  # empty: no kernel to launch
        return _layernorm_fwd_triton(x, n, weight, bias, eps, out_dtype)
    return _layernorm_fwd_reference(x, normalized_ndim, weight, bias, eps, out_dtype)


@layernorm_fwd.register_fake
def _(x, normalized_ndim, weight, bias, eps, out_dtype, backend):
    rows = math.prod(x.shape[: x.dim() - normalized_ndim])
    return x.new_empty(x.shape, dtype=out_dtype), x.new_empty((rows,), dtype=_rstd_dtype(x.dtype))


@torch.library.custom_op("tempo::layernorm_bwd", mutates_args=())
def layernorm_bwd(grad_y: Tensor, y: Tensor, rstd: Tensor, normalized_ndim: int, weight: Optional[Tensor],
                  bias: Optional[Tensor], x_dtype: torch.dtype, backend: str) -> tuple[Tensor, Tensor, Tensor]:
    """-> (dx in x_dtype and y's shape, dγ in γ's dtype, dβ in β's dtype); an absent γ/β gets an
    empty tensor. ``backend`` is the one the forward ran (recorded in the autograd ctx)."""
    n = _trailing_numel(y, normalized_ndim)
    _check_op_backend(backend, n, y.dtype, "tempo::layernorm_bwd")
    if backend == "triton" and y.numel() > 0:
        return _layernorm_bwd_triton(grad_y, y, rstd, weight, bias, x_dtype)
    return _layernorm_bwd_reference(grad_y, y, rstd, normalized_ndim, weight, bias, x_dtype)


@layernorm_bwd.register_fake
def _(grad_y, y, rstd, normalized_ndim, weight, bias, x_dtype, backend):
    def param_grad(p):
        return p.new_empty(p.shape) if p is not None else y.new_empty((0,), dtype=torch.float32)

    return y.new_empty(y.shape, dtype=x_dtype), param_grad(weight), param_grad(bias)


def _fwd_setup_context(ctx, inputs, output):
    x, normalized_ndim, weight, bias, _eps, _out_dtype, backend = inputs
    y, rstd = output
    # The output, not the input: y is the tensor the next layer keeps anyway.
    ctx.save_for_backward(y, rstd, weight, bias)
    ctx.x_dtype = x.dtype
    ctx.normalized_ndim = normalized_ndim
    # The backend the forward ran, not whatever use_backend() says when backward runs: on CUDA
    # that is autograd's device thread, where the forward thread's use_backend() is not active.
    ctx.backend = backend
    ctx.mark_non_differentiable(rstd)


def _fwd_backward(ctx, grad_y, _grad_rstd):
    y, rstd, weight, bias = ctx.saved_tensors
    dx, dw, db = torch.ops.tempo.layernorm_bwd(grad_y.contiguous(), y, rstd, ctx.normalized_ndim, weight, bias,
                                               ctx.x_dtype, ctx.backend)
    return (dx, None, dw if weight is not None else None, db if bias is not None else None, None, None, None)


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
                      out_dtype: Optional[torch.dtype] = None) -> Tensor:
    """LayerNorm over the last ``len(normalized_shape)`` dims whose backward keeps only y and rstd.

    ``out_dtype`` None means: the autocast dtype when autocast is enabled on x's device (and x is
    fp32/fp16/bf16), else x's dtype. Statistics are always computed in fp32 (fp64 for fp64 x).
    A non-contiguous x is copied to a contiguous one first (the copy is not kept for backward).
    """
    check_float_tensor(x, "input", OP_NAME)
    shape = _as_shape(normalized_shape)
    if len(shape) == 0 or x.dim() < len(shape) or tuple(x.shape[x.dim() - len(shape):]) != shape:
        raise ValueError(
            f"{OP_NAME}: argument 'normalized_shape' {shape} must match the trailing dimensions of "
            f"the input, got input of shape {tuple(x.shape)}"
        )
    for name, param in (("weight", weight), ("bias", bias)):
        if param is not None:
            check_float_tensor(param, name, OP_NAME)
            if tuple(param.shape) != shape:
                raise ValueError(f"{OP_NAME}: argument '{name}' of shape {tuple(param.shape)} must have "
                                 f"the normalized_shape {shape}")
    if out_dtype is not None and not out_dtype.is_floating_point:
        raise TypeError(f"{OP_NAME}: argument 'out_dtype' must be a floating-point dtype, got {out_dtype}")
    n = math.prod(shape)
    y, _rstd = torch.ops.tempo.layernorm_fwd(
        x.contiguous(),
        len(shape),
        # Views of contiguous parameters (the usual case) share their storage: nothing is copied.
        weight.reshape(n).contiguous() if weight is not None else None,
        bias.reshape(n).contiguous() if bias is not None else None,
        float(eps),
        _output_dtype(x, out_dtype),
        resolve_layernorm_backend(x, n),
    )
    return y


class LayerNormParameters(nn.Module):
    """What every Tempo LayerNorm module shares with ``nn.LayerNorm``: the constructor, the
    ``weight``/``bias`` parameters (same state_dict keys, so state dicts load in both directions),
    their initialisation and the repr."""

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

    def reset_parameters(self) -> None:
        if self.elementwise_affine:
            nn.init.ones_(self.weight)
            if self.bias is not None:
                nn.init.zeros_(self.bias)

    def extra_repr(self) -> str:
        # Borrowed so the repr tracks the installed torch's nn.LayerNorm (2.13 added "bias=").
        return nn.LayerNorm.extra_repr(self)


class InplaceLayerNorm(LayerNormParameters):
    """Drop-in ``nn.LayerNorm`` whose backward keeps its output y and one fp32 rstd per row.

    Same constructor, ``weight``/``bias`` parameters, state_dict keys and repr as
    ``nn.LayerNorm``; state dicts load in both directions.

    Precision: x̂ is recovered from y as stored, so its error is about u·|y_j|/|γ_j| (u: unit
    roundoff of y's dtype); with |γ| ~ 1 this matches nn.LayerNorm's gradients to the usual
    fp32/fp16/bf16 tolerances. Double backward is not supported.

    Dtypes: under ``torch.autocast`` (fp32/fp16/bf16 input) the output is in the autocast dtype,
    computed in fp32 internally, so the next autocast Linear keeps the very same storage; outside
    autocast the output has the input's dtype. (nn.LayerNorm returns fp32 under autocast, and the
    Linear then keeps its own bf16 copy as well.)

    γ near zero: x̂ = (y − β)/γ cannot be recovered where γ_j = 0. The backward divides by γ
    clamped away from zero keeping its sign (0 counts as +): |γ_j| → max(|γ_j|, τ) with
    τ = max(1e-6 · max_k |γ_k|, 1e-12), and clamps the recovered x̂ to its feasible range
    [−√(N−1), √(N−1)]. Consequences, always with finite gradients:
      * dβ and the terms of dx that need no x̂ (rstd·(g·γ − mean(g·γ)) and the coefficient
        mean(g·γ·x̂) = mean(g·(y − β))) are exact for every feature;
      * features with |γ_j| >= τ get exact dγ_j and dx_j (up to the rounding of y in its dtype);
      * for features with |γ_j| < τ, x̂_j is approximated by x̂'_j (in exact arithmetic
        x̂'_j = x̂_j·|γ_j|/τ, shrunk towards 0; 0 at γ_j = 0), |x̂'_j| <= √(N−1), so
            |dγ_j − dγ_j,true| <= 2·√(N−1)·Σ_rows |g_rj|,
            |dx_rj − dx_rj,true| <= 2·√(N−1)·rstd_r·|mean_k(g_rk·(y_rk − β_k))|.
    """

    def forward(self, input: Tensor) -> Tensor:
        return inplace_layernorm(input, self.normalized_shape, self.weight, self.bias, self.eps)


__all__ = ["InplaceLayerNorm", "LayerNormParameters", "inplace_layernorm", "layernorm_fwd", "layernorm_bwd", "xhat_bound"]
