"""One mechanism for every swap ``apply_tempo`` makes: a declared ``Recipe`` per kind of module.

A recipe says, for one kind of original module (transformers' ``BertOutput``, ``nn.LayerNorm``,
DeBERTa's ``DisentangledSelfAttention``, ...):

  * ``option`` / ``enabled``: which ``apply_tempo`` option turns it on;
  * ``recognise``: whether a module is an original it handles (structure, cheap);
  * ``replacement``: the class of its replacement, so that a module of that class is never
    replaced again (a second ``apply_tempo`` is a no-op) and the subtree under it is Tempo's own
    (a GELU inside Tempo's GeGLU MLP is not swapped on its own);
  * ``build``: the replacement, built from the original. It holds the original's submodules and
    Parameters (the same objects: state_dict keys, optimizer references, tying and adapters stay
    valid) and the original's ``nn.Dropout`` modules, whose rate it reads at every forward, so
    ``m.p = 0`` on every ``nn.Dropout`` (TRL's ``disable_dropout_in_model``) switches Tempo's
    dropout off too. Or ``Skip(reason)``: recognised, left alone (logged);
  * ``check``: the replacement computes what the original does (eval mode, small random inputs on
    the original's device and dtype; ``same_output``: the formula compared in fp32, the module's own
    16-bit dtype against the rounding it allows); a replacement that does not is dropped and the
    original left alone (logged with the module, the difference and the tolerance: a transformers
    version whose module computes something else);
  * ``restore``: hand the replacement's current submodules and Parameters back to the original
    (``revert_tempo``).

How the model's own ``_init_weights`` sees a replacement is the same for every recipe: the
replacement is an instance of a subclass of *both* its Tempo class and the original's class
(``as_original_class``), so ``isinstance(module, ModernBertMLP)`` holds for Tempo's GeGLU MLP and
the model's ``_init_weights`` (which dispatches on such checks) initialises it exactly as the
module it replaced: same branches, same random draws in the same order (a replacement keeps its
children in the original's order). Every other ``isinstance`` idiom (an optimizer's
no-weight-decay rule for ``nn.LayerNorm``, PEFT's target checks) answers as for the stock model.
Those subclasses pickle and deep-copy as themselves.

Where a Tempo class adds no state to a module's own class (``InputKeepingLinear`` of ``nn.Linear``,
``SeededDropout`` of ``nn.Dropout``), apply_tempo switches the module's class instead of replacing it
(``switch_class``; ``restore_classes`` switches it back): the same object, so hooks and references to
it stay valid (tempo.integrations.projections, tempo.integrations.dropouts).
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import Any, Callable, Optional, Union

import torch
from torch import nn

logger = logging.getLogger("tempo.integrations.patch")

ORIGINAL = "_tempo_original"  # on a replacement (a plain attribute, outside the module tree): what it replaced


@dataclass(frozen=True)
class Options:
    """What one ``apply_tempo`` call asks for (the arguments, normalised)."""

    gelu: bool
    layernorm: bool
    attention: Optional[str]  # "tempo" (Combined), "efficient", or None (leave attention alone)
    dropout_add_layernorm: bool
    attention_named: bool = False  # the caller named an attention (not the default): refusing it raises
    lm_loss: bool = True  # a causal or masked LM's head and loss fused (tempo.integrations.lm_loss)

    def describe(self) -> str:
        attention = repr(self.attention) if self.attention is not None else "False"
        return (f"gelu={self.gelu}, layernorm={self.layernorm}, attention={attention}, "
                f"dropout_add_layernorm={self.dropout_add_layernorm}, lm_loss={self.lm_loss}")

    def same_choice(self, other: "Options") -> bool:
        return (self.gelu, self.layernorm, self.attention, self.dropout_add_layernorm, self.lm_loss) == (
            other.gelu, other.layernorm, other.attention, other.dropout_add_layernorm, other.lm_loss)


@dataclass(frozen=True)
class Skip:
    """A recognised module the recipe leaves alone, and why (one INFO line per kind)."""

    reason: str
    kind: Optional[str] = None  # the log's name for it, when not the recipe's kind
    measured: str = ""  # a numerical refusal: what differed, by how much (logged per module, named)


Built = Union[nn.Module, Skip]


@dataclass(frozen=True)
class Recipe:
    """How one kind of original module becomes its Tempo replacement (see the module docstring)."""

    kind: str  # the log's name for what is replaced, e.g. "LayerNorm"
    becomes: str  # the log's name for the replacement, e.g. "InplaceLayerNorm"
    option: str  # the apply_tempo option that turns it on
    replacement: type  # the replacement's (Tempo) class
    recognise: Callable[[nn.Module], bool]
    build: Callable[[nn.Module, Options], Built]
    # -> a truthy CheckResult (same_output's), or a falsy one whose reason the skip log quotes
    check: Optional[Callable[[nn.Module, nn.Module], Any]] = None
    restore: Optional[Callable[[nn.Module, nn.Module], None]] = None  # default: move the Parameters back
    enabled: Optional[Callable[[Options], bool]] = None  # default: the option's value is truthy
    label: Optional[Callable[[nn.Module], tuple[str, str]]] = None  # (kind, becomes) of one replacement, for logs
    # What a model holding this recipe's replacements needs around them (DeBERTa: forward hooks handing
    # each call's packing to its layers). ``model_hook(model)`` adds forward hooks or instance
    # attributes where the tree lacks them (idempotent; every apply_tempo call; a failed apply takes
    # back what it added); ``model_unhook(model)`` takes them out of the whole tree, found by identity
    # (module-level functions, no handles or closures: a deep copy or a pickled model reverts on its
    # own, never touching the model it was copied from).
    model_hook: Optional[Callable[[nn.Module], None]] = None
    model_unhook: Optional[Callable[[nn.Module], None]] = None

    def labels(self, new: nn.Module) -> tuple[str, str]:
        return self.label(new) if self.label is not None else (self.kind, self.becomes)

    def is_enabled(self, options: Options) -> bool:
        if self.enabled is not None:
            return self.enabled(options)
        return bool(getattr(options, self.option))


# ---------------------------------------------------------------------------------------------
# Replacements that are also instances of the original's class
# ---------------------------------------------------------------------------------------------
_AS_ORIGINAL: dict[tuple[type, type], type] = {}
_STANDS_FOR = "_tempo_stands_for"  # on such a class: the original class it stands for


def _rebuild_replacement(tempo_cls: type, original_cls: type) -> nn.Module:
    """pickle / deepcopy: an empty instance of the combined class (its state is set after)."""
    return object.__new__(as_original_class(tempo_cls, original_cls))


def _reduce_replacement(self: nn.Module, protocol: int) -> Any:
    cls = type(self)
    base = cls.__mro__[1]
    return _rebuild_replacement, (base, cls.__dict__[_STANDS_FOR]), self.__getstate__()


def as_original_class(tempo_cls: type, original_cls: type) -> type:
    """A class that is ``tempo_cls`` first (its forward and everything it defines) and also a
    subclass of ``original_cls`` (for isinstance). Same name, module and qualname as ``tempo_cls``;
    one class per pair, made once."""
    if issubclass(tempo_cls, original_cls):
        return tempo_cls
    key = (tempo_cls, original_cls)
    if key not in _AS_ORIGINAL:
        # A whole model's class (tempo_cls.keeps_original_name) keeps the original's name, which
        # transformers reads (save_pretrained's "architectures", the loss type), and its forward's
        # signature, which callers inspect for the arguments it takes.
        named = original_cls if getattr(tempo_cls, "keeps_original_name", False) else tempo_cls
        namespace = {
            _STANDS_FOR: original_cls,
            "__module__": named.__module__,
            "__qualname__": named.__qualname__,
            "__doc__": named.__doc__,
            "__reduce_ex__": _reduce_replacement,
        }
        if named is original_cls:
            def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
                return tempo_cls.forward(self, *args, **kwargs)

            namespace["forward"] = functools.wraps(original_cls.forward)(forward)
        _AS_ORIGINAL[key] = type(named.__name__, (tempo_cls, original_cls), namespace)
    return _AS_ORIGINAL[key]


def stands_for(cls: type) -> type:
    """The original class a replacement class stands for (``as_original_class``), also through a
    subclass made of one (FSDP2's ``fully_shard`` gives each module its own ``FSDP<name>`` subclass)."""
    return next(c.__dict__[_STANDS_FOR] for c in cls.__mro__ if _STANDS_FOR in c.__dict__)


def tempo_class(module: nn.Module) -> type:
    """The Tempo class of a replacement (``as_original_class``'s first base), else its own class."""
    cls = type(module)
    return cls.__mro__[1] if _STANDS_FOR in cls.__dict__ else cls


def is_replacement(module: nn.Module) -> bool:
    """True for a module apply_tempo swapped in (it remembers the original it replaced)."""
    return ORIGINAL in module.__dict__


# ---------------------------------------------------------------------------------------------
# Class switches: the other way apply_tempo changes a module (no replacement, no new object)
# ---------------------------------------------------------------------------------------------
Switched = tuple[nn.Module, type]  # (the module, the class it had)


def switch_class(module: nn.Module, tempo_cls: type) -> Switched:
    """Make ``module`` an instance of ``tempo_cls``, a subclass of its own class adding no state
    (``InputKeepingLinear`` of ``nn.Linear``, ``SeededDropout`` of ``nn.Dropout``): its Parameters,
    hooks, references to it and ``isinstance`` checks stay as they are. Returns what
    ``restore_classes`` needs to switch it back."""
    original = type(module)
    if tempo_cls.__bases__ != (original,):
        raise TypeError(f"switch_class: {tempo_cls.__name__} is not a direct subclass of {original.__name__}")
    module.__class__ = tempo_cls
    return module, original


def restore_classes(switched: list[Switched]) -> None:
    """Give each module ``switch_class`` switched its own class back (one still of a subclass of it)."""
    for module, original in switched:
        if type(module) is not original and isinstance(module, original):
            module.__class__ = original


# ---------------------------------------------------------------------------------------------
# Helpers the recipes share
# ---------------------------------------------------------------------------------------------
def move_parameters(src: nn.Module, dst: nn.Module) -> None:
    """Register src's own Parameter objects (not copies) on dst under the same names."""
    for name, param in src.named_parameters(recurse=False):
        setattr(dst, name, param)
    for name in ("weight", "bias"):  # absent affine parameters are registered as None
        if name in src._parameters and src._parameters[name] is None:
            dst.register_parameter(name, None)


def same_submodules(src: nn.Module, dst: nn.Module) -> None:
    """dst gets src's submodules (the same objects, in src's order)."""
    for name, child in src._modules.items():
        dst._modules[name] = child


def has_meta_weights(module: nn.Module) -> bool:
    """Built on the meta device, or made of fake tensors (tempo.plan's and tempo.memory's counting
    copies): nothing to compute with, the structure was checked."""
    from torch._subclasses.fake_tensor import is_fake

    return any(p.is_meta or is_fake(p) for p in module.parameters())


def first_tensor(out: Any) -> Optional[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
        return out[0]
    return None


# The numerical check, per dtype. A replacement is dropped only when it computes something else,
# never for the rounding of the model's dtype. Two comparisons:
#   1. the formula, in the compute dtype (fp32; fp64 for an fp64 module): the replacement and the
#      original run on the same parameters and inputs cast to it (torch.func.functional_call: no
#      copy of the module), within FORMULA_ATOL + FORMULA_RTOL·|original|. 1e-5 is ~100 fp32 ulps
#      of an O(1) output: far above fp32 rounding, far below any other formula (the two GELU forms
#      differ by 4.7e-4, a dropped bias or eps by its size).
#   2. the dtype, for a 16-bit module: the replacement run in the module's own dtype is as close to
#      the compute-dtype original as rounding allows: its relative L2 error at most
#      max(ROUNDING_FACTOR·(the stock module's own error in that dtype), ROUNDING_FACTOR·u_D), u_D
#      the dtype's unit roundoff (bf16 2⁻⁸, fp16 2⁻¹¹). The stock module's error is the yardstick
#      of what rounding in that dtype does to this computation; 8× it leaves room for a different
#      (equally valid) order of operations and still refuses an output off by a few percent.
FORMULA_ATOL = 1e-5
FORMULA_RTOL = 1e-5
ROUNDING_FACTOR = 8.0


@dataclass(frozen=True)
class CheckResult:
    """What a recipe's numerical check found. Truthy when the replacement computes what the
    original does; otherwise ``reason`` says what differs, by how much, against which tolerance
    (the log line of the module left alone quotes it)."""

    ok: bool
    reason: str = ""

    def __bool__(self) -> bool:
        return self.ok


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a check compares formulas in: fp64 for fp64 modules, else fp32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _module_dtype(*modules: nn.Module) -> Optional[torch.dtype]:
    for module in modules:
        for t in (*module.parameters(), *module.buffers()):
            if t.is_floating_point():
                return t.dtype
    return None


def _cast_tensors(value: Any, dtype: torch.dtype) -> Any:
    if isinstance(value, torch.Tensor) and value.is_floating_point():
        return value.to(dtype)
    if isinstance(value, (tuple, list)):
        return type(value)(_cast_tensors(v, dtype) for v in value)
    return value


def _run(module: nn.Module, inputs: tuple, dtype: Optional[torch.dtype] = None) -> Optional[torch.Tensor]:
    """module(*inputs) under no_grad, eval mode set by the caller; with ``dtype``: its floating
    parameters and buffers, and the inputs, cast to it for this call only."""
    with torch.no_grad():
        if dtype is None:
            return first_tensor(module(*inputs))
        state = {name: t.to(dtype) if t.is_floating_point() else t
                 for name, t in (*module.named_parameters(), *module.named_buffers())}
        return first_tensor(torch.func.functional_call(module, state, _cast_tensors(inputs, dtype)))


def _relative_l2(got: torch.Tensor, want: torch.Tensor) -> float:
    want = want.to(torch.float64)
    scale = float(want.norm())
    diff = float((got.to(torch.float64) - want).norm())
    return diff / scale if scale > 0 else diff


def same_output(original: nn.Module, replacement: nn.Module, *inputs: Any) -> CheckResult:
    """Whether ``replacement(*inputs)`` computes ``original(*inputs)``, in eval mode (dropout off)
    under no_grad, for the module's dtype (the two comparisons above). A forward that raises
    counts as different. Both modules' train flags are restored."""
    modes = [(m, m.training) for m in (*original.modules(), *replacement.modules())]
    original.eval()
    replacement.eval()
    dtype = _module_dtype(original, replacement) or torch.float32
    compute = compute_dtype(dtype)
    stage = "the formula"
    try:
        want = _run(original, inputs, compute)
        got = _run(replacement, inputs, compute)
        if dtype != compute:
            stage = f"the {dtype} forward"
            stock = _run(original, inputs)
            got_in_dtype = _run(replacement, inputs)
    except Exception as err:  # noqa: BLE001 - a forward we cannot run is one we do not replace
        logger.debug("%s: the numerical check failed to run", type(original).__name__, exc_info=True)
        return CheckResult(False, f"{stage} failed to run: {type(err).__name__}: {str(err)[:200]}")
    finally:
        for module, mode in modes:
            module.training = mode
    if want is None or got is None:
        return CheckResult(False, "no tensor output to compare")
    if got.shape != want.shape:
        return CheckResult(False, f"output shape {tuple(got.shape)} instead of {tuple(want.shape)}")
    diff = (got.to(compute) - want).abs()
    excess = diff - (FORMULA_ATOL + FORMULA_RTOL * want.abs())
    if not bool(torch.isfinite(got).all()) or (excess.numel() and float(excess.max()) > 0):
        at = int(excess.flatten().argmax()) if excess.numel() else 0
        return CheckResult(False, f"in {compute} it differs by {float(diff.flatten()[at]):.3g} where "
                                  f"{FORMULA_ATOL:g} + {FORMULA_RTOL:g}·|original| allows "
                                  f"{FORMULA_ATOL + FORMULA_RTOL * float(want.flatten()[at].abs()):.3g}")
    if dtype == compute:
        return CheckResult(True)
    if stock is None or got_in_dtype is None or got_in_dtype.dtype != stock.dtype:
        return CheckResult(False, f"in {dtype} it returns {getattr(got_in_dtype, 'dtype', None)} where the "
                                  f"original returns {getattr(stock, 'dtype', None)}")
    error = _relative_l2(got_in_dtype, want)
    allowed = ROUNDING_FACTOR * max(_relative_l2(stock, want), torch.finfo(dtype).eps / 2)
    if not error <= allowed:  # (a NaN error fails too)
        return CheckResult(False, f"in {dtype} its relative L2 error against the {compute} original is "
                                  f"{error:.3g}, above the {allowed:.3g} that {dtype} rounding allows "
                                  f"({ROUNDING_FACTOR:g}x the stock module's own error or unit roundoff)")
    return CheckResult(True)


def output_check(inputs: Callable[[nn.Module], tuple]) -> Callable[[nn.Module, nn.Module], Any]:
    """A recipe's ``check``: the replacement computes what the original does on ``inputs(original)``
    (``same_output``: eval mode, dropout off). An original without values (meta or fake weights)
    passes on the structure its recognise and build already checked."""
    def check(original: nn.Module, new: nn.Module) -> Any:
        if has_meta_weights(original):
            return True
        return same_output(original, new, *inputs(original))
    return check


def restore_children(new: nn.Module, original: nn.Module) -> None:
    """A recipe's ``restore`` for a replacement that holds the original's submodules: each goes back
    to the original (the current ones: an adapter put on since goes back too)."""
    for name, child in new._modules.items():
        original._modules[name] = child


def sample(shape: tuple[int, ...], like: torch.Tensor, seed: int = 0) -> torch.Tensor:
    """A deterministic standard-normal tensor on ``like``'s device and dtype (a check's input)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    return torch.randn(shape, generator=g).to(device=like.device, dtype=like.dtype)


__all__ = ["ORIGINAL", "CheckResult", "Options", "Recipe", "Skip", "Switched", "as_original_class", "compute_dtype",
           "has_meta_weights", "is_replacement", "move_parameters", "output_check", "restore_children", "restore_classes",
           "same_output", "same_submodules", "sample", "switch_class", "tempo_class"]
