"""In-place GELU: exact (erf) GELU whose backward needs only its output and one bit per element.

Plain GELU keeps its input x for backward. The next Linear keeps GELU's output y anyway, so
keeping x too costs a whole extra activation (4h elements per token in BERT's FFN). Here
backward recovers x from y: GELU(x) = x·Φ(x) is monotonic on either side of its minimum at
x* ≈ -0.75179 (y* ≈ -0.16997), so y plus one bit saying which side x was on (x < x*) names x
uniquely. The bits are packed 8 to a byte (layout in tempo/ops/bitpack.py); the original Tempo
kept a byte per element.

Recovering the derivative (the same table and arithmetic on both paths):
  with t = sqrt(y − y*), GELU'(x) is a smooth function of t on each branch (the square-root
  singularity of x(y) at the minimum disappears in t), so it is tabulated once, at import, on
  4097 evenly spaced t per branch — left: t ∈ [0, sqrt(−y*)] (y from y* up to 0⁻), right:
  t ∈ [0, sqrt(6 − y*)] (beyond it GELU' = 1 within 2e-7) — from an fp64 Newton inversion, and
  backward interpolates linearly: a sqrt, two table reads and a lerp per element, no erf/exp.
Near x*, dy/dx = 0, so a rounding error dy in the stored y becomes an error of about
sqrt(2·GELU''(x*)·dy) in the recovered derivative: y must be rounded once, not a few times.
The reference path computes fp32 GELU in fp64 and rounds once; the forward kernel, whose fp32
erf is a few ULP off, evaluates y = y* + (x − x*)²·P(x − x*) (Taylor to degree 7, x* and y*
split head + tail) within |x − x*| < 1/16 instead, which agrees with the reference to 1 ULP.
Accuracy against the fp64 derivative at the fp64 input, x on 100001 points over [−12, 12] plus
the 600 fp32 neighbours of x* and 601 points within 3e-4 of it (tests/test_gelu.py asserts the
bounds): fp32 max abs error 4.8e-5 on both paths (1.2e-4 in the kernel before the Taylor
patch) (bound 2e-4), 7.7e-6 away from x* (|x − x*| > 0.05); bf16 1.5e-2 reference, 2.3e-2
kernel under the interpreter (which truncates the bf16 store of y); fp16 6.6e-3 (bound 3e-2).
Elsewhere the error is at the level of the dtype's rounding of y.

Under torch.autocast GELU is not on autocast's lists, so it runs in its input's dtype.
"""

from __future__ import annotations

import functools
import math

import torch
from torch import nn

from tempo.ops._backend import check_float_tensor, resolve_backend
from tempo.ops.bitpack import pack_bits, packed_numel, unpack_bits

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the reference path needs no Triton
    triton = None
    tl = None

OP = "InplaceGelu"
X_STAR = -0.7517915246935645  # argmin of x·Φ(x)
Y_STAR = -0.16997120747990363  # GELU(x*)
CURVATURE = 0.43149399231404695  # GELU''(x*)
LEFT_LIMIT = -5.5  # left bracket end: |GELU'(x)| < 1e-6 below it
# y − y* near the minimum loses the bits that matter most in fp32: y* is split into an fp32
# head and a small tail, so y − head is exact (Sterbenz) and the tail is subtracted after.
Y_STAR_HEAD = float(torch.tensor(Y_STAR, dtype=torch.float32))
Y_STAR_TAIL = Y_STAR - Y_STAR_HEAD
X_STAR_HEAD = float(torch.tensor(X_STAR, dtype=torch.float32))
X_STAR_TAIL = X_STAR - X_STAR_HEAD
TABLE_INTERVALS = 4096
T_LEFT = math.sqrt(-Y_STAR)  # t at y = 0⁻, the left branch's far end
T_RIGHT = math.sqrt(6.0 - Y_STAR)  # beyond y = 6, GELU' = 1 to within 2e-7
_SQRT1_2 = 0.7071067811865476
_INV_SQRT_2PI = 0.3989422804014327
_LOG_2PI = math.log(2.0 * math.pi)


def _taylor_at_minimum(order: int = 7) -> tuple[float, ...]:
    """GELU^(k)(x*) / k! for k = 2..order: y - y* = u^2 * sum_j c_j u^j with u = x - x*.

    GELU^(k)(x) = k phi^(k-2)(x) + x phi^(k-1)(x) for k >= 2, and phi^(n)(x) = (-1)^n He_n(x) phi(x).
    """
    hermite = [1.0, X_STAR]  # probabilists' He_n(x*), by the recurrence He_{n+1} = x He_n - n He_{n-1}
    for n in range(1, order):
        hermite.append(X_STAR * hermite[n] - n * hermite[n - 1])
    phi = math.exp(-0.5 * X_STAR * X_STAR) * _INV_SQRT_2PI
    dphi = [(-1) ** n * hermite[n] * phi for n in range(order)]
    return tuple((k * dphi[k - 2] + X_STAR * dphi[k - 1]) / math.factorial(k) for k in range(2, order + 1))


# Near x* the kernel's fp32 erf rounds y by a few ULP, and backward amplifies exactly that error
# (dy/dx = 0 there): within |x - x*| < 1/16 the forward kernel evaluates the Taylor polynomial
# instead (terms to u^7, truncation < 1e-12), so y is rounded once, like the fp64 reference.
TAYLOR_RADIUS = 0.0625
TAYLOR = _taylor_at_minimum()

# ------------------------------------------------------------------------------------------
# Triton kernels
# ------------------------------------------------------------------------------------------
if triton is not None:

    @triton.jit
    def _gelu_fwd_kernel(x_ptr, y_ptr, bits_ptr, n, x_star_head, x_star_tail, y_star_head, y_star_tail,
                         c2, c3, c4, c5, c6, c7, TAYLOR_RADIUS: tl.constexpr, BLOCK: tl.constexpr):
        pid = tl.program_id(0)
        offs = pid * BLOCK + tl.arange(0, BLOCK)
        in_range = offs < n
        x = tl.load(x_ptr + offs, mask=in_range, other=0.0).to(tl.float32)
        y = 0.5 * x * (1.0 + tl.erf(x * 0.7071067811865476))
        # Near x*: y* + u^2 P(u) with u = x - x* exact (x* split head + tail, x - head is Sterbenz-exact).
        u = (x - x_star_head) - x_star_tail
        poly = c2 + u * (c3 + u * (c4 + u * (c5 + u * (c6 + u * c7))))
        y = tl.where(tl.abs(u) < TAYLOR_RADIUS, y_star_head + (y_star_tail + u * u * poly), y)
        tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=in_range)
        # Pack the branch bit (x < x*) 8 to a byte, least significant bit first.
        left = ((x < -0.7517915246935645) & in_range).to(tl.int32)
        byte = tl.sum(tl.reshape(left, (BLOCK // 8, 8)) << tl.arange(0, 8)[None, :], axis=1)
        byte_offs = pid * (BLOCK // 8) + tl.arange(0, BLOCK // 8)
        tl.store(bits_ptr + byte_offs, byte.to(tl.uint8), mask=byte_offs < (n + 7) // 8)

    @triton.jit
    def _gelu_bwd_kernel(grad_ptr, y_ptr, bits_ptr, table_ptr, dx_ptr, n, y_star_head, y_star_tail, t_left, t_right,
                         BLOCK: tl.constexpr, INTERVALS: tl.constexpr):
        pid = tl.program_id(0)
        offs = pid * BLOCK + tl.arange(0, BLOCK)
        in_range = offs < n
        y = tl.load(y_ptr + offs, mask=in_range, other=0.0).to(tl.float32)
        g = tl.load(grad_ptr + offs, mask=in_range, other=0.0).to(tl.float32)
        byte_offs = pid * (BLOCK // 8) + tl.arange(0, BLOCK // 8)
        byte = tl.load(bits_ptr + byte_offs, mask=byte_offs < (n + 7) // 8, other=0).to(tl.int32)
        left = tl.reshape((byte[:, None] >> tl.arange(0, 8)[None, :]) & 1, (BLOCK,)) != 0

        # Table lookup in t = sqrt(y - y*); the table is [left branch | right branch].
        t = tl.sqrt(tl.maximum((y - y_star_head) - y_star_tail, 0.0))
        u = tl.minimum(tl.where(left, t / t_left, t / t_right), 1.0) * INTERVALS
        i = tl.minimum(tl.floor(u), INTERVALS - 1.0)
        frac = u - i
        index = i.to(tl.int32) + tl.where(left, 0, INTERVALS + 1)
        lo = tl.load(table_ptr + index, mask=in_range, other=0.0)
        hi = tl.load(table_ptr + index + 1, mask=in_range, other=0.0)
        derivative = lo + frac * (hi - lo)
        derivative = tl.where(left & (y >= 0.0), 0.0, derivative)  # x -> -inf
        derivative = tl.where((~left) & (t > t_right), 1.0, derivative)  # large x
        tl.store(dx_ptr + offs, (g * derivative).to(dx_ptr.dtype.element_ty), mask=in_range)


_BLOCK = 1024  # a multiple of 8, so a block's bits fill whole bytes


def _grid(n: int) -> tuple[int]:
    return (triton.cdiv(n, _BLOCK),)


def _forward_triton(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    y = torch.empty_like(x)
    bits = torch.empty(packed_numel(x.numel()), dtype=torch.uint8, device=x.device)
    _gelu_fwd_kernel[_grid(x.numel())](x, y, bits, x.numel(), X_STAR_HEAD, X_STAR_TAIL, Y_STAR_HEAD, Y_STAR_TAIL,
                                       *TAYLOR, TAYLOR_RADIUS=TAYLOR_RADIUS, BLOCK=_BLOCK)
    return y, bits


def _backward_triton(grad: torch.Tensor, y: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    dx = torch.empty_like(y)
    table = derivative_table(y.device, torch.float32)
    _gelu_bwd_kernel[_grid(y.numel())](grad, y, bits, table, dx, y.numel(), Y_STAR_HEAD, Y_STAR_TAIL,
                                       T_LEFT, T_RIGHT,
                                       BLOCK=_BLOCK, INTERVALS=TABLE_INTERVALS)
    return dx


# ------------------------------------------------------------------------------------------
# Reference path (PyTorch, any device; the same math as the kernels)
# ------------------------------------------------------------------------------------------
def _compute_dtype(t: torch.Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def _gelu(x: torch.Tensor) -> torch.Tensor:
    return 0.5 * x * (1.0 + torch.erf(x * _SQRT1_2))


def _gelu_slope(x: torch.Tensor) -> torch.Tensor:
    return 0.5 * (1.0 + torch.erf(x * _SQRT1_2)) + x * torch.exp(-0.5 * x * x) * _INV_SQRT_2PI


def invert_gelu(y: torch.Tensor, left: torch.Tensor, steps: int = 60) -> torch.Tensor:
    """x with GELU(x) = y on the branch ``left`` (x < x*) or its complement (builds the table).

    Newton from per-region guesses (quadratic model near x*, Gaussian-tail asymptote far left,
    y + 0.1 for y ≥ 0), each step clamped to the branch's bracket ([−5.5, x*] on the left,
    where below −5.5 |GELU'| < 1e-6; [x*, 0] or [y, y + 0.2] on the right).
    """
    r = torch.sqrt(torch.clamp(2.0 * (y - Y_STAR) / CURVATURE, min=0.0))
    tail = -torch.sqrt(torch.clamp(-2.0 * torch.log(torch.clamp(-y, min=1e-30)) - _LOG_2PI, min=0.0))
    guess = torch.where(left, torch.where(y > -0.1, tail, X_STAR - r), torch.where(y >= 0, y + 0.1, X_STAR + r))
    lo = torch.where(left, torch.full_like(y, LEFT_LIMIT), torch.where(y >= 0, y, torch.full_like(y, X_STAR)))
    hi = torch.where(left, torch.full_like(y, X_STAR), torch.where(y >= 0, y + 0.2, torch.zeros_like(y)))
    x = torch.minimum(torch.maximum(guess, lo), hi)
    for _ in range(steps):
        slope = _gelu_slope(x)
        slope = torch.where(slope.abs() > 1e-12, slope, torch.full_like(slope, 1e-12))
        x = torch.minimum(torch.maximum(x - (_gelu(x) - y) / slope, lo), hi)
    return x


@functools.lru_cache(maxsize=None)
def _table_fp64() -> torch.Tensor:
    t = torch.linspace(0.0, 1.0, TABLE_INTERVALS + 1, dtype=torch.float64)
    y_left, y_right = Y_STAR + (t * T_LEFT) ** 2, Y_STAR + (t * T_RIGHT) ** 2
    left = _gelu_slope(invert_gelu(y_left, torch.ones_like(t, dtype=torch.bool)))
    left[-1] = 0.0  # y = 0⁻ is x -> -inf
    right = _gelu_slope(invert_gelu(y_right, torch.zeros_like(t, dtype=torch.bool)))
    return torch.cat([left, right])


_TABLES: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}


def derivative_table(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """GELU' tabulated against t = sqrt(y − y*): [left branch (4097) | right branch (4097)]."""
    key = (torch.device(device), dtype)
    if key not in _TABLES:
        _TABLES[key] = _table_fp64().to(device=device, dtype=dtype)
    return _TABLES[key]


def gelu_derivative_from_output(y: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    """GELU'(x) recovered from the output y and the packed branch bits (reference path).

    Returned in fp32 (fp64 for fp64 y): the same lookup the Triton kernel does.
    """
    left = unpack_bits(bits, y.shape)
    y = y.to(_compute_dtype(y))
    table = derivative_table(y.device, y.dtype)
    # In-place arithmetic and masked fills: this runs on every backward of the CPU path.
    t = (y - Y_STAR_HEAD).sub_(Y_STAR_TAIL).clamp_(min=0.0).sqrt_()
    large_x = t > T_RIGHT
    large_x &= ~left
    per_unit = left.to(y.dtype).mul_(1.0 / T_LEFT - 1.0 / T_RIGHT).add_(1.0 / T_RIGHT)
    u = t.mul_(per_unit).clamp_(max=1.0).mul_(TABLE_INTERVALS)
    i = torch.floor(u).clamp_(max=TABLE_INTERVALS - 1)
    index = i.to(torch.int32).add_(left.logical_not().to(torch.int32), alpha=TABLE_INTERVALS + 1)
    lower = table[index]
    derivative = torch.lerp(lower, table[index.add_(1)], u.sub_(i))
    derivative.masked_fill_(left & (y >= 0), 0.0)  # x -> -inf
    return derivative.masked_fill_(large_x, 1.0)


def _forward_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # torch's exact GELU is the same function. For fp32 it is computed in fp64 and rounded once:
    # torch's fp32 erf is a few ULP off near x*, and backward amplifies exactly that error
    # (2e-4 instead of 4e-5 in the recovered derivative). 16-bit inputs get fp32 math inside.
    if x.dtype == torch.float32:
        return torch.nn.functional.gelu(x.double()).float(), pack_bits(x < X_STAR)
    return torch.nn.functional.gelu(x), pack_bits(x < X_STAR)


def _backward_reference(grad: torch.Tensor, y: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    return gelu_derivative_from_output(y, bits).mul_(grad).to(y.dtype)


# ------------------------------------------------------------------------------------------
# Custom ops: opaque to torch.compile (no graph break), with fake and autograd registrations
# ------------------------------------------------------------------------------------------
@torch.library.custom_op("tempo::inplace_gelu", mutates_args=())
def _gelu_op(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if x.numel() == 0:
        return torch.empty_like(x), torch.empty(0, dtype=torch.uint8, device=x.device)
    if resolve_backend(x, OP) == "triton":
        return _forward_triton(x)
    return _forward_reference(x)


@_gelu_op.register_fake
def _(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty_like(x), x.new_empty(packed_numel(x.numel()), dtype=torch.uint8)


@torch.library.custom_op("tempo::inplace_gelu_backward", mutates_args=())
def _gelu_backward_op(grad: torch.Tensor, y: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    if y.numel() == 0:
        return torch.empty_like(y)
    grad = grad.contiguous()
    if resolve_backend(y, OP) == "triton":
        return _backward_triton(grad, y, bits)
    return _backward_reference(grad, y, bits)


@_gelu_backward_op.register_fake
def _(grad: torch.Tensor, y: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(y)


def _setup_context(ctx, inputs, output) -> None:
    y, bits = output
    ctx.mark_non_differentiable(bits)
    # y is the very tensor returned to the caller: the next Linear saves the same storage.
    ctx.save_for_backward(y, bits)


def _backward(ctx, grad_y: torch.Tensor, grad_bits: torch.Tensor | None):
    y, bits = ctx.saved_tensors
    return _gelu_backward_op(grad_y, y, bits)


_gelu_op.register_autograd(_backward, setup_context=_setup_context)


# ------------------------------------------------------------------------------------------
# Public API
# ------------------------------------------------------------------------------------------
def inplace_gelu(x: torch.Tensor) -> torch.Tensor:
    """Exact GELU that keeps only its output and 1 bit per element for backward."""
    check_float_tensor(x, "x", OP)
    y, _bits = _gelu_op(x.contiguous())  # kernels index the flat storage
    return y


class InplaceGelu(nn.Module):
    """Drop-in for ``nn.GELU()`` (exact erf form) keeping only its output + 1 bit per element."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return inplace_gelu(x)
