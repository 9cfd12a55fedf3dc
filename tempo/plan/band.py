"""``python -m tempo.plan.band``: the plan's predicted peak against the real peak of a real CPU step.

The band (docs/plan.md): on device "cpu" the predicted peak is within [1, 1.05] of the real one.
For every family of ``tempo.presets.FAMILIES`` at a small size (``small_config``), each head it has
(``HEADS``), fp32 and bf16 (fp32 weights, the forward and loss under CPU autocast to bf16: what the
plan's ``precision="bf16"`` counts), one length and mixed lengths (``LENGTHS``), and the devices
"cpu" and "h100", ``run`` writes table.md and table.json with three numbers per case:

  * predicted: ``tempo.plan.count`` for the device, ``choose`` at a budget with room to spare (no
    recompute), ``Counted.peak_at`` the step's tokens. For "h100" less the cuBLAS workspaces (64 MiB
    that no CPU counter sees).
  * counted: ``LiveStorages`` (below) over the second AdamW step of the real model with the plan
    applied, on the CPU. For "h100" each storage rounded to 512 bytes as the CUDA allocator rounds,
    but the ops are still the CPU's (no fused attention, bool dropout masks or foreach AdamW): not
    like for like, shown for reference; the band is held on "cpu".
  * MemTracker: ``torch.distributed._tools.mem_tracker.MemTracker`` over the same second step of a
    fresh copy, the batch tracked too. It holds extra: its module hooks keep one more gradient of a
    block's output through that block's backward, so where the peak is there it reads higher than
    the step itself allocates (by one [tokens, h] gradient).

The step is the one the plan counts (tempo.plan.trace.trace_step): the model's output and loss are
held through backward (the forward and the loss under autocast for bf16), then AdamW steps and the
gradients are dropped. The batch is the one the plan is for (docs/plan.md, "Tokens, not sequences"):
a model that takes padding-free batches gets the sequences packed back to back in one row with
``position_ids`` restarting at each, and is predicted at its real tokens; one that cannot (a
per-sequence head, sliding-window layers) gets them padded to the plan's length with an attention
mask, predicted at sequences x that length. No step keeps a KV cache (``use_cache=False`` wherever
the model takes it): training keeps none.
"""

from __future__ import annotations

import argparse
import copy
import gc
import inspect
import json
import sys
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch
from torch import nn

from tempo.plan.live import LiveStorages

BAND = (1.0, 1.05)
MIXED = [30, 64, 100, 17, 128, 50, 77, 128, 9, 112]
LENGTHS = {"one": [128] * 4, "mixed": MIXED}
PRECISIONS = ("fp32", "bf16")
DEVICES = ("cpu", "h100")
BUDGET = "64GiB"  # room to spare for every small model: the plan is no recompute
# head -> transformers' auto class; "encoder" is the bare model, trained on tempo.plan's default loss
# (the mean square of its last hidden state in fp32, tempo.plan.trace.default_loss).
HEADS = {"mlm": "AutoModelForMaskedLM", "causal-lm": "AutoModelForCausalLM",
         "classification": "AutoModelForSequenceClassification", "encoder": "AutoModel"}
# Small sizes: 3 blocks of width 64 (4 heads), 500 tokens, 512 positions; per family what its
# geometry needs to stay itself (kv heads, head_dim, a window shorter than the longest sequence).
SMALL = dict(hidden_size=64, num_hidden_layers=3, num_attention_heads=4, intermediate_size=256, vocab_size=500,
             max_position_embeddings=512)
SMALL_FIELDS = {
    "deberta-v3-large": dict(position_buckets=64),
    "modernbert-large": dict(intermediate_size=96, local_attention=64),
    "mpnet-base": dict(max_position_embeddings=514),  # positions start after padding_idx: 512 usable
    "eurobert-210m": dict(num_key_value_heads=4),
    "embeddinggemma-300m": dict(num_key_value_heads=1, head_dim=16, query_pre_attn_scalar=16, intermediate_size=96,
                                sliding_window=64),
    "llama-3.2-1b": dict(num_key_value_heads=2, head_dim=16, intermediate_size=128, pad_token_id=0),
    "qwen3-0.6b": dict(num_key_value_heads=2, head_dim=16, intermediate_size=128, pad_token_id=0),
}
# The quick run and tests/test_plan_band.py, (family, head, precision, lengths): an encoder MLM, one
# with sliding-window layers (padded), a decoder LM, a per-sequence head with DeBERTa's attention, a
# bare encoder; each precision and each lengths setting at least twice.
QUICK = [("bert-large", "mlm", "fp32", "mixed"), ("bert-large", "mlm", "bf16", "one"),
         ("modernbert-large", "mlm", "fp32", "mixed"), ("llama-3.2-1b", "causal-lm", "fp32", "one"),
         ("llama-3.2-1b", "causal-lm", "bf16", "mixed"), ("deberta-v3-large", "classification", "fp32", "mixed"),
         ("deberta-v3-large", "classification", "bf16", "one"), ("eurobert-210m", "encoder", "fp32", "one")]


class Unavailable(Exception):
    """A case that cannot run, with the one-line reason the table records."""


# -- the real peak --------------------------------------------------------------------------------
def real_batch(model: nn.Module, lengths: Sequence[int], packed: bool, seq_len: int) -> dict:
    """The step's inputs (module docstring): packed with ``position_ids``, or padded to ``seq_len``
    with an attention mask; labels as the head takes them (none for a bare model; a masked LM's
    ~15 % of positions, tempo.plan.probe.masked_lm_labels)."""
    from tempo.plan.probe import masked_lm_labels

    generator = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    name = type(model).__name__
    per_sequence = name.endswith("ForSequenceClassification")
    has_head = "For" in name or "Head" in name
    masked = name.endswith("ForMaskedLM")  # a collator's ~15 % of positions labelled
    extra = {"use_cache": False} if "use_cache" in inspect.signature(model.forward).parameters else {}
    if packed:
        ids = torch.randint(3, vocab, (1, sum(lengths)), generator=generator)
        positions = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)
        labels = {"labels": masked_lm_labels(ids) if masked else ids.clone()} if has_head else {}
        return {"input_ids": ids, "position_ids": positions, **labels, **extra}
    ids = torch.randint(3, vocab, (len(lengths), seq_len), generator=generator)
    mask = (torch.arange(seq_len) < torch.tensor(lengths).unsqueeze(1)).long()
    labels = {}
    if has_head:
        labels["labels"] = (torch.zeros(len(lengths), dtype=torch.long) if per_sequence
                            else (masked_lm_labels(ids) if masked else ids).masked_fill(mask == 0, -100))
    return {"input_ids": ids, "attention_mask": mask, **labels, **extra}


def _step(model: nn.Module, optimizer: torch.optim.Optimizer, batch: dict, precision: str):
    from tempo.plan.trace import default_loss

    def step() -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
            out = model(**batch)
            loss = default_loss(out)
        loss.backward()  # the output is held through backward, as the plan counts it
        del out, loss
        optimizer.step()
        optimizer.zero_grad()
    return step


def _prepared(model: nn.Module, plan: Any, lengths: Sequence[int]):
    from tempo.plan.confirm import optimizer_factory

    model = plan.apply(copy.deepcopy(model)).train()
    optimizer = optimizer_factory(plan.optimizer, "cpu")(model.parameters())
    batch = real_batch(model, lengths, plan.unpadding, plan.seq_len)
    return model, optimizer, batch, _step(model, optimizer, batch, plan.precision)


def count_step(model: nn.Module, plan: Any, lengths: Sequence[int]) -> LiveStorages:
    """The counter (``LiveStorages``) of the second AdamW step of a copy of ``model`` with ``plan``
    applied, after the step."""
    model, optimizer, batch, step = _prepared(model, plan, lengths)
    torch.manual_seed(0)
    step()
    gc.collect()
    states = [v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]
    inputs = [v for v in batch.values() if isinstance(v, torch.Tensor)]
    counter = LiveStorages([*model.parameters(), *model.buffers(), *states, *inputs])
    with counter:
        step()
    return counter


def memtracker_peak(model: nn.Module, plan: Any, lengths: Sequence[int]) -> int:
    """MemTracker's peak over the second AdamW step of a copy of ``model`` with ``plan`` applied."""
    from torch.distributed._tools.mem_tracker import MemTracker

    model, optimizer, batch, step = _prepared(model, plan, lengths)
    torch.manual_seed(0)
    step()
    gc.collect()
    tracker = MemTracker()
    # The batch too: made before the tracker starts, it would be missed (the counter counts it).
    tracker.track_external(model, optimizer, *(v for v in batch.values() if isinstance(v, torch.Tensor)))
    with warnings.catch_warnings():
        # Its module tracker warns for every backward hook of a module gone before backward.
        warnings.filterwarnings("ignore", message="Module is None", category=UserWarning)
        with tracker:
            step()
    return int(max(v["Total"] for v in tracker.get_tracker_snapshot("peak").values()))


# -- the cases ------------------------------------------------------------------------------------
def small_config(family: str, head: str) -> Any:
    """transformers' config of ``family`` at its preset's fields with ``SMALL`` and the family's
    ``SMALL_FIELDS`` over them; a causal-LM head gets ``is_decoder`` (BERT's LM head is causal only
    then). ``Unavailable`` when the installed transformers lacks the config class."""
    import transformers

    from tempo.presets import FAMILIES, family_unavailable

    why = family_unavailable(family)
    if why is not None:
        raise Unavailable(why)
    _label, cls_name, fields = FAMILIES[family]
    extra = {"is_decoder": True} if head == "causal-lm" else {}
    return getattr(transformers, cls_name)(**{**fields, **SMALL, **SMALL_FIELDS.get(family, {}), **extra})


def small_model(family: str, head: str) -> nn.Module:
    """The small model of ``family`` with ``head`` (a key of ``HEADS``), real fp32 weights seeded 0;
    ``Unavailable`` when the family has no such head in the installed transformers."""
    import transformers

    if head not in HEADS:
        raise ValueError(f"unknown head {head!r}; valid: {', '.join(HEADS)}")
    config = small_config(family, head)
    auto = getattr(transformers, HEADS[head])
    if type(config) not in auto._model_mapping:
        raise Unavailable(f"transformers {transformers.__version__} has no {head} head for {type(config).__name__}")
    torch.manual_seed(0)
    return auto.from_config(config)


@dataclass
class Row:
    """One case of the table: the three peaks in bytes, or ``reason`` (the case cannot run: no such
    head or class in the installed transformers) or ``failed`` (the planner or the step raised: the
    exception's first line) instead."""

    family: str
    head: str
    dtype: str
    lengths: str
    device: str
    model: Optional[str] = None
    packed: Optional[bool] = None  # the batch: packed (padding-free, predicted at real tokens) or padded
    predicted: Optional[int] = None
    counted: Optional[int] = None
    memtracker: Optional[int] = None
    reason: Optional[str] = None
    failed: Optional[str] = None

    @property
    def to_counted(self) -> Optional[float]:
        return self.predicted / self.counted if self.predicted and self.counted else None

    @property
    def to_memtracker(self) -> Optional[float]:
        return self.predicted / self.memtracker if self.predicted and self.memtracker else None

    @property
    def in_band(self) -> bool:
        """predicted/counted within ``BAND`` (False when not measured)."""
        ratio = self.to_counted
        return ratio is not None and BAND[0] <= ratio <= BAND[1]


def predicted_peak(model: nn.Module, lengths: Sequence[int], device: str, precision: str,
                   budget: str = BUDGET) -> tuple[int, Any]:
    """(the predicted peak of the step in bytes, the plan): module docstring. ValueError when the
    plan for ``budget`` recomputes anything (the real step would not be the step predicted)."""
    import tempo.plan as tp

    counted = tp.count(model, lengths, device=device, precision=precision, optimizer="adamw")
    plan = tp.choose(counted, budget)
    if set(plan.recompute) != {"none"}:
        raise ValueError(f"the plan for {type(model).__name__} at {budget} recomputes ({plan.recompute}); "
                         f"the band is of steps without recompute")
    tokens = sum(lengths) if plan.unpadding else len(lengths) * plan.seq_len
    peak = counted.peak_at(plan.recompute, tokens)
    return peak.total - peak.cublas_workspace, plan


def run_case(family: str, head: str, precision: str, lengths: str, devices: Sequence[str] = DEVICES,
             memtracker: bool = True) -> list[Row]:
    """One row per device for the small model of ``family`` with ``head``, ``precision`` and the
    lengths ``LENGTHS[lengths]``: one real step serves every device (counted at each one's rounding);
    ``memtracker``: MemTracker's peak of it too (it does not round)."""
    from tempo.plan.budget import resolve_device

    rows = [Row(family, head, precision, lengths, device) for device in devices]
    try:
        model = small_model(family, head)
    except Unavailable as exc:
        for row in rows:
            row.reason = str(exc)
        return rows
    sample = LENGTHS[lengths]
    steps: dict = {}  # the real step per (packed, length, apply_tempo's options): every device's plan has the same
    for row in rows:
        row.model = type(model).__name__
        try:
            predicted, plan = predicted_peak(model, sample, row.device, precision)
            key = (plan.unpadding, plan.seq_len, repr(plan.tempo_options))
            if key not in steps:
                steps[key] = (count_step(model, plan, sample),
                              memtracker_peak(model, plan, sample) if memtracker else None)
        except Exception as exc:  # noqa: BLE001 - a survey: the row records the failure, summary() lists it
            row.failed = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            continue
        counter, row.memtracker = steps[key]
        row.packed, row.predicted = plan.unpadding, predicted
        row.counted = counter.peak(resolve_device(row.device).round_to)
    return rows


def families() -> list[str]:
    """The families of ``FAMILIES``, one per config class (MiniLM is BERT: the same small model)."""
    from tempo.presets import FAMILIES

    seen: dict[str, str] = {}
    for family, (_label, cls_name, _fields) in FAMILIES.items():
        seen.setdefault(cls_name, family)
    return list(seen.values())


def cases(quick: bool = False) -> list[tuple[str, str, str, str]]:
    """(family, head, precision, lengths) of a run: ``QUICK``, or every family x head x precision x lengths."""
    if quick:
        return list(QUICK)
    return [(f, h, p, n) for f in families() for h in HEADS for p in PRECISIONS for n in LENGTHS]


# -- the table ------------------------------------------------------------------------------------
NOTES = [
    "predicted: tempo.plan.count for the device, chosen at 64 GiB (no recompute), Counted.peak_at the step's tokens; "
    "for h100 less the 64 MiB cuBLAS workspaces, which no CPU counter sees.",
    "batch: packed (padding-free: one row, position_ids restarting; predicted at the real tokens) or padded "
    "(to the plan's length, with an attention mask; predicted at sequences x length), as the plan chose.",
    "counted: the live storages of the second AdamW step of the real model on the CPU (tempo/plan/band.py, "
    "LiveStorages: each storage once, no module hooks). The band [1, 1.05] is held on cpu.",
    "h100: the prediction uses the H100 device model (its autocast policies, fused attention, bool dropout masks, "
    "foreach AdamW, 512-byte rounding); the counted step is still the CPU's, each storage rounded to 512 bytes: "
    "not like for like, shown for reference.",
    "MemTracker: torch.distributed._tools.mem_tracker.MemTracker over the same second step (the batch tracked too). "
    "It holds extra: its module hooks keep one more gradient of a block's output through that block's backward, "
    "so where the peak is there it reads above the counted bytes (predicted/MemTracker below predicted/counted).",
]


def _ratio(value: Optional[float]) -> str:
    return "" if value is None else f"{value:.4f}"


def _bytes(value: Optional[int]) -> str:
    return "" if value is None else f"{value:,}"


def summary(rows: list[Row]) -> list[str]:
    """Lines: rows measured, that cannot run and that failed; min/max predicted/counted on "cpu"
    per dtype; every cpu row outside the band or failed."""
    measured = [r for r in rows if r.to_counted is not None]
    failed = [r for r in rows if r.failed]
    lines = [f"{len(rows)} rows: {len(measured)} measured, {sum(1 for r in rows if r.reason)} that cannot run, "
             f"{len(failed)} failed."]
    for dtype in PRECISIONS:
        ratios = [r.to_counted for r in measured if r.device == "cpu" and r.dtype == dtype]
        if ratios:
            lines.append(f"cpu, {dtype}: predicted/counted {min(ratios):.4f} to {max(ratios):.4f} "
                         f"over {len(ratios)} rows.")
    outside = [f"{r.family} {r.head} {r.dtype} {r.lengths} ({r.to_counted:.4f})"
               for r in measured if r.device == "cpu" and not r.in_band]
    lines.append(f"cpu rows outside [{BAND[0]}, {BAND[1]}]: {', '.join(outside) or 'none'}.")
    by_model: dict = {}  # one line per model and error: a planner error repeats over dtypes, lengths and devices
    for r in failed:
        by_model.setdefault((r.family, r.head, r.failed), []).append(f"{r.dtype} {r.lengths} {r.device}")
    lines.append("Failed: " + ("; ".join(f"{family} {head} ({', '.join(where)}): {error}"
                                         for (family, head, error), where in by_model.items()) or "none") + ".")
    return lines


def format_table(rows: list[Row], header: dict) -> str:
    """table.md: the header (command, time, versions, commit), the notes, the summary, one line per row."""
    dirty = " with uncommitted changes" if header["dirty"] else ""
    out = ["# The plan's predicted peak against the real peak of a CPU step", "",
           f"Command: `{header['command']}` ({header['seconds']:.0f} s; torch {header['torch']}, transformers "
           f"{header['transformers']}; commit {header['commit']}{dirty}).", "",
           f"Every family of tempo/presets.py at a small size (tempo/plan/band.py, SMALL: 3 blocks, h = 64, 4 heads, "
           f"500 tokens; MiniLM is BERT, the same small model: bert-large's rows are its), every head it has, fp32 "
           f"and bf16 (CPU autocast), lengths one = {LENGTHS['one']} and mixed = {LENGTHS['mixed']}.", "",
           *(f"- {note}" for note in NOTES), "", *summary(rows), "",
           "| family | head | dtype | lengths | device | batch | predicted bytes | counted bytes | MemTracker bytes "
           "| predicted/counted | predicted/MemTracker |",
           "|---|---|---|---|---|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        case = f"| {r.family} | {r.head} | {r.dtype} | {r.lengths} | {r.device} |"
        if r.reason or r.failed:
            out.append(f"{case} {r.reason or 'failed: ' + r.failed} | | | | | |")
        else:
            out.append(f"{case} {'packed' if r.packed else 'padded'} | {_bytes(r.predicted)} | {_bytes(r.counted)} "
                       f"| {_bytes(r.memtracker)} | {_ratio(r.to_counted)} | {_ratio(r.to_memtracker)} |")
    return "\n".join(out) + "\n"


def run(todo: Sequence[tuple[str, str, str, str]], out: Optional[Path] = None, command: str = "",
        progress: Optional[Callable[[str], None]] = None) -> list[Row]:
    """The rows of every case of ``todo`` (``cases``); with ``out``, table.md and table.json written
    there atomically, ``command`` in their header."""
    import transformers

    from tempo.utils import atomic_write_text, git_commit

    started = time.perf_counter()
    rows: list[Row] = []
    for case in todo:
        if progress is not None:
            progress(" ".join(case))
        rows += run_case(*case)
    if out is not None:
        commit = git_commit()
        header = {"command": command, "seconds": round(time.perf_counter() - started), "torch": torch.__version__,
                  "transformers": transformers.__version__, "commit": (commit["commit"] or "unknown")[:7],
                  "dirty": bool(commit["dirty"]), "band": list(BAND), "notes": NOTES}
        records = [{**asdict(r), "predicted_to_counted": r.to_counted, "predicted_to_memtracker": r.to_memtracker}
                   for r in rows]
        atomic_write_text(Path(out) / "table.json", json.dumps({"header": header, "rows": records}, indent=1) + "\n")
        atomic_write_text(Path(out) / "table.md", format_table(rows, header))
    return rows


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tempo.plan.band", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help=f"only {len(QUICK)} cases (QUICK): a few minutes")
    parser.add_argument("--out", type=Path, default=Path("results/plan_band"),
                        help="the folder table.md and table.json are written to")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    command = "python -m tempo.plan.band" + (" --quick" if args.quick else "") + f" --out {args.out}"
    rows = run(cases(args.quick), args.out, command,
               lambda line: print(f"[band {time.perf_counter() - start:6.1f} s] {line}", file=sys.stderr, flush=True))
    print("\n".join(summary(rows)))
    return 0


__all__ = ["BAND", "DEVICES", "HEADS", "LENGTHS", "NOTES", "PRECISIONS", "QUICK", "LiveStorages", "Row", "Unavailable",
           "cases", "count_step", "families", "format_table", "main", "memtracker_peak", "predicted_peak",
           "real_batch", "run", "run_case", "small_config", "small_model", "summary"]

if __name__ == "__main__":
    raise SystemExit(main())
