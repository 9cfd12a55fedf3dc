"""In-place LayerNorm (Tempo): backward from the output. Implementation in tempo.ops.layernorm."""

from tempo.ops.layernorm import InplaceLayerNorm, inplace_layernorm

__all__ = ["InplaceLayerNorm", "inplace_layernorm"]
