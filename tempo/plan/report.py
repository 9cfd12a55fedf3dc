"""A plan in words and tables (what ``print(plan)`` and ``python -m tempo.plan`` show)."""

from __future__ import annotations

from typing import Any

from tempo.utils import format_bytes


def _recompute_line(recompute: list) -> str:
    counts = {m: recompute.count(m) for m in ("none", "selective", "full") if recompute.count(m)}
    if len(counts) == 1:
        mode = next(iter(counts))
        return f"{mode} in all {len(recompute)} blocks"
    detail = ", ".join(f"{m} {n}" for m, n in counts.items())
    marks = "".join({"none": ".", "selective": "s", "full": "F"}[m] for m in recompute)
    return f"{detail} of {len(recompute)} blocks ({marks}: . none, s selective, F full)"


def format_plan(plan: Any) -> str:
    p = plan.peak
    share = (lambda n: f"{n / p.total:5.1%}") if p.total else (lambda n: "")
    tempo = ", ".join(f"{k} {v}" for k, v in plan.tempo.items()) or "nothing (Tempo not applied)"
    lines = [
        f"Plan for {plan.model} on {plan.device.name}, budget {format_bytes(plan.budget)}, {plan.precision}, "
        f"{plan.optimizer} (counted on fake tensors in {plan.seconds:.1f} s)",
        f"  Tempo:             {tempo}",
    ]
    if plan.left_stock:
        lines.append(f"  left stock:        {'; '.join(plan.left_stock)}")
    if plan.parallel is not None:
        lines.append(f"  parallel:          {plan.parallel} over {plan.world_size} GPUs, planned per rank "
                     f"(tempo.plan.parallel: each rank's batch, its shards and the engine's buffers)")
    lines += [
        f"  recompute:         {_recompute_line(plan.recompute)}",
        f"  unpadding:         {'yes: padding-free batches, memory per real token' if plan.unpadding else 'no: counted at the padded length'}"
        f" (counted at s = {plan.seq_len})",
        f"  tokens per step:   {plan.tokens_per_step:,}" + (" real tokens" if plan.unpadding else " padded tokens")
        + (f" per GPU, {plan.tokens_per_global_step:,} per step over {plan.world_size} GPUs" if plan.parallel else ""),
    ]
    for padded, fraction, sequences in plan.buckets:
        lines.append(f"    sequences up to {padded:5d} tokens ({fraction:4.0%} of the sample): {sequences:,} per step")
    lines += [
        f"  predicted peak:    {format_bytes(p.total)} at the {p.at}",
        f"    weights            {format_bytes(p.weights):>12} {share(p.weights)}",
        f"    gradients          {format_bytes(p.gradients):>12} {share(p.gradients)}",
        f"    optimizer states   {format_bytes(p.optimizer_states):>12} {share(p.optimizer_states)}",
        f"    kept activations   {format_bytes(p.activations):>12} {share(p.activations)}",
        f"    transient          {format_bytes(p.transient):>12} {share(p.transient)}",
        f"    workspace margin   {format_bytes(p.workspace):>12} {share(p.workspace)}",
    ]
    if plan.parallel is not None:
        lines.append(f"    engine buffers     {format_bytes(p.buffers):>12} {share(p.buffers)}"
                     + ("  (gradient buckets)" if plan.parallel == "ddp" else "  (unsharded parameters, collectives)"))
    if plan.step_seconds and plan.parallel is not None and plan.collective_seconds is not None:
        overlapped = plan.step_seconds_overlapped
        lines.append(f"  projected step:    {overlapped * 1e3:.1f}-{plan.step_seconds * 1e3:.1f} ms per step "
                     f"({plan.collective_seconds * 1e3:.1f} ms of collectives at tempo.plan.parallel.INTERCONNECT's "
                     f"bandwidth, hidden to not hidden), {plan.tokens_per_global_step / plan.step_seconds:,.0f}-"
                     f"{plan.tokens_per_global_step / overlapped:,.0f} real tokens/s over {plan.world_size} GPUs "
                     f"(a projection)")
    elif plan.step_seconds:
        lines.append(f"  projected step:    {plan.step_seconds * 1e3:.1f} ms, {plan.tokens_per_second:,.0f} real tokens/s "
                     f"(a projection: tempo.movement's roofline, recompute included)")
    else:
        lines.append("  projected step:    no projection for this device (tempo.movement covers V100, A100, H100)")
    return "\n".join(lines)


def format_candidates(plan: Any, limit: int = 12) -> str:
    """The recompute plans tried: tokens each allows, its peak and projected tokens/s."""
    rows = ["| recompute | tokens per step | predicted peak | projected tokens/s |", "|---|---|---|---|"]
    shown = plan.candidates if len(plan.candidates) <= limit else (
        plan.candidates[:: max(1, len(plan.candidates) // limit)] + [plan.candidates[-1]])
    for c in shown:
        speed = f"{c.tokens_per_second:,.0f}" if c.tokens_per_second else "-"
        peak = format_bytes(c.peak.total) if c.peak else "does not fit"
        mark = " (plan)" if list(c.recompute) == list(plan.recompute) else ""
        rows.append(f"| {c.summary()}{mark} | {c.tokens:,} | {peak} | {speed} |")
    return "\n".join(rows)


__all__ = ["format_candidates", "format_plan"]
