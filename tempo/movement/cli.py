"""``python -m tempo.movement``: bytes moved and projected GPU time of BERT-large, per Tempo choice."""

from __future__ import annotations

import argparse
import functools
import json
import platform
import sys
from typing import Any, Optional

import torch

from tempo.movement.components import component_table
from tempo.movement.declarations import CLASSES, CONTRACTION, ELEMENTWISE, NORMALIZATION
from tempo.movement.projection import CALIBRATION, Fit, fit_factors, gpus
from tempo.movement.report import (REFERENCE_GPU, Summary, fmt_bytes, per_op_rows, record, relative, summarize,
                                   target_of)
from tempo.movement.workloads import (CHOICES, DEBERTA_VARIANTS, HF_VARIANTS, Workload, deberta_workload,
                                     layer_workload, model_workload)

_SHORT = {CONTRACTION: "GEMM", NORMALIZATION: "norm", ELEMENTWISE: "elem"}
# The calibration points' workloads: what each published time measures.
# Both publications ran fp16 mixed precision: the calibration traces are fp16 (the table's are bf16).
_FP16 = torch.float16
_CALIBRATION_WORKLOADS = {
    "substation V100 layer b=8 s=512": (lambda: layer_workload("original", 8, 512, dtype=_FP16), 1),
    "substation V100 layer b=96 s=128": (lambda: layer_workload("original", 96, 128, dtype=_FP16), 1),
    "DLE A100-80GB pretraining s=128": (lambda: model_workload("original", "pretraining", 64, 128, dtype=_FP16), 64),
    # Fine-tuning updates the weights every step (pretraining accumulates 32+ micro-batches per update).
    "DLE A100-80GB SQuAD s=384 b=32": (lambda: model_workload("original", "squad", 32, 384, dtype=_FP16,
                                                              optimizer=True), 32),
}
DEFAULT_BATCH = {128: 96, 512: 8}  # Substation's two layer configurations


@functools.lru_cache(maxsize=1)
def calibrate() -> tuple[Fit, dict[str, Workload]]:
    """The fitted factors (traced once per process: the calibration is a constant of the code)."""
    built = {name: factory() for name, (factory, _) in _CALIBRATION_WORKLOADS.items()}
    table = gpus()
    workloads = {p.name: (built[p.name].weighted(target_of(table[p.gpu])), _CALIBRATION_WORKLOADS[p.name][1])
                 for p in CALIBRATION}
    return fit_factors(workloads), built


def _projection_cells(summary: Summary, fit: Fit, names: list[str]) -> str:
    err = fit.max_relative_error
    return " | ".join(f"{summary.projected_ms[n]:.2f} (±{err:.0%})" for n in names)


def _table(title: str, summaries: list[Summary], fit: Fit, baseline: Optional[Summary], hidden: int) -> str:
    names = list(summaries[0].projected_ms)
    lines = [f"\n{title}", "",
             "| choice | moved | per token per layer | vs original | GFLOP | GEMM / norm / elem share | "
             + " | ".join(f"{n} ms/step (proj.)" for n in names) + " |",
             "|---|---|---|---|---|---|" + "---|" * len(names)]
    for s in summaries:
        shares = " / ".join(f"{s.class_share(c):.0%}" for c in CLASSES)
        per_tok = s.per_token_per_layer
        lines.append(f"| {s.workload.label} | {fmt_bytes(s.moved)} | {per_tok / hidden:.0f} h ({fmt_bytes(per_tok)}) | "
                     f"{relative(s.moved, baseline.moved if baseline else None)} | {s.flops / 1e9:.0f} | {shares} | "
                     + _projection_cells(s, fit, names) + " |")
    return "\n".join(lines)


def _calibration_lines(fit: Fit) -> str:
    lines = ["Calibration (published measurements; the projection model: per kernel max(FLOPs / (η_c·peak), "
             "bytes / (η_b·bandwidth)), summed):",
             f"  fitted η_c = {fit.factors.compute:.3f} (compute), η_b = {fit.factors.bandwidth:.3f} (bandwidth)"
             + ("  [a factor sits at its bound 1: the points pull in opposite directions, see the errors]"
                if max(fit.factors.compute, fit.factors.bandwidth) >= 0.999 else ""),
             "", "| point | GPU | measured ms | projected ms | relative error |", "|---|---|---|---|---|"]
    for p in fit.points:
        lines.append(f"| {p['point']} ({p['per']}) | {p['gpu']} | {p['measured_ms']:.2f} | {p['projected_ms']:.2f} | "
                     f"{p['relative_error']:+.1%} |")
    lines.append(f"\nEvery projection below carries ±{fit.max_relative_error:.0%}: the largest calibration error. "
                 "Projections, not measurements.")
    return "\n".join(lines)


def _component_lines(batch: int, seq_len: int, target) -> str:
    lines = [f"\nEach Tempo layer against the stock ops it replaces, alone (b = {batch}, s = {seq_len}, fwd + bwd, "
             f"bytes on {target.name}):", "", "| part | stock | Tempo | Tempo − stock | kernels, where Tempo moves more |",
             "|---|---|---|---|---|"]
    for row in component_table(batch, seq_len, target):
        stock = row["stock"]
        for side in row["tempo"]:
            extra = side.moved - stock.moved
            where = ""
            if extra > 0:  # both sides' kernels, so the reader sees where the difference is
                where = "Tempo: " + _kernel_list(side) + "; stock: " + _kernel_list(stock)
            lines.append(f"| {row['part']} | {stock.label}: {fmt_bytes(stock.moved)} | {side.label}: "
                         f"{fmt_bytes(side.moved)} | {fmt_bytes(extra)} ({extra / stock.moved:+.1%}) | {where} |")
    return "\n".join(lines)


def _kernel_list(side) -> str:
    totals: dict[str, list[float]] = {}
    for phase, k in side.kernels:
        entry = totals.setdefault(f"{phase[:3]} {k.name}", [0.0, 0.0])
        entry[0] += k.read
        entry[1] += k.written
    return ", ".join(f"{name} r {fmt_bytes(r)} w {fmt_bytes(w)}" for name, (r, w) in totals.items())


def _per_op_lines(workload: Workload, target) -> str:
    lines = [f"\nPer op, {workload.label} ({workload.scope}, b = {workload.batch}, s = {workload.seq_len}), "
             f"bytes on {target.name}:", "", "| phase | op | kernel | class | count | read | written | GFLOP |",
             "|---|---|---|---|---|---|---|---|"]
    for r in per_op_rows(workload, target):
        lines.append(f"| {r['phase'][:3]} | {r['op']} | {r['kernel']} | {_SHORT[r['class']]} | {r['count']:g} | "
                     f"{fmt_bytes(r['read'])} | {fmt_bytes(r['written'])} | {r['flops'] / 1e9:.2f} |")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    from tempo.utils import positive_int, proportion

    parser = argparse.ArgumentParser(
        prog="python -m tempo.movement",
        description="Bytes moved (Substation's data-movement count) and projected GPU time of BERT-large, forward + "
                    "backward, per Tempo choice, counted on the CPU with fake tensors as the CUDA kernels move them.")
    parser.add_argument("--seq-lens", type=positive_int, nargs="+", default=[128, 512])
    parser.add_argument("--batch", type=positive_int, default=None,
                        help="batch for every sequence length (default: Substation's, 96 at s=128 and 8 at s=512)")
    parser.add_argument("--choices", nargs="+", default=list(CHOICES), choices=list(CHOICES))
    parser.add_argument("--padding-share", type=proportion, default=0.5,
                        help="padding share of the padded batch the unpadded rows are counted on (default 0.5)")
    parser.add_argument("--no-unpad", action="store_true", help="skip the padded-batch / unpadded rows")
    parser.add_argument("--model", action="store_true",
                        help="also count whole pretraining steps (BertForPreTraining, 24 layers, MLM on 15%% of the "
                             "positions + NSP) per choice")
    parser.add_argument("--hf", action="store_true",
                        help="also count transformers' BertForPreTraining (eager, sdpa, after apply_tempo: paper, floor)")
    parser.add_argument("--deberta", action="store_true",
                        help="also count one DeBERTa-v3-large layer in a stack (transformers' eager model; after "
                             "apply_tempo with the Combined core; after apply_tempo: the O(s) disentangled attention)")
    parser.add_argument("--components", action="store_true",
                        help="also compare each Tempo layer with the stock ops it replaces, alone")
    parser.add_argument("--per-op", action="store_true", help="print every op's kernels for each layer counted")
    parser.add_argument("--json", metavar="PATH", help="write the records, the calibration and the factors as JSON")
    return parser


def _batch_for(seq_len: int, batch: Optional[int]) -> int:
    if batch is not None:
        return batch
    return DEFAULT_BATCH.get(seq_len, max(1, 4096 // seq_len))


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    table = gpus()
    reference = target_of(table[REFERENCE_GPU])
    hidden = 1024
    print("Bytes moved by BERT-large (h = 1024, 16 heads, I = 4096, dropout 0.1), bf16 autocast, forward + backward,\n"
          "counted on the CPU with fake tensors; each op counted as its CUDA kernels move bytes (tempo/movement). "
          f"Bytes: {REFERENCE_GPU} (Tempo's backward grids depend on the SM count).")
    fit, _ = calibrate()
    print(_calibration_lines(fit))
    records: list[dict[str, Any]] = []
    not_counted: list[dict[str, str]] = []

    half_dtypes = sorted({g.half_dtype for g in table.values()}, key=str)

    def count(label: str, make) -> Optional[Summary]:
        """``make(dtype)`` traces the workload in ``dtype`` autocast: bf16 for the bytes, and each
        GPU's mixed-precision dtype for its projection (fp16 on the V100)."""
        try:
            by_dtype = {dtype: make(dtype) for dtype in half_dtypes}
            workload = by_dtype.get(torch.bfloat16) or make(torch.bfloat16)
        except (ImportError, NotImplementedError) as err:
            not_counted.append({"choice": label, "seq_len": seq_len, "reason": f"{type(err).__name__}: {err}"})
            print(f"  not counted: {label}: {type(err).__name__}: {err}")
            return None
        summary = summarize(workload, table, fit.factors, hidden, by_dtype)
        records.append(record(summary, fit))
        if args.per_op:
            print(_per_op_lines(workload, reference))
        return summary

    for seq_len in args.seq_lens:
        batch = _batch_for(seq_len, args.batch)
        layer = [s for s in (count(name, lambda d, n=name: layer_workload(n, batch, seq_len, dtype=d))
                             for name in args.choices) if s is not None]
        base = next((s for s in layer if s.workload.label == "original"), None)
        print(_table(f"One encoder layer, s = {seq_len}, b = {batch} (per token: of the b·s tokens):", layer, fit, base,
                     hidden))
        if not args.no_unpad:
            share = args.padding_share
            rows = []
            for name in args.choices:
                for unpad in (False, True):
                    label = f"{name}{'+unpad' if unpad else ''} ({share:.0%} padding)"
                    s = count(label, lambda d, n=name, u=unpad: layer_workload(
                        n, batch, seq_len, padding_share=share, unpad=u, dtype=d))
                    if s is not None:
                        s.workload.label = f"{s.workload.label} ({share:.0%} padding)"
                        records[-1]["choice"] = s.workload.label
                        rows.append(s)
            if rows:
                padded_base = next((s for s in rows if s.workload.label.startswith("original (")), None)
                print(_table(f"One encoder layer on a batch with {share:.0%} padding (every sequence "
                             f"{round(seq_len * (1 - share))} real tokens), s = {seq_len}, b = {batch}; per token of "
                             f"the padded batch:", rows, fit, padded_base, hidden))
        if args.model or args.hf:
            model_batch = 64 if seq_len <= 128 else 8
            names = (list(args.choices) if args.model else []) + (list(HF_VARIANTS) if args.hf else [])
            steps = [s for s in (count(n, lambda d, n=n: model_workload(n, "pretraining", model_batch, seq_len,
                                                                           dtype=d))
                                 for n in names) if s is not None]
            if steps:
                base = next((s for s in steps if s.workload.label == "original"), None)
                print(_table(f"Pretraining step (BertForPreTraining, 24 layers, embeddings and heads included), "
                             f"s = {seq_len}, b = {model_batch}:", steps, fit, base, hidden))
                print("  projected sequences/s: " + "; ".join(
                    f"{s.workload.label}: " + ", ".join(f"{g} {model_batch / s.projected_ms[g] * 1e3:.0f}"
                                                       for g in s.projected_ms) for s in steps))
        if args.deberta:
            rows = [s for s in (count(n, lambda d, n=n: deberta_workload(n, batch, seq_len, dtype=d))
                                for n in DEBERTA_VARIANTS) if s is not None]
            if rows:
                print(_table(f"One DeBERTa-v3-large layer in a stack (h = 1024, 16 heads, 256 position buckets, "
                             f"c2p + p2c, dropout 0.1), s = {seq_len}, b = {batch}:", rows, fit, rows[0], hidden))
        if args.components:
            print(_component_lines(batch, seq_len, reference))
    if not_counted:
        print("\nNot counted: " + "; ".join(f"{n['choice']} at s = {n['seq_len']} ({n['reason']})" for n in not_counted))
    if args.json:
        payload = {
            "records": records,
            "calibration": [{k: p[k] for k in ("point", "gpu", "per", "measured_ms", "projected_ms", "relative_error",
                                               "source")} for p in fit.points],
            "factors": {"compute": fit.factors.compute, "bandwidth": fit.factors.bandwidth},
            "gpus": {name: {"half_tflops": g.half_tflops, "fp32_tflops": g.fp32_tflops,
                            "bandwidth_gbs": g.bandwidth_gbs, "sms": g.sms, "source": g.source}
                     for name, g in table.items()},
            "bytes_counted_for": REFERENCE_GPU,
            "not_counted": not_counted,
            "command": "python -m tempo.movement " + " ".join(argv if argv is not None else sys.argv[1:]),
            "versions": {"torch": torch.__version__, "python": platform.python_version()},
        }
        from tempo.utils import atomic_write_text

        atomic_write_text(args.json, json.dumps(payload, indent=2) + "\n")
        print(f"\nwrote {args.json}")
    return 0


__all__ = ["build_parser", "calibrate", "main"]
