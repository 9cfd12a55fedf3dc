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
"""

from __future__ import annotations

import copy
import logging
import weakref
from typing import Any, Optional

from torch import nn

logger = logging.getLogger("tempo.integrations.patch")

# Configs Tempo made (id -> weak reference): a model patched in parts reuses them instead of copying again.
_COPIES: dict[int, "weakref.ref[Any]"] = {}


def is_tempo_copy(config: Any) -> bool:
    ref = _COPIES.get(id(config))
    return ref is not None and ref() is config


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
    docstring); ``inherited`` maps id(original config) -> the copy a nested patch already made."""

    def __init__(self, model: nn.Module, implementation: str, inherited: Optional[dict[int, Any]] = None):
        self.model = model
        self.implementation = implementation
        self.inherited = dict(inherited or {})
        self.holders: list[tuple[nn.Module, Any]] = []  # (module, its original config) for revert
        self.copies: dict[int, Any] = {}  # id(original) -> copy, this switch's and inherited ones
        self.previous: list[tuple[Any, str]] = []  # (copy, implementation it had) for the log
        self.config_classes: list[tuple[Any, type]] = []
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
            for module, config in holders:
                if is_tempo_copy(config):
                    continue
                new = self.inherited.get(id(config)) or self.copies.get(id(config))
                if new is None:
                    new = copy.deepcopy(config, memo)
                    _COPIES[id(new)] = weakref.ref(new)
                self.copies[id(config)] = new
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
        except BaseException:
            self.undo()
            raise
        if self.switched:
            before = self.previous[0][1]
            logger.info("attention: %s -> %s (%d config%s)", before, self.implementation, len(configs),
                        "" if len(configs) == 1 else "s")
        return bool(self.holders) or self.switched

    def undo(self) -> None:
        """Give every module its original config back (the copies go with their changes)."""
        from tempo.integrations.hf_attention import restore_config_class

        for config, original in self.config_classes:
            restore_config_class(config, original)
        for module, config in reversed(self.holders):
            module.__dict__["config"] = config
        self.holders.clear()
        self.config_classes.clear()


__all__ = ["AttentionSwitch", "asks_for_attention_weights", "config_holders", "configs_of", "is_tempo_copy"]
