"""Compile gate for the Triton kernels, without a GPU: ``python -m tempo.ops.compile_check``.

The interpreter (how CI runs the kernels on the CPU) never compiles them, so a kernel that would
fail to compile, or spill registers, for a real GPU passes every CPU test. This gate

  1. records every Triton kernel launch the layers make at real row widths: a child process
     runs each op's forward and backward under the interpreter (``TRITON_INTERPRET=1``) with
     tiny row counts while ``LaunchRecorder`` wraps the launch entry point (the ``run`` method
     ``kernel[grid](...)`` calls), capturing the kernel, its arguments as the GPU launcher
     specializes them (pointer dtype and 16-byte alignment; integer width, divisibility by 16
     and the value 1; floats; constexpr values) and num_warps / num_stages, deduplicated;
  2. compiles each unique launch in child processes *without* the interpreter, through the same
     binder the GPU launcher uses (so the signature, constexprs and divisibility attributes are
     what a GPU run would compile), with ``triton.compile(ASTSource(...), target=GPUTarget("cuda",
     cap, 32), options={"num_warps": ...})`` for sm_80 and sm_90, then runs the ptxas bundled in
     the triton wheel with ``-v`` on the PTX for registers and spill bytes (the same counts as
     the cubin triton builds, checked with cuobjdump), and reads shared memory from the
     compiled metadata. A compiler crash is isolated to its own process and reported as that
     launch's compile error.

It prints one row per (kernel, config, arch), writes the rows as JSON with ``--json PATH``, and
exits 1 with one line per offending kernel on a compile error or spill stores above the allowed
bytes (``--max-spill-bytes``, default 0, no per-kernel allowances). Kernels defined in
``tempo.ops`` that no workload launched are listed (not an error: an op without a workload here
is not compiled, which the output says).

Ops covered: LayerNorm (h = 1024, 4096, 16384; fp32/fp16/bf16; with/without affine; fp32 input
with a bf16 output as under autocast), GELU (both forms when ``inplace_gelu`` takes
``approximate``), Combined (softmax rows 128, 384, 512, the longest single-pass row and the
longest Triton row; dropout on/off; autocast dtypes) and ``tempo.ops.dropout_add_layernorm`` at
h = 1024, 4096 when that module exists (skipped, with a printed line, when it does not), and
DeBERTa's disentangled attention (``tempo.ops.disentangled_attention``: S = 512, head dim 64,
span 256 with log buckets, S = 64, which compiles the kernels S = 512 runs; padded with a mask
and varlen; fp32/fp16/bf16; c2p+p2c, c2p only, p2c only, content only; dropout on/off; its
forward, both backward kernels and the keep-mask kernel), the gated MLP (``tempo.ops.gated_mlp``:
I = 3072 and an odd fused 2 × 1001; SiLU, exact and tanh GELU; dropout on/off; fp32/fp16/bf16), and
RMSNorm (``tempo.ops.rmsnorm``: h = 1024, 4096, 16384; fp32/fp16/bf16; w and 1 + w; with and
without kept columns, and without a weight; a bf16 input with fp32 weights, output fp32 or bf16),
and the seeded dropout (``tempo.ops.dropout``: fp32/fp16/bf16), and the fused head's two row kernels
(``tempo.ops.linear_cross_entropy``: fp32/fp16/bf16, softcap on/off).
About 100 s on 2 cores with an empty triton cache (300 compiles).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import inspect
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable, Iterable, Optional

ARCHES = (80, 90)
DEFAULT_MAX_SPILL_BYTES = 0
# Per-kernel spill allowances in bytes, keyed by kernel name: none needed today. An entry needs
# a comment saying why the spill cannot be removed.
SPILL_ALLOWANCE: dict[str, int] = {}

_INTERP = "TRITON_INTERPRET"


# ------------------------------------------------------------------------------------------------
# Recording launches
# ------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Launch:
    """One kernel launch as the GPU launcher would specialize it (JSON-serialisable, hashable)."""

    module: str
    qualname: str
    # (name, kind, value): kind "ptr" (value: [torch dtype name, 16-byte aligned]), "int" (value:
    # a representative integer with the same specialization), "float", "bool", "none", or
    # "constexpr" (value: the constexpr, tl dtypes as {"tl_dtype": name}).
    args: tuple
    num_warps: Optional[int]
    num_stages: Optional[int]

    def to_json(self) -> dict:
        return {"module": self.module, "qualname": self.qualname, "args": [list(a) for a in self.args],
                "num_warps": self.num_warps, "num_stages": self.num_stages}

    @staticmethod
    def from_json(d: dict) -> "Launch":
        return Launch(d["module"], d["qualname"], tuple(_freeze(a) for a in d["args"]), d["num_warps"],
                      d["num_stages"])

    @property
    def config(self) -> str:
        """Short label: constexprs, pointer dtypes in argument order, integer specializations."""
        consts, ptrs, ints = [], [], []
        for name, kind, value in self.args:
            if kind == "constexpr":
                v = value.get("tl_dtype") if isinstance(value, dict) else value
                consts.append(f"{name}={int(v) if isinstance(v, bool) else v}")
            elif kind == "ptr":
                short = _SHORT_DTYPE.get(value[0], value[0]) + ("" if value[1] else "!unaligned")
                if ptrs and ptrs[-1][0] == short:
                    ptrs[-1][1] += 1
                else:
                    ptrs.append([short, 1])
            elif kind == "int":
                ints.append(_int_code(value))
        ptr_text = ",".join(d if n == 1 else f"{d}x{n}" for d, n in ptrs)
        return f"{' '.join(consts)} ptr:{ptr_text} int:{''.join(ints)}"


_SHORT_DTYPE = {"float32": "f32", "float16": "f16", "bfloat16": "bf16", "float64": "f64", "uint8": "u8",
                "int8": "i8", "int16": "i16", "int32": "i32", "int64": "i64", "bool": "b1"}


def _freeze(x):
    if isinstance(x, list):
        return tuple(_freeze(i) for i in x)
    if isinstance(x, dict):
        return x  # constexpr tl dtype marker; compared through json in dedup keys
    return x


def _int_code(v: int) -> str:
    """D: divisible by 16, 1: the value 1 (a constexpr on GPU), _: neither; L: 64-bit."""
    code = "1" if v == 1 else ("D" if v % 16 == 0 else "_")
    return code + ("" if -(2**31) <= v < 2**31 else "L")


def _representative_int(v: int) -> int:
    """An integer the GPU launcher specializes exactly like ``v`` (width, %16, == 1)."""
    if v == 1:
        return 1
    if -(2**31) <= v < 2**31:
        base = 16
    elif v >= 2**63:
        base = 2**63 + 16
    else:
        base = 2**40
    return base if v % 16 == 0 else base + 1


def _is_constexpr_annotation(annotation: Any) -> bool:
    # Covers tl.constexpr itself and string annotations ("tl.constexpr") under
    # `from __future__ import annotations`.
    if annotation is inspect.Parameter.empty:
        return False
    text = annotation if isinstance(annotation, str) else getattr(annotation, "__name__", str(annotation))
    return "constexpr" in text


def _describe_arg(name: str, value: Any, constexpr: bool) -> tuple:
    if constexpr:
        if value.__class__.__name__ == "dtype" and value.__class__.__module__.startswith("triton"):
            return (name, "constexpr", {"tl_dtype": str(value)})
        if hasattr(value, "value") and value.__class__.__name__ == "constexpr":
            value = value.value
        return (name, "constexpr", value)
    if hasattr(value, "data_ptr") and hasattr(value, "dtype"):
        dtype = str(value.dtype).replace("torch.", "")
        return (name, "ptr", (dtype, value.data_ptr() % 16 == 0))
    if value is None:
        return (name, "none", None)
    if isinstance(value, bool):
        return (name, "bool", value)
    if isinstance(value, int):
        return (name, "int", _representative_int(value))
    if isinstance(value, float):
        return (name, "float", None)
    raise TypeError(f"compile_check: cannot describe argument {name!r} of type {type(value).__name__}")


def _launch_from_call(kernel: Any, args: tuple, kwargs: dict) -> Launch:
    fn = kernel.fn
    params = inspect.signature(fn).parameters
    bound = inspect.signature(fn).bind_partial(*args, **{k: v for k, v in kwargs.items() if k in params})
    bound.apply_defaults()
    described = tuple(
        _describe_arg(name, bound.arguments.get(name), _is_constexpr_annotation(p.annotation))
        for name, p in params.items())
    return Launch(fn.__module__, fn.__qualname__, described, kwargs.get("num_warps"), kwargs.get("num_stages"))


class LaunchRecorder:
    """Records every Triton kernel launch made inside the block, deduplicated, in launch order.

    Wraps the ``run`` method that ``kernel[grid](...)`` calls: the interpreter's
    ``InterpretedFunction.run`` under ``TRITON_INTERPRET=1``, else ``JITFunction.run``. The op
    files are not touched.
    """

    def __init__(self) -> None:
        self.launches: list[Launch] = []
        self._keys: set[str] = set()
        self._cls: Any = None
        self._original: Any = None

    def __enter__(self) -> "LaunchRecorder":
        from tempo.ops._backend import triton_interpreting

        if triton_interpreting():
            from triton.runtime.interpreter import InterpretedFunction as cls
        else:
            from triton.runtime.jit import JITFunction as cls
        original = cls.run
        recorder = self

        def run(kernel, *args, grid, warmup, **kwargs):
            recorder.add(_launch_from_call(kernel, args, kwargs))
            return original(kernel, *args, grid=grid, warmup=warmup, **kwargs)

        self._cls, self._original = cls, original
        cls.run = run
        return self

    def __exit__(self, *exc) -> None:
        self._cls.run = self._original

    def add(self, launch: Launch) -> None:
        key = json.dumps(launch.to_json(), sort_keys=True, default=str)
        if key not in self._keys:
            self._keys.add(key)
            self.launches.append(launch)


# ------------------------------------------------------------------------------------------------
# Workloads: each op forward + backward at real row widths, tiny row counts
# ------------------------------------------------------------------------------------------------
def _backward(out, *inputs) -> None:
    import torch

    grads = torch.autograd.grad(out, [t for t in inputs if t is not None and t.requires_grad],
                                torch.randn_like(out), allow_unused=True)
    del grads


def _affine(h: int, kept: bool):
    """γ = 1, β = 0; with ``kept``, every 97th γ is 0 under β = 1: those columns' x̂ cannot be
    recovered from y, so the forward keeps them and both kernels take their HAS_KEPT branch."""
    import torch

    w, b = torch.ones(h), torch.zeros(h)
    if kept:
        w[::97], b[::97] = 0.0, 1.0
    return w.requires_grad_(), b.requires_grad_()


def _layernorm_workload(log: Callable[[str], None]) -> None:
    import torch

    from tempo.ops.layernorm import inplace_layernorm

    for h in (1024, 4096, 16384):
        for dtype in (torch.float32, torch.float16, torch.bfloat16):
            for affine, kept in ((True, False), (True, True), (False, False)):
                # 16 rows: several rows per backward program, as on a GPU at real batch sizes.
                x = torch.randn(16, h, dtype=dtype, requires_grad=True)
                w, b = _affine(h, kept) if affine else (None, None)
                _backward(inplace_layernorm(x, h, w, b), x, w, b)
        # Under autocast a fp32 residual sum is normalised into a bf16 output.
        for kept in (False, True):
            x = torch.randn(16, h, requires_grad=True)
            w, b = _affine(h, kept)
            _backward(inplace_layernorm(x, h, w, b, out_dtype=torch.bfloat16), x, w, b)
    log("layernorm: h = 1024, 4096, 16384; with and without kept columns")


def _gelu_workload(log: Callable[[str], None]) -> None:
    import torch

    from tempo.ops.gelu import inplace_gelu

    forms = [{}]
    if "approximate" in inspect.signature(inplace_gelu).parameters:
        forms = [{"approximate": "none"}, {"approximate": "tanh"}]
    for kwargs in forms:
        for dtype in (torch.float32, torch.float16, torch.bfloat16):
            for n in (4 * 4096, 3 * 1000 + 1):  # divisible by 16 and not
                x = torch.randn(n, dtype=dtype, requires_grad=True)
                _backward(inplace_gelu(x, **kwargs), x)
    log(f"gelu: forms {[k.get('approximate', 'exact') for k in forms]}")


def _combined_workload(log: Callable[[str], None]) -> None:
    import torch

    from tempo.ops.combined import (
        MAX_TRITON_ROW,
        SINGLE_PASS_MAX,
        combined_softmax_dropout_matmul,
        dropout_keep_mask,
    )

    # BERT's 128/384/512, the longest row held in registers, the longest Triton row (chunked).
    lengths = (128, 384, 512, SINGLE_PASS_MAX, MAX_TRITON_ROW)
    for s in lengths:
        for dtype in (torch.float32, torch.float16, torch.bfloat16):
            for p in (0.0, 0.1):
                x = torch.randn(1, 1, 2, s, dtype=dtype, requires_grad=True)
                v = torch.randn(1, 1, s, 8, dtype=dtype, requires_grad=True)
                _backward(combined_softmax_dropout_matmul(x, v, -1, p, True), x, v)
        # Autocast: fp32 scores (bf16 matmul + fp32 mask), softmax stored in bf16, bf16 v.
        x = torch.randn(1, 1, 2, s, requires_grad=True)
        v = torch.randn(1, 1, s, 8, dtype=torch.bfloat16, requires_grad=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = combined_softmax_dropout_matmul(x, v, -1, 0.1, True)
        _backward(out, x, v)
        dropout_keep_mask(torch.tensor(1), (2, s), 0.1, "cpu", "triton")
    log(f"combined: softmax rows {lengths}")


def _dropout_add_layernorm_workload(log: Callable[[str], None]) -> None:
    import torch

    try:
        module = importlib.import_module("tempo.ops.dropout_add_layernorm")
    except ModuleNotFoundError as err:
        if err.name != "tempo.ops.dropout_add_layernorm":
            raise  # the module exists but imports something missing: a real failure
        log("dropout_add_layernorm: skipped, tempo.ops.dropout_add_layernorm does not exist")
        return
    op = module.dropout_add_layernorm
    for h in (1024, 4096):
        for dtype in (torch.float32, torch.float16, torch.bfloat16):
            for p, training in ((0.1, True), (0.0, False)):
                x = torch.randn(16, h, dtype=dtype, requires_grad=True)
                residual = torch.randn(16, h, dtype=dtype, requires_grad=True)
                for kept in (False, True):
                    w, b = _affine(h, kept)
                    out = op(x, residual, (h,), w, b, 1e-12, p, training)
                    _backward(out if isinstance(out, torch.Tensor) else out[0], x, residual, w, b)
    keep_mask = getattr(module, "dropout_add_layernorm_keep_mask", None)
    if keep_mask is not None:
        keep_mask(torch.tensor(1), (16, 1024), 0.1, "cpu", "triton")
    log("dropout_add_layernorm: h = 1024, 4096; with and without kept columns")


def _disentangled_attention_workload(log: Callable[[str], None]) -> None:
    import torch

    from tempo.ops.disentangled_attention import (
        disentangled_attention,
        disentangled_attention_keep_mask,
        disentangled_attention_varlen,
    )

    # DeBERTa-v3: head dim 64, span = position_buckets = 256, max_relative_positions 512. The
    # sequence length only enters the kernels as runtime ints, which a launch specializes by
    # divisibility by 16 alone: S = 64 compiles exactly the kernels S = 512 runs (one interpreted
    # S = 512 call takes ~30 s; this whole workload ~30 s). One head, one padded sequence with a
    # mask, or three packed ones (64, 17, 33 tokens).
    s, d, span = 64, 64, 256
    geometry = dict(span=span, position_buckets=256, max_relative_positions=512, scale=1.0 / (64 * 3) ** 0.5)
    cu = torch.tensor([0, 64, 64 + 17, 64 + 17 + 33], dtype=torch.int32)
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        for c2p, p2c in ((True, True), (True, False), (False, True), (False, False)):
            for p in (0.0, 0.1):
                kp = torch.randn(2 * span, 1, d, dtype=dtype, requires_grad=True) if c2p else None
                qp = torch.randn(2 * span, 1, d, dtype=dtype, requires_grad=True) if p2c else None
                q, k, v = (torch.randn(1, s, 1, d, dtype=dtype, requires_grad=True) for _ in range(3))
                mask = torch.ones(1, s, dtype=torch.bool)
                mask[:, 50:] = False
                _backward(disentangled_attention(q, k, v, kp, qp, padding_mask=mask, dropout_p=p, **geometry),
                          q, k, v, kp, qp)
                t = int(cu[-1])
                q, k, v = (torch.randn(t, 1, d, dtype=dtype, requires_grad=True) for _ in range(3))
                _backward(disentangled_attention_varlen(q, k, v, cu, s, kp, qp, dropout_p=p, **geometry),
                          q, k, v, kp, qp)
    disentangled_attention_keep_mask(torch.tensor(1), 1, 1, 64, 0.1, backend="triton")
    log("disentangled_attention: D = 64, span = 256 (log buckets), S = 64 (compiles as S = 512); padded with a "
        "mask and varlen; fp32/fp16/bf16; c2p+p2c, c2p, p2c, content only; dropout on/off")


def _gated_mlp_workload(log: Callable[[str], None]) -> None:
    import torch

    from tempo.ops.gated_mlp import gated_linear, gated_linear_fused, gated_mlp_keep_mask

    # The kernels see I only as a runtime int (specialized by divisibility by 16) and row strides:
    # I = 3072 (BERT-base-sized MLPs, Llama-style I's are all multiples of 16) compiles what every
    # real width runs; I = 1001 the unaligned second half of an odd fused projection. bf16 (the
    # training dtype): every activation with and without dropout; fp32/fp16: every activation with it.
    width = 3072
    cases = [(torch.bfloat16, act, p) for act in ("silu", "gelu", "gelu_tanh") for p in (0.0, 0.1)]
    cases += [(dtype, act, 0.1) for dtype in (torch.float32, torch.float16) for act in ("silu", "gelu", "gelu_tanh")]
    for dtype, act, p in cases:
        gate, up = (torch.randn(2, width, dtype=dtype, requires_grad=True) for _ in range(2))
        w = torch.randn(16, width, dtype=dtype, requires_grad=True)
        _backward(gated_linear(gate, up, w, None, act, p=p), gate, up, w)
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        h = torch.randn(2, 2 * 1001, dtype=dtype, requires_grad=True)
        w = torch.randn(16, 1001, dtype=dtype, requires_grad=True)
        _backward(gated_linear_fused(h, w, None, "silu", gate_first=False, p=0.1), h, w)
    # Without a weight (a LoRA-wrapped down projection): the backward writes no product.
    gate, up = (torch.randn(2, width, dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    _backward(gated_linear(gate, up, None, activation="silu", p=0.1), gate, up)
    # fp32 gate and up under bf16 autocast: the product stored in bf16 for the projection.
    gate, up = (torch.randn(2, width, requires_grad=True) for _ in range(2))
    w = torch.randn(16, width, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = gated_linear(gate, up, w, None, "gelu")
    _backward(out, gate, up, w)
    gated_mlp_keep_mask(torch.tensor(1), 2, width, 0.1, "cpu", "triton")
    log(f"gated_mlp: I = {width} and 1001 (fused, unaligned halves); silu/gelu/gelu_tanh; dropout on/off; "
        "fp32/fp16/bf16, fp32 under bf16 autocast; with and without a weight")


def _rmsnorm_workload(log: Callable[[str], None]) -> None:
    import torch

    from tempo.ops.rmsnorm import inplace_rmsnorm

    def weight(h, dtype, kept, unit_offset):
        w = torch.zeros(h, dtype=dtype) if unit_offset else torch.ones(h, dtype=dtype)
        if kept:  # every 97th w_eff is 0: those columns' x̂ are kept, both kernels take HAS_KEPT
            w[::97] = -1.0 if unit_offset else 0.0
        return w.requires_grad_()

    for h in (1024, 4096, 16384):
        for dtype in (torch.float32, torch.float16, torch.bfloat16):
            # (weight, kept, unit_offset): Llama's w, with kept columns, Gemma's 1 + w (fp32 w_eff in
            # backward), no weight.
            for has_weight, kept, unit_offset in ((True, False, False), (True, True, False), (True, True, True),
                                                  (False, False, False)):
                x = torch.randn(16, h, dtype=dtype, requires_grad=True)
                w = weight(h, dtype, kept, unit_offset) if has_weight else None
                _backward(inplace_rmsnorm(x, h, w, unit_offset=unit_offset), x, w)
        # Under autocast (fp32 weights): a bf16 input (q/k norms of an autocast projection), output
        # fp32 (Llama's promotion) or bf16 (Gemma's input dtype).
        for out_dtype, unit_offset in ((torch.float32, False), (torch.bfloat16, True)):
            x = torch.randn(16, h, dtype=torch.bfloat16, requires_grad=True)
            w = weight(h, torch.float32, True, unit_offset)
            _backward(inplace_rmsnorm(x, h, w, unit_offset=unit_offset, out_dtype=out_dtype), x, w)
    log("rmsnorm: h = 1024, 4096, 16384; w and 1 + w; with and without kept columns; no weight")


def _seeded_dropout_workload(log: Callable[[str], None]) -> None:
    import torch

    from tempo.ops.dropout import seeded_dropout, seeded_dropout_keep_mask

    # One element-wise kernel, forward and backward alike; numel is a runtime int (specialized by
    # divisibility by 16): 4096 (any real [tokens, h]) and an odd 4097.
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        for numel in (4096, 4097):
            x = torch.randn(numel, dtype=dtype, requires_grad=True)
            _backward(seeded_dropout(x, 0.1), x)
    seeded_dropout_keep_mask(torch.tensor(1), (16, 64), 0.1, "cpu", "triton")
    log("seeded_dropout: fp32/fp16/bf16; 4096 and 4097 elements")


def _linear_cross_entropy_workload(log: Callable[[str], None]) -> None:
    import torch

    from tempo.ops.linear_cross_entropy import linear_cross_entropy

    # Two row kernels over a block of GEMM output in the GEMM's dtype (fp32, or 16 bits under autocast);
    # the block width is a runtime int (4·hidden: 4096 for h = 1024, and an odd last block), softcap on/off.
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        for softcap in (None, 30.0):
            x = torch.randn(4, 1024, requires_grad=True)
            w = torch.randn(4096 + 1001, 1024, requires_grad=True)
            with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
                loss = linear_cross_entropy(x, w, torch.tensor([0, 7, 4096, 5096]), softcap=softcap)
            _backward(loss, x, w)
    log("linear_cross_entropy: fp32/fp16/bf16; blocks of 4096 and 1001 columns; softcap on/off")


# The module each workload exercises (kernels there that no launch reached are reported).
WORKLOAD_MODULES = {"layernorm": "tempo.ops.layernorm", "gelu": "tempo.ops.gelu", "combined": "tempo.ops.combined",
                    "dropout_add_layernorm": "tempo.ops.dropout_add_layernorm",
                    "disentangled_attention": "tempo.ops.disentangled_attention", "gated_mlp": "tempo.ops.gated_mlp",
                    "rmsnorm": "tempo.ops.rmsnorm", "seeded_dropout": "tempo.ops.dropout",
                    "linear_cross_entropy": "tempo.ops.linear_cross_entropy"}

WORKLOADS: dict[str, Callable[[Callable[[str], None]], None]] = {
    "layernorm": _layernorm_workload,
    "gelu": _gelu_workload,
    "combined": _combined_workload,
    "dropout_add_layernorm": _dropout_add_layernorm_workload,
    "disentangled_attention": _disentangled_attention_workload,
    "gated_mlp": _gated_mlp_workload,
    "rmsnorm": _rmsnorm_workload,
    "seeded_dropout": _seeded_dropout_workload,
    "linear_cross_entropy": _linear_cross_entropy_workload,
}


def record(names: Iterable[str] = tuple(WORKLOADS), log: Callable[[str], None] = print) -> list[Launch]:
    """Run the workloads on the Triton backend (interpreter on CPU) and return their launches."""
    import torch

    from tempo.ops._backend import use_backend

    torch.manual_seed(0)
    with LaunchRecorder() as recorder, use_backend("triton"):
        for name in names:
            WORKLOADS[name](log)
    return recorder.launches


def defined_kernels() -> list[tuple[str, str]]:
    """(module, name) of the Triton kernels defined at module level in the tempo.ops modules.

    A @triton.jit function another one in its module calls (``name(``) is a device function,
    not a kernel: left out.
    """
    import pkgutil

    import tempo.ops

    found = []
    for info in pkgutil.iter_modules(tempo.ops.__path__):
        if info.name == "compile_check":
            continue
        try:
            module = importlib.import_module(f"tempo.ops.{info.name}")
        except Exception as err:  # noqa: BLE001 - reported, not fatal: the workloads import what they use
            found.append((f"tempo.ops.{info.name}", f"<import failed: {err!r}>"))
            continue
        jitted = {name: obj for name, obj in vars(module).items()
                  if hasattr(obj, "fn") and hasattr(obj, "run") and getattr(obj.fn, "__module__", None) == module.__name__}
        sources = {name: inspect.getsource(obj.fn) for name, obj in jitted.items()}
        for name in jitted:
            called = any(re.search(rf"\b{re.escape(name)}\(", src) for other, src in sources.items() if other != name)
            if not called:
                found.append((module.__name__, name))
    return sorted(found)


# ------------------------------------------------------------------------------------------------
# Compiling for real GPUs (a process without TRITON_INTERPRET)
# ------------------------------------------------------------------------------------------------
class _FakeTensor:
    """What the launcher reads of a tensor argument: its dtype and its address."""

    def __init__(self, dtype: Any, aligned: bool) -> None:
        self.dtype = dtype
        self._ptr = (1 << 20) + (0 if aligned else dtype.itemsize)

    def data_ptr(self) -> int:
        return self._ptr

    def ptr_range(self) -> int:
        return 0


def _materialise(arg: tuple) -> Any:
    import torch
    import triton.language as tl

    name, kind, value = arg
    if kind == "ptr":
        return _FakeTensor(getattr(torch, value[0]), value[1])
    if kind == "int":
        return int(value)
    if kind == "float":
        return 0.5
    if kind in ("bool", "none"):
        return value
    if isinstance(value, dict) and "tl_dtype" in value:
        return getattr(tl, value["tl_dtype"])
    return value


def _resolve_kernel(module: str, qualname: str) -> Any:
    obj: Any = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    while not hasattr(obj, "params") and hasattr(obj, "fn"):  # autotuner / heuristics wrappers
        obj = obj.fn
    return obj


def _arch_name(cap: int) -> str:
    return f"sm_{cap}{'a' if cap >= 90 else ''}"


def _bundled_ptxas(cap: int) -> list[str]:
    """Bundled ptxas binaries, the one triton itself uses for ``cap`` first."""
    import triton

    bin_dir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    candidates = []
    try:
        from triton.backends.nvidia.compiler import get_ptxas

        candidates.append(get_ptxas(cap).path)
    except Exception:  # older triton: no per-arch choice; try the bundled binaries below
        pass
    for name in ("ptxas-blackwell", "ptxas"):
        path = os.path.join(bin_dir, name)
        if os.path.exists(path) and path not in candidates:
            candidates.append(path)
    return candidates


_PTXAS_USED = re.compile(r"Used (\d+) registers")
_PTXAS_SPILL = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")


def run_ptxas(ptx: str, cap: int) -> dict:
    """Registers and spill bytes from ``ptxas -v`` (the first bundled ptxas that accepts the PTX)."""
    errors = []
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.ptx")
        with open(path, "w") as f:
            f.write(ptx)
        for ptxas in _bundled_ptxas(cap):
            proc = subprocess.run([ptxas, "-v", f"--gpu-name={_arch_name(cap)}", path, "-o", os.devnull],
                                  capture_output=True, text=True)
            if proc.returncode != 0:
                errors.append(f"{os.path.basename(ptxas)}: {proc.stderr.strip()[:300]}")
                continue
            log = proc.stdout + proc.stderr
            used, spill = _PTXAS_USED.search(log), _PTXAS_SPILL.search(log)
            if used is None or spill is None:
                raise RuntimeError(f"cannot read ptxas -v output:\n{log}")
            return {"registers": int(used.group(1)), "stack_frame": int(spill.group(1)),
                    "spill_stores": int(spill.group(2)), "spill_loads": int(spill.group(3)),
                    "ptxas": os.path.basename(ptxas)}
    raise RuntimeError("no bundled ptxas accepted the PTX: " + " | ".join(errors))


def compile_launch(launch: Launch, cap: int) -> dict:
    """Compile one recorded launch for ``cap`` (80, 90) and measure it; errors go in the row."""
    row = {"kernel": launch.qualname, "module": launch.module, "config": launch.config,
           "arch": _arch_name(cap), "num_warps": launch.num_warps or 4, "num_stages": launch.num_stages,
           "registers": None, "spill_stores": None, "spill_loads": None, "stack_frame": None,
           "shared": None, "ptxas": None, "compile_s": None, "error": None}
    start = time.perf_counter()
    try:
        import triton
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource, make_backend
        from triton.runtime.jit import create_function_from_signature

        kernel = _resolve_kernel(launch.module, launch.qualname)
        target = GPUTarget("cuda", cap, 32)
        backend = make_backend(target)
        options = {"num_warps": row["num_warps"]}
        if launch.num_stages is not None:
            options["num_stages"] = launch.num_stages
        # The launcher's own binder: the same signature, constexprs and divisibility attributes
        # a GPU launch with these arguments compiles.
        binder = create_function_from_signature(kernel.signature, kernel.params, backend)
        bound, specialization, _ = binder(*[_materialise(a) for a in launch.args])
        values = list(bound.values())
        names = [p.name for p in kernel.params]
        signature = {n: s[0] for n, s in zip(names, specialization)}
        constexprs = {(i,): values[i] for i, s in enumerate(specialization) if s[0] == "constexpr"}
        attrs = {(i,): backend.parse_attr(s[1]) for i, s in enumerate(specialization)
                 if s[0] != "constexpr" and isinstance(s[1], str)}
        compiled = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs),
                                  target=target, options=options)
        row["shared"] = int(compiled.metadata.shared)
        row["num_stages"] = int(compiled.metadata.num_stages)
        row.update(run_ptxas(compiled.asm["ptx"], cap))
    except Exception as err:  # reported per row; the gate fails on any
        row["error"] = f"{type(err).__name__}: {' '.join(str(err).split())[:400]}"
    row["compile_s"] = round(time.perf_counter() - start, 2)
    return row


def _compile_task(task: tuple[dict, int]) -> dict:
    return compile_launch(Launch.from_json(task[0]), task[1])


def _compile_isolated(task: tuple[dict, int]) -> dict:
    """Compile one task in its own process: a compiler crash becomes that row's error."""
    with tempfile.TemporaryDirectory() as tmp:
        src, out = os.path.join(tmp, "launch.json"), os.path.join(tmp, "row.json")
        with open(src, "w") as f:
            json.dump({"launches": [task[0]]}, f)
        proc = subprocess.run([sys.executable, "-m", "tempo.ops.compile_check", "--compile-from", src,
                               "--rows-to", out, "--jobs", "1", "--arch", str(task[1])],
                              env=_child_env(interpret=False), capture_output=True, text=True)
        if proc.returncode == 0:
            with open(out) as f:
                return json.load(f)[0]
    launch = Launch.from_json(task[0])
    row = {"kernel": launch.qualname, "module": launch.module, "config": launch.config, "arch": _arch_name(task[1]),
           "num_warps": launch.num_warps or 4, "num_stages": launch.num_stages, "registers": None,
           "spill_stores": None, "spill_loads": None, "stack_frame": None, "shared": None, "ptxas": None,
           "compile_s": None}
    row["error"] = f"the compiler process died (exit code {proc.returncode}): {proc.stderr.strip()[-300:]}"
    return row


def compile_all(launches: list[Launch], arches: Iterable[int], jobs: int) -> list[dict]:
    tasks = [(launch.to_json(), cap) for launch in launches for cap in arches]
    if jobs <= 1 or len(tasks) <= 1:
        return [_compile_task(t) for t in tasks]
    import concurrent.futures
    import multiprocessing

    # Fork: the workers inherit the imported triton and torch instead of importing them again.
    context = multiprocessing.get_context("fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn")
    rows: list[Optional[dict]] = [None] * len(tasks)
    with concurrent.futures.ProcessPoolExecutor(max_workers=jobs, mp_context=context) as pool:
        futures = {pool.submit(_compile_task, t): i for i, t in enumerate(tasks)}
        for future in concurrent.futures.as_completed(futures):
            try:
                rows[futures[future]] = future.result()
            except concurrent.futures.process.BrokenProcessPool:
                pass  # a worker crashed (a compiler segfault): redone one by one below
    # Tasks lost with a crashed worker, each in its own process, so the crash names its kernel.
    return [row if row is not None else _compile_isolated(tasks[i]) for i, row in enumerate(rows)]


# ------------------------------------------------------------------------------------------------
# Verdict, table, driver
# ------------------------------------------------------------------------------------------------
def failures(rows: list[dict], max_spill_bytes: int = DEFAULT_MAX_SPILL_BYTES) -> list[str]:
    """One line per row that fails the gate: a compile error, or spill stores above the limit."""
    lines = []
    for r in rows:
        where = f"{r['kernel']} [{r['config']} w{r['num_warps']}] on {r['arch']}"
        if r["error"]:
            lines.append(f"COMPILE ERROR {where}: {r['error']}")
            continue
        allowed = SPILL_ALLOWANCE.get(r["kernel"], max_spill_bytes)
        if r["spill_stores"] > allowed:
            lines.append(f"SPILL {where}: {r['spill_stores']} bytes of spill stores "
                         f"({r['spill_loads']} loads), allowed {allowed}")
    return lines


def format_table(rows: list[dict]) -> str:
    head = ("kernel", "config", "warps", "arch", "regs", "spill st/ld", "smem")
    body = [(r["kernel"], r["config"], str(r["num_warps"]), r["arch"],
             "ERR" if r["error"] else str(r["registers"]),
             "" if r["error"] else f"{r['spill_stores']}/{r['spill_loads']}",
             "" if r["error"] else str(r["shared"])) for r in rows]
    widths = [max(len(x[i]) for x in [head, *body]) for i in range(len(head))]
    fmt = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()  # noqa: E731
    return "\n".join([fmt(head), fmt(["-" * w for w in widths]), *map(fmt, body)])


def _child_env(interpret: bool) -> dict:
    env = dict(os.environ)
    env.pop(_INTERP, None)
    if interpret:
        env[_INTERP] = "1"
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # triton 3.9 warns when unset; 1 is its default
    return env


def _run_child(args: list[str], interpret: bool) -> None:
    cmd = [sys.executable, "-m", "tempo.ops.compile_check", *args]
    proc = subprocess.run(cmd, env=_child_env(interpret))
    if proc.returncode != 0:
        raise SystemExit(f"compile_check: child {' '.join(args[:1])} failed with exit code {proc.returncode}")


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tempo.ops.compile_check", description=__doc__.split("\n")[0])
    parser.add_argument("--json", metavar="PATH", help="write the table (and the verdict) as JSON here")
    parser.add_argument("--arch", type=int, nargs="+", default=list(ARCHES), help="compute capabilities")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="parallel compiler processes")
    parser.add_argument("--max-spill-bytes", type=int, default=DEFAULT_MAX_SPILL_BYTES)
    parser.add_argument("--ops", nargs="+", choices=list(WORKLOADS), default=list(WORKLOADS))
    # Internal: the two child processes.
    parser.add_argument("--record-to", help=argparse.SUPPRESS)
    parser.add_argument("--compile-from", help=argparse.SUPPRESS)
    parser.add_argument("--rows-to", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.record_to:  # child 1: under the interpreter
        from tempo.ops._backend import triton_interpreting

        if not triton_interpreting():
            raise SystemExit("compile_check --record-to needs TRITON_INTERPRET=1")
        notes: list[str] = []
        launches = record(args.ops, log=notes.append)
        kernels = defined_kernels()
        with open(args.record_to, "w") as f:
            json.dump({"launches": [x.to_json() for x in launches], "notes": notes, "defined": kernels}, f)
        return 0
    if args.compile_from:  # child 2: no interpreter
        if os.environ.get(_INTERP, "0") == "1":
            raise SystemExit("compile_check --compile-from must run without TRITON_INTERPRET")
        with open(args.compile_from) as f:
            launches = [Launch.from_json(d) for d in json.load(f)["launches"]]
        rows = compile_all(launches, args.arch, args.jobs)
        with open(args.rows_to, "w") as f:
            json.dump(rows, f)
        return 0

    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        recorded, rows_path = os.path.join(tmp, "launches.json"), os.path.join(tmp, "rows.json")
        _run_child(["--record-to", recorded, "--ops", *args.ops], interpret=True)
        record_s = time.perf_counter() - start
        with open(recorded) as f:
            rec = json.load(f)
        _run_child(["--compile-from", recorded, "--rows-to", rows_path, "--jobs", str(args.jobs),
                    "--arch", *map(str, args.arch)], interpret=False)
        with open(rows_path) as f:
            rows = json.load(f)
    total_s = time.perf_counter() - start

    for note in rec["notes"]:
        print(note)
    launched = {(d["module"], d["qualname"]) for d in rec["launches"]}
    skipped = {WORKLOAD_MODULES[name] for name in WORKLOADS if name not in args.ops}
    uncovered = [f"{m}.{n}" for m, n in rec["defined"] if (m, n) not in launched and m not in skipped]
    print(format_table(rows))
    print(f"{len(rec['launches'])} unique launches x {len(args.arch)} arches = {len(rows)} compiles; "
          f"recording {record_s:.0f} s, total {total_s:.0f} s")
    if uncovered:
        print("not launched by any workload here (not compiled): " + ", ".join(uncovered))
    bad = failures(rows, args.max_spill_bytes)
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "failures": bad, "notes": rec["notes"], "uncovered": uncovered,
                       "max_spill_bytes": args.max_spill_bytes, "seconds": round(total_s, 1)}, f, indent=1)
    for line in bad:
        print(line)
    print("compile check: " + ("FAILED" if bad else "passed"))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
