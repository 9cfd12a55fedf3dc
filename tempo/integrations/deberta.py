"""DeBERTa-v2/v3's attention core through Tempo's Combined softmax -> dropout -> matmul.

transformers' ``DisentangledSelfAttention`` (``deberta_v2``) computes its attention itself, not
through ``AttentionInterface``: content scores q·kᵀ/√(d·f) plus the disentangled relative-position
bias (c2p, p2c), ``masked_fill`` with the dtype's min where the mask is 0, softmax, ``nn.Dropout``,
bmm with v. Eager autograd keeps, per score, the softmax output, the dropout mask (1 byte) and
the dropout output (the bmm's input); under bf16 autocast the softmax output is fp32 and the bmm
gets a bf16 copy of the dropped probabilities: 4 + 1 + 2 bytes per score.
``DebertaCombinedAttention`` computes the same scores with the module's own projections and its
own ``disentangled_attention_bias`` (the relative-position bias is untouched), then runs
softmax -> dropout -> bmm as ``combined_softmax_dropout_matmul``: it keeps the softmax output in
the scores' dtype (2 bytes under bf16 autocast) and an 8-byte seed; the mask is regenerated and
the dropout output recomputed in backward (exactness: tempo/ops/combined.py's docstring).

The replacement holds the original's submodules (the same objects, in the same order: same
state_dict keys, same Parameters, hooks and tying) and its configuration attributes, and calls
the original class's ``transpose_for_scores`` and ``disentangled_attention_bias`` on itself, so a
submodule swapped later (an adapter on ``query_proj``) is the one used. A call that asks for
the attention probabilities (``output_attentions=True``) runs the original class's forward on
the same modules for that call (logged once): Combined keeps no probabilities to return.
``apply_tempo`` checks the replacement against the original numerically (eval mode) before it
swaps it in, so a transformers version whose forward computes something else is left alone.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

import torch
from torch import nn

from tempo.ops.combined import combined_softmax_dropout_matmul

logger = logging.getLogger("tempo.integrations.deberta")

_CLASS = "DisentangledSelfAttention"
_MODULE = "transformers.models.deberta_v2."
_PROJECTIONS = ("query_proj", "key_proj", "value_proj")
_logged_weights = False


def is_deberta_v2_attention(module: nn.Module) -> bool:
    """True for transformers' DeBERTa-v2/v3 ``DisentangledSelfAttention`` with the parts the
    replacement uses (DeBERTa v1's class of the same name has a fused ``in_proj`` instead)."""
    cls = type(module)
    if cls.__name__ != _CLASS or not cls.__module__.startswith(_MODULE):
        return False
    if not all(isinstance(getattr(module, name, None), nn.Linear) for name in _PROJECTIONS):
        return False
    return type(getattr(module, "dropout", None)) is nn.Dropout and all(
        callable(getattr(cls, name, None)) for name in ("transpose_for_scores", "disentangled_attention_bias"))


def _score_scale_factor(pos_att_type: Any) -> int:
    """DeBERTa scales the content and each relative term by √(d·f), f = 1 + one per term used."""
    return 1 + sum(term in pos_att_type for term in ("c2p", "p2c"))


class DebertaCombinedAttention(nn.Module):
    """``DisentangledSelfAttention`` whose softmax -> dropout -> bmm keeps only the probabilities."""

    def __init__(self, original: nn.Module):
        super().__init__()
        if not is_deberta_v2_attention(original):
            raise TypeError(f"DebertaCombinedAttention: expected transformers' deberta_v2 {_CLASS}, "
                            f"got {type(original).__module__}.{type(original).__name__}")
        # Configuration (head counts, position buckets, pos_att_type, ...), then the same submodules.
        for key, value in vars(original).items():
            if not key.startswith("_") and key != "training":
                setattr(self, key, value)
        for name, child in original._modules.items():
            self._modules[name] = child
        self._original_class = type(original)

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor, output_attentions: bool = False,
                query_states: Optional[torch.Tensor] = None, relative_pos: Optional[torch.Tensor] = None,
                rel_embeddings: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        cls = self._original_class
        if output_attentions:
            global _logged_weights
            if not _logged_weights:
                _logged_weights = True
                logger.info("DeBERTa attention: a call asking for the attention probabilities runs the model's own "
                            "attention (Combined keeps none to return)")
            return cls.forward(self, hidden_states, attention_mask, output_attentions, query_states, relative_pos,
                               rel_embeddings)
        heads = self.num_attention_heads
        q_in = hidden_states if query_states is None else query_states
        q = self.transpose_for_scores(self.query_proj(q_in), heads)  # [b·heads, s, d]
        k = self.transpose_for_scores(self.key_proj(hidden_states), heads)
        v = self.transpose_for_scores(self.value_proj(hidden_states), heads)

        factor = _score_scale_factor(self.pos_att_type)
        scale = torch.sqrt(torch.tensor(q.size(-1), dtype=torch.float) * factor)
        # The key is divided before the product, as the original does (same rounding).
        scores = torch.bmm(q, k.transpose(-1, -2) / scale.to(dtype=q.dtype))
        if self.relative_attention:
            rel = self.disentangled_attention_bias(q, k, relative_pos, self.pos_dropout(rel_embeddings),
                                                  factor)
            scores = scores + rel
        scores = scores.view(-1, heads, scores.size(-2), scores.size(-1))
        scores = scores.masked_fill(~attention_mask.bool(), torch.finfo(q.dtype).min)

        context = combined_softmax_dropout_matmul(scores.view(-1, scores.size(-2), scores.size(-1)), v,
                                                  p=self.dropout.p, training=self.training)
        context = context.view(-1, heads, context.size(-2), context.size(-1)).permute(0, 2, 1, 3).contiguous()
        return context.view(context.size()[:-2] + (-1,)), None

    # The original class's helpers, run on this module (they call each other through self).
    def transpose_for_scores(self, x: torch.Tensor, attention_heads: int) -> torch.Tensor:
        return self._original_class.transpose_for_scores(self, x, attention_heads)

    def disentangled_attention_bias(self, *args: Any) -> torch.Tensor:
        return self._original_class.disentangled_attention_bias(self, *args)

    def _tempo_restore(self, original: nn.Module) -> None:
        """revert_tempo: the original gets this module's current submodules back."""
        for name, child in self._modules.items():
            original._modules[name] = child

    def extra_repr(self) -> str:
        return f"heads={self.num_attention_heads}, p={self.dropout.p}, pos_att_type={list(self.pos_att_type)}"


def matches_original(new: DebertaCombinedAttention, original: nn.Module) -> bool:
    """The replacement computes what the original does (eval mode, dropout off, a padded row)."""
    weight = original.query_proj.weight
    if weight.is_meta:
        return True  # nothing to compute with yet; the structure was checked
    hidden = original.query_proj.in_features
    g = torch.Generator(device="cpu").manual_seed(0)
    with torch.no_grad():
        h = torch.randn(2, 5, hidden, generator=g).to(device=weight.device, dtype=weight.dtype)
        mask = torch.ones(2, 1, 5, 5, dtype=torch.int64, device=weight.device)
        mask[1, :, :, 3:] = 0
        mask[1, :, 3:, :] = 0
        rel = None
        if getattr(original, "relative_attention", False):
            rel = torch.randn(2 * original.pos_ebd_size, hidden, generator=g).to(device=weight.device,
                                                                                 dtype=weight.dtype)
        was_training = original.training
        original.eval()
        new.eval()
        try:
            want = original(h, mask, False, None, None, rel)[0]
            got = new(h, mask, False, None, None, rel)[0]
        except Exception:  # noqa: BLE001 - a forward we cannot run is one we do not replace
            logger.debug("DeBERTa attention check failed", exc_info=True)
            return False
        finally:
            original.train(was_training)
            new.train(was_training)
    return got.shape == want.shape and torch.allclose(got, want, atol=1e-5, rtol=1e-5)


__all__ = ["DebertaCombinedAttention", "is_deberta_v2_attention", "matches_original"]
