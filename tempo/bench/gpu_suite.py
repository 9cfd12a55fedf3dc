"""``python -m tempo.bench gpu-suite`` (= ``scripts/gpu_check.sh``): what the GPU has to confirm, in one run.

Stages, in this order, each a fresh subprocess with its own time limit (so an out-of-memory probe or
a crashed kernel never affects a later stage); its output goes to logs/<stage>.log:

  gpu-tests        pytest -m gpu tests: each Tempo layer's Triton kernels against fp64 at BERT-large
                   shapes in fp32/fp16/bf16, efficient attention and sdpa with padding masks at s=192
                   and 320, the Triton path under torch.compile, BERT-large with Tempo training on CUDA
  ops              bench ops: each Tempo op on inputs larger than 2x L2, GB/s against a device copy
                   of the same size
  layer            bench layer: one BERT-large layer fwd+bwd at b8 s512 and b96 s128, ours (original,
                   Tempo, sdpa, Tempo+sdpa, Tempo floor) vs HF's BertLayer eager and sdpa
  train-s{S}-{V}   bench train: pretraining throughput of BERT-large (bf16, LAMB) at a fixed batch,
                   S in 128/512, V in original / tempo / tempo-sdpa
  squad            tempo.bench.squad_benchmark at s=384 (generated QA set): batch search from 32
                   capped at 64, then a short throughput run, original vs Tempo
  maxbatch-s{S}-{V}  bench max-batch: the largest pretraining batch, each probe a fresh process,
                   searched in units of U sequences (the probe multiplies {batch} by U) up to a cap

A stage that fails or runs out of time is recorded (status, seconds, the tail of its log) and the
suite goes on. The whole run stops starting stages at ``--time-limit`` (default 19 minutes, so one
H100 finishes within 20); a stage gets min(its own limit, the time left). ``--stages`` picks stages
by name or prefix (``--stages maxbatch --time-limit 1800``: all six searches).

Output, results/<gpu>/<YYYYmmdd-HHMMSS>/ (or --out-dir): env.json (GPU name, driver, torch, triton,
CUDA, git commit), command.txt (the exact command line), suite.json (every stage: command, status,
seconds, log tail), the stages' raw JSON / JUnit XML / logs, and summary.md: the results beside the
anchors (DLE on A100, a 45%-MFU H100), every stage's command, and what did not finish. suite.json
and summary.md are rewritten after every stage, so an interrupted run leaves both.

Without CUDA it exits 1 with one line; ``--dry-run`` prints the stage commands instead (any machine).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional

PROG = "python -m tempo.bench gpu-suite"
REPO = Path(__file__).resolve().parents[2]  # the checkout (or /opt/tempo in the image)

SEQ_LENS = (128, 512)
VARIANTS = {"original": [], "tempo": ["--tempo"], "tempo-sdpa": ["--tempo", "--attention", "sdpa"]}
VARIANT_LABELS = {"original": "original", "tempo": "Tempo", "tempo-sdpa": "Tempo+sdpa"}
# Throughput batch per sequence length: fits every variant on an 80 GB GPU with room to spare.
TRAIN_BATCH = {128: 128, 512: 32}
# Max-batch search per sequence length: (unit U, first probe in units, cap in units). Coarse units
# keep a search to ~4 probes of ~20 s; the answer is a multiple of U (exact to within U).
MAXBATCH_GRID = {128: (64, 8, 16), 512: (16, 6, 16)}
TRAIN_FLAGS = ["--model", "bert_large", "--precision", "bf16", "--optimizer", "lamb"]

# Anchors quoted in the issue this suite answers: NVIDIA DLE BERT-large on one A100 (pretraining
# s=128, s=512; SQuAD fine-tuning s=384) and what 45% MFU on an H100 SXM would give.
ANCHORS = {
    ("pretrain", 128): {"dle_a100": 580.0, "h100_45_mfu": 1850.0},
    ("pretrain", 512): {"dle_a100": 210.0, "h100_45_mfu": 436.0},
    ("squad", 384): {"dle_a100": 110.5, "h100_45_mfu": None},
}

DEFAULT_TIME_LIMIT_S = 19 * 60
MIN_STAGE_S = 20  # a stage is not started with less time than this left
TAIL_LINES = 40


@dataclass
class Stage:
    name: str
    argv: list[str]
    timeout_s: float
    outputs: list[str] = field(default_factory=list)  # files (relative to the run dir) it writes
    shell: bool = False  # argv[0] is a shell command line

    @property
    def command(self) -> str:
        return self.argv[0] if self.shell else shlex.join(self.argv)


@dataclass
class StageResult:
    name: str
    command: str
    status: str  # ok | failed | timeout | not-run | interrupted
    timeout_s: float
    seconds: Optional[float] = None
    returncode: Optional[int] = None
    log: Optional[str] = None
    log_tail: str = ""
    outputs: list[str] = field(default_factory=list)
    note: str = ""


# ------------------------------------------------------------------------------------------------
# The plan
# ------------------------------------------------------------------------------------------------
def build_stages(out: Path, gpu_label: str, python: str = sys.executable,
                 probe_python: Optional[str] = None) -> list[Stage]:
    """Every stage's command line, writing into ``out`` (the run directory).

    ``probe_python`` (default ``python``) runs the max-batch probes (tests put a stand-in there)."""
    bench = [python, "-m", "tempo.bench"]
    stages = [
        Stage("gpu-tests", [python, "-m", "pytest", "-m", "gpu", str(REPO / "tests"), "-q", "-rfEs",
                            "-p", "no:cacheprovider", "--junitxml", str(out / "gpu_tests.xml")],
              timeout_s=300, outputs=["gpu_tests.xml"]),
        Stage("ops", [*bench, "ops", "--shapes", "bert-large", "--dtype", "bf16", "--out", str(out / "ops.json")],
              timeout_s=120, outputs=["ops.json"]),
        Stage("layer", [*bench, "layer", "--shapes", "substation", "--precision", "bf16",
                        "--variants", "original,tempo,sdpa,tempo-sdpa,tempo-floor,hf-eager,hf-sdpa", "--warmup", "3",
                        "--repeats", "10", "--out", str(out / "layer.json")],
              timeout_s=150, outputs=["layer.json"]),
    ]
    for seq in SEQ_LENS:
        for variant, flags in VARIANTS.items():
            name = f"train-s{seq}-{variant}"
            stages.append(Stage(name, [*bench, "train", *TRAIN_FLAGS, "--seq-len", str(seq),
                                       "--batch-size", str(TRAIN_BATCH[seq]), "--steps", "10", "--warmup", "3",
                                       *flags, "--out", str(out / f"{name}.json")],
                                timeout_s=75, outputs=[f"{name}.json"]))
    stages.append(Stage("squad", [python, "-m", "tempo.bench.squad_benchmark", "--gpu", gpu_label,
                                  "--precisions", "bf16", "--max_seq_length", "384", "--doc_stride", "128",
                                  "--start_batch", "32", "--max_batch", "64", "--probe_steps", "2",
                                  "--steps", "20", "--probe_timeout", "90", "--results_root", str(out / "squad")],
                        timeout_s=240, outputs=["squad"]))
    for seq in SEQ_LENS:
        unit, start, cap = MAXBATCH_GRID[seq]
        for variant, flags in VARIANTS.items():
            name = f"maxbatch-s{seq}-{variant}"
            probe = shlex.join([probe_python or python, "-m", "tempo.bench", "train", *TRAIN_FLAGS,
                                "--seq-len", str(seq), "--steps", "2",
                                "--warmup", "0", "--quiet", *flags])
            # max-batch substitutes {batch}; the shell (the probe runs under sh -c) multiplies it by
            # the unit, so the search walks a coarse grid: few probes, a bounded time.
            template = f"{probe} --batch-size $(( {{batch}} * {unit} ))"
            stages.append(Stage(name, [*bench, "max-batch", "--command", template, "--start", str(start),
                                       "--max", str(cap), "--timeout", "60", "--out", str(out / f"{name}.json")],
                                timeout_s=100, outputs=[f"{name}.json"]))
    return stages


def select_stages(stages: list[Stage], spec: Optional[str]) -> list[Stage]:
    """``spec``: comma list of stage names or prefixes ("train", "maxbatch-s512"); None: all."""
    if not spec:
        return stages
    wanted = [w.strip() for w in spec.split(",") if w.strip()]
    unknown = [w for w in wanted if not any(s.name == w or s.name.startswith(w) for s in stages)]
    if unknown:
        from tempo.bench.common import BenchError

        raise BenchError(f"--stages: no stage named or starting with {', '.join(unknown)}; "
                         f"stages: {', '.join(s.name for s in stages)}")
    return [s for s in stages if any(s.name == w or s.name.startswith(w) for w in wanted)]


# ------------------------------------------------------------------------------------------------
# Running
# ------------------------------------------------------------------------------------------------
def _tail(path: Path, lines: int = TAIL_LINES) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.rstrip().splitlines()[-lines:])


def _kill_group(proc: subprocess.Popen, grace_s: float = 10.0) -> None:
    """Stop the stage and everything it started (its own process group), TERM first, then KILL."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()


def run_stage(stage: Stage, out: Path, timeout_s: float, cwd: Path = REPO) -> StageResult:
    """Run one stage in its own process group with ``timeout_s``; never raises for its failure."""
    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    log = logs / f"{stage.name}.log"
    result = StageResult(stage.name, stage.command, "failed", timeout_s, log=str(log.relative_to(out)))
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    start = time.monotonic()
    with open(log, "w") as fh:
        fh.write(f"$ {stage.command}\n")
        fh.flush()
        proc = subprocess.Popen(stage.argv[0] if stage.shell else stage.argv, shell=stage.shell, cwd=cwd,
                                stdout=fh, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            result.returncode = proc.wait(timeout=timeout_s)
            result.status = "ok" if result.returncode == 0 else "failed"
            try:  # anything the stage left running in its group would hold GPU memory: stop it
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            result.status = "timeout"
            result.note = f"stopped after {timeout_s:.0f} s"
        except BaseException:  # Ctrl-C / SIGTERM of the suite: stop the stage's processes too
            _kill_group(proc)
            result.status = "interrupted"
            result.seconds = time.monotonic() - start
            result.log_tail = _tail(log)
            raise
    result.seconds = time.monotonic() - start
    result.log_tail = _tail(log)
    result.outputs = [o for o in stage.outputs if (out / o).exists()]
    return result


def run_suite(stages: list[Stage], out: Path, time_limit_s: float, header: dict[str, Any],
              cwd: Path = REPO) -> list[StageResult]:
    """All ``stages`` in order within ``time_limit_s``; suite.json and summary.md after each."""
    deadline = time.monotonic() + time_limit_s
    results = [StageResult(s.name, s.command, "not-run", s.timeout_s, note="not reached") for s in stages]
    write_reports(out, header, results)
    for i, stage in enumerate(stages):
        left = deadline - time.monotonic()
        if left < MIN_STAGE_S:
            results[i].note = f"suite time limit ({time_limit_s:.0f} s) reached"
            write_reports(out, header, results)
            continue
        print(f"[gpu-suite] {stage.name} (limit {min(stage.timeout_s, left):.0f} s): {stage.command}", flush=True)
        try:
            results[i] = run_stage(stage, out, min(stage.timeout_s, left), cwd=cwd)
        except BaseException:
            results[i].status, results[i].note = "interrupted", "the suite was interrupted here"
            write_reports(out, header, results)
            raise
        r = results[i]
        print(f"[gpu-suite] {stage.name}: {r.status} in {r.seconds:.0f} s"
              + (f" (exit {r.returncode})" if r.status == "failed" else ""), flush=True)
        write_reports(out, header, results)
    return results


# ------------------------------------------------------------------------------------------------
# Reading the stages' raw data
# ------------------------------------------------------------------------------------------------
def _load(path: Path) -> Optional[dict[str, Any]]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def junit_counts(path: Path) -> Optional[dict[str, Any]]:
    """passed/failed/errors/skipped and the failing test ids of a pytest JUnit XML file."""
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError):
        return None
    counts = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0, "failing": []}
    for case in root.iter("testcase"):
        tags = {child.tag for child in case}
        test_id = f"{case.get('classname', '')}::{case.get('name', '')}"
        if "failure" in tags:
            counts["failed"] += 1
            counts["failing"].append(test_id)
        elif "error" in tags:
            counts["errors"] += 1
            counts["failing"].append(test_id)
        elif "skipped" in tags:
            counts["skipped"] += 1
        else:
            counts["passed"] += 1
    return counts


def maxbatch_from_log(text: str, unit: int) -> Optional[int]:
    """The largest batch a (possibly unfinished) search saw fit, from max-batch's probe lines."""
    best = None
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("batch ") and line.endswith(": fits"):
            try:
                units = int(line[len("batch "):-len(": fits")])
            except ValueError:
                continue
            best = max(best or 0, units * unit)
    return best


def _fmt(value: Any, spec: str = ".1f", none: str = "n/a") -> str:
    return format(value, spec) if isinstance(value, (int, float)) else none


def _ratio(value: Any, anchor: Any) -> str:
    if not isinstance(value, (int, float)) or not isinstance(anchor, (int, float)) or not anchor:
        return "-"
    return f"{value / anchor:.2f}x"


# ------------------------------------------------------------------------------------------------
# Reports
# ------------------------------------------------------------------------------------------------
def write_reports(out: Path, header: dict[str, Any], results: list[StageResult]) -> None:
    from tempo.utils import atomic_write_text

    atomic_write_text(out / "suite.json", json.dumps(
        {"kind": "gpu_suite", **header, "stages": [asdict(r) for r in results]}, indent=2) + "\n")
    atomic_write_text(out / "summary.md", summary_markdown(out, header, results))


def summary_markdown(out: Path, header: dict[str, Any], results: list[StageResult]) -> str:
    env = header.get("env", {})
    by_name = {r.name: r for r in results}
    done = sum(r.status == "ok" for r in results)
    lines = [f"# Tempo GPU suite: {env.get('device_name', '?')}", "",
             f"- run: `{header.get('started', '?')}`, results in `{out}`",
             f"- GPU {env.get('device_name')} (driver {env.get('driver')}, compute capability "
             f"{env.get('compute_capability')}, {_fmt((env.get('gpu_memory_bytes') or 0) / 2**30, '.0f')} GiB)",
             f"- torch {env.get('torch')}, triton {env.get('triton')}, CUDA {env.get('cuda')}, "
             f"python {env.get('python')}",
             f"- commit {header.get('git_commit') or 'unknown'}"
             + (" (uncommitted changes)" if header.get("git_dirty") else ""),
             *([f"- invoked as: `{header['invoked_as']}`"] if header.get("invoked_as") else []),
             f"- command: `{header.get('command', '?')}` (cwd `{header.get('cwd', '?')}`)",
             f"- stages: {done} of {len(results)} ok", ""]
    unfinished = [r for r in results if r.status != "ok"]
    if unfinished:
        lines += ["## Did not finish", ""]
        for r in unfinished:
            detail = r.note or (f"exit {r.returncode}" if r.returncode is not None else "")
            lines.append(f"- **{r.name}**: {r.status}" + (f" ({detail})" if detail else "")
                         + (f", log `{r.log}`" if r.log else ""))
        lines.append("")

    lines += _tests_section(out, by_name.get("gpu-tests"))
    lines += _training_section(out, by_name)
    lines += _squad_section(out, by_name.get("squad"))
    lines += _ops_section(out)
    lines += _layer_section(out)

    lines += ["## Stages", "", "| stage | status | seconds | limit (s) |", "|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r.name} | {r.status} | {_fmt(r.seconds, '.0f', '-')} | {r.timeout_s:.0f} |")
    lines += ["", "Commands (run from the repository root):", ""]
    for r in results:
        lines += [f"- {r.name}:", "", "  ```", f"  {r.command}", "  ```"]
    failed_tails = [r for r in results if r.status in ("failed", "timeout", "interrupted") and r.log_tail]
    if failed_tails:
        lines += ["", "## Log tails of the stages that did not finish", ""]
        for r in failed_tails:
            lines += [f"### {r.name} ({r.status})", "", "```", *r.log_tail.splitlines()[-20:], "```", ""]
    return "\n".join(lines).rstrip() + "\n"


def _tests_section(out: Path, r: Optional[StageResult]) -> list[str]:
    lines = ["## GPU tests (`pytest -m gpu`)", ""]
    counts = junit_counts(out / "gpu_tests.xml")
    if counts is None:
        return lines + [f"No JUnit report ({r.status if r else 'not run'}).", ""]
    lines.append(f"{counts['passed']} passed, {counts['failed']} failed, {counts['errors']} errors, "
                 f"{counts['skipped']} skipped" + (f" ({r.status})" if r and r.status != "ok" else ""))
    for test_id in counts["failing"][:30]:
        lines.append(f"- FAILED {test_id}")
    return lines + [""]


def _training_section(out: Path, by_name: dict[str, StageResult]) -> list[str]:
    lines = ["## Pretraining, BERT-large, bf16, LAMB", "",
             "| seq | model | batch | seq/s | MFU | vs DLE A100 | vs H100 at 45% MFU | largest batch | peak GiB |",
             "|---|---|---|---|---|---|---|---|---|"]
    for seq in SEQ_LENS:
        anchors = ANCHORS[("pretrain", seq)]
        unit = MAXBATCH_GRID[seq][0]
        for variant in VARIANTS:
            rec = _load(out / f"train-s{seq}-{variant}.json")
            speed = rec.get("samples_per_s") if rec else None
            mfu = rec.get("mfu") if rec else None
            peak = ((rec or {}).get("memory") or {}).get("peak_allocated_bytes")
            stage = by_name.get(f"train-s{seq}-{variant}")
            speed_text = _fmt(speed) if rec else (stage.status if stage else "n/a")
            lines.append(f"| {seq} | {VARIANT_LABELS[variant]} | {TRAIN_BATCH[seq]} | {speed_text} | "
                         f"{f'{mfu:.1%}' if isinstance(mfu, (int, float)) else 'n/a'} | "
                         f"{_ratio(speed, anchors['dle_a100'])} | {_ratio(speed, anchors['h100_45_mfu'])} | "
                         f"{_maxbatch_text(out, by_name.get(f'maxbatch-s{seq}-{variant}'), seq, variant, unit)} | "
                         f"{_fmt(peak / 2**30 if peak else None, '.1f')} |")
    lines += ["", "Anchors: DLE BERT-large pretraining on one A100, 580 seq/s at s=128 and 210 at s=512; "
              "45% MFU on an H100 SXM is about 1850 seq/s at s=128 and 436 at s=512. "
              f"Largest batch: bf16, LAMB, searched on a grid of {MAXBATCH_GRID[128][0]} (s=128) and "
              f"{MAXBATCH_GRID[512][0]} (s=512) sequences up to the cap "
              f"({MAXBATCH_GRID[128][0] * MAXBATCH_GRID[128][2]} / {MAXBATCH_GRID[512][0] * MAXBATCH_GRID[512][2]}); "
              "'>= N': the search did not finish, N fitted.", ""]
    return lines


def _maxbatch_text(out: Path, r: Optional[StageResult], seq: int, variant: str, unit: int) -> str:
    rec = _load(out / f"maxbatch-s{seq}-{variant}.json")
    cap = unit * MAXBATCH_GRID[seq][2]
    if rec is not None and isinstance(rec.get("max_batch"), int):
        value = rec["max_batch"] * unit
        return f"{value}" + (" (cap)" if value >= cap else "")
    seen = maxbatch_from_log(_tail(out / "logs" / f"maxbatch-s{seq}-{variant}.log", 10_000), unit)
    if seen:
        return f">= {seen}"
    return r.status if r else "n/a"


def _squad_section(out: Path, r: Optional[StageResult]) -> list[str]:
    lines = ["## SQuAD fine-tuning, s=384, bf16 (generated QA set)", ""]
    results = [_load(p) for p in sorted((out / "squad").glob("**/result_*.json"))]
    results = [x for x in results if x]
    if not results:
        return lines + [f"No results ({r.status if r else 'not run'}).", ""]
    anchor = ANCHORS[("squad", 384)]["dle_a100"]
    lines += ["| model | largest batch (cap 64) | seq/s | vs DLE A100 (110.5) | problem |", "|---|---|---|---|---|"]
    for x in results:
        lines.append(f"| {x.get('mode')} | {x.get('max_batch')} | {_fmt(x.get('sequences_per_second'))} | "
                     f"{_ratio(x.get('sequences_per_second'), anchor)} | {x.get('error') or ''} |")
    return lines + [""]


def _ops_section(out: Path) -> list[str]:
    rec = _load(out / "ops.json")
    if rec is None:
        return []
    lines = ["## Tempo ops alone (bf16, inputs > 2x L2)", "",
             "| op | impl | batch | input MB | fwd GB/s | bwd GB/s | fwd+bwd GB/s | of copy (fwd+bwd) |",
             "|---|---|---|---|---|---|---|---|"]
    for row in rec.get("rows", []):
        if row.get("status") != "ok":
            lines.append(f"| {row.get('op')} | {row.get('impl')} | {row.get('batch', '')} | | {row.get('status')} | | | |")
            continue
        cells = [_fmt((row.get(m) or {}).get("gb_per_s"), ".0f") for m in ("fwd", "bwd", "both")]
        lines.append(f"| {row['op']} | {row['impl']} | {row.get('batch')} | {_fmt(row.get('input_bytes', 0) / 1e6, '.0f')} | "
                     f"{' | '.join(cells)} | {_fmt(((row.get('both') or {}).get('of_copy_bandwidth') or 0) * 100, '.0f')}% |")
    return lines + ["", f"Device copy (256 MiB): {_fmt(rec.get('copy_bandwidth_gb_per_s'), '.0f')} GB/s; "
                    f"L2 {_fmt((rec.get('l2_cache_bytes') or 0) / 2**20, '.0f')} MiB.", ""]


def _layer_section(out: Path) -> list[str]:
    rec = _load(out / "layer.json")
    if rec is None:
        return []
    lines = ["## One BERT-large layer, fwd+bwd, bf16", "",
             "| shape | variant | fwd+bwd p50 ms | fwd p50 ms | saved MiB |", "|---|---|---|---|---|"]
    for row in rec.get("rows", []):
        shape = f"b{row.get('batch')} s{row.get('seq_len')}"
        if row.get("status") != "ok":
            lines.append(f"| {shape} | {row.get('variant')} | {row.get('status')} | | |")
            continue
        both = ((row.get("fwd+bwd") or {}).get("ms") or {}).get("p50")
        fwd = ((row.get("fwd") or {}).get("ms") or {}).get("p50")
        ledger = row.get("ledger_bytes")
        lines.append(f"| {shape} | {row['variant']} | {_fmt(both, '.2f')} | {_fmt(fwd, '.2f')} | "
                     f"{_fmt(ledger / 2**20 if ledger else None, '.0f', '-')} |")
    return lines + [""]


# ------------------------------------------------------------------------------------------------
# Command line
# ------------------------------------------------------------------------------------------------
def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dry-run", action="store_true", help="print the stage commands and exit (any machine)")
    p.add_argument("--stages", default=None, help="comma list of stage names or prefixes (default: all)")
    p.add_argument("--time-limit", type=float, default=DEFAULT_TIME_LIMIT_S,
                   help=f"seconds for the whole suite (default {DEFAULT_TIME_LIMIT_S})")
    p.add_argument("--results-root", default="results", help="results/<gpu>/<timestamp>/ goes here")
    p.add_argument("--out-dir", default=None, help="exact run directory instead")


def _invocation(argv: Optional[list[str]]) -> str:
    args = sys.argv[1:] if argv is None else argv
    return shlex.join([sys.executable, "-m", "tempo.bench", *args])


def main(args: argparse.Namespace) -> int:
    import torch

    from tempo.bench.common import BenchError
    from tempo.bench.hardware import device_label, environment
    from tempo.bench.results import new_results_dir

    if args.time_limit <= 0:
        raise BenchError(f"--time-limit must be positive, got {args.time_limit}")
    on_cuda = torch.cuda.is_available()
    if not on_cuda and not args.dry_run:
        raise BenchError(f"no CUDA GPU visible (torch {torch.__version__}, built for CUDA {torch.version.cuda}): "
                         f"the GPU suite needs one; --dry-run prints its stages")
    label = device_label("cuda") if on_cuda else "cpu"
    if args.dry_run:
        out = Path(args.out_dir) if args.out_dir else Path(args.results_root) / label / time.strftime("%Y%m%d-%H%M%S")
        stages = select_stages(build_stages(out.resolve(), label), args.stages)
        print(f"# gpu-suite dry run: {len(stages)} stages, time limit {args.time_limit:.0f} s, "
              f"results would go to {out}/ (cwd {REPO})")
        for s in stages:
            print(f"{s.name}\t{s.timeout_s:.0f}\t{s.command}")
        return 0

    out = Path(args.out_dir) if args.out_dir else new_results_dir(args.results_root, "cuda")
    out.mkdir(parents=True, exist_ok=True)
    out = out.resolve()
    stages = select_stages(build_stages(out, label), args.stages)
    env = environment("cuda")
    commit, dirty = env.get("git_commit"), env.get("git_dirty")
    if commit is None and os.environ.get("TEMPO_GIT_COMMIT"):  # the image has no .git: build.sh bakes it in
        commit, dirty = os.environ["TEMPO_GIT_COMMIT"] + " (from the image build)", None
    header = {"started": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "command": _invocation(getattr(args, "argv", None)),
              # scripts/gpu_check.sh exports its own command line here
              "invoked_as": os.environ.get("TEMPO_GPU_CHECK_COMMAND"), "cwd": os.getcwd(), "time_limit_s": args.time_limit, "git_commit": commit, "git_dirty": dirty,
              "env": env}
    from tempo.utils import atomic_write_text

    atomic_write_text(out / "env.json", json.dumps(env, indent=2) + "\n")
    atomic_write_text(out / "command.txt", "".join(f"{c}\n" for c in (header["invoked_as"], header["command"]) if c)
                      + f"# cwd: {header['cwd']}\n")
    print(f"[gpu-suite] {env.get('device_name')}, torch {env.get('torch')}, triton {env.get('triton')}, "
          f"CUDA {env.get('cuda')}, driver {env.get('driver')}; results in {out}", flush=True)
    # SIGTERM (e.g. from `timeout`) becomes KeyboardInterrupt: the running stage's process group
    # is stopped and the reports say where the suite was interrupted.
    previous = signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        results = run_suite(stages, out, args.time_limit, header)
    finally:
        signal.signal(signal.SIGTERM, previous)
    bad = [r.name for r in results if r.status != "ok"]
    print(f"[gpu-suite] {len(results) - len(bad)} of {len(results)} stages ok; summary: {out / 'summary.md'}"
          + (f"; not ok: {', '.join(bad)}" if bad else ""), flush=True)
    return 0 if not bad else 4
