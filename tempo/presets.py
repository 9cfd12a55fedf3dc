"""The model presets every command builds from: transformers' families at their published sizes.

``python -m tempo.plan`` (and its ``--frontier``), ``python -m tempo.memory`` and the torch-policy
counts (``tempo.plan.torch_policies``) take a family by name from ``FAMILIES`` and build it here:

    model = build_family("deberta-v3-large", task="mlm")    # on the meta device: nothing downloaded
    config = family_config("modernbert-large", layers=2, vocab=1000, attention="eager")

Weights are never loaded (the counts depend on shapes, not values), so a preset is a config class
and its fields. transformers is the optional ``hf`` extra: this module imports it only inside the
functions that build, so naming the families costs nothing without it.

Tempo's own BERT comes by name from ``tempo.bert.config.BertConfig.from_name`` ("bert_large"); the
stock model it is measured against is transformers' BERT at the same sizes (``hf_bert_config``). The
BERT-pretraining default of masked positions per sequence (``default_max_predictions``) is here too:
the benchmarks and ``tempo.movement``'s workloads share it.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch

# transformers families at their published sizes (random weights: the ledger counts storages, not
# values): key -> (row label, config class, fields). Geometry from each checkpoint's config.json on the
# Hub (hidden, heads, kv heads, head_dim, intermediate, positions, dropout; RoPE bases and token ids do
# not change the bytes kept, so they are the class defaults, or small ids where a default lies beyond
# the 1000-token vocabulary of the per-layer count). The per-added-layer count's second layer is a
# sliding-window one in ModernBERT (global every 3) and EmbeddingGemma (global every 6).
FAMILIES = {
    "bert-large": ("BERT-large (h=1024)", "BertConfig",  # google-bert/bert-large-uncased
                   dict(hidden_size=1024, num_attention_heads=16, intermediate_size=4096, max_position_embeddings=512)),
    "minilm": ("MiniLM-L6 (BERT, h=384)", "BertConfig",  # sentence-transformers/all-MiniLM-L6-v2
               dict(hidden_size=384, num_attention_heads=12, intermediate_size=1536, max_position_embeddings=512)),
    "deberta-v3-large": ("DeBERTa-v3-large (h=1024)", "DebertaV2Config", dict(  # microsoft/deberta-v3-large
        hidden_size=1024, num_attention_heads=16, intermediate_size=4096, relative_attention=True,
        pos_att_type=["p2c", "c2p"], position_buckets=256, max_relative_positions=-1, norm_rel_ebd="layer_norm",
        share_att_key=True, max_position_embeddings=512, position_biased_input=False)),
    "modernbert-large": ("ModernBERT-large (h=1024, I=2624)", "ModernBertConfig", dict(  # answerdotai/ModernBERT-large
        hidden_size=1024, num_attention_heads=16, intermediate_size=2624, global_attn_every_n_layers=3,
        local_attention=128, max_position_embeddings=8192,
        pad_token_id=0, bos_token_id=1, eos_token_id=2, cls_token_id=1, sep_token_id=2)),
    # sentence-transformers' all-mpnet-base-v2: relative position bias shared by the batch (issue 33).
    "mpnet-base": ("MPNet-base, all-mpnet-base-v2 (h=768)", "MPNetConfig",
                   dict(hidden_size=768, num_attention_heads=12, intermediate_size=3072, max_position_embeddings=514)),
    # EuroBERT/EuroBERT-210m: pre-norm RMSNorm, SwiGLU, RoPE, no dropout.
    "eurobert-210m": ("EuroBERT-210m (h=768)", "EuroBertConfig", dict(
        hidden_size=768, num_attention_heads=12, num_key_value_heads=12, intermediate_size=3072,
        max_position_embeddings=8192, mlp_bias=False, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        mask_token_id=3)),
    # google/embeddinggemma-300m: Gemma3TextModel with use_bidirectional_attention, (1 + w) RMSNorms
    # (four per layer, and q/k norms), tanh GeGLU, 3 heads of 256 over 1 kv head, 5 sliding layers of 6.
    "embeddinggemma-300m": ("EmbeddingGemma-300m (Gemma3, h=768)", "Gemma3TextConfig", dict(
        hidden_size=768, num_attention_heads=3, num_key_value_heads=1, head_dim=256, intermediate_size=1152,
        query_pre_attn_scalar=256, sliding_window=512, max_position_embeddings=2048,
        use_bidirectional_attention=True)),
    # nomic-ai/nomic-embed-text-v1.5 (n_embd, n_head, n_inner, n_positions): post-LN, SwiGLU, RoPE, no dropout.
    "nomicbert": ("NomicBERT, nomic-embed-text-v1.5 (h=768)", "NomicBertConfig", dict(
        hidden_size=768, num_attention_heads=12, intermediate_size=3072, max_position_embeddings=8192,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)),
    # Alibaba-NLP/gte-multilingual-base: post-LN, gated GELU MLP, RoPE, hidden dropout 0.1.
    "gte-multilingual-base": ("GTE-multilingual-base (h=768)", "GteConfig", dict(
        hidden_size=768, num_attention_heads=12, intermediate_size=3072, max_position_embeddings=8192,
        hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.0)),
    # jinaai/jina-embeddings-v3: XLM-R-large with RoPE (its LoRA adapters are not part of the class).
    "jina-v3": ("Jina-embeddings-v3 (XLM-R + RoPE, h=1024)", "JinaEmbeddingsV3Config", dict(
        hidden_size=1024, num_attention_heads=16, intermediate_size=4096, max_position_embeddings=8194,
        hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1)),
    # meta-llama/Llama-3.2-1B: RMSNorm, SwiGLU, 32 heads of 64 over 8 kv heads.
    "llama-3.2-1b": ("Llama-3.2-1B (h=2048)", "LlamaConfig", dict(
        hidden_size=2048, num_attention_heads=32, num_key_value_heads=8, head_dim=64, intermediate_size=8192,
        max_position_embeddings=131072, tie_word_embeddings=True)),  # the head is the embeddings, as published
    # Qwen/Qwen3-0.6B: RMSNorm with q/k norms, SwiGLU, 16 heads of 128 over 8 kv heads.
    "qwen3-0.6b": ("Qwen3-0.6B (h=1024)", "Qwen3Config", dict(
        hidden_size=1024, num_attention_heads=16, num_key_value_heads=8, head_dim=128, intermediate_size=3072,
        max_position_embeddings=40960, tie_word_embeddings=True)),
}
# (published layers, vocabulary) of each family: what a whole model of the family is built with.
FAMILY_DEPTH = {"bert-large": (24, 30522), "minilm": (6, 30522), "deberta-v3-large": (24, 128100),
                "modernbert-large": (28, 50368), "mpnet-base": (12, 30527), "eurobert-210m": (12, 128256),
                "embeddinggemma-300m": (24, 262144), "nomicbert": (12, 30528), "gte-multilingual-base": (12, 250048),
                "jina-v3": (24, 250002), "llama-3.2-1b": (16, 128256), "qwen3-0.6b": (28, 151936)}
# The heads a model is built with (build_family's task): masked-LM logits for every position, as
# transformers' *ForMaskedLM trains; a decoder's causal-LM head; the encoder alone; a sequence classifier.
TASKS = {"mlm": "AutoModelForMaskedLM", "causal-lm": "AutoModelForCausalLM", "encoder": "AutoModel",
         "classification": "AutoModelForSequenceClassification"}
# Config classes whose positions count from padding_idx + 1 (RoBERTa's rule): 2 rows of the table unused.
_POSITIONS_AFTER_PADDING = {"MPNetConfig", "RobertaConfig", "XLMRobertaConfig"}


def family_unavailable(family: str) -> Optional[str]:
    """Why ``family`` cannot be built with the installed transformers (its config class is missing:
    GTE's in transformers 5.17, the GPU image's), or None when it can."""
    import transformers

    cls_name = FAMILIES[family][1]
    if getattr(transformers, cls_name, None) is None:
        return f"transformers {transformers.__version__} has no {cls_name}"
    return None


def longest_seq_len(family: str) -> int:
    """The longest s the family's published model takes: its max_position_embeddings (less the two
    rows before padding_idx + 1 where positions start there)."""
    _label, cls_name, fields = FAMILIES[family]
    return fields["max_position_embeddings"] - (2 if cls_name in _POSITIONS_AFTER_PADDING else 0)


def supports_sdpa(family: str) -> bool:
    """Whether transformers' model of ``family`` runs attn_implementation="sdpa" (DeBERTa's does not)."""
    import transformers

    return bool(getattr(transformers.AutoModel._model_mapping[getattr(transformers, FAMILIES[family][1])],
                        "_supports_sdpa", False))


def family_config(family: str, layers: Optional[int] = None, *, vocab: Optional[int] = None,
                  attention: Optional[str] = None) -> Any:
    """transformers' config of ``family`` at its published geometry, with ``layers`` blocks and ``vocab``
    tokens (default: the published depth and vocabulary, ``FAMILY_DEPTH``) and attn_implementation
    ``attention`` (default: transformers' own choice). ValueError naming the family when it is not in
    ``FAMILIES`` or the installed transformers lacks its config class."""
    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; valid: {', '.join(FAMILIES)}")
    import transformers

    why = family_unavailable(family)
    if why is not None:
        raise ValueError(f"family {family!r} ({FAMILIES[family][0]}) cannot be built: {why}")
    _label, cls_name, fields = FAMILIES[family]
    depth, published_vocab = FAMILY_DEPTH[family]
    extra = {} if attention is None else {"attn_implementation": attention}
    return getattr(transformers, cls_name)(vocab_size=published_vocab if vocab is None else vocab,
                                           num_hidden_layers=depth if layers is None else layers, **fields, **extra)


def build_family(family: str, task: str = "mlm", layers: Optional[int] = None,
                 attention: Optional[str] = None) -> torch.nn.Module:
    """transformers' model of ``family`` with the head ``task`` (a key of ``TASKS``) at its published
    depth (or ``layers``) and vocabulary, on the meta device; ``attention``: its attn_implementation
    (default: transformers'). ValueError as ``family_config``, or for an unknown task."""
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; valid: {', '.join(TASKS)}")
    return model_on_meta(family_config(family, layers, attention=attention), task, family)


def local_config(path: str) -> Any:
    """transformers' config from a local config.json or a model folder holding one (never a
    download). ValueError naming the path when there is none or transformers cannot read it."""
    import transformers
    from pathlib import Path

    folder = Path(path)
    if folder.is_file():
        if folder.name != "config.json":
            raise ValueError(f"{path}: a model's config must be a file named config.json (or its folder)")
        folder = folder.parent
    if not (folder / "config.json").is_file():
        raise ValueError(f"{path}: no config.json there (a preset name, a config.json or a model folder)")
    try:
        return transformers.AutoConfig.from_pretrained(str(folder), local_files_only=True)
    except (ValueError, KeyError, OSError) as err:
        raise ValueError(f"{folder / 'config.json'}: transformers cannot read it: {str(err).splitlines()[0]}") from None


def model_on_meta(config: Any, task: str, name: str) -> torch.nn.Module:
    """transformers' model of ``config`` with the head ``task`` on the meta device. ValueError in one
    line when transformers has no such head for this kind of model (a decoder's masked LM)."""
    import transformers

    auto = getattr(transformers, TASKS[task])
    if type(config) not in auto._model_mapping:
        causal = type(config) in transformers.AutoModelForCausalLM._model_mapping
        hint = "; a decoder: --task causal-lm" if causal and task != "causal-lm" else ""
        raise ValueError(f"{name} ({type(config).__name__}) has no {task} head in transformers "
                         f"{transformers.__version__}{hint}")
    with torch.device("meta"):
        return auto.from_config(config)


def hf_bert_config(ours: Any, layers: Optional[int] = None, attention: str = "eager") -> Any:
    """transformers' BertConfig at the sizes of one of Tempo's own BERT configs (``ours``, a
    ``tempo.bert.config.BertConfig``: every field carries over, its names are transformers'), with
    ``layers`` blocks (default its own) and attn_implementation ``attention``: the stock model Tempo's
    BERT is measured against."""
    import transformers

    fields = ours.to_dict()
    if layers is not None:
        fields["num_hidden_layers"] = layers
    return transformers.BertConfig(**fields, attn_implementation=attention)


def default_max_predictions(seq_len: int) -> int:
    """Masked positions per sequence of BERT pretraining: 15% of the tokens rounded up to a multiple
    of 4, DLE's 20 at s=128 and 80 at s=512."""
    return min(seq_len, 4 * math.ceil(0.15 * seq_len / 4))


__all__ = ["FAMILIES", "FAMILY_DEPTH", "TASKS", "build_family", "default_max_predictions", "family_config",
           "family_unavailable", "hf_bert_config", "local_config", "longest_seq_len", "model_on_meta", "supports_sdpa"]
