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
    "Combined": "tempo.combined",
    "DropoutAddLayerNorm": "tempo.ops.dropout_add_layernorm",
    "dropout_add_layernorm": "tempo.ops.dropout_add_layernorm",
    "EfficientAttention": "tempo.ops.attention",
    "efficient_attention": "tempo.ops.attention",
    "ActivationLedger": "tempo.memory",
    "TempoChoice": "tempo.choices",
    "use_backend": "tempo.ops._backend",
    "apply_tempo": "tempo.integrations.patch",
    "revert_tempo": "tempo.integrations.patch",
    "tempo_patched": "tempo.integrations.patch",
    "auto_tempo": "tempo.integrations.autotempo",
    "AutoTempoResult": "tempo.integrations.autotempo",
    "apply_choice": "tempo.integrations.autotempo",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'tempo' has no attribute {name!r}")
