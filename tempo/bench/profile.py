"""``python -m tempo.bench profile``: torch.profiler over a few steps of ``train``.

The train flags are the same as ``train``'s; the first --warmup steps (at least 2) are not
recorded, the next --steps are. Time is attributed to kernels on CUDA (device self time) and
to aten/tempo ops on the CPU (self CPU time), and every name is put in one class:

  gemm           cuBLAS/cuBLASLt/CUTLASS GEMM kernels (gemm, xmma, nvjet, cutlass) and aten
                 mm/addmm/bmm/baddbmm/matmul/linear on the CPU
  attention      fused attention kernels (flash, fmha, efficient attention, cudnn sdpa):
                 GEMMs and softmax in one kernel, so neither class fits
  communication  NCCL / all-reduce
  memory-bound   everything else: element-wise, reductions, softmax, LayerNorm, dropout,
                 copies, optimizer updates, Tempo's Triton kernels

Output (results/<gpu-or-cpu>/<timestamp>/ or --out-dir): profile.json (class shares, the top
kernels, the train record), top_kernels.csv, trace.json (Chrome trace: chrome://tracing or
https://ui.perfetto.dev).
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
from typing import Any

import torch

CLASSES = ("gemm", "attention", "communication", "memory-bound")
_PATTERNS = {
    "attention": ("flash", "fmha", "efficient_attention", "scaled_dot_product", "cudnn_sdpa", "sdpa"),
    "communication": ("nccl", "allreduce", "all_reduce", "c10d"),
    "gemm": ("gemm", "xmma", "nvjet", "cutlass", "cublas", "aten::mm", "aten::addmm", "aten::bmm",
             "aten::baddbmm", "aten::matmul", "aten::linear", "aten::_addmm"),
}


def classify(name: str) -> str:
    lower = name.lower()
    for cls in ("attention", "communication", "gemm"):
        if any(p in lower for p in _PATTERNS[cls]):
            return cls
    return "memory-bound"


def summarize_events(events: list[tuple[str, int, float]], top: int = 20) -> dict[str, Any]:
    """events: (name, calls, self time in µs) -> class shares and the top-``top`` table."""
    total = sum(t for _, _, t in events)
    by_class = {c: 0.0 for c in CLASSES}
    for name, _, t in events:
        by_class[classify(name)] += t
    ranked = sorted(events, key=lambda e: e[2], reverse=True)[:top]
    return {
        "total_us": total,
        "class_us": by_class,
        "class_share": {c: (v / total if total else 0.0) for c, v in by_class.items()},
        "top": [{"name": n, "class": classify(n), "calls": c, "total_us": t, "share": t / total if total else 0.0}
                for n, c, t in ranked],
    }


def _events(averages: Any, on_cuda: bool) -> list[tuple[str, int, float]]:
    out = []
    for evt in averages:
        if on_cuda:
            t = float(getattr(evt, "self_device_time_total", 0) or 0)
            if t <= 0 or evt.device_type != torch.autograd.DeviceType.CUDA:
                continue
        else:
            if not (evt.key.startswith("aten::") or evt.key.startswith("tempo::")):
                continue
            t = float(evt.self_cpu_time_total)
            if t <= 0:
                continue
        out.append((evt.key, int(evt.count), t))
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    from tempo.bench.train_bench import add_train_args
    from tempo.utils import positive_int

    add_train_args(p)
    p.set_defaults(steps=5, warmup=3)
    p.add_argument("--top", type=positive_int, default=20, help="rows of the top-kernels table")
    p.add_argument("--results-root", default="results")
    p.add_argument("--out-dir", default=None)


def main(args: argparse.Namespace) -> int:
    from torch.profiler import ProfilerActivity, profile, schedule

    from tempo.bench.results import new_results_dir, write_csv, write_json
    from tempo.bench.train_bench import config_from_args, run_train_bench

    cfg = config_from_args(args)
    cfg = dataclasses.replace(cfg, warmup=max(cfg.warmup, 2))
    cfg.validate()
    # Compare device types, not strings: "cuda:0" is CUDA too.
    on_cuda = torch.device(cfg.device or ("cuda" if torch.cuda.is_available() else "cpu")).type == "cuda"
    out_dir = Path(args.out_dir) if args.out_dir else new_results_dir(args.results_root, "cuda" if on_cuda else "cpu")
    out_dir.mkdir(parents=True, exist_ok=True)
    captured: dict[str, Any] = {}

    def on_trace_ready(prof: Any) -> None:
        prof.export_chrome_trace(str(out_dir / "trace.json"))
        captured["averages"] = prof.key_averages()

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_cuda else [])
    # Region 0 (the ledger forwards and step 0) and the rest of warm-up are waited out.
    with profile(activities=activities, schedule=schedule(wait=cfg.warmup - 1, warmup=1, active=cfg.steps),
                 on_trace_ready=on_trace_ready) as prof:
        result = run_train_bench(cfg, on_step=lambda _i: prof.step())
    if "averages" not in captured:  # the schedule's last step() did not fire the handler
        on_trace_ready(prof)
    summary = summarize_events(_events(captured["averages"], on_cuda), top=args.top)
    summary["time_source"] = "CUDA kernel self time" if on_cuda else "CPU self time of aten/tempo ops"
    record = {"kind": "profile", "env": result["env"], "profiled_steps": cfg.steps, **summary, "train": result}
    write_json(out_dir / "profile.json", record)
    write_csv(out_dir / "top_kernels.csv", summary["top"], leading=("name", "class", "calls", "total_us", "share"))
    print(f"profile over {cfg.steps} steps ({summary['time_source']}):")
    for c in CLASSES:
        print(f"  {c:<14} {summary['class_share'][c]:6.1%}")
    print("top kernels:")
    for row in summary["top"][:10]:
        print(f"  {row['share']:6.1%}  {row['calls']:5d}x  {row['class']:<13} {row['name'][:90]}")
    print(f"profile: results in {out_dir} (trace.json: open in https://ui.perfetto.dev)")
    return 0
