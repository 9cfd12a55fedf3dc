"""Tempo: Transformer layers that keep fewer bytes for backward, and a BERT trainer built on them.

The three layers of the Tempo paper, importable from here or from their original paths:

    from tempo.inplace_gelu import InplaceGelu
    from tempo.inplace_layernorm import InplaceLayerNorm
    from tempo.combined import Combined

``tempo.memory.ActivationLedger`` measures what they save; ``tempo.apply_tempo(model)`` puts them
into an existing HuggingFace model (``tempo.revert_tempo`` takes them out again).
"""

from importlib import import_module
from typing import Any

__version__ = "0.1.0"

# Resolved on first use so that `import tempo` stays cheap (no Triton import) and so that the
# trainer, the data tools and the ledger do not pay for kernels they never call.
_LAZY = {
    "InplaceGelu": "tempo.inplace_gelu",
    "InplaceLayerNorm": "tempo.inplace_layernorm",
    "InplaceRMSNorm": "tempo.ops.rmsnorm",
    "Combined": "tempo.combined",
    "DropoutAddLayerNorm": "tempo.ops.dropout_add_layernorm",
    "dropout_add_layernorm": "tempo.ops.dropout_add_layernorm",
    "EfficientAttention": "tempo.ops.attention",
    "efficient_attention": "tempo.ops.attention",
    "refresh_kept_column_plans": "tempo.ops.layernorm",
    "ActivationLedger": "tempo.memory",
    "TempoChoice": "tempo.choices",
    "use_backend": "tempo.ops._backend",
    "apply_tempo": "tempo.integrations.patch",
    "revert_tempo": "tempo.integrations.patch",
    "tempo_patched": "tempo.integrations.patch",
    "confirm": "tempo.plan",
}
# Subpackages reachable as attributes of ``tempo`` without importing them first.
_SUBPACKAGES = ("plan",)
# Names that were here once, and what replaced them: an ImportError says so, for ``tempo.name`` and
# ``from tempo import name`` alike (the import statement would swallow an AttributeError's message).
_REMOVED = {
    name: "AutoTempo's measured search was replaced by the planner: tempo.plan.plan(model, budget=...) chooses the "
          "tokens per step and the recompute, tempo.plan.confirm(plan, model_factory, batch_factory) measures the "
          "plan and its neighbours on the device and keeps the fastest that fits (docs/huggingface.md)"
    for name in ("auto_tempo", "AutoTempoResult", "apply_choice")
}

__all__ = sorted([*_LAZY, *_SUBPACKAGES])


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(import_module(_LAZY[name]), name)
    if name in _SUBPACKAGES:
        return import_module(f"tempo.{name}")
    if name in _REMOVED:
        raise ImportError(f"tempo.{name} was removed. {_REMOVED[name]}", name="tempo")
    raise AttributeError(f"module 'tempo' has no attribute {name!r}")
