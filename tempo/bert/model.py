"""Post-LN BERT as in Google's reference / NVIDIA DLE, with optional Tempo memory-saving layers.

Module and parameter names follow Hugging Face's BertModel (embeddings.word_embeddings,
encoder.layer.N.attention.self.query, ..., cls.predictions.transform.dense, qa_outputs) so HF and
DLE checkpoints map onto this model 1:1 (heads models keep the backbone under `bert.`).

Classes appear in data-flow order: embeddings -> attention -> layer -> encoder -> pooler ->
BertModel -> heads -> BertForPreTraining / BertForQuestionAnswering.
"""

from __future__ import annotations

import math
import warnings
from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from tempo.bert.config import BertConfig
from tempo.choices import TempoChoice
from tempo.unpad import TokenLayout
from tempo.ops.linear_cross_entropy import linear_cross_entropy



def _layer_norm(config: BertConfig, options: TempoChoice) -> nn.Module:
    if options.layernorm:
        from tempo.inplace_layernorm import InplaceLayerNorm  # lazy: optional Tempo kernel
        return InplaceLayerNorm(config.hidden_size, eps=config.layer_norm_eps)
    return nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)


def _name_tempo_layernorms(model: nn.Module) -> None:
    """Tempo LayerNorms quote their qualified name in errors (a non-finite γ or β)."""
    options = getattr(model, "options", None) or getattr(getattr(model, "bert", None), "options", None)
    if options is not None and (options.layernorm or options.dropout_add_layernorm):
        from tempo.ops.layernorm import name_layernorms  # lazy, as _layer_norm
        name_layernorms(model)


def _gelu(config: BertConfig, options: TempoChoice) -> nn.Module:
    """The GELU form config.hidden_act names ("gelu": exact erf; "gelu_new", "gelu_pytorch_tanh",
    ...: tanh), as InplaceGelu with the gelu choice, else nn.GELU."""
    approximate = config.gelu_approximate
    if options.gelu:
        from tempo.inplace_gelu import InplaceGelu  # lazy: optional Tempo kernel
        return InplaceGelu(approximate=approximate)
    return nn.GELU(approximate=approximate)


def _compute_dtype(reference: Tensor) -> torch.dtype:
    """dtype the attention scores will have: the autocast dtype if autocast is on."""
    device_type = reference.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return reference.dtype


def additive_attention_mask(attention_mask: Tensor, dtype: torch.dtype) -> Tensor:
    """[B, L] 1=token/0=pad -> additive [B, 1, 1, L] mask in `dtype` (0 keep, finfo.min drop).

    A sample with no tokens at all gets an all-zero mask (uniform attention over padding) rather
    than an all-min row: in fp16, score + finfo.min can round to -inf, and a row of -inf makes
    softmax return NaN.
    """
    keep = attention_mask.bool()
    keep = keep | ~keep.any(dim=-1, keepdim=True)
    mask = torch.zeros(keep.shape, dtype=dtype, device=attention_mask.device)
    mask.masked_fill_(~keep, torch.finfo(dtype).min)
    return mask[:, None, None, :]


def key_padding_mask(attention_mask: Tensor) -> Tensor:
    """[B, L] 1=token/0=pad -> bool [B, 1, 1, L], True = attend; a sample with no tokens at all
    attends every position, as ``additive_attention_mask`` makes it."""
    keep = attention_mask.bool()
    keep = keep | ~keep.any(dim=-1, keepdim=True)
    return keep[:, None, None, :]


def layer_attention_mask(attention: str, attention_mask: Tensor, layout: Optional[TokenLayout],
                         dtype: torch.dtype) -> Optional[Tensor]:
    """The mask the encoder's layers get for the ``attention`` choice (BertModel.forward; the
    movement counter traces a layer with it): none for sdpa and the efficient attention when the
    batch is unpadded (variable-length attention) or nothing is padded (so fused kernels can take
    the call; one host read), a bool key-padding mask for the efficient attention (the same
    attention as the additive one, and with dropout on the fused kernels take it: a float mask with
    dropout runs the reference op, tempo.ops.attention), the additive mask in ``dtype`` otherwise."""
    if attention in ("sdpa", "efficient") and (layout is not None or bool(attention_mask.all())):
        return None
    if attention == "efficient":
        return key_padding_mask(attention_mask)
    return additive_attention_mask(attention_mask, dtype)


# ---------------------------------------------------------------------------------------------
# Embeddings
# ---------------------------------------------------------------------------------------------
class BertEmbeddings(nn.Module):
    def __init__(self, config: BertConfig, options: TempoChoice):
        super().__init__()
        # Padded rows are never targets; they only round the GEMM shape (see padded_vocab_size).
        self.word_embeddings = nn.Embedding(config.padded_vocab_size, config.hidden_size)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, config.hidden_size)
        self.LayerNorm = _layer_norm(config, options)
        if options.dropout_add_layernorm:  # Tempo's dropouts keep a seed, not a mask (tempo.ops.dropout)
            from tempo.ops.dropout import SeededDropout  # lazy: imports Triton only when used

            self.dropout = SeededDropout(config.hidden_dropout_prob)
        else:
            self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(self, input_ids: Tensor, token_type_ids: Tensor, layout: Optional[TokenLayout] = None) -> Tensor:
        """[B, L] ids -> [B, L, H]; with a layout, the T real tokens only -> [T, H], each at the
        position it has in its padded row."""
        seq_len = input_ids.shape[1]
        if seq_len > self.position_embeddings.num_embeddings:
            raise ValueError(f"sequence length {seq_len} exceeds max_position_embeddings "
                             f"{self.position_embeddings.num_embeddings}")
        if layout is None:
            positions = torch.arange(seq_len, device=input_ids.device)
        else:
            input_ids, token_type_ids = layout.unpad(input_ids), layout.unpad(token_type_ids)
            positions = layout.positions()
        x = (self.word_embeddings(input_ids)
             + self.position_embeddings(positions)
             + self.token_type_embeddings(token_type_ids))
        return self.dropout(self.LayerNorm(x))


# ---------------------------------------------------------------------------------------------
# Attention
# ---------------------------------------------------------------------------------------------
class BertSelfAttention(nn.Module):
    """Multi-head self-attention; the softmax/dropout/matmul core is chosen by options.attention."""

    def __init__(self, config: BertConfig, options: TempoChoice):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.head_size = config.head_size
        self.scale = 1.0 / math.sqrt(self.head_size)
        self.attention_impl = options.attention

        self.query = nn.Linear(config.hidden_size, config.hidden_size)
        self.key = nn.Linear(config.hidden_size, config.hidden_size)
        self.value = nn.Linear(config.hidden_size, config.hidden_size)

        # Every attention implementation reads its rate from this module at each forward, so setting
        # .p on the model's nn.Dropout modules (TRL's disable_dropout_in_model) reaches all of them.
        self.dropout = nn.Dropout(config.attention_probs_dropout_prob)
        if options.attention == "tempo":
            from tempo.combined import Combined  # lazy: imports Triton only when used
            self.combined = Combined(dim=-1, dropout=self.dropout)

    @property
    def dropout_p(self) -> float:
        """The attention dropout rate: the nn.Dropout module's."""
        return self.dropout.p

    def _split_heads(self, x: Tensor) -> Tensor:
        b, l, _ = x.shape
        return x.view(b, l, self.num_heads, self.head_size).transpose(1, 2)  # [B, N, L, D]

    def forward(self, hidden: Tensor, mask: Optional[Tensor], layout: Optional[TokenLayout] = None) -> Tensor:
        if layout is not None:
            return self._forward_unpadded(hidden, mask, layout)
        q = self._split_heads(self.query(hidden))
        k = self._split_heads(self.key(hidden))
        v = self._split_heads(self.value(hidden))
        context = self._core(q, k, v, mask)
        b, _, l, _ = context.shape
        return context.transpose(1, 2).reshape(b, l, self.num_heads * self.head_size)

    def _forward_unpadded(self, hidden: Tensor, mask: Optional[Tensor], layout: TokenLayout) -> Tensor:
        """hidden [T, H] of the real tokens -> [T, H]; attention stays inside each sequence."""
        t = hidden.shape[0]
        q, k, v = (proj(hidden).view(t, self.num_heads, self.head_size) for proj in (self.query, self.key, self.value))
        p = self.dropout_p if self.training else 0.0
        if self.attention_impl == "efficient":
            from tempo.ops.attention import efficient_attention_varlen  # lazy, as in the padded path

            # The layout's host facts (max and min length): no host read in any layer.
            context = efficient_attention_varlen(q, k, v, layout.cu_seqlens, layout.max_seqlen,
                                                 dropout_p=self.dropout_p, training=self.training,
                                                 min_seqlen=layout.min_seqlen)
        elif self.attention_impl == "sdpa":
            # Stock variable-length attention: sdpa on nested jagged tensors (CUDA: the fused
            # flash/efficient kernels with cu_seqlens; CPU: the math path per sequence).
            offsets = layout.cu_seqlens.long()
            with warnings.catch_warnings():
                # torch's CPU math path converts to its older nested layout, which warns "prototype".
                warnings.filterwarnings("ignore", message="The PyTorch API of nested tensors", category=UserWarning)
                # min_seqlen and max_seqlen from the layout: without them torch reads both back
                # from the device (offsets.diff().min().item(), per tensor) inside sdpa.
                nested = [torch.nested.nested_tensor_from_jagged(x, offsets=offsets, min_seqlen=layout.min_seqlen,
                                                                 max_seqlen=layout.max_seqlen)
                          .transpose(1, 2) for x in (q, k, v)]
                context = F.scaled_dot_product_attention(*nested, dropout_p=p).transpose(1, 2).values()
        else:
            # Eager and the paper's Combined keep s x s scores by design: they run on the padded
            # [B, N, L, L] block (the linear layers around them still see T tokens only).
            padded = [self._split_heads(layout.pad(x.reshape(t, -1))) for x in (q, k, v)]
            context = self._core(*padded, mask)
            context = layout.unpad(context.transpose(1, 2))
        return context.reshape(t, self.num_heads * self.head_size)

    def _core(self, q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor]) -> Tensor:
        """softmax(q kᵀ·scale + mask) -> dropout -> · v on [B, N, L, D], by options.attention."""
        if self.attention_impl == "sdpa":
            # mask None (no padding in the batch) lets sdpa pick its flash kernel on a GPU.
            context = F.scaled_dot_product_attention(
                q, k, v, attn_mask=None if mask is None else mask.to(q.dtype),
                dropout_p=self.dropout_p if self.training else 0.0)
        elif self.attention_impl == "efficient":
            from tempo.ops.attention import efficient_attention  # lazy: imports Triton only when used

            context = efficient_attention(q, k, v, attn_mask=mask, dropout_p=self.dropout_p, training=self.training)
        else:
            if mask is None:
                mask = torch.zeros((), dtype=q.dtype, device=q.device)
            scores = torch.matmul(q, k.transpose(-1, -2)) * self.scale + mask
            if self.attention_impl == "tempo":
                context = self.combined(scores, v)
            else:
                probs = self.dropout(torch.softmax(scores, dim=-1))
                context = torch.matmul(probs, v)
        return context


class _DropoutAddNorm(nn.Module):
    """dense -> dropout -> + residual -> LayerNorm, the end of both residual blocks of a layer.

    With the dropout_add_layernorm choice the last three are one DropoutAddLayerNorm (named
    LayerNorm, so checkpoints keep their keys) that keeps no dropout mask and no pre-LN sum.
    """

    def __init__(self, config: BertConfig, options: TempoChoice, in_features: int):
        super().__init__()
        self.dense = nn.Linear(in_features, config.hidden_size)
        self.fused = options.dropout_add_layernorm
        if self.fused:
            from tempo.ops.dropout_add_layernorm import DropoutAddLayerNorm  # lazy: imports Triton only when used
            self.LayerNorm = DropoutAddLayerNorm(config.hidden_size, config.hidden_dropout_prob,
                                                 eps=config.layer_norm_eps)
        else:
            self.LayerNorm = _layer_norm(config, options)
            self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(self, hidden: Tensor, residual: Tensor) -> Tensor:
        if self.fused:
            return self.LayerNorm(self.dense(hidden), residual)
        return self.LayerNorm(self.dropout(self.dense(hidden)) + residual)


class BertSelfOutput(_DropoutAddNorm):
    def __init__(self, config: BertConfig, options: TempoChoice):
        super().__init__(config, options, config.hidden_size)


class BertAttention(nn.Module):
    def __init__(self, config: BertConfig, options: TempoChoice):
        super().__init__()
        self.self = BertSelfAttention(config, options)
        self.output = BertSelfOutput(config, options)

    def forward(self, hidden: Tensor, mask: Optional[Tensor], layout: Optional[TokenLayout] = None) -> Tensor:
        return self.output(self.self(hidden, mask, layout), hidden)


# ---------------------------------------------------------------------------------------------
# Feed-forward, layer, encoder
# ---------------------------------------------------------------------------------------------
class BertIntermediate(nn.Module):
    def __init__(self, config: BertConfig, options: TempoChoice):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.intermediate_size)
        self.act = _gelu(config, options)

    def forward(self, hidden: Tensor) -> Tensor:
        return self.act(self.dense(hidden))


class BertOutput(_DropoutAddNorm):
    def __init__(self, config: BertConfig, options: TempoChoice):
        super().__init__(config, options, config.intermediate_size)


class BertLayer(nn.Module):
    def __init__(self, config: BertConfig, options: TempoChoice):
        super().__init__()
        self.attention = BertAttention(config, options)
        self.intermediate = BertIntermediate(config, options)
        self.output = BertOutput(config, options)

    def forward(self, hidden: Tensor, mask: Optional[Tensor], layout: Optional[TokenLayout] = None) -> Tensor:
        """[B, L, H] (mask: additive [B, 1, 1, L], bool for the efficient attention, or None), or the
        T real tokens [T, H] with their layout: every part but attention works token by token."""
        attended = self.attention(hidden, mask, layout)
        return self.output(self.intermediate(attended), attended)


class BertEncoder(nn.Module):
    def __init__(self, config: BertConfig, options: TempoChoice,
                 checkpoint_activations: bool = False):
        super().__init__()
        self.layer = nn.ModuleList(BertLayer(config, options)
                                   for _ in range(config.num_hidden_layers))
        self.checkpoint_activations = checkpoint_activations

    def forward(self, hidden: Tensor, mask: Optional[Tensor], layout: Optional[TokenLayout] = None) -> Tensor:
        use_checkpoint = (self.checkpoint_activations and self.training
                          and torch.is_grad_enabled())
        for layer in self.layer:
            if use_checkpoint:
                # Non-reentrant: works with in-place Tempo ops, kwargs, and restores the RNG
                # state so dropout masks match on recompute.
                hidden = checkpoint(layer, hidden, mask, layout, use_reentrant=False)
            else:
                hidden = layer(hidden, mask, layout)
        return hidden


class BertPooler(nn.Module):
    def __init__(self, config: BertConfig):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.activation = nn.Tanh()

    def forward(self, hidden: Tensor, layout: Optional[TokenLayout] = None) -> Tensor:
        # [CLS]: position 0 of each padded row, or each sequence's first real token.
        first = hidden[:, 0] if layout is None else hidden.index_select(0, layout.first_tokens())
        return self.activation(self.dense(first))


# ---------------------------------------------------------------------------------------------
# Backbone
# ---------------------------------------------------------------------------------------------
class BertModelOutput(NamedTuple):
    last_hidden_state: Tensor       # [B, L, H]; unpadded: [T, H], the real tokens (layout.pad gives [B, L, H])
    pooler_output: Optional[Tensor]  # [B, H], None without a pooler
    layout: Optional[TokenLayout] = None  # the unpadded batch's layout, None on the padded path


def init_bert_weights(module: nn.Module, initializer_range: float) -> None:
    """Google/DLE init: N(0, initializer_range) weights, zero biases, LayerNorm weight 1.

    Name-based so it covers nn.LayerNorm and InplaceLayerNorm alike.
    """
    with torch.no_grad():
        for name, param in module.named_parameters():
            if name.endswith("decoder.weight"):
                continue  # the tied word embedding: initialised (once) as an embedding
            if name.endswith("LayerNorm.weight"):
                param.fill_(1.0)
            elif name.endswith("bias"):
                param.zero_()
            else:
                param.normal_(mean=0.0, std=initializer_range)


class BertModel(nn.Module):
    """``unpad=True``: a batch with padding runs on its T real tokens only (``tempo.unpad``):
    embeddings, every Linear, GELU, LayerNorm and dropout see [T, H], attention stays inside each
    sequence, and the heads read the tokens they need. Same loss and gradients as the padded path
    (right padding; the pooler reads each sequence's first real token, position 0 there)."""

    def __init__(self, config: BertConfig, options: Optional[TempoChoice] = None,
                 checkpoint_activations: bool = False, add_pooling_layer: bool = True, unpad: bool = False):
        super().__init__()
        self.config = config
        self.unpad = unpad
        self.options = options if options is not None else TempoChoice()
        self.embeddings = BertEmbeddings(config, self.options)
        self.encoder = BertEncoder(config, self.options, checkpoint_activations)
        self.pooler = BertPooler(config) if add_pooling_layer else None
        init_bert_weights(self, config.initializer_range)
        _name_tempo_layernorms(self)

    def forward(self, input_ids: Tensor, token_type_ids: Optional[Tensor] = None,
                attention_mask: Optional[Tensor] = None) -> BertModelOutput:
        if token_type_ids is None:
            token_type_ids = torch.zeros_like(input_ids)
        layout = None
        if self.unpad and attention_mask is not None:
            layout = TokenLayout.from_mask(attention_mask)  # checks the mask; one host read
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        hidden = self.embeddings(input_ids, token_type_ids, layout)
        mask = layer_attention_mask(self.options.attention, attention_mask, layout, _compute_dtype(hidden))
        hidden = self.encoder(hidden, mask, layout)
        pooled = self.pooler(hidden, layout) if self.pooler is not None else None
        return BertModelOutput(hidden, pooled, layout)


# ---------------------------------------------------------------------------------------------
# Pre-training heads
# ---------------------------------------------------------------------------------------------
class BertPredictionHeadTransform(nn.Module):
    def __init__(self, config: BertConfig, options: TempoChoice):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.transform_act_fn = _gelu(config, options)
        self.LayerNorm = _layer_norm(config, options)

    def forward(self, hidden: Tensor) -> Tensor:
        return self.LayerNorm(self.transform_act_fn(self.dense(hidden)))


class BertLMPredictionHead(nn.Module):
    def __init__(self, config: BertConfig, options: TempoChoice, word_embedding_weight: Tensor):
        super().__init__()
        self.transform = BertPredictionHeadTransform(config, options)
        self.decoder = nn.Linear(config.hidden_size, config.padded_vocab_size, bias=False)
        self.decoder.weight = word_embedding_weight  # tied, as Google/DLE/HF
        self.bias = nn.Parameter(torch.zeros(config.padded_vocab_size))

    def forward(self, hidden: Tensor) -> Tensor:
        # One fused linear so autocast casts the bias too (a separate `+ bias` in fp32 would
        # promote the [*, vocab] logits to fp32 and double their memory).
        return F.linear(self.transform(hidden), self.decoder.weight, self.bias)


class BertPreTrainingHeads(nn.Module):
    def __init__(self, config: BertConfig, options: TempoChoice, word_embedding_weight: Tensor):
        super().__init__()
        self.predictions = BertLMPredictionHead(config, options, word_embedding_weight)
        self.seq_relationship = nn.Linear(config.hidden_size, 2)

    def forward(self, sequence_output: Tensor, pooled_output: Tensor) -> tuple[Tensor, Tensor]:
        return self.predictions(sequence_output), self.seq_relationship(pooled_output)


def _masked_mean_cross_entropy(logits: Tensor, labels: Tensor) -> Tensor:
    """Mean CE over labels >= 0 (negative = no prediction); 0, not NaN, when there are none."""
    logits = logits.reshape(-1, logits.shape[-1]).float()
    labels = labels.reshape(-1)
    labels = labels.masked_fill(labels < 0, -1)  # accept HF's -100 as well as DLE's -1
    total = F.cross_entropy(logits, labels, ignore_index=-1, reduction="sum")
    count = (labels >= 0).sum().clamp_min(1)
    return total / count


class PreTrainingOutput(NamedTuple):
    loss: Optional[Tensor]                # mlm_loss + nsp_loss (whichever are given)
    mlm_loss: Optional[Tensor]
    nsp_loss: Optional[Tensor]
    prediction_scores: Optional[Tensor]   # [B, P, padded_vocab] (or [B, L, ...]); None: the fused head in training
    seq_relationship_score: Tensor        # [B, 2]


class BertForPreTraining(nn.Module):
    def __init__(self, config: BertConfig, options: Optional[TempoChoice] = None,
                 checkpoint_activations: bool = False, unpad: bool = False):
        super().__init__()
        self.config = config
        self.bert = BertModel(config, options, checkpoint_activations, unpad=unpad)
        self.cls = BertPreTrainingHeads(config, self.bert.options,
                                        self.bert.embeddings.word_embeddings.weight)
        init_bert_weights(self.cls, config.initializer_range)
        _name_tempo_layernorms(self)

    def forward(self, input_ids: Tensor, token_type_ids: Optional[Tensor] = None,
                attention_mask: Optional[Tensor] = None,
                masked_lm_positions: Optional[Tensor] = None,
                masked_lm_labels: Optional[Tensor] = None,
                next_sentence_labels: Optional[Tensor] = None) -> PreTrainingOutput:
        sequence_output, pooled_output, layout = self.bert(input_ids, token_type_ids, attention_mask)
        if masked_lm_positions is not None:
            # Only the ~15% masked positions go through the MLM transform and the big decoder.
            if layout is None:
                index = masked_lm_positions.long().unsqueeze(-1).expand(-1, -1, sequence_output.shape[-1])
                sequence_output = torch.gather(sequence_output, 1, index)  # [B, P, H]
            else:
                tokens = layout.token_index(masked_lm_positions)  # [B, P] indices into the T tokens
                sequence_output = sequence_output.index_select(0, tokens.reshape(-1)).view(*tokens.shape, -1)
        elif layout is not None:
            sequence_output = layout.pad(sequence_output)  # the caller asked for every position
        mlm_loss = nsp_loss = loss = None
        if (self.bert.options.lm_loss and masked_lm_labels is not None and self.training
                and torch.is_grad_enabled()):
            # The fused head and loss (tempo.ops.linear_cross_entropy): no [B, P, vocab] logits.
            predictions = self.cls.predictions
            labels = masked_lm_labels.reshape(-1).masked_fill(masked_lm_labels.reshape(-1) < 0, -100)
            hidden = predictions.transform(sequence_output.reshape(-1, sequence_output.shape[-1]))
            total = linear_cross_entropy(hidden, predictions.decoder.weight, labels, predictions.bias, reduction="sum")
            mlm_loss = loss = total / (labels >= 0).sum().clamp_min(1)
            prediction_scores, seq_relationship_score = None, self.cls.seq_relationship(pooled_output)
        else:
            prediction_scores, seq_relationship_score = self.cls(sequence_output, pooled_output)
        if masked_lm_labels is not None and mlm_loss is None:
            mlm_loss = _masked_mean_cross_entropy(prediction_scores, masked_lm_labels)
            loss = mlm_loss
        if next_sentence_labels is not None:
            nsp_loss = _masked_mean_cross_entropy(seq_relationship_score, next_sentence_labels)
            loss = nsp_loss if loss is None else loss + nsp_loss
        return PreTrainingOutput(loss, mlm_loss, nsp_loss, prediction_scores,
                                 seq_relationship_score)


# ---------------------------------------------------------------------------------------------
# SQuAD head
# ---------------------------------------------------------------------------------------------
class QuestionAnsweringOutput(NamedTuple):
    loss: Optional[Tensor]
    start_logits: Tensor  # [B, L]
    end_logits: Tensor    # [B, L]


class BertForQuestionAnswering(nn.Module):
    """Start/end logits over the [B, L] positions. Padding positions get logit finfo.min (never an
    answer, no share of the softmax), so padded and unpadded runs give the same loss. (DLE and HF
    let padding positions take a share of the loss's softmax; predictions are the same.)"""

    def __init__(self, config: BertConfig, options: Optional[TempoChoice] = None,
                 checkpoint_activations: bool = False, unpad: bool = False):
        super().__init__()
        self.config = config
        # No pooler: it would be an unused parameter set (and DDP complains about those).
        self.bert = BertModel(config, options, checkpoint_activations, add_pooling_layer=False, unpad=unpad)
        self.qa_outputs = nn.Linear(config.hidden_size, 2)
        init_bert_weights(self.qa_outputs, config.initializer_range)
        _name_tempo_layernorms(self)

    def forward(self, input_ids: Tensor, token_type_ids: Optional[Tensor] = None,
                attention_mask: Optional[Tensor] = None,
                start_positions: Optional[Tensor] = None,
                end_positions: Optional[Tensor] = None) -> QuestionAnsweringOutput:
        sequence_output, _, layout = self.bert(input_ids, token_type_ids, attention_mask)
        logits = self.qa_outputs(sequence_output).float()  # [B, L, 2] or [T, 2]
        never = torch.finfo(logits.dtype).min
        if layout is not None:
            logits = layout.pad(logits, value=never)
        elif attention_mask is not None:
            logits = logits.masked_fill(~attention_mask.bool().unsqueeze(-1), never)
        start_logits, end_logits = (t.squeeze(-1).contiguous() for t in logits.split(1, dim=-1))

        loss = None
        if start_positions is not None and end_positions is not None:
            # Answers outside the (truncated) window are clamped to L and ignored, as HF/DLE.
            ignored = start_logits.shape[1]
            start = start_positions.reshape(-1).clamp(0, ignored)
            end = end_positions.reshape(-1).clamp(0, ignored)
            start_loss = F.cross_entropy(start_logits.float(), start, ignore_index=ignored)
            end_loss = F.cross_entropy(end_logits.float(), end, ignore_index=ignored)
            loss = (start_loss + end_loss) / 2
        return QuestionAnsweringOutput(loss, start_logits, end_logits)
