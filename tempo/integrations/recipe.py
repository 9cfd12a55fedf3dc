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
    the original's device and dtype); a replacement that does not is dropped and the original left
    alone (logged: a transformers version whose module computes something else);
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
"""

from __future__ import annotations

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

    def describe(self) -> str:
        attention = repr(self.attention) if self.attention is not None else "False"
        return (f"gelu={self.gelu}, layernorm={self.layernorm}, attention={attention}, "
                f"dropout_add_layernorm={self.dropout_add_layernorm}")

    def same_choice(self, other: "Options") -> bool:
        return (self.gelu, self.layernorm, self.attention, self.dropout_add_layernorm) == (
            other.gelu, other.layernorm, other.attention, other.dropout_add_layernorm)


@dataclass(frozen=True)
class Skip:
    """A recognised module the recipe leaves alone, and why (one INFO line per kind)."""

    reason: str
    kind: Optional[str] = None  # the log's name for it, when not the recipe's kind


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
    check: Optional[Callable[[nn.Module, nn.Module], bool]] = None
    restore: Optional[Callable[[nn.Module, nn.Module], None]] = None  # default: move the Parameters back
    enabled: Optional[Callable[[Options], bool]] = None  # default: the option's value is truthy
    label: Optional[Callable[[nn.Module], tuple[str, str]]] = None  # (kind, becomes) of one replacement, for logs
    # Once per apply_tempo call on a model holding this recipe's replacements: what the model needs
    # around them (DeBERTa: hooks handing a padding-free batch's packing to its layers); returns the undo.
    model_hook: Optional[Callable[[nn.Module], Callable[[], None]]] = None

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
        namespace = {
            _STANDS_FOR: original_cls,
            "__module__": tempo_cls.__module__,
            "__qualname__": tempo_cls.__qualname__,
            "__doc__": tempo_cls.__doc__,
            "__reduce_ex__": _reduce_replacement,
        }
        _AS_ORIGINAL[key] = type(tempo_cls.__name__, (tempo_cls, original_cls), namespace)
    return _AS_ORIGINAL[key]


def tempo_class(module: nn.Module) -> type:
    """The Tempo class of a replacement (``as_original_class``'s first base), else its own class."""
    cls = type(module)
    return cls.__mro__[1] if _STANDS_FOR in cls.__dict__ else cls


def is_replacement(module: nn.Module) -> bool:
    """True for a module apply_tempo swapped in (it remembers the original it replaced)."""
    return ORIGINAL in module.__dict__


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
    """Built on the meta device (nothing to compute with yet: the structure was checked)."""
    return any(p.is_meta for p in module.parameters())


def first_tensor(out: Any) -> Optional[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
        return out[0]
    return None


def same_output(original: nn.Module, replacement: nn.Module, *inputs: Any, atol: float = 1e-5,
                rtol: float = 1e-5) -> bool:
    """``replacement(*inputs)`` equals ``original(*inputs)`` in eval mode (dropout off), under
    no_grad, to ``atol``/``rtol``. A forward that raises counts as different. Both modules' train
    flags are restored."""
    modes = [(m, m.training) for m in (*original.modules(), *replacement.modules())]
    original.eval()
    replacement.eval()
    try:
        with torch.no_grad():
            want = first_tensor(original(*inputs))
            got = first_tensor(replacement(*inputs))
    except Exception:  # noqa: BLE001 - a forward we cannot run is one we do not replace
        logger.debug("%s: the numerical check failed to run", type(original).__name__, exc_info=True)
        return False
    finally:
        for module, mode in modes:
            module.training = mode
    if want is None or got is None or got.shape != want.shape or got.dtype != want.dtype:
        return False
    return bool(torch.allclose(got, want, atol=atol, rtol=rtol))


def sample(shape: tuple[int, ...], like: torch.Tensor, seed: int = 0) -> torch.Tensor:
    """A deterministic standard-normal tensor on ``like``'s device and dtype (a check's input)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    return torch.randn(shape, generator=g).to(device=like.device, dtype=like.dtype)


__all__ = ["ORIGINAL", "Options", "Recipe", "Skip", "as_original_class", "has_meta_weights", "is_replacement",
           "move_parameters", "same_output", "same_submodules", "sample", "tempo_class"]
