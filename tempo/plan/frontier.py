"""``python -m tempo.plan --frontier``: Tempo's plan beside the best of torch's own policies, per budget.

For each model and sequence length (``SCENARIOS``) and each total budget (``BUDGETS_GIB``) on a
projected H100 80 GB: the plan ``tempo.plan`` chooses (Tempo's layers, recompute per block, tokens
per step), and every policy a PyTorch user has without Tempo, each at *its* largest fitting batch:
eager, sdpa, ``torch.compile`` + sdpa, compile with ``activation_memory_budget`` 0.8 / 0.5 / 0.2,
selective checkpointing (matmul outputs saved; every second matmul recomputed), full per-layer
checkpointing. Every time is a projection (tempo.movement's calibrated roofline; the row says so).

How each torch policy is counted, all on fake tensors as a GPU runs the step (bf16 autocast, fused
AdamW-style optimizer states, the model's masked-LM head over every position):
  * eager, sdpa, full checkpointing: ``tempo.plan.count`` of the model without Tempo (its attention
    implementation "eager" or "sdpa"), every block "none" or every block "full": the same composed
    step, peak and kernels as Tempo's plans, by the same code.
  * compile + sdpa, the budget knob, selective checkpointing: ``tempo.plan.torch_policies`` counts
    what each keeps per token per layer and what its backward recomputes (torch's own partitioner and
    checkpoint policies). Their step is sdpa's with each block's kept bytes replaced by the policy's
    (at every segment, for the blocks whose activations are alive there) and the recomputed FLOPs
    added at the fitted tensor-core rate. The compiled ones are timed as Tempo's plan + torch.compile
    is, with tempo.plan.fusion's model of Inductor (each run of element-wise ops between two matmuls
    one kernel, moving its inputs and the outputs read later once): a lower bound on a compiled
    step's traffic, the same on both sides; the recomputed element-wise work of the knob and of
    selective checkpointing is not counted, in torch's favour. The knob's rows are counted on the
    whole model at ``torch_policies.DEFAULT_TOKENS`` tokens and scaled per token (the knob is a
    fraction of the graph's activations, so roughly scale-free where activations outweigh parameters).
  * Torch's budgeted compile below 1.0 redraws dropout masks in backward (pytorch#190758: measured by
    tests/test_torch_policies.py, gradients up to 28 % off with dropout 0.1): those rows do not train
    exactly; every plan Tempo emits does (tests/test_plan_recompute.py).

"Memory binds torch" where the best torch policy's projected tokens/s is more than 3 % below what the
fastest torch policy without recompute would reach with unlimited memory: it cannot reach a batch
that saturates the GPU without recompute.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Optional, Sequence

SCENARIOS = (("bert-large", 128), ("bert-large", 512), ("deberta-v3-large", 512), ("modernbert-large", 8192))
BUDGETS_GIB = (16, 24, 40, 80)
DEVICE = "h100"
SATURATED_TOKENS = 1 << 20  # "unlimited memory": a million tokens per step
BINDS_MARGIN = 0.03
DERIVED = ("compile+sdpa", "compile-budget-0.8", "compile-budget-0.5", "compile-budget-0.2", "sac-matmuls",
           "sac-every-second-matmul")
EXACT_NOTE = {"compile-budget-0.5": "redraws dropout masks", "compile-budget-0.2": "redraws dropout masks"}


@dataclass
class PolicyPoint:
    """One policy at its largest fitting batch under one budget."""

    policy: str
    tokens: int
    tokens_per_second: Optional[float]  # projected
    peak_bytes: Optional[int]
    recompute: str = ""
    trains_exactly: bool = True
    note: str = ""


@dataclass
class FrontierRow:
    model: str
    seq_len: int
    budget_gib: int
    tempo: PolicyPoint
    torch: list = field(default_factory=list)  # PolicyPoint per torch policy
    binds: Optional[bool] = None  # memory binds the best torch policy (module docstring)
    saturated: Optional[float] = None  # torch's projected tokens/s without recompute or a memory limit

    @property
    def best_torch(self) -> Optional[PolicyPoint]:
        fitting = [p for p in self.torch if p.tokens and p.tokens_per_second]
        return max(fitting, key=lambda p: p.tokens_per_second) if fitting else None

    @property
    def best_exact_torch(self) -> Optional[PolicyPoint]:
        """The fastest torch policy that trains exactly (the budgeted compile below 1.0 does not)."""
        fitting = [p for p in self.torch if p.tokens and p.tokens_per_second and p.trains_exactly]
        return max(fitting, key=lambda p: p.tokens_per_second) if fitting else None


def _alive_blocks(segment: tuple, layers: int) -> int:
    """How many blocks' kept activations are alive at the start of ``segment`` of the composed step."""
    if segment[0] == "fwd":
        return max(0, min(segment[1] - 1, layers))
    if segment[0] == "bwd":
        return max(0, min(segment[1] - 1, layers))
    return layers if segment[0] == "fwd_end" else 0


def _derived_point(name: str, sdpa: Any, counts: dict, budget: int) -> PolicyPoint:
    """A torch policy counted by tempo.plan.torch_policies, on sdpa's composed step (module docstring)."""
    from tempo.plan.compose import compose
    from tempo.plan.planner import COMPOSITION_MARGIN, largest_tokens

    policy, reference = counts[name], counts.get("sdpa") or counts["eager"]
    if not policy.counted:
        return PolicyPoint(name, 0, None, None, note=f"not counted: {policy.note}")
    layers = sdpa.blocks
    if policy.scope == "whole model":
        base = counts[f"compile+sdpa (whole model)"]
        saved_per_token = (base.per_token_per_layer - policy.per_token_per_layer) * base.layers  # per token, all layers
        compile_ref = counts["compile+sdpa"]
        saved_per_token += (reference.per_token_per_layer - compile_ref.per_token_per_layer) * layers
    else:
        saved_per_token = (reference.per_token_per_layer - policy.per_token_per_layer) * layers
    composition = compose(sdpa.parts, ("none",) * layers)
    grow = 1.0 + COMPOSITION_MARGIN
    fixed = sdpa.weights + sdpa.states + sdpa.workspace
    lines = []
    for segment, line in zip(composition.peak_segments, composition.peak):
        share = _alive_blocks(segment, layers) / layers if layers else 0.0
        lines.append((fixed + grow * line.a, grow * (line.b - share * saved_per_token)))
    lines.append((fixed + grow * (composition.end.a + sdpa.optimizer_temporary), grow * composition.end.b))
    tokens = largest_tokens(lines, budget)
    tokens = (tokens // sdpa.seq_len) * sdpa.seq_len
    if tokens < sdpa.floor_tokens:
        return PolicyPoint(name, 0, None, None, recompute=policy.recomputed_text)
    peak = max(a + b * tokens for a, b in lines)
    compiled = name.startswith("compile")
    seconds = sdpa.step_seconds(("none",) * layers, tokens, compiled=compiled)
    recomputed = (policy.recomputed_flops_per_token_per_layer or 0.0) * layers * tokens
    gpu = sdpa.gpu
    from tempo.plan.planner import FITTED_COMPUTE

    seconds += recomputed / (FITTED_COMPUTE * gpu.half_tflops * 1e12)
    return PolicyPoint(name, int(tokens), tokens / seconds, int(peak), recompute=policy.recomputed_text,
                       trains_exactly=name not in EXACT_NOTE, note=EXACT_NOTE.get(name, ""))


def _plan_point(name: str, counted: Any, recompute: tuple, budget: int) -> PolicyPoint:
    candidate = counted.candidate(recompute, budget)
    if not candidate.tokens:
        return PolicyPoint(name, 0, None, None)
    return PolicyPoint(name, candidate.tokens, candidate.tokens_per_second, candidate.peak.total,
                       recompute="the whole block" if "full" in recompute else "")


def _saturated(counted: Any) -> float:
    """Projected tokens/s without recompute and without a memory limit, eager or compiled."""
    return max(SATURATED_TOKENS / counted.step_seconds(("none",) * counted.blocks, SATURATED_TOKENS, compiled=compiled)
               for compiled in (False, True))


def frontier(scenarios: Sequence[tuple[str, int]] = SCENARIOS, budgets: Sequence[int] = BUDGETS_GIB,
             device: str = DEVICE, layers: Optional[int] = None,
             progress: Optional[Callable[[str], None]] = None) -> list[FrontierRow]:
    """The rows of the frontier table (module docstring). ``layers``: build each model with this many
    blocks instead of its published depth (tests)."""
    from tempo.plan.budget import PlanError
    from tempo.plan.planner import choose, count
    from tempo.plan.torch_policies import DEFAULT_TOKENS, count_policies
    from tempo.presets import build_family, supports_sdpa

    say = progress or (lambda line: None)
    rows = []
    for family, seq_len in scenarios:
        attentions = ["eager", "sdpa"] if supports_sdpa(family) else ["eager"]
        say(f"{family}, s = {seq_len}: Tempo's plans (tempo.plan)")
        tempo_counted = count(build_family(family, "mlm", layers), seq_len, device, progress=None)
        stock = {}
        for attention in attentions:
            say(f"{family}, s = {seq_len}: torch without Tempo, {attention} attention")
            stock[attention] = count(build_family(family, "mlm", layers, attention=attention), seq_len, device,
                                     tempo=False, modes=("none", "full"))
        base = stock.get("sdpa") or stock["eager"]
        say(f"{family}, s = {seq_len}: torch's compile and selective checkpointing (tempo.plan.torch_policies)")
        names = ["eager", *(["sdpa"] if "sdpa" in stock else []), *DERIVED]
        tokens = seq_len * math.ceil(DEFAULT_TOKENS / seq_len)  # the knob's whole-model rows: whole sequences
        counts = {c.policy: c for c in count_policies(names, family, seq_len, tokens=tokens)}
        for budget_gib in budgets:
            budget = budget_gib << 30
            try:
                plan = choose(tempo_counted, budget, compiled=True)
                seconds = tempo_counted.step_seconds(plan.recompute, plan.tokens_per_step, compiled=True)
                tempo_point = PolicyPoint("Tempo plan + torch.compile", plan.tokens_per_step,
                                          plan.tokens_per_step / seconds, plan.peak_bytes,
                                          recompute=_recompute_text(plan.recompute))
            except PlanError as exc:  # a budget nothing fits is a row saying so
                tempo_point = PolicyPoint("Tempo plan + torch.compile", 0, None, None,
                                          note=str(exc).split(": ", 1)[-1][:120])
            points = [_plan_point(a, stock[a], ("none",) * stock[a].blocks, budget) for a in attentions]
            points.append(_plan_point("full-checkpoint", base, ("full",) * base.blocks, budget))
            for name in DERIVED:
                if name in counts or f"{name}" in counts:
                    points.append(_derived_point(name, base, counts, budget))
            rows.append(FrontierRow(family, seq_len, budget_gib, tempo_point, points))
        saturated = max(_saturated(stock[a]) for a in attentions)
        for row in rows[-len(budgets):]:
            best = row.best_torch
            row.saturated = saturated
            row.binds = bool(best is None or best.tokens_per_second < (1 - BINDS_MARGIN) * saturated)
    return rows


def _recompute_text(recompute: list) -> str:
    counts = {m: recompute.count(m) for m in ("none", "selective", "full") if recompute.count(m)}
    return ", ".join(f"{n} {m}" for m, n in counts.items())


def format_frontier(rows: list[FrontierRow]) -> str:
    from tempo.presets import FAMILIES

    def cells(t: PolicyPoint, p: Optional[PolicyPoint]) -> str:
        if p is None:
            return "nothing fits | -"
        ratio = f"{t.tokens_per_second / p.tokens_per_second:.2f}x" if t.tokens_per_second else "-"
        return f"{p.policy}: {p.tokens:,} tokens, {p.tokens_per_second:,.0f}/s | {ratio}"

    lines = ["| model | s | budget | Tempo plan: recompute | tokens/step | real tokens/s | best torch policy | "
             "Tempo / it | best torch policy that trains exactly | Tempo / it | memory binds torch |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        t = row.tempo
        speed = f"{t.tokens_per_second:,.0f}" if t.tokens_per_second else "does not fit"
        lines.append(f"| {FAMILIES[row.model][0]} | {row.seq_len} | {row.budget_gib} GiB | {t.recompute or '-'} | "
                     f"{t.tokens:,} | {speed} | {cells(t, row.best_torch)} | {cells(t, row.best_exact_torch)} | "
                     f"{'yes' if row.binds else 'no'} |")
    return "\n".join(lines)


def format_details(rows: list[FrontierRow]) -> str:
    """Every policy of every row: tokens per step and projected tokens/s."""
    out = []
    for row in rows:
        out.append(f"\n{row.model}, s = {row.seq_len}, {row.budget_gib} GiB:")
        for p in [row.tempo, *row.torch]:
            speed = f"{p.tokens_per_second:,.0f} tokens/s (proj.)" if p.tokens_per_second else "does not fit"
            extra = f"; {p.note}" if p.note else ""
            out.append(f"  {p.policy:<48} {p.tokens:>10,} tokens  {speed}{extra}")
        if row.saturated:
            out.append(f"  {'(torch, no recompute, unlimited memory)':<48} {'':>17} {row.saturated:,.0f} tokens/s (proj.)")
    return "\n".join(out)


def main(argv: Optional[list[str]] = None) -> int:
    from tempo.utils import atomic_write_text

    parser = argparse.ArgumentParser(prog="python -m tempo.plan --frontier", description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", metavar="PATH", help="write every row as JSON")
    parser.add_argument("--details", action="store_true", help="also print every policy of every row")
    args = parser.parse_args(argv)
    start = time.perf_counter()

    def say(line: str) -> None:
        print(f"[frontier {time.perf_counter() - start:6.1f} s] {line}", file=sys.stderr, flush=True)

    rows = frontier(progress=say)
    print("Projected on an H100 80 GB (tempo.movement's roofline): projections, not measurements.")
    print(format_frontier(rows))
    if args.details:
        print(format_details(rows))
    if args.json:
        atomic_write_text(args.json, json.dumps([asdict(r) for r in rows], indent=2) + "\n")
    return 0


__all__ = ["BUDGETS_GIB", "SCENARIOS", "FrontierRow", "PolicyPoint", "format_frontier", "frontier", "main"]
