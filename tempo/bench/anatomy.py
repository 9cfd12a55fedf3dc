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
from typing import Any

# The byte counts of a step's parts live with the ledger; re-exported for the anatomy's callers.
from tempo.memory import gradient_bytes, optimizer_state_bytes, unique_tensor_bytes, weight_bytes  # noqa: F401


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
