"""Combined softmax -> dropout -> matmul: ``matmul(dropout(softmax(x, dim), p), v)``.

The attention core of a Transformer. Eager PyTorch keeps, for backward, the softmax output,
the dropout mask (1 byte per element) and the dropout output (the matmul's input). This op
keeps only the softmax output ``s`` and ``v``, plus a 0-d int64 seed tensor: the dropout mask
is regenerated from the seed in backward, and the dropout output is recomputed from ``s`` and
the mask when the matmul's gradient needs it.

Semantics
  * Softmax along ``dim`` (computed in fp32; fp64 on the reference path for fp64 inputs), then
    ``torch.matmul(probs, v)`` exactly as written, for any ``dim``: with ``dim=-1`` (attention)
    the softmax dimension is the one the matmul contracts with ``v``'s second-to-last dim.
    ``x`` and ``v`` need at least 2 dims; their batch dims broadcast as in ``torch.matmul``.
  * Dropout drops each probability with probability ``p`` and scales the kept ones by
    1 / (1 - p), as ``torch.nn.functional.dropout``. Not training, or ``p == 0``: no dropout.
  * The mask is a pure function of (seed, shape of x with ``dim`` moved last, p, backend):
    the Triton path uses Triton's philox (``tl.rand(seed, flat index)``), the reference path a
    ``torch.Generator`` seeded with ``seed.item()``. The two paths draw different masks for
    the same seed; ``dropout_keep_mask`` regenerates exactly the mask either one uses. The
    backward uses the backend its forward ran on (recorded at forward time), so the mask matches
    even when backward runs outside the forward's ``use_backend`` block.
  * The Triton path handles softmax rows of up to ``MAX_TRITON_ROW`` elements (one program per
    row: rows up to ``SINGLE_PASS_MAX`` held in registers, longer ones walked in chunks twice);
    longer rows run on the reference path, logged once, and so does their backward.
  * Dtypes: ``s`` is stored in ``x``'s dtype; the probabilities are cast to ``v``'s dtype for
    the matmul, so the output has ``v``'s dtype. Under autocast (custom ops are not on
    autocast's lists, so the module decides) fp32/fp16/bf16 ``x`` and ``v`` behave like
    ``torch.matmul(dropout(softmax(x)), v)`` under autocast: softmax in fp32, then ``s`` stored
    and the matmul run in the autocast dtype (``v`` is cast to it).
  * Masks: additive ``torch.finfo(dtype).min`` masks behave as in torch (a fully masked row
    becomes uniform). A row that is entirely ``-inf`` gives probabilities 0 (torch gives NaN),
    so its output row and its gradients are 0. NaN in a row still gives a NaN row.
  * Inputs are made contiguous (with ``dim`` moved last) at the kernel boundary. Every Triton
    launch runs inside ``launch_on`` (on the device and current stream of its tensors).
  * Exactness: what backward recovers instead of keeping (tests/test_attention_exactness.py checks
    each bound elementwise: logits up to 1e4, finfo.min and −inf masks, fully masked rows,
    fp32/bf16/fp16/bf16 autocast, both backends). u_s, u_v, u_x: unit roundoff of s's, v's and
    x's dtype (2^-24, 2^-8, 2^-11 for fp32, bf16, fp16; twice that on Triton's interpreter, which
    truncates 16-bit stores); η: half the dtype's smallest subnormal spacing (fp16: 2^-25, so
    probabilities below 6e-8 are kept as 0); u_c = 2^-24.
      - The dropout mask: regenerated from the seed on the backend the forward ran: bitwise.
      - s, the kept softmax output, is P (the forward's fp32 probabilities) rounded to its dtype:
        |s − P| <= u_s·P + η_s. Eager keeps the same rounded output when it runs in that dtype
        (no autocast): the two backward passes then agree to the last bits.
      - D = s·keep/(1 − p) in v's dtype, for dv = Dᵀ dO:
        |ΔD| <= (|s − P| + u_v·P)·keep/(1 − p) + η_v.
      - dx_j = s_j (g_j − Σ_k s_k g_k), g = (dO vᵀ)∘keep/(1 − p), G = Σ_k P_k g_k: the error
        from s is <= |s_j − P_j|·|g_j − G| + P_j·Σ_k |s_k − P_k||g_k|, plus
        (n + 4)·u_c·P_j(|g_j − G| + Σ_k P_k|g_k|) of fp32 arithmetic and u_x|dx_j| of the final
        rounding. No condition on the logits or the
        masks. Under autocast eager keeps the fp32 softmax output and this op the autocast-dtype
        one: dx then carries bf16's 2^-8 relative to P_j(|g_j − G| + Σ P|g|), which exceeds |dx_j|
        where g_j − G cancels (peaked rows): measured dx up to ~7x farther from fp64 than eager's
        under bf16 autocast (out and dv as eager's). Keeping s in fp32 there would be exact as
        eager, for 2 more bytes per score.
  * No backward (grad mode off, or neither ``x`` nor ``v`` requires grad: eval of a frozen
    model, ``torch.no_grad()``, ``torch.inference_mode()``) in eval mode (``training=False``):
    nothing is kept, so the stock ops run, ``matmul(aten._safe_softmax(x, dim), v)``, same
    semantics (a row all -inf gives 0) and dtypes, whatever ``use_backend`` says. In training mode
    this op runs with or without a backward (``runs_own_forward``): the output must be the bits
    and the mask the one a backward would compute and draw, so that a no-grad forward replayed
    with grad (activation checkpointing's first pass and its recompute, GradCache, sentence-
    transformers' CachedMultipleNegativesRankingLoss) gives the same both times (the Triton
    softmax rounds otherwise than aten's). Autograd keeps nothing under no_grad either way.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor, nn

# tl, triton: None without triton (reference path only).
from tempo.ops._backend import (TRITON_DTYPES, autocast_dtype_for, check_float_tensor, check_probability, held_dropout,
                                held_dropout_rate, launch_on, log_fallback_once, resolve_backend, runs_own_forward, tl,
                                triton)

_OP = "combined_softmax_dropout_matmul"
# Softmax rows longer than this run on the reference path (logged once); attention rows are
# far shorter.
MAX_TRITON_ROW = 65536
# Rows up to this length are held in registers by one program (one read of each input); longer
# rows are walked in LONG_BLOCK chunks, twice (a whole 16384-row in registers spills: measured
# with `python -m tempo.ops.compile_check`).
SINGLE_PASS_MAX = 8192
LONG_BLOCK = 4096
_LONG_WARPS = 8
# Elementwise kernels (the dropout mask / output regenerated from the seed).
_FLAT_BLOCK = 1024
# The backward walks the flattened batch (b·heads) in about this many chunks; see _combined_bwd_op.
BACKWARD_CHUNKS = 8


# ----------------------------------------------------------------------------------------
# Triton kernels: one program per row of the (dim-moved-last, contiguous) tensor. The dropout
# mask's philox counter is the element's flat index in that whole tensor (plus ``rng_base`` for
# a kernel that sees a slice starting at flat index rng_base), so every kernel regenerates the
# forward's mask.
# ----------------------------------------------------------------------------------------
if triton is not None:

    @triton.jit
    def _keep_from_seed(seed_ptr, offsets, p):
        seed = tl.load(seed_ptr)
        return tl.rand(seed, offsets) >= p

    @triton.jit
    def _store_probs(s_ptr, d_ptr, seed_ptr, offsets, in_row, probs, p, scale,
                     HAS_DROPOUT: tl.constexpr, WRITE_D: tl.constexpr):
        # s = the softmax (kept for backward); d = its dropout, the matmul's input, when asked for.
        tl.store(s_ptr + offsets, probs.to(s_ptr.dtype.element_ty), mask=in_row)
        if HAS_DROPOUT:
            keep = _keep_from_seed(seed_ptr, offsets, p)
            probs = tl.where(keep, probs * scale, 0.0)
        if WRITE_D:
            tl.store(d_ptr + offsets, probs.to(d_ptr.dtype.element_ty), mask=in_row)

    @triton.jit
    def _dropped_grad(dd_ptr, cols, in_row, seed_ptr, counters, p, scale, HAS_DROPOUT: tl.constexpr):
        # dS = dD * mask * scale in fp32 at dd_ptr + cols, the mask regenerated from the seed at ``counters``.
        ds = tl.load(dd_ptr + cols, mask=in_row, other=0.0).to(tl.float32)
        if HAS_DROPOUT:
            keep = _keep_from_seed(seed_ptr, counters, p)
            ds = tl.where(keep, ds * scale, 0.0)
        return ds

    @triton.jit
    def _softmax_dropout_fwd_kernel(x_ptr, s_ptr, d_ptr, seed_ptr, n_cols, p, scale,
                                    HAS_DROPOUT: tl.constexpr, WRITE_D: tl.constexpr,
                                    BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        in_row = cols < n_cols
        offsets = row * n_cols + cols
        x = tl.load(x_ptr + offsets, mask=in_row, other=-float("inf")).to(tl.float32)
        row_max = tl.max(x, axis=0)
        # An all -inf row: shift by 0 so exp gives 0 (not NaN), and return zeros below.
        row_max = tl.where(row_max == -float("inf"), 0.0, row_max)
        e = tl.exp(x - row_max)
        total = tl.sum(e, axis=0)
        probs = e / tl.where(total == 0.0, 1.0, total)
        _store_probs(s_ptr, d_ptr, seed_ptr, offsets, in_row, probs, p, scale, HAS_DROPOUT, WRITE_D)

    @triton.jit
    def _softmax_dropout_fwd_long_kernel(x_ptr, s_ptr, d_ptr, seed_ptr, n_cols, p, scale,
                                         HAS_DROPOUT: tl.constexpr, WRITE_D: tl.constexpr,
                                         BLOCK: tl.constexpr):
        # Rows longer than SINGLE_PASS_MAX. Pass 1: running max and sum of exp per lane over the
        # chunks (online softmax), combined at the end; pass 2 rereads x and writes s (and d).
        row = tl.program_id(0).to(tl.int64)
        base = row * n_cols
        lane_max = tl.full([BLOCK], -float("inf"), tl.float32)
        lane_total = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, n_cols, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            x = tl.load(x_ptr + base + cols, mask=cols < n_cols, other=-float("inf")).to(tl.float32)
            new_max = tl.maximum(lane_max, x)
            shift = tl.where(new_max == -float("inf"), 0.0, new_max)  # all -inf so far: no NaN
            lane_total = lane_total * tl.exp(lane_max - shift) + tl.exp(x - shift)
            lane_max = new_max
        row_max = tl.max(lane_max, axis=0)
        row_max = tl.where(row_max == -float("inf"), 0.0, row_max)
        total = tl.sum(lane_total * tl.exp(lane_max - row_max), axis=0)
        total = tl.where(total == 0.0, 1.0, total)
        for start in range(0, n_cols, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            in_row = cols < n_cols
            offsets = base + cols
            x = tl.load(x_ptr + offsets, mask=in_row, other=-float("inf")).to(tl.float32)
            probs = tl.exp(x - row_max) / total
            _store_probs(s_ptr, d_ptr, seed_ptr, offsets, in_row, probs, p, scale, HAS_DROPOUT, WRITE_D)

    @triton.jit
    def _dropout_from_seed_kernel(s_ptr, out_ptr, seed_ptr, n_elements, rng_base, p, scale,
                                  WRITE_MASK: tl.constexpr, BLOCK: tl.constexpr):
        # Elementwise over the flat tensor. WRITE_MASK: out = keep mask (uint8); else
        # out = s * keep * scale (the dropout output).
        offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        in_range = offsets < n_elements
        keep = _keep_from_seed(seed_ptr, offsets + rng_base, p)
        if WRITE_MASK:
            tl.store(out_ptr + offsets, keep.to(tl.uint8), mask=in_range)
        else:
            s = tl.load(s_ptr + offsets, mask=in_range, other=0.0).to(tl.float32)
            tl.store(out_ptr + offsets, tl.where(keep, s * scale, 0.0).to(out_ptr.dtype.element_ty),
                     mask=in_range)

    @triton.jit
    def _softmax_dropout_bwd_kernel(dd_ptr, s_ptr, dx_ptr, seed_ptr, n_cols, rng_base, p, scale,
                                    HAS_DROPOUT: tl.constexpr, BLOCK: tl.constexpr):
        # dS = dD * mask * scale; dx = s * (dS - sum(dS * s)).
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        in_row = cols < n_cols
        offsets = row * n_cols + cols
        ds = _dropped_grad(dd_ptr, offsets, in_row, seed_ptr, offsets + rng_base, p, scale, HAS_DROPOUT)
        s = tl.load(s_ptr + offsets, mask=in_row, other=0.0).to(tl.float32)
        dot = tl.sum(ds * s, axis=0)
        tl.store(dx_ptr + offsets, (s * (ds - dot)).to(dx_ptr.dtype.element_ty), mask=in_row)

    @triton.jit
    def _softmax_dropout_bwd_long_kernel(dd_ptr, s_ptr, dx_ptr, seed_ptr, n_cols, rng_base, p, scale,
                                         HAS_DROPOUT: tl.constexpr, BLOCK: tl.constexpr):
        # Rows longer than SINGLE_PASS_MAX: pass 1 sums dS * s over the chunks, pass 2 rereads
        # (and regenerates the mask) to write dx.
        row = tl.program_id(0).to(tl.int64)
        base = row * n_cols
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, n_cols, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            in_row = cols < n_cols
            ds = _dropped_grad(dd_ptr + base, cols, in_row, seed_ptr, base + cols + rng_base, p, scale, HAS_DROPOUT)
            acc += ds * tl.load(s_ptr + base + cols, mask=in_row, other=0.0).to(tl.float32)
        dot = tl.sum(acc, axis=0)
        for start in range(0, n_cols, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            in_row = cols < n_cols
            ds = _dropped_grad(dd_ptr + base, cols, in_row, seed_ptr, base + cols + rng_base, p, scale, HAS_DROPOUT)
            s = tl.load(s_ptr + base + cols, mask=in_row, other=0.0).to(tl.float32)
            tl.store(dx_ptr + base + cols, (s * (ds - dot)).to(dx_ptr.dtype.element_ty), mask=in_row)


# ----------------------------------------------------------------------------------------
# Host launchers (all tensors contiguous, softmax dim last).
# ----------------------------------------------------------------------------------------
def _row_config(n_cols: int) -> tuple[bool, int, int]:
    """(long, BLOCK, num_warps) for softmax rows of ``n_cols``."""
    if n_cols > MAX_TRITON_ROW:  # the functional API routes such rows to the reference path
        raise ValueError(f"{_OP}: the Triton kernels handle softmax rows of at most {MAX_TRITON_ROW} "
                         f"elements, got {n_cols}")
    if n_cols <= SINGLE_PASS_MAX:
        block = triton.next_power_of_2(max(n_cols, 1))
        return False, block, 4 if block <= 2048 else (8 if block <= 4096 else 16)
    return True, LONG_BLOCK, _LONG_WARPS


def _rows(t: Tensor, n_cols: int) -> int:
    return t.numel() // n_cols if n_cols else 0


def _triton_forward(xm: Tensor, s_dtype: torch.dtype, d_dtype: torch.dtype, seed: Tensor,
                    p: float, dropout: bool) -> tuple[Tensor, Tensor]:
    """Softmax (+ dropout) of the rows of contiguous ``xm``: returns (s, probabilities for the matmul)."""
    n_cols = xm.shape[-1]
    s = torch.empty(xm.shape, dtype=s_dtype, device=xm.device)
    write_d = dropout or d_dtype != s_dtype
    d = torch.empty(xm.shape, dtype=d_dtype, device=xm.device) if write_d else s
    rows = _rows(xm, n_cols)
    if rows:
        long, block, num_warps = _row_config(n_cols)
        kernel = _softmax_dropout_fwd_long_kernel if long else _softmax_dropout_fwd_kernel
        with launch_on(xm):
            kernel[(rows,)](xm, s, d, seed, n_cols, p, 1.0 / (1.0 - p),
                            HAS_DROPOUT=dropout, WRITE_D=write_d, BLOCK=block, num_warps=num_warps)
    return s, d


def _launch_dropout_from_seed(s: Tensor, out: Tensor, seed: Tensor, p: float, write_mask: bool,
                              rng_base: int = 0) -> None:
    n = out.numel()
    if n:
        with launch_on(out):
            _dropout_from_seed_kernel[(triton.cdiv(n, _FLAT_BLOCK),)](
                s, out, seed, n, rng_base, p, 1.0 / (1.0 - p),
                WRITE_MASK=write_mask, BLOCK=_FLAT_BLOCK, num_warps=4)


def _triton_dropout_output(s: Tensor, out_dtype: torch.dtype, seed: Tensor, p: float, rng_base: int = 0) -> Tensor:
    """s * keep / (1 - p) in ``out_dtype``, the mask regenerated from ``seed``; ``s`` may be a
    contiguous slice starting at flat index ``rng_base`` of the tensor the mask was drawn for."""
    out = torch.empty(s.shape, dtype=out_dtype, device=s.device)
    _launch_dropout_from_seed(s, out, seed, p, write_mask=False, rng_base=rng_base)
    return out


def _triton_keep_mask(shape: tuple[int, ...], device: torch.device, seed: Tensor, p: float) -> Tensor:
    out = torch.empty(shape, dtype=torch.uint8, device=device)
    _launch_dropout_from_seed(out, out, seed, p, write_mask=True)  # s is unused when writing the mask
    return out.view(torch.bool)


def _triton_softmax_dropout_backward(dd: Tensor, s: Tensor, dx: Tensor, seed: Tensor, p: float,
                                     dropout: bool, rng_base: int = 0) -> None:
    """dx = softmax-dropout backward of the rows of ``dd`` / ``s`` (contiguous, possibly a slice
    starting at flat index ``rng_base``), written into ``dx``."""
    n_cols = s.shape[-1]
    rows = _rows(s, n_cols)
    if rows:
        long, block, num_warps = _row_config(n_cols)
        kernel = _softmax_dropout_bwd_long_kernel if long else _softmax_dropout_bwd_kernel
        with launch_on(s):
            kernel[(rows,)](dd, s, dx, seed, n_cols, rng_base, p, 1.0 / (1.0 - p),
                            HAS_DROPOUT=dropout, BLOCK=block, num_warps=num_warps)


# ----------------------------------------------------------------------------------------
# Reference implementation (PyTorch; any device, fp64 included).
# ----------------------------------------------------------------------------------------
def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _reference_keep_mask(seed: Tensor, shape: tuple[int, ...], p: float, device: torch.device) -> Tensor:
    # Host sync on seed.item(): acceptable, this path is the CPU / fallback one.
    generator = torch.Generator(device=device)
    generator.manual_seed(int(seed.item()))
    return torch.rand(shape, generator=generator, device=device, dtype=torch.float32) >= p


def _reference_softmax(xm: Tensor) -> Tensor:
    probs = torch.softmax(xm.to(_compute_dtype(xm.dtype)), dim=-1)
    fully_masked = (xm == float("-inf")).all(dim=-1, keepdim=True)
    return probs.masked_fill(fully_masked, 0.0)


def dropout_keep_mask(seed: Tensor, shape, p: float, device, backend: str, dim: int = -1) -> Tensor:
    """The bool keep-mask (True = kept) ``backend`` draws for a tensor of ``shape`` with ``seed``.

    ``shape`` is the shape of ``x`` and ``dim`` the softmax dim: the mask is drawn over ``x``
    with ``dim`` moved last (the kernels' layout) and returned in ``x``'s layout. ``backend`` is
    "triton" or "reference" (the resolved path, not "auto").
    """
    shape = tuple(int(n) for n in shape)
    device = torch.device(device)
    dim = _normalize_dim(dim, len(shape))
    moved = shape[:dim] + shape[dim + 1:] + (shape[dim],)
    seed = seed.to(device=device, dtype=torch.int64).reshape(())
    if backend == "reference":
        keep = _reference_keep_mask(seed, moved, p, device)
    elif backend == "triton":
        keep = _triton_keep_mask(moved, device, seed, p)
    else:
        raise ValueError(f"dropout_keep_mask: backend must be 'triton' or 'reference', got {backend!r}")
    return keep.movedim(-1, dim)


def _broadcast_matmul_shape(x_shape, v_shape) -> list[int]:
    batch = torch.broadcast_shapes(tuple(x_shape[:-2]), tuple(v_shape[:-2]))
    return list(batch) + [x_shape[-2], v_shape[-1]]


def _dropout_output_reference(s: Tensor, keep: Optional[Tensor], p: float, dtype: torch.dtype) -> Tensor:
    if keep is None:
        return s.to(dtype)
    return (s.to(_compute_dtype(s.dtype)) * keep * (1.0 / (1.0 - p))).to(dtype)


def _softmax_backward_reference(dd: Tensor, s: Tensor, keep: Optional[Tensor], p: float,
                                x_dtype: torch.dtype) -> Tensor:
    cdt = _compute_dtype(s.dtype)
    ds = dd.to(cdt)
    if keep is not None:
        ds = ds * keep * (1.0 / (1.0 - p))
    sc = s.to(cdt)
    return (sc * (ds - (ds * sc).sum(dim=-1, keepdim=True))).to(x_dtype)


def _check_backend_arg(backend: str, where: str) -> None:
    if backend not in ("triton", "reference"):
        raise ValueError(f"{where}: argument 'backend' must be 'triton' or 'reference', got {backend!r}")


# ----------------------------------------------------------------------------------------
# Custom ops: forward returns (out, s) with s in the kernel layout (dim moved last,
# contiguous) so setup_context can save it; s is not differentiable. Both take the backend
# the functional API resolved, so the backward regenerates the forward's mask.
# ----------------------------------------------------------------------------------------
@torch.library.custom_op("tempo::combined_softmax_dropout_matmul", mutates_args=())
def _combined_fwd_op(x: Tensor, v: Tensor, seed: Tensor, p: float, dim: int, training: bool,
                     s_dtype: torch.dtype, backend: str) -> tuple[Tensor, Tensor]:
    _check_backend_arg(backend, _OP)
    dropout = training and p > 0.0
    xm = x.movedim(dim, -1).contiguous()
    with torch.autocast(x.device.type, enabled=False):
        if backend == "triton":
            s, d = _triton_forward(xm, s_dtype, v.dtype, seed, p, dropout)
        else:
            probs = _reference_softmax(xm)
            s = probs.to(s_dtype)
            if dropout:
                keep = _reference_keep_mask(seed, tuple(xm.shape), p, x.device)
                probs = probs * keep * (1.0 / (1.0 - p))
            d = probs.to(v.dtype)
        # d is a temporary: freed when this returns; only s is kept.
        out = torch.matmul(d.movedim(-1, dim), v).contiguous()
    return out, s


@_combined_fwd_op.register_fake
def _(x, v, seed, p, dim, training, s_dtype, backend):
    out = v.new_empty(_broadcast_matmul_shape(x.shape, v.shape))
    s = x.movedim(dim, -1).new_empty(x.movedim(dim, -1).shape, dtype=s_dtype)
    return out, s


def _backward_batch_chunked(g: Tensor, s: Tensor, v: Tensor, seed: Tensor, p: float, dropout: bool,
                            x_dtype: torch.dtype, backend: str) -> tuple[Tensor, Tensor]:
    """Backward when the softmax dim is the last one and x and v share their batch dims (attention).

    Walks the flattened batch (b·heads) in ~BACKWARD_CHUNKS chunks. Besides the saved s and v,
    grad_out and the outputs dx (x's size) and dv, the peak then holds one chunk's temporaries:
    the dropout output D_c (freed after dv's matmul), then dD_c = g_c @ v_cᵀ, i.e. about
    1/BACKWARD_CHUNKS of a b·heads·s² tensor, where processing the whole batch at once held dD
    and dx at full size together (and D before them). The reference path also holds the whole
    bool keep mask (1 byte per element: its generator cannot start mid-tensor) and the chunk's
    fp32 copies.
    """
    *batch, sq, sk = s.shape
    dv_cols = v.shape[-1]
    b = math.prod(batch)
    dx = torch.empty(s.shape, dtype=x_dtype, device=s.device)
    dv = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    s3, g3, v3 = s.contiguous().view(b, sq, sk), g.reshape(b, sq, dv_cols), v.reshape(b, sk, dv_cols)
    dx3, dv3 = dx.view(b, sq, sk), dv.view(b, sk, dv_cols)
    keep = None
    if dropout and backend == "reference":
        keep = _reference_keep_mask(seed, tuple(s.shape), p, s.device).view(b, sq, sk)
    step = max(1, -(-b // BACKWARD_CHUNKS))
    for b0 in range(0, b, step):
        b1 = min(b, b0 + step)
        s_c, g_c, v_c = s3[b0:b1], g3[b0:b1], v3[b0:b1]
        keep_c = keep[b0:b1] if keep is not None else None
        rng_base = b0 * sq * sk  # flat index of the chunk's first element: the mask's counter
        if backend == "triton":
            d_c = _triton_dropout_output(s_c, v.dtype, seed, p, rng_base) if dropout else s_c.to(v.dtype)
        else:
            d_c = _dropout_output_reference(s_c, keep_c, p, v.dtype)
        torch.matmul(d_c.transpose(-1, -2), g_c, out=dv3[b0:b1])  # dv = Dᵀ @ g
        del d_c
        dd_c = torch.matmul(g_c, v_c.transpose(-1, -2))  # dD = g @ vᵀ
        if backend == "triton":
            _triton_softmax_dropout_backward(dd_c, s_c, dx3[b0:b1], seed, p, dropout, rng_base)
        else:
            dx3[b0:b1] = _softmax_backward_reference(dd_c, s_c, keep_c, p, x_dtype)
        del dd_c
    return dx, dv


@torch.library.custom_op("tempo::combined_softmax_dropout_matmul_backward", mutates_args=())
def _combined_bwd_op(grad_out: Tensor, s: Tensor, v: Tensor, seed: Tensor, p: float, dim: int,
                     training: bool, x_dtype: torch.dtype, backend: str) -> tuple[Tensor, Tensor]:
    # ``backend`` is the path the forward took (its mask is the one to regenerate): resolving it
    # again here could differ, e.g. CUDA backward runs on autograd's device thread, outside a
    # use_backend() block of the forward.
    _check_backend_arg(backend, f"{_OP}_backward")
    dropout = training and p > 0.0
    x_shape = s.movedim(-1, dim).shape
    g = grad_out.to(v.dtype)
    with torch.autocast(s.device.type, enabled=False):
        if dim == s.dim() - 1 and s.dim() >= 3 and tuple(v.shape[:-2]) == tuple(s.shape[:-2]):
            return _backward_batch_chunked(g, s, v, seed, p, dropout, x_dtype, backend)
        # Any other dim, or v broadcast over x's batch: the whole tensor at once.
        keep = None
        if backend == "triton":
            d = _triton_dropout_output(s, v.dtype, seed, p) if dropout else s.to(v.dtype)
        else:
            if dropout:
                keep = _reference_keep_mask(seed, tuple(s.shape), p, s.device)
            d = _dropout_output_reference(s, keep, p, v.dtype)
        # dv = D^T @ g, with D recomputed transiently.
        dv = torch.matmul(d.movedim(-1, dim).transpose(-1, -2), g).sum_to_size(v.shape).contiguous()
        del d
        # dD = g @ v^T, reduced over the batch dims x was broadcast along (the mask is the same
        # for every broadcast copy, so reducing before masking is exact).
        dd = torch.matmul(g, v.transpose(-1, -2)).sum_to_size(x_shape)
        ddm = dd.movedim(dim, -1).contiguous()
        del dd
        if backend == "triton":
            dxm = torch.empty(s.shape, dtype=x_dtype, device=s.device)
            _triton_softmax_dropout_backward(ddm, s, dxm, seed, p, dropout)
        else:
            dxm = _softmax_backward_reference(ddm, s, keep, p, x_dtype)
    return dxm.movedim(-1, dim), dv


@_combined_bwd_op.register_fake
def _(grad_out, s, v, seed, p, dim, training, x_dtype, backend):
    dx = s.new_empty(s.shape, dtype=x_dtype).movedim(-1, dim)
    return dx, v.new_empty(v.shape)


def _setup_context(ctx, inputs, output):
    x, v, seed, p, dim, training, s_dtype, backend = inputs
    _, s = output
    ctx.mark_non_differentiable(s)
    ctx.save_for_backward(s, v, seed)
    ctx.p, ctx.dim, ctx.training, ctx.x_dtype = p, dim, training, x.dtype
    ctx.backend = backend  # the path the forward ran, whatever thread the backward runs on


def _backward(ctx, grad_out, grad_s):
    s, v, seed = ctx.saved_tensors
    dx, dv = _combined_bwd_op(grad_out, s, v, seed, ctx.p, ctx.dim, ctx.training, ctx.x_dtype,
                              ctx.backend)
    return dx, dv, None, None, None, None, None, None


_combined_fwd_op.register_autograd(_backward, setup_context=_setup_context)


def resolve_combined_backend(x: Tensor, dim: int) -> str:
    """'triton' or 'reference' for softmax rows of ``x.shape[dim]`` (raises as resolve_backend does).

    Rows longer than MAX_TRITON_ROW run on the reference path; that fallback is logged once.
    """
    backend = resolve_backend(x, _OP)
    if backend == "triton" and x.shape[dim] > MAX_TRITON_ROW:
        log_fallback_once(f"{_OP}:long", f"{_OP}: softmax rows longer than {MAX_TRITON_ROW} (got {x.shape[dim]}) "
                          "run on the PyTorch reference path")
        return "reference"
    return backend


# ----------------------------------------------------------------------------------------
# Public functional and module.
# ----------------------------------------------------------------------------------------
def _normalize_dim(dim: object, rank: int) -> int:
    if isinstance(dim, bool) or not isinstance(dim, int):
        raise TypeError(f"{_OP}: argument 'dim' must be an int, got {type(dim).__name__}")
    if not -rank <= dim < rank:
        raise ValueError(f"{_OP}: argument 'dim'={dim} is out of range for a tensor of rank {rank} "
                         f"(expected -{rank} <= dim < {rank})")
    return dim % rank


def _check_inputs(x: Tensor, v: Tensor) -> None:
    check_float_tensor(x, "x", _OP)
    check_float_tensor(v, "v", _OP)
    if x.dim() < 2 or v.dim() < 2:
        raise ValueError(f"{_OP}: arguments 'x' and 'v' need at least 2 dims for the matmul, "
                         f"got x of shape {tuple(x.shape)} and v of shape {tuple(v.shape)}")
    if x.device != v.device:
        raise ValueError(f"{_OP}: arguments 'x' and 'v' must be on the same device, got {x.device} and {v.device}")
    if x.shape[-1] != v.shape[-2]:
        raise ValueError(f"{_OP}: shape mismatch: x's last dim ({x.shape[-1]}) must equal v's "
                         f"second-to-last dim ({v.shape[-2]}); x {tuple(x.shape)}, v {tuple(v.shape)}")
    try:
        torch.broadcast_shapes(tuple(x.shape[:-2]), tuple(v.shape[:-2]))
    except RuntimeError:
        raise ValueError(f"{_OP}: the batch dims of x {tuple(x.shape)} and v {tuple(v.shape)} "
                         f"do not broadcast") from None


def draw_seed(device: torch.device | str) -> Tensor:
    """A 0-d int64 seed from torch's RNG on ``device``, without a host sync."""
    return torch.randint(0, 2**31 - 1, (), device=device, dtype=torch.int64)


def combined_softmax_dropout_matmul(x: Tensor, v: Tensor, dim: int = -1, p: float = 0.1,
                                    training: bool = True, seed: Optional[Tensor] = None) -> Tensor:
    """``torch.matmul(dropout(softmax(x, dim), p, training), v)``, keeping only softmax(x) and v.

    ``seed`` (0-d integer tensor) fixes the dropout mask; by default one is drawn from torch's
    RNG on ``x``'s device, so torch.manual_seed and torch.utils.checkpoint's RNG restore make
    the mask reproducible. See the module docstring for dtypes and masking.
    """
    _check_inputs(x, v)
    p = check_probability(p, "p", _OP)
    dim = _normalize_dim(dim, x.dim())
    training = bool(training)
    dropout = training and p > 0.0
    # Training mode runs this op, backward or not: a no-grad forward replayed with grad from the
    # same RNG state (GradCache, reentrant checkpointing) must compute the same bits and draw the
    # same mask, and a given seed must be used.
    stock = not runs_own_forward(training, x, v)
    if seed is None:
        seed = draw_seed(x.device) if dropout else torch.zeros((), dtype=torch.int64, device=x.device)
    else:
        if not isinstance(seed, Tensor) or seed.is_floating_point() or seed.is_complex() or seed.numel() != 1:
            raise TypeError(f"{_OP}: argument 'seed' must be a one-element integer tensor")
        seed = seed.to(device=x.device, dtype=torch.int64).reshape(())

    s_dtype = x.dtype
    autocast_dtype = autocast_dtype_for(x)
    if autocast_dtype is not None and x.dtype in TRITON_DTYPES:
        # What torch.matmul under autocast does: softmax in fp32, matmul in the autocast dtype.
        s_dtype = autocast_dtype
        if v.dtype in TRITON_DTYPES:
            v = v.to(autocast_dtype)
    if stock:
        return _stock_combined(x, v, dim, p, training)
    out, _ = _combined_fwd_op(x, v, seed, p, dim, training, s_dtype, resolve_combined_backend(x, dim))
    return out


def _stock_combined(x: Tensor, v: Tensor, dim: int, p: float, training: bool) -> Tensor:
    """No backward will run: nothing to keep, so ``matmul(dropout(softmax(x)), v)`` with the stock
    ops, same semantics and dtypes as the op (``v`` already in the autocast dtype): a row that is
    all -inf gives probabilities 0 (aten._safe_softmax), the probabilities meet ``v`` in its dtype.
    Autocast is off so that a matmul with an fp64 ``v`` stays as the op computes it."""
    with torch.autocast(x.device.type, enabled=False):
        probs = torch.nn.functional.dropout(torch.ops.aten._safe_softmax(x, dim), p, training)
        return torch.matmul(probs.to(v.dtype), v)


class Combined(nn.Module):
    """Softmax along ``dim`` -> dropout (drop probability ``p``) -> matmul with ``v``.

    ``Combined(dim=-1, p=0.1)(scores, v)`` equals
    ``torch.matmul(F.dropout(torch.softmax(scores, dim), p, self.training), v)`` and keeps for
    backward only the softmax output, ``v`` and an 8-byte seed.
    """

    def __init__(self, dim: int = -1, p: float = 0.1, *, dropout: Optional[nn.Dropout] = None):
        super().__init__()
        if isinstance(dim, bool) or not isinstance(dim, int):
            raise TypeError(f"Combined: argument 'dim' must be an int, got {type(dim).__name__}")
        self.dim = dim
        self.dropout = held_dropout(p, dropout, "Combined")  # its rate and flag are read at every forward

    p = held_dropout_rate("p", "Combined")

    def forward(self, x: Tensor, v: Tensor) -> Tensor:
        return combined_softmax_dropout_matmul(x, v, self.dim, float(self.dropout.p), self.dropout.training)

    def extra_repr(self) -> str:
        return f"dim={self.dim}, p={self.p}"


__all__ = ["Combined", "combined_softmax_dropout_matmul", "dropout_keep_mask", "draw_seed"]
