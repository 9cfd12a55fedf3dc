"""Recording every aten op a training step runs, on the CPU, as the CUDA build would run it.

A step is traced with fake tensors (``torch._subclasses.FakeTensorMode``): shapes, dtypes and
strides are exact, no data exists, so a BERT-large step costs milliseconds per op. Three pieces:

``FakeSession``
    owns the FakeTensorMode. ``fake_module`` turns a model built on the meta device into one whose
    parameters and buffers are fake CPU tensors (tied parameters stay tied). Tensors the caller
    makes outside the mode (token ids, attention masks) stay real: an op whose inputs are all real
    (or a small factory: ``arange``, a seed) runs for real, so the data-dependent host reads the
    model makes (``bool(mask.all())``, ``TokenLayout.from_mask``) see real values. Everything that
    touches a weight is fake.

``CudaSemantics`` (a ``TorchFunctionMode``)
    A CPU-only torch cannot make CUDA fake tensors that autograd accepts, so the trace runs on CPU
    fake tensors, and this mode makes the CPU take the CUDA build's decisions where they differ:
      * autocast: CPU autocast casts the GEMMs (linear, matmul, mm, bmm, addmm, baddbmm) exactly as
        CUDA's does; CUDA's fp32 policies, which the CPU lacks, are applied here (ATen's
        ``AT_FORALL_FP32`` and ``AT_FORALL_FP32_SET_OPT_DTYPE``: softmax/log_softmax/sum/cumsum/prod
        return fp32, layer_norm, exp, log, pow, rsqrt, the losses ... run in fp32) and
        ``cross_entropy`` as CUDA decomposes it (log_softmax in the logits' dtype, nll_loss in fp32);
      * dropout: ``F.dropout`` in training is ``aten.native_dropout`` (CUDA's fused kernel: a bool
        mask), where the CPU decomposes it into bernoulli_/div_/mul with a mask of x's dtype;
      * ``F.scaled_dot_product_attention``: the fused kernel CUDA's dispatcher picks
        (``aten._scaled_dot_product_flash_attention`` for 16-bit inputs without a mask and head dim
        <= 256, else ``_scaled_dot_product_efficient_attention``), never the math decomposition.
        Nested jagged inputs (the unpadded sdpa path) go to ``aten._flash_attention_forward`` with
        their offsets, as torch's nested sdpa does on CUDA.

``Recorder`` (a ``TorchDispatchMode``)
    records each op below autograd: name, arguments with tensors replaced by ``TensorMeta``,
    outputs, forward or backward, and FLOPs from ``torch.utils.flop_counter``'s formulas. View ops
    are not recorded (they move nothing). Tempo's LayerNorm forward ops keep x̂ of K "kept"
    columns, planned from γ/β's values by ``tempo.layernorm_plan``: on fake γ/β that plan is recorded
    with K = 0 (γ = 1, β = 0 at initialisation recovers every column; see tempo/ops/layernorm.py)
    and says so in ``OpCall.note``; the forward ops' outputs follow it.
"""

from __future__ import annotations

import contextlib
import functools
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional

import torch
import torch.nn.functional as F
import torch.utils._pytree as pytree
from torch import Tensor, nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode, unset_fake_temporarily
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

from tempo.ops.layernorm import outputs_with_no_kept_columns
from tempo.utils import fake_parameters

aten = torch.ops.aten

# Factories whose output is at most this many elements run for real when nothing fake feeds them
# (seeds, position indices, small masks); larger ones stay fake.
REAL_FACTORY_NUMEL = 1 << 20

# Ops that move no data: metadata queries and aliases. Views are recognised by their schema
# (OpOverload.is_view); these are the aliasing ops the schema does not mark.
_NO_DATA_OPS = {
    aten._unsafe_view.default, aten.lift_fresh.default, aten.sym_size.int, aten.sym_stride.int,
    aten.sym_numel.default, aten.sym_storage_offset.default, aten.is_same_size.default,
    aten.empty.memory_format, aten.empty_strided.default, aten.empty_like.default,
    aten.new_empty.default, aten.new_empty_strided.default, aten.set_.source_Storage_storage_offset,
    aten._local_scalar_dense.default, aten.is_nonzero.default,
}


@functools.lru_cache(maxsize=None)
def itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype, device="meta").element_size()


@dataclass(frozen=True)
class TensorMeta:
    """What the byte count needs of a tensor: shape, strides, dtype."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype

    @classmethod
    def of(cls, t: Tensor) -> "TensorMeta":
        return cls(tuple(int(n) for n in t.shape), tuple(int(s) for s in t.stride()), t.dtype)

    @property
    def itemsize(self) -> int:
        return itemsize(self.dtype)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        """Bytes of the elements one pass touches: a broadcast (stride 0) dim counts once, as in
        ``torch.utils._runtime_estimation.get_num_bytes``."""
        return math.prod(n for n, s in zip(self.shape, self.stride) if s != 0) * self.itemsize

    @property
    def is_contiguous(self) -> bool:
        expected = 1
        for n, s in zip(reversed(self.shape), reversed(self.stride)):
            if n != 1 and s != expected:
                return False
            expected *= n
        return True


@dataclass
class OpCall:
    """One recorded op: ``args`` bound to the schema's argument names, tensors as TensorMeta."""

    op: str  # "aten.mm.default", "tempo.layernorm_fwd.default", ...
    packet: str  # "aten.mm", "tempo.layernorm_fwd"
    args: dict[str, Any]
    outputs: tuple[Any, ...]  # TensorMeta or other values, flattened
    phase: str  # "forward" or "backward"
    flops: int  # torch.utils.flop_counter's count (0 where it has no formula)
    reads: tuple[TensorMeta, ...]  # tensor arguments the op reads (out= and write-only args left out)
    writes: tuple[TensorMeta, ...]  # tensors it writes
    note: str = ""

    def arg(self, name: str) -> Any:
        return self.args[name]

    def tensor_outputs(self) -> list[TensorMeta]:
        return [o for o in self.outputs if isinstance(o, TensorMeta)]


def _meta_tree(value: Any) -> Any:
    return pytree.tree_map_only(Tensor, TensorMeta.of, value)


# In-place ops that overwrite their first argument without reading it.
_WRITE_ONLY_SELF = {"copy_", "fill_", "zero_", "normal_", "uniform_", "random_", "bernoulli_", "exponential_",
                    "geometric_", "log_normal_", "cauchy_"}


def _reads_and_writes(func: torch._ops.OpOverload, args: tuple, kwargs: dict,
                      out: Any) -> tuple[list[Tensor], list[Tensor]]:
    """Tensors read and written by ``func``: every tensor argument is read except out= arguments and
    the self of write-only in-place ops (copy_, fill_, the RNG fills); every output is written."""
    reads: list[Tensor] = []
    schema = func._schema
    name = schema.name.split("::")[-1]
    for i, arg in enumerate(schema.arguments):
        if i < len(args):
            value = args[i]
        elif arg.name in kwargs:
            value = kwargs[arg.name]
        else:
            continue
        if arg.is_out:
            continue
        if i == 0 and name in _WRITE_ONLY_SELF:
            continue
        reads.extend(t for t in pytree.tree_leaves(value) if isinstance(t, Tensor))
    writes = [t for t in pytree.tree_leaves(out) if isinstance(t, Tensor)]
    return reads, writes


def _bind(func: torch._ops.OpOverload, args: tuple, kwargs: dict) -> dict[str, Any]:
    bound: dict[str, Any] = {}
    for i, arg in enumerate(func._schema.arguments):
        if i < len(args):
            bound[arg.name] = _meta_tree(args[i])
        elif arg.name in kwargs:
            bound[arg.name] = _meta_tree(kwargs[arg.name])
        else:
            bound[arg.name] = arg.default_value if arg.has_default_value() else None
    return bound


class Recorder(TorchDispatchMode):
    """Records every op (see the module docstring). ``phase`` is set by the caller."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[OpCall] = []
        self.phase = "forward"

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tensors = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, Tensor)]
        nested = [type(t) for t in tensors if t.is_nested and type(t) is not Tensor]
        if nested:
            # A nested jagged tensor: its subclass runs the op on its values; record those ops.
            with self:
                return nested[0].__torch_dispatch__(func, types, args, kwargs)
        any_fake = any(isinstance(t, FakeTensor) for t in tensors)
        note = ""
        special = outputs_with_no_kept_columns(func, args, kwargs) if any_fake else None
        if special is not None:
            out = special
            note = "K = 0 kept columns (every x̂ recovered from y: γ = 1, β = 0)"
        elif not any_fake and tensors:
            with unset_fake_temporarily():  # real inputs only: compute for real (host reads need it)
                out = func(*args, **kwargs)
        else:
            out = func(*args, **kwargs)
            if not tensors and all(isinstance(o, Tensor) and o.numel() <= REAL_FACTORY_NUMEL
                                   for o in pytree.tree_leaves(out)):
                with unset_fake_temporarily():  # a small factory: real values for the host reads
                    out = func(*args, **kwargs)
        if func.is_view or func in _NO_DATA_OPS or func.namespace == "prim":
            return out
        reads, writes = _reads_and_writes(func, args, kwargs, out)
        flops = 0
        if func.overloadpacket in flop_registry:
            # Outside the fake mode: the variable-length formulas read real offsets (cu_seqlens).
            with unset_fake_temporarily():
                flops = int(flop_registry[func.overloadpacket](*_at_query_heads(func, args), **kwargs, out_val=out))
        self.calls.append(OpCall(
            op=str(func), packet=str(func.overloadpacket), args=_bind(func, args, kwargs),
            outputs=tuple(_meta_tree(o) for o in pytree.tree_leaves(out)), phase=self.phase, flops=flops,
            reads=tuple(TensorMeta.of(t) for t in reads), writes=tuple(TensorMeta.of(t) for t in writes),
            note=note))
        self.recorded(self.calls[-1], reads, writes)
        return out

    def recorded(self, call: OpCall, reads: list[Tensor], writes: list[Tensor]) -> None:
        """Called with each recorded op and the tensors it read and wrote (subclasses follow the data:
        tempo.plan's timeline does)."""


# ---------------------------------------------------------------------------------------------
# CUDA's choices on the CPU
# ---------------------------------------------------------------------------------------------
def _autocast_on() -> bool:
    return torch.is_autocast_enabled("cpu")


def _eligible(t: Any) -> bool:
    """ATen autocast's is_eligible: a floating-point tensor other than fp64."""
    return isinstance(t, Tensor) and t.is_floating_point() and t.dtype != torch.float64


def _to_fp32(value: Any) -> Any:
    return pytree.tree_map_only(Tensor, lambda t: t.float() if _eligible(t) else t, value)


def _functions(*names: str, modules=(torch, torch.Tensor, F, torch.special)) -> set:
    found = set()
    for name in names:
        for module in modules:
            fn = getattr(module, name, None)
            if fn is not None:
                found.add(fn)
    return found


# CUDA autocast's fp32 policy (AT_FORALL_FP32), the entries a Transformer can reach.
_FP32_FUNCTIONS = _functions(
    "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p", "reciprocal", "rsqrt",
    "sinh", "tan", "pow", "softplus", "layer_norm", "rms_norm", "group_norm", "cosine_similarity",
    "poisson_nll_loss", "cosine_embedding_loss", "nll_loss", "hinge_embedding_loss", "kl_div", "l1_loss",
    "smooth_l1_loss", "huber_loss", "mse_loss", "margin_ranking_loss", "multilabel_margin_loss",
    "soft_margin_loss", "triplet_margin_loss", "multi_margin_loss", "binary_cross_entropy_with_logits",
    "dist", "pdist", "cdist", "renorm", "logsumexp") | {Tensor.__pow__, Tensor.__ipow__}
# CUDA autocast's fp32_set_opt_dtype policy: the output dtype becomes fp32 unless one is given.
_FP32_DTYPE_FUNCTIONS = _functions("softmax", "log_softmax", "sum", "prod", "cumsum", "cumprod")
_DROPOUT_FUNCTIONS = _functions("dropout", modules=(torch, F))
_SDPA = F.scaled_dot_product_attention


_SOFTMAXES = _functions("softmax")
_LOG_SOFTMAXES = _functions("log_softmax")


def _with_fp32_dtype(func, args, kwargs):
    if not (args and _eligible(args[0])) or kwargs.get("dtype") is not None:
        return func(*args, **kwargs)
    # softmax/log_softmax: (input, dim, [_stacklevel], dtype); sum/prod/cumsum/cumprod: dtype kwarg.
    if func in (F.softmax, F.log_softmax) and len(args) >= 4 and args[3] is not None:
        return func(*args, **kwargs)
    if func in (F.softmax, F.log_softmax):
        args = args[:3]
    dim = args[1] if len(args) > 1 else kwargs.get("dim")
    if args[0].dtype == torch.float16 and isinstance(dim, int) and func in _SOFTMAXES | _LOG_SOFTMAXES:
        # at::softmax/log_softmax on CUDA: fp16 in, fp32 out in one kernel (half_to_float), where a
        # bf16 input is first copied to fp32.
        op = aten._softmax if func in _SOFTMAXES else aten._log_softmax
        return op(args[0], dim, True)
    return func(*args, **{**kwargs, "dtype": torch.float32})


def _cross_entropy(args, kwargs):
    """CUDA's cross_entropy_loss under autocast (it has no autocast entry of its own): log_softmax in
    the logits' dtype (the composite passes that dtype explicitly), then nll_loss in fp32."""
    names = ("input", "target", "weight", "size_average", "ignore_index", "reduce", "reduction", "label_smoothing")
    bound = {**dict(zip(names, args)), **kwargs}
    logits, target = bound["input"], bound["target"]
    if (not _eligible(logits) or target.is_floating_point() or bound.get("label_smoothing", 0.0)
            or bound.get("size_average") is not None or bound.get("reduce") is not None):
        return F.cross_entropy(*args, **kwargs)
    class_dim = 1 if logits.dim() >= 2 else 0
    with torch.autocast("cpu", enabled=False):
        log_probs = torch.log_softmax(logits, class_dim, dtype=logits.dtype)
        weight = bound.get("weight")
        return F.nll_loss(log_probs.float(), target, weight=None if weight is None else weight.float(),
                          ignore_index=bound.get("ignore_index", -100), reduction=bound.get("reduction", "mean"))


def _dropout(func, args, kwargs):
    names = ("input", "p", "training", "inplace") if func is F.dropout else ("input", "p", "train")
    bound = {**dict(zip(names, args)), **kwargs}
    x, p = bound["input"], float(bound.get("p", 0.5))
    training = bound.get("training", bound.get("train", True))
    # at::dropout's is_fused_kernel_acceptable on CUDA; the in-place form is not fused there either.
    if training and 0.0 < p < 1.0 and x.numel() > 0 and not bound.get("inplace", False):
        return aten.native_dropout(x, p, True)[0]
    return func(*args, **kwargs)


def _sdpa_args(args, kwargs):
    names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
    bound = {**dict(zip(names, args)), **kwargs}
    return (bound["query"], bound["key"], bound["value"], bound.get("attn_mask"), float(bound.get("dropout_p", 0.0)),
            bool(bound.get("is_causal", False)), bound.get("scale"), bool(bound.get("enable_gqa", False)))


def fused_attention_kind(q: Tensor, v: Tensor, mask: Optional[Tensor]) -> str:
    """The fused kernel CUDA's sdpa dispatch picks: flash for fp16/bf16 without a mask and head dims
    <= 256 (multiples of 8), else the memory-efficient one (which takes a mask)."""
    if (mask is None and q.dtype in (torch.float16, torch.bfloat16) and q.shape[-1] <= 256
            and v.shape[-1] <= 256 and q.shape[-1] % 8 == 0 and v.shape[-1] % 8 == 0):
        return "flash"
    return "efficient"


def _sdpa(args, kwargs):
    q, k, v, mask, p, is_causal, scale, gqa = _sdpa_args(args, kwargs)
    if _autocast_on():  # sdpa is on CUDA autocast's lower-precision list
        dtype = torch.get_autocast_dtype("cpu")
        q, k, v = (t.to(dtype) if _eligible(t) else t for t in (q, k, v))
    with torch.autocast("cpu", enabled=False):
        if q.is_nested:
            if gqa:
                raise NotImplementedError("tempo.movement: nested sdpa with enable_gqa=True has no CUDA kernel model")
            return _nested_flash(q, k, v, p, is_causal, scale)
        flash = fused_attention_kind(q, v, mask) == "flash"
        if gqa and not flash:
            # CUDA's memory-efficient kernel takes no grouped kv heads (sdp_utils: only flash does), so
            # sdpa runs its math path there, on kv heads repeated to the query heads.
            group = q.shape[-3] // k.shape[-3]
            k, v = k.repeat_interleave(group, dim=-3), v.repeat_interleave(group, dim=-3)
            return aten._scaled_dot_product_attention_math(q, k, v, mask, p, is_causal, scale=scale)[0]
        if flash:  # flash reads grouped kv heads as they are
            return aten._scaled_dot_product_flash_attention(q, k, v, p, is_causal, False, scale=scale)[0]
        if mask is not None and mask.dtype != torch.bool and mask.dtype != q.dtype:
            mask = mask.to(q.dtype)
        if mask is not None and mask.dtype == torch.bool:
            # The efficient kernel takes an additive bias: sdpa converts a bool mask first.
            mask = torch.zeros(mask.shape, dtype=q.dtype).masked_fill_(mask.logical_not(), float("-inf"))
        if mask is not None:
            mask = mask.expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2])
        return aten._scaled_dot_product_efficient_attention(q, k, v, mask, True, p, is_causal, scale=scale)[0]


def _nested_flash(q: Tensor, k: Tensor, v: Tensor, p: float, is_causal: bool, scale) -> Tensor:
    """sdpa on nested jagged (b, h, j, d) tensors as torch's nested sdpa runs it on CUDA: the flash
    kernel on the [T, h, d] values with cu_seqlens."""
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))  # (b, j, h, d): values() is [T, h, d]
    offsets = qt.offsets().to(torch.int32)
    max_q = qt._get_max_seqlen()
    max_k = kt._get_max_seqlen()
    out = aten._flash_attention_forward(qt.values(), kt.values(), vt.values(), offsets, kt.offsets().to(torch.int32),
                                        max_q, max_k, p, is_causal, False, scale=scale)[0]
    nested = torch.nested.nested_tensor_from_jagged(out, qt.offsets(), max_seqlen=max_q)
    return nested.transpose(1, 2)


def _at_query_heads(func, args: tuple) -> tuple:
    """sdpa's flash op's arguments with grouped kv heads (enable_gqa: fewer k, v heads than q's) as
    meta tensors of the query's heads, for torch's flop formula, which (torch 2.11) refuses them:
    each kv head serves its group of query heads, so the FLOPs are those of the expanded heads."""
    if "flash_attention" not in str(func) or len(args) < 3:
        return args
    heads = args[0].shape[-3] if args[0].dim() == 4 else None
    if heads is None or all(a.shape[-3] == heads for a in args[:3] if isinstance(a, Tensor) and a.dim() == 4):
        return args

    def widened(a: Any) -> Any:
        if isinstance(a, Tensor) and a.dim() == 4 and a.shape[-3] != heads:
            return torch.empty((a.shape[0], heads, *a.shape[2:]), dtype=a.dtype, device="meta")
        return a
    return tuple(widened(a) for a in args)


class CudaSemantics(TorchFunctionMode):
    """Make the CPU trace take CUDA's autocast, dropout and sdpa decisions (module docstring)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is _SDPA:
            return _sdpa(args, kwargs)
        if func in _DROPOUT_FUNCTIONS:
            return _dropout(func, args, kwargs)
        if _autocast_on():
            if func is F.cross_entropy:
                return _cross_entropy(args, kwargs)
            if func in _FP32_DTYPE_FUNCTIONS:
                return _with_fp32_dtype(func, args, kwargs)
            if func in _FP32_FUNCTIONS:
                with torch.autocast("cpu", enabled=False):
                    return func(*_to_fp32(args), **_to_fp32(kwargs))
        return func(*args, **kwargs)


# ---------------------------------------------------------------------------------------------
# Sessions: fake models, traced steps
# ---------------------------------------------------------------------------------------------
@dataclass
class Trace:
    calls: list[OpCall] = field(default_factory=list)
    parameters: int = 0  # elements of the traced model's distinct parameters (0 when not a model)

    def phase(self, phase: str) -> list[OpCall]:
        return [c for c in self.calls if c.phase == phase]


class FakeSession:
    """One FakeTensorMode for a model and the steps traced on it."""

    def __init__(self) -> None:
        self.mode = FakeTensorMode(allow_non_fake_inputs=True)

    def fake_module(self, module: nn.Module) -> nn.Module:
        """``module`` (built on the meta device) with fake CPU parameters and buffers, in place.
        A parameter shared by several modules (tied embeddings) stays one parameter."""
        return fake_parameters(module, self.mode)

    def fake_tensor(self, shape, dtype=torch.float32, requires_grad: bool = False) -> Tensor:
        with self.mode:
            t = torch.empty(tuple(shape), dtype=dtype, device="cpu")
        return t.requires_grad_(requires_grad)

    def trace(self, forward: Callable[[], Any], autocast_dtype: Optional[torch.dtype] = torch.bfloat16,
              backward: bool = True) -> Trace:
        """Record ``forward()`` (under CPU autocast with ``autocast_dtype`` plus CudaSemantics) and,
        when ``backward``, the backward of its result: ``.backward()`` for a scalar loss, else a
        backward seeded with an (uncounted) gradient of the output's shape."""
        recorder = Recorder()
        with self.mode, CudaSemantics(), recorder:
            with torch.autocast("cpu", dtype=autocast_dtype or torch.bfloat16, enabled=autocast_dtype is not None):
                out = forward()
            if backward:
                recorder.phase = "backward"
                outputs = [t for t in pytree.tree_leaves(out) if isinstance(t, Tensor) and t.requires_grad]
                if not outputs:
                    raise ValueError("tempo.movement: the traced forward returned no tensor that requires grad")
                if len(outputs) == 1 and outputs[0].dim() == 0:
                    outputs[0].backward()
                else:
                    # The seed gradients are made outside the recorder: the layer above would hand them in.
                    with _paused(recorder):
                        seeds = [torch.empty_like(t) for t in outputs]
                    torch.autograd.backward(outputs, seeds)
        return Trace(recorder.calls)


@contextlib.contextmanager
def _paused(recorder: Recorder) -> Iterator[None]:
    calls = len(recorder.calls)
    try:
        yield
    finally:
        del recorder.calls[calls:]


def build_on_meta(factory: Callable[[], nn.Module]) -> nn.Module:
    """``factory()`` under ``torch.device("meta")``: no memory, no initialisation cost."""
    with torch.device("meta"):
        return factory()


__all__ = ["CudaSemantics", "FakeSession", "OpCall", "Recorder", "TensorMeta", "Trace", "build_on_meta",
           "fused_attention_kind"]
