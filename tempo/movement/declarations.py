"""What each recorded op moves on a GPU: one declaration per op that is not counted by its I/O.

Every recorded op becomes one or more ``Kernel`` records (bytes read, bytes written, FLOPs, class).
By default an op is one kernel that reads each tensor argument once and writes each output once
(views cost nothing; a broadcast dim counts once; out= arguments and the self of copy_/fill_ are
written, not read): Substation's count, and what CUDA's element-wise, reduction, GEMM and
single-pass normalisation kernels do. The ops below are declared instead, because their CUDA
kernels move something else:

* Tempo's custom ops (``tempo.*``): on the CPU they run a reference path (tiled attention, the
  mask drawn by a CPU generator, aten's LayerNorm on a recovered x̂); on CUDA they run Triton
  kernels plus a few torch ops around them. Each declaration lists those kernels with what each
  loads and stores, exactly as written in tempo/ops/*.py (``triton=True`` marks the ones
  tests/test_movement.py checks against Triton's interpreter), and the torch ops the host code
  runs around them (casts, the dγ/dβ partial sums). An undeclared ``tempo.*`` op is an error.
* Fused attention (``aten._scaled_dot_product_flash_attention``, ``_efficient_attention``, the
  variable-length ``_flash_attention_forward``, and Tempo's ``efficient_attention`` ops, which on
  CUDA call them): FlashAttention-2 as PyTorch vendors it. Forward reads q, k, v (and the mask
  bias), writes out, one fp32 log-sum-exp per row and the philox seed/offset. Backward runs three
  kernels: D = rowsum(dO·O) (reads O and dO, writes D and zeroes an fp32 dq accumulator), the
  main kernel (reads q, k, v, dO, lse, D; writes dk, dv; accumulates dq in fp32, counted once:
  the atomics resolve in L2) and the dq conversion (reads the fp32 accumulator, writes dq).
  Tiles re-read from L2 are not counted, as for GEMMs.
* ``aten.native_layer_norm_backward``: two CUDA kernels (dX; dγ/dβ), each reading dY and X.
* Gathers (``embedding``, ``index_select``, ``gather``, ``index``): they read the rows they
  return, not the whole table.

FLOPs: torch.utils.flop_counter's formulas (matrix products and attention: 2 per multiply-add);
element-wise work counts 0, as in FlopCounterMode. Kernel classes are Substation's: tensor
contractions, statistical normalisations, element-wise (which here takes copies, casts,
reductions and gathers too).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch.utils.flop_counter import sdpa_backward_flop_count, sdpa_flop_count

from tempo.movement.trace import OpCall, TensorMeta, itemsize

CONTRACTION = "tensor contraction"
NORMALIZATION = "normalization"
ELEMENTWISE = "element-wise"
CLASSES = (CONTRACTION, NORMALIZATION, ELEMENTWISE)

SEED_BYTES = 8  # Tempo's dropout seed: a 0-d int64 tensor
PHILOX_BYTES = 16  # sdpa's philox seed and offset: two 8-byte words


@dataclass(frozen=True)
class Kernel:
    """One GPU kernel (or host-side torch op) of a recorded op."""

    name: str
    cls: str  # one of CLASSES
    read: int
    written: int
    flops: int = 0
    dtype: Optional[torch.dtype] = None  # the dtype its FLOPs run in (tensor-core peak for 16-bit)
    triton: bool = False  # a Tempo Triton kernel: its loads and stores are checked in the interpreter

    @property
    def moved(self) -> int:
        return self.read + self.written


@dataclass(frozen=True)
class Target:
    """Where the kernels run: ``sms`` streaming multiprocessors (Tempo's backward launchers size their
    grids by it), or None for Triton's interpreter (the launchers' CPU sizing)."""

    name: str
    sms: Optional[int]


INTERPRETER = Target("triton interpreter", None)

Declaration = Callable[[OpCall, Target], list[Kernel]]
DECLARATIONS: dict[str, Declaration] = {}


class UndeclaredOp(LookupError):
    """A ``tempo.*`` op with no declaration: its CPU path says nothing about its CUDA kernels."""


def declares(*packets: str) -> Callable[[Declaration], Declaration]:
    def register(fn: Declaration) -> Declaration:
        for packet in packets:
            DECLARATIONS[packet] = fn
        return fn
    return register


# ---------------------------------------------------------------------------------------------
# The default: one kernel, its inputs read once, its outputs written once
# ---------------------------------------------------------------------------------------------
_NORMALIZATION_PACKETS = {
    "aten._softmax", "aten._log_softmax", "aten._softmax_backward_data", "aten._log_softmax_backward_data",
    "aten._safe_softmax", "aten.native_layer_norm", "aten.native_layer_norm_backward", "aten.native_group_norm",
    "aten.native_group_norm_backward", "aten._fused_rms_norm", "aten._fused_rms_norm_backward",
    "aten.nll_loss_forward", "aten.nll_loss_backward", "aten.nll_loss2d_forward", "aten.nll_loss2d_backward",
}


def classify(call: OpCall) -> str:
    if call.flops > 0:
        return CONTRACTION
    if call.packet in _NORMALIZATION_PACKETS:
        return NORMALIZATION
    return ELEMENTWISE


def _compute_dtype(call: OpCall) -> Optional[torch.dtype]:
    return call.reads[0].dtype if call.reads else None


def io_kernel(call: OpCall) -> Kernel:
    """The default count: each read argument once, each output once."""
    return Kernel(call.packet, classify(call), sum(t.nbytes for t in call.reads), sum(t.nbytes for t in call.writes),
                  call.flops, _compute_dtype(call))


def kernels_of(call: OpCall, target: Target) -> list[Kernel]:
    """The kernels ``call`` runs on ``target``: its declaration, else the default I/O count."""
    declaration = DECLARATIONS.get(call.packet)
    if declaration is not None:
        return declaration(call, target)
    if call.packet.startswith("tempo."):
        raise UndeclaredOp(f"tempo.movement: no declaration for {call.op}: a Tempo op must declare the bytes its "
                           f"CUDA kernels move (tempo/movement/declarations.py); its CPU path would be counted instead")
    return [io_kernel(call)]


# ---------------------------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------------------------
def _size(dtype: torch.dtype) -> int:
    return itemsize(dtype)


def _opt_bytes(meta: Optional[TensorMeta]) -> int:
    return 0 if meta is None else meta.nbytes


def _copy(name: str, meta: TensorMeta, dtype: Optional[torch.dtype] = None) -> Kernel:
    """A copy (or cast to ``dtype``) of ``meta``'s elements."""
    return Kernel(name, ELEMENTWISE, meta.numel * meta.itemsize, meta.numel * _size(dtype or meta.dtype))


def _batch_flattenable(meta: TensorMeta) -> bool:
    """True when the leading (batch) dims of a >= 3-d tensor merge into one without a copy, so that
    torch.matmul's reshape to [batch, m, n] is a view."""
    dims = [(n, s) for n, s in zip(meta.shape[:-2], meta.stride[:-2]) if n != 1]
    return all(dims[i][1] == dims[i + 1][1] * dims[i + 1][0] for i in range(len(dims) - 1))


def _next_power_of_2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


# ---------------------------------------------------------------------------------------------
# Stock ops whose CUDA kernels are not one pass over their I/O
# ---------------------------------------------------------------------------------------------
@declares("aten.native_layer_norm_backward")
def _layer_norm_backward(call: OpCall, target: Target) -> list[Kernel]:
    """layer_norm_backward_cuda: layer_norm_grad_input_kernel (dY, X, mean, rstd, γ -> dX), then
    the γ/β kernel (dY, X, mean, rstd -> dγ, dβ)."""
    dy, x, mean, rstd = (call.arg(n) for n in ("grad_out", "input", "mean", "rstd"))
    weight = call.arg("weight")
    dx, dw, db = (call.outputs + (None, None, None))[:3]
    stats = mean.nbytes + rstd.nbytes
    kernels = [Kernel("layer_norm_grad_input_kernel", NORMALIZATION, dy.nbytes + x.nbytes + stats + _opt_bytes(weight),
                      _opt_bytes(dx) if isinstance(dx, TensorMeta) else 0)]
    param_grads = [t for t in (dw, db) if isinstance(t, TensorMeta) and t.numel]
    if param_grads:
        kernels.append(Kernel("GammaBetaBackwardCUDAKernel", NORMALIZATION, dy.nbytes + x.nbytes + stats,
                              sum(t.nbytes for t in param_grads)))
    return kernels


@declares("aten.embedding", "aten.index_select", "aten.gather", "aten.index")
def _gather(call: OpCall, target: Target) -> list[Kernel]:
    """A gather reads its indices and the source elements it returns (as many as its output holds)."""
    out = call.tensor_outputs()[0]
    table = call.reads[0] if call.packet != "aten.embedding" else call.arg("weight")
    indices = sum(t.nbytes for t in call.reads if t is not table)
    gathered = out.numel * table.itemsize
    return [Kernel(call.packet, ELEMENTWISE, indices + gathered, out.nbytes)]


# ---------------------------------------------------------------------------------------------
# Fused attention: FlashAttention-2 as PyTorch runs it (module docstring)
# ---------------------------------------------------------------------------------------------
def _attention_forward(q: TensorMeta, k: TensorMeta, v: TensorMeta, out_bytes: int, rows: int,
                       bias: Optional[TensorMeta], dropout: bool, name: str,
                       lse_rows: Optional[int] = None, flops: Optional[int] = None) -> Kernel:
    """One fused forward kernel. ``rows``: query rows (b·h·s_q, or h·T for variable length);
    ``flops`` defaults to flop_counter's sdpa formula for (b, h, s, d) tensors."""
    if flops is None:
        flops = sdpa_flop_count(_bhsd(q), _bhsd(k), _bhsd(v))
    read = q.nbytes + k.nbytes + v.nbytes + _opt_bytes(bias)
    written = out_bytes + 4 * (lse_rows if lse_rows is not None else rows) + (PHILOX_BYTES if dropout else 0)
    return Kernel(name, CONTRACTION, read, written, flops, q.dtype)


def _attention_backward(q: TensorMeta, k: TensorMeta, v: TensorMeta, out_bytes: int, rows: int,
                        bias: Optional[TensorMeta], dropout: bool, prefix: str,
                        lse_rows: Optional[int] = None, flops: Optional[int] = None) -> list[Kernel]:
    """The three backward kernels: D = rowsum(dO·O), the main kernel, the dq conversion."""
    lse_rows = lse_rows if lse_rows is not None else rows
    dq_accum = 4 * q.numel  # fp32 accumulator of dq
    seed = PHILOX_BYTES if dropout else 0
    if flops is None:
        flops = sdpa_backward_flop_count(_bhsd(q), _bhsd(q), _bhsd(k), _bhsd(v))
    d_bytes = 4 * rows
    return [
        Kernel(f"{prefix}_bwd_dot_do_o", ELEMENTWISE, 2 * out_bytes, d_bytes + dq_accum),
        Kernel(f"{prefix}_bwd_dq_dk_dv", CONTRACTION,
               q.nbytes + k.nbytes + v.nbytes + out_bytes + 4 * lse_rows + d_bytes + _opt_bytes(bias) + seed,
               k.nbytes + v.nbytes + dq_accum, flops, q.dtype),
        Kernel(f"{prefix}_bwd_convert_dq", ELEMENTWISE, dq_accum, q.numel * q.itemsize),
    ]


def _bhsd(t: TensorMeta) -> tuple[int, int, int, int]:
    return tuple(t.shape)  # type: ignore[return-value]


@declares("aten._scaled_dot_product_flash_attention")
def _flash_forward(call: OpCall, target: Target) -> list[Kernel]:
    q, k, v = call.arg("query"), call.arg("key"), call.arg("value")
    out = call.tensor_outputs()[0]
    b, h, sq, _ = q.shape
    flops = _grouped_flops(q, k, v, backward=False) if k.shape[1] != h else None  # enable_gqa: kv as they are
    return [_attention_forward(q, k, v, out.nbytes, b * h * sq, None, call.arg("dropout_p") > 0, "flash_fwd",
                               flops=flops)]


@declares("aten._scaled_dot_product_flash_attention_backward")
def _flash_backward(call: OpCall, target: Target) -> list[Kernel]:
    q, k, v, out = call.arg("query"), call.arg("key"), call.arg("value"), call.arg("out")
    b, h, sq, _ = q.shape
    flops = _grouped_flops(q, k, v, backward=True) if k.shape[1] != h else None
    return _attention_backward(q, k, v, out.nbytes, b * h * sq, None, call.arg("dropout_p") > 0, "flash", flops=flops)


@declares("aten._scaled_dot_product_efficient_attention")
def _efficient_forward(call: OpCall, target: Target) -> list[Kernel]:
    q, k, v, bias = call.arg("query"), call.arg("key"), call.arg("value"), call.arg("attn_bias")
    out = call.tensor_outputs()[0]
    b, h, sq, _ = q.shape
    lse_rows = b * h * _cdiv(sq, 32) * 32  # the efficient kernel pads its log-sum-exp to 32 rows
    return [_attention_forward(q, k, v, out.nbytes, b * h * sq, bias, call.arg("dropout_p") > 0, "efficient_fwd",
                               lse_rows)]


@declares("aten._scaled_dot_product_efficient_attention_backward")
def _efficient_backward(call: OpCall, target: Target) -> list[Kernel]:
    q, k, v, out = call.arg("query"), call.arg("key"), call.arg("value"), call.arg("out")
    bias = call.arg("attn_bias")
    b, h, sq, _ = q.shape
    lse_rows = b * h * _cdiv(sq, 32) * 32
    return _attention_backward(q, k, v, out.nbytes, b * h * sq, bias, call.arg("dropout_p") > 0, "efficient",
                               lse_rows)


@declares("aten._flash_attention_forward")
def _varlen_flash_forward(call: OpCall, target: Target) -> list[Kernel]:
    q, k, v = call.arg("query"), call.arg("key"), call.arg("value")  # [T, h, d]
    out = call.tensor_outputs()[0]
    kernel = _attention_forward(q, k, v, out.nbytes, q.shape[0] * q.shape[1], None, call.arg("dropout_p") > 0,
                                "flash_varlen_fwd", flops=call.flops)
    read = kernel.read + call.arg("cum_seq_q").nbytes + call.arg("cum_seq_k").nbytes
    return [Kernel(kernel.name, kernel.cls, read, kernel.written, kernel.flops, q.dtype)]


@declares("aten._flash_attention_backward")
def _varlen_flash_backward(call: OpCall, target: Target) -> list[Kernel]:
    q, k, v, out = call.arg("query"), call.arg("key"), call.arg("value"), call.arg("out")
    return _attention_backward(q, k, v, out.nbytes, q.shape[0] * q.shape[1], None, call.arg("dropout_p") > 0,
                               "flash_varlen", flops=call.flops)


# ---------------------------------------------------------------------------------------------
# Tempo's custom ops, as their CUDA path runs them (tempo/ops/*.py)
# ---------------------------------------------------------------------------------------------
def _at_query_heads(t: TensorMeta, heads: int) -> TensorMeta:
    """k or v expanded to the query heads (grouped-query attention), contiguous."""
    shape = (t.shape[0], heads, *t.shape[2:])
    stride = tuple(math.prod(shape[i + 1:]) for i in range(len(shape)))
    return TensorMeta(shape, stride, t.dtype)


def _grouped_flops(q: TensorMeta, k: TensorMeta, v: TensorMeta, backward: bool) -> int:
    """sdpa's flop formula with k and v at the query heads (each kv head serves its group)."""
    heads = q.shape[1]
    k_e, v_e = _bhsd(_at_query_heads(k, heads)), _bhsd(_at_query_heads(v, heads))
    if backward:
        return sdpa_backward_flop_count(_bhsd(q), _bhsd(q), k_e, v_e)
    return sdpa_flop_count(_bhsd(q), k_e, v_e)


@declares("tempo.efficient_attention_fwd")
def _tempo_attention_forward(call: OpCall, target: Target) -> list[Kernel]:
    """On CUDA ``efficient_attention`` calls sdpa's fused kernels (flash without a mask, efficient
    with one, after ``_fused_mask`` copies the mask with entries <= FUSED_MASK_FLOOR made -inf);
    this op is its CPU/fallback path and is counted as those kernels. Grouped kv heads reach this op
    16-bit and without a mask only (efficient_attention expands them before it otherwise): flash
    reads them as they are."""
    q, k, v, mask = call.arg("q"), call.arg("k"), call.arg("v"), call.arg("attn_mask")
    b, h, sq, _ = q.shape
    dropout = call.arg("dropout_p") > 0
    out_bytes = call.tensor_outputs()[0].nbytes
    grouped = k.shape[1] != h
    flops = _grouped_flops(q, k, v, backward=False) if grouped else None
    if mask is None and q.dtype in (torch.float16, torch.bfloat16):
        return [_attention_forward(q, k, v, out_bytes, b * h * sq, None, dropout, "flash_fwd", flops=flops)]
    kernels = []
    if mask is not None:
        kernels.append(Kernel("_fused_mask (masked_fill)", ELEMENTWISE, mask.nbytes, mask.numel * q.itemsize))
    kernels.append(_attention_forward(q, k, v, out_bytes, b * h * sq, mask, dropout, "efficient_fwd",
                                      b * h * _cdiv(sq, 32) * 32))
    return kernels + _attention_bias_bytes(call, backward=False)


def _attention_bias_bytes(call: OpCall, backward: bool) -> list[Kernel]:
    """``attn_bias`` (MPNet's batch-shared bias): on CUDA it runs the tiled reference op, which no
    CUDA kernel of ours stands for; counted as one more read of the bias per pass (and, in backward,
    a write of its gradient when it needs one) beside the fused kernels' bytes: an approximation."""
    bias = call.arg("attn_bias")
    if bias is None:
        return []
    written = bias.nbytes if backward and call.arg("bias_needs_grad") else 0
    return [Kernel("attn_bias (read with the scores" + ("; its gradient" if written else "") + ")", ELEMENTWISE,
                   bias.nbytes, written)]


@declares("tempo.efficient_attention_bwd")
def _tempo_attention_backward(call: OpCall, target: Target) -> list[Kernel]:
    q, k, v, out, mask = call.arg("q"), call.arg("k"), call.arg("v"), call.arg("out"), call.arg("attn_mask")
    b, h, sq, _ = q.shape
    dropout = call.arg("dropout_p") > 0
    grouped = k.shape[1] != h
    flops = _grouped_flops(q, k, v, backward=True) if grouped else None
    if mask is None and q.dtype in (torch.float16, torch.bfloat16):
        return _attention_backward(q, k, v, out.nbytes, b * h * sq, None, dropout, "flash", flops=flops) + \
            _attention_bias_bytes(call, backward=True)
    return _attention_backward(q, k, v, out.nbytes, b * h * sq, mask, dropout, "efficient",
                               b * h * _cdiv(sq, 32) * 32) + _attention_bias_bytes(call, backward=True)


def _varlen_flops(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, backward: bool) -> int:
    """sdpa's flop formulas summed over the packed sequences (cu_seqlens holds real offsets)."""
    h, d, d_v = q.shape[1], q.shape[2], v.shape[2]
    offsets = [int(o) for o in cu_seqlens.tolist()]
    total = 0
    for n in (b - a for a, b in zip(offsets[:-1], offsets[1:])):
        qs, ks, vs = (1, h, n, d), (1, h, n, d), (1, h, n, d_v)
        total += sdpa_backward_flop_count((1, h, n, d_v), qs, ks, vs) if backward else sdpa_flop_count(qs, ks, vs)
    return total


def _register_varlen_flop_formulas() -> None:
    """flop_counter formulas for Tempo's variable-length attention ops (the Recorder reads them)."""
    from torch.utils.flop_counter import flop_registry, register_flop_formula

    import tempo.ops.attention  # noqa: F401  (defines the ops)

    fwd, bwd = torch.ops.tempo.efficient_attention_varlen_fwd, torch.ops.tempo.efficient_attention_varlen_bwd
    if fwd in flop_registry:
        return

    @register_flop_formula(fwd, get_raw=True)
    def _fwd_flops(q, k, v, cu_seqlens, *args, out_val=None, **kwargs) -> int:
        return _varlen_flops(q, k, v, cu_seqlens, backward=False)

    @register_flop_formula(bwd, get_raw=True)
    def _bwd_flops(grad_out, q, k, v, out, stats, cu_seqlens, *args, out_val=None, **kwargs) -> int:
        return _varlen_flops(q, k, v, cu_seqlens, backward=True)


def _varlen_kernel_prefix(q: TensorMeta) -> str:
    # Nested jagged sdpa: flash for 16-bit inputs, the efficient kernel otherwise (fp32).
    return "flash_varlen" if q.dtype in (torch.float16, torch.bfloat16) else "efficient_varlen"


@declares("tempo.efficient_attention_varlen_fwd")
def _tempo_varlen_forward(call: OpCall, target: Target) -> list[Kernel]:
    """On CUDA ``efficient_attention_varlen`` runs sdpa on nested jagged tensors: the fused
    variable-length kernel on the [T, h, d] values with the offsets (as ``_flash_attention_forward``)."""
    q, k, v, cu = call.arg("q"), call.arg("k"), call.arg("v"), call.arg("cu_seqlens")
    t, h, _ = q.shape
    out = call.tensor_outputs()[0]
    kernel = _attention_forward(q, k, v, out.nbytes, t * h, None, call.arg("dropout_p") > 0,
                                _varlen_kernel_prefix(q) + "_fwd", flops=call.flops)
    return [Kernel(kernel.name, kernel.cls, kernel.read + 2 * cu.nbytes, kernel.written, kernel.flops, q.dtype)]


@declares("tempo.efficient_attention_varlen_bwd")
def _tempo_varlen_backward(call: OpCall, target: Target) -> list[Kernel]:
    q, k, v, out = call.arg("q"), call.arg("k"), call.arg("v"), call.arg("out")
    t, h, _ = q.shape
    return _attention_backward(q, k, v, out.nbytes, t * h, None, call.arg("dropout_p") > 0,
                               _varlen_kernel_prefix(q), flops=call.flops)


@declares("tempo.inplace_gelu")
def _gelu_forward(call: OpCall, target: Target) -> list[Kernel]:
    """_gelu_fwd_kernel: reads x, writes y and the branch bits (one bit per element, whole bytes)."""
    x = call.arg("x")
    bits = _cdiv(x.numel, 8)
    return [Kernel("_gelu_fwd_kernel", ELEMENTWISE, x.numel * x.itemsize, x.numel * x.itemsize + bits, triton=True)]


def gelu_table_bytes(approximate: str = "none") -> int:
    """Bytes of the fp32 derivative table the backward kernel reads (whatever layout
    tempo.ops.gelu gives it; built on the CPU once per process). A real activation's y values
    spread over every entry; the table stays in L2 after the first reads, so it is counted once."""
    from tempo.ops.gelu import derivative_table

    table = derivative_table("cpu", torch.float32, approximate)
    return table.numel() * table.element_size()


@declares("tempo.inplace_gelu_backward")
def _gelu_backward(call: OpCall, target: Target) -> list[Kernel]:
    """grad.contiguous() (a copy only for a non-contiguous gradient), then _gelu_bwd_kernel: reads
    grad, y, the bits and the derivative table, writes dx."""
    grad, y = call.arg("grad"), call.arg("y")
    n = y.numel
    kernels = [] if grad.is_contiguous else [_copy("grad.contiguous()", grad)]
    read = n * grad.itemsize + n * y.itemsize + _cdiv(n, 8) + gelu_table_bytes(call.arg("approximate"))
    kernels.append(Kernel("_gelu_bwd_kernel", ELEMENTWISE, read, n * y.itemsize, triton=True))
    return kernels


@declares("tempo.seeded_dropout")
def _seeded_dropout(call: OpCall, target: Target) -> list[Kernel]:
    """_seeded_dropout_kernel, forward and backward alike (backward is the op on dy): reads x and
    the seed, writes y; the mask is drawn again from the seed, never stored."""
    x = call.arg("x")
    return [Kernel("_seeded_dropout_kernel", ELEMENTWISE, x.numel * x.itemsize + SEED_BYTES, x.numel * x.itemsize,
                   triton=True)]


@declares("tempo.layernorm_plan")
def _layernorm_plan(call: OpCall, target: Target) -> list[Kernel]:
    """plan_kept_columns: a few element-wise kernels over the N columns of γ and β (|γ|, |β|, the
    comparison, the finiteness flags) and one host read of N flags; counted as one pass reading γ
    and β and writing the N one-byte flags (a lower bound; ~0.1 % of a BERT LayerNorm's bytes). On
    CUDA it is made once per optimizer step for all layers (at the step), so a training step of one
    forward makes it once per layer, as counted here."""
    weight, bias = call.arg("weight"), call.arg("bias")
    return [Kernel("plan_kept_columns", ELEMENTWISE, _opt_bytes(weight) + _opt_bytes(bias), call.arg("n"))]


def _kept(call_kept_xhat: TensorMeta) -> int:
    return call_kept_xhat.shape[1] if len(call_kept_xhat.shape) == 2 else 0


def _rows_n(x: TensorMeta, trailing: int) -> tuple[int, int]:
    n = math.prod(x.shape[len(x.shape) - trailing:])
    return x.numel // max(n, 1), n


@declares("tempo.layernorm_fwd")
def _layernorm_forward(call: OpCall, target: Target) -> list[Kernel]:
    """_layernorm_fwd_kernel (its plan is ``tempo.layernorm_plan``'s): reads x, γ, β, writes y, rstd
    (fp32 per row) and, when K > 0 columns are kept, the row mean; the host then gathers the kept
    columns' x̂ = (x[:, cols] − mean)·rstd in fp32 (a few small torch kernels over rows × K)."""
    x, weight, bias = call.arg("x"), call.arg("weight"), call.arg("bias")
    y, _rstd, _cols, kept_xhat = call.outputs
    rows, _n = _rows_n(x, call.arg("normalized_ndim"))
    k = _kept(kept_xhat)
    read = x.numel * x.itemsize + _opt_bytes(weight) + _opt_bytes(bias)
    written = y.numel * y.itemsize + 4 * rows + (4 * rows if k else 0)
    kernels = [Kernel("_layernorm_fwd_kernel", NORMALIZATION, read, written, triton=True)]
    if k:
        block = rows * k
        kernels.append(Kernel("x[:, kept_cols]", ELEMENTWISE, block * x.itemsize + 8 * k, block * x.itemsize))
        if x.itemsize != 4:
            kernels.append(Kernel("kept.float()", ELEMENTWISE, block * x.itemsize, 4 * block))
        kernels += [Kernel("kept - mean", ELEMENTWISE, 4 * block + 4 * rows, 4 * block),
                    Kernel("kept * rstd", ELEMENTWISE, 4 * block + 4 * rows, 4 * block)]
    return kernels


def _recovery_inverse(n: int, weight: Optional[TensorMeta]) -> list[Kernel]:
    """recovery_inverse: γ cast to fp32 (a copy unless it is fp32) and its reciprocal."""
    if weight is None:
        return []
    kernels = [] if weight.dtype == torch.float32 else [_copy("γ.to(float32)", weight, torch.float32)]
    return kernels + [Kernel("γ.reciprocal()", ELEMENTWISE, 4 * n, 4 * n)]


def _partial_sums(programs: int, n: int, params: list[TensorMeta]) -> list[Kernel]:
    """The host sums the per-program fp32 dγ/dβ partials ([programs, N] each) and casts them to the
    parameters' dtype."""
    kernels = []
    for p in params:
        kernels.append(Kernel("partials.sum(0)", ELEMENTWISE, 4 * programs * n, 4 * n))
        if p.dtype != torch.float32:
            kernels.append(Kernel("partials.to(param dtype)", ELEMENTWISE, 4 * n, n * p.itemsize))
    return kernels


@declares("tempo.layernorm_bwd")
def _layernorm_backward(call: OpCall, target: Target) -> list[Kernel]:
    """recovery_inverse, then (N <= BWD_BLOCK_MAX) _layernorm_bwd_kernel, or the wide pair
    _layernorm_bwd_row_sums_kernel + _layernorm_bwd_wide_kernel, then the partial sums. Grid sizes
    from tempo.ops.layernorm._backward_plan for ``target.sms``."""
    from tempo.ops.layernorm import _backward_plan

    dy, y, rstd, kept_xhat = call.arg("grad_y"), call.arg("y"), call.arg("rstd"), call.arg("kept_xhat")
    weight, bias = call.arg("weight"), call.arg("bias")
    rows, n = _rows_n(y, call.arg("normalized_ndim"))
    k = _kept(kept_xhat)
    dx_bytes = y.numel * _size(call.arg("x_dtype"))
    wide, programs, _rows_per_program, _chunks = _backward_plan(rows, n, target.sms)
    params = [p for p in (weight, bias) if p is not None]
    # What _recover loads per column: β, 1/γ (fp32), and with K > 0 the slots (int32) and the kept x̂.
    recover = _opt_bytes(bias) + (4 * n if weight is not None else 0) + ((4 * n + 4 * rows * k) if k else 0)
    rows_in = dy.numel * dy.itemsize + y.numel * y.itemsize
    partials = 4 * programs * n * len(params)
    kernels = _recovery_inverse(n, weight)
    if not wide:
        kernels.append(Kernel("_layernorm_bwd_kernel", NORMALIZATION,
                              rows_in + _opt_bytes(weight) + recover + rstd.nbytes, dx_bytes + partials, triton=True))
    else:
        sums = 8 * rows  # two fp32 row sums
        kernels.append(Kernel("_layernorm_bwd_row_sums_kernel", NORMALIZATION,
                              rows_in + _opt_bytes(weight) + recover, sums, triton=True))
        kernels.append(Kernel("_layernorm_bwd_wide_kernel", NORMALIZATION,
                              rows_in + _opt_bytes(weight) + recover + rstd.nbytes + sums, dx_bytes + partials,
                              triton=True))
    return kernels + _partial_sums(programs, n, params)


@declares("tempo.rmsnorm_fwd")
def _rmsnorm_forward(call: OpCall, target: Target) -> list[Kernel]:
    """_rmsnorm_fwd_kernel (its plan is ``tempo.layernorm_plan``'s, β = None): reads x and w, writes y
    and rstd (fp32 per row); when K > 0 columns are kept the host gathers their x̂ = x[:, cols]·rstd
    in fp32 (a few small torch kernels over rows × K)."""
    x, weight = call.arg("x"), call.arg("weight")
    y, _rstd, _cols, kept_xhat = call.outputs
    rows, _n = _rows_n(x, call.arg("normalized_ndim"))
    k = _kept(kept_xhat)
    kernels = [Kernel("_rmsnorm_fwd_kernel", NORMALIZATION, x.numel * x.itemsize + _opt_bytes(weight),
                      y.numel * y.itemsize + 4 * rows, triton=True)]
    if k:
        block = rows * k
        kernels.append(Kernel("x[:, kept_cols]", ELEMENTWISE, block * x.itemsize + 8 * k, block * x.itemsize))
        if x.itemsize != 4:
            kernels.append(Kernel("kept.float()", ELEMENTWISE, block * x.itemsize, 4 * block))
        kernels.append(Kernel("kept * rstd", ELEMENTWISE, 4 * block + 4 * rows, 4 * block))
    return kernels


@declares("tempo.rmsnorm_bwd")
def _rmsnorm_backward(call: OpCall, target: Target) -> list[Kernel]:
    """w_eff (Gemma's form: 1 + w in fp32) and its reciprocal (recovery_inverse), then (N <=
    BWD_BLOCK_MAX) _rmsnorm_bwd_kernel, or the wide pair _rmsnorm_bwd_row_sums_kernel (one row sum,
    Σ g·w_eff·x̂) + _rmsnorm_bwd_wide_kernel, then the partial sums of dw. Grid sizes from
    tempo.ops.layernorm._backward_plan for ``target.sms``."""
    from tempo.ops.layernorm import _backward_plan

    dy, y, rstd, kept_xhat, weight = (call.arg("grad_y"), call.arg("y"), call.arg("rstd"), call.arg("kept_xhat"),
                                      call.arg("weight"))
    rows, n = _rows_n(y, call.arg("normalized_ndim"))
    k = _kept(kept_xhat)
    dx_bytes = y.numel * _size(call.arg("x_dtype"))
    wide, programs, _rows_per_program, _chunks = _backward_plan(rows, n, target.sms)
    kernels: list[Kernel] = []
    w_bytes = 0  # w_eff as the kernels load it
    if weight is not None:
        if call.arg("unit_offset"):
            if weight.dtype != torch.float32:
                kernels.append(_copy("w.to(float32)", weight, torch.float32))
            kernels.append(Kernel("w + 1", ELEMENTWISE, 4 * n, 4 * n))
            w_bytes = 4 * n
            kernels.append(Kernel("γ.reciprocal()", ELEMENTWISE, 4 * n, 4 * n))
        else:
            w_bytes = weight.nbytes
            kernels += _recovery_inverse(n, weight)
    # What _recover loads per column: 1/w_eff (fp32), and with K > 0 the slots (int32), w_eff and the kept x̂.
    recover = (4 * n if weight is not None else 0) + ((4 * n + 4 * rows * k + w_bytes) if k else 0)
    rows_in = dy.numel * dy.itemsize + y.numel * y.itemsize
    partials = 4 * programs * n if weight is not None else 0
    # The kernels load w_eff for g·w_eff too; _recover's loads of it (K > 0) are the same addresses.
    w_loaded = w_bytes if not k else 0
    if not wide:
        kernels.append(Kernel("_rmsnorm_bwd_kernel", NORMALIZATION, rows_in + w_loaded + recover + rstd.nbytes,
                              dx_bytes + partials, triton=True))
    else:
        sums = 4 * rows  # one fp32 row sum
        kernels.append(Kernel("_rmsnorm_bwd_row_sums_kernel", NORMALIZATION, rows_in + recover, sums, triton=True))
        kernels.append(Kernel("_rmsnorm_bwd_wide_kernel", NORMALIZATION, rows_in + w_loaded + recover + rstd.nbytes
                              + sums, dx_bytes + partials, triton=True))
    return kernels + _partial_sums(programs, n, [weight] if weight is not None else [])


@declares("tempo.dropout_add_layernorm_fwd")
def _dal_forward(call: OpCall, target: Target) -> list[Kernel]:
    """_dal_fwd_kernel (its plan is ``tempo.layernorm_plan``'s): reads x, residual, γ, β, the seed (with
    dropout) and the slots (K > 0); writes y, rstd and the kept x̂."""
    x, residual, weight, bias = call.arg("x"), call.arg("residual"), call.arg("weight"), call.arg("bias")
    y, _rstd, _cols, kept_xhat = call.outputs
    rows, n = _rows_n(x, len(call.arg("normalized_shape")))
    k = _kept(kept_xhat)
    dropout = call.arg("training") and call.arg("p") > 0
    read = (x.numel * x.itemsize + residual.numel * residual.itemsize + _opt_bytes(weight) + _opt_bytes(bias)
            + (SEED_BYTES if dropout else 0) + (4 * n if k else 0))
    written = y.numel * y.itemsize + 4 * rows + 4 * rows * k
    return [Kernel("_dal_fwd_kernel", NORMALIZATION, read, written, triton=True)]


def dal_backward_programs(rows: int, sms: Optional[int]) -> int:
    """tempo.ops.dropout_add_layernorm._backward_programs: 4 programs per SM on CUDA, at most 4 on
    the interpreter, then trimmed so that no program is left without rows."""
    programs = max(1, min(rows, 4 * sms if sms is not None else 4))
    rows_per_program = _cdiv(rows, programs)
    return _cdiv(rows, rows_per_program)


@declares("tempo.dropout_add_layernorm_bwd")
def _dal_backward(call: OpCall, target: Target) -> list[Kernel]:
    """recovery_inverse, _dal_bwd_kernel (reads dy, y, γ, β, 1/γ, rstd, the seed — loaded whether or
    not dropout is on — and the kept x̂; writes dx, d(residual) and the dγ/dβ partials), then the
    partial sums."""
    dy, y, rstd, kept_xhat = call.arg("grad_y"), call.arg("y"), call.arg("rstd"), call.arg("kept_xhat")
    weight, bias = call.arg("weight"), call.arg("bias")
    rows, n = _rows_n(y, len(call.arg("normalized_shape")))
    k = _kept(kept_xhat)
    programs = dal_backward_programs(rows, target.sms)
    params = [p for p in (weight, bias) if p is not None]
    recover = _opt_bytes(bias) + (4 * n if weight is not None else 0) + ((4 * n + 4 * rows * k) if k else 0)
    read = dy.numel * dy.itemsize + y.numel * y.itemsize + _opt_bytes(weight) + recover + rstd.nbytes + SEED_BYTES
    written = y.numel * (_size(call.arg("x_dtype")) + _size(call.arg("residual_dtype"))) + 4 * programs * n * len(params)
    return (_recovery_inverse(n, weight) + [Kernel("_dal_bwd_kernel", NORMALIZATION, read, written, triton=True)]
            + _partial_sums(programs, n, params))


def _linear_cross_entropy(call: OpCall, backward: bool) -> list[Kernel]:
    """tempo.ops.linear_cross_entropy's blocks as it runs them on CUDA, its Triton path (every row
    counted as kept: a trace cannot read the targets). Before the blocks: the kept rows' gather and
    cast. Per block of vocabulary columns: the weight block's cast (when its dtype is not the GEMM's),
    the GEMM (rows x block) and the rows' target column in the block (int32); forward,
    _lce_block_fwd_kernel reads the GEMM's output once and writes 3 fp32 per row; backward,
    _lce_block_bwd_kernel reads it and 4 fp32 per row and writes the gradient over it, then two GEMMs:
    the rows' gradient (added into an fp32 sum) and the block's weight gradient (written once).
    Backward's end: the rows' gradient scattered into a zeroed dx."""
    x, weight = call.arg("x"), call.arg("weight")
    dtype, block = call.arg("dtype"), call.arg("block")
    rows, hidden = x.shape
    vocab = weight.shape[0]
    ds, acc = _size(dtype), 4
    kernels = [Kernel("x.index_select(kept rows).to(dtype)", ELEMENTWISE, rows * hidden * x.itemsize,
                      rows * hidden * ds)]
    for v0 in range(0, vocab, block):
        cols = min(block, vocab - v0)
        logits = rows * cols
        if weight.dtype != dtype:
            kernels.append(Kernel("weight[block].to(dtype)", ELEMENTWISE, cols * hidden * weight.itemsize,
                                  cols * hidden * ds))
        kernels.append(Kernel("linear(x, weight[block])", CONTRACTION, (rows + cols) * hidden * ds, logits * ds,
                              2 * logits * hidden, dtype))
        kernels.append(Kernel("the target's column in the block", ELEMENTWISE, 8 * rows, 4 * rows))
        if not backward:
            kernels.append(Kernel("_lce_block_fwd_kernel", ELEMENTWISE, logits * ds + 4 * rows, 3 * acc * rows,
                                  triton=True))
            continue
        kernels.append(Kernel("_lce_block_bwd_kernel", ELEMENTWISE, logits * ds + 4 * rows + 4 * acc * rows,
                              logits * ds, triton=True))
        kernels.append(Kernel("dz @ weight[block] (+= in fp32)", CONTRACTION, logits * ds + cols * hidden * ds,
                              rows * hidden * ds, 2 * logits * hidden, dtype))
        kernels.append(Kernel("dx_sum += (fp32)", ELEMENTWISE, rows * hidden * (ds + acc), rows * hidden * acc))
        kernels.append(Kernel("dzᵀ @ x (the block's weight gradient)", CONTRACTION, logits * ds + rows * hidden * ds,
                              cols * hidden * weight.itemsize, 2 * logits * hidden, dtype))
    if backward:
        kernels.append(Kernel("dx.index_copy_(kept rows)", ELEMENTWISE, rows * hidden * acc,
                              rows * hidden * x.itemsize * 2))
    return kernels


@declares("tempo.linear_cross_entropy_fwd")
def _linear_cross_entropy_forward(call: OpCall, target: Target) -> list[Kernel]:
    """See ``_linear_cross_entropy``."""
    return _linear_cross_entropy(call, backward=False)


@declares("tempo.linear_cross_entropy_bwd")
def _linear_cross_entropy_backward(call: OpCall, target: Target) -> list[Kernel]:
    """See ``_linear_cross_entropy``."""
    return _linear_cross_entropy(call, backward=True)


def _combined_row_kernel(n_cols: int, base: str) -> str:
    from tempo.ops.combined import SINGLE_PASS_MAX

    return f"{base}_long_kernel" if n_cols > SINGLE_PASS_MAX else f"{base}_kernel"


@declares("tempo.combined_softmax_dropout_matmul")
def _combined_forward(call: OpCall, target: Target) -> list[Kernel]:
    """x.movedim(dim, -1).contiguous() (a copy only when x is not laid out so), the softmax-dropout
    kernel (reads x and the seed, writes s and, with dropout or a dtype change, the dropout output
    d), then torch.matmul(d, v) (a copy of v first when its batch dims do not flatten)."""
    x, v, s_dtype = call.arg("x"), call.arg("v"), call.arg("s_dtype")
    dim = call.arg("dim") % len(x.shape)
    dropout = call.arg("training") and call.arg("p") > 0
    out = call.tensor_outputs()[0]
    kernels = []
    if dim != len(x.shape) - 1 or not x.is_contiguous:
        kernels.append(_copy("x.movedim(dim, -1).contiguous()", x))
    n_cols = x.shape[dim]
    numel = x.numel
    write_d = dropout or v.dtype != s_dtype
    kernels.append(Kernel(_combined_row_kernel(n_cols, "_softmax_dropout_fwd"), NORMALIZATION,
                          numel * x.itemsize + (SEED_BYTES if dropout else 0),
                          numel * _size(s_dtype) + (numel * v.itemsize if write_d else 0), triton=True))
    if dim != len(x.shape) - 1:
        raise NotImplementedError("tempo.movement: Combined with a softmax dim other than the last has no "
                                  "declaration of its matmul's operand layout")
    if not _batch_flattenable(v):
        kernels.append(_copy("torch.matmul: v reshaped to [batch, k, n]", v))
    batch = numel // (x.shape[-2] * x.shape[-1])
    flops = 2 * batch * x.shape[-2] * x.shape[-1] * v.shape[-1]
    d_bytes = numel * (v.itemsize if write_d else _size(s_dtype))
    kernels.append(Kernel("bmm(d, v)", CONTRACTION, d_bytes + v.numel * v.itemsize, out.nbytes, flops, v.dtype))
    return kernels


@declares("tempo.combined_softmax_dropout_matmul_backward")
def _combined_backward(call: OpCall, target: Target) -> list[Kernel]:
    """The batch-chunked backward (softmax dim last, v not broadcast: attention), walking the
    flattened batch in ceil(b / ceil(b / BACKWARD_CHUNKS)) chunks, each: the dropout output D_c
    regenerated from the seed (_dropout_from_seed_kernel; without dropout s_c cast when dtypes
    differ), dv_c = D_cᵀ g_c, dD_c = g_c v_cᵀ, then the softmax-dropout backward kernel (reads dD_c,
    s_c, the seed; writes dx_c). Before the loop: grad_out cast to v's dtype, and g and v copied
    when reshaping them to [batch, rows, cols] cannot be a view."""
    from tempo.ops.combined import BACKWARD_CHUNKS

    g, s, v = call.arg("grad_out"), call.arg("s"), call.arg("v")
    dim = call.arg("dim") % len(s.shape)
    if dim != len(s.shape) - 1 or len(s.shape) < 3 or tuple(v.shape[:-2]) != tuple(s.shape[:-2]):
        raise NotImplementedError("tempo.movement: only Combined's batch-chunked backward (softmax over the last "
                                  "dim, v not broadcast) is declared")
    dropout = call.arg("training") and call.arg("p") > 0
    x_size = _size(call.arg("x_dtype"))
    *batch_dims, sq, sk = s.shape
    dv_cols = v.shape[-1]
    batch = math.prod(batch_dims)
    kernels = []
    if g.dtype != v.dtype:  # .to() keeps g's strides, so the reshape below may still copy
        kernels.append(_copy("grad_out.to(v.dtype)", g, v.dtype))
    if not _batch_flattenable(g):
        kernels.append(_copy("grad_out.reshape(b, s_q, d_v)", g, v.dtype))
    if not _batch_flattenable(v):
        kernels.append(_copy("v.reshape(b, s_k, d_v)", v))
    step = max(1, _cdiv(batch, BACKWARD_CHUNKS))
    for b0 in range(0, batch, step):
        nb = min(batch, b0 + step) - b0
        scores = nb * sq * sk
        if dropout:
            kernels.append(Kernel("_dropout_from_seed_kernel", ELEMENTWISE, scores * s.itemsize + SEED_BYTES,
                                  scores * v.itemsize, triton=True))
        elif s.dtype != v.dtype:
            kernels.append(Kernel("s_c.to(v.dtype)", ELEMENTWISE, scores * s.itemsize, scores * v.itemsize))
        d_size = v.itemsize if (dropout or s.dtype != v.dtype) else s.itemsize
        g_c = nb * sq * dv_cols * v.itemsize
        v_c = nb * sk * dv_cols * v.itemsize
        kernels.append(Kernel("bmm(D_cᵀ, g_c)", CONTRACTION, scores * d_size + g_c, v_c, 2 * nb * sk * sq * dv_cols,
                              v.dtype))
        kernels.append(Kernel("bmm(g_c, v_cᵀ)", CONTRACTION, g_c + v_c, scores * v.itemsize, 2 * nb * sq * dv_cols * sk,
                              v.dtype))
        kernels.append(Kernel(_combined_row_kernel(sk, "_softmax_dropout_bwd"), NORMALIZATION,
                              scores * v.itemsize + scores * s.itemsize + (SEED_BYTES if dropout else 0),
                              scores * x_size, triton=True))
    return kernels


# ---------------------------------------------------------------------------------------------
# The gated MLP (tempo/ops/gated_mlp.py): one element-wise kernel each way around torch's GEMMs
# ---------------------------------------------------------------------------------------------
def _gated_rows(call: OpCall) -> tuple[int, int]:
    """(rows, I) of the [rows, I] product: h is the gate, or [.., 2·I] holding gate and up."""
    h = call.arg("h")
    width = h.shape[-1] if call.arg("gate_half") < 0 else h.shape[-1] // 2
    return (h.numel // h.shape[-1] if h.shape[-1] else 0), width


def _gated_input_copies(call: OpCall) -> list[Kernel]:
    """A gate or up that is not laid out as [rows, I] rows is copied first (reshape)."""
    return [_copy(f"{name}.reshape(rows, -1)", t) for name, t in (("h", call.arg("h")), ("up", call.arg("up")))
            if t is not None and not t.is_contiguous]


@declares("tempo.gated_linear_fwd")
def _gated_forward(call: OpCall, target: Target) -> list[Kernel]:
    """_gated_fwd_kernel (reads gate and up, a fused projection's halves in place, and the seed with
    dropout; writes the dropped product in the down projection's dtype), then F.linear(q, W, b)."""
    h, weight, bias = call.arg("h"), call.arg("weight"), call.arg("bias")
    rows, width = _gated_rows(call)
    dropout = call.arg("training") and call.arg("p") > 0
    q_size = weight.itemsize if weight is not None else h.itemsize
    kernels = _gated_input_copies(call) + [Kernel("_gated_fwd_kernel", ELEMENTWISE,
                                                  2 * rows * width * h.itemsize + (SEED_BYTES if dropout else 0),
                                                  rows * width * q_size, triton=True)]
    if weight is not None:
        out = weight.shape[0]
        kernels.append(Kernel("linear(q, W, b)", CONTRACTION, rows * width * q_size + weight.nbytes + _opt_bytes(bias),
                              rows * out * weight.itemsize, 2 * rows * width * out, weight.dtype))
    return kernels


@declares("tempo.gated_linear_bwd")
def _gated_backward(call: OpCall, target: Target) -> list[Kernel]:
    """dq = dO·W (no GEMM without a weight), _gated_bwd_kernel (reads dq, gate, up and the seed with
    dropout; writes d_gate, d_up and, for the weight's gradient, the recomputed product q), then
    dW = dOᵀ·q and db = dO.sum(0)."""
    grad, h, weight = call.arg("grad_out"), call.arg("h"), call.arg("weight")
    rows, width = _gated_rows(call)
    dropout = call.arg("training") and call.arg("p") > 0
    want_q = weight is not None and call.arg("weight_grad")
    kernels = _gated_input_copies(call)
    if not grad.is_contiguous:
        kernels.append(_copy("grad_out.reshape(rows, -1)", grad))
    dq_size = grad.itemsize
    if weight is not None:
        out = weight.shape[0]
        dq_size = weight.itemsize
        kernels.append(Kernel("mm(dO, W)", CONTRACTION, grad.nbytes + weight.nbytes, rows * width * dq_size,
                              2 * rows * out * width, weight.dtype))
    elements = rows * width
    kernels.append(Kernel("_gated_bwd_kernel", ELEMENTWISE,
                          elements * dq_size + 2 * elements * h.itemsize + (SEED_BYTES if dropout else 0),
                          2 * elements * h.itemsize + (elements * weight.itemsize if want_q else 0), triton=True))
    if want_q:
        kernels.append(Kernel("mm(dOᵀ, q)", CONTRACTION, grad.nbytes + elements * weight.itemsize, weight.nbytes,
                              2 * rows * out * width, weight.dtype))
    if weight is not None and call.arg("bias_grad"):
        kernels.append(Kernel("dO.sum(0)", ELEMENTWISE, grad.nbytes, out * weight.itemsize))
    return kernels


# ---------------------------------------------------------------------------------------------
# DeBERTa's disentangled attention (tempo/ops/disentangled_attention.py): its Triton kernels
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _DisentangledGeometry:
    """What the disentangled-attention kernels' footprints depend on. ``lengths``: the sequence
    lengths (padded: B × S; varlen: the trace holds no offsets, so every sequence is taken as
    max_seqlen long, an upper bound that is exact when they all are)."""

    tokens: int
    heads: int
    d: int
    d_v: int
    max_len: int
    lengths: tuple[int, ...]
    table: tuple[int, ...]  # idx(t) at t + max_len - 1
    span: int
    c2p: bool
    p2c: bool
    dropout: bool
    mask_bytes: int
    cu_bytes: int

    def rows(self, t_lo: int, t_hi: int) -> tuple[int, int]:
        """(first, last) table row of t in [t_lo, t_hi], clamped into the table as the kernels clamp."""
        lo = min(max(t_lo + self.max_len - 1, 0), 2 * self.max_len - 2)
        hi = min(max(t_hi + self.max_len - 1, 0), 2 * self.max_len - 2)
        return self.table[lo], self.table[hi]

    def launch_t_range(self, m: int, n: int) -> tuple[int, int]:
        """Clamped range of t = i0 − j0 + u − (N − 1) over every tile pair of the launch."""
        longest = max(self.lengths)
        lo = -((longest - 1) // n * n) - (n - 1)
        hi = (longest - 1) // m * m + m - 1
        return max(lo, -(self.max_len - 1)), min(hi, self.max_len - 1)

    def table_reads(self, m: int, n: int) -> tuple[int, int]:
        """(table bytes, distinct position rows per head) the tile pairs of one launch load."""
        lo, hi = self.launch_t_range(m, n)
        entries = self.table[lo + self.max_len - 1: hi + self.max_len]
        return 4 * len(entries), len(set(entries))


def _disentangled_geometry(call: OpCall) -> _DisentangledGeometry:
    from tempo.ops.disentangled_attention import relative_position_index

    q, v = call.arg("q"), call.arg("v")
    span, buckets, max_rel = call.arg("span"), call.arg("position_buckets"), call.arg("max_relative_positions")
    if "cu_seqlens" in call.args:
        tokens, heads, d = q.shape
        cu = call.arg("cu_seqlens")
        max_len = call.arg("max_seqlen")
        lengths = (max_len,) * (cu.shape[0] - 1)
        mask_bytes, cu_bytes = 0, cu.nbytes
    else:
        batch, max_len, heads, d = q.shape
        tokens, lengths = batch * max_len, (max_len,) * batch
        mask = call.arg("padding_mask")
        mask_bytes, cu_bytes = _opt_bytes(mask), 0
    table = tuple(int(x) for x in relative_position_index(max(max_len, 1), span, buckets, max_rel, "cpu").tolist())
    return _DisentangledGeometry(tokens, heads, d, v.shape[-1], max(max_len, 1), lengths, table, span,
                                 call.arg("pos_key") is not None, call.arg("pos_query") is not None,
                                 call.arg("dropout_p") > 0, mask_bytes, cu_bytes)


def _disentangled_common_reads(geo: _DisentangledGeometry, es: int, m: int, n: int) -> int:
    """Bytes every kernel of the op loads besides the row tensors: the position rows its tile pairs
    touch (per head), the index table entries, the mask or the offsets, the seed."""
    table_bytes, rows = geo.table_reads(m, n)
    positions = (geo.c2p + geo.p2c) * rows * geo.heads * geo.d * es
    return (positions + (table_bytes if geo.c2p or geo.p2c else 0) + geo.mask_bytes + geo.cu_bytes
            + (SEED_BYTES if geo.dropout else 0))


def _disentangled_pairs(geo: _DisentangledGeometry, m: int, n: int) -> int:
    """Tile pairs (query tile, key tile) the kernels run, over sequences and heads."""
    return geo.heads * sum(_cdiv(length, m) * _cdiv(length, n) for length in geo.lengths)


def _disentangled_partial_rows(geo: _DisentangledGeometry, groups: int, programs: int, tpp: int, size: int,
                               other: int, query_tiles: bool) -> int:
    """Table rows of the partial buffer all programs of one backward kernel read-modify-write, per
    head: program (p, group g) walks the sequences g, g + groups, ... and in each its tiles
    p·tpp .. p·tpp + tpp − 1 below the length; each tile pair adds a band of rows
    idx(t_lo)..idx(t_hi), and the bands of one program overlap (consecutive tiles)."""
    total = 0
    for g in range(groups):
        for prog in range(programs):
            ranges = []
            for length in geo.lengths[g::groups]:
                last_other = (length - 1) // other * other  # the last tile start the inner loop reaches
                for start in range(prog * tpp * size, (prog + 1) * tpp * size, size):
                    if start >= length:
                        break
                    if query_tiles:  # t = i0 − j0 + u − (N − 1), j0 over the key tiles
                        ranges.append((start - last_other - (other - 1), start + size - 1))
                    else:  # i0 over the query tiles, j0 = start
                        ranges.append((-start - (size - 1), last_other + other - 1 - start))
            if ranges:
                first, last = geo.rows(min(r[0] for r in ranges), max(r[1] for r in ranges))
                total += last - first + 1
    return total


@declares("tempo.disentangled_attention_fwd", "tempo.disentangled_attention_varlen_fwd")
def _disentangled_forward(call: OpCall, target: Target) -> list[Kernel]:
    """_fwd_kernel: reads q, k, v of every real token, the position rows its tile pairs touch, the
    index table, the mask (padded) or the offsets (varlen), the seed (dropout); writes out and the
    fp32 (m, log l) per row and head."""
    from tempo.ops.disentangled_attention import triton_tiles

    q = call.arg("q")
    geo = _disentangled_geometry(call)
    m, n, w, _, _ = triton_tiles("fwd", q.dtype)
    es, out = q.itemsize, call.tensor_outputs()[0]
    rows_in = geo.tokens * geo.heads * (2 * geo.d + geo.d_v) * es
    read = rows_in + _disentangled_common_reads(geo, es, m, n)
    written = out.numel * out.itemsize + 8 * geo.tokens * geo.heads
    flops = 2 * _disentangled_pairs(geo, m, n) * (m * n * (geo.d + geo.d_v) + (geo.c2p * m + geo.p2c * n) * w * geo.d)
    return [Kernel("_fwd_kernel", CONTRACTION, read, written, flops, q.dtype, triton=True)]


@declares("tempo.disentangled_attention_bwd", "tempo.disentangled_attention_varlen_bwd")
def _disentangled_backward(call: OpCall, target: Target) -> list[Kernel]:
    """grad_out.contiguous() (a copy only when it is not), zeroed fp32 partial buffers of the
    position gradients, _bwd_dq_kernel (reads q, k, v, dO, O, the row stats, the position rows, the
    table, the mask or offsets, the seed; writes D = rowsum(dO·O), dq and read-modify-writes its own
    bands of the c2p partial), _bwd_dkdv_kernel (reads q, k, v, dO, the stats, D, the same position
    data; writes dk, dv and its bands of the p2c partial), then per position table the partials
    summed over (groups, tiles), scaled, and cast to the table's dtype. Grids from
    tempo.ops.disentangled_attention.backward_plan for ``target`` (its CPU sizing on the interpreter)."""
    from tempo.ops.disentangled_attention import backward_plan, triton_tiles

    q, grad = call.arg("q"), call.arg("grad_out")
    geo = _disentangled_geometry(call)
    m, n, w, _, _ = triton_tiles("bwd", q.dtype, geo.c2p or geo.p2c)
    es = q.itemsize
    groups, tpp, progs_q, progs_k = backward_plan(len(geo.lengths), geo.max_len, geo.heads, geo.d, geo.span,
                                                  geo.c2p, geo.p2c, target.sms is not None, q.dtype)
    kernels = [] if grad.is_contiguous else [_copy("grad_out.contiguous()", grad)]
    table_rows = 2 * geo.span * geo.heads * geo.d
    for present, progs in ((geo.c2p, progs_q), (geo.p2c, progs_k)):
        if present:
            kernels.append(Kernel("torch.zeros (position-gradient partials)", ELEMENTWISE, 0,
                                  4 * groups * progs * table_rows))
    th = geo.tokens * geo.heads
    qk_bytes, v_bytes = th * geo.d * es, th * geo.d_v * es
    common = _disentangled_common_reads(geo, es, m, n)
    pairs = _disentangled_pairs(geo, m, n)
    scores = m * n * (geo.d + geo.d_v) + (geo.c2p * m + geo.p2c * n) * w * geo.d  # S and dP of one tile pair
    part_kp = (4 * geo.heads * geo.d * _disentangled_partial_rows(geo, groups, progs_q, tpp, m, n, True)
               if geo.c2p else 0)
    part_qp = (4 * geo.heads * geo.d * _disentangled_partial_rows(geo, groups, progs_k, tpp, n, m, False)
               if geo.p2c else 0)
    kernels.append(Kernel(
        "_bwd_dq_kernel", CONTRACTION,
        2 * qk_bytes + 3 * v_bytes + 8 * th + common + part_kp, 4 * th + qk_bytes + part_kp,
        2 * pairs * (scores + m * n * geo.d + geo.c2p * (2 * m * w * geo.d + m * w * w)), q.dtype, triton=True))
    kernels.append(Kernel(
        "_bwd_dkdv_kernel", CONTRACTION,
        2 * qk_bytes + 2 * v_bytes + 12 * th + common + part_qp, qk_bytes + v_bytes + part_qp,
        2 * pairs * (scores + m * n * (geo.d + geo.d_v) + geo.p2c * (2 * n * w * geo.d + n * w * w)), q.dtype,
        triton=True))
    for present, progs, pos in ((geo.c2p, progs_q, call.arg("pos_key")), (geo.p2c, progs_k, call.arg("pos_query"))):
        if present:
            kernels.append(Kernel("partials.sum((0, 1))", ELEMENTWISE, 4 * groups * progs * table_rows, 4 * table_rows))
            kernels.append(Kernel("mul_(scale)", ELEMENTWISE, 4 * table_rows, 4 * table_rows))
            if pos.dtype != torch.float32:
                kernels.append(Kernel("to(position table dtype)", ELEMENTWISE, 4 * table_rows,
                                      table_rows * pos.itemsize))
    return kernels


__all__ = ["CLASSES", "CONTRACTION", "DECLARATIONS", "ELEMENTWISE", "INTERPRETER", "Kernel", "NORMALIZATION",
           "Target", "UndeclaredOp", "classify", "dal_backward_programs", "declares", "gelu_table_bytes",
           "io_kernel", "kernels_of"]

_register_varlen_flop_formulas()
