"""The plan for a memory budget (tempo/plan/planner.py); per-block recompute (tempo/plan/recompute.py)."""
