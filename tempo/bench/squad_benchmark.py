"""Original vs Tempo SQuAD fine-tuning on one GPU: the largest batch that fits, and its throughput.

What scripts/tempo/tempo_benchmarking_squad_<gpu>.sh run:

    python -m tempo.bench.squad_benchmark --gpu a100 --precisions tf32,bf16

For each precision and each of original/Tempo: ``python -m tempo.bench max-batch`` searches the
largest ``--train_batch_size`` for which a short ``run_squad.py`` run succeeds (a fresh process
per probe; "out of memory" = does not fit), then one longer run at that batch measures
``training_sequences_per_second`` (from its DLLL summary). Everything goes to
``results/squad_benchmark/<gpu>/<timestamp>/``: the search JSONs, each run's log and
dllogger.json, ``result_<mode>_<precision>.json``, and ``summary.md``, the table also printed.

``--summarize DIR`` only rebuilds the table from the result JSONs in DIR.
Only processes this driver starts are ever stopped (by their own time limits), never others.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from tempo.bert.config import CONFIGS_DIR

MODES = ("original", "tempo")
PRECISION_FLAGS = {"fp32": [], "tf32": ["--tf32"], "fp16": ["--fp16"], "bf16": ["--bf16"]}


def run_squad_command(args: argparse.Namespace, mode: str, precision: str, batch: str, steps: int,
                      out_dir: Path) -> list[str]:
    """A run_squad.py training command line; ``batch`` may be the literal "{batch}"."""
    cmd = [sys.executable, "-m", "tempo.tasks.squad", "--do_train", "--train_file", args.train_file,
           "--config_file", args.config_file, "--vocab_file", args.vocab_file,
           "--max_seq_length", str(args.max_seq_length), "--doc_stride", str(args.doc_stride),
           "--train_batch_size", batch, "--max_steps", str(steps), "--learning_rate", "3e-5",
           "--output_dir", str(out_dir), "--cache_dir", str(args.cache_dir), "--skip_checkpoint",
           "--disable-progress-bar", "--log_freq", str(max(1, steps)), "--num_workers", "2",
           "--tempo" if mode == "tempo" else "--no-tempo", *PRECISION_FLAGS[precision]]
    if args.init_checkpoint:
        cmd += ["--init_checkpoint", args.init_checkpoint]
    return cmd


def _summary_record(dllog_path: Path) -> dict[str, Any]:
    from tempo.train.dllog import read_dllog

    merged: dict[str, Any] = {}
    for record in read_dllog(str(dllog_path)):
        if record["step"] == []:
            merged.update(record["data"])
    return merged


def measure(args: argparse.Namespace, run_dir: Path, mode: str, precision: str) -> dict[str, Any]:
    """Max-batch search, then a throughput run at the batch found."""
    tag = f"{mode}_{precision}"
    search_json = run_dir / f"maxbatch_{tag}.json"
    probe = run_squad_command(args, mode, precision, "{batch}", args.probe_steps, run_dir / f"probe_{tag}")
    search = [sys.executable, "-m", "tempo.bench", "max-batch", "--command", shlex.join(probe),
              "--start", str(args.start_batch), "--max", str(args.max_batch), "--out", str(search_json)]
    if args.probe_timeout:
        search += ["--timeout", str(args.probe_timeout)]
    print(f"== {tag}: searching the largest batch", flush=True)
    with open(run_dir / f"maxbatch_{tag}.log", "w") as log:
        subprocess.run(search, stdout=log, stderr=subprocess.STDOUT, check=False)
    result: dict[str, Any] = {"mode": mode, "precision": precision, "max_batch": 0,
                              "sequences_per_second": None, "error": None}
    try:
        found = json.loads(search_json.read_text())
        result["max_batch"] = int(found.get("max_batch") or 0)
        if found.get("error"):
            result["error"] = f"max-batch search stopped: {str(found['error']).splitlines()[-1]}"
    except (OSError, ValueError, AttributeError) as exc:
        result["error"] = f"max-batch search failed ({exc}); see {run_dir / f'maxbatch_{tag}.log'}"
    if result["max_batch"] > 0:
        print(f"== {tag}: batch {result['max_batch']}, measuring throughput", flush=True)
        out = run_dir / f"run_{tag}"
        cmd = run_squad_command(args, mode, precision, str(result["max_batch"]), args.steps, out)
        with open(run_dir / f"run_{tag}.log", "w") as log:
            status = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, check=False).returncode
        summary = _summary_record(out / "dllogger.json") if (out / "dllogger.json").is_file() else {}
        result["sequences_per_second"] = summary.get("training_sequences_per_second")
        result["peak_memory_bytes"] = summary.get("peak_allocated_bytes", summary.get("peak_rss_bytes"))
        if status != 0:
            result["error"] = f"throughput run exited {status}; see {run_dir / f'run_{tag}.log'}"
    (run_dir / f"result_{tag}.json").write_text(json.dumps(result, indent=2) + "\n")
    return result


def _ratio(new: Any, old: Any) -> str:
    if not isinstance(new, (int, float)) or not isinstance(old, (int, float)) or not old:
        return "n/a"
    return f"{(new / old - 1) * 100:+.1f}%"


def summary_table(results: list[dict[str, Any]], gpu: str = "") -> str:
    """Markdown table in the Tempo README's layout; improvements are Tempo relative to original."""
    lines = [f"SQuAD fine-tuning, original vs Tempo{f' on {gpu}' if gpu else ''}", "",
             "| Model | Precision | Batch size | Throughput (seq/s) | Batch-size improvement | Throughput improvement |",
             "|---|---|---|---|---|---|"]
    by_key = {(r["mode"], r["precision"]): r for r in results}
    precisions = list(dict.fromkeys(r["precision"] for r in results))
    for precision in precisions:
        original = by_key.get(("original", precision), {})
        for mode in MODES:
            r = by_key.get((mode, precision))
            if r is None:
                continue
            speed = r.get("sequences_per_second")
            speed_text = f"{speed:.1f}" if isinstance(speed, (int, float)) else "n/a"
            batch = r.get("max_batch") or None  # 0 = nothing fitted or the search failed: no ratio
            batch_gain = _ratio(batch, original.get("max_batch")) if mode == "tempo" else "-"
            speed_gain = _ratio(speed, original.get("sequences_per_second")) if mode == "tempo" else "-"
            lines.append(f"| {mode.capitalize()} | {precision} | {r.get('max_batch', 0)} | {speed_text} | "
                         f"{batch_gain} | {speed_gain} |")
    errors = [f"- {r['mode']} {r['precision']}: {r['error']}" for r in results if r.get("error")]
    if errors:
        lines += ["", "Problems:", *errors]
    return "\n".join(lines) + "\n"


def summarize(run_dir: str | os.PathLike, gpu: str = "") -> str:
    run_dir = Path(run_dir)
    results = [json.loads(p.read_text()) for p in sorted(run_dir.glob("result_*.json"))]
    order = {m: i for i, m in enumerate(MODES)}
    results.sort(key=lambda r: order.get(r["mode"], len(order)))
    table = summary_table(results, gpu)
    (run_dir / "summary.md").write_text(table)
    return table


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m tempo.bench.squad_benchmark", description=__doc__.split("\n\n")[0])
    p.add_argument("--gpu", default="gpu", help="name of the results folder (2080ti, v100, a100, h100)")
    p.add_argument("--precisions", default="fp32,fp16", help="comma-separated: fp32, tf32, fp16, bf16")
    p.add_argument("--train_file", default=None, help="SQuAD train JSON (default: a generated QA set)")
    p.add_argument("--config_file", default=str(CONFIGS_DIR / "bert_large.json"))
    p.add_argument("--vocab_file", default=None, help="default: the installed MiniLM's (BERT uncased) vocab.txt")
    p.add_argument("--init_checkpoint", default=None, help="weights do not change memory or speed; optional")
    p.add_argument("--max_seq_length", type=int, default=384)
    p.add_argument("--doc_stride", type=int, default=128)
    p.add_argument("--probe_steps", type=int, default=3, help="optimizer steps per max-batch probe")
    p.add_argument("--steps", type=int, default=50, help="optimizer steps of the throughput run")
    p.add_argument("--start_batch", type=int, default=8)
    p.add_argument("--max_batch", type=int, default=1024)
    p.add_argument("--probe_timeout", type=float, default=900.0, help="seconds per probe")
    p.add_argument("--results_root", default=str(Path("results") / "squad_benchmark"))
    p.add_argument("--summarize", metavar="DIR", default=None, help="only print/save the table of DIR")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.summarize:
        print(summarize(args.summarize, args.gpu), end="")
        return 0
    precisions = [p.strip() for p in args.precisions.split(",") if p.strip()]
    unknown = [p for p in precisions if p not in PRECISION_FLAGS]
    if unknown:
        print(f"squad_benchmark: error: unknown precision(s) {unknown}; choose from {list(PRECISION_FLAGS)}",
              file=sys.stderr)
        return 1
    run_dir = Path(args.results_root) / args.gpu / time.strftime("%Y%m%d-%H%M%S")
    run_dir.mkdir(parents=True, exist_ok=False)
    args.cache_dir = run_dir / "feature_cache"
    if args.vocab_file is None:
        from tempo.bert.hf_interop import minilm_dir

        args.vocab_file = str(minilm_dir() / "vocab.txt")
    if args.train_file is None:
        from tempo.bert.data.qa_generator import write_qa_set

        args.train_file = str(write_qa_set(run_dir / "data", num_train=4000, num_dev=100, seed=0)[0])
    print(f"squad_benchmark: results in {run_dir}", flush=True)
    for precision in precisions:
        for mode in MODES:
            measure(args, run_dir, mode, precision)
    print(summarize(run_dir, args.gpu), end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
