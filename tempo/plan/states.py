"""What the optimizer holds and what its step needs, counted by running it on fake tensors.

``optimizer_memory(parameters, name)`` builds the optimizer over fake copies of the parameters
(same shapes and dtypes, fake gradients), runs two steps under tempo.plan.trace's timeline and
returns the bytes of its state after the first step and the peak of temporaries during the second
(the steady state): AdamW's ``foreach`` step makes one parameter-sized temporary list
(``_foreach_sqrt`` of the second moments), the fused step none. Host-side 0-d step counters
(AdamW without ``fused``/``capturable`` keeps them on the CPU) are not GPU memory and are left out
when counting for a GPU.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from tempo.plan.budget import PlanError
from tempo.plan.trace import MemoryTimeline

OPTIMIZERS = ("adamw", "adamw-fused", "sgd", "lamb")


def _build(name: str, params: list, semantics: str) -> torch.optim.Optimizer:
    if name == "adamw":
        # torch's default on CUDA: the foreach implementation (fused is opt-in).
        return torch.optim.AdamW(params, lr=1e-4, foreach=semantics == "cuda")
    if name == "adamw-fused":
        return torch.optim.AdamW(params, lr=1e-4, fused=True)
    if name == "sgd":
        return torch.optim.SGD(params, lr=1e-2, momentum=0.9, foreach=semantics == "cuda")
    if name == "lamb":
        from tempo.train.optim import Lamb

        return Lamb(params, lr=1e-3)
    raise PlanError(f"tempo.plan: argument 'optimizer' must be one of {', '.join(OPTIMIZERS)}, got {name!r}")


def optimizer_memory(parameters: Iterable[nn.Parameter], name: str, semantics: str = "cuda",
                     round_to: int = 1) -> tuple[int, int]:
    """(state bytes, peak temporary bytes of a step) for optimizer ``name`` (module docstring)."""
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    seen: set[int] = set()
    fakes = []
    with mode:
        for p in parameters:
            if id(p) in seen or not p.requires_grad:
                continue
            seen.add(id(p))
            fake = nn.Parameter(torch.empty(tuple(p.shape), dtype=p.dtype, device="cpu"))
            fake.grad = torch.empty(tuple(p.shape), dtype=p.dtype, device="cpu")
            fakes.append(fake)
    if not fakes:
        return 0, 0
    optimizer = _build(name, fakes, semantics)
    host_counters = semantics == "cuda" and name != "adamw-fused"
    timeline = MemoryTimeline(round_to)
    with mode, timeline:
        optimizer.step()
        states = _state_bytes(optimizer, round_to, host_counters)
        timeline.enter(("fwd", 1))
        before = timeline.live
        optimizer.step()
        temporary = max(0, timeline.segments[("fwd", 1)].peak - before)
    return states, temporary


def _state_bytes(optimizer: torch.optim.Optimizer, round_to: int, host_counters: bool) -> int:
    seen: set[Any] = set()
    total = 0
    for state in optimizer.state.values():
        for value in state.values():
            if not isinstance(value, torch.Tensor) or (host_counters and value.dim() == 0):
                continue
            storage = value.untyped_storage()
            if storage in seen:
                continue
            seen.add(storage)
            nbytes = storage.nbytes()
            total += -(-nbytes // round_to) * round_to if round_to > 1 and nbytes else nbytes
    return total


__all__ = ["OPTIMIZERS", "optimizer_memory"]
