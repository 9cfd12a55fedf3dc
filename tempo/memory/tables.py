"""The activation-ledger tables: bytes kept for backward per token per encoder layer, in units of h.

Three tables, which ``python -m tempo.memory`` (``tempo.memory.cli``) prints:

1. one BERT-large encoder layer alone, per layer choice (and transformers' ``BertLayer``):
   ``ledger_table``;
2. per added layer in a stack (a model of 2 layers minus 1 layer), ours and transformers'
   ``BertModel`` before and after ``apply_tempo``, the figure that decides how large a batch fits:
   ``stack_table``;
3. transformers' model of every family in ``tempo.presets.FAMILIES`` before and after
   ``apply_tempo(model)``, with what it swaps per layer (``family_rows``), and the largest batch of
   each whole model in a budget (``family_batch_rows``). These need the ``hf`` extra.

The bytes a forward keeps depend on shapes, dtypes and the code path, not on values, so on the CPU
they are counted on fake tensors (``tempo.memory.fake``); ``fake=False`` counts them on real tensors
instead (the same numbers: ``tests/test_memory.py`` holds every table's fake count to the real one),
and so does a CUDA device, where CUDA's dropout keeps 1-byte masks. Models are built from their
configs (random weights at each model's published size) and patched by the live ``apply_tempo``: no
number here is stored.

Unlike the ledger itself (``tempo.memory``, which only counts), these tables build models: they
import tempo.bert and tempo.integrations, so nothing below those may import this module.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterable, Optional

import torch

from tempo.choices import TempoChoice
from tempo.memory import ActivationLedger
from tempo.presets import FAMILIES, FAMILY_DEPTH, family_config, hf_bert_config, longest_seq_len

Tick = Optional[Callable[[], None]]
# The per-added-layer count's vocabulary: its embedding's size changes no activation, and a small one
# keeps the real-tensor count's models small. Token ids are drawn from [3, SMALL_VOCAB).
SMALL_VOCAB = 1000

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
    from transformers.models.bert.modeling_bert import BertLayer as HFBertLayer

    hf_config = hf_bert_config(config, attention=attn_impl)
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

        hf_config = hf_bert_config(config, layers)
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
        config = family_config(family, layers, vocab=SMALL_VOCAB, attention="eager")
        models[layers] = build.module(lambda: transformers.AutoModel.from_config(config),
                                      apply_tempo if patched else None)

    def kept(layers: int, batch: int) -> int:
        model = models[layers]
        ids = torch.randint(3, SMALL_VOCAB, (batch, seq_len), device=device)
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
            config = family_config(family, layers, vocab=vocab, attention="eager")
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
