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
import math
import threading
from typing import Any, Optional

import torch
from torch import nn

from tempo.integrations.recipe import Options, Recipe, has_meta_weights, same_output, sample
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


class _DebertaAttentionCore(nn.Module):
    """What both replacements share: the original's configuration attributes and submodules (the
    same objects, in its order), its helpers, and the original forward for calls asking for the
    attention probabilities (Tempo keeps none to return; logged once)."""

    def __init__(self, original: nn.Module):
        super().__init__()
        if not is_deberta_v2_attention(original):
            raise TypeError(f"{type(self).__name__}: expected transformers' deberta_v2 {_CLASS}, "
                            f"got {type(original).__module__}.{type(original).__name__}")
        # Configuration (head counts, position buckets, pos_att_type, ...), then the same submodules.
        for key, value in vars(original).items():
            # Not its methods (an instance-level forward override is the original's, not ours).
            if not key.startswith("_") and key != "training" and not callable(value):
                setattr(self, key, value)
        for name, child in original._modules.items():
            self._modules[name] = child
        self._original_class = type(original)

    def _original_forward(self, *args: Any, why: str) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        global _logged_weights
        if not _logged_weights:
            _logged_weights = True
            logger.info("DeBERTa attention: %s runs the model's own attention (it keeps the s x s probabilities "
                        "for backward; logged once)", why)
        return self._original_class.forward(self, *args)

    # The original class's helpers, run on this module (they call each other through self).
    def transpose_for_scores(self, x: torch.Tensor, attention_heads: int) -> torch.Tensor:
        return self._original_class.transpose_for_scores(self, x, attention_heads)

    def disentangled_attention_bias(self, *args: Any) -> torch.Tensor:
        return self._original_class.disentangled_attention_bias(self, *args)

    def extra_repr(self) -> str:
        return f"heads={self.num_attention_heads}, p={self.dropout.p}, pos_att_type={list(self.pos_att_type)}"


class DebertaCombinedAttention(_DebertaAttentionCore):
    """``DisentangledSelfAttention`` whose softmax -> dropout -> bmm keeps only the probabilities."""

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor, output_attentions: bool = False,
                query_states: Optional[torch.Tensor] = None, relative_pos: Optional[torch.Tensor] = None,
                rel_embeddings: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        if output_attentions:
            return self._original_forward(hidden_states, attention_mask, output_attentions, query_states,
                                          relative_pos, rel_embeddings, why="a call asking for the probabilities")
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

        # The held nn.Dropout's rate and flag, read now: TRL's disable_dropout_in_model (m.p = 0) works.
        context = combined_softmax_dropout_matmul(scores.view(-1, scores.size(-2), scores.size(-1)), v,
                                                  p=self.dropout.p, training=self.dropout.training)
        context = context.view(-1, heads, context.size(-2), context.size(-1)).permute(0, 2, 1, 3).contiguous()
        return context.view(context.size()[:-2] + (-1,)), None


class DebertaEfficientAttention(_DebertaAttentionCore):
    """``DisentangledSelfAttention`` as one O(s) op (``tempo.ops.disentangled_attention``): keeps q,
    k, v, the layer's position projections (batch-independent), the output, two numbers per row and
    a seed; never an s x s or s x 2·span tensor. Dropout from the held ``nn.Dropout`` (rate and flag
    read at every forward), regenerated from the seed in backward; the relative embeddings go
    through the module's own ``pos_dropout`` as in the original.

    Inputs it takes as the original does: the encoder's [B, 1, S, S] mask of pairs m_i·m_j (from a
    [B, S] mask; read back as its diagonal, checked once per mask tensor), relative positions as
    the encoder builds them (checked once per tensor against the op's table). A call it cannot run
    exactly — attention probabilities asked for, a 3-D pair mask that is not m_i·m_j, other
    relative positions, query states of another length — runs the original forward (logged once).
    Padding-free batches (``DataCollatorWithFlattening``: position_ids restarting, or
    ``cu_seq_lens_q``) attend within each sequence through the op's variable-length form: the
    model-level hook ``install_packing_hooks`` hands the packing to every layer.
    """

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor, output_attentions: bool = False,
                query_states: Optional[torch.Tensor] = None, relative_pos: Optional[torch.Tensor] = None,
                rel_embeddings: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        args = (hidden_states, attention_mask, output_attentions, query_states, relative_pos, rel_embeddings)
        if output_attentions:
            return self._original_forward(*args, why="a call asking for the attention probabilities")
        b, s, _ = hidden_states.shape
        q_in = hidden_states if query_states is None else query_states
        if q_in.shape[:2] != (b, s):
            return self._original_forward(*args, why="query states of another length")
        padding = _padding_of(attention_mask, b, s)
        if padding is False:
            return self._original_forward(*args, why="an attention mask that is not a [B, S] padding mask")
        if self.relative_attention and relative_pos is not None and not _standard_positions(self, relative_pos, s):
            return self._original_forward(*args, why="relative positions other than the encoder's")
        packing = current_packing()
        if packing is not None and padding is not None:
            raise ValueError("DeBERTa (Tempo): a padding-free batch (packed sequences) with padding in its "
                             "attention_mask; pass one or the other")

        heads = self.num_attention_heads
        q = self.query_proj(q_in).view(b, s, heads, -1)
        k = self.key_proj(hidden_states).view(b, s, heads, -1)
        v = self.value_proj(hidden_states).view(b, s, heads, -1)
        scale = 1.0 / math.sqrt(q.shape[-1] * _score_scale_factor(self.pos_att_type))
        pos_key = pos_query = None
        positions = dict(span=1, position_buckets=-1, max_relative_positions=1)  # content only: unused
        if self.relative_attention:
            span = self.pos_ebd_size
            rel = self.pos_dropout(rel_embeddings)[: 2 * span]
            key_proj = self.key_proj if self.share_att_key else getattr(self, "pos_key_proj", None)
            query_proj = self.query_proj if self.share_att_key else getattr(self, "pos_query_proj", None)
            if "c2p" in self.pos_att_type:
                pos_key = key_proj(rel).view(2 * span, heads, -1)
            if "p2c" in self.pos_att_type:
                pos_query = query_proj(rel).view(2 * span, heads, -1)
            positions = dict(span=span, position_buckets=self.position_buckets,
                             max_relative_positions=self.max_relative_positions)
        p, training = float(self.dropout.p), self.dropout.training
        if packing is not None:
            from tempo.ops.disentangled_attention import disentangled_attention_varlen

            cu_seqlens, max_seqlen = packing
            t = b * s
            out = disentangled_attention_varlen(q.reshape(t, heads, -1), k.reshape(t, heads, -1),
                                                v.reshape(t, heads, -1), cu_seqlens, max_seqlen, pos_key, pos_query,
                                                scale=scale, dropout_p=p, training=training, **positions)
            return out.view(b, s, -1), None
        from tempo.ops.disentangled_attention import disentangled_attention

        out = disentangled_attention(q, k, v, pos_key, pos_query, scale=scale, padding_mask=padding, dropout_p=p,
                                     training=training, **positions)
        return out.view(b, s, -1), None


# -- what the op needs from the encoder's inputs, checked once per tensor (every layer gets the same one)
_FACTS: dict[int, tuple[Any, int, Any]] = {}  # id(tensor) -> (weakref, version, answer); the batch being run


def _cached(tensor: torch.Tensor, key: str, compute: Any) -> Any:
    import weakref

    entry = _FACTS.get(id(tensor))
    if entry is not None and entry[0]() is tensor and entry[1] == (key, tensor._version):
        return entry[2]
    answer = compute()
    if len(_FACTS) > 8:
        _FACTS.clear()
    _FACTS[id(tensor)] = (weakref.ref(tensor), (key, tensor._version), answer)
    return answer


def _is_fake(t: torch.Tensor) -> bool:
    """A fake tensor (tempo.movement's traces): no values to read, the encoder's own structure is assumed."""
    from torch._subclasses.fake_tensor import is_fake

    return is_fake(t)


def _padding_of(mask: torch.Tensor, b: int, s: int) -> Any:
    """The [B, S] padding mask behind the encoder's pair mask, None when nothing is padded, False
    when the pair mask is not m_i·m_j of one (one host read per mask tensor)."""
    def compute() -> Any:
        pairs = mask.reshape(b, s, s) if mask.dim() == 4 and mask.shape[1] == 1 else mask
        if pairs.shape != (b, s, s):
            return False
        real = pairs.diagonal(dim1=-2, dim2=-1).bool()
        if _is_fake(pairs):
            return real.contiguous()
        outer = real[:, :, None] & real[:, None, :]
        is_outer, all_real = torch.stack([(pairs.bool() == outer).all(), real.all()]).tolist()
        if not is_outer:
            return False
        return None if all_real else real.contiguous()
    if mask is None:
        return None
    return _cached(mask, f"padding:{b}x{s}", compute)


def _standard_positions(module: nn.Module, relative_pos: torch.Tensor, s: int) -> bool:
    """relative_pos is what the encoder builds (transformers' build_relative_position) for length s."""
    def compute() -> bool:
        from tempo.ops.disentangled_attention import relative_position_index

        if _is_fake(relative_pos):
            return relative_pos.numel() == s * s

        span = module.pos_ebd_size
        index = relative_position_index(s, span, module.position_buckets, module.max_relative_positions,
                                        relative_pos.device)
        offsets = torch.arange(s, device=relative_pos.device)
        expected = index[(offsets[:, None] - offsets[None, :]) + s - 1].long() - span
        got = relative_pos.reshape(-1, s, s)
        # Positions beyond the span are clamped by the op exactly as transformers clamps them.
        got = (got + span).clamp(0, 2 * span - 1) - span
        return bool((got == expected).all())
    return _cached(relative_pos, f"positions:{s}:{module.pos_ebd_size}", compute)


# -- padding-free batches: the packing reaches every layer through a model-level hook -------------
_packing = threading.local()


def current_packing() -> Optional[tuple[torch.Tensor, int]]:
    """(cu_seqlens int32, max length) of the padding-free batch being run, or None."""
    return getattr(_packing, "value", None)


def _packing_from_call(args: tuple, kwargs: dict) -> Optional[tuple[torch.Tensor, int]]:
    """The packing a padding-free batch's call carries (cu_seq_lens_q, or position_ids restarting),
    read as the registered Tempo attention reads it (hf_attention.packing_of_call); None otherwise."""
    from tempo.integrations.hf_attention import packing_of_call

    ids = kwargs.get("input_ids", args[0] if args else None)
    if ids is None:
        ids = kwargs.get("inputs_embeds")
    if not isinstance(ids, torch.Tensor) or ids.dim() < 2:
        return None
    position_ids = kwargs.get("position_ids")
    if position_ids is None and len(args) > 3:
        position_ids = args[3]  # (input_ids, attention_mask, token_type_ids, position_ids, ...)
    return packing_of_call(ids.shape[0], ids.shape[1], kwargs, position_ids, ids.device)


def install_packing_hooks(model: nn.Module) -> Any:
    """Hooks on every DeBERTa-v2 model of the tree (head and base) reading a padding-free batch's
    packing from the outermost call; returns the undo. A model with the convolution layer (some
    DeBERTa-v2 configs) is refused for packed batches: it mixes neighbouring tokens across sequences."""
    handles = []

    def pre(module: nn.Module, args: tuple, kwargs: dict) -> None:
        depth = getattr(_packing, "depth", 0)
        _packing.depth = depth + 1
        if depth:
            return  # an inner model of the same call: the outermost call's packing holds
        packing = _packing_from_call(args, kwargs)
        if packing is not None and any(getattr(m, "conv", None) is not None for m in module.modules()
                                       if type(m).__name__ == "DebertaV2Encoder"):
            _packing.depth = 0
            raise ValueError(f"{type(module).__name__}: padding-free batches (packed sequences) cannot run through "
                             f"DeBERTa-v2's convolution layer (conv_kernel_size > 0 mixes neighbouring tokens "
                             f"across sequences); pad the batch instead")
        _packing.value = packing

    def post(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        _packing.depth = getattr(_packing, "depth", 1) - 1
        if _packing.depth <= 0:
            _packing.depth = 0
            _packing.value = None

    for module in model.modules():
        if (isinstance(module, _pretrained_model_class()) and type(module).__name__.startswith("DebertaV2")
                and _HOOKED not in module.__dict__):
            module.__dict__[_HOOKED] = True
            handles.append((module, module.register_forward_pre_hook(pre, with_kwargs=True)))
            handles.append((module, module.register_forward_hook(post, with_kwargs=True, always_call=True)))

    def undo() -> None:
        for module, handle in handles:
            handle.remove()
            module.__dict__.pop(_HOOKED, None)
    return undo


_HOOKED = "_tempo_packing_hooks"


def _pretrained_model_class() -> type:
    from transformers import PreTrainedModel

    return PreTrainedModel


def check_inputs(original: nn.Module, seq_len: int = 5) -> tuple:
    """The positional inputs the numerical check feeds: hidden states, a padded [B, 1, S, S] mask
    (the second row has 3 real tokens, as DeBERTa's encoder builds it), no query states, no
    relative positions (the module builds them), random relative embeddings."""
    weight = original.query_proj.weight
    hidden = original.query_proj.in_features
    h = sample((2, seq_len, hidden), weight, seed=0)
    real = torch.ones(2, seq_len, dtype=torch.int64, device=weight.device)
    real[1, 3:] = 0
    mask = (real[:, None, :, None] * real[:, None, None, :])
    rel = None
    if getattr(original, "relative_attention", False):
        rel = sample((2 * original.pos_ebd_size, hidden), weight, seed=1)
    return h, mask, False, None, None, rel


def matches_original(new: nn.Module, original: nn.Module) -> bool:
    """The replacement computes what the original does (eval mode, dropout off, a padded row)."""
    if has_meta_weights(original):
        return True  # nothing to compute with yet; the structure was checked
    return same_output(original, new, *check_inputs(original))


def _build_combined(old: nn.Module, options: Options) -> nn.Module:
    return DebertaCombinedAttention(old)


def _restore(new: nn.Module, original: nn.Module) -> None:
    for name, child in new._modules.items():
        original._modules[name] = child


def _build_efficient(old: nn.Module, options: Options) -> nn.Module:
    return DebertaEfficientAttention(old)


def deberta_recipes() -> list[Recipe]:
    """The attention core: the O(s) disentangled attention for attention="efficient" (and the
    default), Combined for attention="tempo" (the paper's: keeps the probabilities)."""
    common = dict(option="attention", recognise=is_deberta_v2_attention, check=matches_original, restore=_restore)
    return [
        Recipe(kind="DeBERTa attention", becomes="DebertaEfficientAttention (disentangled attention in O(s): "
                                                 "tempo.ops.disentangled_attention)",
               replacement=DebertaEfficientAttention, build=_build_efficient, model_hook=install_packing_hooks,
               enabled=lambda options: options.attention == "efficient", **common),
        Recipe(kind="DeBERTa attention core",
               becomes="DebertaCombinedAttention (softmax -> dropout -> bmm as Combined; relative-position "
                       "bias as it was)",
               replacement=DebertaCombinedAttention, build=_build_combined,
               enabled=lambda options: options.attention == "tempo", **common),
    ]


__all__ = ["DebertaCombinedAttention", "DebertaEfficientAttention", "check_inputs", "current_packing",
           "deberta_recipes", "install_packing_hooks", "is_deberta_v2_attention", "matches_original"]
