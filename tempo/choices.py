"""The one vocabulary of Tempo choices: which layers are swapped, which attention runs, which precision.

Every place that lets a user choose reads this module: the trainers' flags (``--tempo``,
``--tempo_layers``, ``--attention``), the benchmark's flags (same spelling), the BERT model,
``apply_tempo``, AutoTempo and the ledger tables. Adding a layer kind or an attention
implementation means editing this file and the code that builds the layer, nothing else.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Iterable, Optional

# Layer kinds Tempo can swap in. dropout_add_layernorm fuses the hidden dropout, the residual add
# and the LayerNorm after it (DropoutAddLayerNorm: keeps no mask and no pre-LN sum).
LAYER_KINDS = ("gelu", "layernorm", "attention", "dropout_add_layernorm")
# The paper's three layers: what TempoChoice.full() turns on by default. (--tempo without
# --tempo_layers turns on TempoChoice.floor(), every kind with efficient attention.)
DEFAULT_KINDS = ("gelu", "layernorm", "attention")
# Implementations of the attention core (softmax -> dropout -> matmul with v):
#   eager: PyTorch ops as written (keeps the s x s probabilities, mask and dropout output);
#   tempo: the paper's Combined layer (keeps the s x s probabilities, no mask);
#   sdpa: torch's scaled_dot_product_attention as is;
#   efficient: tempo.efficient_attention (O(s) per row: q, k, v, out, log-sum-exp, a seed).
ATTENTIONS = ("eager", "tempo", "sdpa", "efficient")
# The attention implementations that are Tempo layers (count as the "attention" kind).
TEMPO_ATTENTIONS = ("tempo", "efficient")
# What --attention means when Tempo attention is on and no implementation is named.
DEFAULT_TEMPO_ATTENTION = "tempo"
# Training precisions, in one order everywhere: tf32 = fp32 weights with TF32 matmuls.
PRECISIONS = ("fp32", "tf32", "bf16", "fp16")


class ChoiceError(ValueError):
    """A Tempo choice that does not exist (names the flag or argument)."""


def parse_kinds(spec: str | Iterable[str], flag: str = "--tempo_layers") -> tuple[str, ...]:
    """'gelu,layernorm' or an iterable of kinds -> the kinds in LAYER_KINDS order; unknown ones fail."""
    items = spec.split(",") if isinstance(spec, str) else list(spec)
    kinds = {k.strip() for k in items if k.strip()}
    unknown = kinds - set(LAYER_KINDS)
    if unknown:
        raise ChoiceError(f"{flag}: unknown layer kind(s) {sorted(unknown)}; choose from {LAYER_KINDS}")
    return tuple(k for k in LAYER_KINDS if k in kinds)


@dataclass(frozen=True)
class TempoChoice:
    """Which Tempo layers replace the stock ones, and where.

    gelu: InplaceGelu instead of GELU; layernorm: InplaceLayerNorm instead of LayerNorm;
    attention: the attention implementation (one of ATTENTIONS); first_layers: apply the layer
    swaps to the first k Transformer blocks only (None: all of them).
    """

    gelu: bool = False
    layernorm: bool = False
    attention: str = "eager"
    first_layers: Optional[int] = None
    dropout_add_layernorm: bool = False

    def __post_init__(self) -> None:
        if self.attention not in ATTENTIONS:
            raise ChoiceError(f"unknown attention implementation {self.attention!r}; choose one of {ATTENTIONS}")
        if self.first_layers is not None and self.first_layers < 0:
            raise ChoiceError(f"first_layers must be >= 0, got {self.first_layers}")

    @classmethod
    def none(cls, attention: str = "eager") -> "TempoChoice":
        """No Tempo layer (the stock model), with the given attention implementation."""
        return cls(attention=attention)

    original = none  # the name the trainers and tables use for the stock layers

    @classmethod
    def full(cls, kinds: Iterable[str] = DEFAULT_KINDS, attention: Optional[str] = None) -> "TempoChoice":
        """The given kinds on (the paper's three by default); ``attention`` overrides the attention
        implementation."""
        kinds = parse_kinds(kinds, flag="kinds")
        if attention is None:
            attention = DEFAULT_TEMPO_ATTENTION if "attention" in kinds else "eager"
        return cls(gelu="gelu" in kinds, layernorm="layernorm" in kinds, attention=attention,
                   dropout_add_layernorm="dropout_add_layernorm" in kinds)

    @classmethod
    def floor(cls) -> "TempoChoice":
        """Every Tempo layer with O(s) attention: the least a layer keeps without recomputing a GEMM."""
        return cls.full(LAYER_KINDS, attention="efficient")

    @classmethod
    def from_flags(cls, enabled: bool, kinds: str | Iterable[str] | None = None,
                   attention: Optional[str] = None, flag: str = "--tempo_layers") -> "TempoChoice":
        """What ``--tempo/--no-tempo``, ``--tempo_layers`` and ``--attention`` ask for: with no
        --tempo_layers, --tempo means the best Tempo has (``floor()``), --attention overriding its
        attention implementation."""
        if kinds is not None:
            kinds = parse_kinds(kinds, flag=flag)
        if not enabled:
            return cls.none(attention or "eager")
        if kinds is None:
            best = cls.floor()
            return best if attention is None else replace(best, attention=attention)
        return cls.full(kinds, attention=attention)

    @property
    def kinds(self) -> tuple[str, ...]:
        """The Tempo layer kinds this choice turns on, in LAYER_KINDS order."""
        on = {"gelu": self.gelu, "layernorm": self.layernorm, "attention": self.attention in TEMPO_ATTENTIONS,
              "dropout_add_layernorm": self.dropout_add_layernorm}
        return tuple(k for k in LAYER_KINDS if on[k])

    @property
    def is_none(self) -> bool:
        return not self.kinds

    @property
    def label(self) -> str:
        if self.is_none:
            return "no tempo" if self.attention == "eager" else f"no tempo, {self.attention} attention"
        where = "" if self.first_layers is None else f" (first {self.first_layers} layers)"
        return "+".join(self.kinds) + where

    def __str__(self) -> str:
        return (f"TempoChoice(gelu={self.gelu}, layernorm={self.layernorm}, attention={self.attention!r}"
                + (", dropout_add_layernorm=True" if self.dropout_add_layernorm else "")
                + (f", first_layers={self.first_layers})" if self.first_layers is not None else ")"))


__all__ = ["ATTENTIONS", "ChoiceError", "DEFAULT_KINDS", "DEFAULT_TEMPO_ATTENTION", "LAYER_KINDS", "PRECISIONS",
           "TEMPO_ATTENTIONS", "TempoChoice", "parse_kinds"]
