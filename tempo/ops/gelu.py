"""In-place GELU: exact (erf) GELU whose backward needs only its output and one bit per element.

Plain GELU keeps its input x for backward. The next Linear keeps GELU's output y anyway, so
keeping x too costs a whole extra activation (4h elements per token in BERT's FFN). Here
backward recovers x from y: GELU(x) = x·Φ(x) is monotonic on either side of its minimum at
x* ≈ -0.75179 (y* ≈ -0.16997), so y plus one bit saying which side x was on (x < x*) names x
uniquely. The bits are packed 8 to a byte (layout in tempo/ops/bitpack.py); the original Tempo
kept a byte per element.

Inverting GELU (the same math on both paths, in fp32; fp64 on the reference path):
  * an initial guess per region: the quadratic model y ≈ y* + g''(x*)(x − x*)²/2 near the
    minimum, the Gaussian-tail asymptote x ≈ −sqrt(−2 ln(−y) − ln 2π) far left, x ≈ y + 0.1
    for y ≥ 0 (there x − y = x·Φ(−x) ∈ [0, 0.17]);
  * then 8 Newton steps clamped to the branch's bracket: [−5.5, x*] on the left (below −5.5
    the derivative is under 1e-6 in magnitude, so clamping there costs nothing measurable),
    [x*, 0] or [y, y + 0.2] on the right.
The derivative is then Φ(x) + x·φ(x). Accuracy against the fp64 derivative at the fp64 input,
x on a dense grid over [−12, 12] plus the neighbourhood of x* (tests/test_gelu.py measures it):
fp32 max abs error 1.4e-4 (bound 2e-4), bf16 1.5e-2 and fp16 6.4e-3 (bound 3e-2). The error
is worst at x*, where dy/dx = 0 amplifies the rounding error of the stored y; elsewhere it is
at the level of the dtype's rounding. Cost: ~8 erf+exp evaluations per element in backward.

Under torch.autocast GELU is not on autocast's lists, so it runs in its input's dtype.
"""

from __future__ import annotations

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
NEWTON_STEPS = 8
_SQRT1_2 = 0.7071067811865476
_INV_SQRT_2PI = 0.3989422804014327
_LOG_2PI = math.log(2.0 * math.pi)

# ------------------------------------------------------------------------------------------
# Triton kernels
# ------------------------------------------------------------------------------------------
if triton is not None:

    @triton.jit
    def _gelu_fwd_kernel(x_ptr, y_ptr, bits_ptr, n, BLOCK: tl.constexpr):
        pid = tl.program_id(0)
        offs = pid * BLOCK + tl.arange(0, BLOCK)
        in_range = offs < n
        x = tl.load(x_ptr + offs, mask=in_range, other=0.0).to(tl.float32)
        y = 0.5 * x * (1.0 + tl.erf(x * 0.7071067811865476))
        tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=in_range)
        # Pack the branch bit (x < x*) 8 to a byte, least significant bit first.
        left = ((x < -0.7517915246935645) & in_range).to(tl.int32)
        byte = tl.sum(tl.reshape(left, (BLOCK // 8, 8)) << tl.arange(0, 8)[None, :], axis=1)
        byte_offs = pid * (BLOCK // 8) + tl.arange(0, BLOCK // 8)
        tl.store(bits_ptr + byte_offs, byte.to(tl.uint8), mask=byte_offs < (n + 7) // 8)

    @triton.jit
    def _gelu_bwd_kernel(grad_ptr, y_ptr, bits_ptr, dx_ptr, n, BLOCK: tl.constexpr, STEPS: tl.constexpr):
        pid = tl.program_id(0)
        offs = pid * BLOCK + tl.arange(0, BLOCK)
        in_range = offs < n
        y = tl.load(y_ptr + offs, mask=in_range, other=0.0).to(tl.float32)
        g = tl.load(grad_ptr + offs, mask=in_range, other=0.0).to(tl.float32)
        byte_offs = pid * (BLOCK // 8) + tl.arange(0, BLOCK // 8)
        byte = tl.load(bits_ptr + byte_offs, mask=byte_offs < (n + 7) // 8, other=0).to(tl.int32)
        left = tl.reshape((byte[:, None] >> tl.arange(0, 8)[None, :]) & 1, (BLOCK,)) != 0

        x_star = -0.7517915246935645
        # Initial guess and bracket, per branch (see the module docstring).
        r = tl.sqrt(tl.maximum(2.0 * (y + 0.16997120747990363) / 0.43149399231404695, 0.0))
        tail = -tl.sqrt(tl.maximum(-2.0 * tl.log(tl.maximum(-y, 1e-30)) - 1.8378770664093453, 0.0))
        left_guess = tl.where(y > -0.1, tail, x_star - r)
        right_guess = tl.where(y >= 0.0, y + 0.1, x_star + r)
        lo = tl.where(left, -5.5, tl.where(y >= 0.0, y, x_star))
        hi = tl.where(left, x_star, tl.where(y >= 0.0, y + 0.2, 0.0))
        x = tl.minimum(tl.maximum(tl.where(left, left_guess, right_guess), lo), hi)
        for _ in tl.static_range(STEPS):
            cdf = 0.5 * (1.0 + tl.erf(x * 0.7071067811865476))
            slope = cdf + x * tl.exp(-0.5 * x * x) * 0.3989422804014327
            slope = tl.where(tl.abs(slope) > 1e-6, slope, 1e-6)
            x = tl.minimum(tl.maximum(x - (x * cdf - y) / slope, lo), hi)
        cdf = 0.5 * (1.0 + tl.erf(x * 0.7071067811865476))
        derivative = cdf + x * tl.exp(-0.5 * x * x) * 0.3989422804014327
        tl.store(dx_ptr + offs, (g * derivative).to(dx_ptr.dtype.element_ty), mask=in_range)


_BLOCK = 1024  # a multiple of 8, so a block's bits fill whole bytes


def _grid(n: int) -> tuple[int]:
    return (triton.cdiv(n, _BLOCK),)


def _forward_triton(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    y = torch.empty_like(x)
    bits = torch.empty(packed_numel(x.numel()), dtype=torch.uint8, device=x.device)
    _gelu_fwd_kernel[_grid(x.numel())](x, y, bits, x.numel(), BLOCK=_BLOCK)
    return y, bits


def _backward_triton(grad: torch.Tensor, y: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    dx = torch.empty_like(y)
    _gelu_bwd_kernel[_grid(y.numel())](grad, y, bits, dx, y.numel(), BLOCK=_BLOCK, STEPS=NEWTON_STEPS)
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


def invert_gelu(y: torch.Tensor, left: torch.Tensor, steps: int = NEWTON_STEPS) -> torch.Tensor:
    """x with GELU(x) = y on the branch ``left`` (x < x*) or its complement, in fp32 (fp64 for fp64)."""
    y = y.to(_compute_dtype(y))
    r = torch.sqrt(torch.clamp(2.0 * (y - Y_STAR) / CURVATURE, min=0.0))
    tail = -torch.sqrt(torch.clamp(-2.0 * torch.log(torch.clamp(-y, min=1e-30)) - _LOG_2PI, min=0.0))
    guess = torch.where(left, torch.where(y > -0.1, tail, X_STAR - r), torch.where(y >= 0, y + 0.1, X_STAR + r))
    lo = torch.where(left, torch.full_like(y, LEFT_LIMIT), torch.where(y >= 0, y, torch.full_like(y, X_STAR)))
    hi = torch.where(left, torch.full_like(y, X_STAR), torch.where(y >= 0, y + 0.2, torch.zeros_like(y)))
    x = torch.minimum(torch.maximum(guess, lo), hi)
    for _ in range(steps):
        slope = _gelu_slope(x)
        slope = torch.where(slope.abs() > 1e-6, slope, torch.full_like(slope, 1e-6))
        x = torch.minimum(torch.maximum(x - (_gelu(x) - y) / slope, lo), hi)
    return x


def gelu_derivative_from_output(y: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    """GELU'(x) recovered from the output y and the packed branch bits (reference path).

    Returned in fp32 (fp64 for fp64 y). Benchmarks and tests use it to measure accuracy.
    """
    left = unpack_bits(bits, y.shape)
    return _gelu_slope(invert_gelu(y, left))


def _forward_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    xc = x.to(_compute_dtype(x))
    return _gelu(xc).to(x.dtype), pack_bits(xc < X_STAR)


def _backward_reference(grad: torch.Tensor, y: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    derivative = gelu_derivative_from_output(y, bits)
    return (grad.to(derivative.dtype) * derivative).to(y.dtype)


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
