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
from typing import Any, Optional

import torch
from torch import nn

from tempo.integrations import model_calls
from tempo.integrations.recipe import Built, Options, Recipe, Skip, output_check, restore_children, sample
from tempo.ops.combined import combined_softmax_dropout_matmul
from tempo.ops.disentangled_attention import (disentangled_attention, disentangled_attention_varlen,
                                              relative_position_index)

logger = logging.getLogger("tempo.integrations.deberta")

_CLASS = "DisentangledSelfAttention"
_MODULE = "transformers.models.deberta_v2."
_PROJECTIONS = ("query_proj", "key_proj", "value_proj")
_logged_reasons: set[str] = set()  # why a call ran the original forward: each logged once


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
        if why not in _logged_reasons:
            _logged_reasons.add(why)
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
    [B, S] mask; read back as its diagonal) and relative positions as the encoder builds them.
    Eager: both are checked (one host read each per tensor and model call, shared by the layers
    through the call's memo; a layer called on its own checks at every call). Under torch.compile
    nothing can be read on the host inside the graph, so the layer trusts what the model-level hook
    saw at the call (``install_call_hooks``): a call of a DeBERTa model with a [B, S] mask (or none)
    runs transformers' encoder, which builds exactly these (``DebertaV2Encoder.get_attention_mask``
    and ``get_rel_pos``); any other call runs the original forward there.
    A call it cannot run exactly — attention probabilities asked for, a 3-D pair mask that is not
    m_i·m_j, other relative positions, query states of another length, a sequence longer than a
    degenerate log-bucket table covers (``_positions``) — runs the original forward (logged once per
    reason). Padding-free batches (``DataCollatorWithFlattening``: position_ids restarting, or
    ``cu_seq_lens_q``) attend within each sequence through the op's variable-length form: the
    model-level hook hands the packing to every layer.
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
        call = current_call()
        packing = call.packing if call is not None else None
        positions = _positions(self, s if packing is None else packing[1].shape[0])  # a packed row: per sequence
        if positions is None:
            why = (f"a sequence longer than position_buckets // 2 + 1 = {self.position_buckets // 2 + 1} tokens in a "
                   f"config whose log buckets degenerate (max_relative_positions - 1 = "
                   f"{self.max_relative_positions - 1} <= position_buckets // 2: transformers' "
                   f"make_log_bucket_position takes the log of a ratio <= 1 there)")
            if packing is not None:  # the original forward would attend across the packed sequences
                raise ValueError(f"DeBERTa (Tempo): a padding-free batch with {why}; pad the batch instead")
            return self._original_forward(*args, why=why)
        if torch.compiler.is_compiling():
            if call is None or not call.encoder_inputs or not _encoder_shapes(attention_mask, relative_pos, b, s):
                return self._original_forward(*args, why=(
                    "under torch.compile, a call whose mask and relative positions are not known to be the "
                    "encoder's (the layer called outside a DeBERTa model's forward with a [B, S] mask; no host "
                    "read can check them inside the graph)"))
            # The encoder built the pair mask as m_i·m_j: its diagonal is the padding (always passed: no host
            # read decides whether anything is padded). A packed call's mask is all ones (its hook checked).
            padding = None if packing is not None else _diagonal(attention_mask, b, s)
        else:
            memo = call.memo if call is not None else None
            padding = None if packing is not None else _padding_of(attention_mask, b, s, memo)
            if padding is False:
                return self._original_forward(*args, why="an attention mask that is not a [B, S] padding mask")
            # (A packed row's positions are the op's own, per sequence: the row-wide ones are not used.)
            if (self.relative_attention and relative_pos is not None and packing is None
                    and not _standard_positions(relative_pos, s, positions, memo)):
                return self._original_forward(*args, why="relative positions other than the encoder's")

        heads = self.num_attention_heads
        q = self.query_proj(q_in).view(b, s, heads, -1)
        k = self.key_proj(hidden_states).view(b, s, heads, -1)
        v = self.value_proj(hidden_states).view(b, s, heads, -1)
        scale = 1.0 / math.sqrt(q.shape[-1] * _score_scale_factor(self.pos_att_type))
        pos_key = pos_query = None
        if self.relative_attention:
            span = self.pos_ebd_size
            rel = self.pos_dropout(rel_embeddings)[: 2 * span]
            key_proj = self.key_proj if self.share_att_key else getattr(self, "pos_key_proj", None)
            query_proj = self.query_proj if self.share_att_key else getattr(self, "pos_query_proj", None)
            if "c2p" in self.pos_att_type:
                pos_key = key_proj(rel).view(2 * span, heads, -1)
            if "p2c" in self.pos_att_type:
                pos_query = query_proj(rel).view(2 * span, heads, -1)
        # The held nn.Dropout's rate and flag, read now: TRL's disable_dropout_in_model (m.p = 0) works.
        p, training = float(self.dropout.p), self.dropout.training
        if packing is not None:
            cu_seqlens, carrier = packing
            max_seqlen, t = carrier.shape[0], b * s
            out = disentangled_attention_varlen(q.reshape(t, heads, -1), k.reshape(t, heads, -1),
                                                v.reshape(t, heads, -1), cu_seqlens, max_seqlen, pos_key, pos_query,
                                                scale=scale, dropout_p=p, training=training, **positions)
            return out.view(b, s, -1), None
        out = disentangled_attention(q, k, v, pos_key, pos_query, scale=scale, padding_mask=padding, dropout_p=p,
                                     training=training, **positions)
        return out.view(b, s, -1), None


def _positions(module: nn.Module, s: int) -> Optional[dict]:
    """The op's position arguments for a sequence of ``s`` tokens, or None when the op cannot
    compute what transformers does for it.

    A config whose log buckets degenerate — ``max_relative_positions - 1 <= position_buckets // 2``
    (small DeBERTa-v3 configs: ``max_position_embeddings`` <= 129 with 256 buckets) — makes
    transformers' make_log_bucket_position take the log of a ratio <= 1 (negative buckets folding
    back, or inf cast to an integer) beyond distance ``position_buckets // 2``; at and below that
    distance it returns the distance itself. So sequences of up to ``position_buckets // 2 + 1``
    tokens run with identity buckets over the same table (exact), longer ones the original
    forward. (position_buckets = 1 never gets here: ``_one_bucket``.)"""
    if not module.relative_attention:
        return dict(span=1, position_buckets=-1, max_relative_positions=1)  # content only: unused
    span, buckets, furthest = module.pos_ebd_size, module.position_buckets, module.max_relative_positions
    mid = buckets // 2
    if buckets > 0 and furthest > 0 and furthest - 1 <= mid:
        if s - 1 > mid:
            return None
        return dict(span=span, position_buckets=-1, max_relative_positions=span)
    return dict(span=span, position_buckets=buckets, max_relative_positions=furthest)


def _one_bucket(module: nn.Module) -> bool:
    """position_buckets = 1 with log buckets: transformers' make_log_bucket_position divides by
    position_buckets // 2 = 0. In transformers 5.2x that raises ZeroDivisionError (the model does not
    run, with or without Tempo); in 5.17, whose position functions are TorchScript, it makes inf buckets
    cast to integers: the model runs on positions Tempo's op does not reproduce. Tempo leaves it alone."""
    return bool(module.relative_attention and module.position_buckets == 1 and module.max_relative_positions > 0)


# -- what the op needs from the encoder's inputs, checked in eager mode ---------------------------
def _remembered(memo: Optional[dict], tensor: torch.Tensor, what: tuple, compute: Any) -> Any:
    """``compute()``, remembered for this model call (every layer gets the same mask and position
    tensors). The key is every field that can change what the tensor holds while the object stays
    the same: an in-place write (version), ``.data`` swapped for other memory (data pointer), the
    same memory read as another dtype, or another view geometry (shape, strides)."""
    if memo is None or _is_fake(tensor):
        return compute()
    key = (what, id(tensor), tensor._version, tensor.data_ptr(), tensor.dtype, tuple(tensor.shape), tensor.stride())
    hit = memo.get(key)
    if hit is not None and hit[0] is tensor:
        return hit[1]
    answer = compute()
    memo[key] = (tensor, answer)  # a strong reference: no other tensor takes its id during the call
    return answer


def _is_fake(t: torch.Tensor) -> bool:
    """A fake tensor (tempo.movement's traces): no values to read, the encoder's own structure is assumed."""
    from torch._subclasses.fake_tensor import is_fake

    return is_fake(t)


def _diagonal(mask: torch.Tensor, b: int, s: int) -> torch.Tensor:
    """m of the encoder's pair mask m_i·m_j, as a contiguous bool [B, S] (1 = real)."""
    return mask.reshape(b, s, s).diagonal(dim1=-2, dim2=-1).bool().contiguous()


def _encoder_shapes(mask: Optional[torch.Tensor], relative_pos: Optional[torch.Tensor], b: int, s: int) -> bool:
    """The shapes the encoder gives its layers for a [B, S] batch: a [B, 1, S, S] mask, [1, S, S] positions."""
    return (mask is not None and tuple(mask.shape) == (b, 1, s, s)
            and (relative_pos is None or tuple(relative_pos.shape[-2:]) == (s, s)))


def _padding_of(mask: Optional[torch.Tensor], b: int, s: int, memo: Optional[dict]) -> Any:
    """The [B, S] padding mask behind the encoder's pair mask, None when nothing is padded, False
    when the pair mask is not m_i·m_j of one (one host read per mask tensor and call)."""
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
    return _remembered(memo, mask, ("padding", b, s), compute)


def _standard_positions(relative_pos: torch.Tensor, s: int, positions: dict, memo: Optional[dict]) -> bool:
    """relative_pos is what the encoder builds (transformers' build_relative_position) for length
    s, as far as the op's table sees it (``positions``: its arguments)."""
    def compute() -> bool:
        if _is_fake(relative_pos):
            return relative_pos.numel() == s * s
        span = positions["span"]
        index = relative_position_index(s, span, positions["position_buckets"], positions["max_relative_positions"],
                                        relative_pos.device)
        offsets = torch.arange(s, device=relative_pos.device)
        expected = index[(offsets[:, None] - offsets[None, :]) + s - 1].long() - span
        if relative_pos.numel() != s * s:
            return False
        # transformers reads the positions as integers, and clamps those beyond the span, as the op does.
        got = relative_pos.reshape(s, s).to(torch.long)
        got = (got + span).clamp(0, 2 * span - 1) - span
        return bool((got == expected).all())
    return _remembered(memo, relative_pos, ("positions", s, *sorted(positions.items())), compute)


# -- what one call of a DeBERTa model tells its layers: model-level hooks ----------------------------
# The hooks are these module-level functions (pickled by reference, shared by deep copies); revert
# finds them again by identity on each module of the tree it is given: no handle, no closure, nothing
# that refers to one model instance is kept anywhere.
class _Call:
    """One call of a DeBERTa-v2 model (head or base) running in this thread."""

    def __init__(self, owner: nn.Module, packing: Optional[tuple[torch.Tensor, torch.Tensor]], encoder_inputs: bool):
        self.owner = owner
        self.packing = packing  # the outermost call's (cu_seqlens, _length_carrier(max length)), or None
        self.encoder_inputs = encoder_inputs  # its mask is [B, S] or absent: the encoder builds the layers' inputs
        self.memo: dict = {}  # eager checks of the mask and positions, shared by the layers of this call


_CALLS = model_calls.CallStack()
_POSITIONS = {"input_ids": 0, "attention_mask": 1, "inputs_embeds": 4}  # DebertaV2Model.forward's


def current_call() -> Optional[_Call]:
    """The innermost DeBERTa model call running in this thread, or None."""
    return _CALLS.current()


def current_packing() -> Optional[tuple[torch.Tensor, int]]:
    """(cu_seqlens int32, max length) of the padding-free batch being run, or None."""
    call = current_call()
    if call is None or call.packing is None:
        return None
    cu_seqlens, carrier = call.packing
    return cu_seqlens, carrier.shape[0]


@torch.compiler.disable
def _packing_from_call(args: tuple, kwargs: dict) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
    """The packing a padding-free batch's call carries (cu_seq_lens_q, or position_ids restarting),
    read as the registered Tempo attention reads it (hf_attention.packing_of_call): (cu_seqlens,
    the longest sequence's length as ``_length_carrier``), or None. It reads the sequence
    boundaries on the host, so torch.compile runs it outside the graph (one break, before the layers)."""
    from tempo.integrations.hf_attention import packing_of_call

    ids = model_calls.argument(args, kwargs, "input_ids", 0)
    if ids is None:
        ids = model_calls.argument(args, kwargs, "inputs_embeds", 4)
    if not isinstance(ids, torch.Tensor) or ids.dim() < 2:
        return None
    position_ids = model_calls.argument(args, kwargs, "position_ids", 3)
    packing = packing_of_call(ids.shape[0], ids.shape[1], kwargs, position_ids, ids.device)
    return None if packing is None else (packing[0], _length_carrier(packing[1], packing[0]))


def _length_carrier(length: int, like: torch.Tensor) -> torch.Tensor:
    """An empty [length, 0] tensor (no bytes): the length travels as its size, which torch.compile
    makes a dynamic dimension, where an int read by the layers would be guarded on (one graph per
    longest-sequence length, soon past the recompile limit)."""
    return like.new_empty((length, 0))


def _call_pre_hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
    outer = _CALLS.current()
    packing = outer.packing if outer is not None else _packing_from_call(args, kwargs)
    # The call's mask is absent or [B, S]: the encoder gives every layer the pair mask m_i·m_j and
    # the standard relative positions (DebertaV2Encoder). Popped by the post hook, always.
    _CALLS.push(_Call(module, packing, model_calls.mask_per_token(args, kwargs, _POSITIONS)))
    if packing is None or outer is not None:
        return  # not packed, or an inner model of the same call (the outermost call's packing holds)
    if any(getattr(m, "conv", None) is not None for m in module.modules() if type(m).__name__ == "DebertaV2Encoder"):
        raise ValueError(f"{type(module).__name__}: padding-free batches (packed sequences) cannot run through "
                         f"DeBERTa-v2's convolution layer (conv_kernel_size > 0 mixes neighbouring tokens "
                         f"across sequences); pad the batch instead")
    if torch.is_grad_enabled() and any(getattr(m, "gradient_checkpointing", False) is True and m.training
                                       for m in module.modules()):
        # The recomputation runs in backward, after this call: its layers would not see the packing.
        raise ValueError(f"{type(module).__name__}: padding-free batches (packed sequences) cannot run with gradient "
                         f"checkpointing (the layers recomputed in backward run outside the call that carries "
                         f"the packing); pad the batch, or call gradient_checkpointing_disable()")
    mask = model_calls.argument(args, kwargs, "attention_mask", 1)
    if isinstance(mask, torch.Tensor) and not bool(mask.all()):  # one host read; the packing took one already
        raise ValueError("DeBERTa (Tempo): a padding-free batch (packed sequences) with padding in its "
                         "attention_mask; pass one or the other")


def _call_post_hook(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
    _CALLS.pop(module)


def _is_deberta_model(module: nn.Module) -> bool:
    from transformers import PreTrainedModel

    return isinstance(module, PreTrainedModel) and type(module).__name__.startswith("DebertaV2")


def install_call_hooks(model: nn.Module) -> None:
    """The call hooks on every DeBERTa-v2 model of the tree (head and base) that lacks them: each
    call hands its packing (a padding-free batch, read at the outermost call) and whether the
    encoder builds the layers' inputs to every layer. Idempotent. A padding-free batch through a
    model with the convolution layer (some DeBERTa-v2 configs) is refused: it mixes neighbouring
    tokens across sequences."""
    for module in model.modules():
        if _is_deberta_model(module):
            model_calls.install(module, _call_pre_hook, _call_post_hook)


def remove_call_hooks(model: nn.Module) -> None:
    """Take the call hooks out of every module of the tree: the entries whose function is this
    module's hook (by identity; a user's hooks stay), as their RemovableHandle would."""
    model_calls.remove(model.modules(), _call_pre_hook, _call_post_hook)


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


matches_original = output_check(check_inputs)  # the recipe's check: a padded row, eval mode, dropout off


def _build_combined(old: nn.Module, options: Options) -> nn.Module:
    return DebertaCombinedAttention(old)


def _build_efficient(old: nn.Module, options: Options) -> Built:
    if _one_bucket(old):
        return Skip("position_buckets=1: transformers' own make_log_bucket_position divides by position_buckets // 2 "
                    "= 0 (a ZeroDivisionError, or under TorchScript inf buckets cast to integers), which Tempo's "
                    "attention does not reproduce")
    return DebertaEfficientAttention(old)


def deberta_recipes() -> list[Recipe]:
    """The attention core: the O(s) disentangled attention for attention="efficient" (and the
    default), Combined for attention="tempo" (the paper's: keeps the probabilities)."""
    common = dict(option="attention", recognise=is_deberta_v2_attention, check=matches_original, restore=restore_children)
    return [
        Recipe(kind="DeBERTa attention", becomes="DebertaEfficientAttention (disentangled attention in O(s): "
                                                 "tempo.ops.disentangled_attention)",
               replacement=DebertaEfficientAttention, build=_build_efficient, model_hook=install_call_hooks,
               model_unhook=remove_call_hooks,
               enabled=lambda options: options.attention == "efficient", **common),
        Recipe(kind="DeBERTa attention core",
               becomes="DebertaCombinedAttention (softmax -> dropout -> bmm as Combined; relative-position "
                       "bias as it was)",
               replacement=DebertaCombinedAttention, build=_build_combined,
               enabled=lambda options: options.attention == "tempo", **common),
    ]


__all__ = ["DebertaCombinedAttention", "DebertaEfficientAttention", "check_inputs", "current_packing",
           "current_call", "deberta_recipes", "install_call_hooks", "is_deberta_v2_attention", "matches_original",
           "remove_call_hooks"]
