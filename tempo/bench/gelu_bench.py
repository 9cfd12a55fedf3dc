"""In-place GELU on its own: CPU timing of the reference path, and the exactness audit.

``python -m tempo.bench.gelu_bench time`` times forward + backward of ``InplaceGelu`` on the
reference path (what runs on the CPU) against ``nn.GELU`` on [16·128, 1536] (MiniLM's FFN at
batch 16, s = 128), fp32 and bf16, on 1 and 2 threads: the variants alternate inside each
repeat (so a neighbour's load hits both alike), median and min over ``--repeats`` (default 9)
after ``--warmup`` (3) untimed rounds, forward and backward also timed apart. Timings are
printed, never asserted.

``python -m tempo.bench.gelu_bench audit`` measures the recovered derivative against fp64 over
adversarial inputs (``adversarial_inputs``) for each form x dtype x path and prints the table the
module docstring of tempo/ops/gelu.py and the README carry:
  * total: |GELU'(recovered) − GELU'(x)|, x the input as the dtype holds it, GELU' in fp64 — what
    a user gets; near x* it is dominated by the rounding of the stored y (the recovery's
    condition), nothing the table can improve;
  * recovery: |GELU'(recovered) − GELU'(x̂)| / max(|GELU'(x̂)|, 1e-3), x̂ the exact (fp64
    bisection) inverse of the stored y on the stored branch — the table and arithmetic alone,
    computed before the result is rounded to the dtype (fp32 on both paths: the reference's
    ``gelu_derivative_from_output``; the kernel's fp32 result is read through an fp32 y), so a
    0.1 % slip shows in every dtype.
The Triton column runs the kernels under Triton's interpreter on the CPU (the module sets
``TRITON_INTERPRET=1`` when there is no GPU, before Triton is imported), whose bf16 stores
truncate instead of rounding.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time

import torch

if __name__ == "__main__" and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton

SHAPE = (16 * 128, 1536)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


# ------------------------------------------------------------------------------------------
# Timing
# ------------------------------------------------------------------------------------------
def _round(module: torch.nn.Module, base: torch.Tensor, grad: torch.Tensor) -> tuple[float, float]:
    x = base.detach().requires_grad_()
    start = time.perf_counter()
    y = module(x)
    middle = time.perf_counter()
    y.backward(grad)
    end = time.perf_counter()
    return middle - start, end - middle


def time_gelu(threads: int, dtype: torch.dtype, approximate: str, repeats: int, warmup: int,
              shape: tuple[int, ...] = SHAPE) -> dict[str, dict[str, list[float]]]:
    """{variant: {"fwd": [s...], "bwd": [...], "both": [...]}} on the reference path, CPU."""
    from tempo.inplace_gelu import InplaceGelu
    from tempo.ops import use_backend

    torch.set_num_threads(threads)
    generator = torch.Generator().manual_seed(0)
    base = torch.randn(shape, generator=generator).to(dtype)
    grad = torch.randn(shape, generator=generator).to(dtype)
    variants = {"nn.GELU": torch.nn.GELU(approximate), "InplaceGelu": InplaceGelu(approximate)}
    times: dict[str, dict[str, list[float]]] = {name: {"fwd": [], "bwd": [], "both": []} for name in variants}
    with use_backend("reference"):
        for index in range(warmup + repeats):
            for name, module in variants.items():
                forward, backward = _round(module, base, grad)
                if index >= warmup:
                    times[name]["fwd"].append(forward)
                    times[name]["bwd"].append(backward)
                    times[name]["both"].append(forward + backward)
    return times


def _ms(values: list[float]) -> str:
    return f"{statistics.median(values) * 1e3:7.2f} ({min(values) * 1e3:6.2f})"


def run_timing(args: argparse.Namespace) -> None:
    print(f"InplaceGelu (reference path) vs nn.GELU, forward + backward on {list(args.shape)}, "
          f"approximate={args.approximate!r}; ms, median (min) of {args.repeats} after {args.warmup} warm-up; "
          f"torch {torch.__version__}")
    print("| threads | dtype | nn.GELU fwd+bwd | InplaceGelu fwd+bwd | ratio | InplaceGelu fwd | InplaceGelu bwd "
          "| nn.GELU fwd | nn.GELU bwd |")
    print("|---|---|---|---|---|---|---|---|---|")
    for threads in args.threads:
        for dtype_name in args.dtypes:
            times = time_gelu(threads, DTYPES[dtype_name], args.approximate, args.repeats, args.warmup,
                              tuple(args.shape))
            stock, tempo = times["nn.GELU"], times["InplaceGelu"]
            ratio = statistics.median(tempo["both"]) / statistics.median(stock["both"])
            print(f"| {threads} | {dtype_name} | {_ms(stock['both'])} | {_ms(tempo['both'])} | {ratio:.2f}x "
                  f"| {_ms(tempo['fwd'])} | {_ms(tempo['bwd'])} | {_ms(stock['fwd'])} | {_ms(stock['bwd'])} |",
                  flush=True)


# ------------------------------------------------------------------------------------------
# Exactness audit
# ------------------------------------------------------------------------------------------
def fp_neighbours(value: float, count: int, dtype: torch.dtype) -> torch.Tensor:
    """``value`` rounded to ``dtype`` and its ``count`` nearest representable neighbours each side."""
    centre = torch.tensor(value, dtype=dtype)
    up, down = [centre], [centre]
    for _ in range(count):
        up.append(torch.nextafter(up[-1], torch.tensor(math.inf, dtype=dtype)))
        down.append(torch.nextafter(down[-1], torch.tensor(-math.inf, dtype=dtype)))
    return torch.stack(down[::-1] + up[1:])


def adversarial_inputs(approximate: str, dtype: torch.dtype) -> torch.Tensor:
    """Inputs (in ``dtype``) where recovering GELU' from y is hardest or easiest to get wrong.

    A dense grid on [−12, 12]; the neighbourhood of the minimum x* (±0.02, ±3e-4, and the 300
    nearest ``dtype`` and fp32 values each side: the branch split itself); the far left tail
    down to −40 with y underflowing (fp16 below x ≈ −5.3, bf16/fp32 below ≈ −13.2/−14.2) and
    y = −0.0; x at the table's ends (LEFT_LIMIT = −5.5 and the x where y = 6); zeros of both
    signs, subnormals; huge x up to the dtype's largest finite value (y = x, GELU' = 1).
    """
    from tempo.ops.gelu import FORMS, LEFT_LIMIT

    form = FORMS[approximate]
    d64 = torch.float64
    finfo = torch.finfo(dtype)
    x_at_right_end = 6.0 + 1e-8  # GELU(6) = 6 - 6e-9: the table's right end, y = 6, is at x = 6.0000000
    parts = [
        torch.linspace(-12, 12, 100001, dtype=d64),
        form.x_star + torch.linspace(-0.02, 0.02, 4001, dtype=d64),
        form.x_star + torch.linspace(-3e-4, 3e-4, 601, dtype=d64),
        torch.linspace(-40, -5, 3501, dtype=d64),
        torch.tensor([0.0, -0.0, form.x_star, LEFT_LIMIT, x_at_right_end, 1e4, -1e4, finfo.tiny, -finfo.tiny,
                      finfo.max, finfo.max / 2, -finfo.max], dtype=d64),
    ]
    x = torch.cat([p.to(dtype) for p in parts] + [
        fp_neighbours(form.x_star, 300, dtype),
        fp_neighbours(form.x_star, 300, torch.float32).to(dtype),
        fp_neighbours(LEFT_LIMIT, 20, dtype),
        fp_neighbours(x_at_right_end, 20, dtype),
        fp_neighbours(0.0, 20, dtype),  # subnormals of both signs
    ])
    return x


def exact_gelu(x: torch.Tensor, approximate: str) -> torch.Tensor:
    """fp64 GELU without the cancellation of 1 + erf / 1 + tanh on the left."""
    x = x.double()
    if approximate == "tanh":
        return x * torch.sigmoid(2 * math.sqrt(2 / math.pi) * (x + 0.044715 * x**3))
    return 0.5 * x * torch.special.erfc(-x / math.sqrt(2))


def exact_derivative(x: torch.Tensor, approximate: str) -> torch.Tensor:
    """fp64 GELU', accurate in the left tail too; beyond |x| = 1e6 (x³ would overflow) its
    limits, 1 on the right and 0 on the left."""
    x = x.double()
    far = x.abs() > 1e6
    x_near = torch.where(far, torch.zeros_like(x), x)
    if approximate == "tanh":
        k = math.sqrt(2 / math.pi)
        inner = k * (x_near + 0.044715 * x_near**3)
        s, s_minus = torch.sigmoid(2 * inner), torch.sigmoid(-2 * inner)  # 0.5 (1 ± tanh)
        slope = s + 2 * x_near * s * s_minus * k * (1 + 3 * 0.044715 * x_near**2)
    else:
        slope = (0.5 * torch.special.erfc(-x_near / 2**0.5)
                 + x_near * torch.exp(-0.5 * x_near * x_near) / (2 * torch.pi) ** 0.5)
    return torch.where(far, (x > 0).double(), slope)


def inverse_on_branch(y: torch.Tensor, left: torch.Tensor, approximate: str, steps: int = 64) -> torch.Tensor:
    """x with GELU(x) = y (fp64) on the branch ``left`` (x < x*) or the right one, by bisection
    over [−40, x*] / [x*, max(y, 0) + 1] (64 halvings of at most 40: below fp64's resolution of
    x): independent of the code under test. A y beyond the largest fp32 GELU (x ≥ 1e6) is its
    own x within 1e-300."""
    from tempo.ops.gelu import FORMS

    y = y.double()
    x_star = FORMS[approximate].x_star
    lo = torch.where(left, torch.full_like(y, -40.0), torch.full_like(y, x_star))
    hi = torch.where(left, torch.full_like(y, x_star), y.clamp(min=0.0) + 1.0)
    sign = torch.where(left, -1.0, 1.0).double()
    for _ in range(steps):
        mid = 0.5 * (lo + hi)
        below = sign * exact_gelu(mid, approximate) < sign * y
        lo = torch.where(below, mid, lo)
        hi = torch.where(below, hi, mid)
    return 0.5 * (lo + hi)


def audit_case(approximate: str, dtype: torch.dtype, path: str, device: str = "cpu") -> dict[str, float]:
    """Worst cases of one form x dtype x path over ``adversarial_inputs`` (see the module doc)."""
    from tempo.ops.bitpack import unpack_bits
    from tempo.ops.gelu import FORMS, gelu_derivative_from_output

    x = adversarial_inputs(approximate, dtype).to(device)
    # The ops autograd runs (inplace_gelu's forward, then its backward with grad 1).
    y, bits = torch.ops.tempo.inplace_gelu(x, approximate, path)
    dx = torch.ops.tempo.inplace_gelu_backward(torch.ones_like(y), y, bits, approximate, path)
    if path == "triton":  # the kernel's fp32 result: the same loads and arithmetic on an fp32 copy of y
        recovered = torch.ops.tempo.inplace_gelu_backward(torch.ones_like(y, dtype=torch.float32), y.float(),
                                                          bits, approximate, "triton").double()
    else:
        recovered = gelu_derivative_from_output(y, bits, approximate).double()
    left = unpack_bits(bits, y.shape)
    oracle = exact_derivative(inverse_on_branch(y, left, approximate), approximate)
    exact = exact_derivative(x.detach(), approximate)
    total = (dx.double() - exact).abs()
    recovery = (recovered - oracle).abs()
    x64 = x.double()
    near = (x64 - FORMS[approximate].x_star).abs() <= 0.05
    tail = x64 < -3.0
    bulk = ~near & ~tail
    worst = int(total.argmax())
    return {
        "total": total.max().item(),
        "total_at": x[worst].item(),
        "total_bulk_relative": (total[bulk] / exact[bulk].abs()).max().item(),
        "total_tail": total[tail].max().item(),
        "recovery_near": recovery[near].max().item(),
        "recovery_bulk_relative": (recovery[bulk] / oracle[bulk].abs()).max().item(),
        "recovery_tail": recovery[tail].max().item(),
        "finite": bool(torch.isfinite(dx).all() and torch.isfinite(recovered).all()),
    }


def run_audit(args: argparse.Namespace) -> None:
    print(f"Recovered GELU' against fp64 over tempo.bench.gelu_bench.adversarial_inputs; torch {torch.__version__}; "
          "near: |x - x*| <= 0.05 (absolute), bulk: the rest down to x = -3 (relative to |GELU'|), "
          "tail: x < -3 (absolute, |GELU'| < 1.2e-2)")
    print("| form | dtype | path | total: max (at x) | total: bulk rel, tail abs "
          "| recovery: near abs, bulk rel, tail abs |")
    print("|---|---|---|---|---|---|")
    for approximate in args.forms:
        for dtype_name in args.dtypes:
            for path in args.paths:
                r = audit_case(approximate, DTYPES[dtype_name], path)
                print(f"| {approximate} | {dtype_name} | {path} | {r['total']:.2e} ({r['total_at']:.6g}) "
                      f"| {r['total_bulk_relative']:.1e}, {r['total_tail']:.1e} "
                      f"| {r['recovery_near']:.1e}, {r['recovery_bulk_relative']:.1e}, {r['recovery_tail']:.1e} |"
                      + ("" if r["finite"] else " NON-FINITE"), flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tempo.bench.gelu_bench", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    timing = sub.add_parser("time", help="forward + backward vs nn.GELU on the CPU (reference path)")
    timing.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    timing.add_argument("--dtypes", nargs="+", choices=sorted(DTYPES), default=["fp32", "bf16"])
    timing.add_argument("--approximate", choices=["none", "tanh"], default="none")
    timing.add_argument("--repeats", type=int, default=9)
    timing.add_argument("--warmup", type=int, default=3)
    timing.add_argument("--shape", type=int, nargs="+", default=list(SHAPE))
    audit = sub.add_parser("audit", help="worst-case derivative error per form x dtype x path")
    audit.add_argument("--forms", nargs="+", choices=["none", "tanh"], default=["none", "tanh"])
    audit.add_argument("--dtypes", nargs="+", choices=list(DTYPES), default=list(DTYPES))
    audit.add_argument("--paths", nargs="+", choices=["reference", "triton"], default=["reference", "triton"])
    args = parser.parse_args(argv)
    if args.command == "time":
        if args.repeats < 5 or args.warmup < 1:
            parser.error("--repeats must be >= 5 and --warmup >= 1")
        run_timing(args)
    else:
        run_audit(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
