"""Tempo's original import path for the In-place GELU layer (exact and tanh forms)."""

from tempo.ops.gelu import InplaceGelu, gelu_derivative_from_output, inplace_gelu, prepare_derivative_table

__all__ = ["InplaceGelu", "inplace_gelu", "gelu_derivative_from_output", "prepare_derivative_table"]
