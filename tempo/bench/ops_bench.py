"""``python -m tempo.bench ops``: each Tempo layer alone vs eager PyTorch and torch.compile.

Shapes (``--shapes bert-large``, default; B=8, L=512, bf16): GELU on [B·L, 4096], LayerNorm on
[B·L, 1024], Combined on scores [B, 16, L, L] and values [B, 16, L, 64]. ``--shapes tiny``
(B=2, L=32, hidden 64, 2 heads) runs anywhere in seconds, for tests on the CPU.

Out of cache: at B=8 an input is 8-64 MB, which an H100's 50 MB L2 partly holds, so a timed
loop would measure L2, not HBM. Each op's batch B is therefore raised (a multiple of the named
B) until its first input holds at least ``--min-input-bytes`` (default on CUDA: 2x the GPU's L2
cache; on the CPU: no minimum). Each row records its batch, its input bytes and the rule.

Implementations: "tempo" (the Tempo layer; Triton on CUDA, the reference path elsewhere),
"eager" (nn.GELU / nn.LayerNorm / matmul(dropout(softmax(x)), v)), "compiled" (torch.compile
of the eager one; --no-compile leaves it out). Modes: fwd, bwd (graph built untimed), both.

Achieved GB/s = bytes the op must move / time, with the same byte count for every
implementation (so a higher GB/s is simply faster), e = element size, N = elements of x:
  GELU       fwd: read x, write y = 2·N·e           bwd: read grad_y and x (or y), write grad_x = 3·N·e
  LayerNorm  fwd: read x, write y = 2·N·e           bwd: read grad_y and y (or x), write grad_x = 3·N·e
             (per-row statistics and the weight/bias vectors are < 0.2% and left out)
  Combined   P = elements of the scores, V = elements of v (= of the output):
             fwd: read x, write softmax s, read v, write out = (2P + 2V)·e
             bwd: read grad_out, s and v, write grad_x and grad_v = (2P + 3V)·e
"both" moves the sum. The ceiling is the measured device-to-device copy bandwidth (read+write,
hardware.measure_copy_bandwidth) of a buffer the size of the op's first input, measured once per
op; "of copy" is GB/s / that figure. The record also keeps one copy figure at a fixed size
(256 MiB on CUDA) as ``copy_bandwidth_gb_per_s``.
"""

from __future__ import annotations

import argparse
import math
from typing import Any

import torch
from torch import nn

from tempo.bench.timing import on_device, spread, time_fn
from tempo.utils import non_negative_int, positive_int

SHAPES = {"bert-large": dict(batch=8, seq=512, hidden=1024, intermediate=4096, heads=16, head_dim=64),
          "tiny": dict(batch=2, seq=32, hidden=64, intermediate=256, heads=2, head_dim=32)}
OPS = ("gelu", "layernorm", "combined")
IMPLS = ("tempo", "eager", "compiled")
MODES = ("fwd", "bwd", "both")


class EagerCombined(nn.Module):
    def __init__(self, p: float = 0.1):
        super().__init__()
        self.dropout = nn.Dropout(p)

    def forward(self, x: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return torch.matmul(self.dropout(torch.softmax(x, dim=-1)), v)


def make_op(op: str, impl: str, shape: dict[str, int], dtype: torch.dtype, device: str) -> nn.Module:
    if op == "gelu":
        if impl == "tempo":
            from tempo.inplace_gelu import InplaceGelu  # not merged yet in some checkouts

            module: nn.Module = InplaceGelu()
        else:
            module = nn.GELU()
    elif op == "layernorm":
        if impl == "tempo":
            from tempo.inplace_layernorm import InplaceLayerNorm

            module = InplaceLayerNorm(shape["hidden"], eps=1e-12)
        else:
            module = nn.LayerNorm(shape["hidden"], eps=1e-12)
    elif op == "combined":
        if impl == "tempo":
            from tempo.combined import Combined

            module = Combined(dim=-1, p=0.1)
        else:
            module = EagerCombined(0.1)
    else:
        raise ValueError(op)
    module = module.to(device=device, dtype=dtype).train()
    return torch.compile(module) if impl == "compiled" else module


def op_inputs(op: str, shape: dict[str, int], dtype: torch.dtype, device: str) -> list[torch.Tensor]:
    rows = shape["batch"] * shape["seq"]
    if op == "gelu":
        return [torch.randn(rows, shape["intermediate"], device=device, dtype=dtype)]
    if op == "layernorm":
        return [torch.randn(rows, shape["hidden"], device=device, dtype=dtype)]
    b, h, s, d = shape["batch"], shape["heads"], shape["seq"], shape["head_dim"]
    return [torch.randn(b, h, s, s, device=device, dtype=dtype), torch.randn(b, h, s, d, device=device, dtype=dtype)]


def input_bytes(op: str, shape: dict[str, int], dtype: torch.dtype) -> int:
    """Bytes of the op's first input (x, or the scores for Combined) at ``shape``."""
    e = torch.empty((), dtype=dtype).element_size()
    rows = shape["batch"] * shape["seq"]
    if op == "gelu":
        return rows * shape["intermediate"] * e
    if op == "layernorm":
        return rows * shape["hidden"] * e
    return shape["batch"] * shape["heads"] * shape["seq"] * shape["seq"] * e


def scaled_shape(op: str, shape: dict[str, int], dtype: torch.dtype, min_bytes: int) -> dict[str, int]:
    """``shape`` with its batch multiplied (by the smallest integer) so the input holds >= min_bytes."""
    have = input_bytes(op, shape, dtype)
    factor = max(1, math.ceil(min_bytes / have)) if min_bytes > 0 else 1
    return {**shape, "batch": shape["batch"] * factor}


def bytes_moved(op: str, mode: str, inputs: list[torch.Tensor]) -> int:
    """The documented minimum traffic (module docstring)."""
    e = inputs[0].element_size()
    if op in ("gelu", "layernorm"):
        n = inputs[0].numel()
        fwd, bwd = 2 * n * e, 3 * n * e
    else:
        p, v = inputs[0].numel(), inputs[1].numel()
        fwd, bwd = (2 * p + 2 * v) * e, (2 * p + 3 * v) * e
    return {"fwd": fwd, "bwd": bwd, "both": fwd + bwd}[mode]


def bench_op(op: str, impl: str, shape: dict[str, int], dtype: torch.dtype, device: str,
             modes: tuple[str, ...], warmup: int, repeats: int) -> dict[str, Any]:
    torch.manual_seed(0)
    module = make_op(op, impl, shape, dtype, device)
    bases = op_inputs(op, shape, dtype, device)
    state: dict[str, Any] = {}

    def fresh() -> None:
        leaves = [b.clone().requires_grad_() for b in bases]
        # In-place ops may not write into a leaf: give them an intermediate, as in a real model.
        state["leaves"], state["inputs"] = leaves, [t * 1 for t in leaves]

    def forward() -> None:
        state["out"] = module(*state["inputs"])

    def backward() -> None:
        state["out"].backward(state["grad"])

    fresh()
    forward()
    state["grad"] = torch.randn_like(state["out"])
    result: dict[str, Any] = {"op": op, "impl": impl, "shapes": [list(b.shape) for b in bases], "dtype": str(dtype)}
    for mode in modes:
        if mode == "fwd":
            times = time_fn(forward, device, warmup, repeats, setup=fresh)
        elif mode == "bwd":
            times = time_fn(backward, device, warmup, repeats, setup=lambda: (fresh(), forward()))
        else:
            times = time_fn(lambda: (forward(), backward()), device, warmup, repeats, setup=fresh)
        ms = spread(times)
        moved = bytes_moved(op, mode, bases)
        result[mode] = {"ms": ms, "raw_ms": times, "bytes": moved, "gb_per_s": moved / (ms["p50"] / 1000) / 1e9}
    state.clear()
    return result


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--shapes", choices=sorted(SHAPES), default="bert-large")
    p.add_argument("--ops", default=",".join(OPS), help=f"comma list of {','.join(OPS)}")
    p.add_argument("--no-compile", action="store_true", help="leave out the torch.compile column")
    p.add_argument("--modes", default=",".join(MODES), help="comma list of fwd,bwd,both")
    p.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default="bf16")
    p.add_argument("--device", default=None)
    p.add_argument("--min-input-bytes", type=_bytes_arg, default=None,
                   help="raise each op's batch until its input holds this many bytes, e.g. 100MB "
                        "(default: 2x the L2 cache on CUDA, 0 on the CPU)")
    p.add_argument("--warmup", type=non_negative_int, default=5)
    p.add_argument("--repeats", type=positive_int, default=30)
    p.add_argument("--out", default=None, help="JSON output file")


def _bytes_arg(text: str) -> int:
    from tempo.utils import parse_bytes

    try:
        value = parse_bytes(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if value is None or value < 0:
        raise argparse.ArgumentTypeError(f"must be a size >= 0, got {text!r}")
    return value


def main(args: argparse.Namespace) -> int:
    from tempo.bench.common import BenchError
    from tempo.bench.hardware import bench_device

    try:
        device = bench_device(args.device)  # "cuda" becomes the current GPU's "cuda:N"
    except ValueError as exc:
        raise BenchError(str(exc)) from None
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    ops = [o.strip() for o in args.ops.split(",") if o.strip()]
    modes = tuple(m.strip() for m in args.modes.split(",") if m.strip())
    bad = (set(ops) - set(OPS)) | (set(modes) - set(MODES))
    if bad:
        raise BenchError(f"unknown ops/modes {sorted(bad)}")
    impls = [i for i in IMPLS if not (args.no_compile and i == "compiled")]
    # Everything below runs with the benchmark's GPU current (tempo.bench.timing.on_device): the
    # modules, inputs, torch.compile's kernels and the timing events all on that device.
    with on_device(device):
        return _run(args, device, ops, modes, impls, dtype)


def _run(args: argparse.Namespace, device: torch.device, ops: list[str], modes: tuple[str, ...],
         impls: list[str], dtype: torch.dtype) -> int:
    from tempo.bench.common import BenchError
    from tempo.bench.hardware import environment, l2_cache_bytes, measure_copy_bandwidth
    from tempo.bench.results import write_json

    on_cuda = device.type == "cuda"
    shape = SHAPES[args.shapes]
    l2 = l2_cache_bytes(device)
    if args.min_input_bytes is not None:
        min_bytes, rule = args.min_input_bytes, "--min-input-bytes"
    elif on_cuda:
        if l2 is None:
            raise BenchError("this torch does not report the GPU's L2 cache size; pass --min-input-bytes "
                             "(e.g. 2x the L2 size)")
        min_bytes, rule = 2 * l2, "2x L2"
    else:
        min_bytes, rule = 0, "none (CPU)"
    copy_gbps = measure_copy_bandwidth(device, nbytes=(256 << 20) if on_cuda else (16 << 20),
                                       repeats=10 if on_cuda else 3)
    print(f"device-to-device copy: {copy_gbps:.1f} GB/s (read + write, 256 MiB)" if on_cuda else
          f"device-to-device copy: {copy_gbps:.1f} GB/s (read + write, 16 MiB)")
    rows = []
    for op in ops:
        op_shape = scaled_shape(op, shape, dtype, min_bytes)
        nbytes = input_bytes(op, op_shape, dtype)
        # The ceiling for this op: a copy of a buffer as large as its input (same cache regime).
        op_copy_gbps = measure_copy_bandwidth(device, nbytes=nbytes, repeats=10 if on_cuda else 3)
        print(f"{op}: batch {op_shape['batch']}, input {nbytes / 1e6:.1f} MB, copy of that size "
              f"{op_copy_gbps:.1f} GB/s", flush=True)
        for impl in impls:
            try:
                row = bench_op(op, impl, op_shape, dtype, str(device), modes, args.warmup, args.repeats)
                row["status"] = "ok"
                for mode in modes:
                    row[mode]["of_copy_bandwidth"] = row[mode]["gb_per_s"] / op_copy_gbps
            except torch.OutOfMemoryError as exc:
                row = {"op": op, "impl": impl, "status": "oom", "message": str(exc).strip().splitlines()[0]}
                torch.cuda.empty_cache()
            except (ImportError, RuntimeError) as exc:
                row = {"op": op, "impl": impl, "status": "skipped",
                       "message": str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__}
            row.update(batch=op_shape["batch"], input_bytes=nbytes, copy_gb_per_s=op_copy_gbps)
            rows.append(row)
            print(_format_row(row, modes), flush=True)
    record = {"kind": "ops", "env": environment(device), "shapes": args.shapes, "shape": shape, "dtype": args.dtype,
              "min_input_bytes": min_bytes, "min_input_rule": rule, "l2_cache_bytes": l2,
              "copy_bandwidth_gb_per_s": copy_gbps, "modes": list(modes), "rows": rows}
    if args.out:
        write_json(args.out, record)
    return 0


def _format_row(row: dict[str, Any], modes: tuple[str, ...]) -> str:
    head = f"{row['op']:<10} {row['impl']:<9}"
    if row["status"] != "ok":
        return f"{head} {row['status']}: {row.get('message', '')}"
    return head + "  ".join(
        f" {m} {row[m]['ms']['p20']:.3f}/{row[m]['ms']['p50']:.3f}/{row[m]['ms']['p80']:.3f} ms "
        f"{row[m]['gb_per_s']:.1f} GB/s ({row[m]['of_copy_bandwidth']:.0%})" for m in modes)
