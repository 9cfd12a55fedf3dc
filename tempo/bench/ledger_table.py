"""The activation-ledger table: bytes kept for backward per token per BERT encoder layer, in units of h.

``python -m tempo.memory`` (and ``tempo-ledger``) print it. It builds BERT layers, so it lives on the
benchmark side; ``tempo.memory`` itself only counts.
"""

from __future__ import annotations

import argparse
from typing import Any

import torch

from tempo.choices import TempoChoice
from tempo.memory import ActivationLedger, marginal_bytes_per_token, saved_bytes


# -- the table the README and the issue quote ----------------------------------------------
LEDGER_VARIANTS = ("original", "tempo", "original+sdpa", "tempo+sdpa", "tempo-floor")


def bert_layer_ledger(variant: str, seq_len: int, batch: int, dtype: torch.dtype, device: str,
                      config_name: str = "bert_large") -> ActivationLedger:
    """Ledger of one post-LN encoder layer's forward in training mode (dropout on)."""
    from tempo.bert.config import BertConfig
    from tempo.bert.model import BertLayer, additive_attention_mask

    config = BertConfig.from_name(config_name)
    if variant.startswith("hf-"):
        return _hf_layer_ledger(variant[3:], config, seq_len, batch, dtype, device)
    options = {
        "original": TempoChoice.original(attention="eager"),
        "tempo": TempoChoice.paper(),
        "original+sdpa": TempoChoice.original(attention="sdpa"),
        "tempo+sdpa": TempoChoice.full(attention="sdpa"),
        # every Tempo layer, efficient attention and the fused dropout-add-LayerNorm
        "tempo-floor": TempoChoice.floor(),
    }[variant]
    torch.manual_seed(0)
    layer = BertLayer(config, options).to(device).train()
    # The layer's input is the previous layer's LayerNorm output: fp32 from nn.LayerNorm under
    # autocast, the autocast dtype from InplaceLayerNorm. Feed each variant what it would get.
    input_dtype = dtype if options.layernorm else torch.float32
    hidden = torch.randn(batch, seq_len, config.hidden_size, device=device, dtype=input_dtype,
                         requires_grad=True)
    # The additive mask as the model builds it: in the compute dtype, so it does not promote
    # bf16 scores to fp32 (no padding here).
    mask = additive_attention_mask(torch.ones(batch, seq_len, device=device),
                                   dtype if dtype != torch.float32 else torch.float32)
    if options.attention == "efficient":
        mask = None  # no padding: the model passes no mask (see BertModel.forward)

    def forward() -> None:
        with torch.autocast(device_type=device, dtype=dtype, enabled=dtype != torch.float32):
            layer(hidden, mask)

    return saved_bytes(forward, model=layer)


def _hf_layer_ledger(attn_impl: str, config: Any, seq_len: int, batch: int, dtype: torch.dtype,
                     device: str) -> ActivationLedger:
    """The same layer as HF transformers builds it (what most users train today)."""
    from transformers import BertConfig as HFBertConfig
    from transformers.models.bert.modeling_bert import BertLayer as HFBertLayer

    hf_config = HFBertConfig(hidden_size=config.hidden_size, num_attention_heads=config.num_attention_heads,
                             intermediate_size=config.intermediate_size, attn_implementation=attn_impl)
    torch.manual_seed(0)
    layer = HFBertLayer(hf_config).to(device).train()
    hidden = torch.randn(batch, seq_len, config.hidden_size, device=device, requires_grad=True)

    def forward() -> None:
        with torch.autocast(device_type=device, dtype=dtype, enabled=dtype != torch.float32):
            layer(hidden)

    return saved_bytes(forward, model=layer)


# -- per added layer in a stack (what a deeper model pays per layer) --------------------------
STACK_VARIANTS = ("original", "tempo", "tempo-floor", "hf-eager", "hf-tempo-paper", "hf-tempo-floor")
_STACK_CHOICES = {"original": TempoChoice.original(attention="eager"), "tempo": TempoChoice.paper(),
                  "tempo-floor": TempoChoice.floor()}
# apply_tempo's arguments per HF column, each written out: a column keeps meaning what its header says
# whatever apply_tempo's default is (today the floor, TempoChoice.default()).
_HF_APPLY = {"hf-tempo-paper": dict(gelu=True, layernorm=True, attention="tempo", dropout_add_layernorm=False),
             "hf-tempo-floor": dict(gelu=True, layernorm=True, attention="efficient", dropout_add_layernorm=True)}


def _stack_model(variant: str, layers: int, config: Any, device: str) -> tuple[Any, Any]:
    """(model, forward(ids)) for ``layers`` encoder layers: ours with a TempoChoice, or HF's BertModel
    (hf-eager as transformers builds it, hf-tempo-paper after apply_tempo with the paper's three
    layers, hf-tempo-floor after apply_tempo with every layer and the efficient attention, which is
    apply_tempo(model)'s default)."""
    torch.manual_seed(0)
    if variant.startswith("hf-"):
        import transformers

        from tempo.integrations.patch import apply_tempo

        hf_config = transformers.BertConfig(
            vocab_size=config.vocab_size, hidden_size=config.hidden_size, num_hidden_layers=layers,
            num_attention_heads=config.num_attention_heads, intermediate_size=config.intermediate_size,
            max_position_embeddings=config.max_position_embeddings, attn_implementation="eager")
        model = transformers.BertModel(hf_config, add_pooling_layer=False).to(device).train()
        if variant in _HF_APPLY:
            apply_tempo(model, **_HF_APPLY[variant])
        return model, lambda ids: model(input_ids=ids)
    from dataclasses import replace

    from tempo.bert.model import BertModel

    model = BertModel(replace(config, num_hidden_layers=layers), _STACK_CHOICES[variant],
                      add_pooling_layer=False).to(device).train()
    return model, lambda ids: model(ids)


def bytes_per_added_layer(variant: str, seq_len: int, dtype: torch.dtype, device: str,
                          config_name: str = "bert_large") -> float:
    """Bytes kept for backward per token by one more encoder layer in a stack:
    [bytes(2 layers) - bytes(1 layer)] at batch 2 minus the same at batch 1, so both the layer
    below's output (kept by the layer above) is counted once and autocast's fixed bf16 weight
    copies drop out."""
    from tempo.bert.config import BertConfig

    config = BertConfig.from_name(config_name)
    kept = {}
    for layers in (1, 2):
        model, forward = _stack_model(variant, layers, config, device)
        for batch in (1, 2):
            ids = torch.randint(0, config.vocab_size, (batch, seq_len), device=device)
            with ActivationLedger(model) as ledger, torch.autocast(device_type=device, dtype=dtype,
                                                                   enabled=dtype != torch.float32):
                forward(ids)
            kept[layers, batch] = ledger.activation_bytes
    return (kept[2, 2] - kept[2, 1] - kept[1, 2] + kept[1, 1]) / seq_len


def stack_table(seq_lens=(128, 512), variants=STACK_VARIANTS, dtype: torch.dtype = torch.bfloat16,
                device: str = "cpu", config_name: str = "bert_large") -> list[dict[str, Any]]:
    from tempo.bert.config import BertConfig

    hidden = BertConfig.from_name(config_name).hidden_size
    return [{"seq_len": s, **{v: bytes_per_added_layer(v, s, dtype, device, config_name) / hidden
                               for v in variants}} for s in seq_lens]


def _transformers_available() -> bool:
    try:
        import transformers  # noqa: F401
    except ImportError:
        return False
    return True


def ledger_table(seq_lens=(128, 512), variants=LEDGER_VARIANTS, dtype: torch.dtype = torch.bfloat16,
                 device: str = "cpu", hidden: int = 1024) -> list[dict[str, Any]]:
    """Rows of marginal bytes kept per token per BERT-large encoder layer, in units of h."""
    rows = []
    for seq_len in seq_lens:
        row: dict[str, Any] = {"seq_len": seq_len}
        for variant in variants:
            per_token, _fixed = marginal_bytes_per_token(
                lambda b: bert_layer_ledger(variant, seq_len, b, dtype, device), seq_len)
            row[variant] = per_token / hidden
        rows.append(row)
    return rows


def format_table(rows: list[dict[str, Any]]) -> str:
    variants = [k for k in rows[0] if k != "seq_len"]
    header = "| s | " + " | ".join(variants) + " | Tempo saves |"
    lines = [header, "|" + "---|" * (len(variants) + 2)]
    for row in rows:
        best = min(row[v] for v in variants if v.startswith("tempo")) if any(
            v.startswith("tempo") for v in variants) else float("nan")
        saving = 1 - best / row["original"] if "original" in row else float("nan")
        cells = " | ".join(f"{row[v]:.1f} h" for v in variants)
        lines.append(f"| {row['seq_len']} | {cells} | {saving:.0%} |")
    return "\n".join(lines)


# transformers families at their published sizes (random weights: the ledger counts storages, not
# values): config class and fields. ModernBERT's second layer is a sliding-window one (global every 3).
FAMILIES = {
    "MiniLM-L6 (BERT, h=384)": ("BertConfig", dict(hidden_size=384, num_attention_heads=12, intermediate_size=1536)),
    "DeBERTa-v3-large (h=1024)": ("DebertaV2Config", dict(
        hidden_size=1024, num_attention_heads=16, intermediate_size=4096, relative_attention=True,
        pos_att_type=["p2c", "c2p"], position_buckets=256, max_relative_positions=-1, norm_rel_ebd="layer_norm",
        share_att_key=True, max_position_embeddings=512, position_biased_input=False)),
    "ModernBERT-large (h=1024, I=2624)": ("ModernBertConfig", dict(
        hidden_size=1024, num_attention_heads=16, intermediate_size=2624, global_attn_every_n_layers=3,
        local_attention=128, pad_token_id=0, bos_token_id=1, eos_token_id=2, cls_token_id=1, sep_token_id=2)),
}


def _family_bytes_per_added_layer(family: str, seq_len: int, patched: bool, dtype: torch.dtype,
                                  device: str) -> float:
    """As bytes_per_added_layer, for transformers' model of ``family`` (eager attention), before or
    after apply_tempo(model) (the default: every layer kind the family has)."""
    import transformers

    from tempo.integrations.patch import apply_tempo

    cls_name, fields = FAMILIES[family]
    kept = {}
    for layers in (1, 2):
        torch.manual_seed(0)
        config = getattr(transformers, cls_name)(vocab_size=1000, num_hidden_layers=layers,
                                                 attn_implementation="eager", **fields)
        model = transformers.AutoModel.from_config(config).to(device).train()
        if patched:
            apply_tempo(model)
        for batch in (1, 2):
            ids = torch.randint(3, 1000, (batch, seq_len), device=device)
            with ActivationLedger(model) as ledger, torch.autocast(device_type=device, dtype=dtype,
                                                                   enabled=dtype != torch.float32):
                model(input_ids=ids)
            kept[layers, batch] = ledger.activation_bytes
    return (kept[2, 2] - kept[2, 1] - kept[1, 2] + kept[1, 1]) / seq_len


def family_table(seq_lens=(128, 512), dtype: torch.dtype = torch.bfloat16, device: str = "cpu") -> str:
    """Per added layer, units of the family's h: transformers' model before and after apply_tempo."""
    lines = ["| model | s | before apply_tempo | after apply_tempo(model) | saved |", "|---|---|---|---|---|"]
    for family, (_, fields) in FAMILIES.items():
        h = fields["hidden_size"]
        for s in seq_lens:
            before = _family_bytes_per_added_layer(family, s, False, dtype, device) / h
            after = _family_bytes_per_added_layer(family, s, True, dtype, device) / h
            lines.append(f"| {family} | {s} | {before:.1f} h | {after:.1f} h | {1 - after / before:.0%} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tempo.memory",
        description="Bytes autograd keeps for backward per token per BERT-large encoder layer (units of h).",
    )
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[128, 512])
    parser.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16",
                        help="autocast dtype (fp32 = no autocast)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--no-hf", action="store_true", help="skip the HF transformers BertLayer column")
    parser.add_argument("--no-stack", action="store_true", help="skip the per-added-layer (stack) table")
    parser.add_argument("--no-families", action="store_true",
                        help="skip the MiniLM / DeBERTa-v3-large / ModernBERT-large table")
    args = parser.parse_args(argv)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    if args.device == "cpu" and dtype == torch.float16:
        parser.error("--dtype fp16 autocast needs --device cuda")
    variants = LEDGER_VARIANTS + (("hf-eager",) if _transformers_available() and not args.no_hf else ())
    rows = ledger_table(tuple(args.seq_lens), variants=variants, dtype=dtype, device=args.device)
    print(f"Activation ledger: one BERT-large post-LN encoder layer (h=1024, 16 heads, dropout 0.1), "
          f"{args.dtype} autocast.\nBytes kept for backward per token (marginal: batch 2 minus batch 1, "
          f"so autocast's fixed weight copies are excluded), in units of h = 1024 bytes")
    print(format_table(rows))
    if not args.no_stack:
        stack_variants = tuple(v for v in STACK_VARIANTS
                               if not v.startswith("hf-") or (_transformers_available() and not args.no_hf))
        stack = stack_table(tuple(args.seq_lens), variants=stack_variants, dtype=dtype, device=args.device)
        print("\nPer added layer in a stack (BertModel of 2 layers minus 1 layer, batch 2 minus batch 1; the\n"
              "layer's input is counted once, where the layer above keeps it), units of h:")
        print(format_table(stack))
    if _transformers_available() and not args.no_hf and not args.no_families:
        print("\nOther encoders (transformers' models with eager attention, per added layer, units of each "
              "model's h;\ndropout as each family ships: BERT/DeBERTa 0.1, ModernBERT 0):")
        print(family_table(tuple(args.seq_lens), dtype=dtype, device=args.device))
    if args.device == "cpu":
        print("On the CPU, scaled_dot_product_attention runs PyTorch's math fallback, which keeps the whole\n"
              "attention matrix; on a GPU its flash/memory-efficient kernels keep O(s) per row instead.")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
