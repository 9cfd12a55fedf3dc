"""run_squad.py end to end: a tiny train+predict run, predict-only and v2 runs, bad-input exits,
the benchmark scripts' syntax and summary table, and (slow) MiniLM reaching EM >= 80."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tempo.bert.data.qa_generator import write_qa_set
from tempo.train.dllog import read_dllog
from tempo.tasks.squad import main

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def vocab_file():
    from tempo.bert.hf_interop import minilm_dir

    try:
        return str(minilm_dir() / "vocab.txt")
    except FileNotFoundError as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="module")
def qa_set(tmp_path_factory):
    return write_qa_set(tmp_path_factory.mktemp("qa"), num_train=24, num_dev=8, seed=7)


def _tiny_args(vocab_file, out, *extra):
    return ["--config_file", str(REPO / "configs" / "bert_tiny.json"), "--vocab_file", vocab_file,
            "--output_dir", str(out), "--max_seq_length", "96", "--doc_stride", "32", "--max_query_length", "24",
            "--disable-progress-bar", "--num_workers", "0", "--no-tempo", *extra]


def _summaries(path):
    merged = {}
    for record in read_dllog(path):
        if record["step"] == []:
            merged.update(record["data"])
    return merged


def test_tiny_train_then_predict(tmp_path, qa_set, vocab_file):
    train_file, dev_file = map(str, qa_set)
    out = tmp_path / "run"
    status = main(_tiny_args(vocab_file, out, "--do_train", "--train_file", train_file, "--do_predict",
                             "--predict_file", dev_file, "--train_batch_size", "4", "--max_steps", "3",
                             "--log_freq", "1", "--cache_dir", str(tmp_path / "cache")))
    assert status == 0
    for name in ("predictions.json", "nbest_predictions.json", "train_results.json", "eval_results.json",
                 "model.safetensors", "config.json", "vocab.txt", "dllogger.json"):
        assert (out / name).is_file(), name
    assert not (out / "null_odds.json").exists()
    predictions = json.loads((out / "predictions.json").read_text())
    assert len(predictions) == 8 and all(isinstance(v, str) for v in predictions.values())
    nbest = json.loads((out / "nbest_predictions.json").read_text())
    assert set(nbest) == set(predictions)
    assert set(nbest[next(iter(nbest))][0]) == {"text", "probability", "start_logit", "end_logit"}
    train_results = json.loads((out / "train_results.json").read_text())
    assert {"train_runtime", "train_samples_per_second", "train_loss"} <= set(train_results)
    summary = _summaries(out / "dllogger.json")
    # The run uses the GPU when there is one: CUDA runs report allocator peaks, CPU runs the RSS.
    peak_keys = ("peak_allocated_bytes", "peak_reserved_bytes") if torch.cuda.is_available() else ("peak_rss_bytes",)
    for key in ("e2e_train_time", "training_sequences_per_second", "final_loss", "e2e_inference_time",
                "inference_sequences_per_second", "exact_match", "F1", *peak_keys):
        assert key in summary, key
    assert [r["step"] for r in read_dllog(out / "dllogger.json") if isinstance(r["step"], int)] == [1, 2, 3]

    # The saved folder is a checkpoint: predict from it, on a file without answers (no scores).
    unanswered = tmp_path / "test.json"
    data = json.loads(Path(dev_file).read_text())
    for article in data["data"]:
        for paragraph in article["paragraphs"]:
            for qa in paragraph["qas"]:
                del qa["answers"]
    unanswered.write_text(json.dumps(data))
    out2 = tmp_path / "predict_only"
    assert main(["--init_checkpoint", str(out), "--output_dir", str(out2), "--do_predict", "--do_eval",
                 "--predict_file", str(unanswered), "--max_seq_length", "96", "--doc_stride", "32",
                 "--max_query_length", "24", "--disable-progress-bar", "--num_workers", "0", "--skip_cache"]) == 0
    assert (out2 / "predictions.json").is_file() and not (out2 / "eval_results.json").exists()
    assert not list(Path(unanswered).parent.glob("*.npz"))  # --skip_cache wrote nothing
    assert "exact_match" not in _summaries(out2 / "dllogger.json")


def test_v2_prediction_writes_null_odds_and_threshold_metrics(tmp_path, vocab_file):
    context = "Ada Lovelace was born in London in 1815."
    data = {"version": "v2.0", "data": [{"title": "t", "paragraphs": [{"context": context, "qas": [
        {"id": "a", "question": "Where was Ada born?", "answers": [{"text": "London", "answer_start": 25}],
         "is_impossible": False},
        {"id": "b", "question": "Who invented radio?", "answers": [], "is_impossible": True}]}]}]}
    path = tmp_path / "v2.json"
    path.write_text(json.dumps(data))
    out = tmp_path / "v2"
    assert main(_tiny_args(vocab_file, out, "--do_train", "--train_file", str(path), "--do_predict",
                           "--predict_file", str(path), "--version_2_with_negative", "--train_batch_size", "2",
                           "--max_steps", "1", "--skip_checkpoint", "--skip_cache")) == 0
    assert set(json.loads((out / "null_odds.json").read_text())) == {"a", "b"}
    assert not (out / "model.safetensors").exists()  # --skip_checkpoint
    metrics = json.loads((out / "eval_results.json").read_text())
    for key in ("exact_match", "F1", "exact", "f1", "HasAns_exact", "NoAns_exact", "best_exact",
                "best_exact_thresh", "best_f1", "best_f1_thresh"):
        assert key in metrics, key


def _run_cli(*args, cwd=REPO):
    return subprocess.run([sys.executable, str(REPO / "run_squad.py"), *args], cwd=cwd, capture_output=True,
                          text=True, timeout=120)


@pytest.mark.parametrize("case", ["not_json", "v2_without_flag", "answer_missing"])
def test_bad_input_exits_cleanly(tmp_path, vocab_file, case):
    bad = tmp_path / f"{case}.json"
    if case == "not_json":
        bad.write_text("{this is not json")
        needle = "not valid JSON"
    else:
        qa = ({"id": "imp-7", "question": "q?", "answers": [], "is_impossible": True} if case == "v2_without_flag"
              else {"id": "lost-3", "question": "q?", "answers": [{"text": "Paris", "answer_start": 0}]})
        bad.write_text(json.dumps({"data": [{"paragraphs": [{"context": "London is big.", "qas": [qa]}]}]}))
        needle = "imp-7" if case == "v2_without_flag" else "lost-3"
    result = _run_cli(*_tiny_args(vocab_file, tmp_path / "out", "--do_train", "--train_file", str(bad),
                                  "--max_steps", "1"))
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    assert str(bad) in result.stderr and needle in result.stderr
    assert "run_squad.py: error:" in result.stderr


def test_bad_flags_exit_cleanly(tmp_path, vocab_file, qa_set):
    result = _run_cli(*_tiny_args(vocab_file, tmp_path / "out", "--do_predict"))
    assert result.returncode == 1 and "--do_predict needs --predict_file" in result.stderr
    result = _run_cli(*_tiny_args(vocab_file, tmp_path / "out", "--do_predict", "--predict_file", str(qa_set[1]),
                                  "--fp16", "--no_cuda"))
    assert result.returncode == 1 and "--fp16 needs a CUDA GPU" in result.stderr and "Traceback" not in result.stderr


# -- benchmark scripts -----------------------------------------------------------------------------
SCRIPTS = ["scripts/run_squad.sh", "scripts/tempo/tempo_run_squad.sh", "scripts/tempo/squad_benchmark_common.sh",
           *[f"scripts/tempo/tempo_benchmarking_squad_{gpu}.sh" for gpu in ("2080ti", "v100", "a100", "h100")]]


@pytest.mark.parametrize("script", SCRIPTS)
def test_scripts_parse(script):
    assert subprocess.run(["bash", "-n", str(REPO / script)]).returncode == 0
    assert os.access(REPO / script, os.X_OK)


def test_benchmark_summary_table(tmp_path):
    from tempo.bench.squad_benchmark import summarize

    fake = [("original", "tf32", 24, 100.0), ("tempo", "tf32", 36, 110.0),
            ("original", "bf16", 48, 300.0), ("tempo", "bf16", 72, None)]
    for mode, precision, batch, speed in fake:
        (tmp_path / f"result_{mode}_{precision}.json").write_text(json.dumps(
            {"mode": mode, "precision": precision, "max_batch": batch, "sequences_per_second": speed,
             "error": None if speed else "throughput run exited 1"}))
    table = summarize(tmp_path, "a100")
    assert (tmp_path / "summary.md").read_text() == table
    assert "| Original | tf32 | 24 | 100.0 | - | - |" in table
    assert "| Tempo | tf32 | 36 | 110.0 | +50.0% | +10.0% |" in table
    assert "| Tempo | bf16 | 72 | n/a | +50.0% | n/a |" in table
    assert "tempo bf16: throughput run exited 1" in table


# -- quality: the real MiniLM on the generated held-out set ----------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("tempo_flag", ["--tempo"])  # --no-tempo vs --tempo: the parity test below
def test_minilm_reaches_em_80_on_held_out_entities(tmp_path, tempo_flag):
    from tempo.bert.hf_interop import minilm_dir

    # Paragraphs of ~60 WordPiece tokens fit 80-token sequences; batch 16 gives 128 updates in
    # ~2 epochs. The held-out EM jumps (type-only guessing -> reading the right fact) after about
    # 1,000 sequences at a high learning rate, so the schedule must not decay before that: 80
    # steps gave EM 52 (no Tempo) / 77.5 (Tempo); 128 steps: see the commit message.
    # CPU cost: ~3 min per run on 1 thread, less on 2.
    train_file, dev_file = write_qa_set(tmp_path / "qa", num_train=1000, num_dev=200, seed=1)
    out = tmp_path / "out"
    assert main(["--init_checkpoint", str(minilm_dir()), "--do_train", "--train_file", str(train_file),
                 "--do_predict", "--predict_file", str(dev_file), "--max_seq_length", "80", "--doc_stride", "40",
                 "--max_query_length", "24", "--train_batch_size", "16", "--learning_rate", "3e-4",
                 "--max_steps", "128", "--warmup_proportion", "0.1", "--predict_batch_size", "64",
                 "--output_dir", str(out), "--skip_checkpoint", "--skip_cache", "--disable-progress-bar",
                 "--num_workers", "0", tempo_flag]) == 0
    metrics = json.loads((out / "eval_results.json").read_text())
    assert metrics["exact_match"] >= 80.0, metrics


@pytest.mark.slow
def test_squad_parity_minilm_with_and_without_tempo(tmp_path):
    """Issue 17's parity check: MiniLM fine-tuned on 160 generated questions (s = 128, batch 16,
    10 epochs at lr 3e-4: at 2 epochs and lr 1e-4 neither variant gets past EM 12 on this
    generator) reaches EM >= 90 on them with and without Tempo, within 5 EM of each other. The
    clamped LayerNorm recovery this guards against trained MiniLM with 30%-wrong gradients.
    Measured: --no-tempo EM 100, --tempo EM 98.75 (about 2 minutes each on 2 CPU cores)."""
    from tempo.bert.hf_interop import minilm_dir

    train_file, _ = write_qa_set(tmp_path / "qa", num_train=160, num_dev=10, seed=1)
    em = {}
    for flag in ("--no-tempo", "--tempo"):
        out = tmp_path / flag.strip("-")
        assert main(["--init_checkpoint", str(minilm_dir()), "--do_train", "--train_file", str(train_file),
                     "--do_predict", "--predict_file", str(train_file), "--max_seq_length", "128",
                     "--doc_stride", "64", "--train_batch_size", "16", "--learning_rate", "3e-4",
                     "--num_train_epochs", "10", "--predict_batch_size", "64", "--output_dir", str(out),
                     "--skip_checkpoint", "--skip_cache", "--disable-progress-bar", "--num_workers", "0", flag]) == 0
        em[flag] = json.loads((out / "eval_results.json").read_text())["exact_match"]
    assert min(em.values()) >= 90.0 and abs(em["--tempo"] - em["--no-tempo"]) <= 5.0, em
