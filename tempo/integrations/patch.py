"""Apply Tempo's layers to a model that already exists, and take them out again.

    model = transformers.BertForMaskedLM(config)        # or from_pretrained(...)
    apply_tempo(model)                                  # before building the optimizer / Trainer
    ...
    revert_tempo(model)                                 # the original module objects are back

Instance-level only: submodules of *this* model are swapped; no transformers class or function is
modified, so other models in the process are untouched. What is replaced:

  * ``nn.LayerNorm`` (exactly that class) -> ``InplaceLayerNorm`` holding the *same* Parameter
    objects: state_dict keys and values, optimizer references and tied weights stay valid.
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
    left alone and logged.
    Activations called as plain functions (e.g. RoBERTa's LM head calls ``gelu(x)``) cannot be
    swapped and stay as they are.
  * attention (HF models only): the model's ``config._attn_implementation`` becomes
    "tempo_efficient" (the default, ``attention="efficient"``) or "tempo" (``attention=True`` or
    "tempo": the paper's Combined), registered by ``tempo.integrations.hf_attention`` with
    transformers' AttentionInterface and AttentionMaskInterface. Needs transformers >= 4.50 and a
    model whose attention layers dispatch through the interface (``model_dispatches_attention``).
    Where that is missing, an attention the caller named raises ImportError before anything is
    changed; the default leaves the attention as it is and says so in one INFO line.
  * DeBERTa-v2/v3 (transformers' ``deberta_v2``) compute attention in their own
    ``DisentangledSelfAttention``: with the default or ``attention="tempo"``/True each of those
    becomes a ``DebertaCombinedAttention`` (tempo.integrations.deberta: same submodules and
    state_dict keys, relative-position bias as it was, softmax -> dropout -> bmm as Combined),
    checked numerically against the original first; ``attention="efficient"`` raises
    ImportError (its dense relative-position bias is not something the efficient attention
    takes). ``config._attn_implementation`` stays as it is: the interface is not claimed.
    A model whose config sets ``output_attentions=True`` keeps its attention
    (Tempo attention keeps no weights to return, so every call would fall back to eager anyway),
    logged; a call that asks for attention weights on a patched model gets them from the model's
    eager attention, with eager's additive mask, for that call (logged once, see hf_attention),
    and ``model.config.output_attentions = True`` works on a patched model (the config gets an
    instance-level subclass that accepts it; revert_tempo gives the original class back).

The default, ``apply_tempo(model)``, is ``tempo.choices.TempoChoice.default()``: every kind with
the efficient attention, what the trainers' ``--tempo`` means too. The paper's three layers:
``apply_tempo(model, attention="tempo", dropout_add_layernorm=False)``.

All or nothing: every replacement is built first, then all are swapped in; if anything fails
(building a replacement, switching the attention) the model is left exactly as it was and the
error is raised. It works on models built under ``with torch.device("meta")`` (apply, then
``to_empty`` and initialise or load), whatever was imported first.

Every replacement is logged on ``logging.getLogger("tempo.integrations.patch")``: one INFO line per kind with
counts, one DEBUG line per module. Applying twice changes nothing the second time. Each
replacement keeps the module it replaced (outside the module tree, so not in state_dict and not
moved by ``.to()``); ``revert_tempo`` puts those exact objects back, with the Parameters the
replacement holds at that moment and its train/eval mode.
"""

from __future__ import annotations

import logging
import sys
from collections import Counter
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import nn

from tempo.choices import TempoChoice

logger = logging.getLogger("tempo.integrations.patch")

# apply_tempo's defaults: the one default of tempo.choices (the trainers' --tempo means it too).
_DEFAULT = TempoChoice.default()

_ORIGINAL = "_tempo_original"  # on a replacement: the module it replaced
_STATE = "_tempo_patch_state"  # on the root model: what apply_tempo changed outside the tree

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
_KIND_NAMES = {"none": "GELU", "tanh": "tanh GELU"}


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
            y = type(module).forward(module, x)
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
    if _ORIGINAL in module.__dict__ or type(module).__module__.startswith("tempo."):  # already Tempo's
        return False, None
    if type(module) is nn.GELU:
        return True, module.approximate if module.approximate in ("none", "tanh") else None
    claimed = _hf_gelu_classes().get(type(module))
    if claimed is None and "gelu" not in type(module).__name__.lower():
        return False, None
    measured = _probe_gelu_form(module)
    if claimed is not None and measured is not None and measured != claimed:
        logger.debug("%s claims the %s GELU form but computes the %s form", type(module).__name__, claimed, measured)
    return True, measured


def _make_layernorm(old: nn.LayerNorm) -> nn.Module:
    from tempo.inplace_layernorm import InplaceLayerNorm

    # Built on the meta device: its fresh parameters are thrown away at once for the old ones.
    new = InplaceLayerNorm(old.normalized_shape, eps=old.eps, elementwise_affine=old.elementwise_affine,
                           bias=old.bias is not None, device="meta")
    _move_parameters(old, new)
    return new


def _make_gelu(old: nn.Module, approximate: str) -> nn.Module:
    from tempo.inplace_gelu import InplaceGelu

    return InplaceGelu(approximate=approximate)


# HF modules computing LayerNorm(dropout(dense(hidden)) + input_tensor): BERT's residual blocks and
# their copies in RoBERTa, XLM-R, CamemBERT, ELECTRA. Checked by structure (and numerically when
# the weights are real) before they are fused.
_RESIDUAL_BLOCKS = {f"{family}{part}" for family in ("Bert", "Roberta", "XLMRoberta", "Camembert", "Electra",
                                                      "DebertaV2")
                    for part in ("SelfOutput", "Output")}


class FusedResidualOutput(nn.Module):
    """A ``BertSelfOutput``/``BertOutput``-style block with its dropout, residual add and LayerNorm
    fused into one ``DropoutAddLayerNorm``: same ``dense`` module, same LayerNorm Parameters under
    the same state_dict keys; keeps no dropout mask and no pre-LN sum."""

    def __init__(self, old: nn.Module):
        super().__init__()
        from tempo.ops.dropout_add_layernorm import DropoutAddLayerNorm

        ln = old.LayerNorm
        self.dense = old.dense  # the same module object: its Parameters, hooks and tying stay
        self.LayerNorm = DropoutAddLayerNorm(ln.normalized_shape, float(old.dropout.p), eps=ln.eps,
                                             elementwise_affine=ln.elementwise_affine,
                                             bias=getattr(ln, "bias", None) is not None, device="meta")
        _move_parameters(ln, self.LayerNorm)

    def forward(self, hidden_states: torch.Tensor, input_tensor: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dense(hidden_states), input_tensor)

    def _tempo_restore(self, original: nn.Module) -> None:
        """revert_tempo: the original block gets this one's current Parameters back."""
        original.dense = self.dense
        _move_parameters(self.LayerNorm, original.LayerNorm)


def _is_residual_block(module: nn.Module) -> bool:
    if type(module).__name__ not in _RESIDUAL_BLOCKS:
        return False
    parts = (getattr(module, "dense", None), getattr(module, "LayerNorm", None), getattr(module, "dropout", None))
    if not (isinstance(parts[0], nn.Linear) and type(parts[1]) is nn.LayerNorm and isinstance(parts[2], nn.Dropout)):
        return False
    if parts[0].weight.is_meta:
        return True  # nothing to compute with yet; the structure is BERT's
    # Numerically, in eval mode (dropout off): LayerNorm(dense(h) + r).
    with torch.no_grad():
        h = torch.randn(2, 3, parts[0].in_features, dtype=parts[0].weight.dtype, device=parts[0].weight.device)
        r = torch.randn(2, 3, parts[0].out_features, dtype=h.dtype, device=h.device)
        was_training = module.training
        module.eval()
        try:
            got = module(h, r)
        finally:
            module.train(was_training)
        want = parts[1](parts[0](h) + r)
    return torch.allclose(got, want, atol=1e-5, rtol=1e-5)


def _move_parameters(src: nn.Module, dst: nn.Module) -> None:
    """Register src's Parameter objects (not copies) on dst under the same names."""
    for name, param in src.named_parameters(recurse=False):
        setattr(dst, name, param)
    for name in ("weight", "bias"):  # absent affine parameters are registered as None
        if name in src._parameters and src._parameters[name] is None:
            dst.register_parameter(name, None)


# HF GeGLU MLPs: Wo(drop(act(a) * g)), a, g = Wi(x).chunk(2). Checked by structure and numerically.
_GEGLU_MLPS = {"ModernBertMLP"}


def _geglu_form(module: nn.Module) -> tuple[bool, Optional[str]]:
    """(is a GeGLU MLP, the GELU form to fuse or None when it cannot be fused)."""
    if type(module).__name__ not in _GEGLU_MLPS:
        return False, None
    wi, wo, drop, act = (getattr(module, n, None) for n in ("Wi", "Wo", "drop", "act"))
    if not (isinstance(wi, nn.Linear) and isinstance(wo, nn.Linear) and isinstance(drop, nn.Dropout)
            and act is not None and wi.out_features == 2 * wo.in_features):
        return False, None
    candidate, form = gelu_form(act)
    if not candidate or form is None or drop.p != 0.0:
        return True, None  # another activation, or dropout inside the MLP: left alone (logged)
    if wi.weight.is_meta:
        return True, form
    from tempo.ops.geglu import geglu_linear

    with torch.no_grad():
        x = torch.randn(2, 3, wi.in_features, dtype=wi.weight.dtype, device=wi.weight.device)
        was_training = module.training
        module.eval()
        try:
            got = module(x)
        finally:
            module.train(was_training)
        want = geglu_linear(wi(x), wo.weight, wo.bias, form)
    return True, form if torch.allclose(got, want, atol=1e-5, rtol=1e-5) else None


def _deberta_attention(module: nn.Module) -> tuple[Optional[str], Optional[nn.Module]]:
    from tempo.integrations.deberta import DebertaCombinedAttention, is_deberta_v2_attention, matches_original

    if not is_deberta_v2_attention(module):
        return None, None
    new = DebertaCombinedAttention(module)
    if not matches_original(new, module):
        return "DeBERTa attention", None
    return "DeBERTa attention core", new


def _replacement_for(module: nn.Module, options: dict[str, bool]) -> tuple[Optional[str], Optional[nn.Module]]:
    """(kind, new module) for a module Tempo replaces, (kind, None) for one it deliberately skips."""
    if options.get("attention_core"):
        kind, new = _deberta_attention(module)
        if kind is not None:
            return kind, new
    if options.get("dropout_add_layernorm") and _is_residual_block(module):
        return "dropout-add-LayerNorm", FusedResidualOutput(module)
    is_geglu, geglu = _geglu_form(module) if options["gelu"] else (False, None)
    if is_geglu:
        if geglu is None:
            return "GeGLU MLP (dropout or another activation)", None
        from tempo.ops.geglu import GegluMLP

        return "GeGLU MLP", GegluMLP(module, geglu)
    if type(module) is nn.LayerNorm:
        return ("LayerNorm", _make_layernorm(module)) if options["layernorm"] else (None, None)
    candidate, form = gelu_form(module)
    if not candidate or not options["gelu"]:
        return None, None
    if form is None:
        return "other GELU", None
    return _KIND_NAMES[form], _make_gelu(module, form)


@dataclass
class _Swap:
    parent: nn.Module
    name: str
    old: nn.Module
    new: nn.Module
    qualified: str
    kind: Optional[str]  # None: a second parent of a module already planned


def _plan_swaps(model: nn.Module, options: dict[str, bool]) -> tuple[list[_Swap], Counter]:
    """Build every replacement without touching the model: (swaps, counts of skipped kinds)."""
    swaps: list[_Swap] = []
    skipped: Counter = Counter()
    planned: dict[int, nn.Module] = {}  # a module shared by several parents gets one replacement
    for parent_name, parent in list(model.named_modules(remove_duplicate=False)):
        if any(parent is swap.old for swap in swaps):
            continue  # replaced as a whole (a fused residual block): its children stay as they are
        for child_name, child in list(parent._modules.items()):
            if child is None:
                continue
            qualified = f"{parent_name}.{child_name}" if parent_name else child_name
            if id(child) in planned:
                swaps.append(_Swap(parent, child_name, child, planned[id(child)], qualified, None))
                continue
            kind, new = _replacement_for(child, options)
            if kind is None:
                continue
            if new is None:
                skipped[kind] += 1
                logger.debug("left %s (%s) alone: %s", qualified, type(child).__name__, kind)
                continue
            new.train(child.training)
            new.__dict__[_ORIGINAL] = child  # plain attribute: not a submodule, not in state_dict
            planned[id(child)] = new
            swaps.append(_Swap(parent, child_name, child, new, qualified, kind))
    return swaps, skipped


def _configs_of(model: nn.Module) -> list[Any]:
    """Distinct HF configs of the model and its sub-models, in tree order."""
    configs, seen = [], set()
    for module in model.modules():
        config = getattr(module, "config", None)
        if config is not None and hasattr(config, "_attn_implementation") and id(config) not in seen:
            seen.add(id(config))
            configs.append(config)
    return configs


def _asks_for_attention_weights(model: nn.Module) -> bool:
    return any(getattr(config, "output_attentions", False) is True for config in _configs_of(model))


def _set_attn_implementation(model: nn.Module, implementation: str) -> None:
    setter = getattr(model, "set_attn_implementation", None)
    if callable(setter):
        setter(implementation)
    for config in _configs_of(model):  # older versions, or sub-configs the setter skipped
        if config._attn_implementation != implementation:
            config._attn_implementation = implementation


def _restore_attention(model: nn.Module, previous: list[tuple[Any, str]]) -> None:
    setter = getattr(model, "set_attn_implementation", None)
    if callable(setter):
        try:
            setter(previous[0][1])
        except Exception:  # noqa: BLE001 - the per-config assignment below restores it anyway
            logger.debug("set_attn_implementation(%r) failed while restoring", previous[0][1])
    for config, implementation in previous:  # sub-configs may have had their own setting
        config._attn_implementation = implementation


def _attention_implementation(attention: bool | str | None) -> Optional[str]:
    """apply_tempo's ``attention`` argument -> the attn_implementation to set (None: leave it).
    None is the default choice's attention (TempoChoice.default().attention)."""
    from tempo.integrations.hf_attention import TEMPO_ATTENTION, TEMPO_EFFICIENT_ATTENTION

    if attention is None:
        attention = _DEFAULT.attention if _DEFAULT.attention in ("tempo", "efficient") else False
    if attention is False:
        return None
    choices = {True: TEMPO_ATTENTION, "tempo": TEMPO_ATTENTION, "efficient": TEMPO_EFFICIENT_ATTENTION}
    if isinstance(attention, (int, float)) and not isinstance(attention, bool) or attention not in choices:
        raise ValueError(f"apply_tempo: argument 'attention' must be None (the default), True, False, 'tempo' "
                         f"or 'efficient', got {attention!r}")
    return choices[attention]


def _patch_attention(model: nn.Module, state: dict[str, Any], implementation: str) -> bool:
    from tempo.integrations.hf_attention import accept_output_attentions, register_tempo_attention, restore_config_class

    configs = _configs_of(model)
    if not configs:
        logger.info("attention: %s has no HF config; nothing to switch", type(model).__name__)
        return False
    if "attention" in state:  # already switched by an earlier apply_tempo
        return False
    previous = [(config, config._attn_implementation) for config in configs]
    register_tempo_attention()
    classes: list[tuple[Any, type]] = []
    try:
        _set_attn_implementation(model, implementation)
        if any(c._attn_implementation != implementation for c in configs):
            raise RuntimeError(f"could not set attn_implementation={implementation!r} on {type(model).__name__}")
        # config.output_attentions = True must keep working (a call asking for weights runs eager attention).
        for config in configs:
            original = accept_output_attentions(config)
            if original is not None:
                classes.append((config, original))
    except BaseException:
        for config, original in classes:
            restore_config_class(config, original)
        _restore_attention(model, previous)
        raise
    state["attention"] = previous
    state["config_classes"] = classes
    logger.info("attention: %s -> %s (%d config%s)", previous[0][1], implementation, len(configs),
                "" if len(configs) == 1 else "s")
    return True


def _has_deberta_attention(model: nn.Module) -> bool:
    from tempo.integrations.deberta import is_deberta_v2_attention

    return any(is_deberta_v2_attention(module) for module in model.modules())


def _check_attention_possible(model: nn.Module) -> None:
    """ImportError unless switching this model's attn_implementation changes what runs."""
    from tempo.integrations.hf_attention import (MIN_ATTENTION_INTERFACE_VERSION, model_dispatches_attention,
                                    require_attention_interface, transformers_version)

    if not _configs_of(model):
        return
    require_attention_interface()
    if not model_dispatches_attention(model):
        raise ImportError(
            f"{type(model).__name__} in transformers {transformers_version()} computes attention in its own "
            f"layers instead of dispatching through AttentionInterface, so Tempo attention cannot be "
            f"plugged in (BERT-family models dispatch from about transformers 4.54; the interface itself "
            f"needs >= {MIN_ATTENTION_INTERFACE_VERSION}). apply_tempo(model, attention=False) still "
            f"patches GELU and LayerNorm.")


def apply_tempo(model: nn.Module, gelu: bool = _DEFAULT.gelu, layernorm: bool = _DEFAULT.layernorm,
                attention: bool | str | None = None,
                dropout_add_layernorm: bool = _DEFAULT.dropout_add_layernorm) -> nn.Module:
    """Swap Tempo's memory-saving layers into ``model`` in place; returns ``model``.

    With no arguments: the default, ``tempo.choices.TempoChoice.default()`` (every Tempo layer kind
    with the efficient attention), which is what the trainers' ``--tempo`` means too.

    ``gelu``: exact and tanh GELU modules -> InplaceGelu of the same form. ``layernorm``:
    nn.LayerNorm -> InplaceLayerNorm (same Parameters). ``attention``: HF models only,
    ``attn_implementation`` -> "tempo_efficient" (None, the default, or "efficient":
    tempo.efficient_attention, O(s) kept per row) or "tempo" (True or "tempo": the paper's
    Combined); False leaves it; not when the config sets ``output_attentions=True``.
    ``dropout_add_layernorm``: BERT-family residual blocks (``BertSelfOutput``/``BertOutput`` and
    their RoBERTa/XLM-R/CamemBERT/ELECTRA copies) -> ``FusedResidualOutput`` (one
    DropoutAddLayerNorm, same state_dict keys); DeBERTa-v2/v3's also. ModernBERT's GeGLU MLP
    -> ``GegluMLP`` (with ``gelu``). DeBERTa-v2/v3's attention core -> ``DebertaCombinedAttention``
    (with the default or "tempo" attention). The paper's three layers:
    ``apply_tempo(model, attention="tempo", dropout_add_layernorm=False)``.
    See the module docstring for what is and is not replaced. Idempotent; all or nothing.

    With the HF Trainer, patch the model before building the Trainer (the optimizer is created
    from the same Parameters either way, but the Trainer should see the final modules):

        trainer = Trainer(model=apply_tempo(model), args=training_args, train_dataset=dataset, ...)

    Raises ImportError (before changing anything) when ``attention`` names a Tempo attention
    (True, "tempo", "efficient") for an HF model whose attention does not dispatch through
    transformers' AttentionInterface (DeBERTa-v2/v3: "efficient" only; its core runs as
    Combined); with the default (None) that attention is left as it is, logged in one line, and
    everything else is swapped.
    """
    from tempo.integrations.hf_attention import TEMPO_EFFICIENT_ATTENTION

    implementation = _attention_implementation(attention)
    switch_attention = implementation is not None
    if switch_attention and _asks_for_attention_weights(model):
        switch_attention = False
        logger.info("attention: %s's config sets output_attentions=True; Tempo attention keeps no attention "
                    "weights to return, so the attention is left as it is", type(model).__name__)
    # DeBERTa-v2/v3 compute attention in their own modules: their softmax -> dropout -> matmul core
    # is swapped module by module (Combined), for the default and for attention="tempo".
    attention_core = switch_attention and _has_deberta_attention(model)
    if switch_attention:
        try:
            _check_attention_possible(model)
        except ImportError as exc:
            switch_attention = False
            if attention_core and implementation == TEMPO_EFFICIENT_ATTENTION and attention is not None:
                raise ImportError(
                    f"{type(model).__name__}: DeBERTa's disentangled attention adds a dense relative-position "
                    f"bias to every score, so the efficient attention (O(s) kept per row) cannot run it; "
                    f"Tempo runs its softmax -> dropout -> matmul core as Combined: apply_tempo(model) or "
                    f"apply_tempo(model, attention='tempo')") from exc
            if not attention_core:
                if attention is not None:
                    raise
                logger.info("apply_tempo: attention left as it is: %s", str(exc).split(". apply_tempo(")[0])

    # 1. Plan: build every replacement; nothing in the model changes if this fails.
    swaps, skipped = _plan_swaps(model, {"gelu": gelu, "layernorm": layernorm,
                                         "dropout_add_layernorm": dropout_add_layernorm,
                                         "attention_core": attention_core})

    # 2. Apply: swap them all in, then the attention; undo everything if any step fails.
    had_state = _STATE in model.__dict__
    state = model.__dict__.setdefault(_STATE, {})
    applied: list[_Swap] = []
    try:
        for swap in swaps:
            swap.parent._modules[swap.name] = swap.new
            applied.append(swap)
        if switch_attention:
            _patch_attention(model, state, implementation)
    except BaseException:
        for swap in reversed(applied):
            swap.parent._modules[swap.name] = swap.old
        if not had_state:
            model.__dict__.pop(_STATE, None)
        logger.info("apply_tempo: failed, %s left as it was", type(model).__name__)
        raise

    _prepare_swapped(model, swaps)
    counts = Counter(swap.kind for swap in swaps if swap.kind is not None)
    for swap in swaps:
        if swap.kind is None:
            continue
        old = swap.old
        if old._forward_hooks or old._forward_pre_hooks or old._backward_hooks:
            logger.warning("%s has hooks; they stay on the original module and do not run while it is replaced",
                           swap.qualified)
        logger.debug("%s: %s -> %s", swap.qualified, type(old).__name__, type(swap.new).__name__)
    for kind, n in sorted(skipped.items()):
        why = ("dropout inside it, or an activation other than the exact or tanh GELU" if kind.startswith("GeGLU")
               else "transformers' forward differs from the one Tempo mirrors" if kind.startswith("DeBERTa")
               else "computes neither the exact nor the tanh GELU that InplaceGelu has")
        logger.info("apply_tempo: left %d %s module%s alone (%s)", n, kind, "" if n == 1 else "s", why)
    for kind, n in sorted(counts.items()):
        target = {"GELU": "InplaceGelu", "tanh GELU": "InplaceGelu(approximate='tanh')",
                  "dropout-add-LayerNorm": "FusedResidualOutput (DropoutAddLayerNorm)",
                  "GeGLU MLP": "GegluMLP (geglu_linear: keeps Wi's output only)",
                  "DeBERTa attention core": "DebertaCombinedAttention (softmax -> dropout -> bmm as Combined; "
                                            "relative-position bias as it was)"}.get(kind, "InplaceLayerNorm")
        logger.info("apply_tempo: replaced %d %s -> %s", n, kind, target)
    if not counts and not state.get("attention"):
        logger.info("apply_tempo: nothing to replace in %s", type(model).__name__)
    return model


def _prepare_swapped(model: nn.Module, swaps: list) -> None:
    """After the swaps: every Tempo LayerNorm gets its qualified name (its errors quote it), and
    each InplaceGelu's derivative table is built on the device the model's parameters are on (it
    was built on the CPU with the module; a model already on a GPU would otherwise build it at its
    first forward there)."""
    from tempo.ops.layernorm import name_layernorms

    name_layernorms(model)
    gelus = [swap.new for swap in swaps if swap.kind is not None and "GELU" in swap.kind]
    if not gelus:
        return
    from tempo.ops.gelu import prepare_derivative_table

    devices = {p.device for p in model.parameters() if p.device.type not in ("cpu", "meta")}
    for device in devices:
        for form in {g.approximate for g in gelus}:
            prepare_derivative_table(device, form)


def revert_tempo(model: nn.Module) -> nn.Module:
    """Put back every module apply_tempo replaced (the same objects) and the attention setting."""
    counts: Counter = Counter()
    for parent_name, parent in list(model.named_modules(remove_duplicate=False)):
        for child_name, child in list(parent._modules.items()):
            original = None if child is None else child.__dict__.get(_ORIGINAL)
            if original is None:
                continue
            # The replacement's current Parameters go back: they are what the optimizer updates.
            restore = getattr(child, "_tempo_restore", None)
            if restore is not None:
                restore(original)
            else:
                _move_parameters(child, original)
            original.train(child.training)
            parent._modules[child_name] = original
            counts[type(original).__name__] += 1
            qualified = f"{parent_name}.{child_name}" if parent_name else child_name
            logger.debug("%s: %s -> %s", qualified, type(child).__name__, type(original).__name__)
    for kind, n in sorted(counts.items()):
        logger.info("revert_tempo: restored %d %s", n, kind)
    state = model.__dict__.pop(_STATE, {})
    for config, original in state.get("config_classes", ()):
        from tempo.integrations.hf_attention import restore_config_class

        restore_config_class(config, original)
    previous = state.get("attention")
    if previous:
        _restore_attention(model, previous)
        logger.info("revert_tempo: attention -> %s", previous[0][1])
        for config, implementation in previous:
            if getattr(config, "output_attentions", False) and implementation != "eager":
                logger.warning("revert_tempo: %s sets output_attentions=True, which transformers supports only "
                               "with attn_implementation='eager' (it is %r again)", type(config).__name__,
                               implementation)
    return model


def tempo_patched(model: nn.Module) -> dict[str, int]:
    """How many modules of each Tempo kind the model holds now, and whether attention is "tempo"."""
    counts: Counter = Counter()
    for module in model.modules():
        if _ORIGINAL in module.__dict__:
            counts[type(module).__name__] += 1
    configs = _configs_of(model)
    counts["attention"] = int(bool(configs) and all(c._attn_implementation in ("tempo", "tempo_efficient")
                                                    for c in configs))
    return dict(counts)


__all__ = ["FusedResidualOutput", "apply_tempo", "revert_tempo", "tempo_patched", "gelu_form"]
