"""The projections that read a Tempo RMSNorm's output keep that output, not their own 16-bit copy.

In a pre-norm block (Llama, Qwen3, EuroBERT, Gemma3, T5, ...) under bf16 autocast with fp32 weights,
the norm returns fp32 (its stock dtype, tempo.ops.rmsnorm) and keeps that output for its backward;
q, k and v, then gate and up, each cast it to bf16 and keep their cast: 2 bytes per element each,
10 in all, beside the norm's 4. ``InputKeepingLinear`` (tempo.ops.linear) keeps the input as given,
the norm's tensor, and casts it again in backward: the same numbers bit for bit, none of the copies.

Which projections, by structure: in every module that holds an ``InplaceRMSNorm`` child (the
block), the plain ``nn.Linear`` children of its attention modules (a class name holding
"Attention": q, k, v, and the output projection, whose 16-bit input makes the switch a no-op) and
the input projections of its ``GatedMLP`` (gate and up, or the fused one; the down projection is
fused by reading its weight and stays a plain ``nn.Linear``). Only ``type(m) is nn.Linear``: a LoRA
layer or a quantized Linear is left as it is. A block whose attention reads something else than the
norm's output would pay 2 bytes per element more per projection for nothing kept elsewhere (4
instead of 2); it stays exact either way.

The switch is a class change (``recipe.switch_class``), no new state: Parameters, state_dict keys,
``isinstance(m, nn.Linear)`` (PEFT's target checks, ``_init_weights``) and hooks are the module's
own. apply_tempo records the switched modules in the model's patch state; ``revert_tempo`` gives
them back their class.
"""

from __future__ import annotations

from torch import nn

from tempo.integrations.recipe import Switched, switch_class
from tempo.ops.gated_mlp import GatedMLP
from tempo.ops.linear import InputKeepingLinear
from tempo.ops.rmsnorm import InplaceRMSNorm


def _input_projections(module: nn.Module) -> list[nn.Module]:
    if isinstance(module, GatedMLP):
        layout = module.layout
        names = [layout.fused] if layout.fused is not None else [layout.gate, layout.up]
        return [module._modules[n] for n in names if n is not None]
    if "Attention" in type(module).__name__:
        return [c for c in module._modules.values() if c is not None]
    return []


def keep_norm_outputs(model: nn.Module) -> list[Switched]:
    """Switch the projections beside each ``InplaceRMSNorm`` (module docstring) to
    ``InputKeepingLinear``; returns what ``recipe.restore_classes`` switches back."""
    switched = []
    for block in model.modules():
        children = [c for c in block._modules.values() if c is not None]
        if not any(isinstance(c, InplaceRMSNorm) for c in children):
            continue
        for reader in children:
            for projection in _input_projections(reader):
                if type(projection) is nn.Linear:
                    switched.append(switch_class(projection, InputKeepingLinear))
    return switched


__all__ = ["keep_norm_outputs"]
