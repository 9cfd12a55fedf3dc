"""``python -m tempo.bench sweep``: throughput vs batch size, and the technique matrix.

Batch sweep: ``--batch-sizes 8 16 32`` or ``--batch-range 8 256`` (doubling) with the train
flags you give. Technique matrix (``--techniques all`` or a comma list of the names below), at
``--matrix-batch`` (default: --batch-size), each row = your train flags plus:

  fp32           precision fp32, AdamW (the "nothing done" baseline)
  bf16           + bf16 autocast
  fused          + fused AdamW (bf16)
  accum          + gradient accumulation x4 (bf16, fused AdamW; 4x the samples per step)
  ckpt           + activation checkpointing (bf16, fused AdamW)
  tempo          + Tempo layers with Tempo attention (bf16, fused AdamW)
  tempo-sdpa     + Tempo GELU/LayerNorm with sdpa attention (bf16, fused AdamW)
  tempo-all      + every Tempo layer: efficient attention, fused dropout-add-LayerNorm (bf16, fused AdamW)
  compile        + torch.compile on top of tempo-sdpa

accum and ckpt are alternatives to compare against, not stacked into the Tempo rows (they
would hide what Tempo alone gives). Tempo rows use the paper's layer kinds (tempo.choices.PAPER_KINDS); the row
records which.

Each row runs in a fresh subprocess (``--no-isolate`` runs them in this process: faster, but an
OOM then ends the sweep): an OOM row is recorded with status "oom" and the sweep goes on.
Output: results/<gpu-or-cpu>/<timestamp>/ (or --out-dir) with sweep.json (env, base config,
every row's full record incl. raw per-step times), sweep.csv and rows/<name>.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import subprocess
import sys
from pathlib import Path
from typing import Any

from tempo.choices import PAPER_KINDS, LAYER_KINDS
from tempo.bench.common import OOM_EXIT, BenchError, SimulatedOOM
from tempo.bench.train_bench import (
    TrainBenchConfig,
    add_train_args,
    config_from_args,
    config_to_argv,
    run_train_bench,
)

TECHNIQUE_NAMES = ("fp32", "bf16", "fused", "accum", "ckpt", "tempo", "tempo-sdpa", "tempo-all", "compile")
CSV_LEADING = ("group", "name", "status", "config.batch_size", "config.seq_len", "config.precision",
               "config.optimizer", "tempo_layers", "attention", "config.grad_accum", "config.grad_ckpt",
               "config.compile", "samples_per_s", "step_time_ms.p20", "step_time_ms.p50", "step_time_ms.p80",
               "model_tflops_per_device", "mfu", "anatomy.weights", "anatomy.gradients",
               "anatomy.optimizer_states", "anatomy.activations", "anatomy.temporaries",
               "memory.peak_allocated_bytes", "memory.peak_reserved_bytes")


def doubling(start: int, stop: int) -> list[int]:
    if start < 1 or stop < start:
        raise BenchError("--batch-range needs 1 <= START <= STOP")
    out, b = [], start
    while b <= stop:
        out.append(b)
        b *= 2
    return out


def technique_configs(base: TrainBenchConfig, names: tuple[str, ...]) -> list[tuple[str, TrainBenchConfig]]:
    tempo_kinds = PAPER_KINDS
    all_kinds = ",".join(tempo_kinds)
    no_attention = ",".join(k for k in tempo_kinds if k != "attention")
    plain = dict(tempo_layers="", attention="eager", grad_ckpt=False, grad_accum=1, compile=False)
    fused = dict(plain, precision="bf16", optimizer="adamw_fused")
    recipes = {
        "fp32": dict(plain, precision="fp32", optimizer="adamw"),
        "bf16": dict(plain, precision="bf16", optimizer="adamw"),
        "fused": fused,
        "accum": dict(fused, grad_accum=4),
        "ckpt": dict(fused, grad_ckpt=True),
        "tempo": dict(fused, tempo_layers=all_kinds,
                      attention="tempo" if "attention" in tempo_kinds else "eager"),
        "tempo-sdpa": dict(fused, tempo_layers=no_attention, attention="sdpa"),
        "tempo-all": dict(fused, tempo_layers=",".join(LAYER_KINDS), attention="efficient"),
        "compile": dict(fused, tempo_layers=no_attention, attention="sdpa", compile=True),
    }
    unknown = set(names) - set(recipes)
    if unknown:
        raise BenchError(f"--techniques: unknown {sorted(unknown)}; choose from {TECHNIQUE_NAMES}")
    return [(n, dataclasses.replace(base, **recipes[n])) for n in names]


def run_row(cfg: TrainBenchConfig, out_json: Path, isolate: bool, timeout: float | None) -> dict[str, Any]:
    """One row: {"status": ok|oom|error, "result": record | None, "message": ...}."""
    from tempo.bench.max_batch import is_oom_output
    from tempo.bench.results import read_json, write_json

    if not isolate:
        try:
            result = run_train_bench(cfg)
        except SimulatedOOM as exc:
            return {"status": "oom", "message": str(exc), "result": None}
        except BenchError as exc:
            return {"status": "error", "message": str(exc), "result": None}
        write_json(out_json, result)
        return {"status": "ok", "message": "", "result": read_json(out_json)}
    cmd = [sys.executable, "-m", "tempo.bench", "train", *config_to_argv(cfg), "--out", str(out_json), "--quiet"]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"status": "error", "message": f"timed out after {timeout} s", "result": None}
    output = proc.stdout + proc.stderr
    if proc.returncode == 0 and out_json.is_file():
        return {"status": "ok", "message": "", "result": read_json(out_json)}
    tail = "\n".join(output.strip().splitlines()[-5:])
    status = "oom" if proc.returncode == OOM_EXIT or is_oom_output(output) else "error"
    return {"status": status, "message": tail, "result": None}


def add_arguments(p: argparse.ArgumentParser) -> None:
    from tempo.utils import positive_int, positive_number

    add_train_args(p)
    p.add_argument("--batch-sizes", type=positive_int, nargs="+", default=None, help="batch sweep over these sizes")
    p.add_argument("--batch-range", type=positive_int, nargs=2, metavar=("START", "STOP"), default=None,
                   help="batch sweep doubling from START up to STOP")
    p.add_argument("--techniques", default=None,
                   help=f"technique matrix rows: 'all' or a comma list of {','.join(TECHNIQUE_NAMES)}")
    p.add_argument("--matrix-batch", type=positive_int, default=None,
                   help="batch of the technique rows (default --batch-size)")
    p.add_argument("--isolate", action=argparse.BooleanOptionalAction, default=True,
                   help="each row in a fresh subprocess (default on)")
    p.add_argument("--timeout", type=positive_number, default=None, help="seconds per row")
    p.add_argument("--results-root", default="results", help="results/<gpu-or-cpu>/<timestamp>/ goes here")
    p.add_argument("--out-dir", default=None, help="exact output directory instead")


def main(args: argparse.Namespace) -> int:
    import torch

    from tempo.bench.hardware import environment
    from tempo.bench.results import new_results_dir, write_csv, write_json

    base = config_from_args(args)
    base.validate()
    plan: list[tuple[str, str, TrainBenchConfig]] = []
    sizes = args.batch_sizes or (doubling(*args.batch_range) if args.batch_range else [])
    for b in sizes:
        plan.append(("batch", f"batch {b}", dataclasses.replace(base, batch_size=b)))
    if args.techniques:
        names = TECHNIQUE_NAMES if args.techniques == "all" else tuple(
            n.strip() for n in args.techniques.split(",") if n.strip())
        matrix_base = dataclasses.replace(base, batch_size=args.matrix_batch or base.batch_size)
        plan += [("technique", n, c) for n, c in technique_configs(matrix_base, names)]
    if not plan:
        raise BenchError("nothing to run: give --batch-sizes/--batch-range and/or --techniques")

    device = base.device or ("cuda" if torch.cuda.is_available() else "cpu")
    out_dir = Path(args.out_dir) if args.out_dir else new_results_dir(args.results_root, device)
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = []
    for i, (group, name, cfg) in enumerate(plan):
        print(f"sweep [{i + 1}/{len(plan)}] {name} ...", flush=True)
        slug = "".join(c if c.isalnum() else "_" for c in f"{group}_{name}")
        row = run_row(cfg, out_dir / "rows" / f"{slug}.json", args.isolate, args.timeout)
        row = {"group": group, "name": name, "config": dataclasses.asdict(cfg), **row}
        result = row.pop("result")
        if result is not None:
            row.update({k: v for k, v in result.items() if k not in ("config", "kind")})
            r = result
            print(f"    {r['samples_per_s']:.2f} samples/s, step p50 {r['step_time_ms']['p50']:.1f} ms, "
                  f"activations {r['anatomy']['activations'] / 2**20:.1f} MiB", flush=True)
        else:
            print(f"    {row['status']}: {row['message'].splitlines()[-1] if row['message'] else ''}", flush=True)
        rows.append(row)
    record = {"kind": "sweep", "env": environment(device), "base_config": dataclasses.asdict(base), "rows": rows}
    write_json(out_dir / "sweep.json", record)
    write_csv(out_dir / "sweep.csv", [{k: v for k, v in r.items() if k not in ("env", "step_times_s")}
                                      | {"step_times_s": r.get("step_times_s", [])} for r in rows],
              leading=CSV_LEADING)
    print(f"sweep: results in {out_dir}")
    return 0
