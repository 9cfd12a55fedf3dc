"""Summaries of counted workloads: totals, class shares, per-op rows, projections, the JSON record."""

from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import Any, Optional

import torch

from tempo.movement.declarations import CLASSES, Target
from tempo.movement.projection import GPU, Factors, Fit, project_seconds
from tempo.movement.workloads import Workload

# Bytes counted for the table and the JSON are those of this target (Tempo's backward grids, and
# so their dγ/dβ partials, depend on the SM count); each GPU's projection uses its own count.
REFERENCE_GPU = "H100"


def target_of(gpu: GPU) -> Target:
    return Target(gpu.name, gpu.sms)


@dataclass
class Summary:
    workload: Workload
    flops: float
    read: float
    written: float
    by_class: dict[str, dict[str, float]]  # class -> {"read", "written", "flops"}
    projected_ms: dict[str, float]
    hidden: int

    @property
    def moved(self) -> float:
        return self.read + self.written

    @property
    def per_token_per_layer(self) -> float:
        return self.moved / self.workload.tokens / self.workload.layers

    def class_share(self, cls: str) -> float:
        c = self.by_class.get(cls, {})
        return (c.get("read", 0.0) + c.get("written", 0.0)) / self.moved if self.moved else 0.0


def summarize(workload: Workload, gpus: dict[str, GPU], factors: Factors, hidden: int = 1024,
              by_dtype: Optional[dict[torch.dtype, Workload]] = None) -> Summary:
    """Totals of ``workload`` (bytes and FLOPs on the reference GPU) and each GPU's projection, from
    ``by_dtype[gpu.half_dtype]`` when given (the same workload traced in that GPU's 16-bit dtype),
    else from ``workload``."""
    reference = target_of(gpus[REFERENCE_GPU])
    by_class: dict[str, dict[str, float]] = {cls: {"read": 0.0, "written": 0.0, "flops": 0.0} for cls in CLASSES}
    read = written = flops = 0.0
    for kernel, weight, _call in workload.kernels(reference):
        read += weight * kernel.read
        written += weight * kernel.written
        flops += weight * kernel.flops
        entry = by_class[kernel.cls]
        entry["read"] += weight * kernel.read
        entry["written"] += weight * kernel.written
        entry["flops"] += weight * kernel.flops
    by_dtype = by_dtype or {}
    projected = {name: project_seconds(by_dtype.get(gpu.half_dtype, workload).weighted(target_of(gpu)), gpu,
                                       factors) * 1e3
                 for name, gpu in gpus.items()}
    return Summary(workload, flops, read, written, by_class, projected, hidden)


def per_op_rows(workload: Workload, target: Target) -> list[dict[str, Any]]:
    """Kernels aggregated by (phase, op, kernel): count, bytes read/written, FLOPs, class."""
    rows: dict[tuple, dict[str, Any]] = collections.OrderedDict()
    for kernel, weight, call in workload.kernels(target):
        phase, op = (call.phase, call.packet) if call is not None else ("step", "optimizer")
        key = (phase, op, kernel.name, kernel.cls)
        row = rows.setdefault(key, {"phase": phase, "op": op, "kernel": kernel.name,
                                    "class": kernel.cls, "count": 0.0, "read": 0.0, "written": 0.0, "flops": 0.0})
        row["count"] += weight
        row["read"] += weight * kernel.read
        row["written"] += weight * kernel.written
        row["flops"] += weight * kernel.flops
    return sorted(rows.values(), key=lambda r: -(r["read"] + r["written"]))


def record(summary: Summary, fit: Fit) -> dict[str, Any]:
    """One JSON record (the issue's schema, plus scope, padding and class shares)."""
    w = summary.workload
    return {
        "choice": w.label, "scope": w.scope, "seq_len": w.seq_len, "batch": w.batch, "layers": w.layers,
        "padding_share": w.padding_share, "real_tokens": w.real_tokens,
        "flops": summary.flops, "bytes_read": summary.read, "bytes_written": summary.written,
        "bytes_moved_per_token_per_layer": summary.per_token_per_layer,
        "bytes_moved_per_token_per_layer_in_h": summary.per_token_per_layer / summary.hidden,
        "class_shares": {cls: summary.class_share(cls) for cls in CLASSES},
        "projected_ms": summary.projected_ms,
        "projected_ms_note": (f"projection (per-kernel roofline, factors fitted on {len(fit.points)} published "
                              f"measurements; largest calibration error {fit.max_relative_error:.0%}), "
                              "not a measurement"),
    }


def fmt_bytes(n: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def relative(value: float, base: Optional[float]) -> str:
    if not base:
        return ""
    return f"{value / base - 1:+.0%}"


__all__ = ["REFERENCE_GPU", "Summary", "fmt_bytes", "per_op_rows", "record", "relative", "summarize", "target_of"]
