"""The language-model head and its cross-entropy in one op that never keeps the logits (issue 41).

``linear_cross_entropy(x, weight, target)`` is ``F.cross_entropy(F.linear(x, weight, bias).float(),
target)`` over rows of x, computed a chunk of rows at a time: one chunk's logits [rows, vocab] live
for a moment, none is kept for backward. What is kept per row is its log-sum-exp (4 bytes); the
stock head keeps the logits' 16-bit copy and cross-entropy's fp32 softmax (6 bytes per row and
vocabulary entry: 0.9 GiB per 1,024 tokens at Qwen3's 152k vocabulary).

Backward recomputes each chunk's logits from x and the weight: one more GEMM of 2·rows·vocab·hidden
FLOPs (the head's forward again: backward costs 3 GEMMs where stock's costs 2), then the exact
gradient from the kept log-sum-exp: softmax = exp(z − lse). Nothing is recovered from a rounded
output (the logits are recomputed by the same GEMM on the same operands, bitwise on the CPU), so
there is no condition on the values.

Ignored rows (``target == ignore_index``) are dropped before the GEMM (inside the op, so the op's
shapes stay static under ``torch.compile``): a masked-LM batch with 15 % labelled positions pays
15 % of the head. Per row the loss is, with z the row's logits (after ``softcap``: c·tanh(z/c),
Gemma's final-logit softcapping), t its target, ε the label smoothing and λ the z-loss weight:

    (1 − ε)·(lse − z_t) + ε·(lse − mean_j z_j) + λ·lse²

— ``F.cross_entropy``'s label smoothing and PaLM's z-loss. Reduction "sum", "mean" (over the rows not
ignored: NaN when every row is ignored, as ``F.cross_entropy``) or "none"; ``num_items_in_batch``
divides the sum instead (transformers' gradient-accumulation convention).

Precision: the GEMM runs in ``dtype`` (the autocast dtype, else x's) as stock's ``F.linear`` does;
everything after it (log-sum-exp, softmax, the gradient of the logits) in fp32, as transformers'
``logits.float()``; the weight's gradient is summed over chunks in fp32. So fp32 results equal the
stock head's to fp32 rounding and 16-bit ones are no further from the fp32 reference than stock's.

One implementation, PyTorch's GEMMs over chunks (cuBLAS on CUDA), on every device: the work is the
GEMMs, and a Triton kernel for the element-wise part in between is not written yet. torch 2.13's
``F.linear_cross_entropy`` is not used: it is absent from torch 2.11 and has no smoothing, z-loss or
softcap in its chunked path, so results would change with the torch version.
"""

from __future__ import annotations

import math
from typing import Optional, Union

import torch
import torch.nn.functional as F
from torch import Tensor

from tempo.ops._backend import autocast_dtype_for, check_float_tensor

OP = "linear_cross_entropy"
REDUCTIONS = ("mean", "sum", "none")


def chunk_rows(rows: int, vocab: int, hidden: int) -> int:
    """Rows per chunk: one chunk's fp32 logits about as large as the rows' hidden states (Liger's
    rule), at least 16 rows so small batches are not split row by row."""
    return max(16, math.ceil(rows * hidden / max(vocab, 1)))


def _acc(dtype: torch.dtype) -> torch.dtype:
    """fp32 after the GEMM (fp64 stays fp64, for gradcheck)."""
    return torch.promote_types(dtype, torch.float32)


def _logits(x: Tensor, weight: Tensor, bias: Optional[Tensor], softcap: float) -> Tensor:
    """fp32 logits of rows x (weight and bias already in the GEMM's dtype), softcapped when > 0."""
    z = F.linear(x, weight, bias)
    z = z.to(_acc(z.dtype))
    return torch.tanh(z / softcap).mul_(softcap) if softcap > 0 else z


def _kept_rows(target: Tensor, ignore_index: int, vocab: int) -> Tensor:
    rows = (target != ignore_index).nonzero().squeeze(1)
    kept = target.index_select(0, rows)
    if kept.numel() and bool(((kept < 0) | (kept >= vocab)).any()):
        bad = kept[(kept < 0) | (kept >= vocab)][0].item()
        raise ValueError(f"{OP}: a target is {bad}, outside [0, {vocab}) (the head's vocabulary) and not "
                         f"ignore_index={ignore_index}")
    return rows


@torch.library.custom_op("tempo::linear_cross_entropy_fwd", mutates_args=())
def _fwd_op(x: Tensor, weight: Tensor, bias: Optional[Tensor], target: Tensor, ignore_index: int,
            smoothing: float, z_loss: float, softcap: float, dtype: torch.dtype, chunk: int) -> tuple[Tensor, Tensor]:
    """x [N, h], weight [V, h], target [N] -> (loss per row, log-sum-exp per row), both fp32 [N],
    0 at ignored rows."""
    loss = x.new_zeros(x.shape[0], dtype=_acc(dtype))
    lse = torch.zeros_like(loss)
    w = weight.to(dtype)
    b = bias.to(dtype) if bias is not None else None
    for rows in _kept_rows(target, ignore_index, weight.shape[0]).split(chunk):
        z = _logits(x.index_select(0, rows).to(dtype), w, b, softcap)
        row_lse = torch.logsumexp(z, dim=-1)
        row_loss = row_lse - z.gather(1, target.index_select(0, rows)[:, None]).squeeze(1)
        if smoothing:
            row_loss = (1 - smoothing) * row_loss + smoothing * (row_lse - z.mean(dim=-1))
        if z_loss:
            row_loss = row_loss + z_loss * row_lse.square()
        loss.index_copy_(0, rows, row_loss)
        lse.index_copy_(0, rows, row_lse)
    return loss, lse


@_fwd_op.register_fake
def _(x, weight, bias, target, ignore_index, smoothing, z_loss, softcap, dtype, chunk):
    loss = x.new_empty(x.shape[0], dtype=_acc(dtype))
    return loss, torch.empty_like(loss)


@torch.library.custom_op("tempo::linear_cross_entropy_bwd", mutates_args=())
def _bwd_op(grad: Tensor, x: Tensor, weight: Tensor, bias: Optional[Tensor], target: Tensor, lse: Tensor,
            ignore_index: int, smoothing: float, z_loss: float, softcap: float, dtype: torch.dtype,
            chunk: int) -> tuple[Tensor, Tensor, Tensor]:
    """(dx like x, dweight like weight, dbias like bias or empty) of the loss per row with upstream
    gradient ``grad`` [N]; each chunk's logits recomputed, softmax = exp(z − lse)."""
    vocab = weight.shape[0]
    dx = torch.zeros_like(x)
    dw = torch.zeros(weight.shape, dtype=_acc(dtype), device=weight.device)
    db = torch.zeros(vocab if bias is not None else 0, dtype=_acc(dtype), device=weight.device)
    w = weight.to(dtype)
    b = bias.to(dtype) if bias is not None else None
    for rows in _kept_rows(target, ignore_index, vocab).split(chunk):
        xc = x.index_select(0, rows).to(dtype)
        z = _logits(xc, w, b, softcap)
        row_lse, g = lse.index_select(0, rows), grad.index_select(0, rows).to(z.dtype)
        # d loss / d z = softmax·(1 + 2λ·lse) − (1 − ε)·onehot(t) − ε/V, times the row's upstream gradient
        dz = torch.exp(z - row_lse[:, None]).mul_((g * (1 + 2 * z_loss * row_lse))[:, None])
        dz.scatter_add_(1, target.index_select(0, rows)[:, None], -(g * (1 - smoothing))[:, None])
        if smoothing:
            dz.sub_((g * smoothing / vocab)[:, None])
        if softcap > 0:  # z = c·tanh(u/c): dz/du = 1 − (z/c)²
            dz.mul_(1 - (z / softcap).square())
        dz = dz.to(dtype)
        dx.index_copy_(0, rows, dz.mm(w).to(x.dtype))
        dw.add_(dz.t().mm(xc))
        if bias is not None:
            db.add_(dz.sum(0))
    return dx, dw.to(weight.dtype), db.to(bias.dtype if bias is not None else db.dtype)


@_bwd_op.register_fake
def _(grad, x, weight, bias, target, lse, ignore_index, smoothing, z_loss, softcap, dtype, chunk):
    db = weight.new_empty(weight.shape[0] if bias is not None else 0,
                          dtype=bias.dtype if bias is not None else _acc(dtype))
    return torch.empty_like(x), torch.empty_like(weight), db


def _setup_context(ctx, inputs, output):
    x, weight, bias, target, *settings = inputs
    ctx.save_for_backward(x, weight, bias, target, output[1])  # inputs and lse: no logits
    ctx.settings = settings


def _backward(ctx, grad_loss, _grad_lse):
    x, weight, bias, target, lse = ctx.saved_tensors
    dx, dw, db = torch.ops.tempo.linear_cross_entropy_bwd(grad_loss.contiguous(), x, weight, bias, target, lse,
                                                           *ctx.settings)
    return dx, dw, db if bias is not None else None, None, None, None, None, None, None, None


_fwd_op.register_autograd(_backward, setup_context=_setup_context)


def linear_cross_entropy(x: Tensor, weight: Tensor, target: Tensor, bias: Optional[Tensor] = None, *,
                         ignore_index: int = -100, reduction: str = "mean",
                         num_items_in_batch: Union[Tensor, int, None] = None, label_smoothing: float = 0.0,
                         z_loss: float = 0.0, softcap: Optional[float] = None,
                         chunk: Optional[int] = None) -> Tensor:
    """``F.cross_entropy(F.linear(x, weight, bias).float(), target, ...)`` without the logits (module
    docstring). x [..., h], weight [V, h], target [...] of integers (``ignore_index`` rows dropped),
    bias [V] or None. ``num_items_in_batch`` (with reduction "mean") divides the sum instead of the
    count of rows not ignored. ``softcap`` > 0: Gemma's c·tanh(z/c) on the logits first."""
    check_float_tensor(x, "x", OP)
    check_float_tensor(weight, "weight", OP)
    if weight.dim() != 2 or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"{OP}: x [..., {x.shape[-1]}] and weight {list(weight.shape)} do not multiply "
                         f"(weight must be [vocab, {x.shape[-1]}])")
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"{OP}: bias has shape {list(bias.shape)}, not [{weight.shape[0]}] (the vocabulary)")
    if target.is_floating_point() or target.shape != x.shape[:-1]:
        raise ValueError(f"{OP}: target must be integers of x's leading shape {list(x.shape[:-1])}, got "
                         f"{target.dtype} {list(target.shape)}")
    if reduction not in REDUCTIONS:
        raise ValueError(f"{OP}: reduction={reduction!r}; valid: {', '.join(REDUCTIONS)}")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"{OP}: label_smoothing={label_smoothing} is outside [0, 1]")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"{OP}: softcap={softcap} must be positive (or None for no softcapping)")
    if chunk is not None and int(chunk) < 1:
        raise ValueError(f"{OP}: chunk={chunk} must be a positive number of rows")
    h = x.shape[-1]
    rows = x.reshape(-1, h)
    dtype = autocast_dtype_for(rows) or rows.dtype
    loss, _lse = _fwd_op(rows.contiguous(), weight, bias, target.reshape(-1).long(), int(ignore_index),
                         float(label_smoothing), float(z_loss), float(softcap or 0.0), dtype,
                         int(chunk or chunk_rows(rows.shape[0], weight.shape[0], h)))
    if reduction == "none":
        return loss.view(target.shape)
    total = loss.sum()
    if reduction == "sum":
        return total
    if num_items_in_batch is not None:
        return total / num_items_in_batch
    return total / (target != ignore_index).sum()


__all__ = ["linear_cross_entropy", "chunk_rows"]
