"""Apply Tempo's layers to a model that already exists, and take them out again.

    model = transformers.BertForMaskedLM(config)        # or from_pretrained(...)
    apply_tempo(model)                                  # before building the optimizer / Trainer
    ...
    revert_tempo(model)                                 # the original module objects are back

Instance-level only: submodules of *this* model are swapped; no transformers class or function is
modified, so other models in the process are untouched. What is replaced:

  * ``nn.LayerNorm`` (exactly that class) -> ``InplaceLayerNorm`` holding the *same* Parameter
    objects: state_dict keys and values, optimizer references and tied weights stay valid.
  * exact (erf) GELU -> ``InplaceGelu``: ``nn.GELU(approximate="none")`` and transformers'
    ``GELUActivation`` (what ``ACT2FN["gelu"]`` / ``get_activation("gelu")`` build, e.g. BERT's
    ``intermediate_act_fn``). tanh-approximated GELUs (``nn.GELU("tanh")``, "gelu_new",
    "gelu_pytorch_tanh", "gelu_fast", ...) are different functions: they are left alone and
    logged. GPT-2 defaults to "gelu_new", so only its LayerNorms (and attention) change unless
    its config asks for activation_function="gelu". Activations called as plain functions
    (e.g. RoBERTa's LM head calls ``gelu(x)``) cannot be swapped and stay as they are.
  * attention (HF models only): the model's ``config._attn_implementation`` becomes "tempo",
    registered by ``tempo.integrations.hf_attention`` with transformers' AttentionInterface and
    AttentionMaskInterface. Needs transformers >= 4.50 and a model class whose attention
    dispatches through the interface; otherwise ImportError, before anything is changed.

Every replacement is logged on ``logging.getLogger("tempo.integrations.patch")``: one INFO line per kind with
counts, one DEBUG line per module. Applying twice changes nothing the second time. Each
replacement keeps the module it replaced (outside the module tree, so not in state_dict and not
moved by ``.to()``); ``revert_tempo`` puts those exact objects back, with the Parameters the
replacement holds at that moment and its train/eval mode.
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import Any, Optional

from torch import nn

logger = logging.getLogger("tempo.integrations.patch")

_ORIGINAL = "_tempo_original"  # on a replacement: the module it replaced
_STATE = "_tempo_patch_state"  # on the root model: what apply_tempo changed outside the tree


def _hf_gelu_classes() -> tuple[type, ...]:
    try:
        from transformers.activations import GELUActivation
    except ImportError:
        return ()
    return (GELUActivation,)


def _is_exact_gelu(module: nn.Module) -> Optional[bool]:
    """True: exact erf GELU; False: a tanh/other GELU variant; None: not a GELU module."""
    if _ORIGINAL in module.__dict__ or type(module).__module__.startswith("tempo."):  # already Tempo's
        return None
    if type(module) is nn.GELU:
        return module.approximate == "none"
    if type(module) in _hf_gelu_classes():
        act = getattr(module, "act", None)
        # F.gelu (default approximate="none") or transformers' own erf formula.
        return act is nn.functional.gelu or getattr(act, "__name__", "") == "_gelu_python"
    return None if "gelu" not in type(module).__name__.lower() else False


def _make_layernorm(old: nn.LayerNorm) -> nn.Module:
    from tempo.inplace_layernorm import InplaceLayerNorm

    # Built on the meta device: its fresh parameters are thrown away at once for the old ones.
    new = InplaceLayerNorm(old.normalized_shape, eps=old.eps, elementwise_affine=old.elementwise_affine,
                           bias=old.bias is not None, device="meta")
    _move_parameters(old, new)
    return new


def _make_gelu(old: nn.Module) -> nn.Module:
    from tempo.inplace_gelu import InplaceGelu

    return InplaceGelu()


def _move_parameters(src: nn.Module, dst: nn.Module) -> None:
    """Register src's Parameter objects (not copies) on dst under the same names."""
    for name, param in src.named_parameters(recurse=False):
        setattr(dst, name, param)
    for name in ("weight", "bias"):  # absent affine parameters are registered as None
        if name in src._parameters and src._parameters[name] is None:
            dst.register_parameter(name, None)


def _replacement_for(module: nn.Module, options: dict[str, bool]) -> tuple[Optional[str], Optional[nn.Module]]:
    """(kind, new module) for a module Tempo replaces, (kind, None) for one it deliberately skips."""
    if type(module) is nn.LayerNorm:
        return ("LayerNorm", _make_layernorm(module)) if options["layernorm"] else (None, None)
    exact = _is_exact_gelu(module)
    if exact is None or not options["gelu"]:
        return None, None
    if exact:
        return "GELU", _make_gelu(module)
    return "non-exact GELU", None


def _swap_modules(model: nn.Module, options: dict[str, bool]) -> Counter:
    counts: Counter = Counter()
    done: dict[int, nn.Module] = {}  # a module shared by several parents gets one replacement
    for parent_name, parent in list(model.named_modules(remove_duplicate=False)):
        for child_name, child in list(parent._modules.items()):
            if child is None:
                continue
            qualified = f"{parent_name}.{child_name}" if parent_name else child_name
            if id(child) in done:
                parent._modules[child_name] = done[id(child)]
                continue
            kind, new = _replacement_for(child, options)
            if kind is None:
                continue
            if new is None:
                counts[f"skipped {kind}"] += 1
                logger.debug("left %s (%s) alone: not the exact erf GELU that InplaceGelu computes",
                             qualified, type(child).__name__)
                continue
            if child._forward_hooks or child._forward_pre_hooks or child._backward_hooks:
                logger.warning("%s has hooks; they stay on the original module and do not run while "
                               "it is replaced", qualified)
            new.train(child.training)
            new.__dict__[_ORIGINAL] = child  # plain attribute: not a submodule, not in state_dict
            parent._modules[child_name] = new
            done[id(child)] = new
            counts[kind] += 1
            logger.debug("%s: %s -> %s", qualified, type(child).__name__, type(new).__name__)
    return counts


def _configs_of(model: nn.Module) -> list[Any]:
    """Distinct HF configs of the model and its sub-models, in tree order."""
    configs, seen = [], set()
    for module in model.modules():
        config = getattr(module, "config", None)
        if config is not None and hasattr(config, "_attn_implementation") and id(config) not in seen:
            seen.add(id(config))
            configs.append(config)
    return configs


def _set_attn_implementation(model: nn.Module, implementation: str) -> None:
    setter = getattr(model, "set_attn_implementation", None)
    if callable(setter):
        setter(implementation)
    for config in _configs_of(model):  # older versions, or sub-configs the setter skipped
        if config._attn_implementation != implementation:
            config._attn_implementation = implementation


def _patch_attention(model: nn.Module, state: dict[str, Any]) -> bool:
    from tempo.integrations.hf_attention import TEMPO_ATTENTION, register_tempo_attention

    configs = _configs_of(model)
    if not configs:
        logger.info("attention: %s has no HF config; nothing to switch", type(model).__name__)
        return False
    if "attention" in state:  # already switched by an earlier apply_tempo
        return False
    register_tempo_attention()
    state["attention"] = [(config, config._attn_implementation) for config in configs]
    _set_attn_implementation(model, TEMPO_ATTENTION)
    wrong = [c for c in configs if c._attn_implementation != TEMPO_ATTENTION]
    if wrong:
        raise RuntimeError(f"could not set attn_implementation='tempo' on {type(model).__name__}")
    logger.info("attention: %s -> tempo (%d config%s)", state["attention"][0][1], len(configs),
                "" if len(configs) == 1 else "s")
    return True


def _check_attention_possible(model: nn.Module) -> None:
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


def apply_tempo(model: nn.Module, gelu: bool = True, layernorm: bool = True, attention: bool = True) -> nn.Module:
    """Swap Tempo's memory-saving layers into ``model`` in place; returns ``model``.

    ``gelu``: exact GELU modules -> InplaceGelu. ``layernorm``: nn.LayerNorm -> InplaceLayerNorm
    (same Parameters). ``attention``: HF models only, ``attn_implementation`` -> "tempo".
    See the module docstring for what is and is not replaced. Idempotent.

    With the HF Trainer, patch the model before building the Trainer (the optimizer is created
    from the same Parameters either way, but the Trainer should see the final modules):

        trainer = Trainer(model=apply_tempo(model), args=training_args, train_dataset=dataset, ...)

    Raises ImportError (before changing anything) when ``attention=True`` on an HF model and the
    installed transformers cannot dispatch its attention to a registered function.
    """
    if attention:
        _check_attention_possible(model)
    state = model.__dict__.setdefault(_STATE, {})
    counts = _swap_modules(model, {"gelu": gelu, "layernorm": layernorm})
    for kind, n in sorted(counts.items()):
        if kind.startswith("skipped"):
            logger.info("apply_tempo: left %d %s module%s alone (InplaceGelu is exact erf GELU)",
                        n, kind[len("skipped "):], "" if n == 1 else "s")
        else:
            target = "InplaceGelu" if kind == "GELU" else "InplaceLayerNorm"
            logger.info("apply_tempo: replaced %d %s -> %s", n, kind, target)
    if attention:
        _patch_attention(model, state)
    if not counts and not state.get("attention"):
        logger.info("apply_tempo: nothing to replace in %s", type(model).__name__)
    return model


def revert_tempo(model: nn.Module) -> nn.Module:
    """Put back every module apply_tempo replaced (the same objects) and the attention setting."""
    counts: Counter = Counter()
    for parent_name, parent in list(model.named_modules(remove_duplicate=False)):
        for child_name, child in list(parent._modules.items()):
            original = None if child is None else child.__dict__.get(_ORIGINAL)
            if original is None:
                continue
            # The replacement's current Parameters go back: they are what the optimizer updates.
            _move_parameters(child, original)
            original.train(child.training)
            parent._modules[child_name] = original
            counts[type(original).__name__] += 1
            qualified = f"{parent_name}.{child_name}" if parent_name else child_name
            logger.debug("%s: %s -> %s", qualified, type(child).__name__, type(original).__name__)
    for kind, n in sorted(counts.items()):
        logger.info("revert_tempo: restored %d %s", n, kind)
    state = model.__dict__.pop(_STATE, {})
    previous = state.get("attention")
    if previous:
        setter = getattr(model, "set_attn_implementation", None)
        if callable(setter):
            setter(previous[0][1])
        for config, implementation in previous:  # sub-configs may have had their own setting
            config._attn_implementation = implementation
        logger.info("revert_tempo: attention tempo -> %s", previous[0][1])
    return model


def tempo_patched(model: nn.Module) -> dict[str, int]:
    """How many modules of each Tempo kind the model holds now, and whether attention is "tempo"."""
    counts: Counter = Counter()
    for module in model.modules():
        if _ORIGINAL in module.__dict__:
            counts[type(module).__name__] += 1
    configs = _configs_of(model)
    counts["attention"] = int(bool(configs) and all(c._attn_implementation == "tempo" for c in configs))
    return dict(counts)


__all__ = ["apply_tempo", "revert_tempo", "tempo_patched"]
