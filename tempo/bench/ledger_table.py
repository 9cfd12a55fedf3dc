"""The activation-ledger tables: bytes kept for backward per token per encoder layer, in units of h.

``python -m tempo.memory`` (and ``tempo-ledger``) print three tables:

1. one BERT-large encoder layer alone, per layer choice (and transformers' ``BertLayer``);
2. per added layer in a stack (a model of 2 layers minus 1 layer), ours and transformers'
   ``BertModel`` before and after ``apply_tempo``: the figure that decides how large a batch fits;
3. transformers' model of every family in ``FAMILIES`` (BERT, DeBERTa-v3, ModernBERT, MPNet, EuroBERT,
   EmbeddingGemma, NomicBERT, GTE, Jina-v3, Llama, Qwen3) before and after ``apply_tempo(model)``, with
   what it swaps per layer, and the largest batch of each whole model in a budget (needs the ``hf``
   extra; without it the HF columns and these tables are left out, said in one line; a family whose
   config class the installed transformers lacks, or an s longer than its position table, is left out
   by name in that line too).

The bytes a forward keeps depend on shapes, dtypes and the code path, not on values, so on the CPU
they are counted on fake tensors (``tempo.memory.fake``): the whole command takes about two minutes
on 2 CPU cores (every family at its published size) and about a gigabyte. ``--real`` counts them on
real tensors instead (minutes and gigabytes at BERT-large size, the same numbers;
``tests/test_memory.py`` holds every table's fake count to the real one), and so does
``--device cuda``, where CUDA's dropout keeps 1-byte masks. Models are built from their configs
(random weights at each model's published size) and patched by the live ``apply_tempo``: no number
here is stored.

It builds models, so it lives on the benchmark side; ``tempo.memory`` itself only counts.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import sys
from typing import Any, Callable, Iterable, Optional

import torch

from tempo.choices import TempoChoice
from tempo.memory import ActivationLedger

Tick = Optional[Callable[[], None]]

# -- column names: the README's tables use these headers ---------------------------------------
COLUMNS = {
    "original": "original",
    "tempo": "Tempo (paper's 3 layers)",
    "original+sdpa": "original + sdpa",
    "tempo+sdpa": "Tempo GELU + LayerNorm, sdpa",
    "tempo-floor": "Tempo (all layers)",
    "hf-eager": "HF eager",
    "hf-sdpa": "HF sdpa",
    "hf-tempo-paper": "HF + apply_tempo (paper's 3)",
    "hf-tempo-floor": "HF + apply_tempo (all layers)",
}
SAVED_COLUMN = "Tempo (all layers) saves"
FAMILY_COLUMNS = ("model", "s", "HF eager", "HF + apply_tempo(model)", "saved", "apply_tempo swaps, per added layer")

# -- the table the README and the issue quote ----------------------------------------------
LEDGER_VARIANTS = ("original", "tempo", "original+sdpa", "tempo+sdpa", "tempo-floor")
_LAYER_CHOICES = {
    "original": lambda: TempoChoice.original(attention="eager"),
    "tempo": TempoChoice.paper,
    "original+sdpa": lambda: TempoChoice.original(attention="sdpa"),
    "tempo+sdpa": lambda: TempoChoice.full(attention="sdpa"),
    # every Tempo layer, efficient attention and the fused dropout-add-LayerNorm
    "tempo-floor": TempoChoice.floor,
}


def _autocast(dtype: torch.dtype, device: str) -> contextlib.AbstractContextManager:
    return torch.autocast(device_type=device, dtype=dtype, enabled=dtype != torch.float32)


def _use_fake(fake: Optional[bool], device: str) -> bool:
    """Fake tensors by default on the CPU; real ones elsewhere (CUDA keeps other bytes: bool masks)."""
    if fake is None:
        return device == "cpu"
    if fake and device != "cpu":
        raise ValueError(f"the fake-tensor count follows the CPU's code paths; device {device!r} needs fake=False")
    return fake


class _Builder:
    """Builds a module and its inputs either for real (seeded, on ``device``) or as fake CPU tensors,
    and runs a forward under a ledger: the one place the two ways differ."""

    def __init__(self, fake: bool, device: str):
        self.fake, self.device = fake, device
        if fake:
            from tempo.memory.fake import FakeSession

            self.session = FakeSession()

    def module(self, factory: Callable[[], torch.nn.Module],
               prepare: Optional[Callable[[torch.nn.Module], Any]] = None) -> torch.nn.Module:
        if self.fake:
            return self.session.module(lambda: factory().train(), prepare)
        torch.manual_seed(0)
        model = factory().to(self.device).train()
        if prepare is not None:
            prepare(model)
        return model

    def tensor(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """An input that needs grad (the layer below's output)."""
        if self.fake:
            return self.session.tensor(shape, dtype, requires_grad=True)
        return torch.randn(*shape, device=self.device, dtype=dtype, requires_grad=True)

    def ledger(self, model: torch.nn.Module, forward: Callable[[], Any], dtype: torch.dtype) -> ActivationLedger:
        if self.fake:
            with self.session.ledger(model) as ledger, _autocast(dtype, "cpu"):
                forward()
            return ledger
        with ActivationLedger(model) as ledger, _autocast(dtype, self.device):
            forward()
        return ledger


def bert_layer_ledger(variant: str, seq_len: int, batch: int, dtype: torch.dtype, device: str,
                      config_name: str = "bert_large", fake: Optional[bool] = None) -> ActivationLedger:
    """Ledger of one post-LN encoder layer's forward in training mode (dropout on). ``fake``: count on
    fake tensors (the default on the CPU: same bytes, no compute); ``hf-eager``/``hf-sdpa``:
    transformers' ``BertLayer``."""
    from tempo.bert.config import BertConfig
    from tempo.bert.model import BertLayer, additive_attention_mask

    config = BertConfig.from_name(config_name)
    build = _Builder(_use_fake(fake, device), device)
    if variant.startswith("hf-"):
        return _hf_layer_ledger(variant[3:], config, seq_len, batch, dtype, build)
    options = _LAYER_CHOICES[variant]()
    layer = build.module(lambda: BertLayer(config, options))
    # The layer's input is the previous layer's LayerNorm output: fp32 from nn.LayerNorm under
    # autocast, the autocast dtype from InplaceLayerNorm. Feed each variant what it would get.
    input_dtype = dtype if options.layernorm else torch.float32
    hidden = build.tensor((batch, seq_len, config.hidden_size), input_dtype)
    # The additive mask as the model builds it: in the compute dtype, so it does not promote
    # bf16 scores to fp32 (no padding here).
    mask = additive_attention_mask(torch.ones(batch, seq_len, device=device),
                                   dtype if dtype != torch.float32 else torch.float32)
    if options.attention == "efficient":
        mask = None  # no padding: the model passes no mask (see BertModel.forward)
    return build.ledger(layer, lambda: layer(hidden, mask), dtype)


def _hf_layer_ledger(attn_impl: str, config: Any, seq_len: int, batch: int, dtype: torch.dtype,
                     build: _Builder) -> ActivationLedger:
    """The same layer as HF transformers builds it (what most users train today)."""
    from transformers import BertConfig as HFBertConfig
    from transformers.models.bert.modeling_bert import BertLayer as HFBertLayer

    hf_config = HFBertConfig(hidden_size=config.hidden_size, num_attention_heads=config.num_attention_heads,
                             intermediate_size=config.intermediate_size, attn_implementation=attn_impl)
    layer = build.module(lambda: HFBertLayer(hf_config))
    hidden = build.tensor((batch, seq_len, config.hidden_size), torch.float32)
    return build.ledger(layer, lambda: layer(hidden), dtype)


def _marginal_per_token(kept: Callable[[int], int], seq_len: int) -> float:
    """Bytes per token a batch of one more sequence keeps: kept(2) - kept(1), per token. The bytes are
    linear in the batch for a fixed s (every kept tensor has the batch, or the token count, as one
    factor), and autocast's fixed low-precision weight copies cancel in the difference."""
    return (kept(2) - kept(1)) / seq_len


# -- per added layer in a stack (what a deeper model pays per layer) --------------------------
STACK_VARIANTS = ("original", "tempo", "tempo-floor", "hf-eager", "hf-tempo-paper", "hf-tempo-floor")
_STACK_CHOICES = {"original": lambda: TempoChoice.original(attention="eager"), "tempo": TempoChoice.paper,
                  "tempo-floor": TempoChoice.floor}
# apply_tempo's arguments per HF column, each written out: a column keeps meaning what its header says
# whatever apply_tempo's default is (today the floor, TempoChoice.default()).
_HF_APPLY = {"hf-tempo-paper": dict(gelu=True, layernorm=True, attention="tempo", dropout_add_layernorm=False),
             "hf-tempo-floor": dict(gelu=True, layernorm=True, attention="efficient", dropout_add_layernorm=True)}


def _stack_model(variant: str, layers: int, config: Any, build: _Builder) -> tuple[Any, Any]:
    """(model, forward(ids)) for ``layers`` encoder layers: ours with a TempoChoice, or HF's BertModel
    (hf-eager as transformers builds it, hf-tempo-paper after apply_tempo with the paper's three
    layers, hf-tempo-floor after apply_tempo with every layer and the efficient attention, which is
    apply_tempo(model)'s default)."""
    if variant.startswith("hf-"):
        import transformers

        from tempo.integrations.patch import apply_tempo

        hf_config = transformers.BertConfig(
            vocab_size=config.vocab_size, hidden_size=config.hidden_size, num_hidden_layers=layers,
            num_attention_heads=config.num_attention_heads, intermediate_size=config.intermediate_size,
            max_position_embeddings=config.max_position_embeddings, attn_implementation="eager")
        prepare = (lambda m: apply_tempo(m, **_HF_APPLY[variant])) if variant in _HF_APPLY else None
        model = build.module(lambda: transformers.BertModel(hf_config, add_pooling_layer=False), prepare)
        return model, lambda ids: model(input_ids=ids)
    from dataclasses import replace

    from tempo.bert.model import BertModel

    choice = _STACK_CHOICES[variant]()
    model = build.module(lambda: BertModel(replace(config, num_hidden_layers=layers), choice, add_pooling_layer=False))
    return model, lambda ids: model(ids)


def _added_layer(kept: Callable[[int, int], int], seq_len: int) -> float:
    """[kept(2 layers) - kept(1 layer)] at batch 2 minus the same at batch 1, per token: the layer
    below's output (kept by the layer above) counts once, autocast's weight copies drop out."""
    return (kept(2, 2) - kept(2, 1) - kept(1, 2) + kept(1, 1)) / seq_len


def bytes_per_added_layer(variant: str, seq_len: int, dtype: torch.dtype, device: str,
                          config_name: str = "bert_large", fake: Optional[bool] = None) -> float:
    """Bytes kept for backward per token by one more encoder layer in a stack (``_added_layer``)."""
    from tempo.bert.config import BertConfig

    config = BertConfig.from_name(config_name)
    build = _Builder(_use_fake(fake, device), device)
    models = {layers: _stack_model(variant, layers, config, build) for layers in (1, 2)}

    def kept(layers: int, batch: int) -> int:
        model, forward = models[layers]
        ids = torch.randint(0, config.vocab_size, (batch, seq_len), device=device)
        return build.ledger(model, lambda: forward(ids), dtype).activation_bytes

    return _added_layer(kept, seq_len)


def stack_table(seq_lens=(128, 512), variants=STACK_VARIANTS, dtype: torch.dtype = torch.bfloat16,
                device: str = "cpu", config_name: str = "bert_large", fake: Optional[bool] = None,
                tick: Tick = None) -> list[dict[str, Any]]:
    from tempo.bert.config import BertConfig

    hidden = BertConfig.from_name(config_name).hidden_size
    rows = []
    for s in seq_lens:
        row: dict[str, Any] = {"seq_len": s}
        for v in variants:
            row[v] = bytes_per_added_layer(v, s, dtype, device, config_name, fake) / hidden
            if tick:
                tick()
        rows.append(row)
    return rows


def _transformers_available() -> bool:
    """Whether the ``hf`` extra is installed (checked without importing it: that takes seconds)."""
    try:
        return importlib.util.find_spec("transformers") is not None
    except (ImportError, ValueError):
        return False


def ledger_table(seq_lens=(128, 512), variants=LEDGER_VARIANTS, dtype: torch.dtype = torch.bfloat16,
                 device: str = "cpu", hidden: int = 1024, fake: Optional[bool] = None,
                 config_name: str = "bert_large", tick: Tick = None) -> list[dict[str, Any]]:
    """Rows of marginal bytes kept per token per BERT-large encoder layer, in units of h."""
    rows = []
    for seq_len in seq_lens:
        row: dict[str, Any] = {"seq_len": seq_len}
        for variant in variants:
            per_token = _marginal_per_token(
                lambda b: bert_layer_ledger(variant, seq_len, b, dtype, device, config_name, fake).activation_bytes,
                seq_len)
            row[variant] = per_token / hidden
            if tick:
                tick()
        rows.append(row)
    return rows


def format_table(rows: list[dict[str, Any]]) -> str:
    """Markdown, headers from COLUMNS, plus what every Tempo layer saves against the original."""
    variants = [k for k in rows[0] if k != "seq_len"]
    saves = "original" in variants and "tempo-floor" in variants
    header = "| s | " + " | ".join(COLUMNS.get(v, v) for v in variants) + (f" | {SAVED_COLUMN} |" if saves else " |")
    lines = [header, "|" + "---|" * (len(variants) + 1 + saves)]
    for row in rows:
        cells = " | ".join(f"{row[v]:.1f} h" for v in variants)
        saving = f" | {1 - row['tempo-floor'] / row['original']:.0%} |" if saves else " |"
        lines.append(f"| {row['seq_len']} | {cells}{saving}")
    return "\n".join(lines)


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
        max_position_embeddings=131072)),
    # Qwen/Qwen3-0.6B: RMSNorm with q/k norms, SwiGLU, 16 heads of 128 over 8 kv heads.
    "qwen3-0.6b": ("Qwen3-0.6B (h=1024)", "Qwen3Config", dict(
        hidden_size=1024, num_attention_heads=16, num_key_value_heads=8, head_dim=128, intermediate_size=3072,
        max_position_embeddings=40960)),
}
MAX_SEQ_LEN = 512  # BERT-large's position table: the lone-layer and stack tables' longest s
# The command's longest s: the families' tables are counted on fake tensors, but masks made from real
# position ranges are real s x s tensors (tempo.memory.fake), so s stays where those are megabytes.
MAX_FAMILY_SEQ_LEN = 8192
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


def family_config(family: str, layers: int, vocab: int = 1000) -> Any:
    """transformers' config of ``family`` at its published geometry with ``layers`` layers, eager
    attention. ValueError naming the family when the installed transformers lacks its class."""
    import transformers

    why = family_unavailable(family)
    if why is not None:
        raise ValueError(f"family {family!r} ({FAMILIES[family][0]}) cannot be built: {why}")
    _label, cls_name, fields = FAMILIES[family]
    return getattr(transformers, cls_name)(vocab_size=vocab, num_hidden_layers=layers, attn_implementation="eager",
                                           **fields)


def _check_family_seq_len(family: str, seq_len: int) -> None:
    if seq_len > longest_seq_len(family):
        raise ValueError(f"family {family!r} takes sequences of at most {longest_seq_len(family)} tokens "
                         f"(its max_position_embeddings), got seq_len {seq_len}")


def swaps_per_added_layer(one_layer: torch.nn.Module, two_layers: torch.nn.Module) -> dict[str, int]:
    """What apply_tempo swapped or switched in one more layer (``tempo_patched`` and ``tempo_switched``
    of 2 layers minus 1 layer), and
    "attention": 1 when the attention runs Tempo's (switched in the config, or a module replaced)."""
    from tempo.integrations.patch import tempo_patched, tempo_switched

    one = {**tempo_patched(one_layer), **tempo_switched(one_layer)}
    two = {**tempo_patched(two_layers), **tempo_switched(two_layers)}
    swaps = {kind: two[kind] - one.get(kind, 0) for kind in two if kind != "attention" and two[kind] > one.get(kind, 0)}
    swaps["attention"] = two["attention"]
    return swaps


def format_swaps(swaps: dict[str, int]) -> str:
    """'2 InplaceRMSNorm, GatedMLP, Tempo attention': the kinds of one added layer, most first."""
    parts = [f"{n} {kind}" if n > 1 else kind for kind, n in sorted(swaps.items(), key=lambda kv: (-kv[1], kv[0]))
             if kind != "attention"]
    if swaps.get("attention"):
        parts.append("attention (config switch)")
    return ", ".join(parts) or "nothing"


def _family_added_layer(family: str, seq_len: int, patched: bool, dtype: torch.dtype, device: str,
                        fake: Optional[bool] = None) -> tuple[float, Optional[dict[str, int]]]:
    """As bytes_per_added_layer, for transformers' model of ``family`` (eager attention), before or
    after apply_tempo(model) (the default: every layer kind the family has); with what apply_tempo
    swapped per added layer (None before)."""
    import transformers

    from tempo.integrations.patch import apply_tempo

    _check_family_seq_len(family, seq_len)
    build = _Builder(_use_fake(fake, device), device)
    models = {}
    for layers in (1, 2):
        config = family_config(family, layers)
        models[layers] = build.module(lambda: transformers.AutoModel.from_config(config),
                                      apply_tempo if patched else None)

    def kept(layers: int, batch: int) -> int:
        model = models[layers]
        ids = torch.randint(3, 1000, (batch, seq_len), device=device)
        return build.ledger(model, lambda: model(input_ids=ids), dtype).activation_bytes

    return _added_layer(kept, seq_len), swaps_per_added_layer(models[1], models[2]) if patched else None


def family_rows(seq_lens=(128, 512), families: Iterable[str] = tuple(FAMILIES), dtype: torch.dtype = torch.bfloat16,
                device: str = "cpu", fake: Optional[bool] = None, tick: Tick = None) -> list[dict[str, Any]]:
    """Per added layer, units of the family's h: transformers' model before and after apply_tempo,
    and what apply_tempo swapped in it ("swaps"). Every family must be buildable here and take every
    s (``family_unavailable``, ``longest_seq_len``): ValueError otherwise."""
    rows = []
    for family in families:
        h = FAMILIES[family][2]["hidden_size"]
        for s in seq_lens:
            row: dict[str, Any] = {"family": family, "seq_len": s}
            for patched in (False, True):
                per_token, swaps = _family_added_layer(family, s, patched, dtype, device, fake)
                row["after" if patched else "before"] = per_token / h
                if patched:
                    row["swaps"] = swaps
                if tick:
                    tick()
            rows.append(row)
    return rows


def format_family_table(rows: list[dict[str, Any]]) -> str:
    lines = ["| " + " | ".join(FAMILY_COLUMNS) + " |", "|" + "---|" * len(FAMILY_COLUMNS)]
    for r in rows:
        lines.append(f"| {FAMILIES[r['family']][0]} | {r['seq_len']} | {r['before']:.1f} h | {r['after']:.1f} h | "
                     f"{1 - r['after'] / r['before']:.0%} | {format_swaps(r['swaps'])} |")
    return "\n".join(lines)


def family_table(seq_lens=(128, 512), dtype: torch.dtype = torch.bfloat16, device: str = "cpu",
                 families: Iterable[str] = tuple(FAMILIES), fake: Optional[bool] = None) -> str:
    return format_family_table(family_rows(seq_lens, families, dtype, device, fake))


# -- the largest batch a budget holds, whole encoders at their published depth -------------------
# (published layers, vocabulary) of each family: the whole encoder (transformers' AutoModel) is counted.
FAMILY_DEPTH = {"bert-large": (24, 30522), "minilm": (6, 30522), "deberta-v3-large": (24, 128100),
                "modernbert-large": (28, 50368), "mpnet-base": (12, 30527), "eurobert-210m": (12, 128256),
                "embeddinggemma-300m": (24, 262144), "nomicbert": (12, 30528), "gte-multilingual-base": (12, 250048),
                "jina-v3": (24, 250002), "llama-3.2-1b": (16, 128256), "qwen3-0.6b": (28, 151936)}
DEFAULT_BUDGET = "24GiB"  # a 24 GB GPU (RTX 3090/4090, L4, A10)
BATCH_COLUMNS = ("model", "layers", "s", "HF eager: kept per sequence", "largest batch",
                 "HF + apply_tempo(model): kept per sequence", "largest batch", "Tempo / stock")


def family_batch_rows(budget: int, seq_len: int = 512, families: Iterable[str] = tuple(FAMILIES),
                      dtype: torch.dtype = torch.bfloat16, device: str = "cpu", fake: Optional[bool] = None,
                      tick: Tick = None) -> list[dict[str, Any]]:
    """Per family, the whole encoder at its published depth before and after apply_tempo(model): the
    bytes one more sequence keeps (batch 2 minus batch 1, the ledger), the fixed bytes (batch 1 minus
    that: autocast's weight copies, batch-independent position tables) and the largest batch whose
    activations plus fp32 weights, gradients and Adam moments (16 bytes per parameter) fit ``budget``:
    the main job's rule. Allocator caches and workspaces are not counted (a GPU keeps some)."""
    import transformers

    from tempo.integrations.patch import apply_tempo

    rows = []
    for family in families:
        layers, vocab = FAMILY_DEPTH[family]
        _check_family_seq_len(family, seq_len)
        row = {"family": family, "layers": layers, "seq_len": seq_len}
        for patched in (False, True):
            build = _Builder(_use_fake(fake, device), device)
            config = family_config(family, layers, vocab)
            model = build.module(lambda: transformers.AutoModel.from_config(config), apply_tempo if patched else None)
            parameters = sum(p.numel() for p in model.parameters())
            kept = {}
            for batch in (1, 2):
                ids = torch.randint(3, vocab, (batch, seq_len), device=device)
                kept[batch] = build.ledger(model, lambda: model(input_ids=ids), dtype).activation_bytes
            per_sequence = kept[2] - kept[1]
            fixed = kept[1] - per_sequence
            largest = max(0, int((budget - 16 * parameters - fixed) // per_sequence))
            row["after" if patched else "before"] = {"per_sequence": per_sequence, "largest": largest}
            if tick:
                tick()
        rows.append(row)
    return rows


def format_batch_table(rows: list[dict[str, Any]]) -> str:
    from tempo.utils import format_bytes

    lines = ["| " + " | ".join(BATCH_COLUMNS) + " |", "|" + "---|" * len(BATCH_COLUMNS)]
    for r in rows:
        b, a = r["before"], r["after"]
        lines.append(f"| {FAMILIES[r['family']][0]} | {r['layers']} | {r['seq_len']} | "
                     f"{format_bytes(b['per_sequence'])} | {b['largest']} | {format_bytes(a['per_sequence'])} | "
                     f"{a['largest']} | {a['largest'] / max(1, b['largest']):.1f}x |")
    return "\n".join(lines)


# -- the command ----------------------------------------------------------------------------
def _seq_len(text: str) -> int:
    valid = (f"valid: an integer from 1 to {MAX_FAMILY_SEQ_LEN} (the BERT-large tables take up to {MAX_SEQ_LEN}, "
             f"each family up to its position table)")
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a sequence length; {valid}") from None
    if not 1 <= value <= MAX_FAMILY_SEQ_LEN:
        raise argparse.ArgumentTypeError(f"sequence length {value} is out of range; {valid}")
    return value


def _families(parser: argparse.ArgumentParser, names: list[str]) -> list[str]:
    picked = []
    for name in (n.strip().lower() for arg in names for n in arg.split(",")):
        if name not in FAMILIES:
            parser.error(f"--families: unknown family {name!r}; valid: {', '.join(FAMILIES)}")
        if name not in picked:
            picked.append(name)
    if not picked:
        parser.error(f"--families: name at least one of {', '.join(FAMILIES)}")
    return picked


def _progress(total: int) -> Any:
    """A progress bar on stderr for a run that lasts (shown after 2 s, on a terminal only)."""
    from tqdm import tqdm

    return tqdm(total=total, desc="counting", unit="model", file=sys.stderr, delay=2, leave=False,
                disable=None)


def build_parser() -> argparse.ArgumentParser:
    from tempo.utils import positive_size

    parser = argparse.ArgumentParser(
        prog="python -m tempo.memory",
        description="Bytes autograd keeps for backward per token per encoder layer (units of h): one BERT-large "
                    "layer alone, per added layer in a stack, and transformers' models of every family in --families "
                    "before and after apply_tempo(model). Counted on fake tensors on the CPU (exact, about 2 minutes "
                    "for every family on 2 CPU cores); --real counts on real tensors (minutes, gigabytes; the same numbers).",
    )
    parser.add_argument("--seq-lens", type=_seq_len, nargs="+", default=[128, 512], metavar="S",
                        help=f"sequence lengths, 1 to {MAX_FAMILY_SEQ_LEN} (default 128 512); the BERT-large tables "
                             f"take those up to {MAX_SEQ_LEN}, each family those up to its position table")
    parser.add_argument("--batch-seq-len", type=_seq_len, default=MAX_SEQ_LEN, metavar="S",
                        help=f"the sequence length of the largest-batch table (default {MAX_SEQ_LEN})")
    parser.add_argument("--families", nargs="+", default=list(FAMILIES), metavar="NAME",
                        help=f"transformers families for the last table: {', '.join(FAMILIES)} (default all)")
    parser.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16",
                        help="autocast dtype (fp32 = no autocast)")
    parser.add_argument("--device", default="cpu",
                        help="cpu (default: fake tensors); cuda counts real tensors on the GPU (1-byte dropout masks)")
    parser.add_argument("--real", action="store_true",
                        help="count on real tensors (slow: minutes and gigabytes at BERT-large size; same bytes)")
    parser.add_argument("--no-hf", action="store_true", help="leave out transformers' columns and the families table")
    parser.add_argument("--no-stack", action="store_true", help="leave out the per-added-layer (stack) table")
    parser.add_argument("--no-families", action="store_true",
                        help="leave out the transformers families' tables")
    parser.add_argument("--budget", type=positive_size, default=DEFAULT_BUDGET,
                        help=f"memory budget of the largest-batch table (default {DEFAULT_BUDGET}: a 24 GB GPU)")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    families = _families(parser, args.families)
    budget = args.budget
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    if args.device != "cpu" and args.device.split(":")[0] != "cuda":
        parser.error(f"--device {args.device}: unknown device; valid: cpu, cuda, cuda:N")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error(f"--device {args.device}: no CUDA device here; valid: cpu")
    if args.device == "cpu" and dtype == torch.float16:
        parser.error("--dtype fp16 autocast needs --device cuda")
    fake = not args.real and args.device == "cpu"
    seq_lens = tuple(args.seq_lens)
    bert_lens = tuple(s for s in seq_lens if s <= MAX_SEQ_LEN)
    batch_len = args.batch_seq_len

    left_out = []
    hf = not args.no_hf and _transformers_available()
    if not args.no_hf and not hf:
        left_out.append("the HF columns and the transformers families table: transformers is not installed "
                        "(pip install -e \".[hf]\")")
    elif args.no_hf:
        left_out.append("the HF columns and the transformers families table (--no-hf)")
    if len(bert_lens) < len(seq_lens):
        longer = ", ".join(str(s) for s in seq_lens if s > MAX_SEQ_LEN)
        left_out.append(f"s = {longer} in the BERT-large tables (its position table holds {MAX_SEQ_LEN})")
    stack_variants = tuple(v for v in STACK_VARIANTS if hf or not v.startswith("hf-"))
    layer_variants = LEDGER_VARIANTS + (("hf-eager",) if hf else ())
    show_families = hf and not args.no_families
    if hf and args.no_families:
        left_out.append("the transformers families table (--no-families)")
    if args.no_stack:
        left_out.append("the per-added-layer (stack) table (--no-stack)")
    family_lens: dict[str, tuple[int, ...]] = {}
    batch_families: list[str] = []
    if show_families:
        for family in families:
            why = family_unavailable(family)
            if why is not None:  # a family newer than this transformers: said, never dropped silently
                left_out.append(f"{FAMILIES[family][0]}: {why}")
                continue
            family_lens[family] = tuple(s for s in seq_lens if s <= longest_seq_len(family))
            if batch_len <= longest_seq_len(family):
                batch_families.append(family)
        for s in seq_lens:  # one clause per s: the families whose position tables are shorter
            short = [f"{f} ({longest_seq_len(f)})" for f in family_lens if s > longest_seq_len(f)]
            if short:
                left_out.append(f"s = {s} for {', '.join(short)}: longer than their position tables")
        short = [f"{f} ({longest_seq_len(f)})" for f in family_lens if f not in batch_families]
        if short:
            left_out.append(f"the largest-batch table at s = {batch_len} for {', '.join(short)}: longer than their "
                            f"position tables")
    jobs = (len(bert_lens) * (len(layer_variants) + (0 if args.no_stack else len(stack_variants)))
            + 2 * sum(len(lens) for lens in family_lens.values()) + 2 * len(batch_families))

    with _progress(jobs) as bar:
        rows = ledger_table(bert_lens, variants=layer_variants, dtype=dtype, device=args.device, fake=fake,
                            tick=bar.update) if bert_lens else None
        stack = None if args.no_stack or not bert_lens else stack_table(
            bert_lens, variants=stack_variants, dtype=dtype, device=args.device, fake=fake, tick=bar.update)
        fams = [row for family, lens in family_lens.items()
                for row in family_rows(lens, (family,), dtype=dtype, device=args.device, fake=fake, tick=bar.update)]
        batches = family_batch_rows(budget, batch_len, batch_families, dtype=dtype, device=args.device, fake=fake,
                                    tick=bar.update) if batch_families else []

    how = "counted on fake tensors (exact: bytes depend on shapes, not values)" if fake else \
        f"counted on real tensors on {args.device}"
    precision = "fp32 (no autocast)" if dtype == torch.float32 else f"{args.dtype} autocast"
    print(f"Bytes autograd keeps for backward per token, {precision}, dropout 0.1, in units of h "
          f"(the hidden size);\n{how}. Marginal: batch 2 minus batch 1, so autocast's fixed weight copies "
          "are left out.\n")
    if rows is not None:
        print("One BERT-large encoder layer alone (h = 1024, 16 heads):")
        print(format_table(rows))
    if stack is not None:
        print("\nPer added layer in a stack (BertModel of 2 layers minus 1 layer: the layer's input is counted "
              "once,\nwhere the layer below's output is kept), BERT-large, units of h. This decides the batch that "
              "fits:")
        print(format_table(stack))
    if fams:
        print("\ntransformers' models (eager attention, random weights at the published size), per added layer, "
              "units of each\nmodel's h, before and after apply_tempo(model); dropout as each family ships "
              "(BERT/DeBERTa/GTE/Jina 0.1, the others 0):")
        print(format_family_table(fams))
    if batches:
        from tempo.utils import format_bytes

        print(f"\nThe largest batch at s = {batch_len} in {format_bytes(budget)}: each whole encoder at its published depth "
              f"(transformers' AutoModel),\nactivations by the ledger plus fp32 weights, gradients and Adam moments "
              f"(16 bytes per parameter); allocator caches and\nworkspaces are not counted:")
        print(format_batch_table(batches))
    print("\n'original' is nn.GELU, nn.LayerNorm and eager attention; 'Tempo (paper's 3 layers)' In-place GELU, "
          "In-place LayerNorm\nand Combined; 'Tempo (all layers)' adds efficient attention and DropoutAddLayerNorm "
          "(--tempo, apply_tempo's default).")
    if args.device == "cpu":
        print("On the CPU, sdpa runs PyTorch's math fallback, which keeps the whole attention matrix; on a GPU its "
              "flash/memory-efficient\nkernels keep O(s) per row instead.")
    if left_out:
        print("Left out: " + "; ".join(left_out) + ".")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
