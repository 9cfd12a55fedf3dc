"""``python -m tempo.bench <subcommand>``: see each subcommand's -h.

  train      one training benchmark (samples/s, TFLOPS, MFU, step-time spread, memory anatomy)
  max-batch  largest batch that fits (fresh subprocess per probe; --command for any script)
  sweep      throughput vs batch size, and the technique matrix, into results/<gpu>/<time>/
  layer      one BERT encoder layer: ours (original/Tempo/sdpa/compiled) vs HF's BertLayer
  ops        each Tempo layer alone vs eager PyTorch and torch.compile, with GB/s
  profile    torch.profiler over a few train steps: GEMM vs memory-bound share, top kernels
  report     PNG plots and a markdown table from a results directory
  gpu-suite  the GPU check, one command: the quick plan (at most 7 minutes: correctness, memory, speed,
             largest batch; tempo/bench/gpu_quick.py) or --full (25 minutes: tests, ops, layer, train, ...)
  compare    model variants (Tempo choices, unpadded) timed alternately in one process: train or predict

Exit status: 0 ok, 1 bad configuration (or no GPU for gpu-suite), 2 a max-batch probe failed for
another reason than memory, 3 out of memory (real, or simulated by --memory-budget), 4 a
gpu-suite stage did not finish (its summary.md says which), 130 interrupted.
"""

from __future__ import annotations

import argparse
import importlib
import sys

PROG = "python -m tempo.bench"

SUBCOMMANDS = {
    "train": ("tempo.bench.train_cli", "training benchmark on synthetic data"),
    "max-batch": ("tempo.bench.max_batch", "largest batch that fits"),
    "sweep": ("tempo.bench.sweep", "batch-size sweep and technique matrix"),
    "layer": ("tempo.bench.layer_bench", "one encoder layer: ours vs HF"),
    "ops": ("tempo.bench.ops_bench", "each Tempo op vs eager and compiled PyTorch"),
    "profile": ("tempo.bench.profile", "torch.profiler over train steps"),
    "report": ("tempo.bench.report", "plots and markdown from a results directory"),
    "gpu-suite": ("tempo.bench.gpu_suite", "the GPU check (quick, or --full), results/<gpu>/<time>/summary.md"),
    "compare": ("tempo.bench.compare", "model variants timed alternately in one process"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="subcommand", required=True, metavar="SUBCOMMAND")
    for name, (module, help_text) in SUBCOMMANDS.items():
        mod = importlib.import_module(module)
        p = sub.add_parser(name, help=help_text, description=(mod.__doc__ or help_text).strip(),
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        mod.add_arguments(p)
        p.set_defaults(_module=mod)
    return parser


def main(argv: list[str] | None = None) -> int:
    import torch

    from tempo.bench.common import OOM_EXIT, BenchError, SimulatedOOM
    from tempo.train.runtime import NonFiniteError

    args = build_parser().parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # the exact command, for the records
    where = f"{PROG} {args.subcommand}"
    try:
        return int(args._module.main(args) or 0)
    except (BenchError, NonFiniteError) as exc:  # a NaN step stops a benchmark as it stops the trainers
        print(f"{where}: error: {exc}", file=sys.stderr)
        return 1
    except SimulatedOOM as exc:
        print(f"{where}: {exc}", file=sys.stderr)
        return OOM_EXIT
    except torch.OutOfMemoryError as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else "CUDA out of memory"
        print(f"{where}: out of memory: {first}", file=sys.stderr)
        return OOM_EXIT
    except KeyboardInterrupt:
        print(f"{where}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
