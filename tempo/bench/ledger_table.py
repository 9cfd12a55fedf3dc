"""The activation-ledger tables: bytes kept for backward per token per encoder layer, in units of h.

``python -m tempo.memory`` (and ``tempo-ledger``) print three tables:

1. one BERT-large encoder layer alone, per layer choice (and transformers' ``BertLayer``);
2. per added layer in a stack (a model of 2 layers minus 1 layer), ours and transformers'
   ``BertModel`` before and after ``apply_tempo``: the figure that decides how large a batch fits;
3. transformers' MiniLM, DeBERTa-v3-large and ModernBERT-large before and after ``apply_tempo(model)``
   (needs the ``hf`` extra; without it the HF columns and this table are left out, said in one line).

The bytes a forward keeps depend on shapes, dtypes and the code path, not on values, so on the CPU
they are counted on fake tensors (``tempo.memory.fake``): the whole command takes seconds and a few
hundred MB. ``--real`` counts them on real tensors instead (minutes and gigabytes at BERT-large size,
the same numbers; ``tests/test_memory.py`` holds every table's fake count to the real one), and so
does ``--device cuda``, where CUDA's dropout keeps 1-byte masks. Models are built from their configs
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
FAMILY_COLUMNS = ("model", "s", "HF eager", "HF + apply_tempo(model)", "saved")

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
# values): key -> (row label, config class, fields). ModernBERT's second layer is a sliding-window one
# (global every 3).
FAMILIES = {
    "bert-large": ("BERT-large (h=1024)", "BertConfig",
                   dict(hidden_size=1024, num_attention_heads=16, intermediate_size=4096)),
    "minilm": ("MiniLM-L6 (BERT, h=384)", "BertConfig",
               dict(hidden_size=384, num_attention_heads=12, intermediate_size=1536)),
    "deberta-v3-large": ("DeBERTa-v3-large (h=1024)", "DebertaV2Config", dict(
        hidden_size=1024, num_attention_heads=16, intermediate_size=4096, relative_attention=True,
        pos_att_type=["p2c", "c2p"], position_buckets=256, max_relative_positions=-1, norm_rel_ebd="layer_norm",
        share_att_key=True, max_position_embeddings=512, position_biased_input=False)),
    "modernbert-large": ("ModernBERT-large (h=1024, I=2624)", "ModernBertConfig", dict(
        hidden_size=1024, num_attention_heads=16, intermediate_size=2624, global_attn_every_n_layers=3,
        local_attention=128, pad_token_id=0, bos_token_id=1, eos_token_id=2, cls_token_id=1, sep_token_id=2)),
}
MAX_SEQ_LEN = 512  # BERT-large's and DeBERTa-v3's position tables


def _family_bytes_per_added_layer(family: str, seq_len: int, patched: bool, dtype: torch.dtype,
                                  device: str, fake: Optional[bool] = None) -> float:
    """As bytes_per_added_layer, for transformers' model of ``family`` (eager attention), before or
    after apply_tempo(model) (the default: every layer kind the family has)."""
    import transformers

    from tempo.integrations.patch import apply_tempo

    _label, cls_name, fields = FAMILIES[family]
    build = _Builder(_use_fake(fake, device), device)
    models = {}
    for layers in (1, 2):
        config = getattr(transformers, cls_name)(vocab_size=1000, num_hidden_layers=layers,
                                                 attn_implementation="eager", **fields)
        models[layers] = build.module(lambda: transformers.AutoModel.from_config(config),
                                      apply_tempo if patched else None)

    def kept(layers: int, batch: int) -> int:
        model = models[layers]
        ids = torch.randint(3, 1000, (batch, seq_len), device=device)
        return build.ledger(model, lambda: model(input_ids=ids), dtype).activation_bytes

    return _added_layer(kept, seq_len)


def family_rows(seq_lens=(128, 512), families: Iterable[str] = tuple(FAMILIES), dtype: torch.dtype = torch.bfloat16,
                device: str = "cpu", fake: Optional[bool] = None, tick: Tick = None) -> list[dict[str, Any]]:
    """Per added layer, units of the family's h: transformers' model before and after apply_tempo."""
    rows = []
    for family in families:
        h = FAMILIES[family][2]["hidden_size"]
        for s in seq_lens:
            row = {"family": family, "seq_len": s}
            for patched in (False, True):
                row["after" if patched else "before"] = _family_bytes_per_added_layer(
                    family, s, patched, dtype, device, fake) / h
                if tick:
                    tick()
            rows.append(row)
    return rows


def format_family_table(rows: list[dict[str, Any]]) -> str:
    lines = ["| " + " | ".join(FAMILY_COLUMNS) + " |", "|" + "---|" * len(FAMILY_COLUMNS)]
    for r in rows:
        lines.append(f"| {FAMILIES[r['family']][0]} | {r['seq_len']} | {r['before']:.1f} h | {r['after']:.1f} h | "
                     f"{1 - r['after'] / r['before']:.0%} |")
    return "\n".join(lines)


def family_table(seq_lens=(128, 512), dtype: torch.dtype = torch.bfloat16, device: str = "cpu",
                 families: Iterable[str] = tuple(FAMILIES), fake: Optional[bool] = None) -> str:
    return format_family_table(family_rows(seq_lens, families, dtype, device, fake))


# -- the largest batch a budget holds, whole encoders at their published depth -------------------
# (published layers, vocabulary) of each family: the whole encoder (transformers' AutoModel) is counted.
FAMILY_DEPTH = {"bert-large": (24, 30522), "minilm": (6, 30522), "deberta-v3-large": (24, 128100), "modernbert-large": (28, 50368)}
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
        _label, cls_name, fields = FAMILIES[family]
        layers, vocab = FAMILY_DEPTH[family]
        row = {"family": family, "layers": layers, "seq_len": seq_len}
        for patched in (False, True):
            build = _Builder(_use_fake(fake, device), device)
            config = getattr(transformers, cls_name)(vocab_size=vocab, num_hidden_layers=layers,
                                                     attn_implementation="eager", **fields)
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
    valid = f"valid: an integer from 1 to {MAX_SEQ_LEN} (BERT-large's and DeBERTa-v3's position tables)"
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a sequence length; {valid}") from None
    if not 1 <= value <= MAX_SEQ_LEN:
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tempo.memory",
        description="Bytes autograd keeps for backward per token per encoder layer (units of h): one BERT-large "
                    "layer alone, per added layer in a stack, and transformers' BERT-large / MiniLM / DeBERTa-v3-large / "
                    "ModernBERT-large before and after apply_tempo(model). Counted on fake tensors on the CPU "
                    "(exact, seconds); --real counts on real tensors (minutes, gigabytes; the same numbers).",
    )
    parser.add_argument("--seq-lens", type=_seq_len, nargs="+", default=[128, 512], metavar="S",
                        help=f"sequence lengths, 1 to {MAX_SEQ_LEN} (default 128 512)")
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
    parser.add_argument("--budget", default=DEFAULT_BUDGET,
                        help=f"memory budget of the largest-batch table (default {DEFAULT_BUDGET}: a 24 GB GPU)")
    args = parser.parse_args(argv)
    families = _families(parser, args.families)
    from tempo.utils import parse_bytes

    try:
        budget = parse_bytes(args.budget)
    except ValueError as exc:
        parser.error(f"--budget: {exc}")
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    if args.device != "cpu" and args.device.split(":")[0] != "cuda":
        parser.error(f"--device {args.device}: unknown device; valid: cpu, cuda, cuda:N")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error(f"--device {args.device}: no CUDA device here; valid: cpu")
    if args.device == "cpu" and dtype == torch.float16:
        parser.error("--dtype fp16 autocast needs --device cuda")
    fake = not args.real and args.device == "cpu"
    seq_lens = tuple(args.seq_lens)

    left_out = []
    hf = not args.no_hf and _transformers_available()
    if not args.no_hf and not hf:
        left_out.append("the HF columns and the transformers families table: transformers is not installed "
                        "(pip install -e \".[hf]\")")
    elif args.no_hf:
        left_out.append("the HF columns and the transformers families table (--no-hf)")
    stack_variants = tuple(v for v in STACK_VARIANTS if hf or not v.startswith("hf-"))
    layer_variants = LEDGER_VARIANTS + (("hf-eager",) if hf else ())
    show_families = hf and not args.no_families
    if hf and args.no_families:
        left_out.append("the transformers families table (--no-families)")
    if args.no_stack:
        left_out.append("the per-added-layer table (--no-stack)")
    jobs = len(seq_lens) * (len(layer_variants) + (0 if args.no_stack else len(stack_variants))
                            + (2 * len(families) if show_families else 0)) + (2 * len(families) if show_families else 0)
    batch_len = max(seq_lens)

    with _progress(jobs) as bar:
        rows = ledger_table(seq_lens, variants=layer_variants, dtype=dtype, device=args.device, fake=fake,
                            tick=bar.update)
        stack = None if args.no_stack else stack_table(seq_lens, variants=stack_variants, dtype=dtype,
                                                       device=args.device, fake=fake, tick=bar.update)
        fams = family_rows(seq_lens, families, dtype=dtype, device=args.device, fake=fake,
                           tick=bar.update) if show_families else None
        batches = family_batch_rows(budget, batch_len, families, dtype=dtype, device=args.device, fake=fake,
                                    tick=bar.update) if show_families else None

    how = "counted on fake tensors (exact: bytes depend on shapes, not values)" if fake else \
        f"counted on real tensors on {args.device}"
    precision = "fp32 (no autocast)" if dtype == torch.float32 else f"{args.dtype} autocast"
    print(f"Bytes autograd keeps for backward per token, {precision}, dropout 0.1, in units of h "
          f"(the hidden size);\n{how}. Marginal: batch 2 minus batch 1, so autocast's fixed weight copies "
          "are left out.\n")
    print("One BERT-large encoder layer alone (h = 1024, 16 heads):")
    print(format_table(rows))
    if stack is not None:
        print("\nPer added layer in a stack (BertModel of 2 layers minus 1 layer: the layer's input is counted "
              "once,\nwhere the layer below's output is kept), BERT-large, units of h. This decides the batch that "
              "fits:")
        print(format_table(stack))
    if fams is not None:
        print("\ntransformers' encoders (eager attention, random weights at the published size), per added layer, "
              "units of each\nmodel's h, before and after apply_tempo(model); dropout as each family ships "
              "(BERT/DeBERTa 0.1, ModernBERT 0):")
        print(format_family_table(fams))
    if batches is not None:
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
