"""Every plain ``nn.Dropout`` keeps a seed instead of its mask (tempo.ops.dropout).

The dropouts Tempo fuses (the BERT family's residual blocks, attention probabilities, the gated
MLP's) already keep a seed. The ones a family writes inline stay ``nn.Dropout`` modules: MPNet's
``LayerNorm(self.dropout(attn) + hidden)``, GTE's and Jina-v3's ``residual + self.post_*_dropout(x)``,
embedding and classifier dropouts, and the attention-probability dropout of an attention Tempo leaves
as it is. Each keeps its mask for backward, 1 byte per element on CUDA and 2 (bf16) or 4 on the CPU.
apply_tempo's ``dropout_add_layernorm`` option (Tempo's dropout keeps seeds) switches them to
``SeededDropout``, which keeps 8 bytes per call and draws the same mask again in backward.

The switch is a class change (``recipe.switch_class``), no new state and no new object: ``p``,
``training``, hooks, ``isinstance(m, nn.Dropout)`` (TRL's ``disable_dropout_in_model``, PEFT) and
every reference held to the module stay the module's own. Only ``type(m) is nn.Dropout`` with
``inplace=False`` (an in-place dropout overwrites its input, which its caller may read afterwards),
and only outside the replacements apply_tempo swapped in: their subtrees are Tempo's own (the fused
ops read the rates of the dropouts they hold). apply_tempo records the switched modules in the
model's patch state; ``revert_tempo`` gives them back their class.
"""

from __future__ import annotations

from torch import nn

from tempo.integrations.recipe import Switched, is_replacement, switch_class
from tempo.ops.dropout import SeededDropout


def seed_dropouts(model: nn.Module) -> list[Switched]:
    """Switch the model's plain, not in-place ``nn.Dropout`` modules outside Tempo's replacements to
    ``SeededDropout``; returns what ``recipe.restore_classes`` switches back."""
    switched, seen = [], set()

    def visit(module: nn.Module) -> None:
        if id(module) in seen or is_replacement(module):  # a replacement's subtree is Tempo's own
            return
        seen.add(id(module))
        if type(module) is nn.Dropout and not module.inplace:
            switched.append(switch_class(module, SeededDropout))
        for child in module.children():
            visit(child)

    visit(model)
    return switched


__all__ = ["seed_dropouts"]
