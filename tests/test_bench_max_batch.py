"""max-batch: the pure search with a fake probe, and both subprocess modes end to end."""

import json
import subprocess
import sys
import textwrap

import pytest
import torch

from tempo.bench.max_batch import ProbeError, SearchError, is_oom_output, search_max_batch


@pytest.fixture(autouse=True)
def _one_thread(monkeypatch):
    # 2 shared cores: OpenMP threads fighting each other make tiny models 30x slower.
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def fake_probe(limit):
    return lambda b: b <= limit


@pytest.mark.parametrize("limit", [1, 2, 3, 37, 64, 100])
def test_search_finds_the_limit(limit):
    answer, probes = search_max_batch(fake_probe(limit), start=1)
    assert answer == limit
    batches = [p.batch for p in probes]
    assert len(batches) == len(set(batches))  # never probes the same batch twice
    assert all(p.fits == (p.batch <= limit) for p in probes)


def test_search_starts_high_and_goes_down():
    answer, probes = search_max_batch(fake_probe(5), start=16)
    assert answer == 5
    assert probes[0].batch == 16 and not probes[0].fits


def test_nothing_fits_and_cap():
    assert search_max_batch(fake_probe(0), start=4)[0] == 0
    answer, probes = search_max_batch(fake_probe(1000), start=3, max_batch=20)
    assert answer == 20 and max(p.batch for p in probes) == 20


def test_probe_error_stops_the_search_with_the_probes_so_far():
    def probe(b):
        if b == 4:
            raise ProbeError(b, "segfault")
        return True

    with pytest.raises(SearchError) as info:
        search_max_batch(probe, start=1)
    assert [p.batch for p in info.value.probes] == [1, 2]


def test_oom_markers():
    assert is_oom_output("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate")
    assert is_oom_output("RuntimeError: CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling cublasCreate")
    assert not is_oom_output("ValueError: bad shape")


FAKE_SCRIPT = textwrap.dedent("""
    import sys
    batch = int(sys.argv[1])
    if batch == int(sys.argv[3]):
        print("Segmentation fault (not memory)", file=sys.stderr)
        sys.exit(139)
    if batch > int(sys.argv[2]):
        print("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB", file=sys.stderr)
        sys.exit(1)
""")


def run_bench(*argv):
    return subprocess.run([sys.executable, "-m", "tempo.bench", *argv], capture_output=True, text=True, timeout=300)


def test_generic_command_mode(tmp_path):
    script = tmp_path / "fake_train.py"
    script.write_text(FAKE_SCRIPT)
    out = tmp_path / "mb.json"
    cmd = f"{sys.executable} {script} {{batch}} 13 -1"
    proc = run_bench("max-batch", "--command", cmd, "--start", "2", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    assert "13" in proc.stdout
    record = json.loads(out.read_text())
    assert record["max_batch"] == 13
    assert set(record["probes"][0]) == {"batch", "fits", "seconds"}
    assert [p["batch"] for p in record["probes"]][:4] == [2, 4, 8, 16]

    # A failure that is not an OOM stops the search: exit status 2, reported in the JSON.
    proc = run_bench("max-batch", "--command", f"{sys.executable} {script} {{batch}} 13 8", "--out", str(out))
    assert proc.returncode == 2
    record = json.loads(out.read_text())
    assert record["max_batch"] is None and "exit status 139" in record["error"]
    assert [p["batch"] for p in record["probes"]] == [1, 2, 4]


def test_budget_mode_end_to_end(tmp_path):
    # The budget that admits batch 2 but not 3, from the same anatomy the probes compute.
    from tempo.bench.train_bench import TrainBenchConfig, run_train_bench

    def accounted(batch):
        cfg = TrainBenchConfig(model="bert_tiny", seq_len=32, batch_size=batch, precision="fp32", steps=1, warmup=0,
                               device="cpu")
        return run_train_bench(cfg)["anatomy"]["total_accounted"]

    two, three = accounted(2), accounted(3)
    assert three > two
    budget = (two + three) // 2
    out = tmp_path / "mb.json"
    proc = run_bench("max-batch", "--model", "bert_tiny", "--seq-len", "32", "--precision", "fp32",
                     "--device", "cpu", "--memory-budget", str(budget), "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    record = json.loads(out.read_text())
    assert record["max_batch"] == 2
    assert [(p["batch"], p["fits"]) for p in record["probes"]] == [(1, True), (2, True), (4, False), (3, False)]
