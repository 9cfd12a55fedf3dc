"""The quick GPU check (tempo/bench/gpu_quick.py; the default plan of scripts/gpu_check.sh) on the CPU:
its budget and dry run, its summary when stages fail or run out of time, the guards of its stages,
and every stage's real code at tiny shapes (the Triton kernels through Triton's interpreter), run end
to end through the suite's runner with each stage's JSON checked. On a GPU the same code runs at
BERT-large's shapes; nothing here can say how long it takes there (the limits are estimates)."""

import json
import os
import subprocess
import sys
import tarfile
import time
import types
from pathlib import Path

import pytest
import torch

from tempo.bench import gpu_quick, gpu_suite
from tempo.bench.__main__ import main as bench_main

REPO = Path(__file__).resolve().parents[1]
PLAN = ["env", "correctness-layers", "correctness-attention", "memory", "speed", "projections", "speed-compiled",
        "max-batch"]


# ------------------------------------------------------------------------------------------------
# The plan: order, limits, deadline, dry run
# ------------------------------------------------------------------------------------------------
def test_quick_plan_fits_seven_minutes():
    """The stage limits add up to at most 7 minutes, no stage starts after 6.5, and every stage of
    the plan has a body in gpu_quick, in the plan's order."""
    stages = gpu_suite.quick_stages(Path("/tmp/x"))
    assert [s.name for s in stages] == PLAN == list(gpu_quick.STAGE_FUNCTIONS)
    assert sum(s.timeout_s for s in stages) <= gpu_suite.QUICK_BUDGET_S == 7 * 60
    assert gpu_suite.QUICK_DEADLINE_S == 6.5 * 60
    # the last stage to start does so by the deadline and is stopped there; stopping it and the
    # summary leave room before 7 minutes
    assert gpu_suite.QUICK_DEADLINE_S + gpu_suite.STOP_GRACE_S + 15 <= gpu_suite.QUICK_BUDGET_S
    # max-batch fits its searches in what it is given
    assert gpu_quick.MAXBATCH_BUDGET_S + gpu_quick.MAXBATCH_START_S <= gpu_suite.QUICK_LIMITS_S["max-batch"]
    for stage in stages:
        assert stage.argv[1:4] == ["-m", "tempo.bench.gpu_quick", stage.name]
        assert stage.argv[stage.argv.index("--device") + 1] == "cuda" and "--tiny" not in stage.argv
    assert stages[-1].env == gpu_quick.MAXBATCH_CUDA_ENV and all(not s.env for s in stages[:-1])


def _quick_dry_run(capsys, *extra):
    assert bench_main(["gpu-suite", "--dry-run", *extra]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    rows = [line.split("\t") for line in lines if not line.startswith("#")]
    return lines, rows


def test_dry_run_prints_the_quick_plan_with_its_deadlines(capsys, tmp_path):
    out = tmp_path / "run"
    lines, rows = _quick_dry_run(capsys, "--out-dir", str(out))
    assert lines[0].startswith("# gpu-suite dry run, quick plan: 8 stages, no stage starts after 390 s")
    assert str(out) in lines[0] and not out.exists()  # a dry run writes nothing
    assert [r[0] for r in rows] == PLAN
    limits = [float(r[1]) for r in rows]
    assert limits == [float(gpu_suite.QUICK_LIMITS_S[name]) for name in PLAN]
    starts = [float(r[2]) for r in rows]  # each stage's latest start: the limits before it, added up
    assert starts == [min(sum(limits[:i]), 390.0) for i in range(len(rows))]
    for row in rows:
        assert f"-m tempo.bench.gpu_quick {row[0]} --out {out.resolve()} --device cuda" in row[3]
    assert rows[-1][3].startswith("PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True ")
    budget = [line for line in lines[1:] if line.startswith("# quick plan")]
    assert budget == ["# quick plan: 8 stages, limits add up to 420 s (budget 420 s); no stage starts after 390 s and "
                      "a stage gets min(its limit, the time left), so the run ends by about 390 s (+ 10 s to stop a "
                      "stage, + the summary)"]
    assert lines[-1] == ("# if every stage used its whole limit, these would be cut short or not run: max-batch")


def test_dry_run_selects_quick_stages_and_full_names_the_old_plan(capsys):
    _, rows = _quick_dry_run(capsys, "--stages", "correctness,max")
    assert [r[0] for r in rows] == ["correctness-layers", "correctness-attention", "max-batch"]
    _, rows = _quick_dry_run(capsys, "--full")
    assert len(rows) == 16 and rows[0][0] == "gpu-tests"
    assert bench_main(["gpu-suite", "--dry-run", "--stages", "gpu-tests"]) == 1  # not a quick stage
    assert "no stage named or starting with gpu-tests" in capsys.readouterr().err


def test_gpu_check_script_runs_the_quick_plan_by_default():
    result = subprocess.run(["bash", str(REPO / "scripts" / "gpu_check.sh"), "--dry-run"], capture_output=True,
                            text=True, timeout=300, env={**os.environ, "PYTHON": sys.executable})
    assert result.returncode == 0, result.stderr
    names = [line.split("\t")[0] for line in result.stdout.splitlines() if not line.startswith("#")]
    assert names == PLAN


# ------------------------------------------------------------------------------------------------
# The summary when stages fail, run out of time, or are never reached
# ------------------------------------------------------------------------------------------------
def _py(code, *args):
    return [sys.executable, "-c", code, *map(str, args)]


def _write_json_code(name, record):
    return ("import json, pathlib, sys; pathlib.Path(sys.argv[1], %r).write_text(json.dumps(%r))" % (name, record))


def _stand_ins(out):
    """The quick plan's stage names with stand-in commands: env writes its record, the layer checks
    crash with a traceback, the attention checks hang (and time out), memory writes one row and
    fails, the others succeed without output."""
    env = {"env": {"device_name": "NVIDIA H100 80GB HBM3", "gpu": "H100 SXM", "compute_capability": "9.0",
                   "sm_count": 132, "gpu_memory_bytes": 80 * 2**30, "torch": "2.11.0+cu130", "triton": "3.6.0",
                   "cuda": "13.0", "cudnn": 91900, "versions": {"transformers": "5.17.0"}, "git_commit": "abc123"}}
    memory = {"kind": "gpu_quick.memory", "model": "transformers BertForPreTraining", "batch": 32, "seq_len": 512,
              "rows": [{"variant": "stock-sdpa", "status": "ok", "measured_peak_bytes": 30 * 2**30,
                        "allocated_before_step_bytes": 5 * 2**30, "ledger_activation_bytes": 19 * 2**30,
                        "fake_activation_bytes": 19 * 2**30, "rule_peak_bytes": 25 * 2**30,
                        "planner_peak_bytes": None, "measured_minus_rule_bytes": 5 * 2**30},
                       {"variant": "tempo", "status": "error", "message": "RuntimeError: boom"}]}
    commands = {
        "env": _py(_write_json_code("env.json", env), out),
        "correctness-layers": _py("import sys; print('gelu-exact bf16 ok'); "
                                  "print('Traceback (most recent call last):\\nRuntimeError: CUDA error: an illegal "
                                  "memory access was encountered', file=sys.stderr); sys.exit(1)"),
        "correctness-attention": _py("import time; print('waiting', flush=True); time.sleep(300)"),
        "memory": _py(_write_json_code("memory.json", memory) + "; sys.exit(5)", out),
    }
    stages = []
    for stage in gpu_suite.quick_stages(out):
        argv = commands.get(stage.name, _py("print('fine')"))
        stages.append(gpu_suite.Stage(stage.name, argv, timeout_s=3 if stage.name == "correctness-attention" else 60,
                                      outputs=stage.outputs))
    return stages


def test_summary_is_written_when_a_stage_fails_or_times_out(tmp_path):
    header = {"plan": "quick", "command": "scripts/gpu_check.sh", "env": {"device_name": "NVIDIA H100 80GB HBM3"},
              "time_limit_s": 390.0}
    start = time.monotonic()
    results = gpu_suite.run_suite(_stand_ins(tmp_path), tmp_path, 390, header, cwd=tmp_path)
    assert time.monotonic() - start < 120
    status = {r.name: r.status for r in results}
    assert status == {"env": "ok", "correctness-layers": "failed", "correctness-attention": "timeout",
                      "memory": "failed", "speed": "ok", "projections": "ok", "speed-compiled": "ok", "max-batch": "ok"}
    suite = json.loads((tmp_path / "suite.json").read_text())
    assert suite["plan"] == "quick" and [s["status"] for s in suite["stages"]] == list(status.values())
    summary = (tmp_path / "summary.md").read_text()
    assert summary.startswith("# Tempo GPU check (quick plan): NVIDIA H100 80GB HBM3")
    assert "- no stage starts after 390 s" in summary and "- stages: 5 of 8 ok" in summary
    assert "**correctness-layers**: failed (exit 1)" in summary
    assert "**correctness-attention**: timeout (stopped after 3 s)" in summary
    assert "**memory**: failed (exit 5: it ran, and a check failed or a measurement was refused" in summary
    assert "an illegal memory access was encountered" in summary  # the crashed stage's log tail
    # every section is there, saying what is missing and why
    assert "H100 SXM), compute capability 9.0, 132 SMs, 80.0 GiB" in summary and "commit abc123" in summary
    assert "- not reached (correctness-layers: failed): gelu-exact bf16, gelu-exact fp16, gelu-tanh bf16" in summary
    assert "- not reached (correctness-attention: timeout): attention-padded bf16" in summary
    assert "| stock-sdpa | 30.00 GiB | 5.00 GiB | 19.00 GiB | 19.00 GiB | 25.00 GiB | - | 5.00 GiB |" in summary
    assert "| tempo | error: RuntimeError: boom |" in summary
    assert "No results (speed: ok, speed-compiled: ok)." in summary
    assert "No results (max-batch: ok)." in summary
    for stage in _stand_ins(tmp_path):
        assert stage.command in summary


def test_deadline_leaves_later_stages_not_run_and_a_summary(tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_suite, "MIN_STAGE_S", 5)
    stages = [gpu_suite.Stage(name, _py("import time; time.sleep(4)" if name == "env" else "print(1)"), timeout_s=60)
              for name in PLAN]
    results = gpu_suite.run_suite(stages, tmp_path, 8.0, {"plan": "quick", "env": {}}, cwd=tmp_path)
    assert [r.status for r in results] == ["ok"] + ["not-run"] * 7
    summary = (tmp_path / "summary.md").read_text()
    assert "**max-batch**: not-run (suite time limit (8 s) reached)" in summary
    assert "No env.json (the env stage did not finish)." in summary  # the stand-in wrote none


def test_tarball_holds_the_run_under_its_results_path_and_summary_beside_it(tmp_path):
    run = tmp_path / "results" / "h100-sxm" / "20260101-000000"
    (run / "logs").mkdir(parents=True)
    (run / "summary.md").write_text("# summary\n")
    (run / "logs" / "env.log").write_text("$ env\n")
    packed = gpu_suite.write_tarball(run, tmp_path / "carry" / "gpu_quick.tar.gz", tmp_path / "results")
    with tarfile.open(packed) as tar:
        names = sorted(tar.getnames())
    assert names == ["h100-sxm/20260101-000000", "h100-sxm/20260101-000000/logs",
                     "h100-sxm/20260101-000000/logs/env.log", "h100-sxm/20260101-000000/summary.md"]
    assert (tmp_path / "carry" / "summary.md").read_text() == "# summary\n"
    outside = gpu_suite.write_tarball(run, tmp_path / "other.tar.gz", tmp_path / "elsewhere")
    with tarfile.open(outside) as tar:
        assert tar.getnames()[0] == "20260101-000000"


def test_a_quick_run_writes_its_folder_tarball_and_summary(tmp_path, monkeypatch, capsys):
    """main's quick path as on a GPU (CUDA's presence and the GPU's name stood in, the stages stand-ins):
    results/<gpu>/<time>/ with suite.json, command.txt and summary.md, the tarball and summary.md
    beside it, exit 4 when a stage did not finish; the suite's own process never touches CUDA."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(gpu_suite, "_gpu_name_without_a_context", lambda: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(gpu_suite, "plan_stages", lambda plan, out, label: _stand_ins(out))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda *a: pytest.fail("the suite made a CUDA context"))
    monkeypatch.setenv("TEMPO_GPU_CHECK_COMMAND", "scripts/gpu_check.sh --tarball carry/gpu_quick.tar.gz")
    root, carry = tmp_path / "results", tmp_path / "carry" / "gpu_quick.tar.gz"
    code = bench_main(["gpu-suite", "--results-root", str(root), "--tarball", str(carry)])
    assert code == 4  # three stand-ins fail or time out
    (run,) = list((root / "h100-sxm").iterdir())
    suite = json.loads((run / "suite.json").read_text())
    assert suite["plan"] == "quick" and suite["time_limit_s"] == 390.0 and len(suite["stages"]) == 8
    assert suite["env"]["device_name"] == "NVIDIA H100 80GB HBM3" and suite["env"]["gpu"] == "H100 SXM"
    assert (run / "command.txt").read_text().startswith("scripts/gpu_check.sh --tarball carry/gpu_quick.tar.gz\n")
    with tarfile.open(carry) as tar:
        names = tar.getnames()
    assert f"h100-sxm/{run.name}/summary.md" in names and f"h100-sxm/{run.name}/logs/env.log" in names
    assert (carry.parent / "summary.md").read_text() == (run / "summary.md").read_text()
    assert "- no stage starts after 390 s" in (run / "summary.md").read_text()
    assert "packed" in capsys.readouterr().out


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine-without-CUDA behaviour")
def test_the_suite_learns_the_gpu_name_without_cuda_here():
    assert gpu_suite._gpu_name_without_a_context() is None  # no nvidia-smi, and the child finds no GPU
    env = gpu_suite._runner_environment(None)
    assert env["torch"] == torch.__version__ and env["driver"] is None and "git_commit" in env


def test_results_folder_is_named_as_device_label_names_it():
    assert gpu_suite._label_of("NVIDIA H100 80GB HBM3") == "h100-sxm"
    assert gpu_suite._label_of("NVIDIA H200") == "h200"
    assert gpu_suite._label_of("Some New GPU 9000") == "some-new-gpu-9000"
    assert gpu_suite._label_of(None) == "cuda"


# ------------------------------------------------------------------------------------------------
# The stages' guards
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("argv, message", [
    (["memory", "--device", "meta"], "--device meta: must be cuda or cpu"),
    (["memory", "--device", "nonsense"], "--device 'nonsense' is not a torch device"),
    (["max-batch", "--device", "cpu", "--tiny", "--simulated-budget", "lots"], "--simulated-budget"),
])
def test_bad_arguments_are_one_line(argv, message, tmp_path, capsys):
    assert gpu_quick.main([*argv, "--out", str(tmp_path)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine-without-CUDA behaviour")
def test_cuda_stage_without_cuda_is_one_line(tmp_path, capsys):
    assert gpu_quick.main(["speed", "--out", str(tmp_path)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no CUDA GPU visible" in err[0] and "--device cpu --tiny" in err[0]
    assert not (tmp_path / "speed.json").exists()


def test_cpu_stage_without_the_interpreter_is_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET")
    assert gpu_quick.main(["correctness-layers", "--out", str(tmp_path), "--device", "cpu", "--tiny"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "set TRITON_INTERPRET=1" in err[0]


def _tiny_context(tmp_path, stage="correctness-attention", device="cpu"):
    return gpu_quick.Context(stage, tmp_path, torch.device(device), gpu_quick.TINY, simulated_budget=1 << 20)


def test_a_check_over_its_tolerance_or_raising_is_recorded_and_the_stage_exits_5(tmp_path):
    ctx = _tiny_context(tmp_path)

    def over(ctx, dtype):
        return [gpu_quick.Comparison("y", 1e-3, 3e-2), gpu_quick.Comparison("dx", 0.5, 3e-2)], 1.5, 0.5

    def raises(ctx, dtype):
        raise AssertionError("the dropout mask keeps 0.5 of the entries")

    checks = {"over": ("a check whose dx is wrong", over), "raises": ("a check that raises", raises)}
    assert gpu_quick.run_checks(ctx, checks) == gpu_quick.CHECKS_FAILED_EXIT
    record = json.loads(ctx.path.read_text())
    over_row, raises_row = record["checks"]
    assert over_row["status"] == "failed" and over_row["message"] == "over the tolerance: dx 5.00e-01 > 3e-02"
    assert over_row["first_call_s"] == 1.5 and over_row["compile_s"] == 1.0
    assert raises_row["status"] == "error" and "keeps 0.5 of the entries" in raises_row["message"]
    assert "AssertionError" in raises_row["traceback"] and record["complete"] is True


def test_a_check_over_its_tolerance_fails_its_stage_and_the_run(tmp_path, monkeypatch):
    """Tripped end to end: the correctness stage's real command (its entry point swapped for one
    whose only check reports dx over its tolerance) exits 5, the runner records the stage as failed,
    the run exits 4, and summary.md names the stage, the check and the output over its tolerance."""
    script = tmp_path / "over_tolerance.py"
    script.write_text("import sys\n"
                      "from tempo.bench import gpu_quick\n"
                      "def over(ctx, dtype):\n"
                      "    return [gpu_quick.Comparison('y', 1e-3, 3e-2), gpu_quick.Comparison('dx', 0.5, 3e-2)], 1.0, 0.5\n"
                      "gpu_quick.LAYER_CHECKS.clear()\n"
                      "gpu_quick.LAYER_CHECKS['gelu-exact'] = ('a GELU whose dx is off', over)\n"
                      "sys.exit(gpu_quick.main(sys.argv[1:]))\n")
    out = tmp_path / "run"

    def plan(name, run_dir, label):
        stage = next(s for s in gpu_suite.quick_stages(run_dir, device="cpu", tiny=True)
                     if s.name == "correctness-layers")
        assert stage.argv[1:3] == ["-m", "tempo.bench.gpu_quick"]
        stage.argv[1:3] = [str(script)]
        stage.timeout_s = 300
        return [stage]

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(gpu_suite, "_gpu_name_without_a_context", lambda: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(gpu_suite, "plan_stages", plan)
    assert bench_main(["gpu-suite", "--out-dir", str(out)]) == 4
    (stage,) = json.loads((out / "suite.json").read_text())["stages"]
    assert (stage["name"], stage["status"], stage["returncode"]) == ("correctness-layers", "failed", 5)
    (check,) = _record(out, "correctness-layers")["checks"]
    assert check["status"] == "failed" and check["message"] == "over the tolerance: dx 5.00e-01 > 3e-02"
    summary = (out / "summary.md").read_text()
    assert "- stages: 0 of 1 ok" in summary
    assert "**correctness-layers**: failed (exit 5: it ran, and a check failed or a measurement was refused" in summary
    assert "| gelu-exact | bf16 | triton (interpreter) | **failed** | dx 5.0e-01 (3e-02) |" in summary
    assert "- gelu-exact bf16: over the tolerance: dx 5.00e-01 > 3e-02" in summary


def test_after_a_lost_cuda_context_the_remaining_checks_are_not_run(tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_quick, "_warm_up", lambda device: None)
    ctx = _tiny_context(tmp_path, device="cuda")  # never used on a device: the checks are stand-ins
    ctx.sizes = gpu_quick.REAL  # bf16 and fp16

    def crash(ctx, dtype):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    fine = lambda ctx, dtype: ([gpu_quick.Comparison("y", 0.0, 1e-2)], 0.1, 0.1)  # noqa: E731
    assert gpu_quick.run_checks(ctx, {"crash": ("", crash), "after": ("", fine)}) == gpu_quick.CHECKS_FAILED_EXIT
    rows = json.loads(ctx.path.read_text())["checks"]
    assert [(r["name"], r["dtype"], r["status"]) for r in rows] == [
        ("crash", "bf16", "error"), ("crash", "fp16", "not-run"), ("after", "bf16", "not-run"),
        ("after", "fp16", "not-run")]
    assert rows[-1]["message"] == "the CUDA context was lost at crash (bf16)"


def test_keep_rate_guard_trips():
    ctx = _tiny_context(Path("/tmp"))
    gpu_quick._check_keep_rate(ctx, 0.85, "x")  # within the tiny shapes' slack
    with pytest.raises(AssertionError, match="keeps 0.5000 of the entries, expected 0.9"):
        gpu_quick._check_keep_rate(ctx, 0.5, "x")


@pytest.mark.parametrize("varlen", [False, True], ids=["padded", "varlen"])
def test_the_read_back_dropout_mask_is_what_the_check_stands_on(tmp_path, monkeypatch, varlen):
    """With the mask read at the right keys the dropout attention matches fp64; read one key off, or
    replayed from another RNG state, the check fails: it can tell a wrong mask."""
    torch.manual_seed(0)
    ctx = _tiny_context(tmp_path)
    check = gpu_quick.check_efficient_attention_varlen if varlen else gpu_quick.check_efficient_attention_padded
    good, _, _ = check(ctx, torch.bfloat16, True)
    assert all(c.ok for c in good) and [c.what for c in good][0] == "replay"
    real = gpu_quick._one_hot_values
    monkeypatch.setattr(gpu_quick, "_one_hot_values", lambda d, block, like, pos: real(d, block, like, (pos + 1) % 16))
    shifted, _, _ = check(ctx, torch.bfloat16, True)
    assert not all(c.ok for c in shifted if c.what in ("out", "dq", "dk", "dv"))
    monkeypatch.setattr(gpu_quick, "_one_hot_values", real)
    monkeypatch.setattr(gpu_quick, "_set_rng_state", lambda state, device: None)  # no replay: fresh masks
    unreplayed, _, _ = check(ctx, torch.bfloat16, True)
    assert not next(c for c in unreplayed if c.what == "replay").ok


def test_the_prediction_for_a_cuda_run_takes_cudas_decisions_without_a_gpu():
    """For a CUDA run the fake-tensor count follows CUDA's paths (fused sdpa: O(s) per row, 1-byte
    dropout masks), which keep fewer bytes than the CPU's (sdpa's math path keeps s x s)."""
    cpu = _tiny_context(Path("/tmp"), stage="memory")
    cuda = _tiny_context(Path("/tmp"), stage="memory", device="cuda")  # only a label here: nothing runs there
    b, s = gpu_quick.TINY.memory_shape
    counts = {(ctx.device.type, variant): gpu_quick.predicted_activation_bytes(ctx, variant, b, s)
              for ctx in (cpu, cuda) for variant in gpu_quick.MODEL_VARIANTS}
    assert counts[("cuda", "stock-sdpa")] < counts[("cpu", "stock-sdpa")]
    assert counts[("cuda", "tempo")] < counts[("cuda", "stock-sdpa")]
    assert counts[("cpu", "tempo")] < counts[("cpu", "stock-sdpa")]


def test_search_doubles_then_bisects_to_the_resolution():
    search = gpu_quick.Search(start=64, resolution=8, cap=2048, deadline=time.monotonic() + 60)
    assert search.run(lambda batch: batch <= 250)
    assert (search.largest_fitting, search.smallest_failing) == (248, 256)
    assert [p["batch"] for p in search.probes] == [64, 128, 256, 192, 224, 240, 248]
    down = gpu_quick.Search(start=64, resolution=8, cap=2048, deadline=time.monotonic() + 60)
    assert down.run(lambda batch: batch <= 20)
    assert (down.largest_fitting, down.smallest_failing) == (16, 24)
    capped = gpu_quick.Search(start=64, resolution=8, cap=100, deadline=time.monotonic() + 60)
    assert capped.run(lambda batch: True) and capped.largest_fitting == 100 and capped.smallest_failing is None
    late = gpu_quick.Search(start=64, resolution=8, cap=2048, deadline=time.monotonic() - 1)
    assert not late.run(lambda batch: True) and late.probes == []


def test_max_batch_shares_the_time_left_among_the_variants_still_to_run(tmp_path, monkeypatch):
    """Variant i of n gets (the stage's time left) / (n - i) as it starts, on a fake clock with a
    fake search: one that finishes early leaves its unused time to the ones after it (not 1/n of
    the budget each), and the runner's TEMPO_STAGE_TIMEOUT_S less MAXBATCH_START_S caps the budget."""
    clock = {"now": 1000.0}
    monkeypatch.setattr(gpu_quick, "time", types.SimpleNamespace(monotonic=lambda: clock["now"],
                                                                 perf_counter=time.perf_counter))
    monkeypatch.setattr(gpu_quick, "MODEL_VARIANTS", ("a", "b", "c"))
    used = {"a": 6.0, "b": None, "c": 1.0}  # b uses all it is given
    given = {}

    def search(ctx, variant, seq, deadline, row):
        given[variant] = deadline - clock["now"]
        clock["now"] += given[variant] if used[variant] is None else used[variant]
        row["largest_fitting"] = 8

    monkeypatch.setattr(gpu_quick, "search_largest_batch", search)
    monkeypatch.delenv("TEMPO_STAGE_TIMEOUT_S", raising=False)
    ctx = _tiny_context(tmp_path, stage="max-batch")
    ctx.budget_s = 90.0
    assert gpu_quick.stage_max_batch(ctx) == 0
    # a: 90 / 3 = 30, uses 6; b: (90 - 6) / 2 = 42, uses them all; c: the 42 left
    assert given == {"a": 30.0, "b": 42.0, "c": 42.0}
    record = json.loads(ctx.path.read_text())
    assert [(r["variant"], r["status"]) for r in record["rows"]] == [("a", "ok"), ("b", "ok"), ("c", "ok")]
    monkeypatch.setenv("TEMPO_STAGE_TIMEOUT_S", str(gpu_quick.MAXBATCH_START_S + 36))
    ctx = _tiny_context(tmp_path, stage="max-batch")
    ctx.budget_s = 90.0
    assert gpu_quick.stage_max_batch(ctx) == 0
    assert json.loads(ctx.path.read_text())["search"]["budget_s"] == 36.0
    assert given == {"a": 12.0, "b": 15.0, "c": 15.0}  # 36 / 3; (36 - 6) / 2; what b left


def test_projections_command_is_tempo_movement_for_the_speed_shapes(tmp_path):
    from tempo.movement.cli import build_parser

    args = build_parser().parse_args(gpu_quick.movement_argv(tmp_path / "projections.json"))
    assert args.seq_lens == [128, 512] and args.batch is None and args.choices == ["sdpa", "floor"]
    assert args.deberta and args.no_unpad and args.json == str(tmp_path / "projections.json")
    from tempo.movement.cli import _batch_for

    assert [(_batch_for(s, None), s) for s in args.seq_lens] == sorted(gpu_quick.REAL.layer_shapes, reverse=True)
    assert gpu_quick.REAL.deberta_shape == (_batch_for(512, None), 512)


# ------------------------------------------------------------------------------------------------
# Every stage's real code, end to end on the CPU at tiny shapes, through the suite's runner
# ------------------------------------------------------------------------------------------------
# tempo.movement has no tiny shapes (it counts BERT-large on fake tensors: ~10 s on an idle machine,
# its own tests cover it); its stand-in writes projections for the tiny shapes so that the summary's
# projection column is exercised. Every other stage runs its real command.
TINY_PROJECTIONS = {"records": [{"choice": "sdpa", "scope": "layer", "batch": 2, "seq_len": 16,
                                 "projected_ms": {"H100": 0.125}},
                                {"choice": "floor", "scope": "layer", "batch": 2, "seq_len": 16,
                                 "projected_ms": {"H100": 0.0625}}]}


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("quick")
    stages = gpu_suite.quick_stages(out, sys.executable, device="cpu", tiny=True)
    for stage in stages:
        stage.timeout_s = 900  # 2 shared CPU cores and Triton's interpreter: far from the GPU's limits
        if stage.name == "projections":
            stage.argv = _py(_write_json_code("projections.json", TINY_PROJECTIONS), out)
    header = {"plan": "quick", "command": "test", "env": {"device_name": "cpu"}, "time_limit_s": 10_000.0}
    results = gpu_suite.run_suite(stages, out, 10_000, header, cwd=REPO)
    return out, {r.name: r for r in results}


def _record(out, stage):
    return json.loads((out / f"{stage}.json").read_text())


def test_every_stage_runs_on_the_cpu(quick_run):
    out, results = quick_run
    bad = {name: (r.status, r.log_tail[-1500:]) for name, r in results.items() if r.status != "ok"}
    assert not bad, bad
    for stage in PLAN:
        record = _record(out, stage)
        if stage != "projections":
            assert record["kind"] == f"gpu_quick.{stage}" and record["device"] == "cpu", stage
            assert record["complete"] is True and "--device cpu --tiny" in record["command"], stage


def test_env_stage_records_versions_and_commit(quick_run):
    env = _record(quick_run[0], "env")["env"]
    assert env["torch"] == torch.__version__ and env["versions"]["transformers"]
    assert "git_commit" in env and env["env_vars"]["TRITON_INTERPRET"] == "1"


def test_correctness_stages_check_every_kernel_against_fp64(quick_run):
    out, _ = quick_run
    for stage, checks in (("correctness-layers", gpu_quick.LAYER_CHECKS),
                          ("correctness-attention", gpu_quick.ATTENTION_CHECKS)):
        rows = _record(out, stage)["checks"]
        assert [(r["name"], r["dtype"]) for r in rows] == [(name, "bf16") for name in checks]
        for r in rows:
            assert r["status"] == "ok", r
            assert r["errors"].keys() == r["tolerances"].keys() and len(r["errors"]) >= 2
            assert all(r["errors"][w] <= r["tolerances"][w] for w in r["errors"]), r
            assert r["first_call_s"] > 0 and r["second_call_s"] > 0
            assert "tempo_warnings" not in r, r  # no fallback to the reference path on the way
        dropout = [r for r in rows if r["name"].startswith("attention") and r["name"].endswith("dropout")]
        assert all(r["errors"]["replay"] == 0.0 for r in dropout)
    by_name = {r["name"]: r for r in _record(out, "correctness-layers")["checks"]}
    assert set(by_name["layernorm-kept-columns"]["errors"]) == {"y", "dx", "dweight", "dbias"}
    assert set(_record(out, "correctness-attention")["checks"][-1]["errors"]) == set(gpu_quick.DISENTANGLED_OUTPUTS)


def test_memory_stage_sets_the_ledger_beside_its_predictions(quick_run):
    record = _record(quick_run[0], "memory")
    assert (record["batch"], record["seq_len"]) == gpu_quick.TINY.memory_shape
    rows = {r["variant"]: r for r in record["rows"]}
    assert list(rows) == ["stock-sdpa", "tempo"]
    for r in rows.values():
        assert r["status"] == "ok" and r["measured_peak_bytes"] is None
        # tempo.plan's prediction of the same step: at least its weights, gradients and optimizer states
        assert r["planner_peak_bytes"] > r["weight_bytes"] + r["gradient_bytes"] + r["optimizer_state_bytes"]
        assert r["rule_peak_bytes"] == (r["weight_bytes"] + r["gradient_bytes"] + r["optimizer_state_bytes"]
                                        + r["fake_activation_bytes"])
        assert r["gradient_bytes"] == 4 * r["parameters"]  # fp32 gradients of every parameter
        assert r["optimizer_state_bytes"] >= 8 * r["parameters"]  # AdamW's two fp32 moments (+ step counters)
    # the fake-tensor count is the real ledger's, byte for byte, after apply_tempo; for the stock
    # model the fake count differs by the two statistics of the MLM head's nn.LayerNorm (bf16 input
    # under CPU autocast: fp32 mean and rstd in a real run, bf16 on fake tensors)
    assert rows["tempo"]["fake_activation_bytes"] == rows["tempo"]["ledger_activation_bytes"]
    b, s = gpu_quick.TINY.memory_shape
    assert rows["stock-sdpa"]["ledger_activation_bytes"] - rows["stock-sdpa"]["fake_activation_bytes"] == 2 * b * s * 2
    assert rows["tempo"]["ledger_activation_bytes"] < rows["stock-sdpa"]["ledger_activation_bytes"]


def test_speed_stages_time_every_case(quick_run):
    out, _ = quick_run
    eager, compiled = _record(out, "speed")["rows"], _record(out, "speed-compiled")["rows"]
    assert [(r["model"], r["variant"]) for r in eager] == [("bert-large", "hf-sdpa"), ("bert-large", "tempo"),
                                                           ("deberta-v3-large", "deberta-eager"),
                                                           ("deberta-v3-large", "deberta-tempo")]
    assert [r["variant"] for r in compiled] == ["hf-sdpa+compile", "tempo+compile"]
    for r in eager + compiled:
        assert r["status"] == "ok" and len(r["raw_ms"]) == gpu_quick.TINY.repeats and r["timer"] == "perf_counter"
        assert r["ms"]["p20"] <= r["ms"]["p50"] <= r["ms"]["p80"] and r["first_call_s"] > 0
    assert all(r["compile_backend"] == "aot_eager" for r in compiled)
    assert [r["projection_choice"] for r in eager] == ["sdpa", "floor", "deberta-eager", "deberta-tempo"]


def test_max_batch_stage_finds_each_largest_batch_on_the_simulated_budget(quick_run):
    record = _record(quick_run[0], "max-batch")
    rows = {r["variant"]: r for r in record["rows"]}
    for r in rows.values():
        assert r["status"] == "ok" and r["complete"] is True
        assert r["smallest_failing"] - r["largest_fitting"] == gpu_quick.TINY.maxbatch[1]
        for probe in r["probes"]:  # every probe agrees with the answer
            assert probe["fits"] == (probe["batch"] <= r["largest_fitting"]), (r["variant"], probe)
    assert rows["tempo"]["largest_fitting"] > rows["stock-sdpa"]["largest_fitting"]


def test_summary_reads_every_stage(quick_run):
    out, _ = quick_run
    summary = (out / "summary.md").read_text()
    assert "- stages: 8 of 8 ok" in summary and "## Did not finish" not in summary
    assert "| gelu-exact | bf16 | triton (interpreter) | **ok** |" in summary
    assert "| disentangled-varlen-dropout | bf16 | triton (interpreter) | **ok** |" in summary
    assert "Not ok:" not in summary
    assert "| stock-sdpa | - | - |" in summary and "Tempo / stock sdpa: activations (ledger) 0." in summary
    # the projection column: the stand-in's projected times for the tiny layer
    assert " | 0.12 | " in summary.split("| bert-large | 2 x 16 | hf-sdpa |")[1].splitlines()[0]
    assert " | 0.06 | " in summary.split("| bert-large | 2 x 16 | tempo |")[1].splitlines()[0]
    assert "| stock-sdpa | " in summary.split("## Largest batch")[1]
