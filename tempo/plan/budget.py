"""What a plan is made for: a memory budget in bytes, and the device it runs on.

``parse_budget`` accepts "24GiB", "24 GiB", "24G" (binary), "24GB" (decimal: 24·10⁹ bytes, as
drive and GPU vendors count), "1.5e10" or an int of bytes. ``device`` is "cpu" (the reference paths'
own temporaries, CPU dropout), "cuda" (the current GPU: its name picks the projection, its memory
the default budget), or a GPU named in ``DEVICES``; time projections exist for the GPUs
tempo.movement's roofline is calibrated for (V100, A100, H100; an H200 is projected as an H100 with
its own memory: same SMs and tensor cores, more bandwidth not modelled).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

from tempo.utils import parse_bytes


class PlanError(ValueError):
    """A plan that cannot be made, with one line saying why (the CLI prints it and exits 2)."""


@dataclass(frozen=True)
class Device:
    name: str  # as printed
    memory: Optional[int]  # bytes the GPU holds (None: the CPU, no fixed size)
    semantics: str  # "cuda" (count as a GPU allocates) or "cpu"
    projection: Optional[str]  # key of tempo.movement.projection.gpus(), None: no time projection
    round_to: int  # allocation rounding of its allocator


GIB = 1 << 30
DEVICES = {
    "h100": Device("H100 80GB", 80 * GIB, "cuda", "H100", 512),
    "h200": Device("H200 141GB", 141 * 10**9, "cuda", "H100", 512),
    "a100": Device("A100 80GB", 80 * GIB, "cuda", "A100", 512),
    "a100-40gb": Device("A100 40GB", 40 * GIB, "cuda", "A100", 512),
    "v100": Device("V100 32GB", 32 * GIB, "cuda", "V100", 512),
    "l4": Device("L4 24GB", 24 * GIB, "cuda", None, 512),
    "rtx4090": Device("RTX 4090 24GB", 24 * GIB, "cuda", None, 512),
    "cpu": Device("CPU", None, "cpu", None, 1),
}


def parse_budget(budget: Union[int, float, str]) -> int:
    """Bytes of a budget (module docstring); a PlanError naming the argument otherwise."""
    if isinstance(budget, bool):
        raise PlanError(f"tempo.plan: argument 'budget' must be a size such as '24GiB', got {budget!r}")
    try:
        value = parse_bytes(budget)
    except (ValueError, AttributeError):
        value = None
    if value is None or value <= 0:
        raise PlanError(f"tempo.plan: argument 'budget' must be a size such as '24GiB', '24 GiB', '24GB' or a "
                        f"number of bytes, got {budget!r}")
    return value


def resolve_device(device: Union[str, None]) -> Device:
    """A ``Device`` from its name; "cuda" reads the current GPU (its name and memory)."""
    if device is None:
        device = "cuda"
    if not isinstance(device, str):
        device = str(device)
    key = device.strip().lower()
    if key in ("cuda", "gpu") or key.startswith("cuda:"):
        import torch

        if not torch.cuda.is_available():
            raise PlanError("tempo.plan: device 'cuda' asked for, but no CUDA GPU is visible; name one of "
                            f"{', '.join(DEVICES)} to plan for it from here")
        index = torch.device(key if key.startswith("cuda") else "cuda").index
        props = torch.cuda.get_device_properties(index or 0)
        name = props.name
        projection = next((p for p in ("H100", "H200", "A100", "V100") if p in name.upper()), None)
        return Device(name, int(props.total_memory), "cuda", "H100" if projection == "H200" else projection, 512)
    if key not in DEVICES:
        raise PlanError(f"tempo.plan: unknown device {device!r}; choose 'cuda' (the current GPU), 'cpu' or one of "
                        f"{', '.join(k for k in DEVICES if k != 'cpu')}")
    return DEVICES[key]


__all__ = ["DEVICES", "Device", "PlanError", "parse_budget", "resolve_device"]
