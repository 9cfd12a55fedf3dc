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

Recovering the derivative (the same table and arithmetic on both paths, one table per form):
  with t = sqrt(y − y*), GELU'(x) is a smooth function of t on each branch (the square-root
  singularity of x(y) at the minimum disappears in t), so it is tabulated once, on first use,
  on 4097 evenly spaced t per branch — left: t ∈ [0, sqrt(−y*)] (y from y* up to 0⁻), right:
  t ∈ [0, sqrt(6 − y*)] (beyond it GELU' = 1 within 4e-8) — from an fp64 bisection of the
  branch, and backward interpolates linearly: a sqrt, two table reads and a lerp per element,
  no erf/exp/tanh.
Near x*, dy/dx = 0, so a rounding error dy in the stored y becomes an error of about
sqrt(2·GELU''(x*)·dy) in the recovered derivative: y must be rounded once, not a few times.
The reference path computes fp32 GELU in fp64 (as 0.5·x·erfc(−x/√2) and x·σ(2z), which keep
their relative accuracy on the left) and rounds once; the forward kernel, whose fp32 erf/exp
are a few ULP off, evaluates y = y* + (x − x*)²·P(x − x*) (Taylor to degree 7, x* and y* split
head + tail) within |x − x*| < 1/16 instead, which agrees with the reference to 1 ULP.
The kernel's tanh form uses 0.5·(1 + tanh(z)) = σ(2z) with q = σ(−2|z|) = e/(1 + e),
e = exp(−2|z|): y = x·q for z < 0 and x − x·q for z ≥ 0. No overflow for any z, no tanh (no
libdevice), and no cancellation in 1 + tanh(z) on the left, where torch's fp32 formula loses
most of its digits.

Accuracy of the recovered derivative against the fp64 derivative at the (rounded) input, x on
100001 points over [−12, 12], 4001 points within 0.02 and 601 within 3e-4 of x*, and the 600
nearest neighbours of x* in the dtype; kernel figures under Triton's interpreter (CPU), whose
bf16 store truncates y instead of rounding it. tests/test_gelu.py asserts the bounds:

                    exact ("none")           tanh
    dtype      reference   kernel     reference   kernel     bound
    fp32         4.8e-5    4.8e-5       5.1e-5    5.1e-5     1e-4
    bf16         1.5e-2    2.3e-2       1.2e-2    2.0e-2     3e-2
    fp16         6.4e-3    6.4e-3       7.0e-3    7.0e-3     1e-2

The worst case is always at the minimum (the amplified rounding of y). Away from it, for
|x − x*| > 0.05, the fp32 error is at most 2.1e-5 of |GELU'(x)| on both branches, except the
left branch's far tail (x < −3, |GELU'| < 1.2e-2, the table's last intervals), where it is
at most 7.7e-6 (exact) / 1.2e-5 (tanh) absolute; the tests assert 1e-4·|GELU'| (+ 2e-5 on the
left), so a 0.1 % slip on either branch fails them.
Output y in fp32: the reference path rounds the fp64 value once (0.5 ULP). The tanh kernel is
within 1.9 ULP of fp64 for x ≥ 0, 7.4 ULP on [−2, 0) and 20 ULP on [−4, −2) (5e-8 absolute
for all x < 0; torch's fp32 tanh GELU: 1.7, 13 and 8100 ULP), at most 2.4e-7 absolute over
[−12, 12] (torch 4.3e-7). The exact kernel's tl.erf: 4.5e-7 absolute (torch 1.2e-6).

Under torch.autocast GELU is not on autocast's lists, so it runs in its input's dtype.
"""

from __future__ import annotations

import functools
import math
import struct
from dataclasses import dataclass

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
APPROXIMATIONS = ("none", "tanh")
BACKWARD_BACKENDS = ("triton", "reference")

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
TABLE_INTERVALS = 4096
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
    @property
    def y_star_head(self) -> float:
        return _fp32(self.y_star)

    @property
    def y_star_tail(self) -> float:
        return self.y_star - self.y_star_head

    @property
    def x_star_head(self) -> float:
        return _fp32(self.x_star)

    @property
    def x_star_tail(self) -> float:
        return self.x_star - self.x_star_head

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
    def t_right(self) -> float:
        return math.sqrt(RIGHT_Y - self.y_star)


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
    def _gelu_bwd_kernel(grad_ptr, y_ptr, bits_ptr, table_ptr, dx_ptr, n, y_star_head, y_star_tail, t_left, t_right,
                         BLOCK: tl.constexpr, INTERVALS: tl.constexpr):
        pid = tl.program_id(0).to(tl.int64)
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


def _forward_triton(x: torch.Tensor, approximate: str = "none") -> tuple[torch.Tensor, torch.Tensor]:
    form = FORMS[approximate]
    y = torch.empty_like(x)
    bits = torch.empty(packed_numel(x.numel()), dtype=torch.uint8, device=x.device)
    _gelu_fwd_kernel[_grid(x.numel())](x, y, bits, x.numel(), form.x_split, form.x_star_head, form.x_star_tail,
                                       form.y_star_head, form.y_star_tail, *form.taylor,
                                       TANH=approximate == "tanh", TAYLOR_RADIUS=TAYLOR_RADIUS, BLOCK=_BLOCK)
    return y, bits


def _backward_triton(grad: torch.Tensor, y: torch.Tensor, bits: torch.Tensor,
                     approximate: str = "none") -> torch.Tensor:
    form = FORMS[approximate]
    dx = torch.empty_like(y)
    table = derivative_table(y.device, torch.float32, approximate)
    _gelu_bwd_kernel[_grid(y.numel())](grad, y, bits, table, dx, y.numel(), form.y_star_head, form.y_star_tail,
                                       form.t_left, form.t_right,
                                       BLOCK=_BLOCK, INTERVALS=TABLE_INTERVALS)
    return dx


# ------------------------------------------------------------------------------------------
# Reference path (PyTorch, any device; the same math as the kernels)
# ------------------------------------------------------------------------------------------
def _compute_dtype(t: torch.Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def _gelu(x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """GELU in the tensor's own precision, accurate to a few ULP relative for every x.

    Written as x·Φ(x) = 0.5·x·erfc(−x/√2) and x·σ(2z): the textbook 1 + erf / 1 + tanh cancel
    on the left (torch's fp64 tanh form is exactly 0 below x ≈ −7.1, where y ≈ −4e-16).
    """
    if approximate == "tanh":
        return x * torch.sigmoid(2.0 * _SQRT_2_OVER_PI * (x + _TANH_CUBIC * x * x * x))
    return 0.5 * x * torch.special.erfc(x * -_SQRT1_2)


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
    form = FORMS[approximate]
    # Explicit CPU device: a surrounding ``with torch.device("meta")`` must not make this meta.
    t = torch.linspace(0.0, 1.0, TABLE_INTERVALS + 1, dtype=torch.float64, device="cpu")
    y_left, y_right = form.y_star + (t * form.t_left) ** 2, form.y_star + (t * form.t_right) ** 2
    left = _gelu_slope(invert_gelu(y_left, torch.ones_like(t, dtype=torch.bool), approximate), approximate)
    left[-1] = 0.0  # y = 0⁻ is x -> -inf
    right = _gelu_slope(invert_gelu(y_right, torch.zeros_like(t, dtype=torch.bool), approximate), approximate)
    left[0] = right[0] = 0.0  # t = 0 is x*, where GELU' = 0 (bisection gets within ~1e-8 of x*)
    return torch.cat([left, right])


_TABLES: dict[tuple[torch.device, torch.dtype, str], torch.Tensor] = {}


def derivative_table(device: torch.device, dtype: torch.dtype, approximate: str = "none") -> torch.Tensor:
    """GELU' tabulated against t = sqrt(y − y*): [left branch (4097) | right branch (4097)]."""
    key = (torch.device(device), dtype, approximate)
    if key not in _TABLES:
        _TABLES[key] = _table_fp64(approximate).to(device=device, dtype=dtype)
    return _TABLES[key]


def gelu_derivative_from_output(y: torch.Tensor, bits: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """GELU'(x) recovered from the output y and the packed branch bits (reference path).

    Returned in fp32 (fp64 for fp64 y): the same lookup the Triton kernel does.
    """
    form = FORMS[check_approximate(approximate, "gelu_derivative_from_output")]
    left = unpack_bits(bits, y.shape)
    y = y.to(_compute_dtype(y))
    table = derivative_table(y.device, y.dtype, approximate)
    # In-place arithmetic and masked fills: this runs on every backward of the CPU path.
    t = (y - form.y_star_head).sub_(form.y_star_tail).clamp_(min=0.0).sqrt_()
    large_x = t > form.t_right
    large_x &= ~left
    per_unit = left.to(y.dtype).mul_(1.0 / form.t_left - 1.0 / form.t_right).add_(1.0 / form.t_right)
    u = t.mul_(per_unit).clamp_(max=1.0).mul_(TABLE_INTERVALS)
    i = torch.floor(u).clamp_(max=TABLE_INTERVALS - 1)
    index = i.to(torch.int32).add_(left.logical_not().to(torch.int32), alpha=TABLE_INTERVALS + 1)
    lower = table[index]
    derivative = torch.lerp(lower, table[index.add_(1)], u.sub_(i))
    derivative.masked_fill_(left & (y >= 0), 0.0)  # x -> -inf
    return derivative.masked_fill_(large_x, 1.0)


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
    bits = pack_bits(_left_of_minimum(x, FORMS[approximate]))
    compute = torch.float64 if x.dtype in (torch.float32, torch.float64) else torch.float32
    return _gelu(x.to(compute), approximate).to(x.dtype), bits


def _backward_reference(grad: torch.Tensor, y: torch.Tensor, bits: torch.Tensor,
                        approximate: str = "none") -> torch.Tensor:
    return gelu_derivative_from_output(y, bits, approximate).mul_(grad).to(y.dtype)


# ------------------------------------------------------------------------------------------
# Custom ops: opaque to torch.compile (no graph break), with fake and autograd registrations
# ------------------------------------------------------------------------------------------
@torch.library.custom_op("tempo::inplace_gelu", mutates_args=())
def _gelu_op(x: torch.Tensor, approximate: str = "none") -> tuple[torch.Tensor, torch.Tensor]:
    check_approximate(approximate)
    if x.numel() == 0:
        return torch.empty_like(x), torch.empty(0, dtype=torch.uint8, device=x.device)
    if resolve_backend(x, OP) == "triton":
        return _forward_triton(x, approximate)
    return _forward_reference(x, approximate)


@_gelu_op.register_fake
def _(x: torch.Tensor, approximate: str = "none") -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty_like(x), x.new_empty(packed_numel(x.numel()), dtype=torch.uint8)


@torch.library.custom_op("tempo::inplace_gelu_backward", mutates_args=())
def _gelu_backward_op(grad: torch.Tensor, y: torch.Tensor, bits: torch.Tensor, approximate: str,
                      backend: str) -> torch.Tensor:
    # ``backend`` is the path the forward took, recorded in its autograd ctx: resolving it again
    # here could differ (CUDA backward runs on autograd's device thread, outside the forward's
    # thread-local use_backend() block).
    check_approximate(approximate, f"{OP}_backward")
    if backend not in BACKWARD_BACKENDS:
        raise ValueError(f"{OP}_backward: argument 'backend' must be one of {BACKWARD_BACKENDS}, got {backend!r}")
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
    x, approximate = inputs
    y, bits = output
    ctx.mark_non_differentiable(bits)
    # y is the very tensor returned to the caller: the next Linear saves the same storage.
    ctx.save_for_backward(y, bits)
    ctx.approximate = approximate
    # Same thread and backend context as the forward impl that just ran (an empty x never
    # reached a kernel, and its backward returns before using the backend).
    ctx.backend = resolve_backend(x, OP) if x.numel() else "reference"


def _backward(ctx, grad_y: torch.Tensor, grad_bits: torch.Tensor | None):
    y, bits = ctx.saved_tensors
    return _gelu_backward_op(grad_y, y, bits, ctx.approximate, ctx.backend), None


_gelu_op.register_autograd(_backward, setup_context=_setup_context)


# ------------------------------------------------------------------------------------------
# Public API
# ------------------------------------------------------------------------------------------
def inplace_gelu(x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """GELU (``approximate`` 'none': erf, 'tanh': tanh form) keeping only its output and 1 bit
    per element for backward."""
    check_float_tensor(x, "x", OP)
    check_approximate(approximate)
    y, _bits = _gelu_op(x.contiguous(), approximate)  # kernels index the flat storage
    return y


class InplaceGelu(nn.Module):
    """Drop-in for ``nn.GELU(approximate)`` keeping only its output + 1 bit per element."""

    def __init__(self, approximate: str = "none"):
        super().__init__()
        self.approximate = check_approximate(approximate)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return inplace_gelu(x, self.approximate)

    def extra_repr(self) -> str:
        return f"approximate={self.approximate!r}"
