"""Recipe for the BERT family's residual blocks: ``LayerNorm(dropout(dense(hidden)) + input)``.

transformers' ``BertSelfOutput`` / ``BertOutput`` and their copies in RoBERTa, XLM-R, CamemBERT,
ELECTRA and DeBERTa-v2/v3 (and any module built the same way: MPNet's ``MPNetOutput``, recognised
by structure) become one ``FusedResidualOutput`` each: the same ``dense`` module, the
LayerNorm's Parameters under the same state_dict keys in a ``DropoutAddLayerNorm`` (keeps no dropout
mask and no pre-LayerNorm sum), and the block's own ``nn.Dropout``, whose rate and train flag the
fused op reads at every forward. Recognised by class name or structure, checked numerically.
"""

from __future__ import annotations

import torch
from torch import nn

from tempo.integrations.recipe import (Options, Recipe, as_original_class, has_meta_weights, move_parameters,
                                      same_output, sample)

RESIDUAL_BLOCKS = {f"{family}{part}" for family in ("Bert", "Roberta", "XLMRoberta", "Camembert", "Electra",
                                                     "DebertaV2")
                   for part in ("SelfOutput", "Output")}


class FusedResidualOutput(nn.Module):
    """A ``BertSelfOutput``/``BertOutput``-style block with its dropout, residual add and LayerNorm
    fused into one ``DropoutAddLayerNorm``: same ``dense`` module, same LayerNorm Parameters under
    the same state_dict keys, the block's ``dropout`` module (its ``p`` is what the fused op drops
    with); keeps no dropout mask and no pre-LN sum."""

    def __init__(self, old: nn.Module):
        super().__init__()
        from tempo.ops.dropout_add_layernorm import DropoutAddLayerNorm

        ln = old.LayerNorm
        self.dense = old.dense  # the same module object: its Parameters, hooks and tying stay
        self.LayerNorm = DropoutAddLayerNorm(ln.normalized_shape, old.dropout.p, eps=ln.eps,
                                             elementwise_affine=ln.elementwise_affine,
                                             bias=getattr(ln, "bias", None) is not None, device="meta",
                                             dropout=old.dropout)
        move_parameters(ln, self.LayerNorm)
        # It takes the LayerNorm's place: isinstance(..., nn.LayerNorm) answers as before (no weight
        # decay on it in HF Trainer's rule; the model's _init_weights sets γ = 1, β = 0 as for the original).
        self.LayerNorm.__class__ = as_original_class(DropoutAddLayerNorm, type(ln))
        self.dropout = old.dropout  # the same nn.Dropout (also the fused op's): block.dropout.p works as before

    def forward(self, hidden_states: torch.Tensor, input_tensor: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dense(hidden_states), input_tensor)

    def _tempo_restore(self, original: nn.Module) -> None:
        """revert_tempo: the original block gets this one's current modules and Parameters back."""
        original.dense = self.dense
        original.dropout = self.LayerNorm.dropout
        move_parameters(self.LayerNorm, original.LayerNorm)


def _two_inputs(module: nn.Module) -> bool:
    """forward(hidden_states, input_tensor): the BERT residual block's call (what MPNetOutput and
    other copies of BertOutput take too)."""
    import inspect

    try:
        parameters = list(inspect.signature(type(module).forward).parameters.values())[1:]
    except (TypeError, ValueError):
        return False
    positional = [p for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return len(positional) == 2 and not any(p.kind is p.VAR_POSITIONAL for p in parameters)


def _recognise(module: nn.Module) -> bool:
    """A BertOutput-style block: by name for the families listed, else by structure (a ``dense``
    Linear, an ``nn.LayerNorm`` called ``LayerNorm``, an ``nn.Dropout`` called ``dropout``, called
    with (hidden_states, input_tensor)) — the numerical check confirms it computes LN(dense(h) + r)."""
    dense, ln, dropout = (getattr(module, n, None) for n in ("dense", "LayerNorm", "dropout"))
    if not (isinstance(dense, nn.Linear) and type(ln) is nn.LayerNorm and isinstance(dropout, nn.Dropout)):
        return False
    return type(module).__name__ in RESIDUAL_BLOCKS or (set(module._modules) == {"dense", "LayerNorm", "dropout"}
                                                        and _two_inputs(module))


def _build(old: nn.Module, options: Options) -> nn.Module:
    return FusedResidualOutput(old)


def _check(original: nn.Module, replacement: nn.Module) -> bool:
    """LayerNorm(dense(h) + r), dropout off."""
    dense = original.dense
    if has_meta_weights(original):
        return True  # nothing to compute with yet; the structure is BERT's
    h = sample((2, 3, dense.in_features), dense.weight, seed=0)
    r = sample((2, 3, dense.out_features), dense.weight, seed=1)
    return same_output(original, replacement, h, r)


def bert_family_recipes() -> list[Recipe]:
    return [Recipe(kind="dropout-add-LayerNorm", becomes="FusedResidualOutput (DropoutAddLayerNorm)",
                   option="dropout_add_layernorm", replacement=FusedResidualOutput, recognise=_recognise,
                   build=_build, check=_check, restore=FusedResidualOutput._tempo_restore)]


__all__ = ["FusedResidualOutput", "RESIDUAL_BLOCKS", "bert_family_recipes"]
