"""``python -m tempo.plan.rank_table``: plans per rank of 8 GPUs beside one GPU's
(results/parallel/table.md): Llama-3.2-1B and Qwen3-0.6B under FSDP2, BERT-large under DDP, 16-80 GiB
per GPU, on the H100 device model (tempo.plan.parallel counts a rank)."""

from __future__ import annotations

import torch

from tempo.plan.budget import PlanError


TABLE = (("llama-3.2-1b", "causal-lm", 2048, "fsdp2"), ("qwen3-0.6b", "causal-lm", 2048, "fsdp2"),
         ("bert-large", "mlm", 512, "ddp"))
TABLE_BUDGETS_GIB = (16, 24, 40, 80)
TABLE_GPUS = 8


def table(rows=TABLE, budgets=TABLE_BUDGETS_GIB, gpus: int = TABLE_GPUS, device: str = "h100",
          say=lambda line: None) -> list[dict]:
    """For each (model preset, task, sequence length, engine) and budget per GPU: the plan of one GPU
    and of one rank of ``gpus`` (tokens per GPU and per step, recompute, projected tokens/s)."""
    from tempo.plan.planner import choose, count
    from tempo.presets import build_family

    records = []
    for family, task, seq_len, engine in rows:
        model = build_family(family, task)
        say(f"{family} ({task}, s = {seq_len}): counting one GPU and one rank of {gpus} ({engine})")
        one = count(model, seq_len, device)
        many = count(model, seq_len, device, world_size=gpus, parallel=engine)
        for budget in budgets:
            record = dict(model=family, task=task, seq_len=seq_len, engine=engine, gpus=gpus, budget_gib=budget)
            for key, counted in (("one", one), ("rank", many)):
                try:
                    plan = choose(counted, f"{budget}GiB")
                except PlanError as err:
                    record[key] = {"fits": False, "why": str(err)}
                    continue
                record[key] = {"fits": True, "tokens_per_gpu": plan.tokens_per_step,
                               "tokens_per_step": plan.tokens_per_global_step,
                               "recompute": {m: plan.recompute.count(m) for m in ("none", "selective", "full")},
                               "peak_bytes": plan.peak_bytes, "buffers": plan.peak.buffers,
                               "step_seconds": plan.step_seconds, "overlapped_seconds": plan.step_seconds_overlapped,
                               "collective_seconds": plan.collective_seconds}
            records.append(record)
    return records


def format_table(records: list[dict]) -> str:
    def recompute(r: dict) -> str:
        return ", ".join(f"{n} {m}" for m, n in r["recompute"].items() if n)

    lines = ["| model, s, engine | budget per GPU | 1 GPU: tokens (recompute) | per rank of N: tokens per GPU "
             "(recompute) | per step over N | projected tokens/s over N (collectives hidden - not) |",
             "|---|---:|---|---|---:|---|"]
    for r in records:
        one, rank = r["one"], r["rank"]
        first = f"{one['tokens_per_gpu']:,} ({recompute(one)})" if one["fits"] else "does not fit"
        if rank["fits"]:
            speed = (f"{rank['tokens_per_step'] / rank['overlapped_seconds']:,.0f} - "
                     f"{rank['tokens_per_step'] / rank['step_seconds']:,.0f}" if rank["step_seconds"] else "-")
            cells = [f"{rank['tokens_per_gpu']:,} ({recompute(rank)})", f"{rank['tokens_per_step']:,}", speed]
        else:
            cells = ["does not fit", "-", "-"]
        lines.append(f"| {r['model']} {r['task']}, {r['seq_len']}, {r['engine']} x {r['gpus']} | "
                     f"{r['budget_gib']} GiB | {first} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    import argparse
    import json
    import sys
    import time
    from pathlib import Path

    from tempo.utils import atomic_write_text, git_commit

    parser = argparse.ArgumentParser(prog="python -m tempo.plan.rank_table",
                                     description="Plans per rank for 8 GPUs beside one GPU's (H100, bf16, AdamW)")
    parser.add_argument("--out", default="results/parallel", help="folder for table.md and table.json")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    records = table(say=lambda line: print(f"[{time.perf_counter() - started:6.1f} s] {line}", file=sys.stderr))
    header = (f"Plans per rank (`python -m tempo.plan.rank_table`, commit {git_commit()['commit'][:7]}, "
              f"torch {torch.__version__}): H100 80GB device model, bf16, AdamW, Tempo applied; tokens are real "
              f"tokens per GPU (each rank's batch). Projections on fake tensors, not measurements; collectives at "
              f"tempo.plan.parallel.INTERCONNECT's NVLink bandwidth.\n\n")
    atomic_write_text(Path(args.out) / "table.md", header + format_table(records))
    atomic_write_text(Path(args.out) / "table.json", json.dumps(records, indent=1) + "\n")
    print(header + format_table(records))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
