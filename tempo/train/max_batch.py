"""The largest batch that fits: doubling, then bisection, over any "does batch b fit?" probe.

Used by the benchmark's ``max-batch`` command (one subprocess per probe). It and
``tempo.plan.confirm`` (probes that train a few steps, each in a process of its own on CUDA) decide
"does not fit" with the same rule, written here once: ``is_oom_output`` for a probe's printed
output, ``is_oom_error`` for an exception.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

# Lower-cased substrings that identify "did not fit": PyTorch's CUDA/CPU OOM messages
# ("CUDA out of memory", "OutOfMemoryError", our simulated one) and cuBLAS failing to allocate
# its workspace, which is how an OOM inside a GEMM sometimes surfaces (a RuntimeError, not an
# OutOfMemoryError).
OOM_MARKERS = ("out of memory", "outofmemoryerror", "cublas_status_alloc_failed")


def is_oom_output(text: str) -> bool:
    """Whether a probe's output (or an error message) reports running out of memory."""
    lower = text.lower()
    return any(marker in lower for marker in OOM_MARKERS)


def is_oom_error(exc: BaseException) -> bool:
    """Whether an exception means "out of memory": torch's OutOfMemoryError (CUDA's is the same
    class), or any exception whose type name or message carries an OOM marker (cuBLAS's
    CUBLAS_STATUS_ALLOC_FAILED RuntimeError, "CUDA error: out of memory", the simulated one)."""
    import torch

    oom_type = getattr(torch, "OutOfMemoryError", None) or getattr(torch.cuda, "OutOfMemoryError", None)
    if oom_type is not None and isinstance(exc, oom_type):
        return True
    return is_oom_output(f"{type(exc).__name__}: {exc}")


class ProbeError(Exception):
    """A probe failed for a reason other than memory: the search cannot go on."""

    def __init__(self, batch: int, message: str):
        super().__init__(f"batch {batch}: {message}")
        self.batch = batch
        self.message = message


@dataclass
class Probe:
    batch: int
    fits: bool
    seconds: float


class SearchError(Exception):
    def __init__(self, cause: ProbeError, probes: list[Probe]):
        super().__init__(str(cause))
        self.cause = cause
        self.probes = probes


def search_max_batch(probe: Callable[[int], bool], start: int = 1, max_batch: int | None = None) -> tuple[int, list[Probe]]:
    """Largest b in [1, max_batch] with probe(b) True, assuming "fits" is monotone in b.

    Returns (answer, probes in order); answer 0 means not even batch 1 fits. A ProbeError from
    ``probe`` is re-raised as SearchError carrying the probes made so far.
    """
    if start < 1:
        raise ValueError("start must be >= 1")
    if max_batch is not None and max_batch < 1:
        raise ValueError("max_batch must be >= 1")
    probes: list[Probe] = []

    def run(b: int) -> bool:
        t0 = time.perf_counter()
        try:
            fits = bool(probe(b))
        except ProbeError as exc:
            raise SearchError(exc, probes) from exc
        probes.append(Probe(b, fits, time.perf_counter() - t0))
        return fits

    fitted, failed = 0, None  # largest known fit, smallest known failure
    b = min(start, max_batch) if max_batch is not None else start
    while True:
        if run(b):
            fitted = b
            if max_batch is not None and b >= max_batch:
                break
            b = b * 2 if max_batch is None else min(b * 2, max_batch)
        else:
            failed = b
            break
    if failed is not None:
        while failed - fitted > 1:
            mid = (fitted + failed) // 2
            if run(mid):
                fitted = mid
            else:
                failed = mid
    return fitted, probes
