"""Recipes for the layers every family has: ``nn.LayerNorm``, RMSNorms and GELU modules.

  * ``nn.LayerNorm`` (exactly that class) -> ``InplaceLayerNorm`` holding the *same* Parameter
    objects.
  * any RMSNorm -> ``InplaceRMSNorm`` (tempo.ops.rmsnorm) holding the same ``weight`` Parameter,
    recognised by its structure, not its family: a module whose only Parameter is a 1-D ``weight``
    (no bias), with no submodules and no buffers, and a real-number eps under one of the common
    names (``eps``, ``variance_epsilon``, ``epsilon``) — transformers' ``LlamaRMSNorm``,
    ``Qwen3RMSNorm``, ``EuroBertRMSNorm``, ``Gemma3RMSNorm``, ``T5LayerNorm`` and their kin,
    ``nn.RMSNorm`` with a float eps. Then, in ``build``: the dtype it returns for each pair of input
    and weight dtypes is measured by running its forward on meta tensors, and must be one of
    tempo.ops.rmsnorm's ``DTYPE_RULES`` (Llama's promotion, Gemma's input dtype, T5's weight dtype);
    which form it computes, x·rsqrt(mean(x²) + eps)·w or ·(1 + w) (Gemma's), is measured with the
    recipe's numerical check (``same_output``, rows scaled so that eps matters) for each form in
    turn, and the first that matches is kept. Neither matches (another eps than its attribute, a
    mean subtracted, a clamp...): the check refuses it, and the module is left alone with one line
    naming it and both forms' differences; output dtypes no family has: left alone, its class and
    the dtypes it returned logged. On
    the meta device (or fake tensors) the check runs the module's own forward code on a CPU stand-in
    weight of the same shape. The replacement is an instance of the original class too
    (``as_original_class``: transformers' ``_init_weights`` dispatches on ``"RMSNorm" in`` the class
    name or on ``isinstance``, and finds it), keeps the original's eps under the original's
    attribute name and its other plain attributes, and is turned on by ``apply_tempo``'s
    ``layernorm`` option (a norm is a norm).
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
import warnings
from typing import Optional

import torch
from torch import nn

from tempo.integrations.recipe import (
    CheckResult,
    Options,
    Recipe,
    Skip,
    has_meta_weights,
    move_parameters,
    same_output,
    sample,
)

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


def _probe(module: nn.Module) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
    """(x, module(x)) in float64 on the CPU with its hooks bypassed, over [-8, 8] densely and out to
    +-1e4; None when the module holds state, fails, or returns something else than x's shape."""
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
    return x, y.to(torch.float64)


def computes_silu(module: nn.Module) -> bool:
    """True when a parameter-free module computes SiLU, x·σ(x) (transformers' "silu"/"swish",
    ``nn.SiLU``), measured as the GELU forms are (float64, within 1e-5 over the same points)."""
    probed = _probe(module)
    return probed is not None and float((probed[1] - nn.functional.silu(probed[0])).abs().max()) <= _PROBE_TOLERANCE


def _probe_gelu_form(module: nn.Module) -> Optional[str]:
    """The GELU form a parameter-free module computes ("none"/"tanh"), measured in float64 on the
    CPU with its hooks bypassed; None if it computes neither (or fails, or holds state)."""
    probed = _probe(module)
    if probed is None:
        return None
    x, y = probed
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


# ---------------------------------------------------------------------------------------------
# RMSNorm: recognised by structure, its dtype rule and form measured
# ---------------------------------------------------------------------------------------------
_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def rmsnorm_eps(module: nn.Module) -> Optional[tuple[str, float]]:
    """(the eps attribute's name, its value) when ``module`` is shaped like an RMSNorm (the module
    docstring's structure), else None. Structure only: what it computes is measured in ``build``."""
    from tempo.ops.rmsnorm import EPS_NAMES

    if type(module).__module__.startswith("tempo.") or type(module) is nn.LayerNorm:
        return None  # Tempo's own modules; nn.LayerNorm has its own recipe
    params = [(name, p) for name, p in module._parameters.items() if p is not None]
    if len(params) != 1 or params[0][0] != "weight" or params[0][1].dim() != 1:
        return None
    if any(m is not None for m in module._modules.values()) or any(b is not None for b in module._buffers.values()):
        return None
    for name in EPS_NAMES:
        value = module.__dict__.get(name)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return name, float(value)
    return None


def _rmsnorm_dtype_rule(module: nn.Module) -> tuple[Optional[str], str]:
    """(the name of the DTYPE_RULES rule the module's output dtypes follow, or None, and what it
    returned): its forward run on meta tensors for every pair of fp32/bf16/fp16/fp64 input and
    weight (no values needed, so the meta device works too)."""
    from tempo.ops.rmsnorm import DTYPE_RULES

    n = module.weight.shape[0]
    returned = {}
    # warnings: torch's own, about mixed dtypes it handles (F.rms_norm's "cannot dispatch to fused").
    with torch.no_grad(), torch.autocast("cpu", enabled=False), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for x_dtype in _FLOAT_DTYPES:
            for w_dtype in _FLOAT_DTYPES:
                state = {"weight": torch.empty(n, dtype=w_dtype, device="meta")}
                x = torch.empty((2, n), dtype=x_dtype, device="meta")
                try:
                    out = torch.func.functional_call(module, state, (x,))
                except Exception as err:  # noqa: BLE001 - a forward we cannot run is one we do not replace
                    return None, f"its forward fails for a {x_dtype} input and {w_dtype} weight ({type(err).__name__})"
                if not isinstance(out, torch.Tensor):
                    return None, "its forward returns no tensor"
                returned[(x_dtype, w_dtype)] = out.dtype
    for rule, dtype_of in DTYPE_RULES.items():
        if all(dtype_of(x, w) == out for (x, w), out in returned.items()):
            return rule, ""
    odd = next(f"{x} input, {w} weight -> {out}" for (x, w), out in returned.items()
               if out != DTYPE_RULES["promote"](x, w))
    return None, f"its output dtypes follow none of Llama's, Gemma's or T5's rules ({odd})"


def _rmsnorm_input(n: int, like: torch.Tensor) -> torch.Tensor:
    """The check's input: standard-normal rows scaled by 1, 1e-2 and 1e-3, so that mean(x²) spans
    1 down to ~1e-6, where an eps other than the one the module claims shows."""
    g = torch.Generator(device="cpu").manual_seed(0)
    # CPU explicitly: apply_tempo may run under ``with torch.device("meta")``.
    x = torch.randn((2, 3, n), generator=g, device="cpu") * torch.tensor([1.0, 1e-2, 1e-3], device="cpu")[:, None]
    return x.to(device=like.device, dtype=like.dtype)


def _stand_in(module: nn.Module, weight: nn.Parameter) -> nn.Module:
    """A shallow copy of ``module`` holding ``weight`` instead of its own (its own forward code and
    attributes, no share of its parameters, plans or hooks)."""
    import copy

    twin = copy.copy(module)
    twin.__dict__["_parameters"] = {**module._parameters, "weight": weight}
    if "tempo_kept_columns" in module.__dict__:
        twin.__dict__["tempo_kept_columns"] = {}
    return twin


def _rmsnorm_same_output(original: nn.Module, replacement: nn.Module) -> CheckResult:
    """``same_output`` of the two on the check's input; on the meta device (or fake tensors) of CPU
    stand-ins holding one fp32 weight, 1 + N(0, 0.5²) (no values to compute with: the forward code is
    what is checked)."""
    n = original.weight.shape[0]
    if has_meta_weights(original):
        g = torch.Generator(device="cpu").manual_seed(1)
        weight = nn.Parameter(1.0 + 0.5 * torch.randn(n, generator=g, device="cpu"))
        original, replacement = _stand_in(original, weight), _stand_in(replacement, weight)
    return same_output(original, replacement, _rmsnorm_input(n, original.weight))


def _rmsnorm_candidate(old: nn.Module, unit_offset: bool, rule: str) -> nn.Module:
    from tempo.ops.rmsnorm import InplaceRMSNorm

    eps_name, eps = rmsnorm_eps(old)
    # Built on the meta device: its fresh weight is thrown away at once for the old one.
    new = InplaceRMSNorm(old.weight.shape[0], eps=eps, unit_offset=unit_offset, dtype_rule=rule, eps_name=eps_name,
                         device="meta")
    move_parameters(old, new)
    # The original's other plain attributes (hidden_size, with_scale, ...): same answers to reads.
    for key, value in old.__dict__.items():
        if not key.startswith("_") and key not in new.__dict__ and isinstance(value, (bool, int, float, str)):
            new.__dict__[key] = value
    return new


def _build_rmsnorm(old: nn.Module, options: Options) -> nn.Module | Skip:
    """The replacement of the form (w or 1 + w) that computes what ``old`` does; where neither does,
    the w form, which the check then refuses, naming the module and both differences."""
    rule, why = _rmsnorm_dtype_rule(old)
    if rule is None:
        return Skip(f"{type(old).__name__}: {why}")
    candidate = _rmsnorm_candidate(old, False, rule)
    if _rmsnorm_same_output(old, candidate):
        return candidate
    gemma = _rmsnorm_candidate(old, True, rule)
    return gemma if _rmsnorm_same_output(old, gemma) else candidate


def _rmsnorm_check(original: nn.Module, replacement: nn.Module) -> CheckResult:
    """``same_output`` of the replacement's form; when it differs, the other form's difference too
    (the log line of a look-alike says what neither form matched)."""
    checked = _rmsnorm_same_output(original, replacement)
    if checked:
        return checked
    other = _stand_in(replacement, replacement.weight)
    other.__dict__["unit_offset"] = not replacement.unit_offset
    other_checked = _rmsnorm_same_output(original, other)
    if other_checked:  # cannot happen after _build_rmsnorm; a different replacement handed in
        return CheckResult(False, f"it computes the {'(1 + w)' if other.unit_offset else 'w'} form, not this one's")
    by_form = {replacement.unit_offset: checked.reason, other.unit_offset: other_checked.reason}
    eps_name = replacement.eps_name
    return CheckResult(False, f"it computes neither x·rsqrt(mean(x²) + {eps_name})·w ({by_form[False]}) nor "
                              f"x·rsqrt(mean(x²) + {eps_name})·(1 + w) ({by_form[True]})")


def _rmsnorm_label(new: nn.Module) -> tuple[str, str]:
    if new.unit_offset:
        return "RMSNorm (1 + w)", "InplaceRMSNorm(unit_offset=True)"
    return "RMSNorm", "InplaceRMSNorm"


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
    from tempo.ops.rmsnorm import InplaceRMSNorm

    return [
        Recipe(kind="LayerNorm", becomes="InplaceLayerNorm", option="layernorm", replacement=InplaceLayerNorm,
               recognise=lambda m: type(m) is nn.LayerNorm, build=_build_layernorm, check=_layernorm_check),
        Recipe(kind="RMSNorm", becomes="InplaceRMSNorm", option="layernorm", replacement=InplaceRMSNorm,
               recognise=lambda m: rmsnorm_eps(m) is not None, build=_build_rmsnorm, check=_rmsnorm_check,
               label=_rmsnorm_label),
        Recipe(kind="GELU", becomes="InplaceGelu", option="gelu", replacement=InplaceGelu,
               recognise=_recognise_gelu, build=_build_gelu, label=_gelu_label),
    ]


__all__ = ["computes_silu", "gelu_form", "layer_recipes", "rmsnorm_eps"]
