"""``python -m tempo.memory`` (and ``tempo-ledger``): the activation-ledger tables, printed.

Three tables (``tempo.memory.tables``): one BERT-large encoder layer alone, per layer choice (and
transformers' ``BertLayer``); per added layer in a stack, ours and transformers' ``BertModel`` before
and after ``apply_tempo``; transformers' model of every family in ``tempo.presets.FAMILIES`` before
and after ``apply_tempo(model)``, with what it swaps per layer, and the largest batch of each whole
model in a budget (needs the ``hf`` extra; without it the HF columns and these tables are left out,
said in one line; a family whose config class the installed transformers lacks, or an s longer than
its position table, is left out by name in that line too).

On the CPU the bytes are counted on fake tensors: the whole command takes about two minutes on 2 CPU
cores (every family at its published size) and about a gigabyte. ``--real`` counts them on real
tensors instead (minutes and gigabytes at BERT-large size, the same numbers), and so does
``--device cuda``, where CUDA's dropout keeps 1-byte masks.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from typing import Any

import torch

from tempo.memory.tables import (LEDGER_VARIANTS, STACK_VARIANTS, family_batch_rows, family_rows, format_batch_table,
                                 format_family_table, format_table, ledger_table, stack_table)
from tempo.presets import FAMILIES, family_unavailable, longest_seq_len

MAX_SEQ_LEN = 512  # BERT-large's position table: the lone-layer and stack tables' longest s
# The command's longest s: the families' tables are counted on fake tensors, but masks made from real
# position ranges are real s x s tensors (tempo.memory.fake), so s stays where those are megabytes.
MAX_FAMILY_SEQ_LEN = 8192
DEFAULT_BUDGET = "24GiB"  # a 24 GB GPU (RTX 3090/4090, L4, A10)


def _transformers_available() -> bool:
    """Whether the ``hf`` extra is installed (checked without importing it: that takes seconds)."""
    try:
        return importlib.util.find_spec("transformers") is not None
    except (ImportError, ValueError):
        return False


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
