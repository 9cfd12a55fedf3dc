"""``python -m tempo.bench gpu-suite`` (= ``scripts/gpu_check.sh``): what the GPU has to confirm, in one run.

One runner, two plans (lists of stages). Each stage is a fresh subprocess with its own time limit
(an out-of-memory probe or a crashed kernel never affects a later stage), its output in
logs/<stage>.log; one that fails or runs out of time is recorded (status, seconds, the tail of its
log) and the run goes on. No stage starts after ``--time-limit``; a stage gets min(its own limit,
the time left), and a selection whose limits add up to more is named up front with the stages that
may not be reached. ``--stages`` picks stages by name or prefix.

The quick plan (the default): at most 7 minutes on one H100, for a GPU lent for 15 minutes; its
limits add up to 420 s and no stage starts after 390 s. Each stage is ``python -m
tempo.bench.gpu_quick <stage> --out DIR`` (the stage bodies; each also runs on the CPU at tiny
shapes with ``--device cpu --tiny``):

  env                    GPU, driver, CUDA, cuDNN, torch / triton / transformers versions, git commit
  correctness-layers     each Tempo layer's forward and backward against fp64 at one BERT-large shape
                         (8 x 512 rows, h = 1024, I = 4096), bf16 and fp16: In-place GELU (exact, tanh),
                         In-place LayerNorm with kept columns (γ near 0, |β| = 10), dropout→add→LayerNorm,
                         Combined, the GeGLU linear, with their dropout masks; each first call's seconds
  correctness-attention  the efficient attention padded and variable-length, without and with dropout
                         0.1 (the fused kernels' mask read back by replaying the RNG state with one-hot
                         values); DeBERTa's disentangled attention padded and variable-length, dropout
  memory                 max_memory_allocated of a BertForPreTraining step (BERT-large, b 32, s 512,
                         bf16 autocast, fused AdamW), stock sdpa and apply_tempo, beside the activation
                         ledger, its fake-tensor count with CUDA's semantics and tempo.plan's peak
  speed                  one BERT-large layer fwd+bwd at (8, 512) and (96, 128), sdpa and apply_tempo;
                         one DeBERTa-v3-large layer at (8, 512); CUDA events, median of 30, p20/p80
  projections            ``python -m tempo.movement`` for the same layers: projected H100 times
  speed-compiled         the two BERT-large layers of "speed" under torch.compile (dynamic=False)
  max-batch              the largest BERT-large batch at s = 512, stock sdpa vs apply_tempo, in one
                         process (double, then bisect to 8 sequences), bounded in time

``--tarball PATH`` packs the run folder into one file and copies summary.md beside it (a lent
machine hands back at most a few files).

The full plan (``--full``), 25 minutes: 1,500 s of limits, in three parts (``--part``, which implies
``--full``) whose limits add up to at most 9.5 minutes each, so that a part fits one 10-minute command:

  part 1 gpu-tests          pytest -m gpu: every test that runs on CUDA (tests/test_gpu.py, the
                            attention tests marked gpu, the "cuda" cases of the CPU test files:
                            about 530), each stopped after 120 s
  part 2 ops                bench ops: each Tempo op on inputs > 2x L2, GB/s against a device copy
         layer              bench layer: one BERT-large layer fwd+bwd at b8 s512 and b96 s128, ours vs
                            HF's BertLayer eager and sdpa
         train-s{S}-{V}     bench train: BERT-large pretraining throughput (bf16, LAMB), S in 128/512,
                            V in original / tempo / tempo-sdpa
         squad              tempo.bench.squad_benchmark at s=384: batch search to 64, then throughput
  part 3 maxbatch-s{S}-{V}  bench max-batch: the largest pretraining batch, a fresh process per probe,
                            in units of U sequences up to a cap

Output, results/<gpu>/<YYYYmmdd-HHMMSS>/ (or --out-dir): env.json (GPU, driver, versions, commit),
command.txt, suite.json (every stage: command, status, seconds, log tail), the stages' raw JSON /
JUnit XML / logs, and summary.md: the results (the full plan's beside the anchors: DLE on A100, a
45%-MFU H100), every stage's command, what did not finish. Both reports are rewritten after every
stage (an interrupted run leaves them). A run into an ``--out-dir`` holding a suite.json keeps the
records of the stages it does not run, so the parts run one after another make one summary:

  scripts/gpu_check.sh --part 1 --out-dir results/h100/run1   # then --part 2, then --part 3

The runner's own process never makes a CUDA context (~0.5 GB of GPU memory while the stages measure
memory): the GPU's name and driver come from nvidia-smi. Without CUDA it exits 1 with one line;
``--dry-run`` prints the plan's commands, limits and deadlines (any machine).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
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

from tempo.bench import gpu_quick

PROG = "python -m tempo.bench gpu-suite"
REPO = Path(__file__).resolve().parents[2]  # the checkout (or /opt/tempo in the image)

# ------------------------------------------------------------------------------------------------
# The quick plan: its stages (tempo/bench/gpu_quick.py), their limits in seconds, the deadline
# ------------------------------------------------------------------------------------------------
# Estimated on an H100 (16 cores) from what each stage does; each limit is about 1.5-2x the
# estimate. Python + torch start: ~5 s per process. Triton JIT: ~0.1-0.9 s per kernel
# specialization, up to 2 s for the disentangled-attention kernels (python -m tempo.ops.compile_check
# times every launch: 347 compiles in 225 s on 2 shared CPU cores); BERT-large built on the GPU: ~3 s;
# torch.compile of one layer fwd+bwd: ~20-40 s cold, ~15 s for a second shape.
QUICK_LIMITS_S = {
    "env": 15,                    # estimate 8 s: imports, CUDA's start, nvidia-smi
    "correctness-layers": 45,     # estimate 25 s: ~30 kernel specializations (0.1-0.9 s each), GELU's tables, fp64
    "correctness-attention": 60,  # estimate 35 s: 16 disentangled-attention specializations (~1-2 s each), fp64
    "memory": 60,                 # estimate 35 s: two BERT-large builds, 2 steps each, two fake counts (~1 s)
    "speed": 40,                  # estimate 25 s: six layers, 36 calls each
    "projections": 20,            # estimate 10 s: fake-tensor traces of the same layers
    "speed-compiled": 100,        # estimate 90 s: four compiles (two layers x two shapes)
    "max-batch": 80,              # estimate 60 s: two searches of ~7 probes, bounded at MAXBATCH_BUDGET_S
}
assert tuple(QUICK_LIMITS_S) == tuple(gpu_quick.STAGE_FUNCTIONS), "every stage has a body, in the plan's order"
QUICK_BUDGET_S = 420  # the whole quick plan: 7 minutes of wall time on one H100
QUICK_DEADLINE_S = 390  # no stage starts after 6.5 minutes; a stage gets min(its limit, what is left)

# ------------------------------------------------------------------------------------------------
# The full plan
# ------------------------------------------------------------------------------------------------
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

# The runner
MIN_STAGE_S = 20  # a stage is not started with less time than this left
TAIL_LINES = 40
STOP_GRACE_S = 10.0  # a stage stopped at its limit gets TERM, then KILL after this


@dataclass
class Stage:
    name: str
    argv: list[str]
    timeout_s: float
    outputs: list[str] = field(default_factory=list)  # files (relative to the run dir) it writes
    shell: bool = False  # argv[0] is a shell command line
    part: int = 1  # PARTS (the full plan's)
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
# The plans
# ------------------------------------------------------------------------------------------------
def quick_stages(out: Path, python: str = sys.executable, device: str = "cuda", tiny: bool = False) -> list[Stage]:
    """The quick plan's stages, each ``python -m tempo.bench.gpu_quick <stage> --out <out>``.
    ``device="cpu", tiny=True``: the same commands at tiny shapes on the CPU (what
    tests/test_gpu_quick.py runs)."""
    stages = []
    for name, limit in QUICK_LIMITS_S.items():
        argv = [python, "-m", "tempo.bench.gpu_quick", name, "--out", str(out), "--device", device]
        if tiny:
            argv.append("--tiny")
        if name == "max-batch":
            argv += ["--budget-s", str(gpu_quick.MAXBATCH_BUDGET_S)]
        env = dict(gpu_quick.CPU_STAGE_ENV) if device == "cpu" else {}
        if name == "max-batch" and device != "cpu":
            env.update(gpu_quick.MAXBATCH_CUDA_ENV)
        stages.append(Stage(name, argv, timeout_s=limit, outputs=[f"{name}.json"], env=env))
    return stages


def full_stages(out: Path, gpu_label: str, python: str = sys.executable,
                probe_python: Optional[str] = None) -> list[Stage]:
    """The full plan's stages, writing into ``out`` (the run directory).

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


def plan_stages(plan: str, out: Path, label: str) -> list[Stage]:
    """Every stage of ``plan`` ("quick" or "full"), writing into ``out``."""
    return quick_stages(out) if plan == "quick" else full_stages(out, label)


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


def dry_run_lines(plan: str, stages: list[Stage], time_limit_s: float, out: Path) -> list[str]:
    """What ``--dry-run`` prints: a header, a row per stage (name, limit, for the quick plan the
    latest second it can start, command), then the budget: the quick plan's limits and deadline, or
    the full plan's parts and total; and the stages that would not get their whole limit."""
    quick = plan == "quick"
    total = sum(s.timeout_s for s in stages)
    short = ", ".join(stages_past_the_limit(stages, time_limit_s))
    where = f"results would go to {out}/ (cwd {REPO})"
    if quick:
        lines = [f"# gpu-suite dry run, quick plan: {len(stages)} stages, no stage starts after {time_limit_s:.0f} s, "
                 f"{where}", "# stage\tlimit s\tstarts by s\tcommand"]
    else:
        lines = [f"# gpu-suite dry run: {len(stages)} stages, time limit {time_limit_s:.0f} s, {where}"]
    start = 0.0
    for s in stages:
        lines.append("\t".join([s.name, f"{s.timeout_s:.0f}", *([f"{min(start, time_limit_s):.0f}"] if quick else []),
                                s.command]))
        start += s.timeout_s
    if quick:
        lines.append(f"# quick plan: {len(stages)} stages, limits add up to {total:.0f} s (budget {QUICK_BUDGET_S} s); "
                     f"no stage starts after {time_limit_s:.0f} s and a stage gets min(its limit, the time left), so "
                     f"the run ends by about {time_limit_s:.0f} s (+ {STOP_GRACE_S:.0f} s to stop a stage, + the summary)")
        return lines + ([f"# if every stage used its whole limit, these would be cut short or not run: {short}"]
                        if short else [])
    for number, name in PARTS.items():
        in_part = [s for s in stages if s.part == number]
        if in_part:
            lines.append(f"# part {number} ({name}): {len(in_part)} stage{'s' if len(in_part) != 1 else ''}, "
                         f"limits add up to {sum(s.timeout_s for s in in_part):.0f} s")
    lines.append(f"# total: {total:.0f} s of stage limits, time limit {time_limit_s:.0f} s")
    return lines + ([f"# over budget: if every stage used its limit, these would be cut short or not run: {short}"]
                    if short else [])


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


def _gib(n: Any) -> str:
    return f"{n / 2**30:.1f}" if isinstance(n, (int, float)) else "-"


def _status_word(result: Optional[StageResult]) -> str:
    return result.status if result is not None else "not run"


# ------------------------------------------------------------------------------------------------
# Reports: suite.json and summary.md, one writer for both plans
# ------------------------------------------------------------------------------------------------
def write_reports(out: Path, header: dict[str, Any], results: list[StageResult]) -> None:
    from tempo.utils import atomic_write_text

    atomic_write_text(out / "suite.json", json.dumps(
        {"kind": "gpu_suite", **header, "stages": [asdict(r) for r in results]}, indent=2) + "\n")
    atomic_write_text(out / "summary.md", summary_markdown(out, header, results))


def summary_markdown(out: Path, header: dict[str, Any], results: list[StageResult]) -> str:
    """summary.md: the run (GPU, versions, commit, commands), what did not finish, the plan's result
    sections read from the stages' raw data (``quick_sections`` or ``full_sections``), every
    stage's status and command, and the log tails of the stages that failed or timed out. A quick
    stage that exited CHECKS_FAILED_EXIT is named as one that ran and failed a check."""
    quick = header.get("plan") == "quick"
    # the quick plan's env stage writes the fuller record (its "env"); the full plan's env.json is the header's
    env = {**header.get("env", {}), **((_load(out / "env.json") or {}).get("env") or {})}
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
             *([f"- no stage starts after {header['time_limit_s']:.0f} s"] if header.get("time_limit_s") else []),
             f"- stages: {done} of {len(results)} ok", ""]
    unfinished = [r for r in results if r.status != "ok"]
    if unfinished:
        lines += ["## Did not finish", ""]
        for r in unfinished:
            detail = r.note or (f"exit {r.returncode}" if r.returncode is not None else "")
            if quick and r.returncode == gpu_quick.CHECKS_FAILED_EXIT:  # pytest's 5 (no tests) means another thing
                detail += ": it ran, and a check failed or a measurement was refused (its section says which)"
            lines.append(f"- **{r.name}**: {r.status}" + (f" ({detail})" if detail else "")
                         + (f", log `{r.log}`" if r.log else ""))
        lines.append("")
    lines += quick_sections(out, by_name) if quick else full_sections(out, by_name)
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


# -- the full plan's sections ----------------------------------------------------------------------
def full_sections(out: Path, by_name: dict[str, StageResult]) -> list[str]:
    """GPU tests, pretraining (with the largest batches), SQuAD, the ops alone, one layer."""
    return (_tests_section(out, by_name.get("gpu-tests")) + _training_section(out, by_name)
            + _squad_section(out, by_name.get("squad")) + _ops_section(out) + _layer_section(out))


def _tests_section(out: Path, r: Optional[StageResult]) -> list[str]:
    lines = ["## GPU tests (`pytest -m gpu`)", ""]
    counts = junit_counts(out / "gpu_tests.xml")
    if counts is None:
        return lines + [f"No JUnit report ({_status_word(r)}).", ""]
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
        return lines + [f"No results ({_status_word(r)}).", ""]
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


# -- the quick plan's sections ---------------------------------------------------------------------
def quick_sections(out: Path, results: dict[str, StageResult]) -> list[str]:
    """Environment, correctness, memory, speed, largest batch; ``results``: stage name -> its record."""
    return (_env_section(out) + _correctness_section(out, results) + _memory_section(out, results)
            + _speed_section(out, results) + _maxbatch_section(out, results))


def _env_section(out: Path) -> list[str]:
    env = (_load(out / "env.json") or {}).get("env")
    if not env:
        return ["## Environment", "", "No env.json (the env stage did not finish).", ""]
    smi = env.get("nvidia_smi") or {}
    versions = env.get("versions") or {}
    return ["## Environment", "",
            f"- {env.get('device_name')} ({env.get('gpu') or 'not in the peak table'}), compute capability "
            f"{env.get('compute_capability')}, {env.get('sm_count')} SMs, {_gib(env.get('gpu_memory_bytes'))} GiB; "
            f"driver {env.get('driver') or smi.get('driver_version')}, max SM clock {smi.get('clocks.max.sm')}, "
            f"power limit {smi.get('power.limit')}",
            f"- torch {env.get('torch')} (CUDA {env.get('cuda')}, cuDNN {env.get('cudnn')}), triton {env.get('triton')}, "
            f"transformers {versions.get('transformers')}, numpy {versions.get('numpy')}, python {env.get('python')}",
            f"- commit {env.get('git_commit')}" + (" (uncommitted changes)" if env.get("git_dirty") else ""), ""]


def _sizes_of(record: dict[str, Any]) -> gpu_quick.Sizes:
    """The Sizes a stage's record was made at ("sizes": a name, or the whole record of them)."""
    sizes = record.get("sizes")
    name = sizes.get("name") if isinstance(sizes, dict) else sizes
    return gpu_quick.TINY if name == gpu_quick.TINY.name else gpu_quick.REAL


def _planned_checks(sizes: gpu_quick.Sizes) -> dict[str, list[tuple[str, str]]]:
    return {stage: [(name, gpu_quick._dtype_name(d)) for name in checks for d in sizes.check_dtypes]
            for stage, checks in (("correctness-layers", gpu_quick.LAYER_CHECKS),
                                  ("correctness-attention", gpu_quick.ATTENTION_CHECKS))}


def _share_of_tolerance(error: Optional[float], tolerance: Optional[float]) -> float:
    if error is None:
        return math.inf
    if not tolerance:
        return math.inf if error > 0 else 0.0
    return error / tolerance


def _correctness_section(out: Path, results: dict[str, Any]) -> list[str]:
    lines = ["## Correctness against fp64", "",
             "Each op's forward and backward at one BERT-large shape, errors as max |actual − fp64| / max |fp64| "
             "(LayerNorm: / max(1, max |fp64|)); \"worst\" is the output closest to its tolerance. First call: "
             "Triton's JIT compile included; compile ≈ first − second call.", "",
             "| check | dtype | path | status | worst output: error (tolerance) | first call s | compile s |",
             "|---|---|---|---|---|---|---|"]
    failures = []
    records = {stage: _load(out / f"{stage}.json") or {} for stage in ("correctness-layers", "correctness-attention")}
    sizes = next((_sizes_of(r) for r in records.values() if r.get("sizes")), gpu_quick.REAL)
    for stage, record in records.items():
        seen = set()
        for c in record.get("checks", []):
            seen.add((c["name"], c["dtype"]))
            errors, tols = c.get("errors") or {}, c.get("tolerances") or {}
            worst = max(errors, key=lambda w: _share_of_tolerance(errors[w], tols.get(w)), default=None)
            cell = "-"
            if worst is not None:
                error = errors[worst]  # null in the JSON: a non-finite output
                cell = f"{worst} {error:.1e} ({tols.get(worst, 0):.0e})" if error is not None else f"{worst} non-finite"
            first, compile_s = c.get("first_call_s"), c.get("compile_s")
            lines.append(f"| {c['name']} | {c['dtype']} | {c.get('path', '')} | **{c['status']}** | {cell} | "
                         f"{f'{first:.2f}' if first is not None else '-'} | "
                         f"{f'{compile_s:.2f}' if compile_s is not None else '-'} |")
            if c["status"] != "ok":
                failures.append(f"- {c['name']} {c['dtype']}: {c.get('message', c['status'])}")
        missing = [f"{n} {d}" for n, d in _planned_checks(sizes)[stage] if (n, d) not in seen]
        if missing:
            failures.append(f"- not reached ({stage}: {_status_word(results.get(stage))}): {', '.join(missing)}")
    if failures:
        lines += ["", "Not ok:", "", *failures]
    return lines + [""]


def _memory_section(out: Path, results: dict[str, Any]) -> list[str]:
    from tempo.utils import format_bytes

    record = _load(out / "memory.json")
    if not record or not record.get("rows"):
        return ["## Memory", "", f"No results (memory stage: {_status_word(results.get('memory'))}).", ""]
    lines = [f"## Memory: one training step of {record.get('model')}, b = {record.get('batch')}, "
             f"s = {record.get('seq_len')}, {record.get('precision')}, dropout {record.get('dropout')}, "
             f"{record.get('optimizer')}", "",
             "| model | measured peak (max_memory_allocated) | allocated before the step | activations: ledger "
             "(real) | predicted: fake ledger | predicted peak: weights + grads + Adam + fake activations | "
             "predicted peak: tempo.plan | measured − predicted |",
             "|---|---|---|---|---|---|---|---|"]
    for r in record["rows"]:
        if r.get("status") != "ok":
            lines.append(f"| {r['variant']} | {r.get('status')}: {r.get('message', '')} | | | | | | |")
            continue
        cells = [format_bytes(r.get(key)) for key in ("measured_peak_bytes", "allocated_before_step_bytes",
                                                      "ledger_activation_bytes", "fake_activation_bytes",
                                                      "rule_peak_bytes", "planner_peak_bytes",
                                                      "measured_minus_rule_bytes")]
        lines.append(f"| {r['variant']} | " + " | ".join(cells) + " |")
    ok = {r["variant"]: r for r in record["rows"] if r.get("status") == "ok"}
    if {"stock-sdpa", "tempo"} <= set(ok):
        stock, tempo = ok["stock-sdpa"], ok["tempo"]
        ratios = [f"activations (ledger) {tempo['ledger_activation_bytes'] / stock['ledger_activation_bytes']:.2f}"]
        if stock.get("measured_peak_bytes") and tempo.get("measured_peak_bytes"):
            ratios.insert(0, f"peak {tempo['measured_peak_bytes'] / stock['measured_peak_bytes']:.2f}")
        lines += ["", "Tempo / stock sdpa: " + ", ".join(ratios) + "."]
    return lines + ["", "measured − predicted: what no ledger sees (the loss's and the optimizer's transients, "
                    "cuBLAS workspaces, the allocator's rounding). The tempo.plan column is the planner's predicted "
                    "peak of the same step (it should be at or above the measured peak, within 5 %).", ""]


def _projection_ms(projections: Optional[dict[str, Any]], choice: Optional[str], batch: int, seq: int) -> Optional[float]:
    if not projections or not choice:
        return None
    for r in projections.get("records", []):
        if r.get("choice") == choice and r.get("scope") == "layer" and r.get("batch") == batch \
                and r.get("seq_len") == seq:
            return (r.get("projected_ms") or {}).get("H100")
    return None


def _speed_section(out: Path, results: dict[str, Any]) -> list[str]:
    rows = []
    for stage in ("speed", "speed-compiled"):
        rows += (_load(out / f"{stage}.json") or {}).get("rows", [])
    projections = _load(out / "projections.json")
    lines = ["## Speed: one layer, forward + backward, bf16 autocast, dropout 0.1", ""]
    if not rows:
        return lines + [f"No results (speed: {_status_word(results.get('speed'))}, speed-compiled: "
                        f"{_status_word(results.get('speed-compiled'))}).", ""]
    lines += ["| model | batch x seq | variant | median ms | p20 – p80 ms | vs stock (same shape) | "
              "projected ms, H100 (tempo.movement) | first call s |", "|---|---|---|---|---|---|---|---|"]
    stock = {}
    for r in rows:
        if r.get("status") == "ok" and r["variant"] in ("hf-sdpa", "deberta-eager"):
            stock[(r["model"], r["batch"], r["seq_len"])] = r["ms"]["p50"]
    for r in rows:
        shape = f"{r['batch']} x {r['seq_len']}"
        if r.get("status") != "ok":
            lines.append(f"| {r['model']} | {shape} | {r['variant']} | {r.get('status')}: {r.get('message', '')} | | | | |")
            continue
        ms = r["ms"]
        base = stock.get((r["model"], r["batch"], r["seq_len"]))
        versus = f"{base / ms['p50']:.2f}x" if base and ms["p50"] else "-"
        projected = _projection_ms(projections, r.get("projection_choice"), r["batch"], r["seq_len"])
        projected_cell = f"{projected:.2f}" if projected is not None else "-"
        lines.append(f"| {r['model']} | {shape} | {r['variant']} | {ms['p50']:.3f} | {ms['p20']:.3f} – {ms['p80']:.3f} | "
                     f"{versus} | {projected_cell} | {r.get('first_call_s')} |")
    timer = rows[0].get("timer", "")
    lines += ["", f"{timer}; median of {rows[0].get('repeats')} calls after {rows[0].get('warmup')} warm-up calls "
              "(and the first, timed apart). vs stock: stock median / this median (> 1: faster). Projections: "
              "tempo.movement's per-kernel roofline for the same layer (stock sdpa: 'sdpa'; apply_tempo: 'floor'), "
              "not measurements. The compiled rows (torch.compile, dynamic=False) have no projection."
              + (f" Projections: {_status_word(results.get('projections'))}." if projections is None else ""), ""]
    return lines


def _maxbatch_section(out: Path, results: dict[str, Any]) -> list[str]:
    record = _load(out / "max-batch.json")
    lines = ["## Largest batch", ""]
    if not record or not record.get("rows"):
        return lines + [f"No results (max-batch: {_status_word(results.get('max-batch'))}).", ""]
    search = record.get("search", {})
    lines += [f"BERT-large pretraining step at s = {record.get('seq_len')} ({record.get('precision')}, "
              f"{record.get('optimizer')}), searched in one process: doubling from {search.get('start')}, then "
              f"bisecting to {search.get('resolution')} sequences (cap {search.get('cap')}); {record.get('memory')}.", "",
              "| model | largest batch that fit | smallest that did not | probes | finished |", "|---|---|---|---|---|"]
    for r in record["rows"]:
        if r.get("status") not in ("ok", "running"):
            lines.append(f"| {r['variant']} | {r.get('status')}: {r.get('message', '')} | | | |")
            continue
        finished = "yes" if r.get("complete") else (
            "no (its time budget)" if r.get("status") == "ok" else "no (the stage was stopped)")
        lines.append(f"| {r['variant']} | {r.get('largest_fitting')} | {r.get('smallest_failing')} | "
                     f"{len(r.get('probes', []))} | {finished} |")
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


def _gpu_name_without_a_context() -> Optional[str]:
    """The GPU's name from nvidia-smi, else from a child process: this process must not hold a CUDA
    context (~0.5 GB of GPU memory) while the stages measure memory."""
    name = gpu_quick.nvidia_smi(("name",)).get("name")
    if name:
        return name
    try:
        out = subprocess.run([sys.executable, "-c", "import torch; print(torch.cuda.get_device_name())"],
                             capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip().splitlines()[0].strip() if out.returncode == 0 and out.stdout.strip() else None


def _label_of(name: Optional[str]) -> str:
    """results/<label>/ for a GPU name, as tempo.bench.hardware.device_label makes it."""
    from tempo.bench.hardware import known_gpu

    if not name:
        return "cuda"
    name = known_gpu(name) or name
    return "".join(c if c.isalnum() else "-" for c in name.lower()).strip("-")


def _runner_environment(name: Optional[str]) -> dict[str, Any]:
    """What the runner's own process knows without a CUDA context: the GPU ``name``, nvidia-smi's
    driver, memory and compute capability, the versions, the host and the commit (the quick plan's
    env stage records the rest)."""
    import platform
    from importlib import metadata

    import torch

    from tempo.bench.hardware import known_gpu
    from tempo.utils import git_commit

    try:
        triton_version = metadata.version("triton")
    except metadata.PackageNotFoundError:
        triton_version = None
    smi = gpu_quick.nvidia_smi(("driver_version", "memory.total", "compute_cap")) if name else {}
    memory = smi.get("memory.total", "").split()  # "81559 MiB"
    return {"device_name": name, "gpu": known_gpu(name) if name else None, "driver": smi.get("driver_version"),
            "compute_capability": smi.get("compute_cap"),
            "gpu_memory_bytes": int(memory[0]) * 2**20 if memory and memory[0].isdigit() else None,
            "torch": torch.__version__, "cuda": torch.version.cuda, "triton": triton_version,
            "python": platform.python_version(), "host": platform.node(), "cpu_count": os.cpu_count(),
            **{f"git_{k}": v for k, v in git_commit().items()}}


def _new_run_dir(root: str, label: str) -> Path:
    """<root>/<label>/<YYYYmmdd-HHMMSS> (a -N suffix where that exists); not made here."""
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


def main(args: argparse.Namespace) -> int:
    """Exit 0 when every selected stage is ok, 4 when one is not (summary.md says which), 1 without
    CUDA (``--dry-run`` needs none)."""
    import torch

    from tempo.bench.common import BenchError
    from tempo.utils import atomic_write_text

    plan = "full" if args.full or args.part is not None else "quick"
    on_cuda = torch.cuda.is_available()  # no CUDA context: only the driver is asked
    if not on_cuda and not args.dry_run:
        raise BenchError(f"no CUDA GPU visible (torch {torch.__version__}, built for CUDA {torch.version.cuda}): "
                         f"the GPU suite needs one; --dry-run prints its stages")
    name = _gpu_name_without_a_context() if on_cuda else None
    label = _label_of(name) if on_cuda else "cpu"
    out = Path(args.out_dir) if args.out_dir else _new_run_dir(args.results_root, label)
    every_stage = plan_stages(plan, out.resolve(), label)
    stages = select_stages(every_stage, args.stages, args.part)
    # the default: the quick plan's deadline, or the full plan's selected limits added up (all: DEFAULT_TIME_LIMIT_S)
    time_limit = args.time_limit if args.time_limit is not None else (
        float(QUICK_DEADLINE_S) if plan == "quick" else float(sum(s.timeout_s for s in stages)))
    if args.dry_run:
        print("\n".join(dry_run_lines(plan, stages, time_limit, out)))
        return 0

    out.mkdir(parents=True, exist_ok=True)
    out = out.resolve()
    short = stages_past_the_limit(stages, time_limit)
    if short:
        print(f"[gpu-suite] note: the selected stages' limits add up to {sum(s.timeout_s for s in stages):.0f} s, "
              f"more than --time-limit {time_limit:.0f} s: {', '.join(short)} may be cut short or not run",
              file=sys.stderr, flush=True)
    carried, earlier_commands = earlier_run(out)
    env = _runner_environment(name)
    commit, dirty = env.get("git_commit"), env.get("git_dirty")
    if commit is None and os.environ.get("TEMPO_GIT_COMMIT"):  # the image has no .git: build.sh bakes it in
        commit, dirty = os.environ["TEMPO_GIT_COMMIT"] + " (from TEMPO_GIT_COMMIT)", None
    command = shlex.join([sys.executable, "-m", "tempo.bench", *getattr(args, "argv", sys.argv[1:])])
    header = {"plan": plan, "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "command": command,
              # scripts/gpu_check.sh exports its own command line here
              "invoked_as": os.environ.get("TEMPO_GPU_CHECK_COMMAND"), "cwd": os.getcwd(), "time_limit_s": time_limit,
              "git_commit": commit, "git_dirty": dirty, "env": env,
              # an earlier run into this folder (another --part): its stages stay in the reports
              "earlier_commands": earlier_commands}
    if plan == "full":  # the quick plan's env stage writes env.json
        atomic_write_text(out / "env.json", json.dumps(env, indent=2) + "\n")
    earlier = (out / "command.txt").read_text() if earlier_commands and (out / "command.txt").exists() else ""
    atomic_write_text(out / "command.txt", earlier + "".join(f"{c}\n" for c in (header["invoked_as"], command) if c)
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
