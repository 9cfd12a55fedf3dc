"""The original Tempo import path for the combined softmax -> dropout -> matmul layer."""

from tempo.ops.combined import Combined, combined_softmax_dropout_matmul

__all__ = ["Combined", "combined_softmax_dropout_matmul"]
