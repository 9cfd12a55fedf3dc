"""Apply Tempo's layers to a model that already exists, and take them out again.

    model = transformers.BertForMaskedLM(config)        # or from_pretrained(...)
    apply_tempo(model)                                  # before building the optimizer / Trainer
    ...
    revert_tempo(model)                                 # the original module objects are back

Instance-level only: submodules of *this* model are swapped; no transformers class or function is
modified, and no other model changes (a config shared with another model is copied first:
tempo.integrations.attention_switch).

How: ``apply_tempo`` walks the module tree top-down and, at each module, applies the first
enabled recipe that recognises it (``tempo.integrations.recipe``: recognise, build, check
numerically, restore; one per kind, declared per family):

  * DeBERTa-v2/v3's attention core (tempo.integrations.deberta);
  * the BERT family's residual blocks, fused dropout -> add -> LayerNorm
    (tempo.integrations.bert_family);
  * gated MLPs of every family, SwiGLU and GeGLU (tempo.integrations.gated_mlp);
  * ``nn.LayerNorm`` and GELU modules of every family (tempo.integrations.layers).

After the swaps, two class switches (no new module objects): the ``nn.Linear`` projections reading
a Tempo RMSNorm's output keep that output (tempo.integrations.projections), and, with
``dropout_add_layernorm``, every plain ``nn.Dropout`` left in the model keeps a seed instead of its
mask (tempo.integrations.dropouts: inline residual, embedding and classifier dropouts).

A replaced module's subtree is Tempo's own: it is not entered, now or by a later call (the GELU
inside Tempo's gated MLP stays as it is). Then, for models whose attention dispatches through
transformers' AttentionInterface, the configs' ``_attn_implementation`` becomes "tempo_efficient"
(the default, ``attention="efficient"``) or "tempo" (``attention=True`` or "tempo": the paper's
Combined), on copies of the configs (tempo.integrations.attention_switch). A model whose config sets
``output_attentions=True`` keeps its attention (Tempo attention keeps no weights to return; a call
asking for weights on a patched model runs the model's eager attention, see hf_attention).

The default, ``apply_tempo(model)``, is ``tempo.choices.TempoChoice.default()``: every kind with
the efficient attention, what the trainers' ``--tempo`` means too. The paper's three layers:
``apply_tempo(model, attention="tempo", dropout_add_layernorm=False)``.

The patched model is the stock model in every way a user touches it: the same Parameter objects
and state_dict keys; dropout rates read at every forward from the ``nn.Dropout`` modules the model
already had (``m.p = 0`` on them switches Tempo's dropout off, as TRL does); ``isinstance`` of each
replacement with the class it replaced holds, so the model's own ``_init_weights`` initialises it
as the original; train/eval as before.

Idempotent: a second call with the same choice changes nothing; a call on a model that holds
patched sub-models (its base model patched first, say) patches the rest with the same rules and
leaves them as they are. A different choice on a model already patched raises ValueError naming the
choice it has (``revert_tempo`` first). All or nothing: every replacement is built and checked
first, then all are swapped in and the attention switched; if anything fails the model is left
exactly as it was and the error is raised. Works on models built under
``with torch.device("meta")`` (apply, then ``to_empty`` and initialise or load).

Every replacement is logged on ``logging.getLogger("tempo.integrations.patch")``: one INFO line per
kind with counts, one DEBUG line per module; what is left alone is one INFO line per kind with the
reason. Each replacement keeps the module it replaced (outside the module tree, so not in
state_dict and not moved by ``.to()``); ``revert_tempo`` puts those exact objects back, with the
Parameters and submodules the replacement holds at that moment and its train/eval mode.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass
from typing import Any, Optional

from torch import nn

from tempo.choices import TempoChoice
from tempo.integrations.attention_switch import AttentionSwitch, asks_for_attention_weights, configs_of
from tempo.integrations.dropouts import seed_dropouts
from tempo.integrations.projections import keep_norm_outputs
from tempo.integrations.bert_family import FusedResidualOutput
from tempo.integrations.layers import gelu_form
from tempo.integrations.lm_loss import fuse_lm_loss
from tempo.integrations.recipe import ORIGINAL, Options, Recipe, Skip, Switched, as_original_class, \
    is_replacement, move_parameters, restore_classes, tempo_class

logger = logging.getLogger("tempo.integrations.patch")

# apply_tempo's defaults: the one default of tempo.choices (the trainers' --tempo means it too).
_DEFAULT = TempoChoice.default()

_STATE = "_tempo_patch_state"  # on the root model of a call: its options and the attention switch
_KIND = "_tempo_recipe_kind"  # on a replacement: the recipe that made it (revert finds its restore)


def recipes() -> list[Recipe]:
    """Every recipe, containers before their parts (a residual block before its LayerNorm)."""
    from tempo.integrations.bert_family import bert_family_recipes
    from tempo.integrations.deberta import deberta_recipes
    from tempo.integrations.layers import layer_recipes
    from tempo.integrations.gated_mlp import gated_mlp_recipes
    from tempo.integrations.mpnet import mpnet_recipes

    return [*deberta_recipes(), *mpnet_recipes(), *bert_family_recipes(), *gated_mlp_recipes(), *layer_recipes()]


def _recipe_named(kind: str) -> Optional[Recipe]:
    return next((r for r in recipes() if r.kind == kind), None)


# ---------------------------------------------------------------------------------------------
# Arguments
# ---------------------------------------------------------------------------------------------
def _options(gelu: Any, layernorm: Any, attention: Any, dropout_add_layernorm: Any, lm_loss: Any = True) -> Options:
    for name, value in (("gelu", gelu), ("layernorm", layernorm), ("dropout_add_layernorm", dropout_add_layernorm),
                        ("lm_loss", lm_loss)):
        if not isinstance(value, bool):
            raise TypeError(f"apply_tempo: argument '{name}' must be True or False, got {value!r}")
    named = attention is not None
    if attention is None:
        attention = _DEFAULT.attention if _DEFAULT.attention in ("tempo", "efficient") else False
    choices = {True: "tempo", "tempo": "tempo", "efficient": "efficient", False: None}
    if (isinstance(attention, (int, float)) and not isinstance(attention, bool)) or attention not in choices:
        raise ValueError(f"apply_tempo: argument 'attention' must be None (the default), True, False, 'tempo' "
                         f"or 'efficient', got {attention!r}")
    return Options(gelu=gelu, layernorm=layernorm, attention=choices[attention],
                   dropout_add_layernorm=dropout_add_layernorm, attention_named=named, lm_loss=lm_loss)


def _check_model(model: Any) -> None:
    if isinstance(model, nn.Module):
        return
    hint = ""
    if isinstance(model, str):
        hint = (f"; load the model first, e.g. model = transformers.AutoModelForMaskedLM.from_pretrained({model!r}), "
                f"then apply_tempo(model)")
    raise TypeError(f"apply_tempo: argument 'model' must be a torch.nn.Module (a model instance), "
                    f"got {type(model).__name__} {model!r}"[:300] + hint)


def _hf_implementation(attention: str) -> str:
    from tempo.integrations.hf_attention import TEMPO_ATTENTION, TEMPO_EFFICIENT_ATTENTION

    return {"tempo": TEMPO_ATTENTION, "efficient": TEMPO_EFFICIENT_ATTENTION}[attention]


# ---------------------------------------------------------------------------------------------
# Planning: every replacement built and checked, nothing in the model changed
# ---------------------------------------------------------------------------------------------
@dataclass
class _Swap:
    parent: nn.Module
    name: str
    old: nn.Module
    new: nn.Module
    qualified: str
    recipe: Optional[Recipe]  # None: a second parent of a module already planned


@dataclass
class _Plan:
    swaps: list[_Swap]
    skipped: Counter  # (kind, reason) -> count
    attention_modules: int  # modules an attention recipe replaces


def _is_tempo_module(module: nn.Module) -> bool:
    """Tempo's own layers (replacements, or Tempo modules a model was built with): never replaced,
    never entered."""
    return is_replacement(module) or type(module).__module__.startswith(("tempo.ops.", "tempo.integrations."))


def _plan(model: nn.Module, options: Options, active: list[Recipe]) -> _Plan:
    plan = _Plan([], Counter(), 0)
    planned: dict[int, nn.Module] = {}  # a module shared by several parents gets one replacement
    entered: set[int] = set()

    def visit(parent: nn.Module, prefix: str) -> None:
        if id(parent) in entered:
            return
        entered.add(id(parent))
        for name, child in list(parent._modules.items()):
            if child is None:
                continue
            qualified = f"{prefix}.{name}" if prefix else name
            if id(child) in planned:
                plan.swaps.append(_Swap(parent, name, child, planned[id(child)], qualified, None))
                continue
            if _is_tempo_module(child):
                continue
            recipe = next((r for r in active if r.recognise(child)), None)
            if recipe is None:
                visit(child, qualified)
                continue
            built = recipe.build(child, options)
            if isinstance(built, Skip):
                plan.skipped[(built.kind or recipe.kind, built.reason)] += 1
                if built.measured:  # a numerical refusal: named, with its numbers
                    logger.info("apply_tempo: left %s (%s) alone: %s: %s", qualified, type(child).__name__,
                                built.reason, built.measured)
                else:
                    logger.debug("left %s (%s) alone: %s", qualified, type(child).__name__, built.reason)
                visit(child, qualified)
                continue
            checked = recipe.check(child, built) if recipe.check is not None else True
            if not checked:
                why = "its forward computes something other than the replacement"
                plan.skipped[(recipe.kind, why)] += 1
                logger.info("apply_tempo: left %s (%s) alone: the replacement %s computes something else: %s",
                            qualified, type(child).__name__, recipe.becomes.split(" (")[0],
                            getattr(checked, "reason", "") or "the numerical check failed")
                visit(child, qualified)
                continue
            built.__class__ = as_original_class(type(built), type(child))
            shared = {id(m) for m in child.modules()}
            for part in built.modules():  # its own new parts take the original's mode
                if id(part) not in shared:
                    part.training = child.training
            built.__dict__[ORIGINAL] = child  # plain attribute: not a submodule, not in state_dict
            built.__dict__[_KIND] = recipe.kind
            planned[id(child)] = built
            plan.swaps.append(_Swap(parent, name, child, built, qualified, recipe))
            plan.attention_modules += recipe.option == "attention"

    visit(model, "")
    return plan


# ---------------------------------------------------------------------------------------------
# The attention: which handler takes it
# ---------------------------------------------------------------------------------------------
def _nested_states(model: nn.Module) -> list[tuple[str, dict]]:
    """(qualified name, state) of every sub-model an earlier apply_tempo patched."""
    return [(name, module.__dict__[_STATE]) for name, module in model.named_modules()
            if name and _STATE in module.__dict__]


def _check_not_differently_patched(model: nn.Module, options: Options) -> None:
    own = model.__dict__.get(_STATE)
    if own is not None and not own["options"].same_choice(options):
        raise ValueError(f"apply_tempo: {type(model).__name__} is already patched with apply_tempo(model, "
                         f"{own['options'].describe()}); call tempo.revert_tempo(model) first to apply "
                         f"({options.describe()})")
    for name, state in _nested_states(model):
        theirs = state["options"].attention
        if theirs is not None and options.attention is not None and theirs != options.attention:
            raise ValueError(f"apply_tempo: {name} ({type(model.get_submodule(name)).__name__}) is already patched "
                             f"with attention={theirs!r}; a model has one attention: call "
                             f"tempo.revert_tempo(model.{name}) first, or ask for attention={theirs!r}")


def _has_attention_replacements(model: nn.Module) -> bool:
    kinds = {r.kind for r in recipes() if r.option == "attention"}
    return any(m.__dict__.get(_KIND) in kinds for m in model.modules())


def _attention_switch(model: nn.Module, options: Options, plan: _Plan) -> Optional[AttentionSwitch]:
    """The config switch to make (None: none), or ImportError when a named attention cannot run."""
    from tempo.integrations.hf_attention import (MIN_ATTENTION_INTERFACE_VERSION, model_dispatches_attention,
                                                 require_attention_interface, transformers_version)

    if options.attention is None or plan.attention_modules or _has_attention_replacements(model):
        return None  # not asked for, or taken by module recipes (DeBERTa's core), now or by an earlier call
    if not configs_of(model):
        logger.info("attention: %s has no HF config; nothing to switch", type(model).__name__)
        return None
    attention_kinds = {r.kind for r in recipes() if r.option == "attention"}
    refused = sorted(reason for kind, reason in plan.skipped if kind in attention_kinds)
    try:
        if refused:  # an attention recipe recognised the modules and left them alone: its reason, not another
            raise ImportError(f"{type(model).__name__}: its attention modules were left alone ({'; '.join(refused)})")
        require_attention_interface()
        if not model_dispatches_attention(model):
            raise ImportError(
                f"{type(model).__name__} in transformers {transformers_version()} computes attention in its own "
                f"layers instead of dispatching through AttentionInterface, so Tempo attention cannot be plugged "
                f"in (BERT-family models dispatch from about transformers 4.54; the interface itself needs >= "
                f"{MIN_ATTENTION_INTERFACE_VERSION}). apply_tempo(model, attention=False) still patches GELU and "
                f"LayerNorm.")
    except ImportError as exc:
        if options.attention_named:
            raise
        logger.info("apply_tempo: attention left as it is: %s", str(exc).split(". apply_tempo(")[0])
        return None
    inherited: list[tuple[Any, Any]] = []  # (original config, its copy) pairs of sub-models patched before
    for _, state in _nested_states(model):
        switch = state.get("switch")
        if switch is not None:
            inherited.extend(switch.copies)
    return AttentionSwitch(model, _hf_implementation(options.attention), inherited)


def _install_model_hooks(model: nn.Module) -> None:
    """What the model needs around the replacements it holds (DeBERTa: the call hooks), where it lacks it."""
    present = {m.__dict__.get(_KIND) for m in model.modules() if is_replacement(m)}
    for recipe in recipes():
        if recipe.model_hook is not None and recipe.kind in present:
            recipe.model_hook(model)


def _remove_model_hooks(model: nn.Module) -> None:
    """Every recipe's model hooks out of the whole tree (found by identity: nothing was kept)."""
    for recipe in recipes():
        if recipe.model_unhook is not None:
            recipe.model_unhook(model)


_FORWARD_HOOK_DICTS = ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks",
                       "_forward_hooks_with_kwargs", "_forward_hooks_always_called")


def _extras_of(model: nn.Module) -> list[tuple[nn.Module, set, list[tuple[str, dict]]]]:
    """What model hooks add to the modules of the tree (instance attributes, forward hooks), as it
    is now: a failed apply puts it back exactly (kept only during the call)."""
    return [(m, set(m.__dict__), [(name, dict(m.__dict__[name])) for name in _FORWARD_HOOK_DICTS
                                  if name in m.__dict__]) for m in model.modules()]


def _put_extras_back(snapshot: list[tuple[nn.Module, set, list[tuple[str, dict]]]]) -> None:
    for module, attributes, hook_dicts in snapshot:
        for added in set(module.__dict__) - attributes:
            del module.__dict__[added]
        for name, entries in hook_dicts:
            hooks = module.__dict__[name]
            hooks.clear()
            hooks.update(entries)


# ---------------------------------------------------------------------------------------------
# apply / revert
# ---------------------------------------------------------------------------------------------
def apply_tempo(model: nn.Module, gelu: bool = _DEFAULT.gelu, layernorm: bool = _DEFAULT.layernorm,
                attention: bool | str | None = None,
                dropout_add_layernorm: bool = _DEFAULT.dropout_add_layernorm, lm_loss: bool = _DEFAULT.lm_loss) -> nn.Module:
    """Swap Tempo's memory-saving layers into ``model`` in place; returns ``model``.

    With no arguments: the default, ``tempo.choices.TempoChoice.default()`` (every Tempo layer kind
    with the efficient attention), which is what the trainers' ``--tempo`` means too.

    ``gelu``: exact and tanh GELU modules -> InplaceGelu of the same form (and gated MLPs, SwiGLU
    and GeGLU -> GatedMLP). ``layernorm``: every norm, for a norm is a norm: nn.LayerNorm ->
    InplaceLayerNorm, and any RMSNorm (LlamaRMSNorm, Qwen3's, EuroBERT's, Gemma3's (1 + w) form,
    T5LayerNorm, nn.RMSNorm, ...; recognised by structure and checked numerically,
    tempo.integrations.layers) -> InplaceRMSNorm, holding the same Parameters.
    ``attention``: None (the default) or "efficient": tempo.efficient_attention, O(s) kept per row
    (HF models dispatching through AttentionInterface: ``attn_implementation`` "tempo_efficient");
    True or "tempo": the paper's Combined ("tempo"; DeBERTa-v2/v3: ``DebertaCombinedAttention``);
    False leaves it. ``dropout_add_layernorm``: the BERT family's residual blocks (BERT, RoBERTa,
    XLM-R, CamemBERT, ELECTRA, DeBERTa-v2/v3) -> ``FusedResidualOutput`` (one DropoutAddLayerNorm,
    same state_dict keys), and every other plain ``nn.Dropout`` -> ``SeededDropout`` (a class switch:
    it keeps a seed, not its mask; tempo.ops.dropout). ``lm_loss``: a causal or masked LM's head and
    loss, in training with labels, through ``tempo.ops.linear_cross_entropy`` (no logits; ``outputs.logits``
    is None then; a class switch, tempo.integrations.lm_loss).
    The paper's three layers:
    ``apply_tempo(model, attention="tempo", dropout_add_layernorm=False)``.
    See the module docstring for the rules (idempotent, all or nothing, stock behaviour).

    With the HF Trainer, patch the model before building the Trainer:

        trainer = Trainer(model=apply_tempo(model), args=training_args, train_dataset=dataset, ...)

    Raises TypeError for a model that is not an ``nn.Module`` (a checkpoint name, say) or option
    values of the wrong type; ValueError for a model already patched with another choice;
    ImportError (before changing anything) when ``attention`` names a Tempo attention that cannot
    run on this model (one that computes attention itself without a Tempo recipe for it); with the
    default (None) such an attention is left as it is, logged in one line.
    """
    _check_model(model)
    options = _options(gelu, layernorm, attention, dropout_add_layernorm, lm_loss)
    _check_not_differently_patched(model, options)
    if _STATE in model.__dict__:
        logger.info("apply_tempo: %s is already patched with this choice; nothing to do", type(model).__name__)
        _install_model_hooks(model)  # only where missing (a sub-model moved in, say): idempotent
        switch = model.__dict__[_STATE].get("switch")
        if switch is not None:
            switch.hook_calls()  # the attention's call hooks, likewise
        return model

    if options.attention is not None and asks_for_attention_weights(model):
        logger.info("attention: %s's config sets output_attentions=True; Tempo attention keeps no attention "
                    "weights to return, so the attention is left as it is", type(model).__name__)
        options_for_modules = Options(options.gelu, options.layernorm, None, options.dropout_add_layernorm,
                                      lm_loss=options.lm_loss)
    else:
        options_for_modules = options
    active = [r for r in recipes() if r.is_enabled(options_for_modules)]

    # 1. Plan: build and check every replacement; nothing in the model changes if this fails.
    plan = _plan(model, options_for_modules, active)
    switch = _attention_switch(model, options_for_modules, plan)

    # 2. Apply: swap them all in, then the attention; undo everything if any step fails.
    applied: list[_Swap] = []
    extras_before = _extras_of(model)
    switched: list[Switched] = []  # the class switches: projections, dropouts
    try:
        for swap in plan.swaps:
            swap.parent._modules[swap.name] = swap.new
            applied.append(swap)
        if switch is not None:
            switch.apply()
        # What the model needs around some replacements (DeBERTa: the call hooks).
        _install_model_hooks(model)
        # The projections reading a Tempo RMSNorm's output keep it instead of a 16-bit copy.
        switched.extend(keep_norm_outputs(model))
        # The dropouts left as modules (inline residual, embedding, classifier) keep a seed, not a mask.
        if options_for_modules.dropout_add_layernorm:
            switched.extend(seed_dropouts(model))
        # A causal or masked LM's head and loss without the logits in training (tempo.integrations.lm_loss).
        if options_for_modules.lm_loss:
            switched.extend(fuse_lm_loss(model))
    except BaseException:
        restore_classes(switched)
        _put_extras_back(extras_before)
        if switch is not None:
            switch.undo()
        for swap in reversed(applied):
            swap.parent._modules[swap.name] = swap.old
        logger.info("apply_tempo: failed, %s left as it was", type(model).__name__)
        raise
    # Data only (the choice, and the switch's config objects, all inside this model): a deep copy or a
    # pickled model carries its own and reverts without touching this one.
    model.__dict__[_STATE] = {"options": options, "switch": switch, "switched": switched}
    _prepare_swapped(model, plan.swaps)
    _log(model, plan, switch)
    return model


def _log(model: nn.Module, plan: _Plan, switch: Optional[AttentionSwitch]) -> None:
    counts: Counter = Counter()
    for swap in plan.swaps:
        if swap.recipe is None:
            continue
        old = swap.old
        if old._forward_hooks or old._forward_pre_hooks or old._backward_hooks:
            logger.warning("%s has hooks; they stay on the original module and do not run while it is replaced",
                           swap.qualified)
        counts[swap.recipe.labels(swap.new)] += 1
        logger.debug("%s: %s -> %s", swap.qualified, type(old).__name__, type(swap.new).__name__)
    for (kind, reason), n in sorted(plan.skipped.items()):
        logger.info("apply_tempo: left %d %s module%s alone (%s)", n, kind, "" if n == 1 else "s", reason)
    for (kind, becomes), n in sorted(counts.items()):
        logger.info("apply_tempo: replaced %d %s -> %s", n, kind, becomes)
    if not counts and not (switch is not None and switch.switched):
        logger.info("apply_tempo: nothing to replace in %s", type(model).__name__)


def _prepare_swapped(model: nn.Module, swaps: list[_Swap]) -> None:
    """After the swaps: every Tempo LayerNorm gets its qualified name (its errors quote it), and
    each InplaceGelu's derivative table is built on the device the model's parameters are on (it
    was built on the CPU with the module; a model already on a GPU would otherwise build it at its
    first forward there)."""
    from tempo.ops.layernorm import name_layernorms

    name_layernorms(model)
    gelus = [swap.new for swap in swaps if swap.recipe is not None and swap.recipe.kind == "GELU"]
    if not gelus:
        return
    from tempo.ops.gelu import prepare_derivative_table

    devices = {p.device for p in model.parameters() if p.device.type not in ("cpu", "meta")}
    for device in devices:
        for form in {g.approximate for g in gelus}:
            prepare_derivative_table(device, form)


def _restore_one(child: nn.Module) -> nn.Module:
    """The original a replacement stands for, given the replacement's current parts and mode."""
    original = child.__dict__[ORIGINAL]
    recipe = _recipe_named(child.__dict__.get(_KIND, ""))
    if recipe is not None and recipe.restore is not None:
        recipe.restore(child, original)
    else:
        move_parameters(child, original)
    # Its mode, and that of the parts only the original holds (the replacement's are shared).
    shared = {id(m) for m in child.modules()}
    for module in original.modules():
        if id(module) not in shared:
            module.training = child.training
    return original


def revert_tempo(model: nn.Module) -> nn.Module:
    """Undo everything Tempo put on ``model``; returns it.

    Puts back every module apply_tempo replaced (the same objects), every class it switched and
    every config object, and takes off every per-block recompute (``tempo.plan``'s ``Plan.apply``,
    ``apply_recompute``, ``set_recompute``; with or without apply_tempo, before or after it:
    ``tempo.integrations.recompute.remove_recompute``). Afterwards every module has the class it had
    before Tempo, no recompute mode in its ``__dict__`` and no hook Tempo registered, and a
    training step runs each block's forward once: the stock model's loss and gradients."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"revert_tempo: argument 'model' must be a torch.nn.Module, got {type(model).__name__}")
    counts: Counter = Counter()
    restored: dict[int, nn.Module] = {}
    for parent_name, parent in list(model.named_modules(remove_duplicate=False)):
        for child_name, child in list(parent._modules.items()):
            if child is None or ORIGINAL not in child.__dict__:
                continue
            if id(child) not in restored:
                restored[id(child)] = _restore_one(child)
                counts[type(restored[id(child)]).__name__] += 1
            parent._modules[child_name] = restored[id(child)]
            qualified = f"{parent_name}.{child_name}" if parent_name else child_name
            logger.debug("%s: %s -> %s", qualified, tempo_class(child).__name__, type(restored[id(child)]).__name__)
    for kind, n in sorted(counts.items()):
        logger.info("revert_tempo: restored %d %s", n, kind)
    states = [model.__dict__.pop(_STATE)] if _STATE in model.__dict__ else []
    for _, module in list(model.named_modules()):
        if _STATE in module.__dict__:
            states.append(module.__dict__.pop(_STATE))
    _remove_model_hooks(model)
    for state in states:
        restore_classes(state.get("switched", []))
        switch = state.get("switch")
        if switch is not None:
            switch.undo()
            logger.info("revert_tempo: %s has its original config object%s back", type(model).__name__,
                        "s" if len(configs_of(model)) > 1 else "")
    # After the modules are back: a hook set before apply_tempo on a module it replaced is back too.
    from tempo.integrations.recompute import remove_recompute

    recomputed = remove_recompute(model)
    if recomputed:
        logger.info("revert_tempo: %d block%s without recompute again", recomputed, "" if recomputed == 1 else "s")
    return model


def tempo_patched(model: nn.Module) -> dict[str, int]:
    """How many modules of each Tempo kind the model holds now, and whether attention is "tempo"."""
    counts: Counter = Counter()
    for module in model.modules():
        if is_replacement(module):
            counts[tempo_class(module).__name__] += 1
    configs = configs_of(model)
    counts["attention"] = int(bool(configs) and all(c._attn_implementation in ("tempo", "tempo_efficient")
                                                    for c in configs))
    return dict(counts)


def tempo_switched(model: nn.Module) -> dict[str, int]:
    """How many modules apply_tempo switched the class of (no new object): the projections keeping
    a norm's output (``InputKeepingLinear``) and the dropouts keeping a seed (``SeededDropout``)."""
    from tempo.ops.dropout import SeededDropout
    from tempo.ops.linear import InputKeepingLinear

    return dict(Counter(type(m).__name__ for m in model.modules() if type(m) in (SeededDropout, InputKeepingLinear)))


__all__ = ["FusedResidualOutput", "apply_tempo", "gelu_form", "revert_tempo", "tempo_patched", "tempo_switched"]
