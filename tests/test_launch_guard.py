"""Launches and timings on the tensors' device (issue 18.2).

Triton launches a kernel on ``torch.cuda.current_device()`` and that device's current stream, not
on the device of the tensors it is handed. Every launcher in tempo.ops therefore launches inside
``tempo.ops._backend.launch_on(tensor)``. The test here wraps the entry point ``kernel[grid](...)``
calls (the interpreter's ``InterpretedFunction.run`` on the CPU, ``JITFunction.run`` on CUDA), runs
every op's Triton path forward and backward once on tiny shapes, and fails naming each kernel
launched outside the guard, and each kernel of tempo.ops no workload here launched (a new kernel
needs a workload, or the guard on its launcher goes unchecked). With two GPUs it also runs on
cuda:1 and checks that cuda:1 was current at every launch.

The benchmarks' timing (tempo.bench.timing.time_fn) is checked on the CPU against a stand-in
torch.cuda that records which device is current and which stream the events go on.
"""

from __future__ import annotations

import contextlib
import traceback

import pytest
import torch

from conftest import DEVICES, triton_blocker
from tempo.ops._backend import in_launch_guard, triton_interpreting, use_backend

# A second GPU, where there is one: the case where launching on the current device goes wrong.
GUARD_DEVICES = DEVICES + (["cuda:1"] if torch.cuda.is_available() and torch.cuda.device_count() > 1 else [])


@contextlib.contextmanager
def recorded_launches():
    """Yields a list that gets (kernel name, inside launch_on, current CUDA device) per launch."""
    if triton_interpreting():
        from triton.runtime.interpreter import InterpretedFunction as launcher
    else:
        from triton.runtime.jit import JITFunction as launcher
    original = launcher.run
    seen: list[tuple[str, bool, int | None]] = []

    def run(kernel, *args, **kwargs):
        current = torch.cuda.current_device() if torch.cuda.is_available() else None
        seen.append((f"{kernel.fn.__module__}.{kernel.fn.__name__}", in_launch_guard(), current))
        return original(kernel, *args, **kwargs)

    launcher.run = run
    try:
        yield seen
    finally:
        launcher.run = original


def _backward(out, *inputs):
    torch.autograd.grad(out, [t for t in inputs if t is not None], torch.randn_like(out))


def _layernorm(device):
    from tempo.ops.layernorm import inplace_layernorm

    # 32 features (the row in registers), 4100 (wider than BWD_BLOCK_MAX: the chunked backward);
    # an affine LayerNorm whose γ = 0 column is kept by the forward, and one without γ/β.
    for n in (32, 4100):
        x = torch.randn(3, n, device=device, requires_grad=True)
        w = torch.ones(n, device=device)
        w[1] = 0.0
        w.requires_grad_()
        b = torch.full((n,), 0.5, device=device, requires_grad=True)
        _backward(inplace_layernorm(x, n, w, b), x, w, b)
        x = torch.randn(3, n, device=device, requires_grad=True)
        _backward(inplace_layernorm(x, n), x)


def _gelu(device):
    from tempo.ops.gelu import inplace_gelu

    for approximate in ("none", "tanh"):
        x = torch.randn(100, device=device, requires_grad=True)
        _backward(inplace_gelu(x * 1, approximate=approximate), x)


def _combined(device):
    from tempo.ops.combined import SINGLE_PASS_MAX, combined_softmax_dropout_matmul, dropout_keep_mask

    # Rows held in registers, and one row longer than SINGLE_PASS_MAX (the chunked kernels).
    for s in (16, SINGLE_PASS_MAX + 8):
        for p in (0.0, 0.1):
            x = torch.randn(1, 1, 1, s, device=device, requires_grad=True)
            v = torch.randn(1, 1, s, 4, device=device, requires_grad=True)
            _backward(combined_softmax_dropout_matmul(x, v, -1, p, True), x, v)
    dropout_keep_mask(torch.tensor(1, device=device), (2, 16), 0.1, device, "triton")


def _dropout_add_layernorm(device):
    from tempo.ops.dropout_add_layernorm import dropout_add_layernorm, dropout_add_layernorm_keep_mask

    for p in (0.0, 0.1):
        x = torch.randn(3, 32, device=device, requires_grad=True)
        residual = torch.randn(3, 32, device=device, requires_grad=True)
        w = torch.ones(32, device=device, requires_grad=True)
        b = torch.zeros(32, device=device, requires_grad=True)
        _backward(dropout_add_layernorm(x, residual, 32, w, b, 1e-12, p, True), x, residual, w, b)
    dropout_add_layernorm_keep_mask(torch.tensor(1, device=device), (3, 32), 0.1, device, "triton")


def _disentangled_attention(device):
    from tempo.ops.disentangled_attention import (
        disentangled_attention,
        disentangled_attention_keep_mask,
        disentangled_attention_varlen,
    )

    geometry = dict(span=4, position_buckets=4, max_relative_positions=8, scale=0.3)
    kp, qp = (torch.randn(8, 2, 8, device=device, requires_grad=True) for _ in range(2))
    q, k, v = (torch.randn(2, 9, 2, 8, device=device, requires_grad=True) for _ in range(3))
    mask = torch.ones(2, 9, dtype=torch.bool, device=device)
    _backward(disentangled_attention(q, k, v, kp, qp, padding_mask=mask, dropout_p=0.1, **geometry), q, k, v, kp, qp)
    cu = torch.tensor([0, 3, 9], dtype=torch.int32, device=device)
    q, k, v = (torch.randn(9, 2, 8, device=device, requires_grad=True) for _ in range(3))
    _backward(disentangled_attention_varlen(q, k, v, cu, 6, kp, qp, **geometry), q, k, v, kp, qp)
    disentangled_attention_keep_mask(torch.tensor(1, device=device), 1, 1, 8, 0.1, backend="triton")


def _rmsnorm(device):
    from tempo.ops.rmsnorm import inplace_rmsnorm

    # 32 features (the row in registers), 4100 (the chunked backward); a zero weight column kept.
    for n in (32, 4100):
        x = torch.randn(3, n, device=device, requires_grad=True)
        w = torch.ones(n, device=device)
        w[1] = 0.0
        w.requires_grad_()
        _backward(inplace_rmsnorm(x, n, w), x, w)


def _gated_mlp(device):
    from tempo.ops.gated_mlp import gated_linear, gated_linear_fused, gated_mlp_keep_mask

    gate = torch.randn(4, 16, device=device, requires_grad=True)
    up = torch.randn(4, 16, device=device, requires_grad=True)
    weight = torch.randn(8, 16, device=device, requires_grad=True)
    _backward(gated_linear(gate, up, weight, activation="silu", p=0.1), gate, up, weight)
    h = torch.randn(4, 32, device=device, requires_grad=True)
    _backward(gated_linear_fused(h, weight, activation="gelu"), h, weight)
    gated_mlp_keep_mask(torch.tensor(1, device=device), 2, 8, 0.1, device, backend="triton")


def _seeded_dropout(device):
    from tempo.ops.dropout import seeded_dropout, seeded_dropout_keep_mask

    x = torch.randn(4, 16, device=device, requires_grad=True)
    _backward(seeded_dropout(x, 0.1), x)
    seeded_dropout_keep_mask(torch.tensor(1, device=device), (2, 8), 0.1, device, backend="triton")


def _linear_cross_entropy(device):
    from tempo.ops.linear_cross_entropy import linear_cross_entropy

    x = torch.randn(4, 16, device=device, requires_grad=True)
    w = torch.randn(40, 16, device=device, requires_grad=True)
    _backward(linear_cross_entropy(x, w, torch.tensor([0, 5, -100, 39], device=device), label_smoothing=0.1), x, w)


WORKLOADS = {"layernorm": _layernorm, "gelu": _gelu, "combined": _combined,
             "dropout_add_layernorm": _dropout_add_layernorm, "disentangled_attention": _disentangled_attention,
             "rmsnorm": _rmsnorm, "gated_mlp": _gated_mlp, "seeded_dropout": _seeded_dropout,
             "linear_cross_entropy": _linear_cross_entropy}


@pytest.mark.parametrize("device", GUARD_DEVICES)
def test_every_triton_launch_runs_inside_launch_on(device):
    blocked = triton_blocker(device)
    if blocked is not None:
        action, reason = blocked
        (pytest.fail if action == "fail" else pytest.skip)(f"Triton launches on {device}: {reason}")
    from tempo.ops.compile_check import defined_kernels

    unguarded, wrong_device, errors, launched = {}, {}, {}, set()
    want_index = torch.device(device).index
    for op, workload in WORKLOADS.items():
        with recorded_launches() as seen, use_backend("triton"):
            try:
                workload(device)
            except Exception:  # noqa: BLE001 - one broken op must not hide the others' launches
                errors[op] = traceback.format_exc(limit=3).strip().splitlines()[-1]
        launched.update(name for name, _, _ in seen)
        unguarded[op] = sorted({name for name, guarded, _ in seen if not guarded})
        if want_index is not None:
            wrong_device[op] = sorted({f"{name} on cuda:{cur}" for name, _, cur in seen if cur != want_index})
    problems = [f"{op}: launched outside launch_on: {', '.join(names)}" for op, names in unguarded.items() if names]
    problems += [f"{op}: launched with another GPU current: {', '.join(names)}"
                 for op, names in wrong_device.items() if names]
    problems += [f"{op}: workload failed: {message}" for op, message in errors.items()]
    never = [f"{module}.{name}" for module, name in defined_kernels() if f"{module}.{name}" not in launched]
    if never:
        problems.append("kernels no workload here launched (add one to WORKLOADS): " + ", ".join(never))
    assert not problems, "\n".join(problems)


# ------------------------------------------------------------------------------------------------
# Benchmarks time on the device of their tensors
# ------------------------------------------------------------------------------------------------
class _StandInCuda:
    """Just enough of torch.cuda for time_fn: a current device, streams, events, synchronize."""

    def __init__(self, devices: int = 2, current: int = 0):
        self.count, self.current = devices, current
        self.synchronized: list[int] = []
        self.recorded_on: list[int] = []

    def install(self, monkeypatch):
        cuda = self

        class Stream:
            def __init__(self, index):
                self.index = index

        class Event:
            def __init__(self, enable_timing=False):
                self.stream = None

            def record(self, stream=None):
                self.stream = stream if stream is not None else Stream(cuda.current)
                cuda.recorded_on.append(self.stream.index)

            def synchronize(self):
                pass

            def elapsed_time(self, other):
                return 1.0

        @contextlib.contextmanager
        def device(d):
            previous, cuda.current = cuda.current, torch.device(d).index
            try:
                yield
            finally:
                cuda.current = previous

        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: cuda.count)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: cuda.current)
        monkeypatch.setattr(torch.cuda, "device", device)
        monkeypatch.setattr(torch.cuda, "current_stream",
                            lambda d=None: Stream(cuda.current if d is None else torch.device(d).index))
        monkeypatch.setattr(torch.cuda, "Event", Event)
        monkeypatch.setattr(torch.cuda, "synchronize", lambda d=None: cuda.synchronized.append(
            cuda.current if d is None or torch.device(d).index is None else torch.device(d).index))
        return self


def test_time_fn_times_on_the_named_gpu_not_the_current_one(monkeypatch):
    from tempo.bench.timing import time_fn

    cuda = _StandInCuda(devices=2, current=0).install(monkeypatch)
    current_during_fn = []
    times = time_fn(lambda: current_during_fn.append(cuda.current), "cuda:1", warmup=2, repeats=3,
                    setup=lambda: current_during_fn.append(cuda.current))
    assert times == [1.0, 1.0, 1.0]
    assert set(current_during_fn) == {1} and len(current_during_fn) == 10  # warm-up and timed calls
    assert cuda.recorded_on == [1] * 6  # start and end of each timed call, on cuda:1's stream
    assert cuda.synchronized and set(cuda.synchronized) == {1}
    assert cuda.current == 0  # the caller's current device is restored


def test_plain_cuda_means_the_current_gpu(monkeypatch):
    from tempo.bench.hardware import bench_device
    from tempo.bench.timing import resolve_device, time_fn

    cuda = _StandInCuda(devices=2, current=1).install(monkeypatch)
    assert resolve_device("cuda") == torch.device("cuda", 1)
    assert bench_device(None) == torch.device("cuda", 1)  # recorded as "cuda:1", not "cuda"
    time_fn(lambda: None, "cuda", warmup=0, repeats=1)
    assert cuda.recorded_on == [1, 1]


# Keyed by case name: a "cuda:2" parameter would put this CPU test into the GPU suite (conftest).
BAD_DEVICES = {
    "index-past-the-last": ("cuda:2", "--device cuda:2: this process sees 2 CUDA GPU(s), cuda:0 to cuda:1"),
    "other-type": ("mps", "--device 'mps': must be cpu, cuda or cuda:N"),
    "not-a-device": ("gpu", "--device 'gpu' is not a torch device"),
}


@pytest.mark.parametrize("case", sorted(BAD_DEVICES))
def test_bench_device_names_what_is_wrong(monkeypatch, case):
    from tempo.bench.hardware import bench_device

    text, message = BAD_DEVICES[case]
    _StandInCuda(devices=2).install(monkeypatch)
    with pytest.raises(ValueError) as info:
        bench_device(text)
    assert message in str(info.value)


@pytest.mark.parametrize("command", ["ops", "layer"])
def test_bench_commands_refuse_a_gpu_index_past_the_last(monkeypatch, capsys, command):
    from tempo.bench.__main__ import main as bench_main

    _StandInCuda(devices=1).install(monkeypatch)
    assert bench_main([command, "--shapes", "tiny", "--device", "cuda:1"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--device cuda:1: this process sees 1 CUDA GPU(s)" in err[0]
