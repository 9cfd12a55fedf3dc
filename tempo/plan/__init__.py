"""The plan for a memory budget: tokens per step and recompute per block, counted on fake tensors.

``tempo.plan(model, budget="24GiB", lengths=..., device="h100")`` returns a ``Plan``
(tempo/plan/planner.py explains how); ``python -m tempo.plan`` prints one.
"""

from tempo.plan.budget import DEVICES, PlanError, parse_budget, resolve_device
from tempo.plan.confirm import ConfirmError, Confirmation, confirm, fixed_length_batches
from tempo.plan.planner import Candidate, Counted, PeakParts, Plan, choose, count, plan, tokens_per_step
from tempo.integrations.recompute import apply_recompute, recompute_of, set_recompute, transformer_blocks

__all__ = ["DEVICES", "Candidate", "ConfirmError", "Confirmation", "Counted", "PeakParts", "Plan", "PlanError",
           "apply_recompute", "choose", "confirm", "count", "fixed_length_batches", "parse_budget", "plan",
           "recompute_of", "resolve_device", "set_recompute", "tokens_per_step", "transformer_blocks"]
