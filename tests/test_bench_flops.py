"""FLOP count, peaks, MFU and timing helpers of tempo.bench: arithmetic only, no timings."""

import pytest

from tempo.bench.flops import (
    bert_pretraining_flops,
    coarse_flops,
    flops_per_sequence,
    mfu,
)
from tempo.bench.hardware import device_label, known_gpu, peak_tflops
from tempo.bench.timing import percentile, spread
from tempo.bert.config import BertConfig
from tempo.bench.common import resolve_our_config
from tempo.presets import default_max_predictions


def test_tiny_config_matches_a_hand_count():
    # h=4, i=8, 1 layer, vocab 10, s=3, 2 predicted positions, every GEMM written out.
    cfg = BertConfig.from_dict(dict(hidden_size=4, intermediate_size=8, num_hidden_layers=1,
                                    num_attention_heads=2, vocab_size=10))
    s, h, i, v, p = 3, 4, 8, 10, 2
    qkv = 3 * (2 * s * h * h)           # three [s,h]x[h,h]
    scores = 2 * (2 * s * s * (h // 2))  # per head [s,d]x[d,s], two heads
    context = 2 * (2 * s * s * (h // 2))  # per head [s,s]x[s,d]
    out_proj = 2 * s * h * h
    ffn = 2 * s * h * i + 2 * s * i * h
    mlm = 2 * p * h * h + 2 * p * h * v
    nsp = 2 * h * h + 2 * h * 2
    forward = qkv + scores + context + out_proj + ffn + mlm + nsp
    got = bert_pretraining_flops(cfg, s, p)
    assert got["forward"] == forward
    assert got["total"] == 3 * forward
    ckpt = bert_pretraining_flops(cfg, s, p, grad_ckpt=True)
    assert ckpt["total"] == 3 * forward + (qkv + scores + context + out_proj + ffn)
    assert bert_pretraining_flops(cfg, s, p, nsp=False)["total"] == 3 * (forward - nsp)


@pytest.mark.parametrize("seq_len, predictions, anchor_gflop", [(128, 20, 240.0), (512, 80, 1020.0)])
def test_bert_large_anchors(seq_len, predictions, anchor_gflop):
    large = resolve_our_config("bert_large")
    total = bert_pretraining_flops(large, seq_len, predictions)["total"] / 1e9
    assert total == pytest.approx(anchor_gflop, rel=0.02)


def test_coarse_formula_and_dispatch():
    large = resolve_our_config("bert_large")
    assert coarse_flops(1000, 128) == 6 * 1000 * 128
    assert flops_per_sequence("coarse", large, 128, 20, num_parameters=1000) == 6 * 1000 * 128
    assert flops_per_sequence("gemm", large, 128, 20) == bert_pretraining_flops(large, 128, 20)["total"]
    with pytest.raises(ValueError):
        flops_per_sequence("coarse", large, 128, 20)


def test_mfu_and_predictions_default():
    assert mfu(494.5, 989.0) == pytest.approx(0.5)
    assert mfu(10.0, None) is None
    assert default_max_predictions(128) == 20 and default_max_predictions(512) == 80


def test_peak_table():
    assert peak_tflops("NVIDIA H100 80GB HBM3", "bf16") == 989.0
    assert peak_tflops("NVIDIA H100 PCIe", "bf16") == 756.0
    assert peak_tflops("NVIDIA H200", "tf32") == pytest.approx(494.7)
    assert peak_tflops("NVIDIA A100-SXM4-80GB", "fp32") == 19.5
    assert peak_tflops("Tesla V100-SXM2-16GB", "fp16") == 125.0
    assert peak_tflops("Tesla V100-SXM2-16GB", "bf16") is None  # no bf16 on Volta
    assert peak_tflops("Some Future GPU", "bf16") is None
    assert known_gpu("NVIDIA GeForce RTX 2080 Ti") == "RTX 2080 Ti"
    assert device_label("cpu") == "cpu"
    with pytest.raises(ValueError):
        peak_tflops("NVIDIA H100", "int8")


def test_percentiles():
    values = [5.0, 1.0, 3.0, 2.0, 4.0]
    assert percentile(values, 50) == 3.0
    assert percentile(values, 20) == pytest.approx(1.8)
    assert spread(values) == {"p20": pytest.approx(1.8), "p50": 3.0, "p80": pytest.approx(4.2)}
