"""Fused dropout -> residual add -> LayerNorm whose backward keeps no mask and no input.

    y = LayerNorm(residual + dropout(x, p))

is how a post-LN Transformer closes each sub-layer. Eager PyTorch keeps, for backward, the
dropout mask (1 byte per element), the pre-LN sum (LayerNorm's input) and LayerNorm's mean and
rstd. This op keeps only its output y, which the next layer (a Linear) keeps anyway so the
storage is shared, one fp32 rstd per row and a 0-d int64 seed (plus the γ/β parameters):

  * d(sum) comes from (y, rstd, γ, β) exactly as InplaceLayerNorm's backward does it, with the
    same rule (``tempo.ops.layernorm``'s docstring): x̂_j = (y_j − β_j)/γ_j where that recovery is
    well conditioned (|γ_j| >= |β_j| + λ_D, error (u_D + 3u_c)·(|x̂_j| + 1)), and x̂_j kept by the
    forward ([rows, K] in fp32 plus K indices) for the other columns; no clamp. Non-finite γ or β
    raise in the forward naming the layer, as do γ or β on another device than x. Which columns
    are kept is planned as InplaceLayerNorm plans it: once per version of γ and β on the Triton /
    CUDA path, with no host read in a forward whose parameters are unchanged (its docstring,
    "The plan", including the one write it does not see: ``.data`` outside an optimizer step),
    and handed to the op as an input: under ``torch.compile`` the plan the module holds, checked
    by the op against the current γ/β (no data-dependent shape in the graph);
  * d(residual) = d(sum);  d(x) = d(sum) · keep / (1 − p), the keep mask regenerated from the seed.

Semantics
  * ``normalized_shape`` are the trailing dims of x, as in ``nn.LayerNorm``; x and residual have
    the same shape (no broadcasting). Not training, or ``p == 0``: no dropout (exactly
    LayerNorm(residual + x)).
  * The mask is a pure function of (seed, number of elements, p, backend): element i of the
    contiguous x is kept iff u_i >= p, with u_i = ``tl.rand(seed, i)`` (Triton's philox) on the
    Triton path and, on the reference path, u_i = (w_i + 2^31) / 2^32 for the i-th int32 half of
    full-range int64 words drawn by ``random_`` from a ``torch.Generator`` seeded with the seed
    (half the generator calls of ``torch.rand``). The paths draw different masks for one seed;
    ``dropout_add_layernorm_keep_mask`` regenerates exactly the one a path used. The seed is drawn
    from torch's RNG by default, so ``torch.manual_seed`` and ``torch.utils.checkpoint``'s RNG
    restore reproduce the mask. The backward uses the path its forward ran on (recorded then),
    even outside the forward's ``use_backend`` block.
  * Rows longer than ``MAX_TRITON_N`` elements do not fit one Triton block: they run on the
    reference path (logged once), which keeps exactly the same tensors.
  * The reference path (CPU; CUDA fallback) regenerates the mask in backward and runs aten's
    fused LayerNorm backward on the recovered x̂: on one CPU core its forward+backward costs about
    what nn.Dropout + add + nn.LayerNorm cost.
  * The regenerated mask is bit-identical to the forward's (a pure function of the seed and the
    element index on each path): nothing about dropout is approximated.
  * No backward (grad mode off, or no input/parameter requiring grad) and no dropout (eval, or
    ``p == 0``): the stock computation, ``F.layer_norm(residual + x)``, keeping nothing. With
    dropout this op runs with or without a backward, so that a no-grad forward replayed with grad
    from the same RNG state (GradCache, sentence-transformers' CachedMultipleNegativesRankingLoss)
    draws the same mask both times; under no_grad autograd keeps nothing either way. In training
    mode with ``p == 0`` it runs on the Triton path too (``runs_own_forward``): the kernel rounds
    otherwise than aten (measured on MiniLM: up to 1.9e-6 fp32, one bf16 ULP under autocast), and
    a no-grad pass (reentrant checkpointing's first) must give the bits its recompute with grad
    gives. The reference forward is aten's layer_norm of the same fp32 sum, bitwise the stock
    computation, so the stock computation stands for it there.
  * Dtypes: the sum and the statistics are computed in fp32 (fp64 when an input is fp64, reference
    path only). The output dtype is the autocast dtype when autocast is enabled on x's device and
    both inputs are fp32/fp16/bf16 (so the next autocast Linear keeps this very storage), else
    ``torch.result_type(x, residual)``. Gradients come back in each input's own dtype.
  * Inputs are made contiguous at the kernel boundary (copies are not kept); the output is a
    fresh tensor of x's shape.

Contents, in order: Triton kernels, host launchers, the PyTorch reference path, the
``tempo::dropout_add_layernorm_fwd`` / ``_bwd`` custom ops, the functional
``dropout_add_layernorm`` and the ``DropoutAddLayerNorm`` module.
"""

from __future__ import annotations

import logging
import math
import numbers
from typing import Optional, Sequence, Union

import torch
from torch import Tensor, nn
from torch.nn import functional as F

# tl, triton: None without triton (reference path only).
from tempo.ops._backend import (TRITON_DTYPES, autocast_dtype_for, check_float_tensor, check_probability, held_dropout,
                                held_dropout_rate, launch_on, resolve_backend, runs_own_forward, tl, triton)
from tempo.ops.layernorm import (
    LayerNormParameters,
    _as_shape,
    _kept_args,
    _no_param_grad,
    _num_warps,
    _partials,
    _summed_grad,
    call_with_plan,
    check_parameter_devices,
    kept_fake,
    normalize_rows_backward_reference,
    normalize_rows_reference,
    plan_for_forward,
    plan_in_forward,
    recovery_inverse,
)

if triton is not None:
    from tempo.ops.layernorm import _recover  # the one recovery of x̂, shared with InplaceLayerNorm

OP_NAME = "dropout_add_layernorm"
logger = logging.getLogger(__name__)  # "tempo.ops.dropout_add_layernorm", under the "tempo" logger
# One Triton program holds a whole row in registers; longer rows run on the reference path.
MAX_TRITON_N = 16384
# dtypes autocast would have cast to its lower-precision type (fp64 is left alone by autocast).
_AUTOCAST_ELIGIBLE = (torch.float32, torch.float16, torch.bfloat16)
_KEEP_MASK_BLOCK = 1024


# ----------------------------------------------------------------------------------------------
# Triton kernels. Every tensor is contiguous and viewed as [rows, N]: element (row, col) has the
# flat index row·N + col, which is also its philox counter, so every kernel draws the same mask.
# ----------------------------------------------------------------------------------------------
if triton is not None:

    @triton.jit
    def _keep(seed, offsets, p):
        return tl.rand(seed, offsets) >= p

    @triton.jit
    def _dal_fwd_kernel(
        X, R, Y, W, B, RSTD, SLOTS, KEPT, K, SEED, N, eps, p, scale,
        HAS_DROPOUT: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_KEPT: tl.constexpr,
        BLOCK_N: tl.constexpr,
    ):
        # One program per row; the sum and its statistics in fp32 whatever the input dtypes.
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK_N)
        in_row = cols < N
        # Row base pointers + int32 columns: per-element int64 offsets cost two registers each and
        # made the 4096-wide fp32 kernel spill on sm_80 (the compile gate caught it).
        start = row * N
        x = tl.load(X + start + cols, mask=in_row, other=0.0).to(tl.float32)
        if HAS_DROPOUT:
            x = tl.where(_keep(tl.load(SEED), start + cols, p), x * scale, 0.0)
        s = tl.load(R + start + cols, mask=in_row, other=0.0).to(tl.float32) + x
        mean = tl.sum(s, axis=0) / N
        centered = tl.where(in_row, s - mean, 0.0)
        var = tl.sum(centered * centered, axis=0) / N
        rstd = tl.math.rsqrt(var + eps)
        y = centered * rstd
        if HAS_KEPT:
            # x̂ of the columns whose recovery from y would be ill-conditioned, in fp32.
            slot = tl.load(SLOTS + cols, mask=in_row, other=-1)
            tl.store(KEPT + row * K + slot, y, mask=slot >= 0)
        if HAS_WEIGHT:
            y = y * tl.load(W + cols, mask=in_row, other=0.0).to(tl.float32)
        if HAS_BIAS:
            y = y + tl.load(B + cols, mask=in_row, other=0.0).to(tl.float32)
        tl.store(Y + start + cols, y.to(Y.dtype.element_ty), mask=in_row)
        tl.store(RSTD + row, rstd)

    @triton.jit
    def _dal_bwd_kernel(
        DY, Y, W, B, INV_W, RSTD, SLOTS, KEPT, K, SEED, DX, DR, DW_PARTIAL, DB_PARTIAL,
        M, N, rows_per_program, p, scale,
        HAS_DROPOUT: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_KEPT: tl.constexpr,
        BLOCK_N: tl.constexpr,
    ):
        # Each program walks a contiguous run of rows, writes their d(residual) and d(x), and
        # accumulates its own partial dγ/dβ in fp32; the host sums the partials (no atomics).
        # Apart on purpose from _layernorm_bwd_kernel: it writes d(residual) too, drops out dx, and
        # addresses rows as row·N + int32 columns (fewer registers than its row strides).
        pid = tl.program_id(0)
        cols = tl.arange(0, BLOCK_N)
        in_row = cols < N
        seed = tl.load(SEED)
        if HAS_WEIGHT:
            w = tl.load(W + cols, mask=in_row, other=0.0).to(tl.float32)
        dw_acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        db_acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        first_row = pid.to(tl.int64) * rows_per_program
        for i in range(0, rows_per_program):
            row = first_row + i
            # The last program's run may overhang M: such a row has no live columns (the
            # interpreter rejects a mask built from `in_row & (row < M)`).
            live = cols < tl.where(row < M, N, 0)
            start = row * N  # row base + int32 columns: fewer registers than int64 offsets
            dy = tl.load(DY + start + cols, mask=live, other=0.0).to(tl.float32)
            y = tl.load(Y + start + cols, mask=live, other=0.0).to(tl.float32)
            rstd = tl.load(RSTD + tl.minimum(row, M - 1))  # clamped index, not a scalar mask
            xhat, scaled_xhat = _recover(y, live, cols, row, W, B, INV_W, SLOTS, KEPT, K,
                                         HAS_WEIGHT, HAS_BIAS, HAS_KEPT)
            if HAS_WEIGHT:
                dy_w = dy * w
            else:
                dy_w = dy
            mean_dy_w = tl.sum(dy_w, axis=0) / N
            mean_dy_scaled = tl.sum(dy * scaled_xhat, axis=0) / N
            dsum = rstd * (dy_w - mean_dy_w - xhat * mean_dy_scaled)
            tl.store(DR + start + cols, dsum.to(DR.dtype.element_ty), mask=live)
            if HAS_DROPOUT:
                dsum = tl.where(_keep(seed, start + cols, p), dsum * scale, 0.0)
            tl.store(DX + start + cols, dsum.to(DX.dtype.element_ty), mask=live)
            dw_acc += dy * xhat
            db_acc += dy
        if HAS_WEIGHT:
            tl.store(DW_PARTIAL + pid * N + cols, dw_acc, mask=in_row)
        if HAS_BIAS:
            tl.store(DB_PARTIAL + pid * N + cols, db_acc, mask=in_row)

    @triton.jit
    def _keep_mask_kernel(OUT, SEED, numel, p, BLOCK: tl.constexpr):
        offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        keep = _keep(tl.load(SEED), offsets, p)
        tl.store(OUT + offsets, keep.to(tl.uint8), mask=offsets < numel)


# ----------------------------------------------------------------------------------------------
# Host launchers (all tensors contiguous; rows = numel / N)
# ----------------------------------------------------------------------------------------------
def _dropout_scale(p: float) -> float:
    return 1.0 / (1.0 - p)


def _fwd_triton(x: Tensor, residual: Tensor, n: int, weight: Optional[Tensor], bias: Optional[Tensor],
                seed: Tensor, eps: float, p: float, dropout: bool, out_dtype: torch.dtype,
                kept_cols: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    rows = x.numel() // n
    y = torch.empty(x.shape, dtype=out_dtype, device=x.device)  # x's shape: a fresh tensor, not a view
    rstd = torch.empty((rows,), dtype=torch.float32, device=x.device)
    kept_xhat = torch.empty((rows, kept_cols.numel()), dtype=torch.float32, device=x.device)
    block_n = triton.next_power_of_2(n)
    dummy = rstd  # stands in for absent weight/bias pointers; never read (constexpr flags)
    slots, kept_arg, k = _kept_args(kept_cols, kept_xhat, n, dummy)
    with launch_on(x):
        _dal_fwd_kernel[(rows,)](
            x, residual, y, weight if weight is not None else dummy, bias if bias is not None else dummy,
            rstd, slots, kept_arg, k, seed, n, eps, p, _dropout_scale(p),
            HAS_DROPOUT=dropout, HAS_WEIGHT=weight is not None, HAS_BIAS=bias is not None,
            HAS_KEPT=kept_cols.numel() > 0, BLOCK_N=block_n, num_warps=_num_warps(block_n),
        )
    return y, rstd, kept_xhat


def _backward_programs(rows: int, device: torch.device) -> int:
    if device.type == "cuda":
        # A few programs per SM keep every SM busy while the dγ/dβ partials stay small.
        return max(1, min(rows, 4 * torch.cuda.get_device_properties(device).multi_processor_count))
    return max(1, min(rows, 4))  # the interpreter runs programs one after another


def _bwd_triton(grad_y: Tensor, y: Tensor, rstd: Tensor, kept_cols: Tensor, kept_xhat: Tensor, n: int,
                weight: Optional[Tensor], bias: Optional[Tensor], seed: Tensor, p: float, dropout: bool,
                x_dtype: torch.dtype, residual_dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    rows = rstd.numel()
    dx = torch.empty(y.shape, dtype=x_dtype, device=y.device)
    dr = torch.empty(y.shape, dtype=residual_dtype, device=y.device)
    block_n = triton.next_power_of_2(n)
    programs = _backward_programs(rows, y.device)
    rows_per_program = triton.cdiv(rows, programs)
    programs = triton.cdiv(rows, rows_per_program)
    dw_partial, db_partial = _partials(weight, programs, n, y), _partials(bias, programs, n, y)
    dummy = rstd
    inv_w = recovery_inverse(weight.reshape(n), kept_cols) if weight is not None else dummy
    slots, kept_arg, k = _kept_args(kept_cols, kept_xhat, n, dummy)
    with launch_on(y):
        _dal_bwd_kernel[(programs,)](
            grad_y, y,
            weight if weight is not None else dummy, bias if bias is not None else dummy,
            inv_w, rstd, slots, kept_arg, k, seed, dx, dr,
            dw_partial if dw_partial is not None else dummy, db_partial if db_partial is not None else dummy,
            rows, n, rows_per_program, p, _dropout_scale(p),
            HAS_DROPOUT=dropout, HAS_WEIGHT=weight is not None, HAS_BIAS=bias is not None,
            HAS_KEPT=kept_cols.numel() > 0, BLOCK_N=block_n, num_warps=_num_warps(block_n),
        )
    return dx, dr, _summed_grad(dw_partial, weight, y), _summed_grad(db_partial, bias, y)


def _triton_keep_mask(seed: Tensor, numel: int, p: float, device: torch.device) -> Tensor:
    out = torch.empty((numel,), dtype=torch.uint8, device=device)
    if numel:
        with launch_on(out):
            _keep_mask_kernel[(triton.cdiv(numel, _KEEP_MASK_BLOCK),)](out, seed, numel, p, BLOCK=_KEEP_MASK_BLOCK)
    return out.view(torch.bool)


# ----------------------------------------------------------------------------------------------
# Reference implementation (any device, any float dtype; keeps the same tensors as the kernels).
# Written for speed on the CPU, where the BERT trainer runs it in every layer: aten's fused
# LayerNorm in forward and (when no γ is clamped) in backward, the mask as one fused multiply.
# ----------------------------------------------------------------------------------------------
def _compute_dtype(*dtypes: torch.dtype) -> torch.dtype:
    # fp32 statistics, except with an fp64 input (reference path only): full precision.
    return torch.float64 if torch.float64 in dtypes else torch.float32


def _flat(param: Optional[Tensor], n: int) -> Optional[Tensor]:
    return param.reshape(n) if param is not None else None


def _reference_random_words(seed: Tensor, numel: int, device: torch.device) -> Tensor:
    """``numel`` int32 words uniform over the full 32-bit range, from a Generator seeded with ``seed``.

    Drawn as full-range int64 words split in halves: the CPU generator is serial, making it the
    reference path's main cost, and this needs half as many generator calls as torch.rand
    (measured 7 ms instead of 16 ms for 4M elements on one core).
    """
    # Host sync on seed.item(): acceptable, this is the CPU / fallback path.
    generator = torch.Generator(device=device)
    generator.manual_seed(int(seed.item()))
    words = torch.empty(((numel + 1) // 2,), dtype=torch.int64, device=device)
    words.random_(-(2**63), None, generator=generator)  # to=None: the full 64-bit range
    return words.view(torch.int32)[:numel]


def _keep_threshold(p: float) -> int:
    # Word w stands for u = (w + 2^31) / 2^32 in [0, 1); it is kept iff u >= p, i.e. w >= this.
    return min(math.ceil(p * 2**32) - 2**31, 2**31 - 1)


def _reference_keep_mask(seed: Tensor, numel: int, p: float, device: torch.device) -> Tensor:
    return _reference_random_words(seed, numel, device) >= _keep_threshold(p)


def _reference_keep_float(seed: Tensor, shape: Sequence[int], p: float, device: torch.device,
                          dtype: torch.dtype) -> Tensor:
    """The reference keep mask as 1.0 / 0.0 in ``dtype``, so that applying it is one fused
    multiply (addcmul / mul_): on the CPU, torch.where with a scalar costs about four multiplies."""
    return _reference_keep_mask(seed, math.prod(shape), p, device).view(shape).to(dtype)


def _fwd_reference(x: Tensor, residual: Tensor, normalized_shape: list[int], weight: Optional[Tensor],
                   bias: Optional[Tensor], seed: Tensor, eps: float, p: float, dropout: bool, out_dtype: torch.dtype,
                   kept_cols: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    compute = _compute_dtype(x.dtype, residual.dtype)
    n = math.prod(normalized_shape)
    xc, rc = x.to(compute), residual.to(compute)
    if dropout:
        keep = _reference_keep_float(seed, x.shape, p, x.device, compute)
        s = torch.addcmul(rc, xc, keep, value=_dropout_scale(p))
        del keep
    else:
        s = rc + xc
    # aten's fused LayerNorm (its mean is dropped, its rstd is the one the kernels keep).
    return normalize_rows_reference(s, normalized_shape, _flat(weight, n), _flat(bias, n), eps, out_dtype, kept_cols)


def _bwd_reference(grad_y: Tensor, y: Tensor, rstd: Tensor, kept_cols: Tensor, kept_xhat: Tensor, n: int,
                   weight: Optional[Tensor], bias: Optional[Tensor], seed: Tensor, p: float, dropout: bool,
                   x_dtype: torch.dtype, residual_dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    dsum, dw, db = normalize_rows_backward_reference(
        grad_y.reshape(-1, n), y.reshape(-1, n), rstd, kept_cols, kept_xhat,
        _flat(weight, n), _flat(bias, n))
    dw = dw.view(weight.shape).to(weight.dtype) if weight is not None else _no_param_grad(y)
    db = db.view(bias.shape).to(bias.dtype) if bias is not None else _no_param_grad(y)
    dsum = dsum.view(y.shape)
    dr = dsum.to(residual_dtype)
    if dropout:
        keep = _reference_keep_float(seed, y.shape, p, y.device, rstd.dtype)
        dx = keep.mul_(dsum).mul_(_dropout_scale(p)).to(x_dtype)
    else:
        # Outputs of a custom op may not alias each other.
        dx = dsum.to(x_dtype, copy=dr.dtype == x_dtype)
    return dx, dr, dw, db


def dropout_add_layernorm_keep_mask(seed: Tensor, shape: Sequence[int], p: float, device,
                                    backend: str) -> Tensor:
    """The bool keep-mask (True = kept) ``backend`` draws for an x of ``shape`` with ``seed``.

    ``backend`` is the path that ran, "triton" or "reference" (not "auto"); rows longer than
    ``MAX_TRITON_N`` and empty inputs always run "reference".
    """
    shape = tuple(int(s) for s in shape)
    device = torch.device(device)
    p = check_probability(p, "p", "dropout_add_layernorm_keep_mask")
    seed = seed.to(device=device, dtype=torch.int64).reshape(())
    numel = math.prod(shape)
    if backend == "reference":
        keep = _reference_keep_mask(seed, numel, p, device)
    elif backend == "triton":
        keep = _triton_keep_mask(seed, numel, p, device)
    else:
        raise ValueError(f"dropout_add_layernorm_keep_mask: argument 'backend' must be 'triton' or "
                         f"'reference', got {backend!r}")
    return keep.view(shape)


# ----------------------------------------------------------------------------------------------
# Custom ops (torch.compile traces them as single nodes; autograd keeps y, rstd and the seed).
# ``backend`` is resolved by the caller: the op is a pure function of its arguments, and the
# backward op gets the very path the forward took.
# ----------------------------------------------------------------------------------------------
def _rows(shape: Sequence[int], normalized_shape: Sequence[int]) -> int:
    return math.prod(shape[: len(shape) - len(normalized_shape)])


def _check_op_backend(backend: str, n: int, where: str) -> None:
    if backend not in ("triton", "reference"):
        raise ValueError(f"{where}: argument 'backend' must be 'triton' or 'reference', got {backend!r}")
    if backend == "triton" and n > MAX_TRITON_N:
        raise ValueError(f"{where}: the Triton kernels handle rows of at most {MAX_TRITON_N} elements, "
                         f"got {n}; use backend 'reference'")


@torch.library.custom_op("tempo::dropout_add_layernorm_fwd", mutates_args=())
def dropout_add_layernorm_fwd(x: Tensor, residual: Tensor, normalized_shape: list[int], weight: Optional[Tensor],
                              bias: Optional[Tensor], kept_cols: Tensor, seed: Tensor, eps: float, p: float,
                              training: bool, out_dtype: torch.dtype, backend: str,
                              name: str) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """x, residual contiguous, same shape; ``kept_cols`` int64 [K] the plan (``plan_for_forward``) ->
    (y of x's shape in out_dtype, rstd [rows] fp32 (fp64 when an input is fp64), the kept columns
    used, int64 [K] (those of the current γ/β: ``plan_in_forward``), kept_xhat [rows, K] in rstd's
    dtype). weight/bias have ``normalized_shape``; seed is a 0-d int64 tensor; ``name`` names the
    layer in errors."""
    n = math.prod(normalized_shape)
    _check_op_backend(backend, n, "tempo::dropout_add_layernorm_fwd")
    dropout = training and p > 0.0
    # γ and β as the op got them (the Parameters themselves, usually): the plan cache knows them by
    # identity, and a view made here, below autograd, would not be tracked as one.
    kept_cols = plan_in_forward(kept_cols, weight, bias, out_dtype, n, x.device, name, backend)
    with torch.autocast(x.device.type, enabled=False):
        if backend == "triton" and x.numel() > 0:
            y, rstd, kept_xhat = _fwd_triton(x, residual, n, weight, bias, seed, eps, p, dropout, out_dtype,
                                             kept_cols)
        else:
            y, rstd, kept_xhat = _fwd_reference(x, residual, normalized_shape, weight, bias, seed, eps, p, dropout,
                                                out_dtype, kept_cols)
    return y, rstd, kept_cols, kept_xhat


@dropout_add_layernorm_fwd.register_fake
def _(x, residual, normalized_shape, weight, bias, kept_cols, seed, eps, p, training, out_dtype, backend, name):
    rows = _rows(x.shape, normalized_shape)
    compute = _compute_dtype(x.dtype, residual.dtype)
    return (x.new_empty(x.shape, dtype=out_dtype), x.new_empty((rows,), dtype=compute),
            *kept_fake(rows, kept_cols, x, compute))


@torch.library.custom_op("tempo::dropout_add_layernorm_bwd", mutates_args=())
def dropout_add_layernorm_bwd(grad_y: Tensor, y: Tensor, rstd: Tensor, kept_cols: Tensor, kept_xhat: Tensor,
                              normalized_shape: list[int], weight: Optional[Tensor], bias: Optional[Tensor],
                              seed: Tensor, p: float, training: bool, x_dtype: torch.dtype,
                              residual_dtype: torch.dtype, backend: str) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """-> (dx in x_dtype, dresidual in residual_dtype, dγ, dβ in the parameters' dtypes); an
    absent γ/β gets an empty tensor. ``backend`` must be the one the forward ran on."""
    n = math.prod(normalized_shape)
    _check_op_backend(backend, n, "tempo::dropout_add_layernorm_bwd")
    dropout = training and p > 0.0
    with torch.autocast(y.device.type, enabled=False):
        if backend == "triton" and y.numel() > 0:
            return _bwd_triton(grad_y, y, rstd, kept_cols, kept_xhat, n, weight, bias, seed, p, dropout, x_dtype,
                               residual_dtype)
        return _bwd_reference(grad_y, y, rstd, kept_cols, kept_xhat, n, weight, bias, seed, p, dropout, x_dtype,
                              residual_dtype)


@dropout_add_layernorm_bwd.register_fake
def _(grad_y, y, rstd, kept_cols, kept_xhat, normalized_shape, weight, bias, seed, p, training, x_dtype,
      residual_dtype, backend):
    def param_grad(param):
        return param.new_empty(param.shape) if param is not None else y.new_empty((0,), dtype=torch.float32)

    return (y.new_empty(y.shape, dtype=x_dtype), y.new_empty(y.shape, dtype=residual_dtype),
            param_grad(weight), param_grad(bias))


def _setup_context(ctx, inputs, output):
    x, residual, normalized_shape, weight, bias, _plan, seed, _eps, p, training, _out_dtype, backend, _name = inputs
    y, rstd, kept_cols, kept_xhat = output
    # The output, not the inputs: y is the tensor the next layer keeps anyway. No mask: the seed.
    # x̂ only of the columns where y cannot give it back.
    ctx.save_for_backward(y, rstd, kept_cols, kept_xhat, weight, bias, seed)
    ctx.mark_non_differentiable(rstd, kept_cols, kept_xhat)
    ctx.normalized_shape, ctx.p, ctx.training, ctx.backend = normalized_shape, p, training, backend
    ctx.x_dtype, ctx.residual_dtype = x.dtype, residual.dtype


def _backward(ctx, grad_y, _grad_rstd, _grad_cols, _grad_kept):
    y, rstd, kept_cols, kept_xhat, weight, bias, seed = ctx.saved_tensors
    dx, dr, dw, db = torch.ops.tempo.dropout_add_layernorm_bwd(
        grad_y.contiguous(), y, rstd, kept_cols, kept_xhat, ctx.normalized_shape, weight, bias, seed, ctx.p,
        ctx.training, ctx.x_dtype, ctx.residual_dtype, ctx.backend)
    return (dx, dr, None, dw if weight is not None else None, db if bias is not None else None,
            None, None, None, None, None, None, None, None)


dropout_add_layernorm_fwd.register_autograd(_backward, setup_context=_setup_context)


# ----------------------------------------------------------------------------------------------
# Functional API and module
# ----------------------------------------------------------------------------------------------
_ShapeLike = Union[int, Sequence[int], torch.Size]
_long_row_fallback_logged = False


def _choose_backend(x: Tensor, residual: Tensor, n: int) -> str:
    """The path that will run: resolve_backend, then the documented reference-path cases."""
    global _long_row_fallback_logged
    # Resolve on an input the kernels cannot take, if any, so a forced 'triton' names its dtype.
    backend = resolve_backend(residual if residual.dtype not in TRITON_DTYPES else x, OP_NAME)
    if backend != "triton":
        return backend
    if x.numel() == 0:
        return "reference"  # nothing to compute, no mask to draw
    if n > MAX_TRITON_N:
        if not _long_row_fallback_logged:
            _long_row_fallback_logged = True
            logger.warning("%s: rows of %d elements exceed the Triton block limit (%d); using the "
                           "PyTorch reference path for them (same saved tensors, slower)",
                           OP_NAME, n, MAX_TRITON_N)
        return "reference"
    return "triton"


def _output_dtype(x: Tensor, residual: Tensor) -> torch.dtype:
    autocast_dtype = autocast_dtype_for(x)
    if autocast_dtype is not None and x.dtype in _AUTOCAST_ELIGIBLE and residual.dtype in _AUTOCAST_ELIGIBLE:
        return autocast_dtype
    # = torch.result_type(x, residual) for same-shape tensors; promote_types also traces in dynamo.
    return torch.promote_types(x.dtype, residual.dtype)


def draw_seed(device: torch.device | str) -> Tensor:
    """A 0-d int64 seed from torch's RNG on ``device``, without a host sync."""
    return torch.randint(0, 2**31 - 1, (), device=device, dtype=torch.int64)


def dropout_add_layernorm(x: Tensor, residual: Tensor, normalized_shape: _ShapeLike,
                          weight: Optional[Tensor] = None, bias: Optional[Tensor] = None, eps: float = 1e-5,
                          p: float = 0.5, training: bool = True, seed: Optional[Tensor] = None,
                          name: Optional[str] = None) -> Tensor:
    """``layer_norm(residual + dropout(x, p, training), normalized_shape, weight, bias, eps)``.

    Keeps for backward only the output, one rstd per row and a seed (see the module docstring
    for dtypes and the mask). ``p``/``training`` default as in ``F.dropout``. ``seed`` (a
    one-element integer tensor) fixes the mask; by default one is drawn from torch's RNG.
    ``name`` names the layer in errors (non-finite γ/β). Without a backward and without dropout it runs the stock ops.
    Under torch.compile this functional form makes its plan from γ/β's values inside the graph (a
    data-dependent shape: torch.compile may break the graph there, logged once); the module
    (``DropoutAddLayerNorm``) hands the plan it holds instead and traces without a break.
    """
    return _dropout_add_layernorm(x, residual, normalized_shape, weight, bias, eps, p, training, seed, name,
                                  holder=None)


def _dropout_add_layernorm(x: Tensor, residual: Tensor, normalized_shape: _ShapeLike, weight: Optional[Tensor],
                           bias: Optional[Tensor], eps: float, p: float, training: bool, seed: Optional[Tensor],
                           name: Optional[str], holder: Optional[nn.Module]) -> Tensor:
    """``dropout_add_layernorm``; ``holder``: the module whose held plan a compiled forward hands the op."""
    check_float_tensor(x, "x", OP_NAME)
    check_float_tensor(residual, "residual", OP_NAME)
    if residual.shape != x.shape:
        raise ValueError(f"{OP_NAME}: argument 'residual' of shape {tuple(residual.shape)} must have the "
                         f"shape of argument 'x', {tuple(x.shape)} (no broadcasting)")
    if residual.device != x.device:
        raise ValueError(f"{OP_NAME}: argument 'residual' is on {residual.device}, argument 'x' on {x.device}")
    shape = _as_shape(normalized_shape, OP_NAME)
    if len(shape) == 0 or x.dim() < len(shape) or tuple(x.shape[x.dim() - len(shape):]) != shape:
        raise ValueError(f"{OP_NAME}: argument 'normalized_shape' {shape} must match the trailing "
                         f"dimensions of 'x', got x of shape {tuple(x.shape)}")
    for arg, param in (("weight", weight), ("bias", bias)):
        if param is not None:
            check_float_tensor(param, arg, OP_NAME)
            if tuple(param.shape) != shape:
                raise ValueError(f"{OP_NAME}: argument '{arg}' of shape {tuple(param.shape)} must have "
                                 f"the normalized_shape {shape}")
    check_parameter_devices(x, weight, bias, name or OP_NAME)
    if isinstance(eps, bool) or not isinstance(eps, numbers.Real) or not eps >= 0:
        raise ValueError(f"{OP_NAME}: argument 'eps' must be a non-negative float, got {eps!r}")
    p = check_probability(p, "p", OP_NAME)
    if not isinstance(training, bool):
        raise TypeError(f"{OP_NAME}: argument 'training' must be a bool, got {type(training).__name__}")
    dropout = training and p > 0.0
    out_dtype = _output_dtype(x, residual)
    n = math.prod(shape)
    # In training mode the Triton path runs without a backward too (runs_own_forward); the
    # reference forward gives the stock computation's bits, so that stands for it.
    own = training and _choose_backend(x, residual, n) == "triton"
    if not dropout and not runs_own_forward(own, x, residual, weight, bias):
        # Nothing will be kept: the stock ops (aten's fused LayerNorm, fp32 statistics), returned
        # in the dtype the Tempo path returns so the model behaves the same either way. With
        # dropout the Tempo path runs even without a backward: a no-grad forward replayed with
        # grad from the same RNG state (GradCache) must draw the same mask.
        with torch.autocast(x.device.type, enabled=False):
            compute = _compute_dtype(x.dtype, residual.dtype)
            s = residual.to(compute) + F.dropout(x.to(compute), p, training)
            y = F.layer_norm(s, shape, weight.to(compute) if weight is not None else None,
                             bias.to(compute) if bias is not None else None, eps)
        return y.to(out_dtype)
    if seed is None:
        seed = draw_seed(x.device) if dropout else torch.zeros((), dtype=torch.int64, device=x.device)
    else:
        if (not isinstance(seed, Tensor) or seed.is_floating_point() or seed.is_complex()
                or seed.dtype == torch.bool or seed.numel() != 1):
            raise TypeError(f"{OP_NAME}: argument 'seed' must be a one-element integer tensor")
        seed = seed.to(device=x.device, dtype=torch.int64).reshape(())

    # Contiguous parameters (the usual case) pass through without a copy.
    weight = weight.contiguous() if weight is not None else None
    bias = bias.contiguous() if bias is not None else None
    backend = _choose_backend(x, residual, n)
    name = name or OP_NAME
    kept_cols = plan_for_forward(holder, x, weight, bias, out_dtype, n, backend, name)
    y, _rstd, _cols, _kept = call_with_plan(
        dropout_add_layernorm_fwd, kept_cols, x.contiguous(), residual.contiguous(), list(shape), weight, bias,
        kept_cols, seed, float(eps), p, training, out_dtype, backend, name)
    return y


class DropoutAddLayerNorm(LayerNormParameters):
    """``LayerNorm(residual + Dropout(p)(x))`` in one op that keeps no mask and no input.

    ``forward(x, residual)``. Same ``weight``/``bias`` parameters and state_dict keys as
    ``nn.LayerNorm`` (state dicts load both ways with ``nn.LayerNorm`` and ``InplaceLayerNorm``).
    Dropout is the identity in eval mode or with ``p == 0``. Backward keeps only the output, one
    fp32 rstd per row, an 8-byte seed, and x̂ of the (usually no) columns whose γ is too small
    against β to recover it, exactly as ``InplaceLayerNorm``.
    Double backward is not supported.
    """

    def __init__(self, normalized_shape: _ShapeLike, p: float = 0.0, eps: float = 1e-5,
                 elementwise_affine: bool = True, bias: bool = True, device=None, dtype=None, *,
                 dropout: Optional[nn.Dropout] = None) -> None:
        super().__init__(normalized_shape, eps, elementwise_affine, bias, device, dtype, op=OP_NAME)
        # apply_tempo passes the block's own module; its rate and flag are read at every forward.
        self.dropout = held_dropout(p, dropout, "DropoutAddLayerNorm")

    p = held_dropout_rate("p", "DropoutAddLayerNorm")

    def forward(self, x: Tensor, residual: Tensor) -> Tensor:
        return _dropout_add_layernorm(x, residual, self.normalized_shape, self.weight, self.bias, self.eps,
                                      float(self.dropout.p), self.dropout.training, None,
                                      self.tempo_name or type(self).__name__, holder=self)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, p={self.p}"


__all__ = [
    "DropoutAddLayerNorm",
    "dropout_add_layernorm",
    "dropout_add_layernorm_keep_mask",
    "dropout_add_layernorm_fwd",
    "dropout_add_layernorm_bwd",
    "MAX_TRITON_N",
]
