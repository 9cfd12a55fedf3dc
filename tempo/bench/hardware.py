"""What we run on: GPU detection, dense peak TFLOPS per precision, copy bandwidth, versions.

Peak table (dense, i.e. without 2:4 sparsity; boost clock; from NVIDIA's datasheets and
architecture whitepapers; TFLOPS):

  GPU            bf16/fp16 tensor   tf32 tensor   fp32 (no tensor cores)
  H100 SXM        989                494.7         66.9
  H100 PCIe       756                378           51.2
  H100 NVL        835                418           60.0
  H200 (SXM)      989                494.7         66.9   (same GH100 compute as H100 SXM)
  H200 NVL        835                418           60.0
  A100 (SXM/PCIe) 312                156           19.5
  L40S            362                183           91.6
  L40             181                90.5          90.5
  L4              121                60            30.3
  A10             125                62.5          31.2
  V100 SXM2       125 (fp16 only)    -             15.7
  V100 PCIe       112 (fp16 only)    -             14.0
  RTX 2080 Ti     53.8 (fp16 only)   -             13.4

Assumptions: "bf16"/"fp16" runs are bounded by the tensor-core peak of that dtype with fp32
accumulation, which is what PyTorch's matmuls use. That matters on GeForce Turing: the 2080 Ti's
often-quoted 107.6 TFLOPS is fp16 with fp16 accumulation; with fp32 accumulation the whitepaper
gives half of it, 53.8. GPUs without bf16 (V100, Turing) have no bf16 peak (MFU is left out);
GPUs without TF32 run "tf32" at the fp32 peak. Unknown GPUs and the CPU have no peak unless
``--peak-tflops`` gives one. Real sustained clocks are lower than boost clock, so MFU near 100%
is not reachable; ~50-60% for BERT-large is good.
"""

from __future__ import annotations

import os
import platform
import re
import subprocess
import sys
from typing import Any

import torch

from tempo.choices import PRECISIONS
from tempo.utils import git_commit

# (name tokens that must all occur, lower case) -> peaks; first match wins, so the more specific
# variants come first. A GPU name is split into tokens at spaces, dashes, underscores and
# slashes ("NVIDIA A100-SXM4-80GB" -> nvidia, a100, sxm4, 80gb) and keys match whole tokens:
# substring matching let "l4" match "L40S" and "a10" match "A100".
_PEAKS: list[tuple[tuple[str, ...], str, dict[str, float]]] = [
    (("h100", "pcie"), "H100 PCIe", {"bf16": 756.0, "fp16": 756.0, "tf32": 378.0, "fp32": 51.2}),
    (("h100", "nvl"), "H100 NVL", {"bf16": 835.0, "fp16": 835.0, "tf32": 418.0, "fp32": 60.0}),
    (("h100",), "H100 SXM", {"bf16": 989.0, "fp16": 989.0, "tf32": 494.7, "fp32": 66.9}),
    (("h200", "nvl"), "H200 NVL", {"bf16": 835.0, "fp16": 835.0, "tf32": 418.0, "fp32": 60.0}),
    (("h200",), "H200", {"bf16": 989.0, "fp16": 989.0, "tf32": 494.7, "fp32": 66.9}),
    (("a100",), "A100", {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5}),
    (("l40s",), "L40S", {"bf16": 362.05, "fp16": 362.05, "tf32": 183.0, "fp32": 91.6}),
    (("l40",), "L40", {"bf16": 181.05, "fp16": 181.05, "tf32": 90.5, "fp32": 90.5}),
    (("l4",), "L4", {"bf16": 121.0, "fp16": 121.0, "tf32": 60.0, "fp32": 30.3}),
    (("a10",), "A10", {"bf16": 125.0, "fp16": 125.0, "tf32": 62.5, "fp32": 31.2}),
    (("v100", "pcie"), "V100 PCIe", {"fp16": 112.0, "tf32": 14.0, "fp32": 14.0}),
    (("v100",), "V100 SXM2", {"fp16": 125.0, "tf32": 15.7, "fp32": 15.7}),
    (("2080", "ti"), "RTX 2080 Ti", {"fp16": 53.8, "tf32": 13.4, "fp32": 13.4}),
]


def _name_tokens(name: str) -> set[str]:
    return {t for t in re.split(r"[\s\-_/]+", name.lower()) if t}


def _match(name: str) -> tuple[str, dict[str, float]] | None:
    tokens = _name_tokens(name)
    for keys, label, peaks in _PEAKS:
        if all(k in tokens for k in keys):
            return label, peaks
    return None


def bench_device(text: str | None) -> torch.device:
    """The device a benchmark's ``--device`` names, with its CUDA index filled in.

    None: the current GPU when CUDA is visible, else the CPU. Raises ValueError (the message
    names ``--device``) for what is no device, a type other than cpu/cuda, CUDA without a GPU,
    and an index past the GPUs this process sees."""
    from tempo.bench.timing import resolve_device

    if text is None:
        return resolve_device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    try:
        device = torch.device(text)
    except RuntimeError:
        raise ValueError(f"--device {text!r} is not a torch device; use cpu, cuda or cuda:N") from None
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"--device {text!r}: must be cpu, cuda or cuda:N")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"--device {text}: no CUDA GPU visible")
        count = torch.cuda.device_count()
        if device.index is not None and device.index >= count:
            raise ValueError(f"--device {text}: this process sees {count} CUDA GPU(s), cuda:0 to cuda:{count - 1} "
                             f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r})")
    return resolve_device(device)


def device_name(device: torch.device | str) -> str:
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return platform.processor() or platform.machine() or "cpu"


def known_gpu(name: str) -> str | None:
    """The table's name for a GPU name as CUDA reports it, None when it is not in the table."""
    found = _match(name)
    return found[0] if found else None


def peak_tflops(name: str, precision: str) -> float | None:
    """Dense peak TFLOPS of GPU ``name`` for ``precision``; None when unknown or unsupported."""
    if precision not in PRECISIONS:
        raise ValueError(f"unknown precision {precision!r}; choose one of {PRECISIONS}")
    found = _match(name)
    return found[1].get(precision) if found else None


def device_label(device: torch.device | str) -> str:
    """Folder-safe short name for results/<label>/: the GPU's name, or "cpu"."""
    device = torch.device(device)
    if device.type != "cuda":
        return "cpu"
    name = known_gpu(device_name(device)) or device_name(device)
    return "".join(c if c.isalnum() else "-" for c in name.lower()).strip("-")


def l2_cache_bytes(device: torch.device | str) -> int | None:
    """The GPU's L2 cache size in bytes (H100: 50 MiB); None on the CPU or when torch does not say."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    size = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", None)
    return int(size) if size else None


def measure_copy_bandwidth(device: torch.device | str, nbytes: int = 256 << 20, repeats: int = 10) -> float:
    """Device-to-device copy bandwidth in GB/s (1e9 B/s), counting bytes read + bytes written.

    This is the practical ceiling a memory-bound kernel can reach (a bit under the datasheet's
    HBM figure); the ops benchmark quotes its kernels against it.
    """
    from tempo.bench.timing import resolve_device, time_fn

    device = resolve_device(device)  # the buffers and the timing on the same GPU
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    times_ms = time_fn(lambda: dst.copy_(src), device, warmup=2, repeats=repeats)
    times_ms.sort()
    best = times_ms[len(times_ms) // 2]
    return 2 * src.numel() * 4 / (best / 1000.0) / 1e9


def _nvidia_driver() -> str | None:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None


def environment(device: torch.device | str) -> dict[str, Any]:
    """Everything a result needs to be compared later: hardware, driver, library versions."""
    from tempo.bench.timing import resolve_device

    device = resolve_device(device)  # "cuda" recorded as the GPU it meant, "cuda:N"
    try:
        import triton

        triton_version = triton.__version__
    except Exception:
        triton_version = None
    info: dict[str, Any] = {
        "device": str(device),
        "device_name": device_name(device),
        "gpu": known_gpu(device_name(device)) if device.type == "cuda" else None,
        "driver": _nvidia_driver() if device.type == "cuda" else None,
        "cuda": torch.version.cuda,
        "torch": torch.__version__,
        "triton": triton_version,
        "python": sys.version.split()[0],
        "host": platform.node(),
        "cpu_count": os.cpu_count(),
        "world_size": int(os.environ.get("WORLD_SIZE", "1")),
        **{f"git_{k}": v for k, v in git_commit().items()},
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info["gpu_memory_bytes"] = props.total_memory
        info["compute_capability"] = f"{props.major}.{props.minor}"
    return info
