"""Training benchmark on synthetic data: samples/s, model TFLOPS and MFU, p20/p50/p80 step time,
allocator peaks/retries/OOMs and the memory anatomy (weights, gradients, optimizer states,
activations, temporaries). DDP: launch with torchrun --nproc-per-node N -m tempo.bench train ...

Examples:
  python -m tempo.bench train --model bert_large --seq-len 128 --batch-size 64 --precision bf16
  python -m tempo.bench train --model bert_large --tempo --attention sdpa --optimizer adamw_fused
  python -m tempo.bench train --model hf:bert-large --attention sdpa --precision bf16
"""

from __future__ import annotations

import argparse

from tempo.bench.train_bench import add_train_args, config_from_args, format_summary, run_train_bench


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_train_args(p)
    p.add_argument("--out", default=None, help="write the result record (JSON) here")
    p.add_argument("--quiet", action="store_true", help="no summary on stdout")


def main(args: argparse.Namespace) -> int:
    from tempo.bench.results import write_json

    result = run_train_bench(config_from_args(args))
    if not result["is_main"]:
        return 0
    if args.out:
        write_json(args.out, result)
    if not args.quiet:
        print(format_summary(result))
    return 0
