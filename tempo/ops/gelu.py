"""In-place GELU: GELU whose backward needs only its output and one bit per element.

Two forms, as ``nn.GELU(approximate=...)``:
  * ``"none"`` (default): exact GELU(x) = x·Φ(x) = 0.5·x·(1 + erf(x/√2));
  * ``"tanh"``: 0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³))), GPT-2's "gelu_new".

Plain GELU keeps its input x for backward. The next Linear keeps GELU's output y anyway, so
keeping x too costs a whole extra activation (4h elements per token in BERT's FFN). Here
backward recovers x from y: each form has one minimum x* and is monotonic on either side of it
(exact: x* ≈ −0.75179, y* ≈ −0.16997; tanh: x* ≈ −0.75246, y* ≈ −0.17004), so y plus one bit
saying which side x was on (x < x*) names x uniquely. The bits are packed 8 to a byte (layout
in tempo/ops/bitpack.py); the original Tempo kept a byte per element.

No backward, nothing kept: when no output can reach a backward (``torch.no_grad()``,
``torch.inference_mode()``, or an input that does not require grad; ``needs_backward``) nothing is
kept. ``InplaceGelu`` in eval mode and the functional ``inplace_gelu`` then run ``F.gelu``;
``InplaceGelu`` in training mode runs its own forward (``runs_own_forward``), so the output is
bitwise the one with grad: reentrant checkpointing's no-grad first pass and its recompute agree.
F.gelu differs from the Tempo path by about one rounding of y (below; measured on MiniLM: up to
9.4e-7 fp32; under bf16 autocast 1.5e-5 reference, 3.1e-2 kernel), and on the CPU the reference
forward costs tens of times F.gelu's (43 against 1.0 ms, [2048, 1536] fp32, one thread), a price
only a training-mode pass pays, as its recompute with grad does.

Recovering the derivative (the same table and arithmetic on both paths, one table per form):
  with t = sqrt(y − y*) and s = −t on the left branch, +t on the right, GELU'(x) is a smooth
  (analytic) function of s across the minimum: the square-root singularity of x(y) at x*
  disappears in s. GELU' is tabulated at TABLE_INTERVALS + 1 = 32769 evenly spaced s on
  [−sqrt(−y*), sqrt(6 − y*)] (y from 0⁻ on the left through y* to y = 6 on the right; beyond
  y = 6, GELU' = 1 within 4e-8, 1.0 in fp32) from an fp64 bisection of the branch, each point
  with its slope to the next; backward reads the pair at i = floor(p), p = (s + t_left)/step
  clamped to the table, and returns value + (p − i)·slope: a sqrt, one 8-byte table read and a
  multiply-add per element, no erf/exp/tanh. The clamp covers both ends with no special case:
  y ≥ 0 on the left branch (x → −∞, y underflowed to −0.0) reads GELU' = 0, y > 6 reads 1.
  A NaN y gives a NaN derivative on both paths (the index is clamped, the weight stays NaN).
  The table is plain data of the form, built when an ``InplaceGelu`` is built (CPU) or moved
  (``.to()``/``.cuda()``/``to_empty``: on the target device), and by the forward on a device
  that has none yet (the functional form, or a module built on the CPU and called on a GPU
  without ``.to``) — never inside a backward, which CUDA-graph capture without warm-up could not
  run. ``prepare_derivative_table(device, approximate)`` builds one ahead.
The CPU (reference) path runs through its tensors CHUNK = 2^17 elements at a time, a dozen
in-place passes per chunk on scratch that stays in cache. Forward + backward on [2048, 1536]
fp32, one thread: 17x nn.GELU's time before, 5.5x now (tanh form: 11x, 2.2x); the backward
alone 63 -> 13 ms, the forward 42 -> 24 ms, which computes in fp64 to round once (see below;
``python -m tempo.bench.gelu_bench time``, medians on a shared 2-core machine).
Near x*, dy/dx = 0, so a rounding error dy in the stored y becomes an error of about
sqrt(2·GELU''(x*)·dy) in the recovered derivative: y must be rounded once, not a few times.
The reference path computes fp32 GELU in fp64 (as 0.5·x·(1 + erf(x/√2)) for x ≥ −2,
0.5·x·erfc(−x/√2) below, and x·σ(2z), which keep their relative accuracy on the left) and
rounds once; the forward kernel, whose fp32 erf/exp are a few ULP off, evaluates
y = y* + (x − x*)²·P(x − x*) (Taylor to degree 7, x* and y* split head + tail) within
|x − x*| < 1/16 instead, which agrees with the reference to 1 ULP.
The kernel's tanh form uses 0.5·(1 + tanh(z)) = σ(2z) with q = σ(−2|z|) = e/(1 + e),
e = exp(−2|z|): y = x·q for z < 0 and x − x·q for z ≥ 0. No overflow for any z, no tanh (no
libdevice), and no cancellation in 1 + tanh(z) on the left, where torch's fp32 formula loses
most of its digits.

Accuracy of the recovered derivative, worst cases over adversarial inputs (``python -m
tempo.bench.gelu_bench audit``: a dense grid on [−12, 12]; ±0.02 and ±3e-4 around x* and the 600
nearest dtype and fp32 values of x*, the branch split; the far left tail down to x = −40 with y
underflowing to −0.0; the table's ends; ±0 and subnormals; the dtype's largest values), against
the fp64 derivative at the input as the dtype holds it. Kernel figures under Triton's CPU
interpreter, whose bf16 store truncates y instead of rounding it. tests/test_gelu.py asserts the
bounds on the same measurement (tempo.bench.gelu_bench.audit_case):

                    exact ("none")           tanh
    dtype      reference   kernel     reference   kernel     bound
    fp32         4.8e-5    4.8e-5       5.1e-5    5.1e-5     1e-4
    bf16         1.5e-2    2.3e-2       1.2e-2    2.0e-2     3e-2
    fp16         6.4e-3    6.4e-3       7.0e-3    7.0e-3     1e-2

Condition: the worst case is always at the minimum, where dy/dx = 0, so the rounding δ of the
stored y (half an ULP at |y*| ≈ 0.17: fp32 7.5e-9, bf16 4.9e-4, fp16 6.1e-5; a whole ULP when
truncated) moves the recovered derivative by up to sqrt(2·GELU''(x*)·δ) (fp32 8.0e-5, bf16
2.1e-2 rounded and 2.9e-2 truncated, fp16 7.3e-3): nothing a table can improve. Away from it,
for |x − x*| > 0.05 and x ≥ −3, the fp32 error is at most 1.1e-5 (reference) / 1.9e-5 (kernel,
whose fp32 erf/exp round y a few ULP off) of |GELU'(x)| on both branches; in the left tail
x < −3 (|GELU'| < 1.2e-2, the table's first intervals, where GELU' has a log singularity in s at
y = 0⁻) at most 9.9e-6 absolute; tests assert 1e-4·|GELU'| and 2e-5, so a 0.1 % slip fails.
In 16-bit, y's rounding dominates there too (up to 0.54 of |GELU'| in bf16 where GELU' is small,
next to x* ± 0.05; 5.1e-2 in fp16). The recovery alone (table and arithmetic against the exact
inverse of the stored y, in fp32 before rounding to the dtype; every dtype and both paths): at
most 4.1e-8 absolute within 0.05 of x*, 1.2e-5 of |GELU'| for the rest down to x = −3, 9.9e-6
absolute below (asserted: 2e-7, 5e-5, 2e-5). Both paths recover the same value within 3e-7.
Past the table's right end (y > 6) GELU' is exactly 1.0 in fp32 (the gradient passes through
bit for bit, GELU(inf) = inf with derivative 1); −inf gives NaN, as F.gelu does.
Output y in fp32: the reference path rounds once an fp64 value accurate to 4e-15 (0.5 ULP). The
tanh kernel is within 1.9 ULP of fp64 for x ≥ 0, 7.4 ULP on [−2, 0) and 20 ULP on [−4, −2) (5e-8
absolute for all x < 0; torch's fp32 tanh GELU: 1.7, 13 and 8100 ULP), at most 2.4e-7 absolute
over [−12, 12] (torch 4.3e-7). The exact kernel's tl.erf: 4.5e-7 absolute (torch 1.2e-6). The
stock path (no backward) is torch's F.gelu: within one rounding of the dtype of the Tempo path,
plus torch's own fp32 error on the left (1.2e-6 absolute at most); it runs in eval mode only.

Unsupported inputs fail the same way eager and under torch.compile: the backend is resolved
before the op (a forced 'triton' on fp64 raises TypeError, with or without grad; an integer x
raises TypeError naming 'x'), in Python that torch.compile runs as such (with fullgraph=True,
Dynamo reports any raise as its own error, carrying this one).

Under autocast GELU is not on autocast's lists, so it runs in its input's dtype.
"""

from __future__ import annotations

import functools
import logging
import math
import struct
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from tempo.ops._backend import check_float_tensor, launch_on, resolve_backend, runs_own_forward
from tempo.ops._backend import tl, triton  # None without triton (reference path only)
from tempo.ops.bitpack import pack_bits, packed_numel

OP = "InplaceGelu"
APPROXIMATIONS = ("none", "tanh")
BACKWARD_BACKENDS = ("triton", "reference")
logger = logging.getLogger("tempo")

# Import-time constants are plain Python floats: no torch.tensor(...) here, which a
# ``with torch.device("meta")`` block around the first import would turn into meta tensors.
X_STAR = -0.7517915246935645  # argmin of x·Φ(x)
Y_STAR = -0.16997120747990363  # GELU(x*)
CURVATURE = 0.43149399231404695  # GELU''(x*)
X_STAR_TANH = -0.7524614220710163  # argmin of the tanh form (mpmath, 40 digits, rounded)
Y_STAR_TANH = -0.17004075057125406
CURVATURE_TANH = 0.4304000910248585
LEFT_LIMIT = -5.5  # left bracket end: |GELU'(x)| < 6e-7 (exact), 5e-8 (tanh) below it
RIGHT_Y = 6.0  # beyond y = 6, |GELU' - 1| < 4e-8 (exact), 1e-9 (tanh)
# Table intervals over s in [-t_left, t_right] (about 2.89 wide): step 8.8e-5, finer than the
# left branch's old 4097-point table, so its far tail (the least smooth part) loses nothing.
TABLE_INTERVALS = 32768
_SQRT1_2 = 0.7071067811865476
_SQRT_2_OVER_PI = 0.7978845608028654
_TANH_CUBIC = 0.044715
_INV_SQRT_2PI = 0.3989422804014327


def _fp32(value: float) -> float:
    """``value`` rounded to the nearest float32, as a Python float."""
    return struct.unpack("<f", struct.pack("<f", value))[0]


def _fp32_ceil(value: float) -> float:
    """The smallest float32 >= ``value`` (for comparing float32 inputs against it exactly)."""
    rounded = _fp32(value)
    if rounded >= value:
        return rounded
    bits = struct.unpack("<I", struct.pack("<f", rounded))[0]
    bits = bits - 1 if rounded < 0 else bits + 1  # one float32 step towards +inf
    return struct.unpack("<f", struct.pack("<I", bits))[0]


def _taylor_at_exact_minimum(order: int = 7) -> tuple[float, ...]:
    """GELU^(k)(x*) / k! for k = 2..order: y - y* = u^2 * sum_j c_j u^j with u = x - x*.

    GELU^(k)(x) = k phi^(k-2)(x) + x phi^(k-1)(x) for k >= 2, and phi^(n)(x) = (-1)^n He_n(x) phi(x).
    """
    hermite = [1.0, X_STAR]  # probabilists' He_n(x*), by the recurrence He_{n+1} = x He_n - n He_{n-1}
    for n in range(1, order):
        hermite.append(X_STAR * hermite[n] - n * hermite[n - 1])
    phi = math.exp(-0.5 * X_STAR * X_STAR) * _INV_SQRT_2PI
    dphi = [(-1) ** n * hermite[n] * phi for n in range(order)]
    return tuple((k * dphi[k - 2] + X_STAR * dphi[k - 1]) / math.factorial(k) for k in range(2, order + 1))


def _fp32_split(field: str) -> tuple[property, property]:
    """Properties (head, tail) of the float attribute ``field``: head = its fp32 rounding, tail = field − head."""
    head = property(lambda self: _fp32(getattr(self, field)))
    tail = property(lambda self: getattr(self, field) - _fp32(getattr(self, field)))
    return head, tail


@dataclass(frozen=True)
class GeluForm:
    """What the forward kernel and the derivative table need to know about one GELU form."""

    approximate: str
    x_star: float
    y_star: float
    curvature: float
    taylor: tuple[float, ...]  # c2..c7 of y - y* = u^2 (c2 + c3 u + ...), u = x - x*

    # y − y* near the minimum loses the bits that matter most in fp32: y* is split into an fp32
    # head and a small tail, so y − head is exact (Sterbenz) and the tail is subtracted after.
    y_star_head, y_star_tail = _fp32_split("y_star")
    x_star_head, x_star_tail = _fp32_split("x_star")

    @property
    def x_split(self) -> float:
        # x < x* <=> x < (smallest fp32 >= x*) for every fp32/bf16/fp16 x; x* itself is not
        # representable, and comparing against x* rounded to nearest would put x = fl(x*) on the
        # wrong side whenever fl(x*) < x* (it is, in fp32, for both forms).
        return _fp32_ceil(self.x_star)

    @property
    def t_left(self) -> float:  # t at y = 0⁻, the left branch's far end
        return math.sqrt(-self.y_star)

    @property
    def t_right(self) -> float:  # t at y = RIGHT_Y on the right branch
        return math.sqrt(RIGHT_Y - self.y_star)

    # The derivative table's grid: s = ±t (− on the left branch) on [−t_left, t_right] in
    # TABLE_INTERVALS equal steps; element position p = (s + t_left) / step.
    @property
    def table_step(self) -> float:
        return (self.t_left + self.t_right) / TABLE_INTERVALS

    @property
    def inv_step(self) -> float:
        return 1.0 / self.table_step

    @property
    def table_offset(self) -> float:  # p at s = 0 (the minimum)
        return self.t_left / self.table_step


FORMS = {
    "none": GeluForm("none", X_STAR, Y_STAR, CURVATURE, _taylor_at_exact_minimum()),
    # The tanh form's Taylor coefficients at its minimum, from mpmath (tests recompute them).
    "tanh": GeluForm("tanh", X_STAR_TANH, Y_STAR_TANH, CURVATURE_TANH,
                     (0.21520004551242924, 0.12917281537859632, -0.003945713380462007,
                      -0.0227888966161918, -0.002769888057175427, 0.0028117584942618738)),
}

# Near x* the kernel's fp32 erf/exp round y by a few ULP, and backward amplifies exactly that
# error (dy/dx = 0 there): within |x - x*| < 1/16 the forward kernel evaluates the Taylor
# polynomial instead (terms to u^7, truncation < 2e-13 for both forms), so y is rounded once,
# like the fp64 reference.
TAYLOR_RADIUS = 0.0625
TAYLOR = FORMS["none"].taylor  # kept for callers of the exact form's constants
Y_STAR_HEAD, Y_STAR_TAIL = FORMS["none"].y_star_head, FORMS["none"].y_star_tail
X_STAR_HEAD, X_STAR_TAIL = FORMS["none"].x_star_head, FORMS["none"].x_star_tail
T_LEFT, T_RIGHT = FORMS["none"].t_left, FORMS["none"].t_right


def check_approximate(approximate: object, op: str = OP) -> str:
    """``approximate`` must name a GELU form: 'none' (erf) or 'tanh'."""
    if not isinstance(approximate, str) or approximate not in APPROXIMATIONS:
        raise ValueError(f"{op}: argument 'approximate' must be one of {APPROXIMATIONS}, got {approximate!r}")
    return approximate


def _check_backend(backend: object, op: str) -> str:
    if backend not in BACKWARD_BACKENDS:
        raise ValueError(f"{op}: argument 'backend' must be one of {BACKWARD_BACKENDS}, got {backend!r}")
    return backend


# ------------------------------------------------------------------------------------------
# Triton kernels
# ------------------------------------------------------------------------------------------
if triton is not None:

    @triton.jit
    def _gelu_fwd_kernel(x_ptr, y_ptr, bits_ptr, n, x_split, x_star_head, x_star_tail, y_star_head, y_star_tail,
                         c2, c3, c4, c5, c6, c7, TANH: tl.constexpr, TAYLOR_RADIUS: tl.constexpr,
                         BLOCK: tl.constexpr):
        # 64-bit offsets: pid * BLOCK in int32 wraps silently from 2^31 elements on.
        pid = tl.program_id(0).to(tl.int64)
        offs = pid * BLOCK + tl.arange(0, BLOCK)
        in_range = offs < n
        x = tl.load(x_ptr + offs, mask=in_range, other=0.0).to(tl.float32)
        if TANH:
            # 0.5 (1 + tanh(z)) = sigmoid(2z) (no libdevice tanh), with a = -2z and q = sigmoid(-|a|)
            # from e = exp(-|a|) in [0, 1]: never overflows, no cancellation in 1 + tanh(z) for
            # z << 0 (y = x q), and for z >= 0 y = x - x q rounds like x (y = x once q underflows,
            # which keeps GELU(inf) = inf).
            a = x * (-1.5957691216057308 + -0.0713548162726002 * (x * x))
            e = tl.exp(-tl.abs(a))
            q = e / (1.0 + e)
            y = tl.where(a < 0.0, tl.where(q > 0.0, x - x * q, x), x * q)  # a = ±0: y = x/2 keeps -0
        else:
            y = 0.5 * x * (1.0 + tl.erf(x * 0.7071067811865476))
        # Near x*: y* + u^2 P(u) with u = x - x* exact (x* split head + tail, x - head is Sterbenz-exact).
        u = (x - x_star_head) - x_star_tail
        poly = c2 + u * (c3 + u * (c4 + u * (c5 + u * (c6 + u * c7))))
        y = tl.where(tl.abs(u) < TAYLOR_RADIUS, y_star_head + (y_star_tail + u * u * poly), y)
        tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=in_range)
        # Pack the branch bit (x < x*) 8 to a byte, least significant bit first.
        left = ((x < x_split) & in_range).to(tl.int32)
        byte = tl.sum(tl.reshape(left, (BLOCK // 8, 8)) << tl.arange(0, 8)[None, :], axis=1)
        byte_offs = pid * (BLOCK // 8) + tl.arange(0, BLOCK // 8)
        tl.store(bits_ptr + byte_offs, byte.to(tl.uint8), mask=byte_offs < (n + 7) // 8)

    @triton.jit
    def _gelu_bwd_kernel(grad_ptr, y_ptr, bits_ptr, table_ptr, dx_ptr, n, y_star_head, y_star_tail, inv_step,
                         table_offset, BLOCK: tl.constexpr, INTERVALS: tl.constexpr):
        pid = tl.program_id(0).to(tl.int64)
        offs = pid * BLOCK + tl.arange(0, BLOCK)
        in_range = offs < n
        y = tl.load(y_ptr + offs, mask=in_range, other=0.0).to(tl.float32)
        g = tl.load(grad_ptr + offs, mask=in_range, other=0.0).to(tl.float32)
        byte_offs = pid * (BLOCK // 8) + tl.arange(0, BLOCK // 8)
        byte = tl.load(bits_ptr + byte_offs, mask=byte_offs < (n + 7) // 8, other=0).to(tl.int32)
        left = tl.reshape((byte[:, None] >> tl.arange(0, 8)[None, :]) & 1, (BLOCK,)) != 0

        # The reference path's arithmetic (gelu_derivative_from_output), element by element:
        # s = ±sqrt(y - y*), position p = s / step + t_left / step on the table's grid, clamped
        # to [0, INTERVALS] keeping NaN, then value[i] + (p - i)·slope[i] from the table's
        # (value, slope) pairs, i = floor(p) (pair INTERVALS has slope 0).
        t = tl.sqrt(tl.maximum((y - y_star_head) - y_star_tail, 0.0, propagate_nan=tl.PropagateNan.ALL))
        p = t * tl.where(left, -inv_step, inv_step) + table_offset
        p = tl.minimum(tl.maximum(p, 0.0, propagate_nan=tl.PropagateNan.ALL), INTERVALS * 1.0,
                       propagate_nan=tl.PropagateNan.ALL)
        i = p.to(tl.int32)  # p >= 0: truncation is floor
        weight = p - i.to(tl.float32)  # NaN for a NaN y
        i = tl.minimum(tl.maximum(i, 0), INTERVALS)  # a NaN p converts to any int: keep the reads inside
        value = tl.load(table_ptr + 2 * i, mask=in_range, other=0.0)
        slope = tl.load(table_ptr + 2 * i + 1, mask=in_range, other=0.0)
        derivative = value + weight * slope
        tl.store(dx_ptr + offs, (g * derivative).to(dx_ptr.dtype.element_ty), mask=in_range)


_BLOCK = 1024  # a multiple of 8, so a block's bits fill whole bytes


def _grid(n: int) -> tuple[int]:
    return (triton.cdiv(n, _BLOCK),)


def _forward_triton(x: torch.Tensor, approximate: str = "none") -> tuple[torch.Tensor, torch.Tensor]:
    form = FORMS[approximate]
    y = torch.empty_like(x)
    bits = torch.empty(packed_numel(x.numel()), dtype=torch.uint8, device=x.device)
    with launch_on(x):
        _gelu_fwd_kernel[_grid(x.numel())](x, y, bits, x.numel(), form.x_split, form.x_star_head, form.x_star_tail,
                                           form.y_star_head, form.y_star_tail, *form.taylor,
                                           TANH=approximate == "tanh", TAYLOR_RADIUS=TAYLOR_RADIUS, BLOCK=_BLOCK)
    return y, bits


def _backward_triton(grad: torch.Tensor, y: torch.Tensor, bits: torch.Tensor,
                     approximate: str = "none") -> torch.Tensor:
    form = FORMS[approximate]
    dx = torch.empty_like(y)
    table = derivative_table(y.device, torch.float32, approximate)
    with launch_on(y):
        _gelu_bwd_kernel[_grid(y.numel())](grad, y, bits, table, dx, y.numel(), form.y_star_head, form.y_star_tail,
                                           form.inv_step, form.table_offset,
                                           BLOCK=_BLOCK, INTERVALS=TABLE_INTERVALS)
    return dx


# ------------------------------------------------------------------------------------------
# Reference path (PyTorch, any device; the same math as the kernels)
# ------------------------------------------------------------------------------------------
def _compute_dtype(t: torch.Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def _gelu(x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """GELU of ``x``, computed and returned in fp64 (fp32 and fp64 x) or fp32 (16-bit x), with a
    relative error of a few ULP of that dtype for every x (fp64: below 4e-15), so rounding it to
    x's dtype rounds once.

    Written as x·Φ(x) = 0.5·x·erfc(−x/√2) and x·σ(2z): the textbook 1 + erf / 1 + tanh cancel
    on the left (torch's fp64 tanh form is exactly 0 below x ≈ −7.1, where y ≈ −4e-16). In fp64,
    where erfc costs 2-3x erf on the CPU, 2Φ(x) = 1 + erf(x/√2) for x ≥ −2 (the cancellation
    costs at most log2(1/(2Φ(−2))) = 4.4 bits of 53: relative error < 4e-15) and erfc(−x/√2) for
    the x < −2 only. Same-dtype in-place passes on one new buffer: on the CPU a mixed-dtype op or a
    fresh allocation costs as much as the op itself.
    """
    compute = torch.float64 if x.dtype in (torch.float32, torch.float64) else torch.float32
    z = x.to(compute, memory_format=torch.contiguous_format)  # x itself when it already is
    if approximate == "tanh":  # σ(2·√(2/π)·(x + 0.044715·x³)) = σ(2·√(2/π)·x·(1 + 0.044715·x²))
        w = torch.mul(z, z)
        w.mul_(_TANH_CUBIC).add_(1.0).mul_(z).mul_(2.0 * _SQRT_2_OVER_PI).sigmoid_()
        return w.mul_(z)
    if compute == torch.float64:
        w = torch.mul(z, _SQRT1_2)
        torch.erf(w, out=w)
        w.add_(1.0)
        tail = (z < -2.0).view(-1).nonzero().squeeze(1)  # a few % of activations: erfc there
        z_tail = z.view(-1).index_select(0, tail)
        w.view(-1).index_copy_(0, tail, torch.special.erfc(z_tail.mul_(-_SQRT1_2)))
    else:
        w = torch.mul(z, -_SQRT1_2)
        torch.special.erfc(w, out=w)
    return w.mul_(0.5).mul_(z)  # halve first: 2·x overflows fp32 for bf16 x near its largest value


def _gelu_slope(x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """GELU'(x) in the tensor's own precision."""
    if approximate == "tanh":
        # d/dx x·σ(2z) = σ(2z) + 2x·σ(2z)·σ(−2z)·z', z = √(2/π)(x + 0.044715 x³)
        z = _SQRT_2_OVER_PI * (x + _TANH_CUBIC * x * x * x)
        dz = _SQRT_2_OVER_PI * (1.0 + 3.0 * _TANH_CUBIC * x * x)
        s = torch.sigmoid(2.0 * z)
        return s + 2.0 * x * s * torch.sigmoid(-2.0 * z) * dz
    return 0.5 * torch.special.erfc(x * -_SQRT1_2) + x * torch.exp(-0.5 * x * x) * _INV_SQRT_2PI


def invert_gelu(y: torch.Tensor, left: torch.Tensor, approximate: str = "none", steps: int = 80) -> torch.Tensor:
    """x with GELU(x) = y on the branch ``left`` (x < x*) or its complement (builds the table).

    Bisection, which cannot fail on a monotonic branch: the bracket is [−5.5, x*] on the left
    (below −5.5 |GELU'| < 6e-7, so x is clamped there), [x*, 0] for y < 0 on the right and
    [y, y + 0.2] for y ≥ 0 (GELU(x) ≤ x there, and x − GELU(x) < 0.17). 80 halvings of a
    bracket at most 6.5 wide reach fp64's resolution.
    """
    x_star = FORMS[check_approximate(approximate, "invert_gelu")].x_star
    lo = torch.where(left, torch.full_like(y, LEFT_LIMIT), torch.where(y >= 0, y, torch.full_like(y, x_star)))
    hi = torch.where(left, torch.full_like(y, x_star), torch.where(y >= 0, y + 0.2, torch.zeros_like(y)))
    # Orient both branches as increasing: on the left GELU decreases, so compare -GELU with -y.
    sign = torch.where(left, -torch.ones_like(y), torch.ones_like(y))
    target = sign * y
    for _ in range(steps):
        mid = 0.5 * (lo + hi)
        below = sign * _gelu(mid, approximate) < target
        lo = torch.where(below, mid, lo)
        hi = torch.where(below, hi, mid)
    return 0.5 * (lo + hi)


@functools.lru_cache(maxsize=None)
def _table_fp64(approximate: str = "none") -> torch.Tensor:
    """[TABLE_INTERVALS + 1, 2]: (GELU'(s_k), GELU'(s_k+1) − GELU'(s_k)) at s_k = −t_left + k·step,
    k = 0..TABLE_INTERVALS (the last slope is 0: p = TABLE_INTERVALS reads GELU'(s_last))."""
    form = FORMS[approximate]
    # Explicit CPU device: a surrounding ``with torch.device("meta")`` must not make this meta.
    s = torch.arange(TABLE_INTERVALS + 1, dtype=torch.float64, device="cpu").mul_(form.table_step).sub_(form.t_left)
    s[-1] = form.t_right
    value = _gelu_slope(invert_gelu(form.y_star + s * s, s < 0, approximate), approximate)
    value[0] = 0.0  # y = 0⁻ is x -> -inf
    value[s == 0] = 0.0  # x* itself, were it a node (bisection gets within ~1e-8 of x*)
    slope = torch.zeros_like(value)
    slope[:-1] = value[1:] - value[:-1]
    return torch.stack([value, slope], dim=1)


@dataclass(frozen=True)
class _DerivativeTable:
    pairs: torch.Tensor  # [TABLE_INTERVALS + 1, 2]: (value, slope) per grid point
    branch_step: torch.Tensor  # [256, 8]: ±1/step for bit j of a byte (− on the left branch)
    offset: torch.Tensor  # 0-d: t_left/step, p at the minimum (a tensor for addcmul, made once)


_TABLES: dict[tuple[torch.device, torch.dtype, str], _DerivativeTable] = {}


def _table_key(device: torch.device | str, dtype: torch.dtype, approximate: str):
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device, dtype, approximate


def _prepared(device: torch.device | str, dtype: torch.dtype, approximate: str) -> _DerivativeTable:
    key = _table_key(device, dtype, approximate)
    table = _TABLES.get(key)
    if table is None:
        form = FORMS[check_approximate(approximate, "derivative_table")]
        pairs = _table_fp64(approximate).to(device=key[0], dtype=dtype)
        byte = torch.arange(256, dtype=torch.int32, device="cpu")
        left = (byte[:, None] >> torch.arange(8, dtype=torch.int32, device="cpu")) & 1
        step = (1.0 - 2.0 * left.to(torch.float64)) * form.inv_step
        offset = torch.tensor(form.table_offset, dtype=dtype, device="cpu").to(key[0])
        table = _DerivativeTable(pairs, step.to(device=key[0], dtype=dtype), offset)
        _TABLES[key] = table
    return table


def prepare_derivative_table(device: torch.device | str, approximate: str = "none",
                             dtype: torch.dtype = torch.float32) -> None:
    """Build the derivative table of form ``approximate`` on ``device`` now (tens of ms the first
    time per form and process, then a copy per device), so no backward ever builds one. Called
    when an ``InplaceGelu`` is built or moved, and by each forward."""
    if torch.device(device).type != "meta":
        _prepared(device, dtype, approximate)


def derivative_table(device: torch.device | str, dtype: torch.dtype, approximate: str = "none") -> torch.Tensor:
    """GELU' tabulated on s = ±sqrt(y − y*) (− left of x*) at TABLE_INTERVALS + 1 points evenly
    spaced on [−t_left, t_right]: [TABLE_INTERVALS + 1, 2] rows (value, slope to the next point)."""
    return _prepared(device, dtype, approximate).pairs


# The reference path works through its tensors CHUNK elements at a time: a dozen passes over a
# chunk that stays in cache, on scratch the allocator reuses, instead of over whole tensors whose
# fresh buffers page-fault on every call (3x slower on the CPU, and noisier). A multiple of 8:
# a chunk's branch bits are whole bytes.
CHUNK = 1 << 17


def _derivative_chunk(y: torch.Tensor, bits: torch.Tensor, table: _DerivativeTable, form: GeluForm,
                      compute: torch.dtype) -> torch.Tensor:
    """GELU' (in ``compute``) of the flat chunk ``y`` whose branch bits are the bytes ``bits``."""
    n = y.numel()
    if y.dtype == compute:
        s = torch.sub(y, form.y_star_head)  # y − y* without cancellation: head exact, then tail
    else:
        s = y.to(compute)
        s.sub_(form.y_star_head)
    s.sub_(form.y_star_tail).clamp_(min=0.0).sqrt_()
    # p = ∓t/step + t_left/step, the ∓1/step of each element from its bit (one row of 8 per byte).
    step = table.branch_step.index_select(0, bits.to(torch.int32)).view(-1)[:n]
    p = torch.addcmul(table.offset, s, step, out=s).clamp_(0.0, float(TABLE_INTERVALS))
    index = p.to(torch.int32).clamp_(0, TABLE_INTERVALS)  # p >= 0: truncation is floor; NaN -> in range
    weight = p.frac_()  # NaN for a NaN y (NaN stays NaN through the clamp), so the derivative is NaN
    if compute == torch.float32:
        # One read per element: the fp32 (value, slope) pair as one 8-byte word. Strided operands
        # are fine for addcmul (vectorized), not for lerp (10x slower on them).
        pairs = table.pairs.view(torch.float64).view(-1).index_select(0, index).view(torch.float32).view(n, 2)
    else:
        pairs = table.pairs.index_select(0, index)
    return torch.addcmul(pairs[:, 0], pairs[:, 1], weight, out=weight)


def _check_bits(y: torch.Tensor, bits: torch.Tensor, op: str) -> None:
    if bits.dtype != torch.uint8 or bits.numel() != packed_numel(y.numel()):
        raise ValueError(f"{op}: argument 'bits' must hold {packed_numel(y.numel())} uint8 bytes for y of "
                         f"shape {tuple(y.shape)}, got {bits.numel()} of {bits.dtype}")


def _chunks(n: int):
    for start in range(0, n, CHUNK):
        stop = min(start + CHUNK, n)
        yield start, stop, slice(start // 8, (stop + 7) // 8)


def gelu_derivative_from_output(y: torch.Tensor, bits: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """GELU'(x) recovered from the output y and the packed branch bits (reference path).

    Returned in fp32 (fp64 for fp64 y), with y's shape: the Triton kernel's arithmetic, as a
    dozen in-place passes over each chunk of CHUNK elements.
    """
    form = FORMS[check_approximate(approximate, "gelu_derivative_from_output")]
    _check_bits(y, bits, "gelu_derivative_from_output")
    compute = _compute_dtype(y)
    table = _prepared(y.device, compute, approximate)
    flat, bits = y.reshape(-1), bits.reshape(-1)
    out = torch.empty(y.shape, dtype=compute, device=y.device)  # owns its storage: not a view
    flat_out = out.view(-1)
    for start, stop, byte_range in _chunks(flat.numel()):
        flat_out[start:stop] = _derivative_chunk(flat[start:stop], bits[byte_range], table, form, compute)
    return out


def _left_of_minimum(x: torch.Tensor, form: GeluForm) -> torch.Tensor:
    # torch rounds a Python scalar to the tensor's dtype before comparing, and bf16/fp16 x*
    # round below x* for some forms: compare in fp32 against the fp32 split point (exact for
    # every 16-bit and fp32 x, and the kernel's test), in fp64 against x* itself.
    if x.dtype == torch.float64:
        return x < form.x_star
    return x.to(torch.float32) < form.x_split


def _forward_reference(x: torch.Tensor, approximate: str = "none") -> tuple[torch.Tensor, torch.Tensor]:
    # fp32 is computed in fp64 and rounded once: fp32 erf/tanh are a few ULP off near x*, and
    # backward amplifies exactly that error (2e-4 instead of 4e-5 in the recovered derivative).
    # 16-bit inputs get fp32 math, fp64 inputs fp64. The result has x's shape and owns its storage.
    form = FORMS[approximate]
    flat = x.reshape(-1)
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)  # owns its storage: not a view
    flat_y = y.view(-1)
    bits = torch.empty(packed_numel(flat.numel()), dtype=torch.uint8, device=x.device)
    for start, stop, byte_range in _chunks(flat.numel()):
        chunk = flat[start:stop]
        flat_y[start:stop] = _gelu(chunk, approximate)
        bits[byte_range] = pack_bits(_left_of_minimum(chunk, form))
    return y, bits


def _backward_reference(grad: torch.Tensor, y: torch.Tensor, bits: torch.Tensor,
                        approximate: str = "none") -> torch.Tensor:
    form = FORMS[approximate]
    _check_bits(y, bits, f"{OP}_backward")
    compute = _compute_dtype(y)
    table = _prepared(y.device, compute, approximate)
    flat, flat_grad = y.reshape(-1), grad.reshape(-1)
    dx = torch.empty(y.shape, dtype=y.dtype, device=y.device)  # owns its storage: not a view
    flat_dx = dx.view(-1)
    for start, stop, byte_range in _chunks(flat.numel()):
        derivative = _derivative_chunk(flat[start:stop], bits[byte_range], table, form, compute)
        # The product in fp32 (fp64), rounded once into y's dtype.
        torch.mul(derivative, flat_grad[start:stop], out=flat_dx[start:stop])
    return dx


# ------------------------------------------------------------------------------------------
# Custom ops: opaque to torch.compile (no graph break), with fake and autograd registrations
# ------------------------------------------------------------------------------------------
@torch.library.custom_op("tempo::inplace_gelu", mutates_args=())
def _gelu_op(x: torch.Tensor, approximate: str, backend: str) -> tuple[torch.Tensor, torch.Tensor]:
    # ``backend`` is resolved by the caller (inplace_gelu), outside the op: a request no kernel
    # can take then fails the same way eager and under torch.compile, before any tracing.
    check_approximate(approximate)
    _check_backend(backend, OP)
    if x.numel() == 0:
        return torch.empty_like(x), torch.empty(0, dtype=torch.uint8, device=x.device)
    # The table backward will read, built here at the latest (never in the backward itself).
    prepare_derivative_table(x.device, approximate, torch.float32 if backend == "triton" else _compute_dtype(x))
    if backend == "triton":
        return _forward_triton(x, approximate)
    return _forward_reference(x, approximate)


@_gelu_op.register_fake
def _(x: torch.Tensor, approximate: str, backend: str) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty_like(x), x.new_empty(packed_numel(x.numel()), dtype=torch.uint8)


@torch.library.custom_op("tempo::inplace_gelu_backward", mutates_args=())
def _gelu_backward_op(grad: torch.Tensor, y: torch.Tensor, bits: torch.Tensor, approximate: str,
                      backend: str) -> torch.Tensor:
    # ``backend`` is the path the forward took, recorded in its autograd ctx: resolving it again
    # here could differ (CUDA backward runs on autograd's device thread, outside the forward's
    # thread-local use_backend() block).
    check_approximate(approximate, f"{OP}_backward")
    _check_backend(backend, f"{OP}_backward")
    if y.numel() == 0:
        return torch.empty_like(y)
    grad = grad.contiguous()
    if backend == "triton":
        return _backward_triton(grad, y, bits, approximate)
    return _backward_reference(grad, y, bits, approximate)


@_gelu_backward_op.register_fake
def _(grad: torch.Tensor, y: torch.Tensor, bits: torch.Tensor, approximate: str, backend: str) -> torch.Tensor:
    return torch.empty_like(y)


def _setup_context(ctx, inputs, output) -> None:
    _x, approximate, backend = inputs
    y, bits = output
    ctx.mark_non_differentiable(bits)
    # y is the very tensor returned to the caller: the next Linear saves the same storage.
    ctx.save_for_backward(y, bits)
    ctx.approximate = approximate
    ctx.backend = backend


def _backward(ctx, grad_y: torch.Tensor, grad_bits: torch.Tensor | None):
    y, bits = ctx.saved_tensors
    return _gelu_backward_op(grad_y, y, bits, ctx.approximate, ctx.backend), None, None


_gelu_op.register_autograd(_backward, setup_context=_setup_context)


# ------------------------------------------------------------------------------------------
# Public API
# ------------------------------------------------------------------------------------------
def inplace_gelu(x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """GELU (``approximate`` 'none': erf, 'tanh': tanh form) keeping only its output and 1 bit
    per element for backward; ``F.gelu`` (keeping nothing) when no backward can follow (the
    functional form has no training mode; ``InplaceGelu`` in training mode runs the Tempo forward
    then too)."""
    return _inplace_gelu(x, approximate, training=False)


def _inplace_gelu(x: torch.Tensor, approximate: str, training: bool) -> torch.Tensor:
    check_float_tensor(x, "x", OP)
    check_approximate(approximate)
    # Resolved (and refused: 'triton' forced on fp64 or where it cannot run) whatever the grad
    # mode, so a request is an error or not independently of no_grad.
    backend = resolve_backend(x, OP)
    if not runs_own_forward(training, x):
        return F.gelu(x, approximate=approximate)
    y, _bits = _gelu_op(x.contiguous(), approximate, backend)  # kernels index the flat storage
    return y


class InplaceGelu(nn.Module):
    """Drop-in for ``nn.GELU(approximate)`` keeping only its output + 1 bit per element.

    Without a backward it keeps nothing: in eval mode it runs ``F.gelu``, in training mode its own
    forward, so that a no-grad pass (reentrant checkpointing's first) gives the bits the pass with
    grad gives (module docstring, "No backward").

    Its derivative table is built with the module (CPU) and on each device it is moved to, so
    the first backward finds it ready (CUDA-graph capture needs no warm-up for it)."""

    def __init__(self, approximate: str = "none"):
        super().__init__()
        self.approximate = check_approximate(approximate)
        prepare_derivative_table("cpu", self.approximate)

    def _apply(self, fn, recurse=True):
        module = super()._apply(fn, recurse)
        # The module has no tensors of its own: where ``fn`` sends an empty fp32 tensor is where
        # the module now runs (``.to(device)``, ``.cuda()``, ``to_empty(device=...)``).
        try:
            device = fn(torch.zeros(0, device="cpu")).device
        except Exception as err:  # noqa: BLE001 - an _apply function written for parameters only
            logger.warning("%s: could not tell which device the module moves to (%r); its derivative table "
                           "will be built by the first forward there", OP, err)
            return module
        prepare_derivative_table(device, self.approximate)
        return module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _inplace_gelu(x, self.approximate, self.training)

    def extra_repr(self) -> str:
        return f"approximate={self.approximate!r}"
