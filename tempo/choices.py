"""The one vocabulary of Tempo choices: which layers are swapped, which attention runs, which precision.

Every place that lets a user choose reads this module: the trainers' flags (``--tempo``,
``--tempo_layers``, ``--attention``), the benchmark's flags (same spelling), the BERT model,
``apply_tempo`` and the ledger tables. Adding a layer kind or an attention
implementation means editing this file and the code that builds the layer, nothing else.

The default, written once (``TempoChoice.default()``): every Tempo layer kind with the efficient
attention, the floor. ``--tempo`` (no ``--tempo_layers``) in the trainers and the benchmark and
``apply_tempo(model)`` with no arguments all mean it. It is the default because it keeps the least
of every choice (20.6 h per added BERT-large layer against 28.5 h / 40.5 h for the paper's three
layers at s = 128 / 512, ``python -m tempo.memory``) with the same exactness contract: every
layer in it returns the stock layer's values and gradients within the bounds its module states.
The paper's three layers (``PAPER_KINDS`` with the Combined attention, ``TempoChoice.paper()``)
are there to compare with the paper, always asked for by name.

Kinds named one by one (``--tempo_layers gelu,attention``, ``TempoChoice.full(kinds)``) keep
the paper's attention implementation unless one is named (``--attention efficient``); the
default restricted to some kinds (``TempoChoice.default(kinds)``) keeps the efficient one.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Iterable, Optional

# Layer kinds Tempo can swap in. dropout_add_layernorm fuses the hidden dropout, the residual add
# and the LayerNorm after it (DropoutAddLayerNorm: keeps no mask and no pre-LN sum), and makes the
# other dropouts SeededDropout (a seed, not a mask: embedding, inline residual dropouts).
LAYER_KINDS = ("gelu", "layernorm", "attention", "dropout_add_layernorm")
# The paper's three layers: what TempoChoice.full() and TempoChoice.paper() turn on. (The default,
# --tempo without --tempo_layers and apply_tempo(model), is TempoChoice.default(): every kind with
# efficient attention.)
PAPER_KINDS = ("gelu", "layernorm", "attention")
# Implementations of the attention core (softmax -> dropout -> matmul with v):
#   eager: PyTorch ops as written (keeps the s x s probabilities, mask and dropout output);
#   tempo: the paper's Combined layer (keeps the s x s probabilities, no mask);
#   sdpa: torch's scaled_dot_product_attention as is;
#   efficient: tempo.efficient_attention (O(s) per row: q, k, v, out, log-sum-exp, a seed).
ATTENTIONS = ("eager", "tempo", "sdpa", "efficient")
# The attention implementations that are Tempo layers (count as the "attention" kind).
TEMPO_ATTENTIONS = ("tempo", "efficient")
# What --attention means when the attention kind is named (--tempo_layers ...,attention,
# TempoChoice.full, apply_tempo(attention=True)) and no implementation is: the paper's Combined.
DEFAULT_TEMPO_ATTENTION = "tempo"
# The attention of the default choice (TempoChoice.default()): O(s) kept per row.
FLOOR_ATTENTION = "efficient"
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
    """Which Tempo layers replace the stock ones.

    gelu: InplaceGelu instead of GELU; layernorm: InplaceLayerNorm instead of LayerNorm;
    attention: the attention implementation (one of ATTENTIONS); dropout_add_layernorm: the fused
    dropout -> residual add -> LayerNorm, and SeededDropout for the other dropouts. (Where to trade compute for memory, block by block, is
    the planner's per-block recompute: tempo.plan.)
    """

    gelu: bool = False
    layernorm: bool = False
    attention: str = "eager"
    dropout_add_layernorm: bool = False
    # The LM head and its loss through tempo.ops.linear_cross_entropy in training (no logits): part of
    # the default (the floor), not a layer kind of the paper's.
    lm_loss: bool = False

    def __post_init__(self) -> None:
        if self.attention not in ATTENTIONS:
            raise ChoiceError(f"unknown attention implementation {self.attention!r}; choose one of {ATTENTIONS}")

    @classmethod
    def none(cls, attention: str = "eager") -> "TempoChoice":
        """No Tempo layer (the stock model), with the given attention implementation."""
        return cls(attention=attention)

    original = none  # the name the trainers and tables use for the stock layers

    @classmethod
    def full(cls, kinds: Iterable[str] = PAPER_KINDS, attention: Optional[str] = None) -> "TempoChoice":
        """The given kinds on (the paper's three by default); ``attention`` overrides the attention
        implementation (by default DEFAULT_TEMPO_ATTENTION, the paper's, when "attention" is on)."""
        kinds = parse_kinds(kinds, flag="kinds")
        if attention is None:
            attention = DEFAULT_TEMPO_ATTENTION if "attention" in kinds else "eager"
        return cls(gelu="gelu" in kinds, layernorm="layernorm" in kinds, attention=attention,
                   dropout_add_layernorm="dropout_add_layernorm" in kinds)

    @classmethod
    def floor(cls) -> "TempoChoice":
        """Every Tempo layer with O(s) attention: the least a layer keeps without recomputing a GEMM;
        and the fused LM head and loss."""
        return replace(cls.full(LAYER_KINDS, attention=FLOOR_ATTENTION), lm_loss=True)

    @classmethod
    def default(cls, kinds: Optional[Iterable[str]] = None) -> "TempoChoice":
        """THE default: what ``--tempo`` and ``apply_tempo(model)`` mean (the floor, see the module
        docstring). ``kinds`` keeps only those kinds of it on (the attention, when on, stays the
        efficient one)."""
        if kinds is None:
            return cls.floor()
        kinds = parse_kinds(kinds, flag="kinds")
        return cls.full(kinds, attention=FLOOR_ATTENTION if "attention" in kinds else None)

    @classmethod
    def paper(cls) -> "TempoChoice":
        """The Tempo paper's three layers: In-place GELU, In-place LayerNorm, Combined attention."""
        return cls.full(PAPER_KINDS, attention="tempo")

    @classmethod
    def from_flags(cls, enabled: bool, kinds: str | Iterable[str] | None = None,
                   attention: Optional[str] = None, flag: str = "--tempo_layers") -> "TempoChoice":
        """What ``--tempo/--no-tempo``, ``--tempo_layers`` and ``--attention`` ask for: with no
        --tempo_layers, --tempo means the default (``default()``, the floor), --attention overriding
        its attention implementation."""
        if kinds is not None:
            kinds = parse_kinds(kinds, flag=flag)
        if not enabled:
            return cls.none(attention or "eager")
        if kinds is None:
            best = cls.default()
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
        return "+".join(self.kinds)

    def __str__(self) -> str:
        return (f"TempoChoice(gelu={self.gelu}, layernorm={self.layernorm}, attention={self.attention!r}"
                + (", dropout_add_layernorm=True)" if self.dropout_add_layernorm else ")"))


__all__ = ["ATTENTIONS", "ChoiceError", "DEFAULT_TEMPO_ATTENTION", "FLOOR_ATTENTION", "LAYER_KINDS", "PAPER_KINDS",
           "PRECISIONS", "TEMPO_ATTENTIONS", "TempoChoice", "parse_kinds"]
