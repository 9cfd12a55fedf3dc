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

from tempo.tasks import demo

REPO = Path(__file__).resolve().parent.parent


def _env() -> dict[str, str]:
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    env.pop("TRITON_INTERPRET", None)  # training uses the reference path on the CPU
    return env


def _summary(loss: float, tokens: float, kept: int) -> dict:
    return {"tail_loss": loss, "tail_steps": 30, "training_real_tokens_per_second": tokens,
            "training_sequences_per_second": tokens / 200, "activation_bytes_per_micro_batch": kept,
            "peak_rss_bytes": 500 * 2**20}


def test_headline_comes_first_and_says_what_tempo_buys():
    results = {"original": _summary(6.96, 3500.0, 180 * 2**20), "tempo": _summary(6.95, 5800.0, 26 * 2**20),
               "tempo_padded": _summary(6.96, 3000.0, 52 * 2**20)}
    state = 10 * 2**20
    text = demo.headline(results, 8, state, 2**30, on_gpu=False)
    fits_o = demo.largest_batch(180 * 2**20, 8, state, 2**30)
    fits_t = demo.largest_batch(26 * 2**20, 8, state, 2**30)
    assert "the same loss: 6.950 against 6.960" in text
    assert f"{fits_t / fits_o:.1f}x the batch: {fits_t} sequences fit in 1.00 GiB against {fits_o}" in text
    assert "1.7x the real tokens/s on this CPU: 5,800 against 3,500; Tempo's layers run their PyTorch reference" in text
    assert "(on the padded batch: 0.86x the original's real tokens/s)" in text  # what the layers cost alone
    table = demo.format_results(results, 8, state, 2**30)
    assert "| original (padded)" in table and "| Tempo (real tokens only) vs original" in table
    results["tempo"]["tail_loss"] = 7.5
    assert "a loss 8% apart" in demo.headline(results, 8, state, 2**30, on_gpu=False)


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
    assert "--quick" in out and "smoke run" in out and "--verbose" in out
    assert "--quick" in demo.__doc__


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("demo_data")
    shard_dir, vocab = demo.build_dataset(root, num_documents=40, vocab_size=300, seq_len=32, seed=3)
    config = demo.write_demo_config(root, vocab, REPO / "configs" / "bert_tiny.json")
    data = json.loads(config.read_text())
    data.update(hidden_size=32, intermediate_size=64, num_attention_heads=2)
    config.write_text(json.dumps(data))
    return {"shards": shard_dir, "vocab": vocab, "config": config}


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
                               "every Tempo layer on the padded batch"), 1):
        assert f"run {k} of 3: {title}" in out
    assert "tempo.tasks.pretrain" not in out and "--input_dir" not in out  # no internal command echo
    assert "step 1/3" not in out  # the trainer's own step lines only with --verbose
    headline = out.index("Tempo (every layer, real tokens only) against the original layers (padded):")
    assert headline < out.index("| original (padded)") < out.index("On a GPU, Triton kernels")
    assert "x the batch:" in out and "x the real tokens/s on this CPU" in out
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
