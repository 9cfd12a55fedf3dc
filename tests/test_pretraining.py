"""run_pretraining.py end to end on the CPU: logs, resume, signals, DDP, patch scripts, bad input.

Every run is a real subprocess of the entry point (as users and torchrun start it), on shards
built once from the project's generated corpus with a tiny BERT.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tempo.train.dllog import read_dllog

REPO = Path(__file__).resolve().parent.parent
SEQ, PRED = 32, 5


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    env.pop("TRITON_INTERPRET", None)  # training uses the reference path on CPU
    env.update(extra)
    return env


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> dict[str, Path]:
    from tempo.bert.data.create_pretraining_data import create_shards
    from tempo.bert.data.sample_corpus import write_sample_corpus
    from tempo.bert.data.tokenization import train_wordpiece_vocab

    root = tmp_path_factory.mktemp("pretrain_data")
    files = write_sample_corpus(root / "text", num_documents=120, seed=3)
    vocab = root / "vocab.txt"
    train_wordpiece_vocab(files, 600, vocab)
    shards = root / "shards"
    create_shards(root / "text", shards, vocab, max_seq_length=SEQ, max_predictions_per_seq=PRED,
                  dupe_factor=1, num_shards=2, random_seed=1)
    config = json.loads((REPO / "configs" / "bert_tiny.json").read_text())
    config.update(vocab_size=sum(1 for _ in open(vocab)), hidden_size=32, intermediate_size=64,
                  num_attention_heads=2, max_position_embeddings=64)
    config_file = root / "config.json"
    config_file.write_text(json.dumps(config))
    no_dropout = dict(config, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    config_nodrop = root / "config_nodrop.json"
    config_nodrop.write_text(json.dumps(no_dropout))
    return {"root": root, "shards": shards, "vocab": vocab, "config": config_file, "config_nodrop": config_nodrop}


def _cmd(data: dict[str, Path], out: Path, *extra: str, steps: int = 8, batch: int = 4) -> list[str]:
    return [sys.executable, str(REPO / "run_pretraining.py"), "--input_dir", str(data["shards"]),
            "--config_file", str(data["config"]), "--vocab_file", str(data["vocab"]), "--output_dir", str(out),
            "--max_seq_length", str(SEQ), "--max_predictions_per_seq", str(PRED),
            "--train_batch_size", str(batch), "--learning_rate", "1e-3", "--max_steps", str(steps),
            "--warmup_proportion", "0.25", "--seed", "7", "--log_freq", "1", "--num_workers", "0",
            "--disable_progress_bar", "--num_steps_per_checkpoint", "4", *extra]


def _run(cmd: list[str], check: bool = True, **kw) -> subprocess.CompletedProcess:
    result = subprocess.run(cmd, capture_output=True, text=True, env=_env(), timeout=300, **kw)
    if check and result.returncode != 0:
        raise AssertionError(f"exit {result.returncode}\nstdout:\n{result.stdout}\nstderr:\n{result.stderr}")
    return result


def _step_losses(log: Path) -> dict[int, float]:
    return {r["step"]: r["data"]["loss"] for r in read_dllog(str(log)) if isinstance(r["step"], int)}


def _summary(log: Path) -> dict:
    return [r for r in read_dllog(str(log)) if r["step"] == []][-1]["data"]


def test_run_logs_summary_and_checkpoints(data, tmp_path):
    out = tmp_path / "run"
    _run(_cmd(data, out, "--tempo"))
    records = read_dllog(str(out / "dllogger.json"))
    assert records[0]["step"] == "PARAMETER" and records[0]["data"]["tempo"] is True
    losses = _step_losses(out / "dllogger.json")
    assert sorted(losses) == list(range(1, 9))
    summary = _summary(out / "dllogger.json")
    for key in ("e2e_train_time", "training_sequences_per_second", "final_loss", "peak_rss_bytes",
                "activation_bytes_per_micro_batch"):
        assert key in summary, key
    assert summary["final_loss"] == losses[8]
    assert summary["activation_bytes_per_micro_batch"] > 0
    ckpts = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert ckpts == ["ckpt_4", "ckpt_8"]


def test_tempo_keeps_fewer_bytes_than_original(data, tmp_path):
    kept = {}
    for flag in ("--tempo", "--no-tempo"):
        out = tmp_path / flag.strip("-")
        _run(_cmd(data, out, flag, steps=1, batch=8) + ["--skip_checkpoint"])
        kept[flag] = _summary(out / "dllogger.json")["activation_bytes_per_micro_batch"]
    assert kept["--tempo"] < 0.8 * kept["--no-tempo"]


@pytest.mark.parametrize("layers", ["--tempo", "--no-tempo"])
def test_unpad_trains_the_same_as_padded_and_keeps_fewer_bytes(data, tmp_path, layers):
    """Dropout off: the unpadded run's step losses equal the padded run's (same data, same init).
    (These s = 32 shards are 1% padding: bytes saved are tested in test_unpad_model.py.)"""
    runs = {}
    for flag in ("--unpad", "--no-unpad"):
        out = tmp_path / flag.strip("-")
        _run(_cmd(data, out, layers, flag, steps=3, batch=8) + ["--config_file", str(data["config_nodrop"]),
                                                                "--skip_checkpoint"])
        runs[flag] = (_step_losses(out / "dllogger.json"), _summary(out / "dllogger.json"))
    (unpadded, u), (padded, p) = runs["--unpad"], runs["--no-unpad"]
    for step in padded:
        assert abs(unpadded[step] - padded[step]) <= 1e-5 * abs(padded[step]), step
    assert u["unpad"] is True and p["unpad"] is False
    for s in (u, p):  # real tokens per sequence: 98-99% of SEQ in these shards
        per_sequence = s["training_real_tokens_per_second"] / s["training_sequences_per_second"]
        assert 0.9 * SEQ < per_sequence < SEQ


def test_stop_and_resume_reproduces_uninterrupted_losses(data, tmp_path):
    full, split = tmp_path / "full", tmp_path / "split"
    _run(_cmd(data, full, steps=8))
    _run(_cmd(data, split, "--steps_this_run", "4", steps=8))
    _run(_cmd(data, split, "--resume_from_checkpoint", steps=8))
    assert _step_losses(split / "dllogger.json") == _step_losses(full / "dllogger.json")
    final_full = load_file(full / "checkpoints" / "ckpt_8" / "model.safetensors")
    final_split = load_file(split / "checkpoints" / "ckpt_8" / "model.safetensors")
    for key in final_full:
        assert torch.equal(final_full[key], final_split[key]), key


def test_sigkill_then_resume_reproduces_losses(data, tmp_path):
    full, killed = tmp_path / "full", tmp_path / "killed"
    steps = 24
    _run(_cmd(data, full, steps=steps) + ["--num_steps_per_checkpoint", "2"])
    proc = subprocess.Popen(_cmd(data, killed, steps=steps) + ["--num_steps_per_checkpoint", "2"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=_env())
    deadline = time.time() + 120
    while time.time() < deadline and not (killed / "checkpoints" / "ckpt_4").exists():
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert (killed / "checkpoints" / "ckpt_4").exists()
    _run(_cmd(data, killed, "--resume_from_checkpoint", steps=steps) + ["--num_steps_per_checkpoint", "2"])
    reference = _step_losses(full / "dllogger.json")
    resumed = _step_losses(killed / "dllogger.json")  # both runs append to one log; later lines win
    assert resumed == reference


def test_sigterm_writes_a_final_checkpoint(data, tmp_path):
    out = tmp_path / "term"
    proc = subprocess.Popen(_cmd(data, out, steps=100_000) + ["--num_steps_per_checkpoint", "100000"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env())
    log = out / "dllogger.json"
    deadline = time.time() + 120
    while time.time() < deadline and not (log.exists() and len(_step_losses(log)) >= 3):
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 0, stderr
    assert "SIGTERM" in stderr
    ckpts = list((out / "checkpoints").iterdir())
    assert len(ckpts) == 1 and _summary(log)["stopped_by_sigterm"] is True


def test_resume_without_checkpoint_starts_fresh_with_warning(data, tmp_path):
    out = tmp_path / "empty"
    out.mkdir()
    result = _run(_cmd(data, out, "--resume_from_checkpoint", steps=2))
    assert "no checkpoint" in result.stderr
    assert sorted(_step_losses(out / "dllogger.json")) == [1, 2]


def test_init_checkpoint_alone_loads_weights(data, tmp_path):
    from tempo.bert.config import BertConfig
    from tempo.bert.hf_interop import save_hf_checkpoint
    from tempo.bert.model import BertForPreTraining

    config = BertConfig.from_json_file(data["config"])
    torch.manual_seed(123)
    save_hf_checkpoint(BertForPreTraining(config), tmp_path / "hf", config)
    out_a, out_b = tmp_path / "a", tmp_path / "b"
    for out in (out_a, out_b):
        _run(_cmd(data, out, "--init_checkpoint", str(tmp_path / "hf"), steps=1) + ["--skip_checkpoint"])
    scratch = tmp_path / "scratch"
    _run(_cmd(data, scratch, steps=1) + ["--skip_checkpoint"])
    loss = lambda out: _step_losses(out / "dllogger.json")[1]  # noqa: E731
    assert loss(out_a) == loss(out_b)  # deterministic given the same initial weights
    assert loss(out_a) != loss(scratch)  # and those weights were actually used


def test_phase2_restarts_schedule_from_phase1_checkpoint(data, tmp_path):
    out = tmp_path / "phases"
    _run(_cmd(data, out, steps=4))
    result = _run(_cmd(data, out, "--resume_from_checkpoint", "--phase2", "--phase1_end_step", "4", steps=2))
    assert "phase 2" in result.stdout
    assert (out / "checkpoints" / "ckpt_6").is_dir()  # phase-2 step 2 = global step 4 + 2


@pytest.mark.slow
def test_ddp_two_processes_match_one_process_with_double_batch(data, tmp_path):
    one, two = tmp_path / "one", tmp_path / "two"
    common = ["--config_file", str(data["config_nodrop"])]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    from test_token_budget import run_torchrun  # one rerun for torchrun's exit-time abort alone (see there)

    cmd = torchrun + _cmd(data, two, steps=3, batch=4)[1:] + common + ["--num_steps_per_checkpoint", "3"]
    result = run_torchrun(cmd, _env(), two)
    assert result.returncode == 0, f"stdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    _run(_cmd(data, one, steps=3, batch=8) + common + ["--num_steps_per_checkpoint", "3"])
    a = load_file(one / "checkpoints" / "ckpt_3" / "model.safetensors")
    b = load_file(two / "checkpoints" / "ckpt_3" / "model.safetensors")
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=1e-4, atol=1e-5, msg=key)


def test_patch_scripts_switch_the_default(data, tmp_path):
    state = tmp_path / "patch_state"
    env = _env(TEMPO_PATCH_FILE=str(state), PYTHON=sys.executable)
    scripts = REPO / "scripts" / "tempo"

    def sh(name: str) -> str:
        # From another directory: the scripts must not depend on the caller's working directory.
        return subprocess.run(["bash", str(scripts / name)], capture_output=True, text=True, env=env,
                              cwd=tmp_path, check=True).stdout.strip()

    assert sh("check_transformer_version.sh") == "Original"
    sh("patch_tempo.sh")
    assert sh("check_transformer_version.sh") == "Tempo"
    out = tmp_path / "patched"
    subprocess.run(_cmd(data, out, steps=1) + ["--skip_checkpoint"], env=env, check=True, capture_output=True)
    assert "gelu=True" in read_dllog(str(out / "dllogger.json"))[0]["data"]["tempo_options"]
    sh("unpatch_tempo.sh")
    assert sh("check_transformer_version.sh") == "Original"


def _expect_user_error(cmd: list[str], *needles: str) -> None:
    result = _run(cmd, check=False)
    assert result.returncode != 0
    assert "Traceback" not in result.stderr, result.stderr
    for needle in needles:
        assert needle in result.stderr, (needle, result.stderr)


def test_bad_input_is_reported_clearly(data, tmp_path):
    missing = tmp_path / "nope"
    _expect_user_error(_cmd(data, tmp_path / "o1")[:2] + ["--input_dir", str(missing)] + _cmd(data, tmp_path / "o1")[4:],
                       "--input_dir", str(missing))
    empty = tmp_path / "empty_in"
    empty.mkdir()
    _expect_user_error(_cmd(data, tmp_path / "o2")[:2] + ["--input_dir", str(empty)] + _cmd(data, tmp_path / "o2")[4:],
                       str(empty))

    bad_config = tmp_path / "bad_config.json"
    bad_config.write_text(json.dumps({"hidden_size": "big"}))
    _expect_user_error(_cmd(data, tmp_path / "o3") + ["--config_file", str(bad_config)], "bad_config.json")

    big_vocab = tmp_path / "big_vocab.txt"
    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    big_vocab.write_text("\n".join(specials + [f"tok{i}" for i in range(5000)]) + "\n")
    _expect_user_error(_cmd(data, tmp_path / "o4") + ["--vocab_file", str(big_vocab)], "big_vocab.txt", "vocab_size")

    _expect_user_error(_cmd(data, tmp_path / "o5") + ["--max_seq_length", "128"], "max_position_embeddings")

    blocker = tmp_path / "file_not_dir"
    blocker.write_text("x")
    _expect_user_error(_cmd(data, blocker / "sub"), "--output_dir")


def test_corrupt_shard_is_named(data, tmp_path):
    shards = tmp_path / "shards"
    shards.mkdir()
    good = sorted(data["shards"].glob("*.hdf5"))[0]
    (shards / "bad_shard.hdf5").write_bytes(good.read_bytes()[:1000])
    cmd = _cmd(data, tmp_path / "out")
    cmd[cmd.index("--input_dir") + 1] = str(shards)
    _expect_user_error(cmd, "bad_shard.hdf5")
