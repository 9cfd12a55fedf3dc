"""Training on a shared CPU: torch's intra-op threads follow the cores other work leaves free
(tempo.train.runtime.CpuThreads), chosen at the start and looked at again during the run."""

from __future__ import annotations

import pytest
import torch

from tempo.train import runtime
from tempo.train.runtime import CpuThreads, CpuWatch, _CpuSample, cpu_threads_for_training


@pytest.fixture
def four_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(4)
    yield
    torch.set_num_threads(before)


class FakeWatch:
    """A CpuWatch whose other work is a script: each look reports the next number of busy cores."""

    usable = 4.0

    def __init__(self, others: list[float]):
        self.script = list(others)

    def sample(self) -> _CpuSample:
        return _CpuSample({}, 0.0, -1e9)  # long ago: every follow() looks again

    def others(self, before: _CpuSample, now: _CpuSample) -> float:
        return self.script.pop(0)


def test_threads_drop_at_once_and_rise_after_two_looks(four_threads, monkeypatch):
    monkeypatch.setattr(runtime.time, "sleep", lambda s: None)
    lines = []
    governor = CpuThreads(FakeWatch([0.0, 1.5, 0.0, 0.0, 0.0, 3.95, 0.05, 0.05]), log=lines.append)
    assert governor.threads == 4 and torch.get_num_threads() == 4
    assert governor.line.startswith("CPU threads: 4 of 4 (other work kept 0.0 of 4 cores busy;")
    governor.follow()  # other work takes 1.5 cores: 2.5 free -> 2 threads, at once
    assert torch.get_num_threads() == 2 and lines == ["CPU threads: 4 -> 2 (other work kept 1.5 of 4 cores busy)"]
    governor.follow()  # free again: one look is not enough
    assert torch.get_num_threads() == 2
    governor.follow()  # two looks in a row: back to 4
    assert torch.get_num_threads() == 4 and lines[-1] == "CPU threads: 2 -> 4 (other work kept 0.0 of 4 cores busy)"
    governor.follow()
    governor.follow()  # every core busy: never fewer than 1
    assert torch.get_num_threads() == 1
    governor.follow()
    governor.follow()  # 0.05 of a core is noise (BUSY_SLACK): all 4
    assert torch.get_num_threads() == 4 and len(lines) == 4
    torch.set_num_threads(3)
    governor.restore()
    assert torch.get_num_threads() == 4  # what the process had before the governor


def test_ranks_of_one_run_share_the_free_cores(four_threads, monkeypatch):
    monkeypatch.setattr(runtime.time, "sleep", lambda s: None)
    assert CpuThreads(FakeWatch([0.0]), local_ranks=2).threads == 2
    assert CpuThreads(FakeWatch([3.0]), local_ranks=2).threads == 1


def test_omp_num_threads_fixes_the_threads(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    governor, line = cpu_threads_for_training()
    assert governor is None and line == f"CPU threads: {torch.get_num_threads()} (OMP_NUM_THREADS=3)"


def test_without_proc_stat_torch_keeps_its_threads_and_says_why(monkeypatch, tmp_path):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(runtime, "PROC_STAT", str(tmp_path / "missing"))
    governor, line = cpu_threads_for_training()
    assert governor is None and "cannot see other work without /proc/stat" in line


def test_proc_stat_is_read_per_cpu_of_the_cpu_set(monkeypatch, tmp_path):
    stat = tmp_path / "stat"
    # user nice system idle iowait irq softirq steal: busy = all but idle and iowait
    stat.write_text("cpu  10 0 10 100 5 0 0 0 0 0\ncpu0 3 1 2 50 4 1 1 2 0 0\ncpu1 7 0 8 50 1 0 0 0 0 0\nintr 1\n")
    monkeypatch.setattr(runtime, "PROC_STAT", str(stat))
    assert runtime._cpu_jiffies([0, 1]) == {0: (10, 64), 1: (15, 66)}
    assert runtime._cpu_jiffies([1, 2]) is None  # a CPU of the set without its line: cannot watch


def test_others_is_busy_time_less_this_process_own(monkeypatch):
    watch = CpuWatch([0, 1])
    before = _CpuSample({0: (0, 0), 1: (0, 0)}, own=10.0, at=100.0)
    now = _CpuSample({0: (100, 100), 1: (50, 100)}, own=11.0, at=102.0)  # 1.5 cores busy; 0.5 of them ours
    assert watch.others(before, now) == pytest.approx(1.0)


@pytest.mark.parametrize("files, cores", [
    ({"cpu.max": "150000 100000\n"}, 1.5), ({"cpu.max": "max 100000\n"}, None),
    ({"cpu.cfs_quota_us": "200000\n", "cpu.cfs_period_us": "100000\n"}, 2.0),
    ({"cpu.cfs_quota_us": "-1\n", "cpu.cfs_period_us": "100000\n"}, None), ({}, None)])
def test_a_cgroup_quota_caps_the_usable_cores(monkeypatch, tmp_path, files, cores):
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    monkeypatch.setattr(runtime, "CGROUP_QUOTA_FILES", (str(tmp_path / "cpu.max"), str(tmp_path / "cpu.cfs_quota_us")))
    assert runtime._cgroup_cores() == cores


def test_setup_runtime_on_the_cpu_says_its_threads_and_teardown_gives_them_back(monkeypatch, capsys):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    before = torch.get_num_threads()
    rt = runtime.setup_runtime(force_cpu=True)
    try:
        assert rt.cpu_threads is not None  # Linux: /proc/stat is there
        assert capsys.readouterr().out.startswith(f"CPU threads: {torch.get_num_threads()} of {before} (")
        rt.follow_load()
    finally:
        runtime.teardown_runtime(rt)
    assert torch.get_num_threads() == before and rt.cpu_threads is None
