"""tempo.bench train: the result record, the memory anatomy sums, MFU arithmetic, HF provider."""

import argparse
import json

import pytest
import torch

from tempo.utils import parse_bytes

from tempo.bench import anatomy as anat
from tempo.bench.__main__ import main as bench_main
from tempo.bench.flops import bert_pretraining_flops
from tempo.bench.train_bench import (
    BenchError,
    SimulatedOOM,
    TrainBenchConfig,
    add_train_args,
    config_from_args,
    config_to_argv,
    run_train_bench,
)

TINY = dict(model="bert_tiny", seq_len=32, batch_size=2, steps=3, warmup=1, device="cpu")


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def fp32_result():
    threads = torch.get_num_threads()  # restored: later test files must not run on one thread
    torch.set_num_threads(1)
    try:
        return run_train_bench(TrainBenchConfig(**TINY, precision="fp32", optimizer="adamw", peak_tflops=2.0))
    finally:
        torch.set_num_threads(threads)


def test_record_keys_and_timing_fields(fp32_result):
    r = fp32_result
    for key in ("config", "env", "samples_per_s", "tokens_per_s", "step_time_ms", "step_times_s", "flops",
                "model_tflops", "mfu", "peak_tflops", "memory", "anatomy", "final_loss"):
        assert key in r
    assert len(r["step_times_s"]) == TINY["warmup"] + TINY["steps"]
    assert set(r["step_time_ms"]) == {"p20", "p50", "p80"}
    assert r["env"]["torch"] == torch.__version__ and "git_commit" in r["env"]
    assert r["final_loss"] == r["final_loss"]  # not NaN


def test_flops_and_mfu_arithmetic(fp32_result):
    r = fp32_result
    from tempo.bench.common import resolve_our_config

    expected = bert_pretraining_flops(resolve_our_config("bert_tiny"), 32, r["max_predictions"])["total"]
    assert r["flops"]["per_sequence"] == expected
    assert r["model_tflops"] == pytest.approx(expected * r["samples_per_s"] / 1e12)
    assert r["mfu"] == pytest.approx(r["model_tflops_per_device"] / 2.0)
    # samples/s counts the timed steps only
    timed = r["step_times_s"][TINY["warmup"]:]
    assert r["samples_per_s"] == pytest.approx(len(timed) * TINY["batch_size"] / sum(timed))


def test_anatomy_sums(fp32_result):
    a = fp32_result["anatomy"]
    from tempo.bert.model import BertForPreTraining
    from tempo.bench.common import resolve_our_config

    model = BertForPreTraining(resolve_our_config("bert_tiny"))
    params = {id(p): p for p in model.parameters()}.values()  # the tied decoder once
    param_bytes = sum(p.numel() * p.element_size() for p in params)
    buffer_bytes = sum(b.numel() * b.element_size() for b in model.buffers())
    assert a["weights"] == param_bytes + buffer_bytes
    assert a["gradients"] == param_bytes  # fp32 grads of every parameter
    # AdamW: exp_avg and exp_avg_sq per parameter (+ a scalar step each)
    assert 2 * param_bytes <= a["optimizer_states"] <= 2 * param_bytes + 8 * len(list(params))
    assert a["activations"] > 0
    assert a["total_accounted"] == a["weights"] + a["gradients"] + a["optimizer_states"] + a["activations"]
    assert a["temporaries"] is None and a["peak_allocated"] is None  # CPU: no allocator peak
    # fp32: no autocast weight copies, so the fixed part is small next to the per-sample part
    assert a["activations_per_sample"] > 0


def test_anatomy_helpers():
    t = torch.zeros(10)
    assert anat.unique_tensor_bytes([t, t[2:], t.view(2, 5)]) == 40
    assert parse_bytes("2GiB") == 2 << 30 and parse_bytes("1.5kb") == 1500 and parse_bytes("77") == 77
    m = anat.MemoryAnatomy(weights=1, gradients=2, optimizer_states=3, activations=4, peak_allocated=15)
    assert m.total_accounted == 10 and m.temporaries == 5 and m.fits(10) and not m.fits(9)


def test_budget_exceeded_is_a_simulated_oom_and_exit_3(tmp_path, capsys):
    with pytest.raises(SimulatedOOM, match="out of memory"):
        run_train_bench(TrainBenchConfig(**TINY, precision="fp32", memory_budget=1000))
    status = bench_main(["train", "--model", "bert_tiny", "--seq-len", "32", "--batch-size", "2", "--steps", "1",
                         "--warmup", "0", "--device", "cpu", "--precision", "fp32", "--memory-budget", "1KiB"])
    assert status == 3
    assert "out of memory" in capsys.readouterr().err


def test_cli_writes_json_bf16_tempo_layers_and_grad_accum(tmp_path):
    out = tmp_path / "train.json"
    status = bench_main(["train", "--model", "bert_tiny", "--seq-len", "32", "--batch-size", "2", "--steps", "1",
                         "--warmup", "0", "--device", "cpu", "--precision", "bf16", "--tempo-layers", "layernorm",
                         "--attention", "sdpa", "--grad-accum", "2", "--grad-ckpt", "--optimizer", "lamb",
                         "--out", str(out), "--quiet"])
    assert status == 0
    r = json.loads(out.read_text())
    assert r["tempo_layers"] == ["layernorm"] and r["attention"] == "sdpa"
    assert r["config"]["grad_accum"] == 2 and r["mfu"] is None  # no peak on the CPU
    assert r["flops"]["gemm_breakdown"]["recompute"] > 0


def test_bad_configuration_is_a_one_line_error(capsys):
    assert bench_main(["train", "--model", "no_such_config", "--device", "cpu"]) == 1
    assert "no such config" in capsys.readouterr().err
    with pytest.raises(BenchError):
        TrainBenchConfig(model="bert_tiny", tempo_layers="softmax").validate()
    if not hasattr(torch.optim, "Adafactor"):
        pytest.skip("no torch.optim.Adafactor in this torch")
    r = run_train_bench(TrainBenchConfig(**dict(TINY, steps=1, warmup=0), precision="fp32", optimizer="adafactor"))
    assert r["anatomy"]["optimizer_states"] > 0


def test_config_round_trips_through_argv():
    cfg = TrainBenchConfig(model="bert_tiny", seq_len=64, batch_size=3, precision="fp32", grad_ckpt=True,
                           tempo_layers="layernorm,attention", attention="sdpa", memory_budget=12345, compile=True)
    parser = argparse.ArgumentParser()
    add_train_args(parser)
    assert config_from_args(parser.parse_args(config_to_argv(cfg))) == cfg


def test_hf_provider_trains_and_counts_all_positions():
    pytest.importorskip("transformers")
    r = run_train_bench(TrainBenchConfig(model="hf:bert-tiny", seq_len=32, batch_size=2, steps=1, warmup=0,
                                         device="cpu", precision="fp32", attention="sdpa"))
    assert r["provider"] == "hf"
    from tempo.bench.common import resolve_our_config

    # HF runs the MLM decoder on every position
    assert r["flops"]["per_sequence"] == bert_pretraining_flops(resolve_our_config("bert_tiny"), 32, 32)["total"]
    assert r["anatomy"]["activations"] > 0
    with pytest.raises(BenchError, match="Tempo layers apply to our model only"):
        run_train_bench(TrainBenchConfig(model="hf:bert-tiny", tempo_layers="layernorm", device="cpu"))


def test_padded_synthetic_batches_and_unpadded_runs():
    """--padding draws right-padded batches with about that share of padding; --unpad runs our
    BERT on their real tokens, reports real tokens/s and keeps fewer activation bytes."""
    cfg = dict(TINY, steps=1, warmup=0, seq_len=64, batch_size=8)
    runs = {unpad: run_train_bench(TrainBenchConfig(**cfg, precision="fp32", padding=0.5, unpad=unpad))
            for unpad in (False, True)}
    for r in runs.values():
        assert 0.4 < r["padding_share"] < 0.6
        assert 0 < r["real_tokens_per_s"] < r["tokens_per_s"]
    assert runs[True]["unpad"] and not runs[False]["unpad"]
    # Less, not half: bert_tiny's MLM logits [B, predictions, 30522] dominate and do not shrink.
    assert runs[True]["anatomy"]["activations"] < 0.95 * runs[False]["anatomy"]["activations"]
    with pytest.raises(BenchError, match="--padding"):
        TrainBenchConfig(model="bert_tiny", padding=0.7).validate()
