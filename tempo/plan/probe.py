"""The probe a plan is counted on: a fake copy of the model with a few Transformer blocks.

``fake_probe(model, layout, mode)`` copies the model's structure without its data (every
parameter and buffer becomes a meta tensor in the copy, then a fake one of ``mode``: nothing is
allocated, the user's model is not touched), keeps ``len(layout)`` Transformer blocks (the first
ones; when the model has fewer, copies of its blocks after the first, in turn: a first block can
differ from the rest, as ModernBERT's, which has no attention norm and so keeps its input for
backward), and gives block i recompute ``layout[i]``. What it allocates per block is what every
block of the real model allocates (identical repeated layers), so a short probe stands for the whole
model (tempo.plan.compose).

``example_batch`` makes the inputs a step feeds such a model: token ids (no padding: the plan counts
real tokens; padded models are counted at their padded length), and the labels its head's loss takes
(masked-LM / pretraining / token classification / causal LM: per token; sequence classification and
question answering: per sequence; BERT pretraining's next-sentence label). A padded model gets the
``attention_mask`` a collator passes (``padded``: ones, and each row's last token padding when the
lengths vary, ``ragged``): it builds masks from it.
"""

from __future__ import annotations

import copy
import inspect
from typing import Any, Callable, Optional, Sequence

import torch
from torch import nn

from tempo.integrations.recompute import set_recompute, transformer_blocks
from tempo.utils import fake_parameters


def structure_copy(model: nn.Module) -> nn.Module:
    """A deep copy of ``model`` whose parameters and buffers are meta tensors (tied ones stay tied):
    the structure, hooks and configuration, none of the data."""
    memo: dict[int, Any] = {}
    for module in model.modules():
        for tensors in (module._parameters, module._buffers):
            for t in tensors.values():
                if t is None or id(t) in memo:
                    continue
                meta = torch.empty_strided(tuple(t.shape), tuple(t.stride()), dtype=t.dtype, device="meta")
                memo[id(t)] = nn.Parameter(meta, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else meta
    return copy.deepcopy(model, memo)


def probe_sources(depth: int, blocks: int) -> list[int]:
    """For each of the probe's ``blocks`` blocks, the model's block (of ``depth``) it is or copies:
    the first ``depth`` are the model's own, the rest copy its blocks after the first in turn (the
    first alone when it is the only one)."""
    return [i if i < depth else 1 + (i - 1) % (depth - 1) if depth > 1 else 0 for i in range(blocks)]


def _shorten_config(model: nn.Module, sources: list[int]) -> None:
    for module in model.modules():
        config = module.__dict__.get("config")
        if config is None or not hasattr(config, "num_hidden_layers"):
            continue
        config.num_hidden_layers = len(sources)
        layer_types = getattr(config, "layer_types", None)
        if isinstance(layer_types, (list, tuple)) and layer_types:
            config.layer_types = [layer_types[i % len(layer_types)] for i in sources]


def fake_probe(model: nn.Module, layout: Sequence[str], mode: Any,
               prepare: Optional[Callable[[nn.Module], Any]] = None) -> tuple[nn.Module, list[nn.Module], int]:
    """(the probe, its blocks, the number of blocks the model has): module docstring. ``prepare``
    runs on the meta copy first (``apply_tempo``)."""
    probe = structure_copy(model)
    if prepare is not None:
        prepare(probe)
    blocks = transformer_blocks(probe)
    depth = len(blocks)
    sources = probe_sources(depth, len(layout))
    kept = [blocks[i] if i == j else structure_copy(blocks[j]) for i, j in enumerate(sources)]
    blocks._modules.clear()
    for i, block in enumerate(kept):
        blocks._modules[str(i)] = block
    _shorten_config(probe, sources)
    fake_parameters(probe, mode)
    for block, recompute in zip(kept, layout):
        set_recompute(block, recompute)
    probe.train()
    return probe, kept, depth


def _accepts(model: nn.Module, name: str) -> bool:
    try:
        parameters = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False
    return name in parameters  # named explicitly: a **kwargs catch-all does not mean the model reads it


def vocabulary_size(model: nn.Module) -> int:
    config = getattr(model, "config", None)
    size = getattr(config, "vocab_size", None)
    if isinstance(size, int) and size > 0:
        return size
    embeddings = [m for m in model.modules() if isinstance(m, nn.Embedding)]
    if not embeddings:
        raise ValueError(f"tempo.plan: {type(model).__name__} has no token embedding to size the inputs by; "
                         f"pass batch_fn=...")
    return max(e.num_embeddings for e in embeddings)


def _has_head(name: str) -> bool:
    """transformers' naming: BertModel is the bare encoder, BertForMaskedLM and GPT2LMHeadModel have heads."""
    return "For" in name or "Head" in name


def takes_attention_mask(model: nn.Module) -> bool:
    """Whether ``model``'s forward takes an ``attention_mask`` (``example_batch(padded=True)``)."""
    return _accepts(model, "attention_mask")


def example_batch(model: nn.Module, batch: int, seq_len: int, padded: bool = False,
                  ragged: bool = True, packed: bool = False) -> dict[str, torch.Tensor]:
    """Inputs of one step of ``model`` (module docstring); real tensors (small: ids and labels).
    ``padded``: with the ``attention_mask`` a collator passes to a padded batch: ones, each row's last
    token padding when ``ragged`` (sequences of several lengths). A model builds its masks from it
    (DeBERTa a [batch, 1, s, s] one from any mask; others none from a mask of ones). ``packed``: with
    ``position_ids`` per row, as a padding-free step passes them: what a model builds from positions
    (rotary cos/sin, position embeddings) is then per token, as in the packed row, not one row
    broadcast over the batch."""
    name = type(model).__name__
    if padded and (seq_len < 2 or not takes_attention_mask(model)):
        raise ValueError(f"example_batch: a padded batch needs seq_len >= 2 and a model that takes an "
                         f"attention_mask; {name} at seq_len {seq_len}")
    generator = torch.Generator().manual_seed(0)
    vocab = vocabulary_size(model)
    ids = torch.randint(min(3, vocab - 1), vocab, (batch, seq_len), generator=generator)
    inputs: dict[str, torch.Tensor] = {"input_ids": ids}
    per_sequence = name.endswith(("ForSequenceClassification", "ForMultipleChoice"))
    if name.endswith("ForQuestionAnswering"):
        inputs["start_positions"] = torch.zeros(batch, dtype=torch.long)
        inputs["end_positions"] = torch.ones(batch, dtype=torch.long)
    elif _accepts(model, "labels") and _has_head(name):
        inputs["labels"] = (torch.zeros(batch, dtype=torch.long) if per_sequence
                            else masked_lm_labels(ids) if name.endswith("ForMaskedLM") else ids.clone())
    if _accepts(model, "use_cache") and _has_head(name):
        inputs["use_cache"] = False  # training: no KV cache
    if _accepts(model, "next_sentence_label") and name.endswith("ForPreTraining"):
        inputs["next_sentence_label"] = torch.zeros(batch, dtype=torch.long)
    if _accepts(model, "masked_lm_positions"):  # tempo.bert's pretraining head (DeepLearningExamples')
        predictions = max(1, round(0.15 * seq_len))  # DLE's max_predictions_per_seq: 20 at 128, 80 at 512
        inputs["masked_lm_positions"] = torch.arange(predictions).repeat(batch, 1)
        inputs["masked_lm_labels"] = ids[:, :predictions].clone()
        inputs["next_sentence_labels"] = torch.zeros(batch, dtype=torch.long)
        inputs.pop("labels", None)
    if any(getattr(m, "unpad", False) is True for m in model.modules()):
        inputs["attention_mask"] = torch.ones_like(ids)  # tempo.bert unpads only with a mask: every token real
    if packed and _accepts(model, "position_ids"):
        inputs["position_ids"] = torch.arange(seq_len).repeat(batch, 1)
    if padded:
        inputs["attention_mask"] = torch.ones_like(ids)
        if ragged:
            inputs["attention_mask"][:, -1] = 0
    return inputs


def masked_lm_labels(ids: torch.Tensor) -> torch.Tensor:
    """A masked LM's labels as a collator gives them: ~15 % of the positions of each row (evenly
    spread) labelled with their token, -100 elsewhere (the loss and Tempo's fused head skip those)."""
    labels = torch.full_like(ids, -100)
    length = ids.shape[-1]
    labelled = torch.linspace(0, length - 1, max(1, round(0.15 * length))).long()
    labels[..., labelled] = ids[..., labelled]
    return labels


def max_positions(model: nn.Module) -> Optional[int]:
    """The longest sequence the model's position table allows (None: no such limit, e.g. RoPE)."""
    config = getattr(model, "config", None)
    if config is None:
        return None
    if getattr(config, "position_embedding_type", "absolute") not in ("absolute", None):
        return None
    limit = getattr(config, "max_position_embeddings", None)
    if not isinstance(limit, int):
        return None
    if type(model).__name__.startswith(("Roberta", "XLMRoberta", "Camembert")):
        limit -= getattr(config, "pad_token_id", 1) + 1  # positions start at padding_idx + 1
    return limit


__all__ = ["example_batch", "fake_probe", "max_positions", "probe_sources", "structure_copy", "takes_attention_mask",
           "vocabulary_size"]
