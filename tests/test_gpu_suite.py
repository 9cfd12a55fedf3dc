"""The GPU suite's machinery, on the CPU: --dry-run, the no-CUDA error, stages that fail or run out
of time (recorded, the suite goes on, the children stopped), the reports read from raw data, and
a real max-batch stage against a stand-in probe; the full plan (--full) here, the quick plan (the
default) in tests/test_gpu_quick.py. The GPU work itself is tests/test_gpu.py."""

import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tempo.bench import gpu_suite
from tempo.bench.__main__ import main as bench_main

REPO = Path(__file__).resolve().parents[1]
no_cuda_only = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine-without-CUDA behaviour")


def _dry_run(capsys, *extra, budget=None):
    """The dry run's header line and its stage rows; ``budget`` (a list) gets the '#' lines after them."""
    assert bench_main(["gpu-suite", "--dry-run", *extra]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    if budget is not None:
        budget.extend(line for line in lines[1:] if line.startswith("#"))
    return lines[0], [line.split("\t") for line in lines[1:] if not line.startswith("#")]


def test_dry_run_prints_every_stage_command(capsys, tmp_path):
    out = tmp_path / "run"
    header, rows = _dry_run(capsys, "--full", "--out-dir", str(out))
    assert "16 stages" in header and str(out) in header
    assert not out.exists()  # a dry run writes nothing
    names = [r[0] for r in rows]
    assert names[:3] == ["gpu-tests", "ops", "layer"]
    assert names[3:9] == [f"train-s{s}-{v}" for s in (128, 512) for v in ("original", "tempo", "tempo-sdpa")]
    assert names[9] == "squad" and names[10:] == [f"maxbatch-s{s}-{v}" for s in (128, 512)
                                                  for v in ("original", "tempo", "tempo-sdpa")]
    commands = {r[0]: shlex.split(r[2]) for r in rows}
    assert all(float(r[1]) > 0 for r in rows)
    assert commands["gpu-tests"][1:5] == ["-m", "pytest", "-m", "gpu"]
    assert "--junitxml" in commands["gpu-tests"] and "--timeout" in commands["gpu-tests"]
    assert commands["ops"][3] == "ops" and commands["layer"][3] == "layer"
    assert {"hf-eager", "hf-sdpa"} <= set(commands["layer"][commands["layer"].index("--variants") + 1].split(","))
    sdpa = commands["train-s512-tempo-sdpa"]
    assert sdpa[3] == "train" and sdpa[sdpa.index("--seq-len") + 1] == "512"
    assert sdpa[sdpa.index("--attention") + 1] == "sdpa" and "--tempo" in sdpa
    assert "--tempo" not in commands["train-s128-original"]
    squad = commands["squad"]
    assert squad[2] == "tempo.bench.squad_benchmark" and squad[squad.index("--max_seq_length") + 1] == "384"
    mb = commands["maxbatch-s128-tempo"]
    assert mb[3] == "max-batch" and "--max" in mb and "--timeout" in mb
    probe = mb[mb.index("--command") + 1]
    assert "{batch}" in probe and "--tempo" in probe and probe.endswith("* 64 ))")
    for name, argv in commands.items():
        if "--out" in argv:
            assert Path(argv[argv.index("--out") + 1]).parent == out.resolve(), name


def test_dry_run_selects_stages_by_prefix(capsys):
    _, rows = _dry_run(capsys, "--full", "--stages", "maxbatch-s512,ops")
    assert [r[0] for r in rows] == ["ops", "maxbatch-s512-original", "maxbatch-s512-tempo", "maxbatch-s512-tempo-sdpa"]


def test_stage_limits_add_up_within_the_budget(capsys):
    """Every stage's limit counted: the default time limit is their sum, each part fits a 10-minute
    command, and the dry run prints the parts, the total and the time limit."""
    stages = gpu_suite.full_stages(Path("/tmp/x"), "cpu")
    assert sum(s.timeout_s for s in stages) == gpu_suite.DEFAULT_TIME_LIMIT_S <= 25 * 60
    for part in gpu_suite.PARTS:
        assert 0 < sum(s.timeout_s for s in stages if s.part == part) <= gpu_suite.PART_LIMIT_S < 600, part
    assert gpu_suite.stages_past_the_limit(stages, gpu_suite.DEFAULT_TIME_LIMIT_S) == []
    budget = []
    header, rows = _dry_run(capsys, "--full", budget=budget)
    assert f"time limit {gpu_suite.DEFAULT_TIME_LIMIT_S} s" in header
    assert sum(float(r[1]) for r in rows) == gpu_suite.DEFAULT_TIME_LIMIT_S
    assert budget == ["# part 1 (tests): 1 stage, limits add up to 540 s",
                      "# part 2 (benchmarks): 9 stages, limits add up to 510 s",
                      "# part 3 (max-batch): 6 stages, limits add up to 450 s",
                      f"# total: {gpu_suite.DEFAULT_TIME_LIMIT_S} s of stage limits, time limit "
                      f"{gpu_suite.DEFAULT_TIME_LIMIT_S} s"]


def test_parts_and_an_over_budget_selection_are_named(capsys):
    """--part picks the full plan's parts (no --full needed)."""
    budget = []
    header, rows = _dry_run(capsys, "--part", "benchmarks,3", "--time-limit", "900", budget=budget)
    assert [r[0] for r in rows][:2] == ["ops", "layer"] and rows[-1][0] == "maxbatch-s512-tempo-sdpa"
    assert "gpu-tests" not in [r[0] for r in rows] and "time limit 900 s" in header
    # 510 s of benchmarks, then 75 s per search: the sixth would end at 960 s
    assert budget[-1] == ("# over budget: if every stage used its limit, these would be cut short or not run: "
                          "maxbatch-s512-tempo-sdpa")
    _, rows = _dry_run(capsys, "--part", "1")
    assert [r[0] for r in rows] == ["gpu-tests"]
    with pytest.raises(SystemExit) as exit_info:  # argparse: no such part
        bench_main(["gpu-suite", "--dry-run", "--part", "4"])
    assert exit_info.value.code == 2
    assert "no part '4'; parts: 1 (tests), 2 (benchmarks), 3 (max-batch)" in capsys.readouterr().err


def test_cuda_cases_of_cpu_test_files_are_in_the_gpu_selection(tmp_path):
    """Collected as on a CUDA machine (torch.cuda.is_available patched), `-m gpu` takes the "cuda"
    cases of the device-parametrized tests and leaves their "cpu" cases out."""
    code = ("import sys, torch; torch.cuda.is_available = lambda: True; import pytest; "
            "sys.exit(pytest.main(['--collect-only', '-q', '-p', 'no:cacheprovider', '-m', 'gpu', "
            "'tests/test_launch_guard.py', 'tests/test_gelu.py']))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=REPO,
                            env={**os.environ, "TRITON_INTERPRET": "1"})
    assert result.returncode == 0, result.stdout + result.stderr
    selected = [line for line in result.stdout.splitlines() if "::" in line]
    assert "tests/test_launch_guard.py::test_every_triton_launch_runs_inside_launch_on[cuda]" in selected
    assert not any("[cpu" in line or "-cpu" in line for line in selected), selected
    gelu = [line for line in selected if line.startswith("tests/test_gelu.py::")]
    assert len(gelu) > 50 and all("cuda" in line for line in gelu if "[" in line and "gpu" not in line), gelu


def test_unknown_stage_is_one_error_line(capsys):
    assert bench_main(["gpu-suite", "--full", "--dry-run", "--stages", "nope"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--stages" in err[0] and "nope" in err[0]


@no_cuda_only
@pytest.mark.parametrize("command", [[sys.executable, "-m", "tempo.bench", "gpu-suite"],
                                     ["bash", str(REPO / "scripts" / "gpu_check.sh")]], ids=["module", "script"])
def test_without_cuda_exits_nonzero_with_one_line(command, tmp_path):
    env = {**os.environ, "PYTHON": sys.executable}
    result = subprocess.run(command + ["--results-root", str(tmp_path)], capture_output=True, text=True,
                            timeout=300, env=env, cwd=tmp_path)
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "gpu-suite: error: no CUDA GPU visible" in lines[0] and "--dry-run" in lines[0]
    assert result.stdout == "" and not any(tmp_path.iterdir())


def test_gpu_check_script_passes_arguments_through():
    assert os.access(REPO / "scripts" / "gpu_check.sh", os.X_OK)
    result = subprocess.run(["bash", str(REPO / "scripts" / "gpu_check.sh"), "--full", "--dry-run", "--stages", "layer"],
                            capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHON": sys.executable})
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[1].startswith("layer\t")


@no_cuda_only
def test_gpu_tests_fail_when_selected_without_cuda():
    """`pytest -m gpu` on a machine without CUDA must fail, not skip (and say why)."""
    env = {k: v for k, v in os.environ.items() if k != "TEMPO_GPU_TESTS_ON_CPU"}
    result = subprocess.run([sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider",
                             str(REPO / "tests" / "test_gpu.py"), "-k", "inplace_gelu"],
                            capture_output=True, text=True, timeout=300, cwd=REPO, env=env)
    assert result.returncode != 0
    assert "needs a CUDA GPU, but torch.cuda.is_available() is False" in result.stdout
    assert "3 error" in result.stdout and "skipped" not in result.stdout


# ------------------------------------------------------------------------------------------------
# The runner: failures and timeouts are recorded, the suite goes on, children are stopped
# ------------------------------------------------------------------------------------------------
def _py(code):
    return [sys.executable, "-c", code]


def test_failing_and_timed_out_stages_are_recorded_and_the_suite_goes_on(tmp_path):
    pid_file = tmp_path / "child.pid"
    stages = [
        gpu_suite.Stage("first", _py("import pathlib, sys; pathlib.Path(sys.argv[1]).write_text('{}'); print('hello')")
                        + [str(tmp_path / "first.json")], timeout_s=60, outputs=["first.json"]),
        gpu_suite.Stage("broken", _py("import sys; print('step 1'); print('Traceback: boom', file=sys.stderr); sys.exit(3)"),
                        timeout_s=60),
        # a stage that starts a child and hangs: the timeout must stop both (the process group)
        gpu_suite.Stage("hangs", _py("import subprocess, sys, time, pathlib; "
                                     "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)']); "
                                     f"pathlib.Path({str(pid_file)!r}).write_text(str(c.pid)); "
                                     "print('waiting', flush=True); time.sleep(300)"), timeout_s=3),
        gpu_suite.Stage("after", _py("print('still run')"), timeout_s=60),
    ]
    header = {"command": "test", "env": {"device_name": "CPU stand-in"}}
    start = time.monotonic()
    results = gpu_suite.run_suite(stages, tmp_path, time_limit_s=120, header=header, cwd=tmp_path)
    assert time.monotonic() - start < 60
    assert [r.status for r in results] == ["ok", "failed", "timeout", "ok"]
    assert results[0].outputs == ["first.json"] and results[1].returncode == 3
    assert "Traceback: boom" in results[1].log_tail and "waiting" in results[2].log_tail
    child = int(pid_file.read_text())
    deadline = time.monotonic() + 10
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(child), "the timed-out stage's child is still running"
    suite = json.loads((tmp_path / "suite.json").read_text())
    assert [s["status"] for s in suite["stages"]] == ["ok", "failed", "timeout", "ok"]
    assert (tmp_path / "logs" / "broken.log").read_text().startswith("$ ")
    summary = (tmp_path / "summary.md").read_text()
    assert "## Did not finish" in summary and "**broken**: failed (exit 3)" in summary
    assert "**hangs**: timeout (stopped after 3 s)" in summary
    for stage in stages:  # every command is visible
        assert stage.command in summary
    assert "Traceback: boom" in summary  # the tail of what failed


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (exited, not yet reaped by init) counts as stopped
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return True


def test_a_second_part_into_the_same_folder_keeps_the_first_parts_records(tmp_path):
    first = [gpu_suite.Stage("a", _py("print('part one')"), timeout_s=60, part=1)]
    second = [gpu_suite.Stage("b", _py("import sys; sys.exit(5)"), timeout_s=60, part=2)]
    order = ["a", "b", "c"]
    gpu_suite.run_suite(first, tmp_path, 60, header={"command": "run one", "env": {}}, cwd=tmp_path, order=order)
    carried, commands = gpu_suite.earlier_run(tmp_path)
    assert [r.name for r in carried] == ["a"] and commands == ["run one"]
    gpu_suite.run_suite(second, tmp_path, 60, header={"command": "run two", "env": {}, "earlier_commands": commands},
                        cwd=tmp_path, carried=carried, order=order)
    suite = json.loads((tmp_path / "suite.json").read_text())
    assert [(s["name"], s["status"]) for s in suite["stages"]] == [("a", "ok"), ("b", "failed")]
    assert suite["earlier_commands"] == ["run one"]
    summary = (tmp_path / "summary.md").read_text()
    assert "earlier run into this folder: `run one`" in summary and "stages: 1 of 2 ok" in summary
    assert "| a | ok |" in summary and "**b**: failed (exit 5)" in summary


def test_time_limit_leaves_later_stages_not_run_and_a_summary(tmp_path, monkeypatch):
    stages = [gpu_suite.Stage("slow", _py("import time; time.sleep(4)"), timeout_s=60),
              gpu_suite.Stage("never", _py("print(1)"), timeout_s=60)]
    monkeypatch.setattr(gpu_suite, "MIN_STAGE_S", 5)
    # 8 s for the suite: "slow" may use them all, then less than 5 s are left
    results = gpu_suite.run_suite(stages, tmp_path, time_limit_s=8.0, header={"env": {}}, cwd=tmp_path)
    assert [r.status for r in results] == ["ok", "not-run"]
    assert "time limit" in results[1].note
    summary = (tmp_path / "summary.md").read_text()
    assert "**never**: not-run (suite time limit (8 s) reached)" in summary


def test_a_full_run_records_its_environment_without_a_cuda_context(tmp_path, monkeypatch):
    """The full plan through main, as on a GPU (CUDA's presence and the GPU's name stood in, one
    stand-in stage): env.json and the summary's header come from nvidia-smi and the versions, never
    from a CUDA context in the runner's process (it would hold GPU memory while stages measure it)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(gpu_suite, "_gpu_name_without_a_context", lambda: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda *a: pytest.fail("the suite made a CUDA context"))
    monkeypatch.setattr(gpu_suite, "plan_stages",
                        lambda plan, out, label: [gpu_suite.Stage("ops", _py("print('ok')"), timeout_s=60, part=2)])
    out = tmp_path / "run"
    assert bench_main(["gpu-suite", "--full", "--out-dir", str(out)]) == 0
    env = json.loads((out / "env.json").read_text())
    assert (env["device_name"], env["gpu"], env["torch"]) == ("NVIDIA H100 80GB HBM3", "H100 SXM", torch.__version__)
    suite = json.loads((out / "suite.json").read_text())
    assert suite["plan"] == "full" and [(s["name"], s["status"]) for s in suite["stages"]] == [("ops", "ok")]
    assert (out / "summary.md").read_text().startswith("# Tempo GPU suite: NVIDIA H100 80GB HBM3")


def test_summary_reads_the_raw_data_and_sets_it_beside_the_anchors(tmp_path):
    def train(speed, mfu, peak):
        return {"samples_per_s": speed, "mfu": mfu, "memory": {"peak_allocated_bytes": peak}}

    (tmp_path / "train-s128-original.json").write_text(json.dumps(train(1160.0, 0.28, 40 * 2**30)))
    (tmp_path / "train-s128-tempo.json").write_text(json.dumps(train(1218.0, 0.30, 30 * 2**30)))
    (tmp_path / "maxbatch-s128-original.json").write_text(json.dumps({"max_batch": 9}))  # units of 64
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "maxbatch-s128-tempo.log").write_text("  batch 8: fits\n  batch 16: out of memory\n"
                                                               "  batch 12: fits\n")
    (tmp_path / "gpu_tests.xml").write_text(
        '<testsuites><testsuite><testcase classname="tests.test_gpu" name="a"/>'
        '<testcase classname="tests.test_gpu" name="b"><failure message="x"/></testcase>'
        '<testcase classname="tests.test_gpu" name="c"><skipped/></testcase></testsuite></testsuites>')
    squad = tmp_path / "squad" / "h100" / "20260101-000000"
    squad.mkdir(parents=True)
    (squad / "result_original_bf16.json").write_text(json.dumps(
        {"mode": "original", "precision": "bf16", "max_batch": 48, "sequences_per_second": 221.0, "error": None}))
    (tmp_path / "ops.json").write_text(json.dumps({"copy_bandwidth_gb_per_s": 2900.0, "l2_cache_bytes": 50 * 2**20,
        "rows": [{"op": "gelu", "impl": "tempo", "status": "ok", "batch": 32, "input_bytes": 134217728,
                  "fwd": {"gb_per_s": 2500.0}, "bwd": {"gb_per_s": 2400.0},
                  "both": {"gb_per_s": 2450.0, "of_copy_bandwidth": 0.85}}]}))
    results = [gpu_suite.StageResult("train-s128-original", "cmd a", "ok", 75, seconds=30.0),
               gpu_suite.StageResult("maxbatch-s128-tempo", "cmd b", "timeout", 100, seconds=100.0,
                                     note="stopped after 100 s")]
    text = gpu_suite.summary_markdown(tmp_path, {"command": "c", "env": {"device_name": "NVIDIA H100 80GB HBM3"}},
                                      results)
    assert "| 128 | original | 128 | 1160.0 | 28.0% | 2.00x | 0.63x | 576 | 40.0 |" in text
    assert "| 128 | Tempo | 128 | 1218.0 | 30.0% | 2.10x | 0.66x | >= 768 | 30.0 |" in text
    assert "| 512 | original | 32 | n/a |" in text  # no record: its stage's status
    assert "1 passed, 1 failed, 0 errors, 1 skipped" in text and "FAILED tests.test_gpu::b" in text
    assert "| original | 48 | 221.0 | 2.00x |" in text
    assert "| gelu | tempo | 32 | 134 | 2500 | 2400 | 2450 | 85% |" in text
    assert "580 seq/s at s=128" in text and "1850" in text
    assert "`cmd a`" not in text and "  cmd a" in text  # the commands, in code blocks


def test_maxbatch_stage_finds_the_batch_on_its_grid(tmp_path):
    """The real max-batch stage command, with a stand-in probe that 'fits' up to 600 sequences."""
    fake = tmp_path / "fake_python"
    fake.write_text("#!/bin/sh\n"
                    "for last; do :; done\n"  # the last argument is the batch size
                    'if [ "$last" -le 600 ]; then exit 0; fi\n'
                    'echo "python -m tempo.bench train: out of memory: CUDA out of memory (stand-in)"; exit 3\n')
    fake.chmod(0o755)
    stage = next(s for s in gpu_suite.full_stages(tmp_path, "cpu", probe_python=str(fake))
                 if s.name == "maxbatch-s128-original")
    result = gpu_suite.run_stage(stage, tmp_path, timeout_s=120, cwd=REPO)
    assert result.status == "ok", result.log_tail
    record = json.loads((tmp_path / "maxbatch-s128-original.json").read_text())
    assert record["max_batch"] == 9  # 9 x 64 = 576 <= 600 < 640
    assert [p["batch"] for p in record["probes"]] == [8, 16, 12, 10, 9]
    assert gpu_suite._maxbatch_text(tmp_path, result, 128, "original", 64) == "576"


# ------------------------------------------------------------------------------------------------
# The versions CI proves (.ci/run's second venv: the GPU machine's torch, triton, transformers)
# ------------------------------------------------------------------------------------------------
def test_pyproject_floors_are_the_versions_ci_runs():
    """Each lower bound in pyproject.toml is the exact version .ci/run installs in its second venv."""
    import re

    pyproject = (REPO / "pyproject.toml").read_text()
    ci = (REPO / ".ci" / "run").read_text()
    for package in ("torch", "triton", "transformers"):
        floor = re.search(rf'"{package}>=([0-9.]+)', pyproject)
        assert floor, f"pyproject.toml has no lower bound for {package}"
        pinned = re.search(rf'"{package}==([0-9.]+)"', ci.split('gpu-versions/bin/pip" install', 1)[-1])
        assert pinned, f".ci/run's GPU-versions step installs no pinned {package}"
        assert pinned.group(1).startswith(floor.group(1)), (package, floor.group(1), pinned.group(1))
    assert '"numpy<2.4"' in ci  # triton 3.6's interpreter


@pytest.mark.parametrize("triton_version, numpy_version, refused", [
    ("3.6.0", "2.4.1", True), ("3.6.0", "2.3.5", False), ("3.7.0", "2.4.1", False), ("3.9.0", "2.5.2", False)])
def test_a_test_run_refuses_triton_3_6_interpreter_with_numpy_2_4(monkeypatch, triton_version, numpy_version,
                                                                  refused):
    import numpy
    import triton

    import conftest

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(triton, "__version__", triton_version)
    monkeypatch.setattr(numpy, "__version__", numpy_version)
    problem = conftest.interpreter_numpy_problem()
    if refused:
        assert problem and f"numpy {numpy_version}" in problem and "install 'numpy<2.4'" in problem
    else:
        assert problem is None
