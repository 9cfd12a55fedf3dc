"""Recipes for the layers every family has: ``nn.LayerNorm`` and GELU modules.

  * ``nn.LayerNorm`` (exactly that class) -> ``InplaceLayerNorm`` holding the *same* Parameter
    objects.
  * GELU modules -> ``InplaceGelu`` of the same form: exact (erf) GELU, ``nn.GELU()`` and
    transformers' ``GELUActivation`` (``ACT2FN["gelu"]``, e.g. BERT's ``intermediate_act_fn``),
    becomes ``InplaceGelu()``; the tanh approximation, ``nn.GELU(approximate="tanh")`` and
    transformers' ``NewGELUActivation`` ("gelu_new", GPT-2's default), ``GELUTanh`` /
    ``PytorchGELUTanh`` ("gelu_pytorch_tanh"), ``FastGELUActivation`` ("gelu_fast": the tanh form
    with sqrt(2/pi) written as 0.7978845608, 1e-12 apart in fp64) and ``AccurateGELUActivation``
    (the same formula), becomes ``InplaceGelu(approximate="tanh")``. Each transformers module, and
    any other parameter-free module whose class name says GELU, is checked numerically first
    (float64, [-8, 8] densely and out to +-1e4, within 1e-5 of one form; the forms are 4.7e-4
    apart): a module that computes neither (QuickGELU's x*sigmoid(1.702x), a clipped GELU, ...) is
    left alone and logged. Activations called as plain functions (RoBERTa's LM head calls
    ``gelu(x)``) cannot be swapped and stay as they are.
"""

from __future__ import annotations

import logging
import sys
from typing import Optional

import torch
from torch import nn

from tempo.integrations.recipe import Options, Recipe, Skip, has_meta_weights, move_parameters, same_output, sample

logger = logging.getLogger("tempo.integrations.patch")

# transformers' GELU activation classes and the form each claims (checked numerically anyway).
_HF_GELU_FORMS = {
    "GELUActivation": "none",
    "NewGELUActivation": "tanh",
    "GELUTanh": "tanh",
    "PytorchGELUTanh": "tanh",  # an alias of GELUTanh in 5.x, its own class before
    "FastGELUActivation": "tanh",
    "AccurateGELUActivation": "tanh",
}
_PROBE_TOLERANCE = 1e-5  # the two forms differ by up to 4.7e-4


def _hf_gelu_classes() -> dict[type, str]:
    """transformers' GELU classes -> claimed form; empty unless transformers.activations is loaded
    (a model holding one of its modules has loaded it, so nothing is imported here)."""
    activations = sys.modules.get("transformers.activations")
    if activations is None:
        return {}
    out = {}
    for name, form in _HF_GELU_FORMS.items():
        cls = getattr(activations, name, None)
        if isinstance(cls, type):
            out[cls] = form
    return out


def _probe_gelu_form(module: nn.Module) -> Optional[str]:
    """The GELU form a parameter-free module computes ("none"/"tanh"), measured in float64 on the
    CPU with its hooks bypassed; None if it computes neither (or fails, or holds state)."""
    if any(True for _ in module.parameters()) or any(True for _ in module.buffers()):
        return None
    dense = torch.linspace(-8.0, 8.0, 321, dtype=torch.float64, device="cpu")
    far = torch.tensor([10.5, 12.0, 16.0, 32.0, 100.0, 1e3, 1e4], dtype=torch.float64, device="cpu")
    x = torch.cat([-far.flip(0), dense, far])  # far points: a clipped GELU (gelu_10) differs only there
    try:
        with torch.no_grad():
            y = module.forward(x)  # the module's own forward (an instance override included), no hooks
    except Exception:  # noqa: BLE001 - a module we cannot probe is one we do not replace
        return None
    if not isinstance(y, torch.Tensor) or y.shape != x.shape or y.device.type != "cpu":
        return None
    y = y.to(torch.float64)
    for form in ("none", "tanh"):
        if float((y - nn.functional.gelu(x, approximate=form)).abs().max()) <= _PROBE_TOLERANCE:
            return form
    return None


def gelu_form(module: nn.Module) -> tuple[bool, Optional[str]]:
    """(is a GELU candidate, its form "none"/"tanh" or None when it computes neither form)."""
    if type(module).__module__.startswith("tempo."):  # Tempo's own modules
        return False, None
    if type(module) is nn.GELU:
        if module.approximate not in ("none", "tanh"):
            return True, None
        return True, module.approximate if _probe_gelu_form(module) == module.approximate else None
    claimed = _hf_gelu_classes().get(type(module))
    if claimed is None and "gelu" not in type(module).__name__.lower():
        return False, None
    measured = _probe_gelu_form(module)
    if claimed is not None and measured is not None and measured != claimed:
        logger.debug("%s claims the %s GELU form but computes the %s form", type(module).__name__, claimed, measured)
    return True, measured


# ---------------------------------------------------------------------------------------------
# The recipes
# ---------------------------------------------------------------------------------------------
def _build_layernorm(old: nn.Module, options: Options) -> nn.Module:
    from tempo.inplace_layernorm import InplaceLayerNorm

    # Built on the meta device: its fresh parameters are thrown away at once for the old ones.
    new = InplaceLayerNorm(old.normalized_shape, eps=old.eps, elementwise_affine=old.elementwise_affine,
                           bias=old.bias is not None, device="meta")
    move_parameters(old, new)
    return new


def _layernorm_check(original: nn.Module, replacement: nn.Module) -> bool:
    if has_meta_weights(original):
        return True  # nothing to compute with yet; the class is nn.LayerNorm itself
    like = original.weight if original.weight is not None else torch.empty(0)
    return same_output(original, replacement, sample((2, 3, *original.normalized_shape), like))


def _recognise_gelu(module: nn.Module) -> bool:
    return gelu_form(module)[0]


def _build_gelu(old: nn.Module, options: Options) -> nn.Module | Skip:
    from tempo.inplace_gelu import InplaceGelu

    form = gelu_form(old)[1]
    if form is None:
        return Skip("computes neither the exact nor the tanh GELU that InplaceGelu has", kind="other GELU")
    return InplaceGelu(approximate=form)


def _gelu_label(new: nn.Module) -> tuple[str, str]:
    if new.approximate == "tanh":
        return "tanh GELU", "InplaceGelu(approximate='tanh')"
    return "GELU", "InplaceGelu"


def layer_recipes() -> list[Recipe]:
    from tempo.inplace_gelu import InplaceGelu
    from tempo.inplace_layernorm import InplaceLayerNorm

    return [
        Recipe(kind="LayerNorm", becomes="InplaceLayerNorm", option="layernorm", replacement=InplaceLayerNorm,
               recognise=lambda m: type(m) is nn.LayerNorm, build=_build_layernorm, check=_layernorm_check),
        Recipe(kind="GELU", becomes="InplaceGelu", option="gelu", replacement=InplaceGelu,
               recognise=_recognise_gelu, build=_build_gelu, label=_gelu_label),
    ]


__all__ = ["gelu_form", "layer_recipes"]
