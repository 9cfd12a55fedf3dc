"""Every bad input named, no NaN ever trained on or saved (issue 14).

Tiny valid inputs are built here (a 40-token vocabulary, one hand-written DLE shard, a two-question
SQuAD file, a 1-layer config); each case corrupts one thing and runs the trainer in-process through
its ``main(argv)``, asserting a non-zero exit, no traceback and a message naming the file, field or
record. A few cases run the real entry points as subprocesses, to prove the same at process level.
The NaN runs diverge on purpose (a learning rate of 1e30, NaN initial weights) and must stop, or
skip, without ever writing a non-finite checkpoint, keeping the last finite one.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from tempo.bert.data.tokenization import SPECIAL_TOKENS, VOCAB_RULE
from tempo.tasks import pretrain, squad
from tempo.train.dllog import read_dllog

REPO = Path(__file__).resolve().parent.parent
WORDS = [f"w{i}" for i in range(35)]
V, L, P, N = 40, 16, 3, 32  # vocab, sequence length, predictions, rows
ROW = 5  # the row the value cases corrupt: length 13, so columns 13..15 are padding


def _valid_arrays() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    arrays = {"input_ids": np.zeros((N, L), np.int32), "input_mask": np.zeros((N, L), np.int16),
              "segment_ids": np.zeros((N, L), np.int16), "masked_lm_positions": np.zeros((N, P), np.int16),
              "masked_lm_ids": np.zeros((N, P), np.int32), "next_sentence_labels": (np.arange(N) % 2).astype(np.int16)}
    for row in range(N):
        n = 8 + row % 9
        ids = rng.integers(5, V, n)
        ids[0], ids[n // 2], ids[n - 1] = 2, 3, 3  # [CLS] A [SEP] B [SEP]
        arrays["input_ids"][row, :n] = ids
        arrays["input_mask"][row, :n] = 1
        arrays["segment_ids"][row, n // 2 + 1:n] = 1
        k = 1 + row % P
        positions = np.sort(rng.choice(np.arange(1, n // 2), k, replace=False))
        arrays["masked_lm_positions"][row, :k] = positions
        arrays["masked_lm_ids"][row, :k] = ids[positions]
    return arrays


def _write_shard(path: Path, arrays: dict[str, np.ndarray]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with h5py.File(path, "w") as f:
        for key, value in arrays.items():
            f[key] = value
    return path


def _squad_file(path: Path, qas: list[dict] | None = None, context: str | None = None, raw: str | None = None) -> Path:
    context = context or " ".join(WORDS[:12])
    qas = qas or [{"id": "q1", "question": "w1 w2", "answers": [{"text": "w4", "answer_start": context.index("w4")}]},
                  {"id": "q2", "question": "w7", "answers": [{"text": "w9 w10", "answer_start": context.index("w9")}]}]
    paragraphs = [{"context": context, "qas": qas}]
    text = raw or json.dumps({"version": "v2.0", "data": [{"title": "t", "paragraphs": paragraphs}]})
    path.write_text(text)
    return path


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny")
    (root / "vocab.txt").write_text("\n".join([*SPECIAL_TOKENS, *WORDS]) + "\n")
    config = dict(vocab_size=V, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
                  max_position_embeddings=32, type_vocab_size=2)
    (root / "config.json").write_text(json.dumps(config))
    _write_shard(root / "shards" / "part_0.hdf5", _valid_arrays())
    return {"root": root, "vocab": root / "vocab.txt", "config": root / "config.json", "shards": root / "shards",
            "squad": _squad_file(root / "train.json")}


@pytest.fixture(autouse=True)
def _keep_sigterm():
    """The pretraining loop installs a SIGTERM handler; a run that stops with an error leaves it."""
    previous = signal.getsignal(signal.SIGTERM)
    yield
    signal.signal(signal.SIGTERM, previous)


def _pretrain_argv(tiny, out: Path, *extra: str) -> list[str]:
    return ["--input_dir", str(tiny["shards"]), "--config_file", str(tiny["config"]),
            "--vocab_file", str(tiny["vocab"]),
            "--output_dir", str(out), "--max_seq_length", str(L), "--max_predictions_per_seq", str(P),
            "--train_batch_size", "4", "--max_steps", "2", "--learning_rate", "1e-3", "--num_workers", "0",
            "--disable_progress_bar", "--no-tempo", "--no_cuda", "--skip_checkpoint", *extra]


def _squad_argv(tiny, out: Path, *extra: str) -> list[str]:
    return ["--config_file", str(tiny["config"]), "--vocab_file", str(tiny["vocab"]), "--output_dir", str(out),
            "--do_train", "--train_file", str(tiny["squad"]), "--max_seq_length", "32", "--doc_stride", "16",
            "--max_query_length", "8", "--train_batch_size", "2", "--max_steps", "2", "--learning_rate", "1e-3",
            "--num_workers", "0", "--disable-progress-bar", "--no-tempo", "--no_cuda", "--skip_cache",
            "--skip_checkpoint", "--log_freq", "1", *extra]


def _run(main, argv: list[str], capsys) -> tuple[int, str]:
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse: status 2 and its usage message
        code = exc.code
    out, err = capsys.readouterr()
    return code, out + err


def _expect_error(main, argv, capsys, *needles: str, status: int | None = None) -> str:
    code, output = _run(main, argv, capsys)
    assert code != 0, output
    if status is not None:
        assert code == status, output
    assert "Traceback" not in output, output
    for needle in needles:
        assert needle in output, (needle, output)
    errors = [line for line in output.splitlines() if ": error: " in line]
    assert len(errors) == 1, output  # one line names the problem
    return errors[0]


# -- shards: one corruption at a time ------------------------------------------------------------
def _set(key, index, value):
    def change(arrays):
        arrays[key][index] = value
    return change


SHARD_CASES = {
    # name: (change to the valid arrays, what the message must contain)
    "token-id-outside-vocab": (_set("input_ids", (ROW, 2), V), f"dataset input_ids row {ROW} column 2 holds {V}"),
    "token-id-negative": (_set("input_ids", (ROW, 1), -7), f"dataset input_ids row {ROW} column 1 holds -7"),
    "segment-id-3": (_set("segment_ids", (ROW, 9), 3), f"dataset segment_ids row {ROW} column 9 holds 3"),
    "input-mask-7": (_set("input_mask", (ROW, 0), 7), f"dataset input_mask row {ROW} column 0 holds 7"),
    "row-without-tokens": (_set("input_mask", ROW, 0), f"dataset input_mask row {ROW} has no real token"),
    "position-past-the-end": (_set("masked_lm_positions", (ROW, 0), L),
                              f"dataset masked_lm_positions row {ROW} column 0 holds {L}"),
    "position-on-padding": (_set("masked_lm_positions", (ROW, 0), 14),
                            f"dataset masked_lm_positions row {ROW} column 0 holds 14; it points at padding"),
    "label-outside-vocab": (_set("masked_lm_ids", (ROW, 0), V + 5),
                            f"dataset masked_lm_ids row {ROW} column 0 holds {V + 5}"),
    "nsp-label-minus-one": (_set("next_sentence_labels", ROW, -1), f"dataset next_sentence_labels row {ROW} holds -1"),
    "nsp-label-2": (_set("next_sentence_labels", ROW, 2), f"dataset next_sentence_labels row {ROW} holds 2"),
    "dataset-missing": (lambda a: a.pop("masked_lm_ids"), "lacks dataset(s) ['masked_lm_ids']"),
    "float-token-ids": (lambda a: a.update(input_ids=a["input_ids"].astype(np.float32)),
                        "input_ids must hold integers"),
    "short-segment-ids": (lambda a: a.update(segment_ids=a["segment_ids"][:, :-1]), "segment_ids has shape"),
}


@pytest.mark.parametrize("case", sorted(SHARD_CASES))
def test_a_bad_shard_value_is_named(tiny, tmp_path, capsys, case):
    change, needle = SHARD_CASES[case]
    arrays = _valid_arrays()
    change(arrays)
    shard = _write_shard(tmp_path / "shards" / f"bad_{case}.hdf5", arrays)
    argv = _pretrain_argv(tiny, tmp_path / "out", "--input_dir", str(shard.parent))
    _expect_error(pretrain.main, argv, capsys, str(shard), needle, status=1)


@pytest.mark.parametrize("damage", ["truncated", "not-hdf5", "empty"])
def test_a_damaged_shard_file_is_named(tiny, tmp_path, capsys, damage):
    good = (tiny["shards"] / "part_0.hdf5").read_bytes()
    shard = tmp_path / "shards" / f"{damage}.hdf5"
    shard.parent.mkdir()
    damaged = {"truncated": good[: len(good) // 2], "not-hdf5": b"input_ids,input_mask\n1,1\n", "empty": b""}
    shard.write_bytes(damaged[damage])
    argv = _pretrain_argv(tiny, tmp_path / "out", "--input_dir", str(shard.parent))
    _expect_error(pretrain.main, argv, capsys, str(shard), "truncated or not an HDF5 file", status=1)


# -- flags ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("flag, value", [
    ("--learning_rate", "nan"), ("--learning_rate", "inf"), ("--learning_rate", "-1e-3"), ("--learning_rate", "0"),
    ("--weight_decay", "nan"), ("--weight_decay", "-0.1"), ("--warmup_proportion", "1.5"),
    ("--warmup_proportion", "nan"), ("--log_freq", "nan"), ("--max_grad_norm", "inf"), ("--on_nonfinite", "ignore"),
])
def test_pretraining_numeric_flags_are_checked_when_parsed(tiny, tmp_path, capsys, flag, value):
    code, output = _run(pretrain.main, _pretrain_argv(tiny, tmp_path / "out", flag, value), capsys)
    assert code == 2 and "Traceback" not in output and f"argument {flag}" in output, output
    assert not (tmp_path / "out").exists()  # refused before anything was written


@pytest.mark.parametrize("flag, value", [
    ("--learning_rate", "nan"), ("--num_train_epochs", "inf"), ("--num_train_epochs", "-1"),
    ("--null_score_diff_threshold", "nan"), ("--warmup_proportion", "-0.1"), ("--max_grad_norm", "-1"),
])
def test_squad_numeric_flags_are_checked_when_parsed(tiny, tmp_path, capsys, flag, value):
    code, output = _run(squad.main, _squad_argv(tiny, tmp_path / "out", flag, value), capsys)
    assert code == 2 and "Traceback" not in output and f"argument {flag}" in output, output


# -- configs too large for memory ----------------------------------------------------------------
@pytest.mark.parametrize("field, value", [
    ("hidden_size", 2**20), ("vocab_size", 10**10), ("num_hidden_layers", 10**7), ("intermediate_size", 10**11),
    ("max_position_embeddings", 10**11),
])
@pytest.mark.parametrize("trainer", ["pretrain", "squad"])
def test_a_config_too_large_for_memory_names_the_field(tiny, tmp_path, capsys, trainer, field, value):
    config = json.loads(tiny["config"].read_text())
    config[field] = value
    path = tmp_path / "huge_config.json"
    path.write_text(json.dumps(config))
    main, argv = ((pretrain.main, _pretrain_argv(tiny, tmp_path / "out")) if trainer == "pretrain"
                  else (squad.main, _squad_argv(tiny, tmp_path / "out")))
    _expect_error(main, argv + ["--config_file", str(path)], capsys, str(path), f"field '{field}'", "too large",
                  status=1)


# -- one vocabulary rule, one message ------------------------------------------------------------
@pytest.mark.parametrize("lines, needle", [
    ([*SPECIAL_TOKENS, "w0", "w1", "w0", *WORDS[2:]], "line 8 repeats token 'w0' of line 6"),
    ([*SPECIAL_TOKENS[:3], "", *SPECIAL_TOKENS[3:], *WORDS], "line 4 is blank"),
    ([*SPECIAL_TOKENS[:4], *WORDS], "lacks special tokens ['[MASK]']"),
])
def test_both_trainers_apply_one_vocab_rule_with_one_message(tiny, tmp_path, capsys, lines, needle):
    vocab = tmp_path / "vocab.txt"
    vocab.write_text("\n".join(lines) + "\n")
    messages = []
    for main, argv in ((pretrain.main, _pretrain_argv(tiny, tmp_path / "p")),
                       (squad.main, _squad_argv(tiny, tmp_path / "s"))):
        line = _expect_error(main, argv + ["--vocab_file", str(vocab)], capsys, str(vocab), needle, VOCAB_RULE,
                             status=1)
        messages.append(line.split(": error: ", 1)[1])
    assert messages[0] == messages[1]


# -- SQuAD records -------------------------------------------------------------------------------
def test_is_impossible_that_is_not_a_boolean_is_named(tiny, tmp_path, capsys):
    path = _squad_file(tmp_path / "train.json", [{"id": "imp-1", "question": "w1", "is_impossible": "no",
                                                  "answers": [{"text": "w2", "answer_start": 3}]}])
    argv = _squad_argv(tiny, tmp_path / "out", "--train_file", str(path), "--version_2_with_negative")
    _expect_error(squad.main, argv, capsys, str(path), "question 'imp-1'", "'is_impossible' should be true or false",
                  status=1)


def test_inconsistent_is_impossible_is_an_error_or_skipped_and_counted(tiny, tmp_path, capsys):
    context = " ".join(WORDS[:12])
    qas = [{"id": "ok-1", "question": "w1", "answers": [{"text": "w4", "answer_start": context.index("w4")}],
            "is_impossible": False},
           {"id": "bad-2", "question": "w2", "answers": [{"text": "w5", "answer_start": context.index("w5")}],
            "is_impossible": True},
           {"id": "none-3", "question": "w3", "answers": [], "is_impossible": True}]
    path = _squad_file(tmp_path / "train.json", qas, context)
    argv = _squad_argv(tiny, tmp_path / "out", "--train_file", str(path), "--version_2_with_negative")
    _expect_error(squad.main, argv, capsys, str(path), "question 'bad-2'", "is_impossible is true but it has 1 answer",
                  "--skip_inconsistent_questions", status=1)
    with pytest.warns(UserWarning, match=r"train\.json: skipped 1 question\(s\) .* 'bad-2'"):
        code, output = _run(squad.main, argv + ["--skip_inconsistent_questions"], capsys)
    assert code == 0 and "2 training questions" in output, output


@pytest.mark.parametrize("field", ["context", "question"])
def test_a_lone_surrogate_is_named_by_question(tiny, tmp_path, capsys, field):
    context = " ".join(WORDS[:12])
    qa = {"id": "sur-9", "question": "w1", "answers": [{"text": "w4", "answer_start": context.index("w4")}]}
    question = "w1 @@" if field == "question" else "w1"
    paragraph = {"context": context + (" @@" if field == "context" else ""), "qas": [dict(qa, question=question)]}
    text = json.dumps({"data": [{"paragraphs": [paragraph]}]})
    path = _squad_file(tmp_path / "train.json", raw=text.replace("@@", "\\ud800"))
    _expect_error(squad.main, _squad_argv(tiny, tmp_path / "out", "--train_file", str(path)), capsys,
                  str(path), "question 'sur-9'", f"the {field} holds '\\ud800'", status=1)


def test_a_damaged_feature_cache_is_rebuilt(tiny, tmp_path, capsys):
    cache = tmp_path / "cache"
    argv = [a for a in _squad_argv(tiny, tmp_path / "out") if a != "--skip_cache"] + ["--cache_dir", str(cache)]
    assert _run(squad.main, argv, capsys)[0] == 0
    (entry,) = cache.glob("*.npz")
    entry.write_bytes(entry.read_bytes()[:200])  # a truncated zip: zipfile.BadZipFile
    with pytest.warns(UserWarning, match="unreadable .*BadZipFile.*rebuilding"):
        code, output = _run(squad.main, argv, capsys)
    assert code == 0 and "Traceback" not in output, output


# -- NaN: stopped, skipped, never saved ----------------------------------------------------------
def _finite_file(path: Path) -> bool:
    return all(torch.isfinite(t).all() for t in load_file(path).values())


def test_a_diverging_run_stops_and_keeps_the_last_finite_checkpoint(tiny, tmp_path, capsys):
    out = tmp_path / "out"
    argv = [a for a in _pretrain_argv(tiny, out, "--learning_rate", "1e30", "--max_steps", "6",
                                      "--num_steps_per_checkpoint", "1") if a != "--skip_checkpoint"]
    line = _expect_error(pretrain.main, argv, capsys, "non-finite loss or gradients", status=1)
    bad_step = int(line.split(": error: step ", 1)[1].split(" ", 1)[0])
    assert bad_step >= 2  # the first step runs on the initial weights
    ckpts = sorted(int(p.name.split("_")[1]) for p in (out / "checkpoints").iterdir() if p.name.startswith("ckpt_"))
    assert ckpts == list(range(max(1, bad_step - 3), bad_step))  # the last 3 finite ones, nothing after
    last = out / "checkpoints" / f"ckpt_{bad_step - 1}"
    assert _finite_file(last / "model.safetensors")
    assert json.loads((last / "meta.json").read_text())["finite"] is True
    state = torch.load(last / "training_state.pt", weights_only=True)
    assert all(torch.isfinite(v).all() for s in state["optimizer"]["state"].values() for v in s.values()
               if torch.is_tensor(v) and v.is_floating_point())


def test_skip_mode_skips_counts_and_saves_only_finite_weights(tiny, tmp_path, capsys):
    out = tmp_path / "out"
    argv = [a for a in _pretrain_argv(tiny, out, "--learning_rate", "1e30", "--max_steps", "4", "--optimizer", "adamw",
                                      "--on_nonfinite", "skip", "--num_steps_per_checkpoint", "100")
            if a != "--skip_checkpoint"]
    code, output = _run(pretrain.main, argv, capsys)
    assert code == 0 and "Traceback" not in output, output
    skips = [line for line in output.splitlines() if "step skipped" in line]
    assert skips and "run_pretraining.py: warning: step" in skips[0]
    summary = [r for r in read_dllog(str(out / "dllogger.json")) if r["step"] == []][-1]["data"]
    assert summary["skipped_steps"] == len(skips) >= 1
    assert _finite_file(out / "checkpoints" / "ckpt_4" / "model.safetensors")


@pytest.mark.parametrize("mode", ["stop", "skip"])
def test_nan_initial_weights_stop_at_step_one_and_nothing_is_saved(tiny, tmp_path, capsys, mode):
    from tempo.bert.config import BertConfig
    from tempo.bert.hf_interop import save_hf_checkpoint
    from tempo.bert.model import BertForPreTraining

    config = BertConfig.from_json_file(tiny["config"])
    model = BertForPreTraining(config)
    with torch.no_grad():
        model.bert.encoder.layer[0].attention.self.query.weight[3, 4] = float("nan")
    save_hf_checkpoint(model, tmp_path / "nan_init", config)
    out = tmp_path / "out"
    pre = [a for a in _pretrain_argv(tiny, out, "--init_checkpoint", str(tmp_path / "nan_init"), "--on_nonfinite", mode)
           if a != "--skip_checkpoint"]
    _expect_error(pretrain.main, pre, capsys, "step 1 (fp32)",
                  "first: bert.encoder.layer.0.attention.self.query.weight", status=1)
    assert not (out / "checkpoints").exists() or not any((out / "checkpoints").iterdir())
    sq = [a for a in _squad_argv(tiny, tmp_path / "sq", "--init_checkpoint", str(tmp_path / "nan_init"),
                                 "--on_nonfinite", mode) if a != "--skip_checkpoint"]
    _expect_error(squad.main, sq, capsys, "step 1 (fp32)", "query.weight", status=1)
    assert not (tmp_path / "sq" / "model.safetensors").exists()


def test_squad_divergence_stops_before_saving(tiny, tmp_path, capsys):
    out = tmp_path / "out"
    argv = [a for a in _squad_argv(tiny, out, "--learning_rate", "1e30", "--max_steps", "5")
            if a != "--skip_checkpoint"]
    _expect_error(squad.main, argv, capsys, "non-finite loss or gradients", "--on_nonfinite skip", status=1)
    assert not (out / "model.safetensors").exists()


# -- the same at process level -------------------------------------------------------------------
def _subprocess(script: str, argv: list[str]) -> subprocess.CompletedProcess:
    env = {k: v for k, v in __import__("os").environ.items() if k != "TRITON_INTERPRET"}
    env.update(OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    return subprocess.run([sys.executable, str(REPO / script), *argv], capture_output=True, text=True, env=env,
                          timeout=300)


def test_processes_exit_with_one_line_and_no_traceback(tiny, tmp_path):
    arrays = _valid_arrays()
    arrays["next_sentence_labels"][ROW] = -1
    shard = _write_shard(tmp_path / "shards" / "nsp.hdf5", arrays)
    result = _subprocess("run_pretraining.py", _pretrain_argv(tiny, tmp_path / "p", "--input_dir", str(shard.parent)))
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    assert f"run_pretraining.py: error: shard {shard}: dataset next_sentence_labels row {ROW} holds -1" in result.stderr

    result = _subprocess("run_pretraining.py", _pretrain_argv(tiny, tmp_path / "p2", "--learning_rate", "nan"))
    assert result.returncode == 2 and "Traceback" not in result.stderr and "argument --learning_rate" in result.stderr

    path = _squad_file(tmp_path / "train.json", raw=json.dumps(
        {"data": [{"paragraphs": [{"context": "w1 w2 @@", "qas": [{"id": "p-1", "question": "w1", "answers": []}]}]}]}
    ).replace("@@", "\\ud800"))
    result = _subprocess("run_squad.py", _squad_argv(tiny, tmp_path / "s", "--train_file", str(path)))
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    assert "run_squad.py: error:" in result.stderr and "question 'p-1'" in result.stderr
