"""``python -m tempo.bench.torch_policies``: what torch's own policies keep for backward and recompute, as a table.

    python -m tempo.bench.torch_policies --model bert-large --seq-len 512 [--policies eager sdpa ...] [--json PATH]

One row per policy (sdpa, ``torch.compile`` and its ``activation_memory_budget``, selective and full
checkpointing, and the same levers after ``apply_tempo``): bytes kept per token per added layer in
units of h, backward FLOPs against eager's, what is recomputed. The counting, and what each column
means, is ``tempo.plan.torch_policies`` (the planner's frontier table is its other user).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import asdict
from typing import Optional, Sequence

from tempo.plan.torch_policies import (DEFAULT_TOKENS, POLICIES, PolicyCount, check_seq_len, count_policies,
                                       layer_period)
from tempo.presets import FAMILIES, FAMILY_DEPTH

TABLE_COLUMNS = ("policy", "bytes kept", "fixed", "backward FLOPs vs eager", "backward transient peak",
                 "what it recomputes")


def _fmt(value: Optional[float], unit: str = " h", digits: int = 1) -> str:
    return "—" if value is None else f"{value:.{digits}f}{unit}"


def format_table(rows: Sequence[PolicyCount]) -> str:
    """Markdown in the issue's format: kept bytes per token per added layer in units of h."""
    from tempo.utils import format_bytes

    lines = ["| " + " | ".join(TABLE_COLUMNS) + " |", "|" + "---|" * len(TABLE_COLUMNS)]
    for r in rows:
        if not r.counted:
            lines.append(f"| {r.policy} | not yet counted | — | — | — | {r.note} |")
            continue
        kept = _fmt(r.kept_h) + (f" (whole model, {r.tokens} tokens)" if r.scope == "whole model" else "")
        fixed = "—" if r.fixed is None else f"{format_bytes(r.fixed)} + {format_bytes(r.fixed_per_layer)}/layer"
        transient = "—" if r.transient_per_token is None else _fmt(r.transient_per_token / r.hidden) + " per token"
        text = r.recomputed_text + (f" ({r.note})" if r.note else "")
        lines.append(f"| {r.policy} | {kept} | {fixed} | {_fmt(r.backward_ratio, '', 3)} | {transient} | {text} |")
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    from tempo.train.flags import positive_int

    parser = argparse.ArgumentParser(
        prog="python -m tempo.bench.torch_policies",
        description="What torch's own policies (sdpa, torch.compile and its activation_memory_budget, selective and "
                    "full checkpointing) keep for backward and recompute, beside apply_tempo and Tempo with the same "
                    "levers: bytes kept per token per added layer (units of h), backward FLOPs against eager, what "
                    "is recomputed. Counted on fake tensors as a GPU runs the step (bf16 autocast).")
    parser.add_argument("--model", default="bert-large", help=f"family: {', '.join(FAMILIES)} (default bert-large)")
    parser.add_argument("--seq-len", type=positive_int, default=512, help="sequence length (default 512)")
    parser.add_argument("--tokens", type=positive_int, default=None,
                        help=f"tokens of the whole-model budget rows, a multiple of --seq-len (default: the smallest "
                             f"multiple at or above {DEFAULT_TOKENS})")
    parser.add_argument("--policies", nargs="+", metavar="NAME", default=list(POLICIES),
                        help=f"policies to count (default all): {', '.join(POLICIES)}")
    parser.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    args = parser.parse_args(argv)
    if args.model not in FAMILIES:
        parser.error(f"--model: unknown family {args.model!r}; valid: {', '.join(FAMILIES)}")
    names = [n.strip() for arg in args.policies for n in arg.split(",") if n.strip()]
    for name in names:
        if name not in POLICIES:
            parser.error(f"--policies: unknown policy {name!r}; valid: {', '.join(POLICIES)}")
    try:
        check_seq_len(args.model, args.seq_len)
    except ValueError as exc:
        parser.error(f"--seq-len: {exc}")
    if args.tokens is None:
        args.tokens = args.seq_len * math.ceil(DEFAULT_TOKENS / args.seq_len)
    if args.tokens % args.seq_len:
        parser.error(f"--tokens {args.tokens} is not a multiple of --seq-len {args.seq_len}")
    steps = sum(1 for n in names if not POLICIES[n].whole_model) + len(
        {POLICIES[n].tempo for n in names if POLICIES[n].whole_model})
    done = [0]
    start = time.monotonic()

    def tick(what: str) -> None:
        done[0] += 1
        print(f"\r[{done[0]}/{steps}] {time.monotonic() - start:5.0f} s  counting {what} ...".ljust(110),
              end="", file=sys.stderr, flush=True)

    rows = count_policies(names, args.model, args.seq_len, tokens=args.tokens, tick=tick)
    print(f"\r[{steps}/{steps}] {time.monotonic() - start:5.0f} s  done".ljust(110), file=sys.stderr, flush=True)
    layers, period = FAMILY_DEPTH[args.model][0], layer_period(args.model)
    averaged = f" (averaged over {period} layers: 1 global, {period - 1} sliding-window)" if period > 1 else ""
    print(f"{FAMILIES[args.model][0]}, s = {args.seq_len}: bytes kept for backward per token per added layer{averaged} "
          f"(units of h),\nbf16 autocast, dropout as the family ships, as a GPU runs the step (fused sdpa, bool dropout "
          f"masks), counted on fake tensors.\nFixed: batch-independent bytes (autocast's weight copies, masks). "
          f"Whole-model rows: {layers} layers at {args.tokens} tokens,\nsaved bytes / (tokens × layers), fixed bytes "
          f"included. Backward FLOPs include recompute, against eager's. Transient: backward's peak\nof the storages "
          f"it makes (parameter gradients left out), per token; not counted for compiled policies (Inductor fuses).\n")
    print(format_table(rows))
    if args.json:
        from tempo.utils import atomic_write_text

        atomic_write_text(args.json, json.dumps([asdict(r) for r in rows], indent=1, default=str) + "\n")
    return 0


__all__ = ["TABLE_COLUMNS", "format_table", "main"]


if __name__ == "__main__":
    raise SystemExit(main())
