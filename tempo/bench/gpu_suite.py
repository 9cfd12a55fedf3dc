"""``python -m tempo.bench gpu-suite`` (= ``scripts/gpu_check.sh``): what the GPU has to confirm, in one run.

Two plans, each stage a fresh subprocess with its own time limit (so an out-of-memory probe or a
crashed kernel never affects a later stage), its output in logs/<stage>.log:

  * the quick plan (the default): at most 7 minutes on one H100, for a GPU lent for 15 minutes:
    environment, correctness against fp64 (two stages), memory truth, speed, the projections of
    tempo.movement, speed under torch.compile, the largest batch; no stage starts after 6.5
    minutes. Its stages live in tempo/bench/gpu_quick.py (its docstring says what each does; each
    runs alone as ``python -m tempo.bench.gpu_quick <stage> --out DIR``, on the CPU at tiny shapes
    with ``--device cpu --tiny``). ``--tarball PATH`` packs the run folder into one file (and copies
    summary.md beside it): a lent machine hands back at most a few files.
  * the full plan (``--full``), 25 minutes, below.

The full plan's stages, in this order. They come in three parts (``--part``, which implies
``--full``), each of whose limits add up to at most 9.5 minutes, so that a part fits one command on
a machine that allows 10 minutes per command:

  part 1, tests
  gpu-tests        pytest -m gpu: every test that runs on CUDA. tests/test_gpu.py (each Tempo
                   layer's Triton kernels against fp64 at BERT-large shapes in fp32/fp16/bf16,
                   efficient attention and sdpa with padding masks, the Triton path under
                   torch.compile, BERT-large with Tempo training on CUDA), the attention tests
                   marked gpu, and the CUDA cases of the CPU test files (the ``device`` fixture's
                   "cuda" case and any parameter naming "cuda": tests/conftest.py marks them gpu;
                   about 530 tests). Each test is stopped after 120 s (pytest-timeout).
  part 2, benchmarks
  ops              bench ops: each Tempo op on inputs larger than 2x L2, GB/s against a device copy
                   of the same size
  layer            bench layer: one BERT-large layer fwd+bwd at b8 s512 and b96 s128, ours (original,
                   Tempo, sdpa, Tempo+sdpa, Tempo floor) vs HF's BertLayer eager and sdpa
  train-s{S}-{V}   bench train: pretraining throughput of BERT-large (bf16, LAMB) at a fixed batch,
                   S in 128/512, V in original / tempo / tempo-sdpa
  squad            tempo.bench.squad_benchmark at s=384 (generated QA set): batch search from 32
                   capped at 64, then a short throughput run, original vs Tempo
  part 3, max-batch
  maxbatch-s{S}-{V}  bench max-batch: the largest pretraining batch, each probe a fresh process,
                   searched in units of U sequences (the probe multiplies {batch} by U) up to a cap

The budget: the stage limits (``--full --dry-run`` prints each, each part's sum and the total) add
up to the default ``--time-limit``, 1,500 s (25 minutes) for everything (the quick plan: 420 s of
limits, no stage started after ``--time-limit`` 390 s). A stage that fails or runs out
of time is recorded (status, seconds, the tail of its log) and the suite goes on. The whole run
stops starting stages at ``--time-limit``; a stage gets min(its own limit, the time left), and a
selection whose limits add up to more than ``--time-limit`` is named up front with the stages
that may not be reached. ``--stages`` picks stages by name or prefix, ``--part`` by part.

Output, results/<gpu>/<YYYYmmdd-HHMMSS>/ (or --out-dir): env.json (GPU name, driver, torch, triton,
CUDA, git commit), command.txt (the exact command lines), suite.json (every stage: command, status,
seconds, log tail), the stages' raw JSON / JUnit XML / logs, and summary.md: the results beside the
anchors (DLE on A100, a 45%-MFU H100), every stage's command, and what did not finish. suite.json
and summary.md are rewritten after every stage, so an interrupted run leaves both. A run into an
``--out-dir`` that already holds a suite.json keeps the records of the stages it does not run, so
the three parts, run one after another into one folder, make one summary:

  scripts/gpu_check.sh --part 1 --out-dir results/h100/run1   # then --part 2, then --part 3

Without CUDA it exits 1 with one line; ``--dry-run`` prints the stage commands instead (any machine).
"""

from __future__ import annotations

import argparse
import dataclasses
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

# Stage limits in seconds. The tests: ~530 tests, most at small shapes; the time goes to compiling
# each kernel specialization once (about 0.5 s each), to torch.compile and to the BERT-large tests.
TESTS_LIMIT_S = 540
PER_TEST_TIMEOUT_S = 120  # one hung test must not take the stage's whole budget
OPS_LIMIT_S, LAYER_LIMIT_S, SQUAD_LIMIT_S = 60, 75, 135
# One bench train process: start, build BERT-large, 3 warm-up + 10 timed steps of ~0.1-0.3 s.
TRAIN_LIMIT_S = 40
# One max-batch search: ~5 probes of ~15 s (a fresh process each), the probe timeout 60 s.
MAXBATCH_LIMIT_S = 75
PARTS = {1: "tests", 2: "benchmarks", 3: "max-batch"}
# A part fits one 10-minute command with 30 s for the suite's own start and reports.
PART_LIMIT_S = 570
DEFAULT_TIME_LIMIT_S = (TESTS_LIMIT_S + OPS_LIMIT_S + LAYER_LIMIT_S + 2 * 3 * TRAIN_LIMIT_S + SQUAD_LIMIT_S
                        + 2 * 3 * MAXBATCH_LIMIT_S)  # every stage's limit: 1,500 s
MIN_STAGE_S = 20  # a stage is not started with less time than this left
TAIL_LINES = 40
STOP_GRACE_S = 10.0  # a stage stopped at its limit gets TERM, then KILL after this
QUICK_CHECKS_FAILED_EXIT = 5  # tempo.bench.gpu_quick.CHECKS_FAILED_EXIT: the stage ran, a check failed
# The quick plan's budget (tempo/bench/gpu_quick.py holds its stages and their limits)
QUICK_BUDGET_S = 420  # = gpu_quick.QUICK_BUDGET_S
QUICK_DEADLINE_S = 390  # = gpu_quick.QUICK_DEADLINE_S


@dataclass
class Stage:
    name: str
    argv: list[str]
    timeout_s: float
    outputs: list[str] = field(default_factory=list)  # files (relative to the run dir) it writes
    shell: bool = False  # argv[0] is a shell command line
    part: int = 1  # PARTS
    env: dict[str, str] = field(default_factory=dict)  # set for this stage's process, on top of the suite's

    @property
    def command(self) -> str:
        command = self.argv[0] if self.shell else shlex.join(self.argv)
        return " ".join([*(f"{k}={shlex.quote(v)}" for k, v in self.env.items()), command])


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
                            "-p", "no:cacheprovider", "--timeout", str(PER_TEST_TIMEOUT_S),
                            "--junitxml", str(out / "gpu_tests.xml")],
              timeout_s=TESTS_LIMIT_S, outputs=["gpu_tests.xml"], part=1),
        Stage("ops", [*bench, "ops", "--shapes", "bert-large", "--dtype", "bf16", "--out", str(out / "ops.json")],
              timeout_s=OPS_LIMIT_S, outputs=["ops.json"], part=2),
        Stage("layer", [*bench, "layer", "--shapes", "substation", "--precision", "bf16",
                        "--variants", "original,tempo,sdpa,tempo-sdpa,tempo-floor,hf-eager,hf-sdpa", "--warmup", "3",
                        "--repeats", "10", "--out", str(out / "layer.json")],
              timeout_s=LAYER_LIMIT_S, outputs=["layer.json"], part=2),
    ]
    for seq in SEQ_LENS:
        for variant, flags in VARIANTS.items():
            name = f"train-s{seq}-{variant}"
            stages.append(Stage(name, [*bench, "train", *TRAIN_FLAGS, "--seq-len", str(seq),
                                       "--batch-size", str(TRAIN_BATCH[seq]), "--steps", "10", "--warmup", "3",
                                       *flags, "--out", str(out / f"{name}.json")],
                                timeout_s=TRAIN_LIMIT_S, outputs=[f"{name}.json"], part=2))
    stages.append(Stage("squad", [python, "-m", "tempo.bench.squad_benchmark", "--gpu", gpu_label,
                                  "--precisions", "bf16", "--max_seq_length", "384", "--doc_stride", "128",
                                  "--start_batch", "32", "--max_batch", "64", "--probe_steps", "2",
                                  "--steps", "20", "--probe_timeout", "90", "--results_root", str(out / "squad")],
                        timeout_s=SQUAD_LIMIT_S, outputs=["squad"], part=2))
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
                                timeout_s=MAXBATCH_LIMIT_S, outputs=[f"{name}.json"], part=3))
    return stages


def select_stages(stages: list[Stage], spec: Optional[str], parts: Optional[set[int]] = None) -> list[Stage]:
    """``spec``: comma list of stage names or prefixes ("train", "maxbatch-s512"); None: all.
    ``parts`` (PARTS numbers) keeps only the stages of those parts."""
    if parts:
        stages = [s for s in stages if s.part in parts]
    if not spec:
        return stages
    wanted = [w.strip() for w in spec.split(",") if w.strip()]
    unknown = [w for w in wanted if not any(s.name == w or s.name.startswith(w) for s in stages)]
    if unknown:
        from tempo.bench.common import BenchError

        raise BenchError(f"--stages: no stage named or starting with {', '.join(unknown)}; "
                         f"stages: {', '.join(s.name for s in stages)}")
    return [s for s in stages if any(s.name == w or s.name.startswith(w) for w in wanted)]


def parse_parts(text: str) -> set[int]:
    """``--part``: comma list of part numbers or names ("1", "2,3", "tests,max-batch")."""
    by_name = {name: number for number, name in PARTS.items()}
    parts = set()
    for word in (w.strip() for w in text.split(",")):
        if word.isdigit() and int(word) in PARTS:
            parts.add(int(word))
        elif word in by_name:
            parts.add(by_name[word])
        else:
            choices = ", ".join(f"{n} ({name})" for n, name in PARTS.items())
            raise argparse.ArgumentTypeError(f"no part {word!r}; parts: {choices}")
    return parts


def budget_lines(stages: list[Stage], time_limit_s: float) -> list[str]:
    """What ``--dry-run`` prints after the stages: each part's limits, the total, what may not run."""
    lines = []
    for number, name in PARTS.items():
        in_part = [s for s in stages if s.part == number]
        if in_part:
            total = sum(s.timeout_s for s in in_part)
            lines.append(f"# part {number} ({name}): {len(in_part)} stage{'s' if len(in_part) != 1 else ''}, "
                         f"limits add up to {total:.0f} s")
    total = sum(s.timeout_s for s in stages)
    lines.append(f"# total: {total:.0f} s of stage limits, time limit {time_limit_s:.0f} s")
    short = stages_past_the_limit(stages, time_limit_s)
    if short:
        lines.append(f"# over budget: if every stage used its limit, these would be cut short or not run: "
                     f"{', '.join(short)}")
    return lines


def stages_past_the_limit(stages: list[Stage], time_limit_s: float) -> list[str]:
    """Names of the stages that would not get their whole limit if every earlier stage used its own."""
    names, used = [], 0.0
    for stage in stages:
        used += stage.timeout_s
        if used > time_limit_s:
            names.append(stage.name)
    return names


# ------------------------------------------------------------------------------------------------
# Running
# ------------------------------------------------------------------------------------------------
def _tail(path: Path, lines: int = TAIL_LINES) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.rstrip().splitlines()[-lines:])


def _kill_group(proc: subprocess.Popen, grace_s: float = STOP_GRACE_S) -> None:
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
    # TEMPO_STAGE_TIMEOUT_S: the seconds this stage is given (a stage with a time budget of its own,
    # the quick plan's max-batch, fits it inside them)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **stage.env, "TEMPO_STAGE_TIMEOUT_S": f"{timeout_s:.0f}"}
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
              cwd: Path = REPO, carried: Optional[list[StageResult]] = None,
              order: Optional[list[str]] = None) -> list[StageResult]:
    """All ``stages`` in order within ``time_limit_s``; suite.json and summary.md after each.

    ``carried``: records of stages an earlier run into ``out`` made and this one does not run;
    the reports hold them too, everything in ``order`` (stage names; default: as given)."""
    deadline = time.monotonic() + time_limit_s
    results = [StageResult(s.name, s.command, "not-run", s.timeout_s, note="not reached") for s in stages]
    kept = {r.name: r for r in carried or [] if r.name not in {s.name for s in stages}}

    def report() -> None:
        current = {r.name: r for r in results}
        names = order or [*current, *kept]
        merged = [current.get(n) or kept.get(n) for n in names]
        merged += [r for n, r in {**kept, **current}.items() if n not in names]
        write_reports(out, header, [r for r in merged if r is not None])

    report()
    for i, stage in enumerate(stages):
        left = deadline - time.monotonic()
        if left < MIN_STAGE_S:
            results[i].note = f"suite time limit ({time_limit_s:.0f} s) reached"
            report()
            continue
        print(f"[gpu-suite] {stage.name} (limit {min(stage.timeout_s, left):.0f} s): {stage.command}", flush=True)
        try:
            results[i] = run_stage(stage, out, min(stage.timeout_s, left), cwd=cwd)
        except BaseException:
            results[i].status, results[i].note = "interrupted", "the suite was interrupted here"
            report()
            raise
        r = results[i]
        print(f"[gpu-suite] {stage.name}: {r.status} in {r.seconds:.0f} s"
              + (f" (exit {r.returncode})" if r.status == "failed" else ""), flush=True)
        report()
    return results


def earlier_run(out: Path) -> tuple[list[StageResult], list[str]]:
    """The stage records and commands of an earlier run into ``out`` (none: empty lists)."""
    record = _load(out / "suite.json")
    if not record or record.get("kind") != "gpu_suite":
        return [], []
    names = {f.name for f in dataclasses.fields(StageResult)}
    results = [StageResult(**{k: v for k, v in stage.items() if k in names}) for stage in record.get("stages", [])]
    commands = [*record.get("earlier_commands", []), record.get("command")]
    return results, [c for c in commands if c]


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
    quick = header.get("plan") == "quick"
    env = header.get("env", {})
    if quick:  # the env stage's record is the fuller one
        env = {**env, **((_load(out / "env.json") or {}).get("env") or {})}
    by_name = {r.name: r for r in results}
    done = sum(r.status == "ok" for r in results)
    title = "Tempo GPU check (quick plan)" if quick else "Tempo GPU suite"
    lines = [f"# {title}: {env.get('device_name', '?')}", "",
             f"- run: `{header.get('started', '?')}`, results in `{out}`",
             f"- GPU {env.get('device_name')} (driver {env.get('driver')}, compute capability "
             f"{env.get('compute_capability')}, {_fmt((env.get('gpu_memory_bytes') or 0) / 2**30, '.0f')} GiB)",
             f"- torch {env.get('torch')}, triton {env.get('triton')}, CUDA {env.get('cuda')}, "
             f"python {env.get('python')}",
             f"- commit {header.get('git_commit') or 'unknown'}"
             + (" (uncommitted changes)" if header.get("git_dirty") else ""),
             *([f"- invoked as: `{header['invoked_as']}`"] if header.get("invoked_as") else []),
             f"- command: `{header.get('command', '?')}` (cwd `{header.get('cwd', '?')}`)",
             *[f"- earlier run into this folder: `{c}`" for c in header.get("earlier_commands", [])],
             *([f"- no stage starts after {header['time_limit_s']:.0f} s"] if quick and header.get("time_limit_s")
               else []),
             f"- stages: {done} of {len(results)} ok", ""]
    unfinished = [r for r in results if r.status != "ok"]
    if unfinished:
        lines += ["## Did not finish", ""]
        for r in unfinished:
            detail = r.note or (f"exit {r.returncode}" if r.returncode is not None else "")
            if quick and r.returncode == QUICK_CHECKS_FAILED_EXIT:
                detail += ": it ran, and a check failed or a measurement was refused (its section says which)"
            lines.append(f"- **{r.name}**: {r.status}" + (f" ({detail})" if detail else "")
                         + (f", log `{r.log}`" if r.log else ""))
        lines.append("")

    if quick:
        from tempo.bench.gpu_quick import summary_sections

        lines += summary_sections(out, by_name)
    else:
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
    from tempo.utils import positive_number

    p.add_argument("--full", action="store_true",
                   help=f"the full 25-minute plan (default: the quick plan, at most {QUICK_BUDGET_S} s)")
    p.add_argument("--dry-run", action="store_true",
                   help="print the plan's stages, their limits and deadlines, and exit (any machine)")
    p.add_argument("--stages", default=None, help="comma list of stage names or prefixes (default: all)")
    p.add_argument("--part", type=parse_parts, default=None,
                   help="the full plan's parts (implies --full): " + ", ".join(f"{n} ({name})" for n, name in PARTS.items())
                        + f"; each part's limits add up to at most {PART_LIMIT_S} s (default: all)")
    p.add_argument("--time-limit", type=positive_number, default=None,
                   help=f"no stage starts after this many seconds (default: quick plan {QUICK_DEADLINE_S}; full plan "
                        f"the selected stages' limits added up, {DEFAULT_TIME_LIMIT_S} for all)")
    p.add_argument("--results-root", default="results", help="results/<gpu>/<timestamp>/ goes here")
    p.add_argument("--out-dir", default=None, help="exact run directory instead")
    p.add_argument("--tarball", default=None, metavar="PATH",
                   help="also pack the run directory into PATH (.tar.gz; member names <gpu>/<timestamp>/... under "
                        "--results-root) and copy summary.md beside it, after the run (or its interruption)")


def _time_limit(args: argparse.Namespace, stages: list[Stage], plan: str = "full") -> float:
    """--time-limit, else the quick plan's deadline, or the full plan's selected stages' limits
    added up (the whole suite: DEFAULT_TIME_LIMIT_S)."""
    if args.time_limit is not None:
        return args.time_limit
    return float(QUICK_DEADLINE_S) if plan == "quick" else float(sum(s.timeout_s for s in stages))


def _invocation(argv: Optional[list[str]]) -> str:
    args = sys.argv[1:] if argv is None else argv
    return shlex.join([sys.executable, "-m", "tempo.bench", *args])


def plan_stages(plan: str, out: Path, label: str) -> list[Stage]:
    """Every stage of ``plan`` ("quick" or "full"), writing into ``out``."""
    if plan == "quick":
        from tempo.bench.gpu_quick import quick_stages

        return quick_stages(out)
    return build_stages(out, label)


def quick_budget_lines(stages: list[Stage], time_limit_s: float) -> list[str]:
    """What ``--dry-run`` prints after the quick plan's stages."""
    total = sum(s.timeout_s for s in stages)
    lines = [f"# quick plan: {len(stages)} stages, limits add up to {total:.0f} s (budget {QUICK_BUDGET_S} s); "
             f"no stage starts after {time_limit_s:.0f} s and a stage gets min(its limit, the time left), so the run "
             f"ends by about {time_limit_s:.0f} s (+ {STOP_GRACE_S:.0f} s to stop a stage, + the summary)"]
    short = stages_past_the_limit(stages, time_limit_s)
    if short:
        lines.append(f"# if every stage used its whole limit, these would be cut short or not run: {', '.join(short)}")
    return lines



def _gpu_name_without_a_context() -> Optional[str]:
    """The GPU's name from nvidia-smi, else from a child process: this process must not hold a CUDA
    context (~0.5 GB of GPU memory) while the stages measure memory."""
    for command in (["nvidia-smi", "--query-gpu=name", "--format=csv,noheader", "--id=0"],
                    [sys.executable, "-c", "import torch; print(torch.cuda.get_device_name())"]):
        try:
            out = subprocess.run(command, capture_output=True, text=True, timeout=60)
        except (OSError, subprocess.SubprocessError):
            continue
        if out.returncode == 0 and out.stdout.strip():
            return out.stdout.strip().splitlines()[0].strip()
    return None


def _label_of(name: Optional[str]) -> str:
    """results/<label>/ for a GPU name, as tempo.bench.hardware.device_label makes it."""
    from tempo.bench.hardware import known_gpu

    if not name:
        return "cuda"
    name = known_gpu(name) or name
    return "".join(c if c.isalnum() else "-" for c in name.lower()).strip("-")


def _new_run_dir(root: str, label: str) -> Path:
    base = Path(root) / label
    stamp = time.strftime("%Y%m%d-%H%M%S")
    path, n = base / stamp, 1
    while path.exists():
        path, n = base / f"{stamp}-{n}", n + 1
    return path


def write_tarball(out: Path, tarball: Path, results_root: Path) -> Path:
    """``out`` packed into ``tarball`` (gzip), its members named by ``out``'s path under
    ``results_root`` (else by its own name), and summary.md copied beside the tarball."""
    import shutil
    import tarfile

    try:
        arcname = str(out.resolve().relative_to(results_root.resolve()))
    except ValueError:
        arcname = out.name
    tarball.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(tarball, "w:gz") as tar:
        tar.add(out, arcname=arcname)
    if (out / "summary.md").exists():
        shutil.copyfile(out / "summary.md", tarball.parent / "summary.md")
    return tarball


def _quick_environment(name: Optional[str]) -> dict[str, Any]:
    """What the suite's own process knows without a CUDA context (the env stage records the rest)."""
    import platform

    import torch

    from tempo.bench.hardware import known_gpu
    from tempo.utils import git_commit

    try:
        from importlib import metadata

        triton_version = metadata.version("triton")
    except Exception:  # noqa: BLE001 - not installed
        triton_version = None
    driver = None
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader", "--id=0"],
                             capture_output=True, text=True, timeout=30)
        driver = smi.stdout.strip() or None if smi.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        pass
    return {"device_name": name, "gpu": known_gpu(name) if name else None, "driver": driver, "torch": torch.__version__,
            "cuda": torch.version.cuda, "triton": triton_version, "python": platform.python_version(),
            "host": platform.node(), **{f"git_{k}": v for k, v in git_commit().items()}}


def main(args: argparse.Namespace) -> int:
    import torch

    from tempo.bench.common import BenchError

    plan = "full" if args.full or args.part is not None else "quick"
    on_cuda = torch.cuda.is_available()
    if not on_cuda and not args.dry_run:
        raise BenchError(f"no CUDA GPU visible (torch {torch.__version__}, built for CUDA {torch.version.cuda}): "
                         f"the GPU suite needs one; --dry-run prints its stages")
    if plan == "full":
        from tempo.bench.hardware import device_label

        label = device_label("cuda") if on_cuda else "cpu"
        name = None
    else:
        name = _gpu_name_without_a_context() if on_cuda else None
        label = _label_of(name) if on_cuda else "cpu"
    if args.dry_run:
        out = Path(args.out_dir) if args.out_dir else Path(args.results_root) / label / time.strftime("%Y%m%d-%H%M%S")
        stages = select_stages(plan_stages(plan, out.resolve(), label), args.stages, args.part)
        time_limit = _time_limit(args, stages, plan)
        if plan == "quick":
            print(f"# gpu-suite dry run, quick plan: {len(stages)} stages, no stage starts after {time_limit:.0f} s, "
                  f"results would go to {out}/ (cwd {REPO})")
            print("# stage\tlimit s\tstarts by s\tcommand")
            start = 0.0
            for s in stages:
                print(f"{s.name}\t{s.timeout_s:.0f}\t{min(start, time_limit):.0f}\t{s.command}")
                start += s.timeout_s
            for line in quick_budget_lines(stages, time_limit):
                print(line)
            return 0
        print(f"# gpu-suite dry run: {len(stages)} stages, time limit {time_limit:.0f} s, "
              f"results would go to {out}/ (cwd {REPO})")
        for s in stages:
            print(f"{s.name}\t{s.timeout_s:.0f}\t{s.command}")
        for line in budget_lines(stages, time_limit):
            print(line)
        return 0

    if args.out_dir:
        out = Path(args.out_dir)
    elif plan == "quick":
        out = _new_run_dir(args.results_root, label)
    else:
        from tempo.bench.results import new_results_dir

        out = new_results_dir(args.results_root, "cuda")
    out.mkdir(parents=True, exist_ok=True)
    out = out.resolve()
    every_stage = plan_stages(plan, out, label)
    stages = select_stages(every_stage, args.stages, args.part)
    time_limit = _time_limit(args, stages, plan)
    short = stages_past_the_limit(stages, time_limit)
    if short:
        print(f"[gpu-suite] note: the selected stages' limits add up to {sum(s.timeout_s for s in stages):.0f} s, "
              f"more than --time-limit {time_limit:.0f} s: {', '.join(short)} may be cut short or not run",
              file=sys.stderr, flush=True)
    carried, earlier_commands = earlier_run(out)
    if plan == "quick":
        env = _quick_environment(name)
    else:
        from tempo.bench.hardware import environment

        env = environment("cuda")
    commit, dirty = env.get("git_commit"), env.get("git_dirty")
    if commit is None and os.environ.get("TEMPO_GIT_COMMIT"):  # the image has no .git: build.sh bakes it in
        commit, dirty = os.environ["TEMPO_GIT_COMMIT"] + " (from TEMPO_GIT_COMMIT)", None
    header = {"plan": plan, "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
              "command": _invocation(getattr(args, "argv", None)),
              # scripts/gpu_check.sh exports its own command line here
              "invoked_as": os.environ.get("TEMPO_GPU_CHECK_COMMAND"), "cwd": os.getcwd(), "time_limit_s": time_limit,
              "git_commit": commit, "git_dirty": dirty, "env": env,
              # an earlier run into this folder (another --part): its stages stay in the reports
              "earlier_commands": earlier_commands}
    from tempo.utils import atomic_write_text

    if plan == "full":  # the quick plan's env stage writes env.json
        atomic_write_text(out / "env.json", json.dumps(env, indent=2) + "\n")
    earlier = (out / "command.txt").read_text() if earlier_commands and (out / "command.txt").exists() else ""
    atomic_write_text(out / "command.txt", earlier + "".join(f"{c}\n" for c in (header["invoked_as"], header["command"]) if c)
                      + f"# cwd: {header['cwd']}\n")
    print(f"[gpu-suite] {plan} plan on {env.get('device_name')}, torch {env.get('torch')}, triton {env.get('triton')}, "
          f"CUDA {env.get('cuda')}, driver {env.get('driver')}; results in {out}", flush=True)
    # SIGTERM (e.g. from `timeout`) becomes KeyboardInterrupt: the running stage's process group
    # is stopped and the reports say where the suite was interrupted.
    previous = signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        results = run_suite(stages, out, time_limit, header, carried=carried, order=[s.name for s in every_stage])
    finally:
        signal.signal(signal.SIGTERM, previous)
        if args.tarball:
            packed = write_tarball(out, Path(args.tarball), Path(args.results_root))
            print(f"[gpu-suite] packed {out} into {packed}", flush=True)
    bad = [r.name for r in results if r.status != "ok"]
    print(f"[gpu-suite] {len(results) - len(bad)} of {len(results)} stages ok; summary: {out / 'summary.md'}"
          + (f"; not ok: {', '.join(bad)}" if bad else ""), flush=True)
    return 0 if not bad else 4
