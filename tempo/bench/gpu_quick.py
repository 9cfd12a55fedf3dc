"""The quick GPU check's stage bodies: each stage of ``scripts/gpu_check.sh``'s quick plan, run as one process.

tempo/bench/gpu_suite.py (the runner) holds the plan: which stages, in which order, with which time
limits, and what each answers. Each stage here writes <stage>.json into the run directory after
every item, so a stage stopped at its limit keeps what it measured. Every stage also runs on the CPU
at tiny shapes (``--device cpu --tiny``: the Triton kernels through Triton's interpreter, the speed
in perf_counter time, torch.compile with the aot_eager backend, the largest batch against a
simulated budget): tests/test_gpu_quick.py runs each stage's real code end to end on the CPU and
checks its JSON. On CUDA the same code runs at BERT-large's shapes.

    python -m tempo.bench.gpu_quick <stage> --out DIR [--device cuda|cpu] [--tiny]

Exit status: 0 ok; 5 the stage ran but a check failed (correctness) or a measurement was refused;
1 a bad argument; anything else a crash (its traceback is in the stage's log).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import json
import logging
import math
import os
import platform
import subprocess
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Sequence

import torch
import torch.nn.functional as F

PROG = "python -m tempo.bench.gpu_quick"
CHECKS_FAILED_EXIT = 5
MAXBATCH_BUDGET_S = 65  # the max-batch searches stop probing after this (both variants together)
MAXBATCH_START_S = 15  # of the stage's time: the process's start and imports, and the summary's margin
# What a stage needs on the CPU to run its Triton kernels (Triton's interpreter, switched on before
# triton is imported) and what the max-batch stage sets on CUDA (fewer failures from fragmentation
# after a probe that ran out of memory).
CPU_STAGE_ENV = {"TRITON_INTERPRET": "1"}
MAXBATCH_CUDA_ENV = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
DEFAULT_SIMULATED_BUDGET = "1.5MiB"  # the tiny model on the CPU: static 0.85 MB, ~0.07 MB per sequence


@dataclass(frozen=True)
class Sizes:
    """The shapes of every stage: BERT-large's (``REAL``) or a tiny stand-in for the CPU (``TINY``)."""

    name: str
    batch: int  # the correctness shape: rows = batch x seq
    seq: int
    hidden: int
    heads: int
    head_dim: int
    ffn: int
    varlen: tuple[int, ...]  # lengths of the packed batch of the variable-length checks
    position_buckets: int  # DeBERTa-v3: 256 buckets, relative positions up to 512
    max_relative_positions: int
    layer_shapes: tuple[tuple[int, int], ...]  # (batch, seq) of the layer timings
    deberta_shape: tuple[int, int]
    memory_shape: tuple[int, int]  # (batch, seq) of the memory stage's training step
    maxbatch: tuple[int, int, int]  # (first probe, resolution, cap) of the largest-batch search
    maxbatch_seq: int
    bert_layers: int  # BertForPreTraining's depth
    vocab: int
    warmup: int
    repeats: int
    check_dtypes: tuple[torch.dtype, ...]  # the correctness checks run in each

    def as_record(self) -> dict[str, Any]:
        return {**asdict(self), "check_dtypes": [_dtype_name(d) for d in self.check_dtypes]}


REAL = Sizes("bert-large", batch=8, seq=512, hidden=1024, heads=16, head_dim=64, ffn=4096,
             varlen=(512, 448, 384, 320, 256, 192, 128, 64), position_buckets=256, max_relative_positions=512,
             layer_shapes=((8, 512), (96, 128)), deberta_shape=(8, 512), memory_shape=(32, 512),
             maxbatch=(64, 8, 2048), maxbatch_seq=512, bert_layers=24, vocab=30522, warmup=5, repeats=30,
             check_dtypes=(torch.bfloat16, torch.float16))
# The CPU stand-in: the same code at shapes Triton's interpreter runs in seconds; bf16 only (the
# fp16 case is the same code with another tolerance).
TINY = Sizes("tiny", batch=2, seq=16, hidden=32, heads=2, head_dim=16, ffn=64, varlen=(16, 9, 3), position_buckets=8,
             max_relative_positions=16, layer_shapes=((2, 16),), deberta_shape=(2, 16), memory_shape=(2, 16),
             maxbatch=(2, 1, 32), maxbatch_seq=16, bert_layers=2, vocab=512, warmup=1, repeats=3,
             check_dtypes=(torch.bfloat16,))
DROPOUT_P = 0.1
DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
# Largest |actual - fp64| over the largest |fp64| value, per dtype: a wrong kernel is off by O(1);
# rounding one value to the dtype is ~4e-3 (bf16) / 5e-4 (fp16). tests/test_gpu.py's figures.
TOL = {torch.bfloat16: 3e-2, torch.float16: 5e-3}
GELU_DX_TOL = {torch.bfloat16: 4e-2, torch.float16: 1.2e-2}  # the slope table's documented bounds + rounding
# LayerNorm: over max(1, largest |fp64|) (tests/test_layernorm.py): the rounding of y carries over to every gradient
LN_TOL = {torch.bfloat16: 4e-2, torch.float16: 4e-3}
KEEP_RATE_SLACK = {"bert-large": 0.01, "tiny": 0.2}  # |measured keep rate - (1 - p)|: millions vs hundreds of draws


# ------------------------------------------------------------------------------------------------
# A stage's context and its JSON, rewritten after every item
# ------------------------------------------------------------------------------------------------
@dataclass
class Context:
    stage: str
    out: Path
    device: torch.device
    sizes: Sizes
    budget_s: Optional[float] = None
    simulated_budget: Optional[int] = None  # max-batch on the CPU: bytes a step may take
    record: dict[str, Any] = field(default_factory=dict)

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    @property
    def path(self) -> Path:
        return self.out / f"{self.stage}.json"

    def write(self) -> None:
        from tempo.bench.results import write_json

        write_json(self.path, self.record)

    def add(self, key: str, item: dict[str, Any]) -> None:
        """Append ``item`` to the record's list ``key`` and write the JSON at once."""
        self.record.setdefault(key, []).append(item)
        self.write()


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _dtype_name(dtype: torch.dtype) -> str:
    return DTYPE_NAMES.get(dtype, str(dtype))


def _error_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"


def _context_lost(exc: BaseException) -> bool:
    """A CUDA error after which this process can run nothing more on the GPU (illegal address, ...)."""
    text = f"{type(exc).__name__} {exc}"
    return "CUDA error" in text or "AcceleratorError" in text or "device-side assert" in text


def _is_oom(exc: BaseException) -> bool:
    if isinstance(exc, torch.OutOfMemoryError):
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and ("out of memory" in text or "CUBLAS_STATUS_ALLOC_FAILED" in text)


@contextlib.contextmanager
def _tempo_warnings() -> Iterator[list[str]]:
    """Collects what the logger "tempo" warns while a check runs (a fallback to the reference path)."""
    messages: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: messages.append(record.getMessage())
    logger = logging.getLogger("tempo")
    logger.addHandler(handler)
    try:
        yield messages
    finally:
        logger.removeHandler(handler)


Item = tuple[str, dict[str, Any], Callable[[dict[str, Any]], None]]  # (label, the row's head, measure(row))


def run_rows(ctx: Context, key: str, items: Sequence[Item]) -> int:
    """The one loop of every stage that measures several things (checks, model variants, layer cases).

    Per item ``(label, head, measure)``: the row ``{**head, "status": "running"}`` is appended to the
    record's list ``key`` and written before ``measure(row)`` fills it, so a stage stopped at its
    limit keeps every row so far. When ``measure`` returns, the row's status is "ok" unless it set
    another ("failed": a check over its tolerance); when it raises, "oom" (out of memory) or
    "error" with the message and the traceback's tail, and the next item runs. After a CUDA error
    that leaves the context unusable every later item is "not-run" (each would fail the same way).
    Returns 0 when every row is "ok", else CHECKS_FAILED_EXIT; the record is then marked complete."""
    failed, lost = 0, None
    for label, head, measure in items:
        row: dict[str, Any] = {**head, "status": "running"}
        ctx.add(key, row)
        if lost is not None:
            row.update(status="not-run", message=f"the CUDA context was lost at {lost}")
        else:
            start = time.perf_counter()
            try:
                measure(row)
                if row["status"] == "running":
                    row["status"] = "ok"
            except Exception as exc:  # noqa: BLE001 - an item that raises is that item's result
                row.update(status="oom" if _is_oom(exc) else "error", message=_error_line(exc),
                           traceback="".join(traceback.format_exception(exc)[-6:]))
                if ctx.cuda and _context_lost(exc):
                    lost = label
            row["seconds"] = round(time.perf_counter() - start, 3)
        failed += row["status"] != "ok"
        ctx.write()
        print(f"{label}: " + json.dumps({k: v for k, v in row.items() if k != "traceback"
                                         and not isinstance(v, (dict, list))}, default=str), flush=True)
        gc.collect()  # the item's model and tensors went with measure's frame
        if ctx.cuda and lost is None:  # a lost context fails every CUDA call, this one too
            torch.cuda.empty_cache()
    ctx.record["complete"] = True
    ctx.write()
    return 0 if failed == 0 else CHECKS_FAILED_EXIT


# ------------------------------------------------------------------------------------------------
# Stage 1: environment
# ------------------------------------------------------------------------------------------------
def nvidia_smi(fields: Sequence[str]) -> dict[str, Any]:
    """nvidia-smi's values of ``fields`` (query names) for the first GPU, as strings; {"error": why}
    where it cannot answer. Needs no CUDA context (the runner's process must hold none)."""
    try:
        out = subprocess.run(["nvidia-smi", f"--query-gpu={','.join(fields)}", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=15)
    except (OSError, subprocess.SubprocessError) as exc:
        return {"error": _error_line(exc)}
    if out.returncode != 0 or not out.stdout.strip():
        return {"error": (out.stderr or out.stdout).strip()[:300]}
    values = [v.strip() for v in out.stdout.strip().splitlines()[0].split(",")]
    return dict(zip(fields, values))


def stage_env(ctx: Context) -> int:
    from tempo.bench.hardware import environment

    info = environment(ctx.device)
    if info.get("git_commit") is None and os.environ.get("TEMPO_GIT_COMMIT"):
        # The device gets the working tree without .git: the command line passes the commit in.
        info["git_commit"], info["git_dirty"] = os.environ["TEMPO_GIT_COMMIT"], None
        info["git_commit_from"] = "TEMPO_GIT_COMMIT"
    from importlib import metadata

    versions = {}
    for package in ("transformers", "numpy", "accelerate", "sentence-transformers", "peft", "pytest"):
        try:  # the installed versions, without importing the packages (seconds each)
            versions[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            versions[package] = None
    info["versions"] = versions
    info["platform"] = platform.platform()
    info["env_vars"] = {k: os.environ.get(k) for k in ("CUDA_VISIBLE_DEVICES", "PYTORCH_CUDA_ALLOC_CONF",
                                                       "TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR",
                                                       "TEMPO_BACKEND", "TRITON_INTERPRET")}
    if ctx.cuda:
        props = torch.cuda.get_device_properties(ctx.device)
        info["sm_count"] = props.multi_processor_count
        info["cudnn"] = torch.backends.cudnn.version()
        info["nvidia_smi"] = nvidia_smi(("name", "driver_version", "memory.total", "clocks.max.sm",
                                         "clocks.max.memory", "power.limit", "pstate", "temperature.gpu"))
        info["sdpa_enabled"] = {"flash": torch.backends.cuda.flash_sdp_enabled(),
                                "efficient": torch.backends.cuda.mem_efficient_sdp_enabled(),
                                "cudnn": torch.backends.cuda.cudnn_sdp_enabled(),
                                "math": torch.backends.cuda.math_sdp_enabled()}
    ctx.record.update({"env": info, "complete": True})
    ctx.write()
    print(json.dumps(info, indent=1, default=str), flush=True)
    return 0


# ------------------------------------------------------------------------------------------------
# Stage 2: correctness against fp64
# ------------------------------------------------------------------------------------------------
def rel_err(actual: torch.Tensor, expected: torch.Tensor, floor: float = 0.0) -> float:
    """max |actual - expected| / max(floor, max |expected|), in fp64; inf for a non-finite actual."""
    if not torch.isfinite(actual).all():
        return float("inf")
    expected = expected.detach().double()
    scale = max(floor, float(expected.abs().max()) if expected.numel() else 0.0, 1e-30)
    return float((actual.detach().double() - expected).abs().max()) / scale if actual.numel() else 0.0


@dataclass
class Comparison:
    what: str  # "y", "dx", ...
    error: float
    tolerance: float

    @property
    def ok(self) -> bool:
        return self.error <= self.tolerance


def compare(what: str, actual: torch.Tensor, expected: torch.Tensor, tolerance: float,
            floor: float = 0.0) -> Comparison:
    if tuple(actual.shape) != tuple(expected.shape):
        raise AssertionError(f"{what}: shape {tuple(actual.shape)} != reference {tuple(expected.shape)}")
    return Comparison(what, rel_err(actual, expected, floor), tolerance)


def compare_all(names: Sequence[str], actual: Sequence[torch.Tensor], expected: Sequence[torch.Tensor],
                tolerance: float, floor: float = 0.0) -> list[Comparison]:
    return [compare(w, a, r, tolerance, floor) for w, a, r in zip(names, actual, expected)]


def twice(device: torch.device, call: Callable[..., torch.Tensor], inputs: Sequence[torch.Tensor],
          grad: torch.Tensor, params: Sequence[torch.Tensor] = (), before: Optional[Callable[[], None]] = None
          ) -> tuple[list[torch.Tensor], float, float]:
    """``call`` forward and backward under the Triton backend twice, synchronized: (the second
    pass's [output, the gradient of each of ``inputs``, then of each of ``params``], the first
    pass's seconds, the second's). Each pass calls ``call`` on fresh leaf copies of ``inputs`` and
    takes the ``params``' gradients (resetting them). ``before()`` runs ahead of each pass (the RNG
    state a dropout attention draws from). The first call of a kernel specialization includes
    Triton's JIT compile (or its disk cache)."""
    def run() -> list[torch.Tensor]:
        if before is not None:
            before()
        leaves = [t.clone().requires_grad_() for t in inputs]
        with _triton():
            out = call(*leaves)
            out.backward(grad)
        grads = [p.grad for p in params]
        for p in params:
            p.grad = None
        return [out.detach(), *(t.grad for t in leaves), *grads]

    synchronize(device)
    t0 = time.perf_counter()
    run()
    synchronize(device)
    t1 = time.perf_counter()
    result = run()
    synchronize(device)
    return result, t1 - t0, time.perf_counter() - t1


def _randn(ctx: Context, *shape: int, scale: float = 1.0, shift: float = 0.0) -> torch.Tensor:
    return torch.randn(*shape, device=ctx.device) * scale + shift


def _triton():
    from tempo.ops._backend import use_backend

    return use_backend("triton")  # Triton where it can run, else an error: never the reference path silently


def check_gelu(ctx: Context, dtype: torch.dtype, approximate: str) -> tuple[list[Comparison], float, float]:
    from tempo.ops.gelu import inplace_gelu

    s = ctx.sizes
    x = _randn(ctx, s.batch * s.seq, s.ffn, scale=3.0).to(dtype)
    # x * 1: an intermediate, as in a model; dy = 1: dx is GELU'(x) itself
    (y, dx), first, second = twice(ctx.device, lambda leaf: inplace_gelu(leaf * 1, approximate), (x,),
                                   torch.ones_like(x))
    x64 = x.double().requires_grad_()
    ref = F.gelu(x64, approximate=approximate)
    ref.backward(torch.ones_like(ref))
    return [compare("y", y, ref, TOL[dtype]), compare("dx", dx, x64.grad, GELU_DX_TOL[dtype])], first, second


def adversarial_layernorm_parameters(ctx: Context) -> tuple[torch.Tensor, torch.Tensor]:
    """γ ~ 1 ± 0.1 and β ~ 0.1·N(0, 1), except the first columns: γ in {0, 1e-30, -1e-6, 1e-3} with
    β = ±10 (x̂ cannot be recovered from y there: the layer must keep those columns), and one
    column with γ = 1, β = 10 (κ = 10)."""
    n = ctx.sizes.hidden
    weight = 1 + 0.1 * _randn(ctx, n)
    bias = 0.1 * _randn(ctx, n)
    gammas = torch.tensor([0.0, 1e-30, -1e-6, 1e-3, 1.0], device=ctx.device)
    weight[:5] = gammas
    bias[:5] = torch.tensor([10.0, -10.0, 10.0, -10.0, 10.0], device=ctx.device)
    return weight, bias


def _layernorm_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, grad: torch.Tensor,
                         residual: Optional[torch.Tensor] = None, keep: Optional[torch.Tensor] = None,
                         p: float = 0.0, eps: float = 1e-12):
    """fp64 LayerNorm (of residual + x·keep/(1 - p) when residual is given) and its gradients."""
    x64 = x.detach().double().requires_grad_()
    w64, b64 = weight.detach().double().requires_grad_(), bias.detach().double().requires_grad_()
    s = x64
    r64 = None
    if residual is not None:
        r64 = residual.detach().double().requires_grad_()
        s = r64 + x64 * keep / (1 - p)
    y = F.layer_norm(s, (x.shape[-1],), w64, b64, eps)
    y.backward(grad.double())
    return y.detach(), x64.grad, (r64.grad if r64 is not None else None), w64.grad, b64.grad


def check_layernorm(ctx: Context, dtype: torch.dtype) -> tuple[list[Comparison], float, float]:
    from tempo.ops.layernorm import InplaceLayerNorm, plan_kept_columns

    s = ctx.sizes
    module = InplaceLayerNorm(s.hidden, eps=1e-12).to(ctx.device)  # fp32 parameters, as in a model
    weight, bias = adversarial_layernorm_parameters(ctx)
    with torch.no_grad():
        module.weight.copy_(weight)
        module.bias.copy_(bias)
        kept = plan_kept_columns(module.weight, module.bias, dtype, s.hidden, ctx.device, "quick check")
    if kept.numel() < 4:
        raise AssertionError(f"the plan keeps {kept.numel()} columns; γ in {{0, 1e-30, -1e-6, 1e-3}} against "
                             f"|β| = 10 must be kept")
    x = _randn(ctx, s.batch * s.seq, s.hidden, scale=2.0, shift=0.5).to(dtype)
    g = _randn(ctx, s.batch * s.seq, s.hidden).to(dtype)
    got, first, second = twice(ctx.device, lambda leaf: module(leaf * 1), (x,), g, (module.weight, module.bias))
    ref_y, ref_dx, _, ref_dw, ref_db = _layernorm_reference(x, module.weight, module.bias, g)
    return compare_all(("y", "dx", "dweight", "dbias"), got, (ref_y, ref_dx, ref_dw, ref_db), LN_TOL[dtype], 1.0), \
        first, second


def check_dropout_add_layernorm(ctx: Context, dtype: torch.dtype) -> tuple[list[Comparison], float, float]:
    from tempo.ops.dropout_add_layernorm import dropout_add_layernorm, dropout_add_layernorm_keep_mask

    s = ctx.sizes
    weight, bias = (t.requires_grad_() for t in adversarial_layernorm_parameters(ctx))
    x = _randn(ctx, s.batch * s.seq, s.hidden).to(dtype)
    residual = _randn(ctx, s.batch * s.seq, s.hidden, scale=2.0).to(dtype)
    g = _randn(ctx, s.batch * s.seq, s.hidden).to(dtype)
    seed = torch.tensor(4321, device=ctx.device)
    got, first, second = twice(
        ctx.device, lambda xl, rl: dropout_add_layernorm(xl * 1, rl * 1, (s.hidden,), weight, bias, 1e-12, DROPOUT_P,
                                                         True, seed), (x, residual), g, (weight, bias))
    with _triton():
        keep = dropout_add_layernorm_keep_mask(seed, x.shape, DROPOUT_P, ctx.device, "triton")
    _check_keep_rate(ctx, keep.double().mean().item(), "dropout_add_layernorm")
    ref = _layernorm_reference(x, weight, bias, g, residual, keep.double(), DROPOUT_P)
    return compare_all(("y", "dx", "dresidual", "dweight", "dbias"), got, ref, LN_TOL[dtype], 1.0), first, second


def _check_keep_rate(ctx: Context, rate: float, what: str) -> None:
    slack = KEEP_RATE_SLACK[ctx.sizes.name]
    if abs(rate - (1 - DROPOUT_P)) > slack:
        raise AssertionError(f"{what}: the dropout mask keeps {rate:.4f} of the entries, expected "
                             f"{1 - DROPOUT_P} ± {slack}")


def check_combined(ctx: Context, dtype: torch.dtype) -> tuple[list[Comparison], float, float]:
    from tempo.ops.combined import combined_softmax_dropout_matmul, dropout_keep_mask

    s = ctx.sizes
    scores = _randn(ctx, s.batch, s.heads, s.seq, s.seq, scale=2.0).to(dtype)
    v = _randn(ctx, s.batch, s.heads, s.seq, s.head_dim).to(dtype)
    g = _randn(ctx, s.batch, s.heads, s.seq, s.head_dim).to(dtype)
    seed = torch.tensor(1234, device=ctx.device)
    got, first, second = twice(ctx.device, lambda sl, vl: combined_softmax_dropout_matmul(sl, vl, -1, DROPOUT_P, True,
                                                                                          seed), (scores, v), g)
    with _triton():
        keep = dropout_keep_mask(seed, scores.shape, DROPOUT_P, ctx.device, "triton")
    _check_keep_rate(ctx, keep.double().mean().item(), "combined")
    s64, v64 = scores.double().requires_grad_(), v.double().requires_grad_()
    ref = torch.matmul(torch.softmax(s64, -1) * keep / (1 - DROPOUT_P), v64)
    ref.backward(g.double())
    return compare_all(("out", "dscores", "dv"), got, (ref, s64.grad, v64.grad), TOL[dtype]), first, second


def check_gated_mlp(ctx: Context, dtype: torch.dtype) -> tuple[list[Comparison], float, float]:
    """The GeGLU linear (ModernBERT's MLP: tanh GELU of the first half of one projection's output
    times the second, dropout 0.1, the down projection) against fp64 with the mask it drew."""
    from tempo.ops.gated_mlp import gated_linear_fused, gated_mlp_keep_mask

    s = ctx.sizes
    rows = s.batch * s.seq
    h = _randn(ctx, rows, 2 * s.ffn).to(dtype)
    weight = (_randn(ctx, s.hidden, s.ffn) / math.sqrt(s.ffn)).to(dtype)
    bias = (0.1 * _randn(ctx, s.hidden)).to(dtype)
    g = _randn(ctx, rows, s.hidden).to(dtype)
    seed = torch.tensor(2468, device=ctx.device)
    got, first, second = twice(ctx.device, lambda hl, wl, bl: gated_linear_fused(
        hl, wl, bl, activation="gelu_tanh", gate_first=True, p=DROPOUT_P, seed=seed), (h, weight, bias), g)
    keep = gated_mlp_keep_mask(seed, rows, s.ffn, DROPOUT_P, ctx.device, "triton")
    _check_keep_rate(ctx, keep.double().mean().item(), "GeGLU linear")
    h64, w64, b64 = (t.double().requires_grad_() for t in (h, weight, bias))
    gate, up = h64.chunk(2, dim=-1)
    ref = F.linear(F.gelu(gate, approximate="tanh") * up * keep / (1 - DROPOUT_P), w64, b64)
    ref.backward(g.double())
    return compare_all(("out", "dh", "dweight", "dbias"), got, (ref, h64.grad, w64.grad, b64.grad), TOL[dtype]), \
        first, second


def check_fused_lm_head(ctx: Context, dtype: torch.dtype) -> tuple[list[Comparison], float, float]:
    """The fused LM head and loss (its two Triton kernels between cuBLAS GEMMs) against the
    materialised head in fp64: an odd vocabulary (a partial last block), one target in seven
    ignored, label smoothing 0.1, z-loss 1e-4, Gemma's softcap 30; per-row loss, dx, dweight."""
    from tempo.ops.linear_cross_entropy import linear_cross_entropy

    s = ctx.sizes
    rows, vocab = s.batch * s.seq, s.vocab + 123
    x = _randn(ctx, rows, s.hidden).to(dtype)
    weight = (_randn(ctx, vocab, s.hidden) / math.sqrt(s.hidden)).to(dtype)
    target = torch.randint(0, vocab, (rows,), device=ctx.device)
    target[::7] = -100
    g = _randn(ctx, rows).abs().to(torch.float32)
    modes = {"label_smoothing": 0.1, "z_loss": 1e-4, "softcap": 30.0}
    got, first, second = twice(ctx.device, lambda xl, wl: linear_cross_entropy(xl, wl, target, reduction="none",
                                                                                **modes), (x, weight), g)
    x64, w64 = (t.double().requires_grad_() for t in (x, weight))
    z = 30.0 * torch.tanh(F.linear(x64, w64) / 30.0)
    kept = target != -100
    ref = F.cross_entropy(z, target, label_smoothing=0.1, reduction="none")
    ref = ref + 1e-4 * torch.logsumexp(z, -1).square() * kept
    ref.backward(g.double())
    return compare_all(("loss", "dx", "dweight"), got, (ref, x64.grad, w64.grad), TOL[dtype]), first, second


# -- attention ---------------------------------------------------------------------------------
def _rng_state(device: torch.device) -> tuple:
    return torch.get_rng_state(), (torch.cuda.get_rng_state(device) if device.type == "cuda" else None)


def _set_rng_state(state: tuple, device: torch.device) -> None:
    torch.set_rng_state(state[0])
    if device.type == "cuda":
        torch.cuda.set_rng_state(state[1], device)


def _attention_fp64(q, k, v, g, keep_keys=None, keep=None, p=0.0):
    """fp64 attention [b, h, s, d] (keep_keys [b, s_k] bool masks keys, keep the dropout mask) and
    its gradients (out, dq, dk, dv)."""
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    scores = q64 @ k64.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if keep_keys is not None:
        scores = scores.masked_fill(~keep_keys[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, -1)
    if keep is not None:
        probs = probs * keep / (1 - p)
    out = probs @ v64
    out.backward(g.double())
    return out.detach(), q64.grad, k64.grad, v64.grad


def _padding(ctx: Context) -> torch.Tensor:
    """Key padding [b, s] bool, True = a real token: lengths from 1 to s, one sample unpadded."""
    s = ctx.sizes
    lengths = torch.linspace(1, s.seq, s.batch).round().long().tolist()
    lengths[0] = s.seq
    keep = torch.zeros(s.batch, s.seq, dtype=torch.bool, device=ctx.device)
    for i, n in enumerate(lengths):
        keep[i, :n] = True
    return keep


def _qkv_padded(ctx: Context, dtype: torch.dtype):
    s = ctx.sizes
    # q scaled by 0.5: scores ~ N(0, 1/4), so no probability underflows a 16-bit output (the probes read them)
    q = _randn(ctx, s.batch, s.heads, s.seq, s.head_dim, scale=0.5).to(dtype)
    k, v, g = (_randn(ctx, s.batch, s.heads, s.seq, s.head_dim).to(dtype) for _ in range(3))
    return q, k, v, g


def _one_hot_values(d: int, block: int, like: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Values whose column c is 1 at the key of position block·d + c (``positions``: each key row's
    position in its sequence): attention's output column c is then that key's probability, dropped
    or scaled by 1/(1 - p) as the kernel's dropout mask says."""
    target = block * d + torch.arange(d, device=like.device)
    return (positions[..., None] == target).to(like.dtype)


def replay_and_read_mask(ctx: Context, state: tuple, call: Callable, q: torch.Tensor, k: torch.Tensor,
                         v: torch.Tensor, out: torch.Tensor, positions: torch.Tensor,
                         longest: int) -> tuple[Comparison, torch.Tensor]:
    """What a dropout attention drew, from its outputs alone (CUDA's fused kernels cannot hand out
    their mask): ``call(q, k, v)`` run again from the RNG ``state`` of the pass with grad whose
    output was ``out``.

    * the replay: the same forward under no_grad (GradCache, reentrant checkpointing) must give
      ``out``: same mask, so equal up to rounding (bit for bit on the CPU; recorded as the error
      against ``out``, whose tolerance is the dtype's: another mask is off by ~0.1 or more);
    * the mask: ``call`` with one-hot values (column c = 1 at the key of position block·d + c,
      ceil(longest / d) calls), q and k requiring grad as in the pass with grad, returns each
      key's probability, 0 where dropped: probabilities [..., longest] (query rows x keys)."""
    with torch.no_grad(), _triton():
        _set_rng_state(state, ctx.device)
        replayed = call(q, k, v)
    replay = Comparison("replay", rel_err(replayed, out), TOL[q.dtype])
    d = q.shape[-1]
    dropped = []
    with torch.enable_grad(), _triton():
        qg, kg = q.clone().requires_grad_(), k.clone().requires_grad_()
        for block in range(math.ceil(longest / d)):
            _set_rng_state(state, ctx.device)
            dropped.append(call(qg, kg, _one_hot_values(d, block, v, positions)).detach())
    return replay, torch.cat(dropped, dim=-1)[..., :longest]


def check_efficient_attention_padded(ctx: Context, dtype: torch.dtype, dropout: bool
                                     ) -> tuple[list[Comparison], float, float]:
    """The efficient attention with a bool key-padding mask against fp64; with dropout, with the mask
    ``replay_and_read_mask`` reads back (and its replay check)."""
    from tempo.ops.attention import efficient_attention

    s = ctx.sizes
    q, k, v, g = _qkv_padded(ctx, dtype)
    keep_keys = _padding(ctx)
    mask = keep_keys[:, None, None, :]
    p = DROPOUT_P if dropout else 0.0
    state = _rng_state(ctx.device)

    def call(qq, kk, vv):
        return efficient_attention(qq, kk, vv, attn_mask=mask, dropout_p=p)

    got, first, second = twice(ctx.device, call, (q, k, v), g, before=lambda: _set_rng_state(state, ctx.device))
    checks = []
    keep = None
    if dropout:
        positions = torch.arange(s.seq, device=ctx.device).expand(s.batch, s.heads, s.seq)
        replay, probs = replay_and_read_mask(ctx, state, call, q, k, v, got[0], positions, s.seq)
        checks.append(replay)
        keep = probs != 0
        ref_probs = torch.softmax((q.double() @ k.double().transpose(-1, -2) / math.sqrt(s.head_dim))
                                  .masked_fill(~mask, float("-inf")), -1)
        readable = ref_probs > 1e-3 / s.seq  # entries whose probability cannot round to 0 in the output
        _check_keep_rate(ctx, keep[readable].double().mean().item(), "efficient attention (padded)")
    ref = _attention_fp64(q, k, v, g, keep_keys, keep.double() if keep is not None else None, p)
    return checks + compare_all(("out", "dq", "dk", "dv"), got, ref, TOL[dtype]), first, second


def _packed(ctx: Context, dtype: torch.dtype):
    """q, k, v, g [T, heads, d] of the packed batch ``sizes.varlen``, its int32 cu_seqlens and offsets."""
    s = ctx.sizes
    lengths = list(s.varlen)
    total = sum(lengths)
    q = _randn(ctx, total, s.heads, s.head_dim, scale=0.5).to(dtype)
    k, v, g = (_randn(ctx, total, s.heads, s.head_dim).to(dtype) for _ in range(3))
    offsets = [0]
    for n in lengths:
        offsets.append(offsets[-1] + n)
    cu = torch.tensor(offsets, dtype=torch.int32, device=ctx.device)
    return q, k, v, g, cu, offsets


def check_efficient_attention_varlen(ctx: Context, dtype: torch.dtype, dropout: bool
                                     ) -> tuple[list[Comparison], float, float]:
    """``efficient_attention_varlen`` over packed sequences against fp64 attention on each
    sequence; with dropout, with the mask ``replay_and_read_mask`` reads back."""
    from tempo.ops.attention import efficient_attention_varlen, remember_sequences

    s = ctx.sizes
    q, k, v, g, cu, offsets = _packed(ctx, dtype)
    facts = remember_sequences(cu, offsets)  # what TokenLayout records: no host read in the op
    p = DROPOUT_P if dropout else 0.0
    state = _rng_state(ctx.device)

    def call(qq, kk, vv):
        return efficient_attention_varlen(qq, kk, vv, cu, facts.max_seqlen, dropout_p=p, min_seqlen=facts.min_seqlen)

    got, first, second = twice(ctx.device, call, (q, k, v), g, before=lambda: _set_rng_state(state, ctx.device))
    checks = []
    keeps: list[Optional[torch.Tensor]] = [None] * len(s.varlen)
    if dropout:
        positions = torch.cat([torch.arange(n, device=ctx.device) for n in s.varlen])[:, None].expand(-1, s.heads)
        replay, probs = replay_and_read_mask(ctx, state, call, q, k, v, got[0], positions, max(s.varlen))
        checks.append(replay)
        readable = []
        for i, (a, b) in enumerate(zip(offsets[:-1], offsets[1:])):
            keeps[i] = probs[a:b, :, : b - a].permute(1, 0, 2) != 0  # [heads, L, L]: query rows x keys
            ref_p = torch.softmax(q[a:b].double().transpose(0, 1) @ k[a:b].double().permute(1, 2, 0)
                                  / math.sqrt(s.head_dim), -1)
            readable.append(keeps[i][ref_p > 1e-3 / (b - a)])
        _check_keep_rate(ctx, torch.cat(readable).double().mean().item(), "efficient attention (varlen)")
    ref_parts = []
    for i, (a, b) in enumerate(zip(offsets[:-1], offsets[1:])):
        per_seq = [t[a:b].transpose(0, 1).unsqueeze(0) for t in (q, k, v, g)]  # [1, heads, L, d]
        keep = keeps[i].unsqueeze(0).double() if keeps[i] is not None else None
        ref_parts.append([t[0].transpose(0, 1) for t in _attention_fp64(*per_seq, keep=keep, p=p)])
    ref = [torch.cat([part[j] for part in ref_parts]) for j in range(4)]
    return checks + compare_all(("out", "dq", "dk", "dv"), got, ref, TOL[dtype]), first, second


def _disentangled_geometry(ctx: Context) -> dict[str, Any]:
    s = ctx.sizes
    return dict(span=s.position_buckets, position_buckets=s.position_buckets,
                max_relative_positions=s.max_relative_positions, scale=1.0 / math.sqrt(s.head_dim * 3))


def _disentangled_fp64(ctx: Context, q, k, v, kp, qp, g, mask=None, keep=None, p=0.0):
    """transformers' formulas in fp64 ([B, S, H, *] inputs, S×S scores, its log buckets from
    ``build_relative_position``; a padded row attends uniformly): (out, dq, dk, dv, dkp, dqp)."""
    from transformers.models.deberta_v2.modeling_deberta_v2 import build_relative_position

    geometry = _disentangled_geometry(ctx)
    span = geometry["span"]
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v, kp, qp)]
    q64, k64, v64, kp64, qp64 = leaves
    b, s_len, h, _ = q.shape
    qh, kh, vh = (t.transpose(1, 2) for t in (q64, k64, v64))
    x = torch.zeros(1, s_len, 1, device=q.device)
    rel = build_relative_position(x, x, geometry["position_buckets"], geometry["max_relative_positions"])[0]
    c2p = qh @ kp64.permute(1, 2, 0)  # [B, H, S, 2·span]
    scores = qh @ kh.transpose(-1, -2) + torch.gather(c2p, -1, torch.clamp(rel + span, 0, 2 * span - 1)
                                                      .expand(b, h, s_len, s_len))
    p2c = kh @ qp64.permute(1, 2, 0)
    scores = scores + torch.gather(p2c, -1, torch.clamp(-rel + span, 0, 2 * span - 1)
                                   .expand(b, h, s_len, s_len)).transpose(-1, -2)
    scores = scores * geometry["scale"]
    if mask is not None:
        pair = mask[:, None, :, None] & mask[:, None, None, :]
        scores = scores.masked_fill(~pair, torch.finfo(torch.float64).min)
    probs = torch.softmax(scores, dim=-1)
    if keep is not None:
        probs = probs * keep.double() / (1.0 - p)
    out = (probs @ vh).transpose(1, 2)
    out.backward(g.double())
    return [out.detach()] + [t.grad for t in leaves]


def _position_tables(ctx: Context, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    s = ctx.sizes
    return tuple(_randn(ctx, 2 * s.position_buckets, s.heads, s.head_dim, scale=0.5).to(dtype) for _ in range(2))


DISENTANGLED_OUTPUTS = ("out", "dq", "dk", "dv", "dpos_key", "dpos_query")


def check_disentangled_padded(ctx: Context, dtype: torch.dtype) -> tuple[list[Comparison], float, float]:
    from tempo.ops.disentangled_attention import disentangled_attention, disentangled_attention_keep_mask

    s = ctx.sizes
    q = _randn(ctx, s.batch, s.seq, s.heads, s.head_dim, scale=0.5).to(dtype)
    k, v, g = (_randn(ctx, s.batch, s.seq, s.heads, s.head_dim).to(dtype) for _ in range(3))
    kp, qp = _position_tables(ctx, dtype)
    mask = _padding(ctx)
    seed = torch.tensor(77, device=ctx.device)
    got, first, second = twice(ctx.device, lambda *leaves: disentangled_attention(
        *leaves, padding_mask=mask, dropout_p=DROPOUT_P, seed=seed, **_disentangled_geometry(ctx)),
        (q, k, v, kp, qp), g)
    keep = disentangled_attention_keep_mask(seed, s.batch, s.heads, s.seq, DROPOUT_P, backend="triton")
    _check_keep_rate(ctx, keep.double().mean().item(), "disentangled attention")
    ref = _disentangled_fp64(ctx, q, k, v, kp, qp, g, mask, keep, DROPOUT_P)
    return compare_all(DISENTANGLED_OUTPUTS, got, ref, TOL[dtype]), first, second


def check_disentangled_varlen(ctx: Context, dtype: torch.dtype) -> tuple[list[Comparison], float, float]:
    from tempo.ops.disentangled_attention import disentangled_attention_keep_mask, disentangled_attention_varlen

    s = ctx.sizes
    q, k, v, g, cu, offsets = _packed(ctx, dtype)
    kp, qp = _position_tables(ctx, dtype)
    seed = torch.tensor(78, device=ctx.device)
    got, first, second = twice(ctx.device, lambda ql, kl, vl, kpl, qpl: disentangled_attention_varlen(
        ql, kl, vl, cu, max(s.varlen), kpl, qpl, dropout_p=DROPOUT_P, seed=seed, **_disentangled_geometry(ctx)),
        (q, k, v, kp, qp), g)
    keeps = disentangled_attention_keep_mask(seed, 0, s.heads, 0, DROPOUT_P, backend="triton", cu_seqlens=cu)
    _check_keep_rate(ctx, torch.cat([m.flatten() for m in keeps]).double().mean().item(), "disentangled (varlen)")
    outs, grads = [], [torch.zeros(t.shape, dtype=torch.float64, device=ctx.device) for t in (q, k, v, kp, qp)]
    for n, (a, b) in enumerate(zip(offsets[:-1], offsets[1:])):
        part = _disentangled_fp64(ctx, *(t[a:b].unsqueeze(0) for t in (q, k, v)), kp, qp, g[a:b].unsqueeze(0),
                                  keep=keeps[n].unsqueeze(0), p=DROPOUT_P)
        outs.append(part[0][0])
        for j in range(3):
            grads[j][a:b] = part[1 + j][0]
        grads[3] += part[4]
        grads[4] += part[5]
    return compare_all(DISENTANGLED_OUTPUTS, got, [torch.cat(outs)] + grads, TOL[dtype]), first, second


# name -> (what it checks, function(ctx, dtype)); in the order they run
LAYER_CHECKS: dict[str, tuple[str, Callable[..., tuple[list[Comparison], float, float]]]] = {
    "gelu-exact": ("In-place GELU, exact (erf) form: y, dx (dy = 1)", lambda c, d: check_gelu(c, d, "none")),
    "gelu-tanh": ("In-place GELU, tanh form: y, dx (dy = 1)", lambda c, d: check_gelu(c, d, "tanh")),
    "layernorm-kept-columns": ("In-place LayerNorm, γ in {0, 1e-30, -1e-6, 1e-3} with |β| = 10 (kept columns)",
                               check_layernorm),
    "dropout-add-layernorm": ("dropout → add → LayerNorm (p = 0.1, its mask from the seed; kept columns too)",
                              check_dropout_add_layernorm),
    "combined": ("Combined softmax → dropout → matmul (p = 0.1, its mask from the seed)", check_combined),
    "geglu-linear": ("GeGLU fused with its down projection (tanh GELU, dropout 0.1, its mask from the seed)",
                     check_gated_mlp),
    "fused-lm-head": ("LM head + cross-entropy without logits (odd vocabulary, ignored rows, smoothing, z-loss, "
                      "softcap): loss per row, dx, dweight", check_fused_lm_head),
}
ATTENTION_CHECKS: dict[str, tuple[str, Callable[..., tuple[list[Comparison], float, float]]]] = {
    "attention-padded": ("efficient attention, bool key padding, no dropout",
                         lambda c, d: check_efficient_attention_padded(c, d, False)),
    "attention-padded-dropout": ("efficient attention, key padding, dropout 0.1: replayed mask, fwd and bwd",
                                 lambda c, d: check_efficient_attention_padded(c, d, True)),
    "attention-varlen": ("efficient attention, packed sequences, no dropout",
                         lambda c, d: check_efficient_attention_varlen(c, d, False)),
    "attention-varlen-dropout": ("efficient attention, packed sequences, dropout 0.1: replayed mask",
                                 lambda c, d: check_efficient_attention_varlen(c, d, True)),
    "disentangled-padded-dropout": ("DeBERTa disentangled attention (c2p + p2c, 256 buckets), padding, dropout 0.1",
                                    check_disentangled_padded),
    "disentangled-varlen-dropout": ("DeBERTa disentangled attention, packed sequences, dropout 0.1",
                                    check_disentangled_varlen),
}


def _path_of(ctx: Context, name: str) -> str:
    """What runs the op here: Triton kernels, PyTorch's fused sdpa kernels, or plain torch ops."""
    if name.startswith("attention"):
        return "sdpa fused kernels (flash / efficient)" if ctx.cuda else "reference op (tiled PyTorch)"
    return "triton" if ctx.cuda else "triton (interpreter)"


def run_checks(ctx: Context, checks: dict[str, tuple[str, Callable]]) -> int:
    """Every check in each of ``sizes.check_dtypes`` (bf16, fp16), one row of "checks" each
    (``run_rows``: recorded as it finishes, an exception is the check's "error", after a lost CUDA
    context the rest are "not-run"). A check with any output over its tolerance is "failed" and
    names those outputs: the stage then exits CHECKS_FAILED_EXIT, which the runner records as the
    stage's failure."""
    _warm_up(ctx.device)
    ctx.record.update({"sizes": ctx.sizes.as_record(), "device": str(ctx.device),
                       "tolerance_rule": "max |actual - fp64| / max |fp64| (LayerNorm: / max(1, max |fp64|))"})
    ctx.write()
    return run_rows(ctx, "checks", [
        (f"{name} ({_dtype_name(dtype)})",
         {"name": name, "dtype": _dtype_name(dtype), "what": what, "path": _path_of(ctx, name)},
         functools.partial(_run_check, ctx, fn, dtype))
        for name, (what, fn) in checks.items() for dtype in ctx.sizes.check_dtypes])


def _run_check(ctx: Context, fn: Callable, dtype: torch.dtype, row: dict[str, Any]) -> None:
    torch.manual_seed(0)
    with _tempo_warnings() as warnings:
        try:
            comparisons, first, second = fn(ctx, dtype)
        finally:
            if warnings:
                row["tempo_warnings"] = warnings
    row.update(errors={c.what: c.error for c in comparisons}, tolerances={c.what: c.tolerance for c in comparisons},
               first_call_s=round(first, 4), second_call_s=round(second, 4),
               compile_s=round(max(0.0, first - second), 4))
    bad = [f"{c.what} {c.error:.2e} > {c.tolerance:.0e}" for c in comparisons if not c.ok]
    if bad:
        row.update(status="failed", message="over the tolerance: " + ", ".join(bad))


def _warm_up(device: torch.device) -> None:
    """CUDA context, cuBLAS and the caching allocator, so that the first check's first call times
    its own compile only."""
    a = torch.randn(256, 256, device=device)
    (a @ a).sum().item()
    if device.type == "cuda":
        torch.randn(256, 256, device=device, dtype=torch.bfloat16).matmul(
            torch.randn(256, 256, device=device, dtype=torch.bfloat16)).sum().item()


# ------------------------------------------------------------------------------------------------
# BERT-large for the memory and max-batch stages: transformers' BertForPreTraining, stock or Tempo
# ------------------------------------------------------------------------------------------------
MODEL_VARIANTS = ("stock-sdpa", "tempo")


def bert_config(ctx: Context):
    import transformers

    s = ctx.sizes
    return transformers.BertConfig(
        vocab_size=s.vocab, hidden_size=s.hidden, num_hidden_layers=s.bert_layers, num_attention_heads=s.heads,
        intermediate_size=s.ffn, max_position_embeddings=512, hidden_dropout_prob=DROPOUT_P,
        attention_probs_dropout_prob=DROPOUT_P, attn_implementation="sdpa")


def _built(ctx: Context, make: Callable[[], torch.nn.Module], tempo: bool) -> torch.nn.Module:
    """``make()`` built on the device (no CPU copy) from seed 0, in training mode; with ``tempo``,
    after apply_tempo(module), its default (every Tempo layer, the efficient attention)."""
    from tempo.integrations.patch import apply_tempo

    torch.manual_seed(0)
    with torch.device(ctx.device):
        module = make()
    if tempo:
        apply_tempo(module)
    return module.train()


def build_bert(ctx: Context, variant: str) -> torch.nn.Module:
    """BertForPreTraining (``_built``), stock or "tempo"."""
    import transformers

    return _built(ctx, lambda: transformers.BertForPreTraining(bert_config(ctx)), variant == "tempo")


def pretraining_batch(ctx: Context, batch: int, seq: int, device: Optional[torch.device] = None) -> dict:
    """Random tokens, no padding, MLM labels on 15 % of the positions (the rest -100), NSP labels."""
    device = device or ctx.device
    g = torch.Generator().manual_seed(batch)
    ids = torch.randint(3, ctx.sizes.vocab, (batch, seq), generator=g)
    labels = torch.full((batch, seq), -100, dtype=torch.int64)
    predictions = max(1, int(0.15 * seq))
    labels[:, 1:1 + predictions] = ids[:, 1:1 + predictions]
    return {"input_ids": ids.to(device), "attention_mask": torch.ones(batch, seq, dtype=torch.int64, device=device),
            "token_type_ids": torch.zeros(batch, seq, dtype=torch.int64, device=device), "labels": labels.to(device),
            "next_sentence_label": torch.zeros(batch, dtype=torch.int64, device=device)}


def _autocast(device: torch.device):
    return torch.autocast(device.type, dtype=torch.bfloat16)


def training_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: dict,
                  ledger: Optional[Any] = None) -> float:
    """One step: zero_grad(set_to_none), forward under bf16 autocast (inside ``ledger`` when given),
    backward, the optimizer's step. Returns the loss (a host read: the step is over)."""
    optimizer.zero_grad(set_to_none=True)
    with (ledger if ledger is not None else contextlib.nullcontext()), _autocast(next(model.parameters()).device):
        output = model(**batch)  # held through backward (its logits too), as tempo.plan counts a step
    output.loss.backward()
    optimizer.step()
    return float(output.loss.detach())


def make_optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)


def planner_peak_bytes(ctx: Context, variant: str, batch: int, seq: int) -> int:
    """tempo.plan's predicted peak for this very step (the model as built here, fused AdamW, bf16
    autocast, every block without recompute), counted on fake tensors: for a CUDA run with the GPU's
    semantics (device "h100", the CUDA allocator's rounding), on the CPU with the CPU's."""
    import transformers

    from tempo.plan.planner import count

    with torch.device("meta"):
        model = transformers.BertForPreTraining(bert_config(ctx))
    counted = count(model, seq, "h100" if ctx.cuda else "cpu", "bf16", "adamw-fused",
                    tempo=variant == "tempo")
    return counted.peak_at(("none",) * counted.blocks, batch * seq).total


def predicted_activation_bytes(ctx: Context, variant: str, batch: int, seq: int) -> int:
    """What the ledger counts for the same forward on fake tensors (no memory, no compute; ~1 s at
    BERT-large size): the model built on the meta device, made fake, its forward traced under CPU
    autocast. For a CUDA run the trace takes CUDA's decisions (tempo.movement.trace.CudaSemantics:
    fp32 softmax / loss policies, 1-byte dropout masks, the fused sdpa kernels); for a CPU run the
    CPU's, so that it equals the real CPU ledger byte for byte."""
    import transformers

    from tempo.integrations.patch import apply_tempo
    from tempo.memory.fake import FakeSession
    from tempo.movement.trace import CudaSemantics

    session = FakeSession()
    config = bert_config(ctx)
    model = session.module(lambda: transformers.BertForPreTraining(config).train(),
                           apply_tempo if variant == "tempo" else None)
    inputs = pretraining_batch(ctx, batch, seq, device=torch.device("cpu"))
    semantics = CudaSemantics() if ctx.cuda else contextlib.nullcontext()
    with session.ledger(model) as ledger, semantics, torch.autocast("cpu", dtype=torch.bfloat16):
        model(**inputs)
    return ledger.activation_bytes


# ------------------------------------------------------------------------------------------------
# Stage 3: memory truth
# ------------------------------------------------------------------------------------------------
def stage_memory(ctx: Context) -> int:
    """Per variant (a row each, ``run_rows``): a warm-up step (allocates AdamW's moments), then a step
    whose allocator peak is measured (CUDA) and whose forward runs under the activation ledger,
    beside the predictions."""
    batch, seq = ctx.sizes.memory_shape
    ctx.record.update({"model": "transformers BertForPreTraining", "config": json.loads(bert_config(ctx).to_json_string()),
                       "batch": batch, "seq_len": seq, "precision": "bf16 autocast", "optimizer": "AdamW(fused=True)",
                       "dropout": DROPOUT_P, "device": str(ctx.device),
                       "prediction_methods": {
                           "ledger_activation_bytes": "ActivationLedger on the real step (what autograd keeps)",
                           "fake_activation_bytes": "the ledger on fake tensors, CUDA semantics for a CUDA run "
                                                    "(tempo.memory.fake + tempo.movement.trace.CudaSemantics)",
                           "rule_peak_bytes": "python -m tempo.memory's rule: weights + gradients + Adam moments "
                                              "(exact byte counts) + fake_activation_bytes",
                           "planner_peak_bytes": "tempo.plan's predicted peak of this step (weights, gradients, "
                                                 "optimizer states, activations, transients, cuBLAS workspace "
                                                 "margin), counted on fake tensors"}})
    ctx.write()
    return run_rows(ctx, "rows", [(variant, {"variant": variant},
                                   functools.partial(measure_memory, ctx, variant, batch, seq))
                                  for variant in MODEL_VARIANTS])


def measure_memory(ctx: Context, variant: str, batch: int, seq: int, row: dict[str, Any]) -> None:
    """Fills ``row`` as it goes (what was measured before a failure stays). Its model and optimizer
    are locals: gone when it returns or raises, before the next variant is built."""
    from tempo.integrations.patch import tempo_patched
    from tempo.memory import ActivationLedger, gradient_bytes, optimizer_state_bytes, weight_bytes

    row["fake_activation_bytes"] = predicted_activation_bytes(ctx, variant, batch, seq)
    model = build_bert(ctx, variant)
    row["tempo_patched"] = tempo_patched(model)
    optimizer = make_optimizer(model)
    inputs = pretraining_batch(ctx, batch, seq)
    row["first_loss"] = training_step(model, optimizer, inputs)  # AdamW's moments exist from here on
    optimizer.zero_grad(set_to_none=True)
    synchronize(ctx.device)
    if ctx.cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(ctx.device)
        row["allocated_before_step_bytes"] = torch.cuda.memory_allocated(ctx.device)
    ledger = ActivationLedger(model)
    row["loss"] = training_step(model, optimizer, inputs, ledger)
    synchronize(ctx.device)
    if ctx.cuda:
        row["measured_peak_bytes"] = torch.cuda.max_memory_allocated(ctx.device)
        row["measured_peak_reserved_bytes"] = torch.cuda.max_memory_reserved(ctx.device)
    else:
        row["measured_peak_bytes"] = None
        row["measured_peak_note"] = "the CPU has no allocator peak counter: the ledger and exact byte counts only"
    row["ledger_activation_bytes"] = ledger.activation_bytes
    row["weight_bytes"] = weight_bytes(model)
    row["gradient_bytes"] = gradient_bytes(model)
    row["optimizer_state_bytes"] = optimizer_state_bytes(optimizer)
    row["parameters"] = sum(p.numel() for p in model.parameters())
    static = row["weight_bytes"] + row["gradient_bytes"] + row["optimizer_state_bytes"]
    row["rule_peak_bytes"] = static + row["fake_activation_bytes"]
    row["planner_peak_bytes"] = planner_peak_bytes(ctx, variant, batch, seq)
    if row["measured_peak_bytes"] is not None:
        row["measured_minus_rule_bytes"] = row["measured_peak_bytes"] - row["rule_peak_bytes"]


# ------------------------------------------------------------------------------------------------
# Stage 4: speed of one layer (eager, then compiled)
# ------------------------------------------------------------------------------------------------
def hf_bert_layer(ctx: Context, tempo: bool) -> torch.nn.Module:
    import transformers
    from transformers.models.bert.modeling_bert import BertLayer

    s = ctx.sizes
    config = transformers.BertConfig(hidden_size=s.hidden, num_attention_heads=s.heads, intermediate_size=s.ffn,
                                     hidden_dropout_prob=DROPOUT_P, attention_probs_dropout_prob=DROPOUT_P,
                                     attn_implementation="sdpa")
    return _built(ctx, lambda: BertLayer(config), tempo)


def deberta_config(ctx: Context):
    """DeBERTa-v3-large's layer (tempo.movement.workloads' config): 256 position buckets, c2p + p2c."""
    import transformers

    s = ctx.sizes
    return transformers.DebertaV2Config(
        hidden_size=s.hidden, num_hidden_layers=1, num_attention_heads=s.heads, intermediate_size=s.ffn,
        relative_attention=True, position_buckets=s.position_buckets, max_relative_positions=-1,
        max_position_embeddings=s.max_relative_positions, pos_att_type=["p2c", "c2p"], share_att_key=True,
        norm_rel_ebd="layer_norm", position_biased_input=False, type_vocab_size=0, hidden_dropout_prob=DROPOUT_P,
        attention_probs_dropout_prob=DROPOUT_P)


def deberta_layer(ctx: Context, tempo: bool) -> torch.nn.Module:
    """DebertaV2Encoder with one layer (the layer plus its relative-embedding LayerNorm)."""
    from transformers.models.deberta_v2.modeling_deberta_v2 import DebertaV2Encoder

    return _built(ctx, lambda: DebertaV2Encoder(deberta_config(ctx)), tempo)


@dataclass(frozen=True)
class SpeedCase:
    model: str  # "bert-large" | "deberta-v3-large"
    variant: str  # "hf-sdpa", "tempo", "deberta-eager", ...
    batch: int
    seq: int
    compiled: bool = False
    projection: Optional[str] = None  # the tempo.movement choice whose projected time stands beside it

    @property
    def label(self) -> str:
        return self.variant + ("+compile" if self.compiled else "")


def speed_cases(ctx: Context, compiled: bool) -> list[SpeedCase]:
    cases = []
    for batch, seq in ctx.sizes.layer_shapes:
        cases.append(SpeedCase("bert-large", "hf-sdpa", batch, seq, compiled, None if compiled else "sdpa"))
        cases.append(SpeedCase("bert-large", "tempo", batch, seq, compiled, None if compiled else "floor"))
    if not compiled:
        batch, seq = ctx.sizes.deberta_shape
        cases.append(SpeedCase("deberta-v3-large", "deberta-eager", batch, seq, False, "deberta-eager"))
        cases.append(SpeedCase("deberta-v3-large", "deberta-tempo", batch, seq, False, "deberta-tempo"))
    return cases


def _layer_call(ctx: Context, case: SpeedCase
                ) -> tuple[Callable[[torch.Tensor], torch.Tensor], torch.dtype, torch.nn.Module]:
    """(callable(hidden) -> output, the dtype its input arrives in inside a model, the module): a
    stock layer gets fp32 (nn.LayerNorm's output under autocast), a Tempo layer bf16 (its fused
    LayerNorm's)."""
    tempo = case.variant in ("tempo", "deberta-tempo")
    in_dtype = torch.bfloat16 if tempo else torch.float32
    if case.model == "bert-large":
        module = hf_bert_layer(ctx, tempo)

        def call(hidden):
            out = module(hidden)
            return out[0] if isinstance(out, tuple) else out
    else:
        module = deberta_layer(ctx, tempo)
        mask = torch.ones(case.batch, case.seq, dtype=torch.int64, device=ctx.device)

        def call(hidden):
            return module(hidden, mask, output_hidden_states=False).last_hidden_state
    if case.compiled:
        torch._dynamo.reset()  # each compile on its own: no recompile limits, no automatic dynamic shapes
        call = torch.compile(call, dynamic=False, backend="inductor" if ctx.cuda else "aot_eager")
    return call, in_dtype, module


def time_case(ctx: Context, case: SpeedCase, row: dict[str, Any]) -> None:
    """Fills ``row`` with the case's first call (compiles included) and its timed calls."""
    from tempo.bench.timing import spread, time_fn

    call, in_dtype, module = _layer_call(ctx, case)
    torch.manual_seed(1)
    base = torch.randn(case.batch, case.seq, ctx.sizes.hidden, device=ctx.device, dtype=in_dtype)
    grad = torch.randn(case.batch, case.seq, ctx.sizes.hidden, device=ctx.device, dtype=torch.bfloat16)
    state: dict[str, torch.Tensor] = {}

    def fresh_input() -> None:  # outside the timed region: a new input, the gradients of a new step
        state["x"] = base.clone().requires_grad_()
        module.zero_grad(set_to_none=True)

    def step() -> None:
        with _autocast(ctx.device):
            out = call(state["x"])
        out.backward(grad.to(out.dtype))

    fresh_input()
    synchronize(ctx.device)
    start = time.perf_counter()
    step()  # the first call: Triton's JIT, torch.compile's compile
    synchronize(ctx.device)
    first_call_s = time.perf_counter() - start
    times = time_fn(step, ctx.device, warmup=ctx.sizes.warmup, repeats=ctx.sizes.repeats, setup=fresh_input)
    ms = spread(times)
    row.update({"compile_backend": ("inductor" if ctx.cuda else "aot_eager") if case.compiled else None,
                "projection_choice": case.projection, "first_call_s": round(first_call_s, 3),
                "ms": {**ms, "min": min(times), "max": max(times)}, "raw_ms": times, "warmup": ctx.sizes.warmup,
                "repeats": ctx.sizes.repeats, "timer": "CUDA events" if ctx.cuda else "perf_counter",
                "tokens_per_s": case.batch * case.seq / (ms["p50"] / 1e3) if ms["p50"] > 0 else None})


def run_speed(ctx: Context, compiled: bool) -> int:
    """Every case of ``speed_cases``, a row each (``run_rows``)."""
    ctx.record.update({"what": "one layer, forward + backward, bf16 autocast, dropout 0.1, training mode, no padding",
                       "device": str(ctx.device), "sizes": ctx.sizes.as_record()})
    ctx.write()
    return run_rows(ctx, "rows", [
        (f"{c.model} {c.label} b{c.batch} s{c.seq}",
         {"model": c.model, "variant": c.label, "batch": c.batch, "seq_len": c.seq, "compiled": c.compiled},
         functools.partial(time_case, ctx, c)) for c in speed_cases(ctx, compiled)])


# ------------------------------------------------------------------------------------------------
# Projections: python -m tempo.movement for the same layers
# ------------------------------------------------------------------------------------------------
def movement_argv(out_json: Path) -> list[str]:
    """The tempo.movement command for the speed stage's BERT-large and DeBERTa layers (its default
    batches are the speed stage's: 96 at s = 128, 8 at s = 512)."""
    return ["--seq-lens", "128", "512", "--choices", "sdpa", "floor", "--no-unpad", "--deberta",
            "--json", str(out_json)]


def stage_projections(ctx: Context) -> int:
    """Runs tempo.movement's own command line (shapes are BERT-large's on fake tensors: no GPU, no
    tiny variant) and keeps its JSON as projections.json."""
    from tempo.movement.cli import main as movement_main

    return movement_main(movement_argv(ctx.path))


# ------------------------------------------------------------------------------------------------
# Stage 5: the largest batch at s = 512
# ------------------------------------------------------------------------------------------------
@dataclass
class Search:
    """A largest-batch search: double from ``start`` until a probe fails (or ``cap``), then bisect
    to ``resolution``; stops early at ``deadline`` (time.monotonic()), leaving the bounds it has."""

    start: int
    resolution: int
    cap: int
    deadline: float
    probes: list[dict[str, Any]] = field(default_factory=list)
    largest_fitting: Optional[int] = None
    smallest_failing: Optional[int] = None
    on_probe: Optional[Callable[["Search"], None]] = None  # after every probe (the stage writes its JSON)

    def run(self, fits: Callable[[int], bool]) -> bool:
        """True when the search finished (bounds within ``resolution``, or the cap fits)."""
        batch = self.start
        while True:
            if time.monotonic() > self.deadline:
                return False
            t0 = time.perf_counter()
            ok = fits(batch)
            self.probes.append({"batch": batch, "fits": ok, "seconds": round(time.perf_counter() - t0, 3)})
            if ok:
                self.largest_fitting = batch
            else:
                self.smallest_failing = batch
            if self.on_probe is not None:
                self.on_probe(self)
            lo, hi = self.largest_fitting, self.smallest_failing
            if hi is None:
                if batch >= self.cap:
                    return True
                batch = min(self.cap, batch * 2)
                continue
            if lo is None:
                if batch <= 1:
                    return True
                batch = max(1, batch // 2)
                continue
            if hi - lo <= self.resolution:
                return True
            batch = lo + max(1, (hi - lo) // (2 * self.resolution)) * self.resolution
            if batch >= hi:
                batch = (lo + hi) // 2


def stage_max_batch(ctx: Context) -> int:
    """Per variant (a row each, ``run_rows``): build the model, one step at batch 1 (AdamW's
    moments), then the search; each probe one training step. On CUDA a probe fits unless it runs
    out of memory (then its memory is freed before the next); on the CPU against
    ``simulated_budget``: static bytes + the ledger's activation bytes of the step.

    Time: the searches together get ``budget_s`` (default MAXBATCH_BUDGET_S), less where the runner
    gives the stage less (TEMPO_STAGE_TIMEOUT_S − MAXBATCH_START_S). Variant i of n (from 0) gets,
    as it starts, the stage's time left / (n − i): a variant that finishes early leaves its unused
    time to the ones after it, and the last gets all that is left."""
    seq = ctx.sizes.maxbatch_seq
    start, resolution, cap = ctx.sizes.maxbatch
    budget_s = ctx.budget_s if ctx.budget_s is not None else MAXBATCH_BUDGET_S
    given = os.environ.get("TEMPO_STAGE_TIMEOUT_S")  # what the suite gives this stage (less near its deadline)
    if given:
        budget_s = max(0.0, min(budget_s, float(given) - MAXBATCH_START_S))
    stage_deadline = time.monotonic() + budget_s
    ctx.record.update({"seq_len": seq, "model": "transformers BertForPreTraining", "precision": "bf16 autocast",
                       "optimizer": "AdamW(fused=True)", "search": {"start": start, "resolution": resolution,
                                                                     "cap": cap, "budget_s": budget_s},
                       "device": str(ctx.device), "allocator": os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),
                       "memory": ("CUDA out of memory" if ctx.cuda else
                                  f"simulated budget of {ctx.simulated_budget} bytes (static + ledger activations)")})
    ctx.write()

    def search(index: int, variant: str, row: dict[str, Any]) -> None:
        now = time.monotonic()
        search_largest_batch(ctx, variant, seq, now + (stage_deadline - now) / (len(MODEL_VARIANTS) - index), row)

    return run_rows(ctx, "rows", [(variant, {"variant": variant}, functools.partial(search, index, variant))
                                  for index, variant in enumerate(MODEL_VARIANTS)])


def search_largest_batch(ctx: Context, variant: str, seq: int, deadline: float, row: dict[str, Any]) -> None:
    """One variant's search, into ``row``. Its model and optimizer are locals: gone when it returns
    or raises, before the next variant is built."""
    from tempo.memory import ActivationLedger, gradient_bytes, optimizer_state_bytes, weight_bytes

    start, resolution, cap = ctx.sizes.maxbatch
    model = build_bert(ctx, variant)
    optimizer = make_optimizer(model)
    training_step(model, optimizer, pretraining_batch(ctx, 1, seq))  # AdamW's moments
    optimizer.zero_grad(set_to_none=True)
    static = weight_bytes(model) + gradient_bytes(model) + optimizer_state_bytes(optimizer)
    row["static_bytes"] = static

    def fits(batch: int) -> bool:
        inputs = pretraining_batch(ctx, batch, seq)
        ledger = None if ctx.cuda else ActivationLedger(model)
        oom = False
        try:
            training_step(model, optimizer, inputs, ledger)
        except Exception as exc:  # noqa: BLE001 - only running out of memory is an answer
            if not _is_oom(exc):
                raise
            oom = True  # the step's tensors go with the exception's frames at the end of this block
        optimizer.zero_grad(set_to_none=True)
        del inputs
        if ctx.cuda:
            gc.collect()
            torch.cuda.empty_cache()
            return not oom
        return static + ledger.activation_bytes <= ctx.simulated_budget

    def record(search: Search) -> None:  # written after every probe: a stage stopped at its limit keeps them
        row.update(largest_fitting=search.largest_fitting, smallest_failing=search.smallest_failing,
                   probes=search.probes)
        ctx.write()

    row["complete"] = Search(start, resolution, cap, deadline, on_probe=record).run(fits)


# ------------------------------------------------------------------------------------------------
# Command line: one stage
# ------------------------------------------------------------------------------------------------
STAGE_FUNCTIONS: dict[str, Callable[[Context], int]] = {  # every stage of the quick plan (gpu_suite.QUICK_LIMITS_S)
    "env": stage_env,
    "correctness-layers": lambda ctx: run_checks(ctx, LAYER_CHECKS),
    "correctness-attention": lambda ctx: run_checks(ctx, ATTENTION_CHECKS),
    "memory": stage_memory,
    "speed": lambda ctx: run_speed(ctx, compiled=False),
    "projections": stage_projections,
    "speed-compiled": lambda ctx: run_speed(ctx, compiled=True),
    "max-batch": stage_max_batch,
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("stage", choices=tuple(STAGE_FUNCTIONS))
    p.add_argument("--out", required=True, help="the run directory: <stage>.json goes here")
    p.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    p.add_argument("--tiny", action="store_true", help="tiny shapes (for the CPU: the tests run every stage so)")
    p.add_argument("--budget-s", type=float, default=None,
                   help=f"max-batch: seconds of probing for both variants (default {MAXBATCH_BUDGET_S})")
    p.add_argument("--simulated-budget", default=None,
                   help=f"max-batch on the CPU: the memory a step may take (default {DEFAULT_SIMULATED_BUDGET})")
    return p


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    from tempo.bench.common import BenchError
    from tempo.utils import parse_bytes

    try:
        device = torch.device(args.device)
    except RuntimeError:
        print(f"{PROG}: error: --device {args.device!r} is not a torch device; use cuda or cpu", file=sys.stderr)
        return 1
    try:
        if device.type not in ("cuda", "cpu"):
            raise BenchError(f"--device {args.device}: must be cuda or cpu")
        if device.type == "cuda" and not torch.cuda.is_available():
            raise BenchError(f"--device {args.device}: no CUDA GPU visible (torch {torch.__version__}); "
                             f"--device cpu --tiny runs the stage on the CPU")
        if device.type == "cpu" and args.stage not in ("env", "projections"):
            from tempo.ops._backend import triton_interpreting

            if not triton_interpreting():
                raise BenchError("--device cpu runs the Triton kernels through Triton's interpreter: set "
                                 "TRITON_INTERPRET=1 in the environment before starting")
        if device.type == "cuda":
            from tempo.bench.timing import resolve_device

            device = resolve_device(device)
        try:
            simulated = parse_bytes(args.simulated_budget or DEFAULT_SIMULATED_BUDGET)
        except ValueError as exc:
            raise BenchError(f"--simulated-budget: {exc}") from None
    except BenchError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 1
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    ctx = Context(args.stage, out, device, TINY if args.tiny else REAL, budget_s=args.budget_s,
                  simulated_budget=simulated)
    ctx.record = {"kind": f"gpu_quick.{args.stage}", "stage": args.stage, "device": str(device),
                  "sizes": ctx.sizes.name, "command": " ".join([PROG, *(sys.argv[1:] if argv is None else argv)]),
                  "complete": False}
    if args.stage != "projections":  # tempo.movement writes that file itself, in its own format
        ctx.write()
    return STAGE_FUNCTIONS[args.stage](ctx)


if __name__ == "__main__":
    sys.exit(main())
