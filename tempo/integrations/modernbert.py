"""Recipe for ModernBERT's GeGLU MLP: ``Wo(drop(act(a) * g))``, ``a, g = Wi(x).chunk(2)``.

It becomes a ``GegluMLP`` (tempo.ops.geglu: the activation, product and ``Wo`` as
``geglu_linear``, which keeps Wi's output only, 2·I per token instead of 4·I) holding the same
``Wi``, ``act``, ``drop`` and ``Wo`` modules in the original's order. ModernBERT ships the MLP
with dropout 0; one with dropout, or whose activation is neither GELU form, is left alone. As an
instance of ``ModernBertMLP`` too, the model's ``_init_weights`` initialises it as the original
(``Wo``'s truncated normal of std initializer_range/√(2L)).
"""

from __future__ import annotations

from torch import nn

from tempo.integrations.layers import gelu_form
from tempo.integrations.recipe import Options, Recipe, Skip, has_meta_weights, same_output, sample

GEGLU_MLPS = {"ModernBertMLP"}


def _recognise(module: nn.Module) -> bool:
    if type(module).__name__ not in GEGLU_MLPS:
        return False
    wi, wo, drop, act = (getattr(module, n, None) for n in ("Wi", "Wo", "drop", "act"))
    return (isinstance(wi, nn.Linear) and isinstance(wo, nn.Linear) and isinstance(drop, nn.Dropout)
            and isinstance(act, nn.Module) and wi.out_features == 2 * wo.in_features)


def _build(old: nn.Module, options: Options) -> nn.Module | Skip:
    from tempo.ops.geglu import GegluMLP

    candidate, form = gelu_form(old.act)
    if not candidate or form is None:
        return Skip("an activation other than the exact or tanh GELU")
    if old.drop.p != 0.0:
        return Skip("dropout inside it (GegluMLP fuses the product with Wo)")
    return GegluMLP(old, form)


def _check(original: nn.Module, replacement: nn.Module) -> bool:
    if has_meta_weights(original):
        return True
    return same_output(original, replacement, sample((2, 3, original.Wi.in_features), original.Wi.weight))


def _restore(new: nn.Module, original: nn.Module) -> None:
    for name in ("Wi", "act", "drop", "Wo"):
        setattr(original, name, getattr(new, name))


def modernbert_recipes() -> list[Recipe]:
    from tempo.ops.geglu import GegluMLP

    return [Recipe(kind="GeGLU MLP", becomes="GegluMLP (geglu_linear: keeps Wi's output only)", option="gelu",
                   replacement=GegluMLP, recognise=_recognise, build=_build, check=_check, restore=_restore)]


__all__ = ["modernbert_recipes"]
