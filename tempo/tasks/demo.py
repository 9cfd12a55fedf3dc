"""The main job: pretrain a small BERT at s = 512 with the original layers and with Tempo, and compare.

    python -m tempo                  # everything under out/demo: about 2 minutes on 2 idle CPU cores
    python -m tempo --quick          # a smoke run: 300 documents, s = 128, 10 steps per run (~30 s)
    python -m tempo --verbose        # also the trainer's own output and command lines

1. writes the project's own generated corpus (no download) in DLE's text layout, four invented
   encyclopedia entries to an article, so that sequences at s = 512 are about half padding, as
   Wikipedia's are in BERT's phase 2 (the share is measured on the shards and printed);
2. trains a WordPiece vocabulary on it and builds DLE-format HDF5 shards at s = 512;
3. plans each run for the memory budget (``--memory_budget``, tempo.plan on fake tensors): the
   tokens per micro-batch that fit it, the recompute that needs, the predicted peak. Three runs of
   the tiny BERT config (2 layers, h = 128): the original layers on the padded batch (DLE's way:
   every sequence padded to s); every Tempo layer on the real tokens only (``--tempo``: the
   trainers' default unpadding, efficient attention, fused dropout-add-LayerNorm); and every Tempo
   layer on the padded batch, which measures what Tempo's layers cost on this device by themselves;
4. pretrains the three with run_pretraining.py, each in its own process, on the same data with the
   same seed, each at its plan's tokens per micro-batch (``--max_tokens``) and all taking the same
   optimizer steps: each step holds about as many real tokens as the largest plan's micro-batch,
   so a run with a smaller plan takes it in several micro-batches (``--gradient_accumulation_steps``):
   the same training in the same memory, the losses comparable at equal steps and tokens seen;
5. prints what a user would choose Tempo for: the tokens per micro-batch each plan fits (and the
   recompute it needs), the loss (the same), and real tokens per second, with what Tempo's layers
   cost on this device by themselves (the padded Tempo run); then the table; then what a GPU changes.

Runs on the GPU when there is one (bf16), else on the CPU (fp32). ``--steps``, ``--seq_len`` and
``--memory_budget`` change the runs; ``--quick`` makes every default small (a smoke run, not a
result). On the CPU each run sizes torch's threads to the cores other work leaves free
(tempo.train.runtime.cpu_threads_for_training; OMP_NUM_THREADS overrides): OpenMP threads beyond them made
the Tempo run up to 20x slower on 2 shared cores, and flipped the comparison.
SIGTERM stops the running run (it writes no checkpoint: the demo keeps none) and the demo.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Optional

from tempo.bert.config import CONFIGS_DIR
from tempo.train.dllog import read_dllog

PROG = "python -m tempo"
DOCS_PER_ARTICLE = 4  # generated documents joined into one article: ~50 % padding at s = 512
# About 2 minutes on 2 idle CPU cores; the budget sets each run's micro-batch, the steps how long it trains.
DEFAULTS = dict(steps=45, seq_len=512, documents=1500, memory_budget="128MiB")
QUICK = dict(steps=10, seq_len=128, documents=300, memory_budget="32MiB")  # a smoke run


@dataclass(frozen=True)
class Variant:
    key: str  # run directory, results key
    name: str  # table row
    title: str  # "run k of n: <title>"
    flags: tuple[str, ...]
    runs_plan_of: Optional[str] = None  # None: its own plan; else that variant's micro-batches


VARIANTS = (
    Variant("original", "original (padded)", "the original layers on the padded batch (DLE's way)",
            ("--no-tempo", "--attention", "eager", "--no-unpad")),
    Variant("tempo", "Tempo (real tokens only)",
            "every Tempo layer on the real tokens only (--tempo: the trainers' default)", ("--tempo", "--unpad")),
    Variant("tempo_padded", "Tempo (padded)",
            "every Tempo layer on the original's padded micro-batches (what the layers alone cost here)",
            ("--tempo", "--no-unpad"), runs_plan_of="original"),
)


class Stopped(Exception):
    """SIGTERM arrived (while no run was going, or it ended the running one)."""


class _SigtermForwarder:
    """On SIGTERM: pass it to the running run, which stops at its next step; between runs, stop."""

    def __init__(self) -> None:
        self.child: Optional[subprocess.Popen] = None
        self.requested = False
        self._previous: Any = None

    def __enter__(self) -> "_SigtermForwarder":
        self._previous = signal.signal(signal.SIGTERM, self._handle)
        return self

    def __exit__(self, *exc: Any) -> None:
        signal.signal(signal.SIGTERM, self._previous)

    def _handle(self, signum: int, frame: Any) -> None:  # noqa: ARG002 - signal handler signature
        self.requested = True
        if self.child is not None and self.child.poll() is None:
            self.child.send_signal(signal.SIGTERM)
        else:
            raise Stopped()


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


# -- data -------------------------------------------------------------------------------------
def write_articles(text_dir: Path, num_documents: int, seed: int, docs_per_article: int = DOCS_PER_ARTICLE,
                   num_files: int = 4) -> list[Path]:
    """The generated corpus (tempo.bert.data.sample_corpus), ``docs_per_article`` documents to an
    article, in DLE's text layout (one sentence per line, a blank line between articles)."""
    from tempo.bert.data.sample_corpus import generate_documents
    from tempo.utils import atomic_write_text

    docs = generate_documents(num_documents, seed)
    articles = [[s for doc in docs[i:i + docs_per_article] for s in doc] for i in range(0, len(docs), docs_per_article)]
    text_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for k in range(min(num_files, len(articles))):
        path = text_dir / f"articles_{k:02d}.txt"
        atomic_write_text(path, "\n\n".join("\n".join(a) for a in articles[k::num_files]) + "\n")
        paths.append(path)
    return paths


def build_dataset(work: Path, num_documents: int, vocab_size: int, seq_len: int, seed: int) -> tuple[Path, Path]:
    """(shard directory, vocab file), built once per corpus size, seed and length under ``work``."""
    from tempo.bert.data.create_pretraining_data import create_shards
    from tempo.bert.data.tokenization import train_wordpiece_vocab

    data = work / f"data_d{num_documents}_seed{seed}"
    text_dir, shard_dir, vocab_file = data / "articles", data / f"shards_s{seq_len}", data / f"vocab_{vocab_size}.txt"
    if not vocab_file.exists() or not any(shard_dir.glob("*.hdf5")):
        text_files = write_articles(text_dir, num_documents, seed)
        if not vocab_file.exists():
            train_wordpiece_vocab(text_files, vocab_size, vocab_file)
        if not any(shard_dir.glob("*.hdf5")):
            create_shards(text_dir, shard_dir, vocab_file, max_seq_length=seq_len,
                          max_predictions_per_seq=max(2, seq_len * 15 // 100), dupe_factor=2,
                          num_shards=4, random_seed=seed)
    return shard_dir, vocab_file


def shard_padding(shard_dir: Path) -> tuple[int, float]:
    """(sequences, share of padding tokens) over the shards' input masks."""
    import h5py

    rows = real = total = 0
    for path in sorted(shard_dir.glob("*.hdf5")):
        with h5py.File(path, "r") as fh:
            mask = fh["input_mask"][:]
        rows += mask.shape[0]
        real += int(mask.sum())
        total += mask.size
    return rows, 1 - real / max(1, total)


def write_demo_config(work: Path, vocab_file: Path, base_config: Path) -> Path:
    """The tiny BERT config with the vocabulary we just trained."""
    config = json.loads(base_config.read_text())
    with open(vocab_file, encoding="utf-8") as fh:
        config["vocab_size"] = sum(1 for line in fh if line.strip())
    path = work / "bert_demo_config.json"
    path.write_text(json.dumps(config, indent=2) + "\n")
    return path


# -- plans ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RunPlan:
    """What the planner gave one run for the budget, and how the run takes the common step."""

    tokens: int  # per micro-batch: real tokens (unpadded), or the padded batch (sequences x s)
    unpadded: bool
    recompute: tuple[str, ...]  # per Transformer block, as tempo.plan chose it
    peak: int  # the predicted peak, bytes
    seq_len: int  # s, what a padded run pads every sequence to
    mean_length: float  # real tokens of the data's average sequence
    full_recompute_tokens: int = 0  # what full recompute in every block would fit instead (0: nothing)
    micro_batches: int = 1  # per optimizer step (gradient accumulation); ``equal_steps`` sets it

    @property
    def sequences(self) -> int:
        """Sequences per micro-batch of a padded run."""
        return self.tokens // self.seq_len

    def real(self, tokens: int) -> float:
        """Real tokens a micro-batch of ``tokens`` holds on average (padded: whole sequences of s)."""
        return float(tokens) if self.unpadded else tokens // self.seq_len * self.mean_length

    @property
    def real_tokens(self) -> float:
        return self.real(self.tokens)


def trainer_model(config_path: Path, variant: Variant) -> Any:
    """The model run_pretraining.py builds for ``variant``'s flags (its own parser and Tempo choice)."""
    from tempo.bert.config import BertConfig
    from tempo.bert.model import BertForPreTraining
    from tempo.tasks.pretrain import build_parser
    from tempo.train.flags import tempo_choice_from_args

    args = build_parser().parse_args(["--config_file", str(config_path), "--output_dir", "-", *variant.flags])
    config = BertConfig.from_json_file(config_path).with_gelu(args.gelu_approximate)
    return BertForPreTraining(config, tempo_choice_from_args(args), unpad=args.unpad)


def plan_run(variant: Variant, config_path: Path, lengths: Any, seq_len: int, budget: str,
             on_gpu: bool) -> RunPlan:
    """The plan of one run for ``budget`` (tempo.plan, as ``--max_tokens auto`` asks it: the model as the
    trainer builds it, tempo=False, LAMB). A padded run is planned at s, the length it pads to; the
    unpadded run on the data's lengths. A plan that recomputes is refused: the trainer's runs do not."""
    import numpy as np

    import tempo.plan as tp

    model = trainer_model(config_path, variant)
    unpadded = "--unpad" in variant.flags
    try:
        counted = tp.count(model, lengths if unpadded else seq_len, device="cuda" if on_gpu else "cpu",
                           precision="bf16" if on_gpu else "fp32", optimizer="lamb", tempo=False)
        plan = tp.choose(counted, budget)
    except tp.PlanError as exc:
        raise SystemExit(f"{PROG}: --memory_budget {budget}: {variant.name}: {exc}") from None
    if set(plan.recompute) != {"none"}:
        least = counted.peak_at(("none",) * counted.blocks, counted.floor_tokens).total
        raise SystemExit(f"{PROG}: --memory_budget {budget}: the plan of {variant.name} recomputes "
                         f"({', '.join(plan.recompute)}), which the demo's runs do not do: pass at least "
                         f"{math.ceil(least / 2**20)}MiB")
    full = (counted.candidate(("full",) * counted.blocks, plan.budget).tokens
            if "full" in counted.usable else 0)
    return RunPlan(plan.tokens_per_step, unpadded, tuple(plan.recompute), plan.peak_bytes, seq_len,
                   float(np.mean(lengths)), full)


def equal_steps(plans: dict[str, RunPlan]) -> dict[str, RunPlan]:
    """Every run takes the same optimizer step: about the real tokens of the largest micro-batch, in
    as many of its own micro-batches as that takes (at least one)."""
    step = max(p.real_tokens for p in plans.values())
    return {key: replace(p, micro_batches=max(1, math.floor(step / p.real_tokens + 0.5))) for key, p in plans.items()}


def plan_runs(config_path: Path, shard_dir: Path, seq_len: int, budget: str, on_gpu: bool) -> dict[str, RunPlan]:
    """Each variant's plan for ``budget``, on the first shard's lengths (as ``--max_tokens auto``); a
    variant that runs another's plan gets that one (the same micro-batches, the same steps)."""
    from tempo.bert.data.pretraining_dataset import list_shards
    from tempo.bert.data.pretraining_dataset import shard_lengths

    lengths = shard_lengths(list_shards(shard_dir)[0])
    plans = equal_steps({v.key: plan_run(v, config_path, lengths, seq_len, budget, on_gpu)
                         for v in VARIANTS if v.runs_plan_of is None})
    return {v.key: plans[v.runs_plan_of or v.key] for v in VARIANTS}


def _tokens(plan: RunPlan) -> str:
    if plan.unpadded:
        return f"{plan.tokens:,} real tokens"
    return f"{plan.tokens:,} tokens ({plan.sequences} sequences of {plan.seq_len})"


def format_plans(plans: dict[str, RunPlan], budget: str, steps: int, seconds: float) -> str:
    """The plans, one line each, and the step every run takes."""
    planned = [v for v in VARIANTS if v.runs_plan_of is None]
    width = max(len(v.name) for v in planned) + 1
    lines = [f"plans for a {budget} budget (tempo.plan: weights, gradients, LAMB states and activations, counted "
             f"on fake tensors in {seconds:.0f} s), per micro-batch:"]
    for v in planned:
        p = plans[v.key]
        recompute = "no recompute" if set(p.recompute) == {"none"} else f"recompute {', '.join(p.recompute)}"
        lines.append(f"  {(v.name + ':').ljust(width)}  {_tokens(p)}, {recompute}, predicted peak {_mib(p.peak)}")
    step = max(p.real_tokens for p in plans.values())
    counts = ", ".join(f"{v.name} in {_plural(plans[v.key].micro_batches, 'micro-batch')}" for v in planned)
    lines.append(f"every run takes the same {_plural(steps, 'optimizer step')} of about {step:,.0f} real tokens: "
                 f"{counts}")
    return "\n".join(lines)


# -- runs -------------------------------------------------------------------------------------
def run_command(variant: Variant, plan: RunPlan, work: Path, shard_dir: Path, config: Path, vocab: Path,
                args: argparse.Namespace, on_gpu: bool, progress_bar: bool) -> tuple[list[str], Path]:
    out_dir = work / f"run_{variant.key}"
    log = out_dir / "dllogger.json"
    cmd = [sys.executable, "-m", "tempo.tasks.pretrain",
           "--input_dir", str(shard_dir), "--config_file", str(config), "--vocab_file", str(vocab),
           "--output_dir", str(out_dir), "--json-summary", str(log),
           "--max_seq_length", str(args.seq_len), "--max_predictions_per_seq", str(max(2, args.seq_len * 15 // 100)),
           "--max_tokens", str(plan.tokens), "--gradient_accumulation_steps", str(plan.micro_batches),
           "--learning_rate", str(args.lr),
           "--max_steps", str(args.steps), "--warmup_proportion", "0.1", "--seed", str(args.seed),
           "--log_freq", "1", "--num_steps_per_checkpoint", str(args.steps),
           "--num_workers", "0", "--skip_checkpoint", *variant.flags]
    if not plan.unpadded:  # DLE's way: every sequence padded to s (the plan counted it so)
        cmd += ["--pad_to_multiple_of", str(args.seq_len)]
    if not progress_bar:
        cmd.append("--disable_progress_bar")
    if on_gpu:
        cmd.append("--bf16")
    return cmd, log


def tail_loss(losses: list[float]) -> tuple[float, int]:
    """(mean, count) of the last fifth of a run's step losses (at least one step): the loss a run
    ends at, less noisy than its last step. NaN and 0 when the run logged no loss."""
    tail = losses[-max(1, len(losses) // 5):]
    return (sum(tail) / len(tail) if tail else float("nan")), len(tail)


# The trainer's lines on its CPU threads (tempo.train.runtime.CpuThreads): its choice, then each change.
_THREADS_LINE = re.compile(r"^CPU threads: (\d+)(?: -> (\d+))?", re.MULTILINE)


def cpu_threads(output: str) -> list[int]:
    """The thread counts a run's output says it used, in order (empty: not said, e.g. on a GPU)."""
    used = []
    for match in _THREADS_LINE.finditer(output):
        used.append(int(match.group(2) or match.group(1)))
    return used


def _threads(used: list[int]) -> str:
    if not used:
        return ""
    low, high = min(used), max(used)
    if low == high:
        return f" on {_plural(low, 'thread')}"
    return f" on {low} to {high} threads ({_plural(len(used) - 1, 'change')} with the load)"


def run_variant(k: int, n: int, variant: Variant, plan: RunPlan, work: Path, shard_dir: Path, config: Path,
                vocab: Path, args: argparse.Namespace, on_gpu: bool, stop: _SigtermForwarder) -> dict[str, Any]:
    """Run one variant in its own process; its summary, plus the mean loss of its last steps, the real
    tokens it saw and the CPU threads it chose."""
    # The trainer's progress bar (stderr) on a terminal; its step lines only with --verbose.
    progress_bar = sys.stderr.isatty() and not args.verbose
    cmd, log = run_command(variant, plan, work, shard_dir, config, vocab, args, on_gpu, progress_bar)
    if log.exists():
        log.unlink()  # a fresh log per demo run
    print(f"run {k} of {n}: {variant.title}", flush=True)
    if args.verbose:
        print("  " + " ".join(cmd[1:]), flush=True)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    started = time.perf_counter()
    stop.child = subprocess.Popen(cmd, env=env, stdout=None if args.verbose else subprocess.PIPE, text=True)
    try:
        captured, _ = stop.child.communicate()
    finally:
        returncode, stop.child = stop.child.returncode, None
    if stop.requested:
        raise Stopped()
    if returncode != 0:
        if captured:
            print(captured[-4000:], end="")
        raise SystemExit(f"{PROG}: run {k} of {n} ({variant.name}) failed (exit {returncode}); see the output above")
    records = read_dllog(str(log)) if log.exists() else []
    summaries = [r["data"] for r in records if r["step"] == []]
    if not summaries:
        raise SystemExit(f"{PROG}: run {k} of {n} ({variant.name}) wrote no summary to {log}")
    summary = dict(summaries[-1])
    steps = [r["data"] for r in records if isinstance(r["step"], int) and "loss" in r["data"]]
    summary["tail_loss"], summary["tail_steps"] = tail_loss([d["loss"] for d in steps])
    summary["real_tokens_seen"] = sum(d.get("real_tokens", 0) for d in steps)
    summary["real_tokens_per_micro_batch"] = summary["real_tokens_seen"] / max(1, len(steps) * plan.micro_batches)
    summary["cpu_threads"] = cpu_threads(captured or "")
    print(f"  {_plural(summary['steps'], 'step')} in {time.perf_counter() - started:.0f} s"
          f"{_threads(summary['cpu_threads'])}: loss "
          f"{summary['tail_loss']:.3f}, {_rate(summary.get('training_real_tokens_per_second'))} real tokens/s",
          flush=True)
    return summary


# -- what it prints ---------------------------------------------------------------------------
def _mib(value: Any) -> str:
    if not isinstance(value, (int, float)):
        return "n/a"
    return f"{value / 2**30:.2f} GiB" if value >= 2**30 else f"{value / 2**20:.1f} MiB"


def _rate(value: Any) -> str:
    if not isinstance(value, (int, float)) or value != value:
        return "n/a"
    return f"{value:,.0f}" if value >= 100 else f"{value:.1f}"


def _ratio(a: Any, b: Any) -> float:
    try:
        return a / b if b else float("nan")
    except TypeError:
        return float("nan")


def _times(a: Any, b: Any, digits: int = 1) -> str:
    """a / b as '1.5x', or 'n/a' when either is missing (a run too short to time)."""
    ratio = _ratio(a, b)
    return f"{ratio:.{digits}f}x" if ratio == ratio else "n/a"


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}{'es' if word.endswith('ch') else 's'}"


def format_results(results: dict[str, dict[str, Any]], plans: dict[str, RunPlan]) -> str:
    """The table: one row per run, then each Tempo run against the original. On a GPU also the
    allocator's peak beside the predicted one (a CPU process's resident set holds the interpreter and
    libraries besides the tensors: not comparable, so not shown)."""
    names = {v.key: v.name for v in VARIANTS}
    on_gpu = any("peak_allocated_bytes" in s for s in results.values())
    rows = [("", "tokens per micro-batch (real)", "micro-batches per step", "predicted peak", "loss (last steps)",
             "real tokens seen", "real tokens/s", "sequences/s") + (("peak allocated (GPU)",) if on_gpu else ())]
    own = {v.key for v in VARIANTS if v.runs_plan_of is None}
    for key, s in results.items():
        p = plans[key]
        real = f"{s['real_tokens_per_micro_batch']:,.0f}"
        rows.append((names.get(key, key), f"{p.tokens:,}" + ("" if p.unpadded else f" ({real})"),
                     str(p.micro_batches), _mib(p.peak) if key in own else "-", f"{s['tail_loss']:.3f}",
                     f"{s['real_tokens_seen']:,}", _rate(s.get("training_real_tokens_per_second")),
                     _rate(s.get("training_sequences_per_second")))
                    + ((_mib(s.get("peak_allocated_bytes")),) if on_gpu else ()))
    o = results.get("original")
    for key, t in results.items():
        if o is None or key == "original":
            continue
        rows.append((f"{names.get(key, key)} vs original",
                     _times(t["real_tokens_per_micro_batch"], o["real_tokens_per_micro_batch"]), "", "", "", "",
                     _times(t.get("training_real_tokens_per_second"), o.get("training_real_tokens_per_second"), 2),
                     _times(t.get("training_sequences_per_second"), o.get("training_sequences_per_second"), 2))
                    + (("",) if on_gpu else ()))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |" for r in rows]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)


def _padded_check(results: dict[str, dict[str, Any]]) -> str:
    """Tempo's layers on the original's own micro-batches: their real tokens/s against the original's
    (what the layers cost here by themselves) and their loss on the very same batches."""
    p, o = results.get("tempo_padded"), results["original"]
    if p is None:
        return ""
    speed = _times(p["training_real_tokens_per_second"], o["training_real_tokens_per_second"], 2)
    return (f"\n    (Tempo's layers on the original's own micro-batches: {speed} its real tokens/s, loss "
            f"{p['tail_loss']:.3f} against {o['tail_loss']:.3f})")


def headline(results: dict[str, dict[str, Any]], plans: dict[str, RunPlan], budget: str, on_gpu: bool) -> str:
    """What to take away, Tempo (real tokens only) against the original: the real tokens a micro-batch
    holds in the budget (and the recompute that takes), the loss after the same steps, real tokens/s
    (with what Tempo's layers cost on this device by themselves)."""
    o, t = results["original"], results["tempo"]
    po, pt = plans["original"], plans["tempo"]
    real_o, real_t = o["real_tokens_per_micro_batch"], t["real_tokens_per_micro_batch"]
    recompute = ("neither recomputes" if set(po.recompute) == set(pt.recompute) == {"none"}
                 else "with recompute")
    full = ""
    if po.tokens < po.full_recompute_tokens and po.real(po.full_recompute_tokens) < pt.real_tokens:
        full = (f"; recomputing every block, the original would fit {po.full_recompute_tokens:,} tokens "
                f"(about {po.real(po.full_recompute_tokens):,.0f} real)")
    gap = abs(t["tail_loss"] - o["tail_loss"]) / max(abs(o["tail_loss"]), 1e-12)
    same = "the same loss" if gap < 0.02 else f"a loss {gap:.0%} apart"
    window = "the last step" if t["tail_steps"] == 1 else f"mean of the last {t['tail_steps']} steps"
    tok_o, tok_t = o["training_real_tokens_per_second"], t["training_real_tokens_per_second"]
    path = ("Tempo's layers run their Triton kernels here" if on_gpu else
            "Tempo's layers run their PyTorch reference path here, recomputing what they do not keep")
    return "\n".join([
        f"Tempo (every layer, real tokens only) against the original layers (padded), in {budget}:",
        f"  {_times(real_t, real_o)} the real tokens per micro-batch: {real_t:,.0f} against {real_o:,.0f} "
        f"({po.tokens:,} with padding); {recompute}{full}",
        f"  {same}: {t['tail_loss']:.3f} against {o['tail_loss']:.3f} ({window} of the same {t['steps']}, taken in "
        f"{_plural(pt.micro_batches, 'micro-batch')} against {po.micro_batches}; {t['real_tokens_seen']:,} and "
        f"{o['real_tokens_seen']:,} real tokens seen)",
        f"  {_times(tok_t, tok_o)} the real tokens/s on this {'GPU' if on_gpu else 'CPU'}: {_rate(tok_t)} against "
        f"{_rate(tok_o)}; {path}{_padded_check(results)}",
    ])


def device_note(on_gpu: bool) -> str:
    """One line on what a GPU changes."""
    if on_gpu:
        return "On this GPU: bf16, Triton kernels for Tempo's layers, PyTorch's fused attention kernels."
    return ("On a GPU, Triton kernels and fused attention do the reference path's work, and the larger micro-batch "
            "is the gain.")


def build_parser() -> argparse.ArgumentParser:
    from tempo.utils import non_negative_int, positive_int, positive_number

    parser = argparse.ArgumentParser(
        prog=PROG, description=__doc__.split("\n\n")[0],
        epilog="--quick: a smoke run (300 documents, s = 128, 10 steps per run, 32MiB, unless given), for CI and "
               "a first check of an install; its figures are not a result.")
    parser.add_argument("--quick", action="store_true",
                        help="a smoke run: 300 documents, s = 128, 10 steps per run, a 32MiB budget (each unless "
                             "given)")
    parser.add_argument("--work_dir", default="out/demo", help="where corpus, shards and runs go")
    parser.add_argument("--steps", type=positive_int, default=None,
                        help=f"optimizer steps per run (default {DEFAULTS['steps']}; --quick {QUICK['steps']})")
    parser.add_argument("--seq_len", type=positive_int, default=None, help="sequence length (default 512; --quick 128)")
    parser.add_argument("--lr", type=positive_number, default=2e-3)
    parser.add_argument("--documents", type=positive_int, default=None,
                        help=f"generated documents ({DOCS_PER_ARTICLE} to an article; default 1500, --quick 300)")
    parser.add_argument("--vocab_size", type=positive_int, default=2048)
    parser.add_argument("--config", default=str(CONFIGS_DIR / "bert_tiny.json"))
    parser.add_argument("--seed", type=non_negative_int, default=1)
    parser.add_argument("--memory_budget", default=None,
                        help=f"the memory each run's step may use (weights, gradients, optimizer states, "
                             f"activations): the planner fits each run's micro-batch to it (default "
                             f"{DEFAULTS['memory_budget']}; --quick {QUICK['memory_budget']})")
    parser.add_argument("--verbose", action="store_true", help="print each run's command line and the trainer's output")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    from tempo.utils import parse_bytes

    defaults = QUICK if args.quick else DEFAULTS
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    try:
        if not parse_bytes(args.memory_budget) or parse_bytes(args.memory_budget) <= 0:
            raise ValueError("must be a positive size")
    except ValueError as exc:
        parser.error(f"--memory_budget {args.memory_budget!r}: {exc} (e.g. 128MiB, 1GiB)")

    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    on_gpu = _cuda_available()
    base = json.loads(Path(args.config).read_text())
    print(f"Tempo demo: pretraining a {base['num_hidden_layers']}-layer BERT (h = {base['hidden_size']}) at "
          f"s = {args.seq_len} on generated text, the original layers against Tempo, on "
          f"{'the GPU (bf16)' if on_gpu else 'the CPU (fp32)'}; files in {work.resolve()}", flush=True)
    with _SigtermForwarder() as stop:
        try:
            shard_dir, vocab = build_dataset(work, args.documents, args.vocab_size, args.seq_len, args.seed)
            rows, padding = shard_padding(shard_dir)
            print(f"data: {args.documents} generated documents as {-(-args.documents // DOCS_PER_ARTICLE)} articles, "
                  f"{rows:,} sequences at s = {args.seq_len}, {padding:.0%} padding"
                  + (" (Wikipedia at s = 512, BERT's phase 2: about 50%)" if args.seq_len == 512 else ""), flush=True)
            config = write_demo_config(work, vocab, Path(args.config))
            started = time.perf_counter()
            plans = plan_runs(config, shard_dir, args.seq_len, args.memory_budget, on_gpu)
            print(format_plans(plans, args.memory_budget, args.steps, time.perf_counter() - started), flush=True)
            results = {}
            for k, variant in enumerate(VARIANTS, 1):
                results[variant.key] = run_variant(k, len(VARIANTS), variant, plans[variant.key], work, shard_dir,
                                                   config, vocab, args, on_gpu, stop)
        except Stopped:
            print(f"{PROG}: stopped by SIGTERM; no checkpoint was written (the demo's runs keep none)",
                  file=sys.stderr)
            return 128 + signal.SIGTERM

    table = format_results(results, plans)
    print()
    print(headline(results, plans, args.memory_budget, on_gpu))
    print()
    print(table)
    print()
    print(device_note(on_gpu))
    print(f"{_plural(args.steps, 'optimizer step')} per run ({padding:.0%} padding); 'predicted peak': tempo.plan's, "
          f"python -m tempo.plan for any model. This table: {work / 'demo_results.md'}")
    (work / "demo_results.md").write_text(table + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
