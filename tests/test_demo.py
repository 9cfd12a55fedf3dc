"""The main job (``python -m tempo``): what it prints, its smoke run, and how it stops on SIGTERM."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import torch

from tempo.tasks import demo

REPO = Path(__file__).resolve().parent.parent


def _env() -> dict[str, str]:
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    env.pop("TRITON_INTERPRET", None)  # training uses the reference path on the CPU
    return env


def _summary(loss: float, tokens: float, per_micro_batch: float, seen: int) -> dict:
    return {"tail_loss": loss, "tail_steps": 9, "steps": 45, "training_real_tokens_per_second": tokens,
            "training_sequences_per_second": tokens / 200, "real_tokens_per_micro_batch": per_micro_batch,
            "real_tokens_seen": seen, "peak_rss_bytes": 500 * 2**20, "cpu_threads": [2]}


def _plans() -> dict:
    original = demo.RunPlan(2048, False, ("none", "none"), 110 * 2**20, 512, 232.4, full_recompute_tokens=4096,
                            micro_batches=7)
    tempo_plan = demo.RunPlan(6880, True, ("none", "none"), 128 * 2**20, 512, 232.4)
    return {"original": original, "tempo": tempo_plan, "tempo_padded": original}


def test_headline_comes_first_and_says_what_tempo_buys():
    results = {"original": _summary(7.766, 6000.0, 950.0, 299_275), "tempo": _summary(7.791, 11_000.0, 6471.0, 291_213),
               "tempo_padded": _summary(7.767, 4500.0, 950.0, 299_275)}
    text = demo.headline(results, _plans(), "128MiB", on_gpu=False)
    assert text.startswith("Tempo (every layer, real tokens only) against the original layers (padded), in 128MiB:")
    assert ("6.8x the real tokens per micro-batch: 6,471 against 950 (2,048 with padding); neither recomputes; "
            "recomputing every block, the original would fit 4,096 tokens (about 1,859 real)") in text
    assert ("the same loss: 7.791 against 7.766 (mean of the last 9 steps of the same 45, taken in 1 micro-batch "
            "against 7; 291,213 and 299,275 real tokens seen)") in text
    assert "1.8x the real tokens/s on this CPU: 11,000 against 6,000; Tempo's layers run their PyTorch reference" in text
    # The equal-batch pair: Tempo's layers on the original's own micro-batches (speed and loss).
    assert "(Tempo's layers on the original's own micro-batches: 0.75x its real tokens/s, loss 7.767 against 7.766)" in text
    table = demo.format_results(results, _plans())
    assert "| original (padded)" in table and "| Tempo (real tokens only) vs original" in table
    assert "| 2,048 (950)" in table and "| 6,880 " in table  # padded runs: with padding (real)
    assert "peak allocated" not in table  # a CPU process's RSS is not the tensors' peak
    for s in results.values():
        s["peak_allocated_bytes"] = 100 * 2**20
    assert "peak allocated (GPU)" in demo.format_results(results, _plans()).splitlines()[0]
    results["tempo"]["tail_loss"] = 8.5
    assert "a loss 9% apart" in demo.headline(results, _plans(), "128MiB", on_gpu=False)


def test_every_run_takes_the_same_steps_in_micro_batches_of_its_plan():
    plans = _plans()
    steps = demo.equal_steps({"original": demo.replace(plans["original"], micro_batches=1), "tempo": plans["tempo"]})
    # 6,880 real tokens in one Tempo micro-batch; the original's holds 4 sequences of ~232 real tokens.
    assert steps["tempo"].micro_batches == 1 and steps["original"].micro_batches == round(6880 / (4 * 232.4)) == 7
    assert steps["original"].real_tokens == 4 * 232.4
    text = demo.format_plans(steps, "128MiB", 45, 3.0)
    assert "  original (padded):         2,048 tokens (4 sequences of 512), no recompute, predicted peak 110.0 MiB" in text
    assert "every run takes the same 45 optimizer steps of about 6,880 real tokens: original (padded) in 7 " \
           "micro-batches, Tempo (real tokens only) in 1 micro-batch" in text


def test_run_commands_carry_the_plan(tmp_path):
    plans, args = _plans(), demo.argparse.Namespace(seq_len=512, lr=2e-3, steps=45, seed=1)
    for variant in demo.VARIANTS:
        cmd, _ = demo.run_command(variant, plans[variant.key], tmp_path, tmp_path, tmp_path / "c.json",
                                  tmp_path / "v.txt", args, on_gpu=False, progress_bar=False)
        flags = dict(zip(cmd, cmd[1:]))
        assert flags["--max_tokens"] == str(plans[variant.key].tokens)
        assert flags["--gradient_accumulation_steps"] == str(plans[variant.key].micro_batches)
        assert ("--pad_to_multiple_of" in flags) == (variant.key != "tempo")  # padded runs: DLE's s = 512
        assert "--train_batch_size" not in flags


def test_cpu_threads_are_read_from_the_trainer_lines():
    out = ("CPU threads: 2 of 2 (other work kept 0.0 of 2 cores busy; ...)\nrun_pretraining.py: 2 layers\n"
           "CPU threads: 2 -> 1 (other work kept 1.3 of 2 cores busy)\nCPU threads: 1 -> 2 (...)\n")
    assert demo.cpu_threads(out) == [2, 1, 2]
    assert demo._threads([2, 1, 2]) == " on 1 to 2 threads (2 changes with the load)"
    assert demo._threads([1]) == " on 1 thread" and demo._threads([]) == ""


def test_tail_loss_is_the_last_fifth_of_the_run():
    from tempo.tasks.demo import tail_loss

    assert tail_loss([9.0, 8.0, 7.0, 6.0, 5.0, 4.0, 3.0, 2.0, 1.0, 0.0]) == (0.5, 2)
    assert tail_loss([3.0, 2.0]) == (2.0, 1)
    mean, count = tail_loss([])
    assert math.isnan(mean) and count == 0


def test_help_documents_quick(capsys):
    with pytest.raises(SystemExit) as exc:
        demo.main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert "--quick" in out and "smoke run" in out and "--verbose" in out and "--memory_budget" in out
    assert "--quick" in demo.__doc__


@pytest.mark.parametrize("budget", ["lots", "0MiB"])
def test_a_budget_that_is_not_a_size_is_refused_before_any_work(budget, tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        demo.main(["--memory_budget", budget, "--work_dir", str(tmp_path / "w")])
    assert exc.value.code == 2
    assert f"--memory_budget {budget!r}" in capsys.readouterr().err
    assert not (tmp_path / "w").exists()


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("demo_data")
    shard_dir, vocab = demo.build_dataset(root, num_documents=40, vocab_size=300, seq_len=32, seed=3)
    config = demo.write_demo_config(root, vocab, REPO / "configs" / "bert_tiny.json")
    data = json.loads(config.read_text())
    data.update(hidden_size=32, intermediate_size=64, num_attention_heads=2)
    config.write_text(json.dumps(data))
    return {"shards": shard_dir, "vocab": vocab, "config": config}


def test_each_run_gets_the_tokens_max_tokens_auto_would_plan(shards):
    """The demo plans each run as run_pretraining.py's --max_tokens auto does (its model, tempo=False, the
    first shard's lengths), the padded runs at s: the tokens agree, and each plan fits the budget."""
    from tempo.bert.data.pretraining_dataset import list_shards
    from tempo.bert.data.pretraining_dataset import shard_lengths
    from tempo.train.flags import planned_max_tokens

    plans = demo.plan_runs(shards["config"], shards["shards"], 32, "8MiB", on_gpu=False)
    lengths = shard_lengths(list_shards(shards["shards"])[0])
    tempo_variant = next(v for v in demo.VARIANTS if v.key == "tempo")
    model = demo.trainer_model(shards["config"], tempo_variant)
    assert plans["tempo"].tokens == planned_max_tokens(model, lengths, torch.device("cpu"), "fp32", "lamb", "8MiB")
    assert plans["tempo"].unpadded and not plans["original"].unpadded
    assert plans["original"].tokens % 32 == 0 and plans["original"].tokens >= 32  # whole sequences of s
    assert plans["tempo_padded"] == plans["original"]  # Tempo's padded run takes the original's micro-batches
    for plan in plans.values():
        assert plan.recompute == ("none", "none") and 0 < plan.peak <= 8 * 2**20
    assert plans["tempo"].tokens > plans["original"].real_tokens  # what Tempo buys in the same memory
    assert min(p.micro_batches for p in plans.values()) == 1


def test_a_plan_that_recomputes_is_refused_with_the_budget_that_would_not(shards):
    """Between the budget full recompute needs and the one no recompute needs, the planner recomputes,
    which the trainer's runs do not: the demo says the least budget that runs without it."""
    import tempo.plan as tp

    variant = next(v for v in demo.VARIANTS if v.key == "original")
    counted = tp.count(demo.trainer_model(shards["config"], variant), 512, device="cpu", precision="fp32",
                       optimizer="lamb", tempo=False)  # at s = 512 a sequence's s x s scores dominate
    least = counted.peak_at(("none", "none"), 512).total
    full = counted.peak_at(("full", "full"), 512).total
    assert full < least
    budget = f"{(full + least) // 2}"
    with pytest.raises(SystemExit) as exc:
        demo.plan_run(variant, shards["config"], [512], 512, budget, on_gpu=False)
    assert f"python -m tempo: --memory_budget {budget}: the plan of original (padded) recomputes" in str(exc.value)
    assert f"pass at least {math.ceil(least / 2**20)}MiB" in str(exc.value)
    at_least = demo.plan_run(variant, shards["config"], [512], 512, f"{math.ceil(least / 2**20)}MiB", on_gpu=False)
    assert at_least.recompute == ("none", "none") and at_least.tokens == 512


def _wait_for_steps(log: Path, steps: int, proc: subprocess.Popen) -> None:
    deadline = time.time() + 180
    while time.time() < deadline and proc.poll() is None:
        if log.exists():
            records = [json.loads(line[5:]) for line in log.read_text().splitlines()
                       if line.startswith("DLLL ") and line.endswith("}")]
            if sum(1 for r in records if isinstance(r["step"], int)) >= steps:
                return
        time.sleep(0.05)
    raise AssertionError(f"{log}: fewer than {steps} steps logged")


def test_sigterm_with_skip_checkpoint_says_it_writes_none(shards, tmp_path):
    out = tmp_path / "term"
    cmd = [sys.executable, "-m", "tempo.tasks.pretrain", "--input_dir", str(shards["shards"]),
           "--config_file", str(shards["config"]), "--vocab_file", str(shards["vocab"]), "--output_dir", str(out),
           "--max_seq_length", "32", "--max_predictions_per_seq", "4", "--train_batch_size", "4",
           "--max_steps", "100000", "--log_freq", "1", "--num_workers", "0", "--disable_progress_bar",
           "--skip_checkpoint"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=_env())
    _wait_for_steps(out / "dllogger.json", 3, proc)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 0, stderr
    assert "SIGTERM received at step" in stderr and "stopping without a checkpoint (--skip_checkpoint)" in stderr
    assert "checkpoint at step" not in stderr
    assert not (out / "checkpoints").exists() or not any((out / "checkpoints").iterdir())


def _demo_cmd(work: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "tempo", "--quick", "--documents", "40", "--seq_len", "32", "--vocab_size", "300",
            "--work_dir", str(work), *extra]


def test_quick_run_tells_the_story_without_command_lines(tmp_path):
    result = subprocess.run(_demo_cmd(tmp_path, "--steps", "3"), capture_output=True, text=True, env=_env(),
                            timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    for k, title in enumerate(("the original layers", "every Tempo layer on the real tokens only",
                               "every Tempo layer on the original's padded micro-batches"), 1):
        assert f"run {k} of 3: {title}" in out
    assert "plans for a 32MiB budget (tempo.plan" in out and "every run takes the same 3 optimizer steps" in out
    assert out.count("on 1 thread:") == 3  # OMP_NUM_THREADS=1 (the trainer's line, read back)
    assert "tempo.tasks.pretrain" not in out and "--input_dir" not in out  # no internal command echo
    assert "step 1/3" not in out  # the trainer's own step lines only with --verbose
    headline = out.index("Tempo (every layer, real tokens only) against the original layers (padded), in 32MiB:")
    assert headline < out.index("| original (padded)") < out.index("On a GPU, Triton kernels")
    assert "x the real tokens per micro-batch:" in out and "x the real tokens/s on this CPU" in out
    assert (tmp_path / "demo_results.md").exists()


def test_sigterm_stops_the_demo_without_a_checkpoint(tmp_path):
    proc = subprocess.Popen(_demo_cmd(tmp_path, "--steps", "100000"), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=_env())
    _wait_for_steps(tmp_path / "run_original" / "dllogger.json", 2, proc)
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, stdout + stderr
    assert "stopping without a checkpoint (--skip_checkpoint)" in stderr  # the running run's own line
    assert "python -m tempo: stopped by SIGTERM; no checkpoint was written" in stderr
    assert "run 1 of 3" in stdout and "run 2 of 3" not in stdout
    ckpts = tmp_path / "run_original" / "checkpoints"
    assert not ckpts.exists() or not any(ckpts.iterdir())
