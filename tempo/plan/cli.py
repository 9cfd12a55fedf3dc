"""``python -m tempo.plan``: the plan for a model, a budget and sequence lengths, printed.

    python -m tempo.plan --model bert-large --seq-len 512 --budget 24GiB
    python -m tempo.plan --model deberta-v3-large --lengths lengths.txt --budget 40GiB --device a100
    python -m tempo.plan --model llama-3.2-1b --task causal-lm --gpus 8 --parallel fsdp2   # per rank
    python -m tempo.plan --frontier            # Tempo's plans beside torch's own policies (tempo.plan.frontier)

Models are transformers' at their published sizes, built on the meta device from their configs
(``tempo.presets``: nothing is downloaded, no memory is used), or from a local config.json (or the
model folder holding it), with the head ``--task`` names (masked-LM by default: logits for every
position, as transformers' *ForMaskedLM trains; causal-lm for a decoder).
``--lengths`` takes a file of one length per line (or whitespace-separated) as the sample of the
data's lengths; ``--seq-len`` one length.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any, Optional


def read_lengths(path: str) -> list[int]:
    """A sample of sequence lengths: integers separated by whitespace or newlines."""
    try:
        text = Path(path).read_text()
    except OSError as err:
        raise SystemExit(f"python -m tempo.plan: --lengths {path}: {err.strerror}") from None
    values = []
    for i, word in enumerate(text.split(), start=1):
        if not word.isdigit() or int(word) < 1:
            raise SystemExit(f"python -m tempo.plan: --lengths {path}: entry {i} ({word!r}) is not a positive integer")
        values.append(int(word))
    if not values:
        raise SystemExit(f"python -m tempo.plan: --lengths {path}: no lengths in the file")
    return values


def _parser() -> argparse.ArgumentParser:
    from tempo.plan.budget import DEVICES
    from tempo.plan.planner import PRECISIONS
    from tempo.plan.states import OPTIMIZERS
    from tempo.presets import FAMILIES, TASKS
    from tempo.utils import positive_int, positive_size

    parser = argparse.ArgumentParser(prog="python -m tempo.plan", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="bert-large", metavar="MODEL",
                        help=f"a preset ({', '.join(sorted(FAMILIES))}), a local config.json or a model folder "
                             f"(default bert-large)")
    parser.add_argument("--task", default="mlm", choices=sorted(TASKS), help="its head (default mlm)")
    lengths = parser.add_mutually_exclusive_group()
    lengths.add_argument("--seq-len", type=positive_int, default=512, help="one sequence length (default 512)")
    lengths.add_argument("--lengths", metavar="FILE", help="a sample of the data's sequence lengths, one per line")
    parser.add_argument("--budget", type=positive_size, default="24GiB",
                        help="memory for the tensors of a step (default 24GiB)")
    parser.add_argument("--device", default="h100", help=f"cuda (the current GPU) or one of {', '.join(DEVICES)}")
    parser.add_argument("--precision", default="bf16", choices=list(PRECISIONS))
    parser.add_argument("--optimizer", default="adamw", choices=list(OPTIMIZERS))
    parser.add_argument("--gpus", type=positive_int, default=1,
                        help="processes (GPUs) the step runs on, planned per rank (needs --parallel when > 1)")
    parser.add_argument("--parallel", choices=["ddp", "fsdp2"],
                        help="the engine over --gpus: ddp (replicas and gradient buckets) or fsdp2 (fully_shard per "
                             "block and the root)")
    parser.add_argument("--no-tempo", action="store_true", help="plan the model as it is (no apply_tempo)")
    parser.add_argument("--candidates", action="store_true", help="also print every recompute plan tried (with --frontier: every policy of every row)")
    parser.add_argument("--json", metavar="PATH", help="write the plan as JSON")
    parser.add_argument("--frontier", action="store_true",
                        help="the frontier table: Tempo's plans against torch's own policies (tempo.plan.frontier)")
    return parser


def _progress(start: float):
    def say(line: str) -> None:
        print(f"[tempo.plan {time.perf_counter() - start:5.1f} s] {line}", file=sys.stderr, flush=True)
    return say


def plan_record(plan: Any) -> dict[str, Any]:
    """The plan as JSON-ready data."""
    peak = plan.peak
    return {
        "model": plan.model, "device": plan.device.name, "budget_bytes": plan.budget, "precision": plan.precision,
        "optimizer": plan.optimizer, "tempo": plan.tempo, "left_stock": plan.left_stock, "recompute": plan.recompute,
        "unpadding": plan.unpadding, "seq_len": plan.seq_len, "tokens_per_step": plan.tokens_per_step,
        "buckets": [{"padded_length": p, "share": s, "sequences_per_step": n} for p, s, n in plan.buckets],
        "world_size": plan.world_size, "parallel": plan.parallel,
        "tokens_per_global_step": plan.tokens_per_global_step,
        "peak_bytes": plan.peak_bytes,
        "peak": {"weights": peak.weights, "gradients": peak.gradients, "optimizer_states": peak.optimizer_states,
                 "activations": peak.activations, "transient": peak.transient, "workspace": peak.workspace,
                 "buffers": peak.buffers, "at": peak.at},
        "projected_step_seconds": plan.step_seconds, "projected_collective_seconds": plan.collective_seconds, "projected_tokens_per_second": plan.tokens_per_second,
        "planning_seconds": plan.seconds,
        "candidates": [{"recompute": c.summary(), "tokens": c.tokens,
                        "peak_bytes": c.peak.total if c.peak else None,
                        "projected_tokens_per_second": c.tokens_per_second} for c in plan.candidates],
    }


def main(argv: Optional[list[str]] = None) -> int:
    args = _parser().parse_args(argv)
    if args.gpus > 1 and args.parallel is None:
        raise SystemExit(f"python -m tempo.plan: --gpus {args.gpus} needs --parallel ddp or --parallel fsdp2")
    if args.frontier:
        from tempo.plan.frontier import main as frontier_main

        return frontier_main((["--json", args.json] if args.json else []) + (["--details"] if args.candidates else []))
    from tempo.plan import PlanError, plan
    from tempo.plan.report import format_candidates
    from tempo.presets import FAMILIES, build_family, family_unavailable, local_config, model_on_meta
    from tempo.utils import atomic_write_text

    start = time.perf_counter()
    say = _progress(start)
    lengths: Any = read_lengths(args.lengths) if args.lengths else args.seq_len
    try:
        if args.model in FAMILIES:
            why = family_unavailable(args.model)
            if why is not None:  # a family newer than this transformers
                raise ValueError(why)
            say(f"building {args.model} ({args.task}) on the meta device")
            model = build_family(args.model, args.task)
        else:
            model = model_on_meta(local_config(args.model), args.task, args.model)
    except ValueError as err:
        raise SystemExit(f"python -m tempo.plan: --model {args.model}: {err}") from None
    try:
        result = plan(model, budget=args.budget, lengths=lengths, device=args.device, precision=args.precision,
                      optimizer=args.optimizer, tempo=not args.no_tempo, progress=say, world_size=args.gpus,
                      parallel=args.parallel)
    except PlanError as err:
        print(f"python -m tempo.plan: {err}", file=sys.stderr)
        return 2
    say("done")
    print(result)
    if args.candidates:
        print()
        print(format_candidates(result))
    if args.json:
        atomic_write_text(args.json, json.dumps(plan_record(result), indent=2) + "\n")
    return 0


__all__ = ["main", "plan_record", "read_lengths"]
