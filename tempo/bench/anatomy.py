"""Where a training step's memory goes: weights, gradients, optimizer states, activations, rest.

  weights           bytes of the model's parameters and buffers (tied tensors once)
  gradients         bytes of the .grad tensors after a backward (DDP's buckets not included)
  optimizer_states  bytes of every tensor in optimizer.state (moments, step counters, ...)
  activations       what autograd keeps for backward over ONE micro-batch forward, from the
                    ActivationLedger (exact and device-independent; under autocast it includes
                    the low-precision weight copies, reported apart as activations_fixed when
                    a second, smaller forward gave the marginal cost per sample)
  temporaries       GPU only: allocator peak − all of the above: workspace, the logits and
                    their gradients during backward, allocator fragmentation, compile buffers.

On the CPU there is no allocator peak we can trust (the process RSS includes the Python heap
and libraries), so temporaries is None and "total_accounted" (the sum of the four exact parts)
is the figure used, e.g. by ``max-batch --memory-budget``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Iterable

import torch
from torch import nn


def unique_tensor_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the storages behind ``tensors``, each storage once."""
    seen: set[tuple[Any, ...]] = set()
    total = 0
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            continue
        try:
            storage = t.untyped_storage()
            key = (t.device.type, t.device.index, storage.data_ptr())
            nbytes = storage.nbytes()
        except (RuntimeError, NotImplementedError):
            key, nbytes = (id(t),), t.numel() * t.element_size()
        if key in seen:
            continue
        seen.add(key)
        total += nbytes
    return total


def weight_bytes(model: nn.Module) -> int:
    return unique_tensor_bytes(list(model.parameters()) + list(model.buffers()))


def gradient_bytes(model: nn.Module) -> int:
    """Bytes of the gradients a backward pass gives every trainable parameter (one per parameter,
    in its dtype): exact whether or not the gradients exist right now (zero_grad frees them)."""
    params = {id(p): p for p in model.parameters() if p.requires_grad}.values()
    return sum(p.numel() * p.element_size() for p in params)


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    def tensors():
        for state in optimizer.state.values():
            for value in state.values():
                if isinstance(value, torch.Tensor):
                    yield value

    return unique_tensor_bytes(tensors())


@dataclass
class MemoryAnatomy:
    weights: int
    gradients: int
    optimizer_states: int
    activations: int
    activations_fixed: int | None = None       # autocast weight copies etc., batch-independent
    activations_per_sample: float | None = None  # marginal: what one more sample costs
    peak_allocated: int | None = None           # GPU only
    activations_source: str = "ledger"

    @property
    def total_accounted(self) -> int:
        return self.weights + self.gradients + self.optimizer_states + self.activations

    @property
    def temporaries(self) -> int | None:
        if self.peak_allocated is None:
            return None
        return self.peak_allocated - self.total_accounted

    def fits(self, budget_bytes: int) -> bool:
        """The CPU stand-in for "does this batch fit": the exact parts against a budget."""
        return self.total_accounted <= budget_bytes

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["total_accounted"] = self.total_accounted
        d["temporaries"] = self.temporaries
        return d
