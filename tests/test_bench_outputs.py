"""sweep, report, layer, ops and profile on the CPU at tiny sizes: the files they write."""

import csv
import json

import pytest
import torch

from tempo.bench.__main__ import main as bench_main
from tempo.bench.profile import classify, summarize_events
from tempo.bench.sweep import doubling

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
TINY_TRAIN = ["--model", "bert_tiny", "--seq-len", "32", "--batch-size", "2", "--steps", "2", "--warmup", "1",
              "--device", "cpu"]


@pytest.fixture(autouse=True)
def _one_thread(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def results_dir(tmp_path_factory):
    """One directory with a sweep, a layer and an ops record, as a user's run would leave."""
    threads = torch.get_num_threads()  # restored: later test files must not run on one thread
    torch.set_num_threads(1)
    try:
        root = tmp_path_factory.mktemp("results")
        assert bench_main(["sweep", *TINY_TRAIN, "--precision", "fp32", "--batch-sizes", "1", "2",
                           "--techniques", "fp32,tempo-sdpa", "--no-isolate", "--out-dir", str(root)]) == 0
        assert bench_main(["layer", "--shapes", "tiny", "--variants", "original,sdpa,hf-eager", "--warmup", "1",
                           "--repeats", "2", "--out", str(root / "layer.json")]) == 0
        assert bench_main(["ops", "--shapes", "tiny", "--no-compile", "--warmup", "1", "--repeats", "2",
                           "--device", "cpu", "--out", str(root / "ops.json")]) == 0
    finally:
        torch.set_num_threads(threads)
    return root


def test_sweep_json_and_csv(results_dir):
    record = json.loads((results_dir / "sweep.json").read_text())
    assert record["kind"] == "sweep"
    for key in ("device_name", "driver", "torch", "triton", "git_commit"):
        assert key in record["env"]
    rows = record["rows"]
    assert [(r["group"], r["name"]) for r in rows] == [("batch", "batch 1"), ("batch", "batch 2"),
                                                       ("technique", "fp32"), ("technique", "tempo-sdpa")]
    assert all(r["status"] == "ok" for r in rows)
    assert [r["config"]["batch_size"] for r in rows[:2]] == [1, 2]
    assert rows[3]["attention"] == "sdpa" and rows[3]["config"]["optimizer"] == "adamw_fused"
    assert len(rows[0]["step_times_s"]) == 3  # raw per-step times, warm-up included
    with open(results_dir / "sweep.csv", newline="") as fh:
        table = list(csv.DictReader(fh))
    assert len(table) == 4
    for column in ("group", "name", "status", "config.batch_size", "samples_per_s", "step_time_ms.p50", "mfu",
                   "anatomy.weights", "anatomy.activations", "anatomy.optimizer_states", "step_times_s"):
        assert column in table[0]
    assert float(table[1]["anatomy.activations"]) > float(table[0]["anatomy.activations"])


def test_layer_and_ops_records(results_dir):
    layer = json.loads((results_dir / "layer.json").read_text())
    by_variant = {r["variant"]: r for r in layer["rows"]}
    assert by_variant["original"]["status"] == "ok"
    assert set(by_variant["original"]["fwd+bwd"]["ms"]) == {"p20", "p50", "p80"}
    assert by_variant["original"]["ledger_bytes"] > 0
    if by_variant["hf-eager"]["status"] == "ok":
        assert by_variant["hf-eager"]["ledger_bytes"] > 0
    ops = json.loads((results_dir / "ops.json").read_text())
    assert ops["copy_bandwidth_gb_per_s"] > 0
    rows = {(r["op"], r["impl"]): r for r in ops["rows"]}
    ln = rows[("layernorm", "tempo")]
    assert ln["status"] == "ok" and ln["both"]["bytes"] == ln["fwd"]["bytes"] + ln["bwd"]["bytes"]
    assert ln["fwd"]["bytes"] == 2 * 64 * 64 * 2  # [B*L=64, 64] bf16, read + write
    assert rows[("combined", "eager")]["status"] == "ok"


def test_report_writes_pngs_and_markdown(results_dir, tmp_path):
    assert bench_main(["report", str(results_dir), "--out-dir", str(tmp_path)]) == 0
    for name in ("throughput_vs_batch.png", "techniques.png", "layer.png", "ops.png"):
        assert (tmp_path / name).read_bytes()[:8] == PNG_MAGIC, name
    text = (tmp_path / "report.md").read_text()
    assert "## Sweep" in text and "| group | row |" in text and "## Encoder layer" in text and "## Tempo ops" in text


def test_profile_writes_trace_and_shares(tmp_path):
    out = tmp_path / "prof"
    assert bench_main(["profile", *TINY_TRAIN, "--precision", "fp32", "--out-dir", str(out)]) == 0
    record = json.loads((out / "profile.json").read_text())
    assert sum(record["class_share"].values()) == pytest.approx(1.0)
    assert record["class_share"]["gemm"] > 0 and record["top"]
    assert json.loads((out / "trace.json").read_text())  # a valid Chrome trace
    assert (out / "top_kernels.csv").read_text().startswith("name,class,calls")


def test_kernel_classes():
    assert classify("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64") == "gemm"
    assert classify("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_TNT") == "gemm"
    assert classify("aten::addmm") == "gemm"
    assert classify("pytorch_flash::flash_fwd_kernel<...>") == "attention"
    assert classify("ncclDevKernel_AllReduce_Sum_f32_RING_LL") == "communication"
    assert classify("_softmax_dropout_fwd_kernel") == "memory-bound"
    assert classify("void at::native::vectorized_elementwise_kernel<4, GeluCUDAKernelImpl>") == "memory-bound"
    s = summarize_events([("aten::mm", 2, 30.0), ("aten::add", 5, 10.0)])
    assert s["class_share"]["gemm"] == pytest.approx(0.75) and s["top"][0]["name"] == "aten::mm"


def test_doubling_range():
    assert doubling(8, 100) == [8, 16, 32, 64]


@pytest.mark.parametrize("name,label", [
    ("NVIDIA L40S", "L40S"), ("NVIDIA L4", "L4"), ("NVIDIA L40", "L40"), ("NVIDIA A10", "A10"),
    ("NVIDIA A100-SXM4-80GB", "A100"), ("NVIDIA H100 80GB HBM3", "H100 SXM"), ("NVIDIA H100 PCIe", "H100 PCIe"),
    ("NVIDIA H100 NVL", "H100 NVL"), ("NVIDIA H200", "H200"), ("Tesla V100-PCIE-32GB", "V100 PCIe"),
    ("NVIDIA GeForce RTX 2080 Ti", "RTX 2080 Ti"), ("NVIDIA A10G", None), ("NVIDIA GH200 480GB", None)])
def test_gpu_names_match_whole_tokens(name, label):
    """"l4" once matched "L40S" and "a10" "A100" (substrings); names now match by whole tokens."""
    from tempo.bench.hardware import known_gpu, peak_tflops

    assert known_gpu(name) == label
    if label == "L40S":
        assert peak_tflops(name, "bf16") == 362.05 and peak_tflops("NVIDIA L4", "bf16") == 121.0


def test_ops_inputs_are_scaled_out_of_cache_and_record_their_bytes(tmp_path):
    from tempo.bench.ops_bench import SHAPES, input_bytes, scaled_shape

    tiny = SHAPES["tiny"]
    assert scaled_shape("layernorm", tiny, torch.bfloat16, 0) == tiny
    big = scaled_shape("layernorm", tiny, torch.bfloat16, 100_000)  # 8 KiB at batch 2 -> 13x
    assert big["batch"] == 26 and input_bytes("layernorm", big, torch.bfloat16) >= 100_000
    # bert-large on an H100 (50 MiB L2): every input gets past 2x L2
    l2 = 50 * 2**20
    for op in ("gelu", "layernorm", "combined"):
        shape = scaled_shape(op, SHAPES["bert-large"], torch.bfloat16, 2 * l2)
        assert input_bytes(op, shape, torch.bfloat16) >= 2 * l2 and shape["batch"] % 8 == 0
    out = tmp_path / "ops.json"
    assert bench_main(["ops", "--shapes", "tiny", "--no-compile", "--ops", "layernorm", "--modes", "fwd",
                       "--warmup", "0", "--repeats", "1", "--device", "cpu", "--min-input-bytes", "64KiB",
                       "--out", str(out)]) == 0
    record = json.loads(out.read_text())
    assert record["min_input_bytes"] == 65536 and record["min_input_rule"] == "--min-input-bytes"
    for row in record["rows"]:
        assert row["input_bytes"] >= 65536 and row["batch"] == 2 * 8 and row["copy_gb_per_s"] > 0
        assert row["fwd"]["bytes"] == 2 * row["input_bytes"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU error")
@pytest.mark.parametrize("command", ["ops", "layer"])
def test_cuda_device_with_an_index_is_a_cuda_device(command, capsys):
    """"cuda:0" is recognised as CUDA (string comparisons took it for the CPU)."""
    args = ["--shapes", "tiny", "--device", "cuda:0"] + (["--no-compile"] if command == "ops" else [])
    assert bench_main([command, *args]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--device cuda:0: no CUDA GPU visible" in err[0]


def test_layer_bench_masks_like_the_model(monkeypatch):
    """Eager/Tempo attention get an additive mask in the compute dtype (no fp32 promotion of bf16
    scores); sdpa gets none without padding, so its flash kernel may run."""
    from tempo.bench import layer_bench
    from tempo.bench.common import resolve_our_config
    from tempo.bert import model as bert_model

    seen = {}
    original_forward = bert_model.BertLayer.forward

    def spy(self, hidden, mask):
        # the first call is bench_variant's own (the ledger table's layer forwards come later)
        seen.setdefault(self.attention.self.attention_impl, None if mask is None else mask.dtype)
        return original_forward(self, hidden, mask)

    monkeypatch.setattr(bert_model.BertLayer, "forward", spy)
    config = resolve_our_config("bert_tiny")
    for variant in ("original", "sdpa", "tempo-floor"):
        layer_bench.bench_variant(variant, config, 2, 16, "cpu", torch.bfloat16, ("fwd",), 0, 1, "bert_tiny.json")
    assert seen == {"eager": torch.bfloat16, "sdpa": None, "efficient": None}
