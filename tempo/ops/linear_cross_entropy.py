"""The language-model head and its cross-entropy in one op that never keeps the logits (issue 41).

``linear_cross_entropy(x, weight, target)`` is ``F.cross_entropy(F.linear(x, weight, bias).float(),
target)`` over rows of x, computed a block of vocabulary columns at a time (``vocab_block``: 4·hidden
columns): one block's logits [rows, block] live for a moment, none is kept for backward. What is kept
per row is its log-sum-exp (4 bytes), combined over the blocks as they pass (logaddexp); the stock
head keeps the logits' 16-bit copy and cross-entropy's fp32 log-softmax (6 bytes per row and
vocabulary entry: 0.9 GiB per 1,024 tokens at Qwen3's 152k vocabulary).

Backward recomputes each block's logits from x and the weight: one more GEMM of 2·rows·vocab·hidden
FLOPs (the head's forward again: backward costs 3 GEMMs where stock's costs 2), then the exact
gradient from the kept log-sum-exp, softmax = exp(z − lse). Each block's weight gradient is one GEMM
over all rows, written once; the rows' gradient is summed over blocks in fp32. Blocks over the
vocabulary rather than chunks of rows: a row chunk would add its partial weight gradient into a
[vocab, hidden] accumulator, reading and writing it once per chunk. Nothing is recovered from a
rounded output (the logits are recomputed by the same GEMM on the same operands, bitwise on the CPU),
so there is no condition on the values.

Ignored rows (``target == ignore_index``) are dropped before the GEMMs (inside the op, so the op's
shapes stay static under ``torch.compile``): a masked-LM batch with 15 % labelled positions pays
15 % of the head. Per row the loss is, with z the row's logits (after ``softcap``: c·tanh(z/c),
Gemma's final-logit softcapping), t its target, ε the label smoothing and λ the z-loss weight:

    (1 − ε)·(lse − z_t) + ε·(lse − mean_j z_j) + λ·lse²

— ``F.cross_entropy``'s label smoothing and PaLM's z-loss. Reduction "sum", "mean" (over the rows not
ignored: NaN when every row is ignored, as ``F.cross_entropy``) or "none"; ``num_items_in_batch``
divides the sum instead (transformers' gradient-accumulation convention).

Precision: the GEMMs run in ``dtype`` (the autocast dtype, else x's) as stock's ``F.linear`` does;
everything after them (log-sum-exp, softmax, the logits' gradient) in fp32, as transformers'
``logits.float()``. fp32 results equal the stock head's to fp32 rounding. In 16 bits the rows'
gradient is a sum of per-block GEMM outputs each rounded to 16 bits (stock rounds one GEMM output),
summed in fp32: tests hold it within 1.5x of stock's own error against fp32.

The GEMMs are PyTorch's (cuBLAS on CUDA). The element-wise work between them has two paths
(tempo.ops._backend): "triton" (CUDA) reads each block's GEMM output once in forward (one kernel
per row: softcap, online max and sum of exponentials, the target's logit, the row sum) and once in
backward, writing the 16-bit gradient over it in place; "reference" (PyTorch: the CPU, fp64) makes
an fp32 copy and about six passes over it. Both compute the same fp32 values from the same GEMM
output; the kernel's log-sum-exp is online (rounding differs, not the value) and its tanh is
exp-based (within a few ULP of torch's). torch 2.13's ``F.linear_cross_entropy`` is not used: it
is absent from torch 2.11 and has no smoothing, z-loss or softcap in its chunked path, so results
would change with the torch version.
"""

from __future__ import annotations

import math
from typing import Optional, Union

import torch
import torch.nn.functional as F
from torch import Tensor

from tempo.ops._backend import autocast_dtype_for, check_float_tensor, launch_on, resolve_backend
from tempo.ops._backend import tl, triton  # None without triton (reference path only)

OP = "linear_cross_entropy"
REDUCTIONS = ("mean", "sum", "none")


def vocab_block(vocab: int, hidden: int) -> int:
    """Vocabulary columns per block: 4·hidden (at least 512; the whole vocabulary when it is smaller).
    One block's 16-bit logits over the rows are then twice the rows' fp32 hidden states (the Triton
    path holds that block alone; the reference path its fp32 copy and temporaries too). Each block
    reads the rows again in each GEMM: 1/4 of the block's logits' bytes in 16 bits, which keeps the
    head's bytes moved below the stock head's (tests/test_movement.py)."""
    return min(vocab, max(512, 4 * hidden))


def _acc(dtype: torch.dtype) -> torch.dtype:
    """fp32 after the GEMM (fp64 stays fp64, for gradcheck)."""
    return torch.promote_types(dtype, torch.float32)


def _block_gemm(x: Tensor, weight: Tensor, bias: Optional[Tensor], v0: int, v1: int, dtype: torch.dtype) -> Tensor:
    """The rows' logits over vocabulary columns [v0, v1) as the GEMM in ``dtype`` gives them."""
    b = bias[v0:v1].to(dtype) if bias is not None else None
    return F.linear(x, weight[v0:v1].to(dtype), b)


def _block_logits(x: Tensor, weight: Tensor, bias: Optional[Tensor], v0: int, v1: int, dtype: torch.dtype,
                  softcap: float) -> Tensor:
    """``_block_gemm``'s logits in fp32, softcapped when ``softcap`` > 0 (the reference path)."""
    z = _block_gemm(x, weight, bias, v0, v1, dtype).to(_acc(dtype))
    return z.div(softcap).tanh_().mul_(softcap) if softcap > 0 else z


_COLUMNS = 1024  # the kernels' columns per step along a row

if triton is not None:

    @triton.jit
    def _softcapped(z, cap, SOFTCAP: tl.constexpr):
        """cap·tanh(z/cap) in fp32 without libdevice: a Taylor series to u⁷ for |u| < 0.1 (next term
        2e-10 relative), else (1 − e)/(1 + e) with e = exp(−2|u|)."""
        if SOFTCAP:
            u = z / cap
            a = tl.abs(u)
            e = tl.exp(-2.0 * a)
            big = (1.0 - e) / (1.0 + e)
            u2 = u * u
            small = a * (1.0 - u2 * (1.0 / 3.0 - u2 * (2.0 / 15.0 - u2 * (17.0 / 315.0))))
            t = tl.where(a < 0.1, small, big)
            z = cap * tl.where(u < 0, -t, t)
        return z

    @triton.jit
    def _lce_block_fwd_kernel(Z, COLUMN, OUT, rows, n_cols, cap, SOFTCAP: tl.constexpr, BLOCK: tl.constexpr):
        """One row of a block's logits: OUT[0] = its log-sum-exp, OUT[1] = the logit at COLUMN (0 when
        −1: the target is in another block), OUT[2] = the row's sum (label smoothing's)."""
        row = tl.program_id(0)
        column = tl.load(COLUMN + row)
        top = -float("inf")
        total = 0.0
        hit = 0.0
        plain = 0.0
        for start in range(0, n_cols, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            inside = offs < n_cols
            z = _softcapped(tl.load(Z + row.to(tl.int64) * n_cols + offs, mask=inside, other=0.0).to(tl.float32),
                            cap, SOFTCAP)
            new_top = tl.maximum(top, tl.max(tl.where(inside, z, -float("inf")), 0))
            total = total * tl.exp(top - new_top) + tl.sum(tl.where(inside, tl.exp(z - new_top), 0.0), 0)
            top = new_top
            hit += tl.sum(tl.where(offs == column, z, 0.0), 0)
            plain += tl.sum(tl.where(inside, z, 0.0), 0)
        tl.store(OUT + row, top + tl.log(total))
        tl.store(OUT + rows + row, hit)
        tl.store(OUT + 2 * rows + row, plain)

    @triton.jit
    def _lce_block_bwd_kernel(Z, COLUMN, LSE, SCALE, AT_TARGET, EVERYWHERE, n_cols, cap, SOFTCAP: tl.constexpr,
                              BLOCK: tl.constexpr):
        """One row of a block's logits overwritten by d loss / d z: exp(z − lse)·SCALE − AT_TARGET at
        COLUMN − EVERYWHERE, times softcap's derivative 1 − (z/cap)², stored in Z's dtype."""
        row = tl.program_id(0)
        column = tl.load(COLUMN + row)
        lse = tl.load(LSE + row)
        scale = tl.load(SCALE + row)
        at_target = tl.load(AT_TARGET + row)
        everywhere = tl.load(EVERYWHERE + row)
        base = Z + row.to(tl.int64) * n_cols
        for start in range(0, n_cols, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            inside = offs < n_cols
            z = _softcapped(tl.load(base + offs, mask=inside, other=0.0).to(tl.float32), cap, SOFTCAP)
            dz = tl.exp(z - lse) * scale - tl.where(offs == column, at_target, 0.0) - everywhere
            if SOFTCAP:
                q = z / cap
                dz = dz * (1.0 - q * q)
            tl.store(base + offs, dz.to(Z.dtype.element_ty), mask=inside)


def _kernel_columns(tk: Tensor, v0: int, v1: int) -> Tensor:
    """Each row's target column within [v0, v1), −1 where it lies in another block (int32)."""
    inside, column = _target_in_block(tk, v0, v1)
    return torch.where(inside, column, -1).to(torch.int32)


def _block_stats_triton(z: Tensor, columns: Tensor, softcap: float) -> Tensor:
    """[3, rows] fp32: per row of the GEMM output z, its log-sum-exp, the target's logit, the sum."""
    out = torch.empty(3, z.shape[0], dtype=torch.float32, device=z.device)
    with launch_on(z):
        _lce_block_fwd_kernel[(z.shape[0],)](z, columns, out, z.shape[0], z.shape[1], softcap, SOFTCAP=softcap > 0,
                                             BLOCK=_COLUMNS, num_warps=4)
    return out


def _logsumexp(z: Tensor) -> Tensor:
    """``torch.logsumexp(z, -1)`` with one block-sized temporary (so the planner's count is exact)."""
    top = z.amax(dim=-1, keepdim=True).nan_to_num_(neginf=0.0)
    return (z - top).exp_().sum(dim=-1).log_().add_(top.squeeze(-1))


def _target_in_block(target: Tensor, v0: int, v1: int) -> tuple[Tensor, Tensor]:
    """(rows whose target is in [v0, v1) as a bool mask, their column in the block; 0 elsewhere)."""
    inside = (target >= v0) & (target < v1)
    return inside, torch.where(inside, target - v0, 0)


def labelled_rows(target: Tensor, ignore_index: int, vocab: int) -> Tensor:
    """The rows whose target is not ``ignore_index``, in order, after one host read (their count and
    the count of targets outside [0, vocab), in one transfer); ValueError naming a target outside."""
    kept = target != ignore_index
    count, bad = torch.stack([kept.sum(), (kept & ((target < 0) | (target >= vocab))).sum()]).tolist()
    if bad:
        first = target[kept & ((target < 0) | (target >= vocab))][0].item()
        raise ValueError(f"{OP}: a target is {first}, outside [0, {vocab}) (the head's vocabulary) and not "
                         f"ignore_index={ignore_index}")
    return _first_rows(kept, count)


def _first_rows(kept: Tensor, count: int) -> Tensor:
    """The indices of the ``count`` True rows of ``kept``, in order, with no host read."""
    return torch.argsort((~kept).to(torch.int8), stable=True)[:count]


def _rows(target: Tensor, ignore_index: int, vocab: int, checked: bool) -> tuple[Optional[Tensor], Tensor]:
    """(the kept rows, or None for every row when the caller ``checked`` them; their count on the CPU,
    for backward to take the same rows with no host read)."""
    if checked:
        return None, torch.tensor(target.shape[0])
    rows = labelled_rows(target, ignore_index, vocab)
    return rows, torch.tensor(rows.shape[0])


def _count_on_host(count: Tensor) -> int:
    """The forward's count of kept rows: a CPU tensor (``_rows``), so reading it stalls no GPU."""
    return int(count)


def _take(t: Tensor, rows: Optional[Tensor]) -> Tensor:
    return t if rows is None else t.index_select(0, rows)


def _forward(x: Tensor, weight: Tensor, bias: Optional[Tensor], target: Tensor, ignore_index: int,
             smoothing: float, z_loss: float, checked: bool, softcap: float, dtype: torch.dtype,
             block: int, backend: str = "reference") -> tuple[Tensor, Tensor, Tensor]:
    acc = _acc(dtype)
    loss = x.new_zeros(x.shape[0], dtype=acc)
    lse = torch.zeros_like(loss)
    rows, count = _rows(target, ignore_index, weight.shape[0], checked)
    xk, tk = _take(x, rows).to(dtype), _take(target, rows)
    row_lse = torch.full((tk.shape[0],), -math.inf, dtype=acc, device=x.device)
    z_target, z_sum = torch.zeros_like(row_lse), torch.zeros_like(row_lse)
    for v0 in range(0, weight.shape[0], block):
        v1 = min(v0 + block, weight.shape[0])
        if backend == "triton" and tk.shape[0]:
            stats = _block_stats_triton(_block_gemm(xk, weight, bias, v0, v1, dtype), _kernel_columns(tk, v0, v1),
                                        softcap)
            row_lse = torch.logaddexp(row_lse, stats[0])
            z_target += stats[1]
            z_sum += stats[2]
            continue
        z = _block_logits(xk, weight, bias, v0, v1, dtype, softcap)
        row_lse = torch.logaddexp(row_lse, _logsumexp(z))
        inside, column = _target_in_block(tk, v0, v1)
        z_target += torch.where(inside, z.gather(1, column[:, None]).squeeze(1), 0)
        if smoothing:
            z_sum += z.sum(dim=-1)
        del z, inside, column  # before the next block's: one block alive at a time, the same vectors in each
    row_loss = row_lse - z_target
    if smoothing:
        row_loss = (1 - smoothing) * row_loss + smoothing * (row_lse - z_sum / weight.shape[0])
    if z_loss:
        row_loss = row_loss + z_loss * row_lse.square()
    if rows is None:
        return row_loss, row_lse, count
    return loss.index_copy_(0, rows, row_loss), lse.index_copy_(0, rows, row_lse), count


@torch.library.custom_op("tempo::linear_cross_entropy_fwd", mutates_args=())
def _fwd_op(x: Tensor, weight: Tensor, bias: Optional[Tensor], target: Tensor, ignore_index: int,
            smoothing: float, z_loss: float, checked: bool, softcap: float, dtype: torch.dtype,
            block: int, backend: str) -> tuple[Tensor, Tensor, Tensor]:
    """x [N, h], weight [V, h], target [N] -> (loss per row, log-sum-exp per row: both fp32 [N], 0 at
    ignored rows; the count of rows kept, a CPU int64 scalar for backward)."""
    return _forward(x, weight, bias, target, ignore_index, smoothing, z_loss, checked, softcap, dtype, block, backend)


@_fwd_op.register_fake
def _(x, weight, bias, target, ignore_index, smoothing, z_loss, checked, softcap, dtype, block, backend):
    loss = x.new_empty(x.shape[0], dtype=_acc(dtype))
    return loss, torch.empty_like(loss), torch.empty((), dtype=torch.int64, device="cpu")


def _backward_impl(grad: Tensor, x: Tensor, weight: Tensor, bias: Optional[Tensor], target: Tensor, lse: Tensor,
                   count: Tensor, ignore_index: int, smoothing: float, z_loss: float, checked: bool, softcap: float,
                   dtype: torch.dtype, block: int, backend: str = "reference") -> tuple[Tensor, Tensor, Tensor]:
    vocab = weight.shape[0]
    acc = _acc(dtype)
    dw = torch.empty_like(weight)
    db = torch.empty(vocab if bias is not None else 0, dtype=bias.dtype if bias is not None else acc,
                     device=weight.device)
    rows = None if checked else _first_rows(target != ignore_index, _count_on_host(count))
    xk, tk = _take(x, rows).to(dtype), _take(target, rows)
    row_lse, g = _take(lse, rows), _take(grad, rows).to(acc)
    dxk = torch.zeros(xk.shape, dtype=acc, device=x.device)
    scale = (g * (1 + 2 * z_loss * row_lse))[:, None]
    kernel = backend == "triton" and xk.shape[0] > 0
    if kernel:  # per row: the target's coefficient and label smoothing's, for the kernel
        at_target, everywhere = g * (1 - smoothing), g * (smoothing / vocab)
    for v0 in range(0, vocab, block):
        v1 = min(v0 + block, vocab)
        if kernel:
            dz = _block_gemm(xk, weight, bias, v0, v1, dtype)
            with launch_on(dz):
                _lce_block_bwd_kernel[(dz.shape[0],)](dz, _kernel_columns(tk, v0, v1), row_lse, scale, at_target,
                                                      everywhere, dz.shape[1], softcap, SOFTCAP=softcap > 0,
                                                      BLOCK=_COLUMNS, num_warps=4)
            dxk += dz.mm(weight[v0:v1].to(dtype))
            dw[v0:v1] = dz.t().mm(xk)
            if bias is not None:
                db[v0:v1] = dz.sum(0, dtype=acc)
            del dz
            continue
        z = _block_logits(xk, weight, bias, v0, v1, dtype, softcap)
        # d loss / d z = softmax·(1 + 2λ·lse) − (1 − ε)·onehot(t) − ε/V, times the row's upstream gradient
        dz = (z - row_lse[:, None]).exp_().mul_(scale)
        inside, column = _target_in_block(tk, v0, v1)
        dz.scatter_add_(1, column[:, None], -(g * (1 - smoothing) * inside)[:, None])
        if smoothing:
            dz.sub_((g * smoothing / vocab)[:, None])
        if softcap > 0:  # z = c·tanh(u/c): dz/du = 1 − (z/c)²
            dz.mul_(z.div(softcap).square_().neg_().add_(1))
        del z
        dz = dz.to(dtype)
        dxk += dz.mm(weight[v0:v1].to(dtype))
        dw[v0:v1] = dz.t().mm(xk)
        if bias is not None:
            db[v0:v1] = dz.sum(0, dtype=acc)
        del dz  # before the next block's
    if rows is None:
        return dxk.to(x.dtype), dw, db
    return torch.zeros_like(x).index_copy_(0, rows, dxk.to(x.dtype)), dw, db


@torch.library.custom_op("tempo::linear_cross_entropy_bwd", mutates_args=())
def _bwd_op(grad: Tensor, x: Tensor, weight: Tensor, bias: Optional[Tensor], target: Tensor, lse: Tensor,
            count: Tensor, ignore_index: int, smoothing: float, z_loss: float, checked: bool, softcap: float,
            dtype: torch.dtype, block: int, backend: str) -> tuple[Tensor, Tensor, Tensor]:
    """(dx like x, dweight like weight, dbias like bias or empty) of the loss per row with upstream
    gradient ``grad`` [N]; each block's logits recomputed, softmax = exp(z − lse)."""
    return _backward_impl(grad, x, weight, bias, target, lse, count, ignore_index, smoothing, z_loss, checked,
                          softcap, dtype, block, backend)


@_bwd_op.register_fake
def _(grad, x, weight, bias, target, lse, count, ignore_index, smoothing, z_loss, checked, softcap, dtype, block,
      backend):
    db = weight.new_empty(weight.shape[0] if bias is not None else 0,
                          dtype=bias.dtype if bias is not None else _acc(dtype))
    return torch.empty_like(x), torch.empty_like(weight), db


def _setup_context(ctx, inputs, output):
    x, weight, bias, target, *settings = inputs
    ctx.save_for_backward(x, weight, bias, target, output[1], output[2])  # inputs, lse, the count: no logits
    ctx.settings = settings


def _backward(ctx, grad_loss, _grad_lse, _grad_count):
    x, weight, bias, target, lse, count = ctx.saved_tensors
    dx, dw, db = torch.ops.tempo.linear_cross_entropy_bwd(grad_loss.contiguous(), x, weight, bias, target, lse,
                                                           count, *ctx.settings)
    return (dx, dw, db if bias is not None else None) + (None,) * 9


_fwd_op.register_autograd(_backward, setup_context=_setup_context)


def scratch_bytes(rows: int, vocab: int, hidden: int, block: int, x_dtype: torch.dtype, weight_dtype: torch.dtype,
                  dtype: torch.dtype, softcap: bool, backward: bool, kernel: bool = False) -> int:
    """Bytes the op holds at its internal peak beyond its inputs and outputs, for ``rows`` kept rows:
    what a memory trace that sees the op but not the ops inside it must add at that op (tempo.plan's
    timeline does). The rows in the GEMM's dtype (in backward also their fp32 gradient sum) and 36
    bytes of vectors per row (measured), then the largest moment of one block: the weight block's cast beside
    the GEMM's output; that output beside its fp32 copy; two fp32 blocks (softcap's z/c, z − max,
    z − lse beside z; three with softcap's derivative in backward); in backward the 16-bit dz beside
    the fp32 one, and beside the weight block's cast and the rows' partial gradient, or the block's
    weight gradient. The code keeps to these moments (in-place ops, ``del`` between blocks);
    tests/test_linear_cross_entropy.py measures them on the CPU.

    ``kernel``: the Triton path (CUDA), by construction (the interpreter copies a kernel's arguments,
    so the CPU cannot measure it): no fp32 block, only the GEMM's output, overwritten in place by its
    gradient in backward; per row at most 96 bytes of vectors (the reference's 36, the kernels' target
    column and its temporaries, 29, the forward kernel's 3 fp32 outputs, backward's 2 coefficients)."""
    ds, xs, acc = (torch.empty((), dtype=d).element_size() for d in (dtype, x_dtype, _acc(dtype)))
    cast = block * hidden * ds if weight_dtype != dtype else 0
    logits = min(block, vocab) * rows
    if kernel:
        base = rows * hidden * ds + 96 * rows
        if not backward:
            return base + cast + logits * ds
        return base + rows * hidden * acc + max(logits * ds + cast + rows * hidden * ds,
                                                logits * ds + block * hidden * ds, rows * hidden * xs if xs != acc else 0)
    moments = [cast + logits * ds, logits * (ds + acc) if ds != acc else 0, 2 * logits * acc]
    base = rows * hidden * ds + 36 * rows
    if not backward:
        return base + max(moments)
    base += rows * hidden * acc
    moments += [3 * logits * acc if softcap else 0, logits * (acc + ds) if ds != acc else 0,
                logits * ds + cast + rows * hidden * ds, logits * ds + block * hidden * ds]
    return base + max(max(moments), rows * hidden * xs if xs != acc else 0)


def _scratch_of_call(args: tuple, backward: bool, kernel: bool) -> int:
    """``scratch_bytes`` of one call of the forward or backward op, from its arguments (every row
    counted as kept: a trace on fake tensors cannot read the targets); ``kernel``: the Triton path's."""
    x, weight = args[1:3] if backward else args[0:2]
    softcap, dtype, block = args[-4:-1]
    return scratch_bytes(x.shape[0], weight.shape[0], x.shape[1], block, x.dtype, weight.dtype, dtype, softcap > 0,
                         backward, kernel)


# The op packet -> the bytes it holds inside beyond its outputs, on the Triton path (``kernel``) or
# the reference one (tempo.plan.trace adds them at the op: the kernel's for a CUDA plan).
SCRATCH = {"tempo.linear_cross_entropy_fwd": lambda args, kernel: _scratch_of_call(args, False, kernel),
           "tempo.linear_cross_entropy_bwd": lambda args, kernel: _scratch_of_call(args, True, kernel)}


def linear_cross_entropy(x: Tensor, weight: Tensor, target: Tensor, bias: Optional[Tensor] = None, *,
                         ignore_index: int = -100, reduction: str = "mean",
                         num_items_in_batch: Union[Tensor, int, None] = None, label_smoothing: float = 0.0,
                         z_loss: float = 0.0, softcap: Optional[float] = None,
                         block: Optional[int] = None, rows_checked: bool = False) -> Tensor:
    """``F.cross_entropy(F.linear(x, weight, bias).float(), target, ...)`` without the logits (module
    docstring). x [..., h], weight [V, h], target [...] of integers (``ignore_index`` rows dropped),
    bias [V] or None. ``num_items_in_batch`` (with reduction "mean") divides the sum instead of the
    count of rows not ignored. ``softcap`` > 0: Gemma's c·tanh(z/c) on the logits first.
    ``rows_checked``: every target is in [0, V) and none is ignore_index (the caller gathered them with
    ``labelled_rows``), so the op reads nothing on the host; otherwise it reads the count of kept rows
    and of targets out of range once, in one transfer, in forward only."""
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
    if block is not None and int(block) < 1:
        raise ValueError(f"{OP}: block={block} must be a positive number of vocabulary columns")
    h = x.shape[-1]
    rows = x.reshape(-1, h)
    dtype = autocast_dtype_for(rows) or rows.dtype
    loss, _lse, _count = _fwd_op(rows.contiguous(), weight, bias, target.reshape(-1).long(), int(ignore_index),
                                 float(label_smoothing), float(z_loss), bool(rows_checked), float(softcap or 0.0),
                                 dtype, int(block or vocab_block(weight.shape[0], h)), resolve_backend(rows, OP))
    if reduction == "none":
        return loss.view(target.shape)
    total = loss.sum()
    if reduction == "sum":
        return total
    if num_items_in_batch is not None:
        return total / num_items_in_batch
    return total / (target != ignore_index).sum()


__all__ = ["SCRATCH", "labelled_rows", "linear_cross_entropy", "scratch_bytes", "vocab_block"]
