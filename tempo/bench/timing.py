"""Timing helpers: warm-up excluded, median and spread (p20/p80) over repeats.

On CUDA every measurement is bracketed by CUDA events (kernel time without host jitter of the
launch loop); on the CPU by ``time.perf_counter``. Timings are reported, never asserted.

The device timed is the one the benchmark's tensors live on, not whichever GPU happens to be
current: ``time_fn(fn, "cuda:1")`` runs the warm-up and the timed calls with cuda:1 current,
records its events on cuda:1's current stream (where the ops on cuda:1 tensors and the Triton
launches under ``launch_on`` queue their kernels) and synchronizes cuda:1. Events recorded on
another device's stream would time an idle stream and return ~0 ms.
"""

from __future__ import annotations

import contextlib
import time
from typing import Callable, Iterator

import torch


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolation percentile (q in [0, 100]); NaN for no values."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def spread(values: list[float]) -> dict[str, float]:
    """The three numbers every table quotes: p20, p50 (median), p80."""
    return {"p20": percentile(values, 20), "p50": percentile(values, 50), "p80": percentile(values, 80)}


def resolve_device(device: torch.device | str) -> torch.device:
    """``device`` with a CUDA index filled in: "cuda" means the current GPU, named as "cuda:N"."""
    device = torch.device(device)
    # Without CUDA there is no current GPU to name; the first use of the device says so.
    if device.type == "cuda" and device.index is None and torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
    return device


@contextlib.contextmanager
def on_device(device: torch.device | str) -> Iterator[torch.device]:
    """Make ``device`` the current CUDA device inside the block (nothing to do on the CPU).

    Whatever in the block asks for "the current device" (a default CUDA stream, an event, a
    library allocating scratch space) then means the benchmark's device."""
    device = resolve_device(device)
    if device.type == "cuda":
        with torch.cuda.device(device):
            yield device
    else:
        yield device


def synchronize(device: torch.device | str) -> None:
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(resolve_device(device))


def time_fn(fn: Callable[[], object], device: torch.device | str, warmup: int = 3,
            repeats: int = 10, setup: Callable[[], object] | None = None) -> list[float]:
    """Milliseconds of each of ``repeats`` calls of ``fn`` after ``warmup`` untimed calls.

    ``setup`` (optional) runs before every call, outside the timed region (e.g. to rebuild the
    graph a backward-only measurement consumes). On CUDA everything runs with ``device`` current
    and the events go on ``device``'s current stream (module docstring).
    """
    with on_device(device) as device:
        for _ in range(warmup):
            if setup is not None:
                setup()
            fn()
        synchronize(device)
        times: list[float] = []
        # The device's current stream, as ops and launch_on use it (a torch.cuda.stream(...) the
        # caller set around time_fn included): the events must bracket that stream's work.
        stream = torch.cuda.current_stream(device) if device.type == "cuda" else None
        for _ in range(repeats):
            if setup is not None:
                setup()
            if stream is not None:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record(stream)
                fn()
                end.record(stream)
                end.synchronize()
                times.append(start.elapsed_time(end))
            else:
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1000.0)
    return times
