"""Timing helpers: warm-up excluded, median and spread (p20/p80) over repeats.

On CUDA every measurement is bracketed by CUDA events (kernel time without host jitter of the
launch loop); on the CPU by ``time.perf_counter``. Timings are reported, never asserted.
"""

from __future__ import annotations

import time
from typing import Callable

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


def synchronize(device: torch.device | str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def time_fn(fn: Callable[[], object], device: torch.device | str, warmup: int = 3,
            repeats: int = 10, setup: Callable[[], object] | None = None) -> list[float]:
    """Milliseconds of each of ``repeats`` calls of ``fn`` after ``warmup`` untimed calls.

    ``setup`` (optional) runs before every call, outside the timed region (e.g. to rebuild the
    graph a backward-only measurement consumes).
    """
    device = torch.device(device)
    for _ in range(warmup):
        if setup is not None:
            setup()
        fn()
    synchronize(device)
    times: list[float] = []
    for _ in range(repeats):
        if setup is not None:
            setup()
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1000.0)
    return times
