"""The one change ``apply_tempo`` makes outside the module tree: the attention a model's configs name.

Models whose attention layers dispatch through transformers' ``AttentionInterface`` (BERT-family,
GPT-2, ModernBERT, ...) run whatever ``config._attn_implementation`` names. Switching it is how
Tempo's attention gets in ("tempo_efficient" or "tempo", registered by
``tempo.integrations.hf_attention``).

Models built from one config object share it (``BertForMaskedLM(cfg)`` twice): switching the
shared object would switch every model built from it. So the configs of the patched model are
copied first (one ``copy.deepcopy`` with a shared memo, so sub-configs stay shared inside the
model) and every module of the model that held an original config holds its copy; only the copies
are switched. ``revert_tempo`` gives each module its original config object back (changes made to
the copy while patched are dropped with it). A model patched in parts (its base model first, then
the head model) gets one copy: the head's modules are given the copy the base's patch made, so
``head.config is head.bert.config`` holds as it did before. A config Tempo copied is never copied
again.

The switch also puts the attention's call hooks on every transformers model of the tree whose
attention is now Tempo's (``hf_attention.install_call_hooks``: each model call hands its packing
to the layers, read once outside any torch.compile graph); ``undo`` takes out the ones it put
there, found by identity.

Everything the switch keeps is objects inside the model it switched (its modules, their original
configs and the copies), paired by identity, never an ``id()`` or a registry outside the model: a
deep copy of a patched model (one memo) or a pickled one has a switch of its own, over its own
objects, and reverting it never touches the model it was copied from.
"""

from __future__ import annotations

import copy
import logging
from typing import Any, Optional

from torch import nn

logger = logging.getLogger("tempo.integrations.patch")


def _copy_of(config: Any, pairs: list[tuple[Any, Any]]) -> Optional[Any]:
    """The copy paired with ``config`` (by identity) in (original, copy) pairs, or None."""
    return next((new for original, new in pairs if original is config), None)


def config_holders(model: nn.Module) -> list[tuple[nn.Module, Any]]:
    """(module, config) for every module of the tree that holds an HF config (``module.config``
    with ``_attn_implementation``), in tree order."""
    holders = []
    for module in model.modules():
        config = module.__dict__.get("config")
        if config is not None and hasattr(config, "_attn_implementation"):
            holders.append((module, config))
    return holders


def configs_of(model: nn.Module) -> list[Any]:
    """Distinct HF configs of the model and its sub-models, in tree order."""
    seen, out = set(), []
    for _, config in config_holders(model):
        if id(config) not in seen:
            seen.add(id(config))
            out.append(config)
    return out


def asks_for_attention_weights(model: nn.Module) -> bool:
    return any(getattr(config, "output_attentions", False) is True for config in configs_of(model))


def _set_attn_implementation(model: nn.Module, configs: list[Any], implementation: str) -> None:
    setter = getattr(model, "set_attn_implementation", None)
    if callable(setter):
        setter(implementation)
    for config in configs:  # older versions, or sub-configs the setter skipped
        if config._attn_implementation != implementation:
            config._attn_implementation = implementation


class AttentionSwitch:
    """Switch ``model``'s attention to ``implementation`` on copies of its configs (see the module
    docstring); ``inherited``: (original config, copy) pairs that nested patches already made."""

    def __init__(self, model: nn.Module, implementation: str, inherited: Optional[list[tuple[Any, Any]]] = None):
        self.model = model
        self.implementation = implementation
        self.inherited = list(inherited or [])
        self.holders: list[tuple[nn.Module, Any]] = []  # (module, its original config) for revert
        self.copies: list[tuple[Any, Any]] = []  # (original, copy): this switch's and inherited ones
        self.previous: list[tuple[Any, str]] = []  # (copy, implementation it had) for the log
        self.config_classes: list[tuple[Any, type]] = []
        self.hooked: list[nn.Module] = []  # models of the tree this switch gave the attention's call hooks
        self.switched = False

    def apply(self) -> bool:
        """Copy, reassign, switch; True when anything changed. Raises with nothing changed."""
        from tempo.integrations.hf_attention import accept_output_attentions, register_tempo_attention

        holders = config_holders(self.model)
        if not holders:
            logger.info("attention: %s has no HF config; nothing to switch", type(self.model).__name__)
            return False
        register_tempo_attention()
        memo: dict[int, Any] = {}
        try:
            made_before = [new for _, new in self.inherited]
            for module, config in holders:
                if any(config is new for new in made_before):
                    continue  # a sub-model's patch gave it Tempo's copy already
                new = _copy_of(config, self.inherited) or _copy_of(config, self.copies)
                if new is None:
                    new = copy.deepcopy(config, memo)
                if _copy_of(config, self.copies) is None:
                    self.copies.append((config, new))
                module.__dict__["config"] = new
                self.holders.append((module, config))
            configs = configs_of(self.model)
            self.previous = [(c, c._attn_implementation) for c in configs]
            pending = [c for c in configs if c._attn_implementation != self.implementation]
            if pending:
                _set_attn_implementation(self.model, configs, self.implementation)
                if any(c._attn_implementation != self.implementation for c in configs):
                    raise RuntimeError(f"could not set attn_implementation={self.implementation!r} on "
                                       f"{type(self.model).__name__}")
                self.switched = True
            # config.output_attentions = True must keep working (a call asking for weights runs eager attention).
            for config in configs:
                original = accept_output_attentions(config)
                if original is not None:
                    self.config_classes.append((config, original))
            self.hook_calls()
        except BaseException:
            self.undo()
            raise
        if self.switched:
            before = self.previous[0][1]
            logger.info("attention: %s -> %s (%d config%s)", before, self.implementation, len(configs),
                        "" if len(configs) == 1 else "s")
        return bool(self.holders) or self.switched

    def hook_calls(self) -> None:
        """The attention's call hooks (each model call hands its packing to the layers, read once
        outside any torch.compile graph: hf_attention) on every transformers model of the tree that
        lacks them; idempotent."""
        from tempo.integrations.hf_attention import install_call_hooks

        self.hooked.extend(install_call_hooks(self.model))

    def undo(self) -> None:
        """Give every module its original config back (the copies go with their changes) and take
        out the call hooks this switch installed (found by identity: a user's hooks stay)."""
        from tempo.integrations.hf_attention import remove_call_hooks, restore_config_class

        remove_call_hooks(self.hooked)
        self.hooked.clear()
        for config, original in self.config_classes:
            restore_config_class(config, original)
        for module, config in reversed(self.holders):
            module.__dict__["config"] = config
        self.holders.clear()
        self.config_classes.clear()


__all__ = ["AttentionSwitch", "asks_for_attention_weights", "config_holders", "configs_of"]
