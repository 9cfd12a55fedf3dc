"""Projected GPU time from counted kernels: a per-kernel roofline with two fitted efficiencies.

A kernel that does F FLOPs in dtype d and moves B bytes is projected to take

    t = max(F / (η_c · peak_d), B / (η_b · bandwidth))

and a step the sum over its kernels (no overlap between kernels, no launch latency). peak_d is the
datasheet's dense tensor-core peak for fp16/bf16 and the non-tensor-core peak for fp32;
bandwidth the datasheet's DRAM bandwidth. A100 and H100 come from
``torch._inductor.analysis.device_info`` (its H100 tensor-core figures include 2:4 sparsity and
are halved, as its ``tops_sparsity_factor`` says); the V100, which it lacks, from ``V100_SXM2``
below. The V100 has no bf16: its projections come from fp16 traces (``GPU.half_dtype``), the
others' from bf16 ones (CUDA's softmax of fp16 scores writes fp32 in one kernel; bf16 scores are
first copied to fp32: ~10 % of an eager layer's bytes at s = 512).

The two efficiencies (η_c for FLOPs, η_b for bytes) are fitted once, by least squares on the
log of the ratio, to published measurements (``CALIBRATION``): Substation's V100 BERT-large layer
times and NVIDIA DeepLearningExamples' A100 80GB BERT-large throughputs. Each projection is printed
with the calibration's largest relative error beside it: these are projections, not measurements.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np
import torch

from tempo.movement.declarations import Kernel


@dataclass(frozen=True)
class GPU:
    name: str
    half_tflops: float  # dense fp16/bf16 tensor-core peak
    fp32_tflops: float  # fp32 without tensor cores (PyTorch's default for fp32 matmuls)
    bandwidth_gbs: float
    sms: int
    source: str
    half_dtype: torch.dtype = torch.bfloat16  # the 16-bit dtype mixed precision uses there

    def peak_flops(self, dtype: Optional[torch.dtype]) -> float:
        if dtype in (torch.float16, torch.bfloat16):
            return self.half_tflops * 1e12
        return self.fp32_tflops * 1e12


# Not in torch's table. NVIDIA V100 SXM2 datasheet: 125 TFLOPS fp16 tensor core, 15.7 fp32,
# 900 GB/s HBM2; 80 SMs (Volta whitepaper).
V100_SXM2 = GPU("V100", 125.0, 15.7, 900.0, 80, "NVIDIA V100 datasheet (SXM2)", torch.float16)

_SMS = {"NVIDIA A100": 108, "NVIDIA H100": 132}  # A100 and H100 SXM whitepapers
_SPARSE_FIGURES = {"NVIDIA H100": 2}  # see _from_inductor


def _from_inductor(key: str, label: str) -> GPU:
    from torch._inductor.analysis.device_info import lookup_device_info

    info = lookup_device_info(key)
    if info is None:
        raise LookupError(f"tempo.movement: torch._inductor.analysis.device_info has no entry {key!r}")
    # torch >= 2.13 says which tensor-core figures include 2:4 sparsity; torch 2.11/2.12 hold the
    # same H100 datasheet figure (1979 bf16 TFLOPS, with sparsity) without saying so.
    factor = getattr(info, "tops_sparsity_factor", _SPARSE_FIGURES.get(key, 1))
    dense = info.tops[torch.bfloat16] / factor
    return GPU(label, dense, info.tops[torch.float32], info.dram_bw_gbs, _SMS[key],
               f"torch._inductor.analysis.device_info[{key!r}]")


def gpus() -> dict[str, GPU]:
    """The GPUs projections are made for, by the names the output uses."""
    return {"V100": V100_SXM2, "A100": _from_inductor("NVIDIA A100", "A100"),
            "H100": _from_inductor("NVIDIA H100", "H100")}


@dataclass(frozen=True)
class Factors:
    compute: float  # η_c
    bandwidth: float  # η_b


def kernel_seconds(kernel: Kernel, gpu: GPU, factors: Factors) -> float:
    compute = kernel.flops / (factors.compute * gpu.peak_flops(kernel.dtype)) if kernel.flops else 0.0
    memory = kernel.moved / (factors.bandwidth * gpu.bandwidth_gbs * 1e9)
    return max(compute, memory)


def project_seconds(kernels: Sequence[tuple[Kernel, float]], gpu: GPU, factors: Factors) -> float:
    """Σ weight · t(kernel) over weighted kernels."""
    return sum(weight * kernel_seconds(k, gpu, factors) for k, weight in kernels)


@dataclass(frozen=True)
class CalibrationPoint:
    """A published time and the counted workload it measures."""

    name: str
    gpu: str  # key of gpus()
    measured_ms: float  # per ``per``
    per: str  # what the time is of ("layer step", "sequence")
    source: str


# Substation (Ivanov et al., "Data Movement Is All You Need", MLSys 2021), Table: one BERT-large
# encoder layer, forward + backward, PyTorch, V100: 9.14 ms at b = 8, s = 512 and 18.43 ms at
# b = 96, s = 128. NVIDIA DeepLearningExamples PyTorch BERT, one A100 80GB, mixed precision:
# pretraining phase 1 (s = 128) 580 sequences/s; SQuAD v1.1 fine-tuning (s = 384, batch 32)
# 110.5 sequences/s.
CALIBRATION = (
    CalibrationPoint("substation V100 layer b=8 s=512", "V100", 9.14, "layer fwd+bwd",
                     "Ivanov et al. 2021 (spcl/substation), PyTorch baseline"),
    CalibrationPoint("substation V100 layer b=96 s=128", "V100", 18.43, "layer fwd+bwd",
                     "Ivanov et al. 2021 (spcl/substation), PyTorch baseline"),
    CalibrationPoint("DLE A100-80GB pretraining s=128", "A100", 1000.0 / 580.0, "sequence",
                     "NVIDIA DeepLearningExamples BERT (PyTorch), phase 1, AMP: 580 seq/s"),
    CalibrationPoint("DLE A100-80GB SQuAD s=384 b=32", "A100", 1000.0 / 110.5, "sequence",
                     "NVIDIA DeepLearningExamples BERT (PyTorch), SQuAD v1.1 fine-tuning, AMP, batch 32: 110.5 seq/s"),
)


@dataclass(frozen=True)
class Fit:
    factors: Factors
    points: tuple[dict, ...]  # {point, gpu, measured_ms, projected_ms, relative_error}

    @property
    def max_relative_error(self) -> float:
        return max(abs(p["relative_error"]) for p in self.points)


def fit_factors(workloads: dict[str, tuple[Sequence[tuple[Kernel, float]], float]],
                points: Sequence[CalibrationPoint] = CALIBRATION,
                grid: int = 200) -> Fit:
    """Fit (η_c, η_b) in (0, 1] minimising Σ log²(projected / measured).

    ``workloads[point.name]`` = (weighted kernels counted for that point's GPU, divisor): the
    projection of the point is Σ t / divisor (e.g. the batch size for a per-sequence time).
    A grid of ``grid`` × ``grid`` values, then a finer grid around the best (the objective is
    smooth and has one basin in practice; the grid makes that an observation, not an assumption).
    """
    table = gpus()
    rows = []
    for point in points:
        kernels, divisor = workloads[point.name]
        gpu = table[point.gpu]
        # Kernels without FLOPs take B / (η_b · bandwidth) whatever η_c is: one sum. The others keep
        # their own max(compute, memory); unweighted seconds at η = 1, and their weights.
        memory_only = sum(w * k.moved for k, w in kernels if not k.flops) / (gpu.bandwidth_gbs * 1e9)
        busy = [(k, w) for k, w in kernels if k.flops]
        c = np.array([k.flops / gpu.peak_flops(k.dtype) for k, _ in busy])
        m = np.array([k.moved / (gpu.bandwidth_gbs * 1e9) for k, _ in busy])
        w = np.array([w for _, w in busy])
        rows.append((point, memory_only, c, m, w, divisor))

    def objective(ec: np.ndarray, eb: np.ndarray) -> np.ndarray:
        total = 0.0
        for point, memory_only, c, m, w, divisor in rows:
            seconds = memory_only / eb
            for ci, mi, wi in zip(c, m, w):
                seconds = seconds + wi * np.maximum(ci / ec, mi / eb)
            total = total + np.log(seconds / divisor * 1e3 / point.measured_ms) ** 2
        return total

    ec_axis = np.linspace(0.01, 1.0, grid)
    eb_axis = np.linspace(0.01, 1.0, grid)
    for _ in range(3):  # a coarse grid over (0, 1], then two finer ones around the best
        values = objective(ec_axis[:, None], eb_axis[None, :])
        i, j = np.unravel_index(np.argmin(values), values.shape)
        ec_best, eb_best = float(ec_axis[i]), float(eb_axis[j])
        span_c = (ec_axis[-1] - ec_axis[0]) / grid * 4
        span_b = (eb_axis[-1] - eb_axis[0]) / grid * 4
        ec_axis = np.linspace(max(1e-3, ec_best - span_c), min(1.0, ec_best + span_c), grid)
        eb_axis = np.linspace(max(1e-3, eb_best - span_b), min(1.0, eb_best + span_b), grid)
    factors = Factors(ec_best, eb_best)
    report = []
    for point, *_rest, divisor in rows:
        projected = project_seconds(workloads[point.name][0], table[point.gpu], factors) / divisor * 1e3
        report.append({"point": point.name, "gpu": point.gpu, "per": point.per, "measured_ms": point.measured_ms,
                       "projected_ms": projected, "relative_error": projected / point.measured_ms - 1.0,
                       "source": point.source})
    return Fit(factors, tuple(report))


__all__ = ["CALIBRATION", "CalibrationPoint", "Factors", "Fit", "GPU", "V100_SXM2", "fit_factors", "gpus",
           "kernel_seconds", "project_seconds"]
