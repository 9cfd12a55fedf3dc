"""Gated MLP fused with its down projection: ``down(dropout(act(gate) * up))``, keeping only the gate
and up pre-activations for backward (issue 33; ModernBERT's GeGLU of issue 21 is one case).

The MLP of Llama, Qwen3, EuroBERT, Gemma3, NomicBERT, GTE, ModernBERT and their kin:

    gate, up = gate_proj(x), up_proj(x)          separate projections, or
    gate, up = fused_proj(x).chunk(2, -1)        one projection [.., 2·I] (either half the gate)
    out = down_proj(dropout(act(gate) * up))     act: SiLU (SwiGLU), exact or tanh GELU (GeGLU)

Stock autograd keeps, per token, gate and up (2·I: the activation's and the product's inputs; the
two halves of one fused output are one storage), the activation's output (I, the product's other
input), the product (I, kept by the down projection), and with dropout its mask (a bool per element on
CUDA, a scaled float on the CPU) and output in place of the product: 4·I elements, plus the mask with
dropout. Liger-Kernel's SwiGLU/GeGLU keep gate and up while the down projection keeps the product:
3·I. This op keeps gate and up alone, 2·I (plus an 8-byte seed with dropout), and recomputes the
activation, the product and the dropout in backward: element-wise work, no GEMM is recomputed. 2·I
is the floor without recomputing a GEMM: both pre-activations are needed for the activation's and
the product's gradients, and neither can be recovered from the other or from the output.

Semantics
  * ``activation``: "silu" (x·σ(x)), "gelu" (exact, erf) or "gelu_tanh" (GPT-2's tanh form).
  * Dropout drops each element of the product with probability ``p`` and scales the kept ones by
    1 / (1 − p), as ``nn.Dropout``; not training, or ``p == 0``: none. The mask is a pure function
    of (seed, element index, p, backend): element (row, col) of the [rows, I] product is kept iff
    u >= p, u = ``tl.rand(seed, row·I + col)`` on the Triton path; on the reference path the
    words ``tempo.ops.dropout_add_layernorm``'s reference path draws for the same seed. The two
    paths draw different masks for one seed; ``gated_mlp_keep_mask`` regenerates the one a path
    used. The seed is drawn from torch's RNG, so ``torch.manual_seed`` and checkpointing's RNG
    restore reproduce the mask; backward uses the path its forward ran on.
  * Dtypes, as the stock module computes them: the activation and the product in the dtype of
    gate and up (which must agree), the down projection in the weight's dtype (the product is cast
    to it). Under autocast (custom ops are not on autocast's lists, so the wrapper decides) the
    weight and bias are cast to the autocast dtype outside the op, as ``F.linear`` under autocast
    casts them, and their gradients come back through that cast in the parameters' own dtype.
    Without autocast a weight of another dtype than gate and up raises, as ``F.linear`` does.
  * Without a weight (``weight=None``) the op returns the dropped product itself (for a down
    projection that is not a plain ``nn.Linear``: a LoRA adapter, a quantized layer); that
    module then keeps the product, I more per token (Liger's 3·I).
  * No backward (grad mode off, or nothing requiring grad) and no dropout: the stock ops, keeping
    nothing. With dropout the op runs with or without a backward, so a no-grad forward replayed
    with grad from the same RNG state (GradCache) draws the same mask both times. In training mode
    (``training``; ``GatedMLP``: the module's mode) it runs on the Triton path without dropout too
    (``runs_own_forward``): the kernels round otherwise than the stock ops (below; 3e-5 measured
    on a bf16 Llama block), and a no-grad pass (reentrant checkpointing's first) must give the
    bits its recompute with grad gives. The reference forward is the stock ops, bit for bit.

Exactness. What backward recomputes is recomputed exactly: the same function on the same kept
inputs with the same rounding, so the activation, the product and the dropout mask in backward are
bitwise the forward's, on both paths. Against the stock module:
  * reference path (CPU, fp64, any device): the forward runs the stock ops in the stock order
    (``F.silu`` / ``F.gelu``, ``*``, the dropout multiply, ``F.linear``), so with dropout off its
    output is bitwise the stock one in every dtype; backward applies the stock backward formulas
    (aten's ``silu_backward`` / ``gelu_backward``, the product rule, the linear layer's three
    GEMMs as aten's linear backward runs them), so gradients equal the stock ones up to the GEMMs'
    summation order. Nothing is recovered from an output, so there is no condition on the values.
  * Triton path (CUDA; CPU under the interpreter): the kernels compute the activation in fp32 with
    their own formulas (x / (1 + e^−x); 0.5·x·(1 + erf(x/√2)); x·σ(2·√(2/π)·(x + 0.044715·x³)))
    and round it, the product and the dropout's output to the dtypes the stock ops round them to;
    the activation differs from torch's fp32 one by a few fp32 ULP (exp/erf implementations), so
    fp32 outputs and gradients agree with the stock module's to ~1e-6 relative (the tests hold
    outputs to 1e-6, gradients to 1e-5) and 16-bit ones to one rounding of their dtype where such
    an ULP crosses a rounding boundary. The GEMMs are torch's (cuBLAS).

Contents, in order: activations and Triton kernels, host launchers, the reference path, the
``tempo::gated_linear_fwd`` / ``_bwd`` custom ops, the functional ``gated_linear`` /
``gated_linear_fused``, and ``GatedMLP``, the module apply_tempo swaps in (it holds the original's
projections, activation and dropout modules: tempo.integrations.gated_mlp).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tempo.ops._backend import (
    TRITON_DTYPES,
    autocast_dtype_for,
    check_float_tensor,
    check_probability,
    launch_on,
    log_fallback_once,
    resolve_backend,
    runs_own_forward,
)
from tempo.ops._backend import tl, triton  # None without triton (reference path only)
from tempo.ops.dropout_add_layernorm import _reference_keep_mask, draw_seed


OP = "gated_linear"
ACTIVATIONS = ("silu", "gelu", "gelu_tanh")
_ACT_CODE = {name: i for i, name in enumerate(ACTIVATIONS)}  # the kernels' ACT constexpr
SEPARATE = -1  # gate_half of separate gate and up tensors; 0 / 1: the gate is that half of one tensor
_BLOCK = 1024


# ----------------------------------------------------------------------------------------------
# Triton kernels: one program per (row, block of BLOCK columns) of the [rows, I] product. Gate
# and up are read through row strides (the two halves of a fused projection's [rows, 2·I] output
# are read in place); the product and the gradients of the separate layout are contiguous.
# ----------------------------------------------------------------------------------------------
if triton is not None:

    @triton.jit
    def _activation(x, ACT: tl.constexpr):
        """act(x) in fp32: 0 SiLU, 1 exact GELU, 2 tanh GELU (as x·σ(2z): no tanh in the interpreter)."""
        if ACT == 0:
            y = x / (1.0 + tl.exp(-x))
        elif ACT == 1:
            y = 0.5 * x * (1.0 + tl.erf(x * 0.7071067811865476))
        else:
            # 2z = 2·√(2/π)·(x + 0.044715·x³)
            y = x / (1.0 + tl.exp(-(x * (1.5957691216057308 + 0.0713548162726002 * (x * x)))))
        return y

    @triton.jit
    def _activation_slope(x, ACT: tl.constexpr):
        """act'(x) in fp32."""
        if ACT == 0:
            s = 1.0 / (1.0 + tl.exp(-x))
            d = s * (1.0 + x * (1.0 - s))
        elif ACT == 1:
            d = 0.5 * (1.0 + tl.erf(x * 0.7071067811865476)) + x * tl.exp(-0.5 * x * x) * 0.3989422804014327
        else:
            s = 1.0 / (1.0 + tl.exp(-(x * (1.5957691216057308 + 0.0713548162726002 * (x * x)))))
            d = s + x * s * (1.0 - s) * (1.5957691216057308 + 0.2140644488178006 * (x * x))
        return d

    @triton.jit
    def _gated_fwd_kernel(G, U, P, SEED, I, stride_g, stride_u, p, scale,
                          ACT: tl.constexpr, DROPOUT: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        inside = cols < I
        g = tl.load(G + row * stride_g + cols, mask=inside, other=0.0).to(tl.float32)
        u = tl.load(U + row * stride_u + cols, mask=inside, other=0.0).to(tl.float32)
        # Rounded where the stock ops round: act(gate) and the product in gate's dtype.
        a = _activation(g, ACT).to(G.dtype.element_ty).to(tl.float32)
        q = (a * u).to(G.dtype.element_ty).to(tl.float32)
        if DROPOUT:
            keep = tl.rand(tl.load(SEED), row * I + cols) >= p
            q = tl.where(keep, q * scale, 0.0).to(G.dtype.element_ty).to(tl.float32)
        tl.store(P + row * I + cols, q.to(P.dtype.element_ty), mask=inside)

    @triton.jit
    def _gated_bwd_kernel(DQ, G, U, SEED, DG, DU, P, I, stride_g, stride_u, stride_d, p, scale,
                          ACT: tl.constexpr, DROPOUT: tl.constexpr, WRITE_P: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        inside = cols < I
        # The gradient reaching the product, in gate's dtype (the stock cast's backward).
        dq = tl.load(DQ + row * I + cols, mask=inside, other=0.0).to(G.dtype.element_ty).to(tl.float32)
        g = tl.load(G + row * stride_g + cols, mask=inside, other=0.0).to(tl.float32)
        u = tl.load(U + row * stride_u + cols, mask=inside, other=0.0).to(tl.float32)
        a = _activation(g, ACT).to(G.dtype.element_ty).to(tl.float32)  # bitwise the forward's
        if DROPOUT:
            keep = tl.rand(tl.load(SEED), row * I + cols) >= p  # the forward's mask, regenerated
            dq = tl.where(keep, dq * scale, 0.0).to(G.dtype.element_ty).to(tl.float32)
        du = dq * a
        da = (dq * u).to(G.dtype.element_ty).to(tl.float32)
        dg = da * _activation_slope(g, ACT)
        tl.store(DG + row * stride_d + cols, dg.to(DG.dtype.element_ty), mask=inside)
        tl.store(DU + row * stride_d + cols, du.to(DU.dtype.element_ty), mask=inside)
        if WRITE_P:  # the down projection's input, for its weight gradient: the forward's, bitwise
            q = (a * u).to(G.dtype.element_ty).to(tl.float32)
            if DROPOUT:
                q = tl.where(keep, q * scale, 0.0).to(G.dtype.element_ty).to(tl.float32)
            tl.store(P + row * I + cols, q.to(P.dtype.element_ty), mask=inside)

    @triton.jit
    def _keep_mask_kernel(OUT, SEED, I, p, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        inside = cols < I
        keep = tl.rand(tl.load(SEED), row * I + cols) >= p
        tl.store(OUT + row * I + cols, keep.to(tl.uint8), mask=inside)


def _dropout_scale(p: float) -> float:
    return 1.0 / (1.0 - p) if p < 1.0 else 0.0


def _grid(rows: int, width: int) -> tuple[int, int]:
    return rows, triton.cdiv(width, _block(width))


def _block(width: int) -> int:
    return min(_BLOCK, max(16, triton.next_power_of_2(width)))


# ----------------------------------------------------------------------------------------------
# Layout: [rows, I] views of gate and up (no copy for a fused projection's halves)
# ----------------------------------------------------------------------------------------------
def _width(h: Tensor, gate_half: int) -> int:
    return h.shape[-1] if gate_half == SEPARATE else h.shape[-1] // 2


def _rows2d(t: Tensor) -> Tensor:
    """``t`` as [rows, last dim] with unit column stride (a view when the layout allows one)."""
    t2 = t.reshape(-1, t.shape[-1]) if t.dim() != 2 else t
    return t2 if t2.stride(-1) == 1 or t2.shape[-1] <= 1 else t2.contiguous()


def _gate_and_up(h: Tensor, up: Optional[Tensor], gate_half: int) -> tuple[Tensor, Tensor]:
    """[rows, I] gate and up: the two tensors, or the two halves of ``h``."""
    if gate_half == SEPARATE:
        return _rows2d(h), _rows2d(up)
    h2 = _rows2d(h)
    width = h2.shape[1] // 2
    first, second = h2[:, :width], h2[:, width:]
    return (first, second) if gate_half == 0 else (second, first)


def _halves_of(dh: Tensor, gate_half: int) -> tuple[Tensor, Tensor]:
    width = dh.shape[1] // 2
    first, second = dh[:, :width], dh[:, width:]
    return (first, second) if gate_half == 0 else (second, first)


# ----------------------------------------------------------------------------------------------
# Host launchers
# ----------------------------------------------------------------------------------------------
def _fwd_triton(gate: Tensor, up: Tensor, seed: Optional[Tensor], activation: str, p: float, dropout: bool,
                out_dtype: torch.dtype) -> Tensor:
    rows, width = gate.shape
    q = torch.empty((rows, width), dtype=out_dtype, device=gate.device)
    if rows and width:
        with launch_on(gate):
            _gated_fwd_kernel[_grid(rows, width)](
                gate, up, q, seed if dropout else q, width, gate.stride(0), up.stride(0), p, _dropout_scale(p),
                ACT=_ACT_CODE[activation], DROPOUT=dropout, BLOCK=_block(width), num_warps=4)
    return q


def _bwd_triton(dq: Tensor, gate: Tensor, up: Tensor, d_gate: Tensor, d_up: Tensor, seed: Optional[Tensor],
                activation: str, p: float, dropout: bool, q_dtype: Optional[torch.dtype]) -> Optional[Tensor]:
    """Writes d_gate and d_up (same row stride); returns the recomputed dropped product in
    ``q_dtype`` (None: not asked for)."""
    rows, width = gate.shape
    q = torch.empty((rows, width), dtype=q_dtype, device=gate.device) if q_dtype is not None else None
    if rows and width:
        with launch_on(gate):
            _gated_bwd_kernel[_grid(rows, width)](
                dq, gate, up, seed if dropout else dq, d_gate, d_up, q if q is not None else dq, width,
                gate.stride(0), up.stride(0), d_gate.stride(0), p, _dropout_scale(p),
                ACT=_ACT_CODE[activation], DROPOUT=dropout, WRITE_P=q is not None, BLOCK=_block(width),
                num_warps=4)
    return q


def _triton_keep_mask(seed: Tensor, rows: int, width: int, p: float, device: torch.device) -> Tensor:
    out = torch.empty((rows, width), dtype=torch.uint8, device=device)
    if rows and width:
        with launch_on(out):
            _keep_mask_kernel[_grid(rows, width)](out, seed, width, p, BLOCK=_block(width))
    return out.view(torch.bool)


# ----------------------------------------------------------------------------------------------
# Reference path: the stock ops, in the stock order
# ----------------------------------------------------------------------------------------------
def _act_reference(x: Tensor, activation: str) -> Tensor:
    if activation == "silu":
        return F.silu(x)
    return F.gelu(x, approximate="tanh" if activation == "gelu_tanh" else "none")


def _act_backward_reference(grad: Tensor, x: Tensor, activation: str) -> Tensor:
    if activation == "silu":
        return torch.ops.aten.silu_backward(grad, x)
    return torch.ops.aten.gelu_backward(grad, x, approximate="tanh" if activation == "gelu_tanh" else "none")


def _reference_keep(seed: Tensor, shape: tuple[int, ...], p: float, like: Tensor) -> Tensor:
    """The reference keep mask as 1.0 / 0.0 in ``like``'s dtype (applied as one multiply)."""
    return _reference_keep_mask(seed, math.prod(shape), p, like.device).view(shape).to(like.dtype)


def _product_reference(gate: Tensor, up: Tensor, seed: Optional[Tensor], activation: str, p: float,
                       dropout: bool) -> Tensor:
    """``dropout(act(gate) * up)`` with the stock ops (F.dropout's multiply by the mask, then the scale)."""
    q = _act_reference(gate, activation) * up
    if dropout:
        q.mul_(_reference_keep(seed, tuple(q.shape), p, q)).mul_(_dropout_scale(p))
    return q


def _stock_forward(h: Tensor, up: Optional[Tensor], gate_half: int, weight: Optional[Tensor],
                   bias: Optional[Tensor], activation: str) -> Tensor:
    """No dropout, no backward: the stock computation on h's own shape (nothing is kept)."""
    if gate_half == SEPARATE:
        gate = h
    else:
        first, second = h.chunk(2, dim=-1)
        gate, up = (first, second) if gate_half == 0 else (second, first)
    q = _act_reference(gate, activation) * up
    return q if weight is None else F.linear(q.to(weight.dtype), weight, bias)


# ----------------------------------------------------------------------------------------------
# Custom ops (torch.compile traces them as single nodes; autograd keeps gate, up and the seed).
# ``backend`` is resolved by the caller: the backward op gets the very path the forward took.
# ----------------------------------------------------------------------------------------------
def _check_op_arguments(activation: str, gate_half: int, backend: str, where: str) -> None:
    if activation not in ACTIVATIONS:
        raise ValueError(f"{where}: argument 'activation' must be one of {ACTIVATIONS}, got {activation!r}")
    if gate_half not in (SEPARATE, 0, 1):
        raise ValueError(f"{where}: argument 'gate_half' must be -1 (separate), 0 or 1, got {gate_half!r}")
    if backend not in ("triton", "reference"):
        raise ValueError(f"{where}: argument 'backend' must be 'triton' or 'reference', got {backend!r}")


@torch.library.custom_op("tempo::gated_linear_fwd", mutates_args=())
def gated_linear_fwd(h: Tensor, up: Optional[Tensor], weight: Optional[Tensor], bias: Optional[Tensor],
                     seed: Optional[Tensor], activation: str, gate_half: int, p: float, training: bool,
                     backend: str) -> Tensor:
    """``F.linear(dropout(act(gate) * up), weight, bias)`` in the weight's dtype; without a weight
    the dropped product in h's dtype. ``gate_half``: -1 (h is the gate, ``up`` given) or which
    half of h (its last dim 2·I) is the gate. ``seed``: a 0-d int64 tensor when dropping out."""
    _check_op_arguments(activation, gate_half, backend, "tempo::gated_linear_fwd")
    dropout = training and p > 0.0
    q_dtype = weight.dtype if weight is not None else h.dtype
    with torch.autocast(h.device.type, enabled=False):
        gate, up2 = _gate_and_up(h, up, gate_half)
        if backend == "triton":
            q = _fwd_triton(gate, up2, seed, activation, p, dropout, q_dtype)
        else:
            q = _product_reference(gate, up2, seed, activation, p, dropout).to(q_dtype)
        out = q if weight is None else F.linear(q, weight, bias)
    return out.view(*h.shape[:-1], out.shape[-1])


@gated_linear_fwd.register_fake
def _(h, up, weight, bias, seed, activation, gate_half, p, training, backend):
    width = _width(h, gate_half)
    if weight is None:
        return h.new_empty((*h.shape[:-1], width))
    return h.new_empty((*h.shape[:-1], weight.shape[0]), dtype=weight.dtype)


@torch.library.custom_op("tempo::gated_linear_bwd", mutates_args=())
def gated_linear_bwd(grad_out: Tensor, h: Tensor, up: Optional[Tensor], weight: Optional[Tensor],
                     seed: Optional[Tensor], activation: str, gate_half: int, p: float, training: bool,
                     weight_grad: bool, bias_grad: bool, backend: str) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """-> (d_h, d_up, d_weight, d_bias): d_h and d_up in h's dtype, the weight's in its dtype; an
    absent ``up`` or a gradient not asked for (``weight_grad``, ``bias_grad``) is an empty tensor.
    ``backend`` must be the one the forward ran on."""
    _check_op_arguments(activation, gate_half, backend, "tempo::gated_linear_bwd")
    dropout = training and p > 0.0
    with torch.autocast(h.device.type, enabled=False):
        gate, up2 = _gate_and_up(h, up, gate_half)
        rows, width = gate.shape
        go2 = grad_out.reshape(rows, grad_out.shape[-1])
        # d(down's input) = dO·W: a GEMM the stock backward runs too (none without a weight).
        dq = go2.mm(weight) if weight is not None else go2
        want_q = weight is not None and weight_grad
        if backend == "triton":
            dq = dq.contiguous()
            if gate_half == SEPARATE:
                d_gate = torch.empty((rows, width), dtype=h.dtype, device=h.device)
                d_up = torch.empty((rows, width), dtype=h.dtype, device=h.device)
                d_h = d_gate
            else:
                d_h = torch.empty((rows, 2 * width), dtype=h.dtype, device=h.device)
                d_gate, d_up = _halves_of(d_h, gate_half)
            q = _bwd_triton(dq, gate, up2, d_gate, d_up, seed, activation, p, dropout,
                            weight.dtype if want_q else None)
        else:
            a = _act_reference(gate, activation)  # the forward's ops on the forward's inputs: bitwise
            dq = dq.to(h.dtype)
            q = None
            if dropout:
                keep = _reference_keep(seed, (rows, width), p, dq)
                dq = dq.mul(keep).mul_(_dropout_scale(p))
            if want_q:
                q = a * up2
                if dropout:
                    q.mul_(keep).mul_(_dropout_scale(p))
                q = q.to(weight.dtype)
            d_up = dq * a
            d_gate = _act_backward_reference(dq * up2, gate, activation)
            if gate_half == SEPARATE:
                d_h = d_gate
            else:
                d_h = torch.cat([d_gate, d_up] if gate_half == 0 else [d_up, d_gate], dim=1)
        d_w = go2.t().mm(q) if want_q else _nothing(h)
        d_b = go2.sum(0) if (weight is not None and bias_grad) else _nothing(h)
    d_up_out = d_up.view(up.shape) if up is not None else _nothing(h)
    return d_h.view(h.shape), d_up_out, d_w, d_b


def _nothing(like: Tensor) -> Tensor:
    # Custom ops cannot return None (nor one tensor twice): an absent gradient is a new empty tensor.
    return like.new_empty((0,))


@gated_linear_bwd.register_fake
def _(grad_out, h, up, weight, seed, activation, gate_half, p, training, weight_grad, bias_grad, backend):
    return (torch.empty_like(h), torch.empty_like(up) if up is not None else _nothing(h),
            torch.empty_like(weight) if (weight is not None and weight_grad) else _nothing(h),
            weight.new_empty((weight.shape[0],)) if (weight is not None and bias_grad) else _nothing(h))


def _setup_context(ctx, inputs, output) -> None:
    h, up, weight, bias, seed, activation, gate_half, p, training, backend = inputs
    # The pre-activations and the seed (None without dropout): nothing per token besides h and up.
    ctx.save_for_backward(h, up, weight, seed)
    ctx.activation, ctx.gate_half, ctx.p, ctx.training, ctx.backend = activation, gate_half, p, training, backend
    ctx.has_bias = bias is not None


def _backward(ctx, grad_out):
    h, up, weight, seed = ctx.saved_tensors
    weight_grad = weight is not None and ctx.needs_input_grad[2]
    bias_grad = ctx.has_bias and ctx.needs_input_grad[3]
    d_h, d_up, d_w, d_b = torch.ops.tempo.gated_linear_bwd(
        grad_out, h, up, weight, seed, ctx.activation, ctx.gate_half, ctx.p, ctx.training, weight_grad, bias_grad,
        ctx.backend)
    return (d_h, d_up if up is not None else None, d_w if weight_grad else None, d_b if bias_grad else None,
            None, None, None, None, None, None)


gated_linear_fwd.register_autograd(_backward, setup_context=_setup_context)


# ----------------------------------------------------------------------------------------------
# Functional API
# ----------------------------------------------------------------------------------------------
_AUTOCAST_ELIGIBLE = (torch.float32, torch.float16, torch.bfloat16)


def _check_seed(seed: object, op: str, device: torch.device) -> Tensor:
    if (not isinstance(seed, Tensor) or seed.is_floating_point() or seed.is_complex()
            or seed.dtype == torch.bool or seed.numel() != 1):
        raise TypeError(f"{op}: argument 'seed' must be a one-element integer tensor")
    return seed.to(device=device, dtype=torch.int64).reshape(())


def _gated(h: Tensor, up: Optional[Tensor], gate_half: int, weight: Optional[Tensor], bias: Optional[Tensor],
           activation: str, p: float, training: bool, seed: Optional[Tensor], op: str) -> Tensor:
    check_float_tensor(h, "h" if gate_half != SEPARATE else "gate", op)
    if activation not in ACTIVATIONS:
        raise ValueError(f"{op}: argument 'activation' must be one of {ACTIVATIONS}, got {activation!r}")
    if gate_half == SEPARATE:
        check_float_tensor(up, "up", op)
        if up.shape != h.shape or up.dtype != h.dtype or up.device != h.device:
            raise ValueError(f"{op}: argument 'up' must have the shape, dtype and device of 'gate', got "
                             f"{tuple(up.shape)} {up.dtype} on {up.device} against {tuple(h.shape)} {h.dtype} "
                             f"on {h.device}")
    elif h.dim() == 0 or h.shape[-1] % 2:
        raise ValueError(f"{op}: argument 'h' must have an even last dimension (the gate and up halves), "
                         f"got {tuple(h.shape)}")
    width = _width(h, gate_half)
    name = "h" if gate_half != SEPARATE else "gate"
    if weight is not None:
        check_float_tensor(weight, "weight", op)
        if weight.dim() != 2 or weight.shape[1] != width:
            raise ValueError(f"{op}: argument 'weight' must be [out, {width}], got {tuple(weight.shape)}")
        if bias is not None and tuple(bias.shape) != (weight.shape[0],):
            raise ValueError(f"{op}: argument 'bias' must be [{weight.shape[0]}], got {tuple(bias.shape)}")
    elif bias is not None:
        raise ValueError(f"{op}: argument 'bias' needs a 'weight'")
    for arg, param in (("weight", weight), ("bias", bias)):
        if param is not None and param.device != h.device:
            raise ValueError(f"{op}: argument '{arg}' (the output projection's) is on {param.device} but the "
                             f"input '{name}' is on {h.device}; move the layer to the input's device")
    p = check_probability(p, "p", op)
    if not isinstance(training, bool):
        raise TypeError(f"{op}: argument 'training' must be a bool, got {type(training).__name__}")
    if weight is not None:
        autocast = autocast_dtype_for(h)
        if autocast is not None and h.dtype in _AUTOCAST_ELIGIBLE and weight.dtype in _AUTOCAST_ELIGIBLE:
            # F.linear under autocast: weight and bias cast (differentiably) to the autocast dtype.
            weight = weight.to(autocast)
            bias = bias.to(autocast) if bias is not None else None
        elif weight.dtype != h.dtype:
            raise TypeError(f"{op}: argument 'weight' is {weight.dtype} but '{name}' is {h.dtype} (outside "
                            f"autocast F.linear needs one dtype)")
        elif bias is not None and bias.dtype != weight.dtype:
            raise TypeError(f"{op}: argument 'bias' is {bias.dtype} but 'weight' is {weight.dtype}")
    # Resolved whatever the grad mode: a refused request ('triton' on fp64) fails either way.
    backend = resolve_backend(h, op)
    dropout = training and p > 0.0
    # In training mode the Triton path runs without a backward too (runs_own_forward); the
    # reference forward gives the stock ops' bits, so those stand for it.
    if not dropout and not runs_own_forward(training and backend == "triton", h, up, weight, bias):
        return _stock_forward(h, up, gate_half, weight, bias, activation)
    if seed is None:
        seed = draw_seed(h.device) if dropout else None
    else:
        seed = _check_seed(seed, op, h.device)
    return gated_linear_fwd(h, up, weight, bias, seed, activation, gate_half, p, training, backend)


def gated_linear(gate: Tensor, up: Tensor, weight: Optional[Tensor], bias: Optional[Tensor] = None,
                 activation: str = "silu", p: float = 0.0, training: bool = True,
                 seed: Optional[Tensor] = None) -> Tensor:
    """``F.linear(dropout(act(gate) * up, p, training), weight, bias)`` from separate gate and up
    pre-activations (Llama's ``gate_proj(x)``, ``up_proj(x)``), keeping only gate and up (and a
    seed with dropout) for backward. ``weight=None``: the dropped product itself. ``seed`` (a
    one-element integer tensor) fixes the mask; by default one is drawn from torch's RNG. See the
    module docstring for dtypes and exactness."""
    return _gated(gate, up, SEPARATE, weight, bias, activation, p, training, seed, OP)


def gated_linear_fused(h: Tensor, weight: Optional[Tensor], bias: Optional[Tensor] = None,
                       activation: str = "gelu", gate_first: bool = True, p: float = 0.0, training: bool = True,
                       seed: Optional[Tensor] = None) -> Tensor:
    """``gated_linear`` from one projection's output ``h`` = [.., 2·I]: the gate is its first half
    (``gate_first``, ModernBERT's ``input, gate = Wi(x).chunk(2)`` activates the first) or its
    second; kept for backward: h (its halves are not copied)."""
    if not isinstance(gate_first, bool):
        raise TypeError(f"{OP}: argument 'gate_first' must be a bool, got {type(gate_first).__name__}")
    return _gated(h, None, 0 if gate_first else 1, weight, bias, activation, p, training, seed, OP)


def gated_mlp_keep_mask(seed: Tensor, rows: int, width: int, p: float, device, backend: str) -> Tensor:
    """The bool keep mask [rows, width] (True = kept) ``backend`` ("triton" or "reference") draws
    for a product of that shape with ``seed``."""
    p = check_probability(p, "p", "gated_mlp_keep_mask")
    device = torch.device(device)
    seed = _check_seed(seed, "gated_mlp_keep_mask", device)
    if backend == "reference":
        return _reference_keep_mask(seed, rows * width, p, device).view(rows, width)
    if backend == "triton":
        return _triton_keep_mask(seed, rows, width, p, device)
    raise ValueError(f"gated_mlp_keep_mask: argument 'backend' must be 'triton' or 'reference', got {backend!r}")


# ----------------------------------------------------------------------------------------------
# The module apply_tempo swaps in
# ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class GatedLayout:
    """Which child of a gated MLP plays which part (names of its own submodules).

    Separate projections: ``gate`` and ``up``; one fused projection: ``fused`` with ``gate_half``
    (0: its first half is the gate). ``act``: the activation module, held (its form is
    ``activation``, measured when the layout was made); ``dropout``: the nn.Dropout between the
    product and ``down``, or None."""

    activation: str
    down: str
    gate: Optional[str] = None
    up: Optional[str] = None
    fused: Optional[str] = None
    gate_half: int = SEPARATE
    act: Optional[str] = None
    dropout: Optional[str] = None

    def describe(self) -> str:
        inputs = (f"{self.gate}, {self.up}" if self.fused is None
                  else f"{self.fused} ({'first' if self.gate_half == 0 else 'second'} half gated)")
        drop = f", dropout {self.dropout}" if self.dropout else ""
        return f"{self.activation}: {inputs} -> {self.down}{drop}"


def _plain_linear(module: nn.Module) -> bool:
    """An nn.Linear whose forward is nn.Linear's: its weight and bias say all it computes."""
    return isinstance(module, nn.Linear) and type(module).forward is nn.Linear.forward


class GatedMLP(nn.Module):
    """A gated MLP (``down(dropout(act(gate(x)) * up(x)))``, or one fused projection chunked in two)
    whose activation, product, dropout and down projection run as one ``gated_linear`` op that
    keeps only the gate and up pre-activations for backward (2·I per token instead of 4·I).

    Built from the original module and its ``GatedLayout``: it holds the original's submodules
    (the same objects, in the original's order, under their names), so Parameters, state_dict keys
    and adapters are unchanged, and its plain attributes (``config``, sizes). The projections are
    called as modules at every forward (a LoRA adapter PEFT puts on ``gate_proj`` runs); the down
    projection is fused by reading its weight and bias when it is a plain ``nn.Linear``, and
    called as a module on the product otherwise (a LoRA adapter or a quantized layer there: it then
    keeps the product, 3·I, logged once); forward hooks on a fused down projection do not run. The
    held nn.Dropout's rate and train flag are read at every forward (TRL's ``m.p = 0`` switches it
    off). The held activation module is not called: its form was measured when the layout was made,
    and the op computes that form (``F.silu`` / ``F.gelu`` on the reference path), so a module that
    writes the same form another way (transformers' ``NewGELUActivation``) agrees to fp32 rounding,
    not bit for bit. Mixed dtypes outside autocast (a bf16 down projection under fp32 activations):
    the stock computation, logged once.
    """

    def __init__(self, original: nn.Module, layout: GatedLayout):
        super().__init__()
        for name, child in original._modules.items():  # the same objects, in the original's order
            self._modules[name] = child
        for name, value in vars(original).items():  # config, hidden_size, ...: plain attributes
            # Not callables: an instance-level forward override is the original's code, not ours.
            if not name.startswith("_") and name != "training" and name not in self.__dict__ and not callable(value):
                self.__dict__[name] = value
        self.layout = layout

    def _stock(self, h: Tensor, up: Optional[Tensor]) -> Tensor:
        """The rest of what the original computes, with the held modules, from the projections'
        outputs (the fallback for mixed dtypes)."""
        L, m = self.layout, self._modules
        if L.fused is not None:
            first, second = h.chunk(2, dim=-1)
            gate, up = (first, second) if L.gate_half == 0 else (second, first)
        else:
            gate = h
        act = m[L.act] if L.act is not None else (lambda t: _act_reference(t, L.activation))
        q = act(gate) * up
        if L.dropout is not None:
            q = m[L.dropout](q)
        return m[L.down](q)

    def forward(self, *args: Tensor, **kwargs: Tensor) -> Tensor:
        # One tensor, positional or under whatever keyword the original's forward names it.
        if len(args) + len(kwargs) != 1:
            raise TypeError(f"{type(self).__name__}.forward takes one tensor (the hidden states), got "
                            f"{len(args)} positional and {sorted(kwargs)} keyword arguments")
        x = args[0] if args else next(iter(kwargs.values()))
        L, m = self.layout, self._modules
        drop = m[L.dropout] if L.dropout is not None else None
        p, training = (float(drop.p), bool(drop.training)) if drop is not None else (0.0, self.training)
        if L.fused is not None:
            h, up, gate_half = m[L.fused](x), None, L.gate_half
        else:
            h, up, gate_half = m[L.gate](x), m[L.up](x), SEPARATE
        down = m[L.down]
        if not _plain_linear(down):
            log_fallback_once(f"{OP}:down:{type(down).__name__}",
                              f"{OP}: the down projection is a {type(down).__name__}, not a plain nn.Linear (an "
                              "adapter or a quantized layer): it is called on the product, which it keeps (3·I "
                              "per token instead of 2·I)")
            return down(_gated(h, up, gate_half, None, None, L.activation, p, training, None, OP))
        params = [down.weight] + ([down.bias] if down.bias is not None else [])
        mixed = (up is not None and up.dtype != h.dtype) or (
            autocast_dtype_for(h) is None and any(t.dtype != h.dtype for t in params))
        if mixed:
            log_fallback_once(f"{OP}:dtypes", f"{OP}: {type(self).__name__} got mixed dtypes outside autocast "
                              f"({h.dtype} activations, {down.weight.dtype} down weight): the stock computation runs")
            return self._stock(h, up)
        return _gated(h, up, gate_half, down.weight, down.bias, L.activation, p, training, None, OP)

    def extra_repr(self) -> str:
        return self.layout.describe()


__all__ = ["ACTIVATIONS", "GatedLayout", "GatedMLP", "gated_linear", "gated_linear_bwd", "gated_linear_fused",
           "gated_linear_fwd", "gated_mlp_keep_mask"]
