"""The main job: pretrain a small BERT at s = 512 with the original layers and with Tempo, and compare.

    python -m tempo                  # everything under out/demo: about 2 minutes on 2 idle CPU cores
    python -m tempo --quick          # a smoke run: 300 documents, s = 128, 10 steps per run (~30 s)
    python -m tempo --verbose        # also the trainer's own output and command lines

1. writes the project's own generated corpus (no download) in DLE's text layout, four invented
   encyclopedia entries to an article, so that sequences at s = 512 are about half padding, as
   Wikipedia's are in BERT's phase 2 (the share is measured on the shards and printed);
2. trains a WordPiece vocabulary on it and builds DLE-format HDF5 shards at s = 512;
3. pretrains the tiny BERT config (2 layers, h = 128) three times with run_pretraining.py, each in
   its own process, on the same data with the same seed: the original layers on the padded batch
   (DLE's way); every Tempo layer on the real tokens only (``--tempo``: the trainers' default
   unpadding, efficient attention, fused dropout-add-LayerNorm); and every Tempo layer on the padded
   batch, which measures what Tempo's layers cost on this device by themselves;
4. prints what a user would choose Tempo for: the loss (the same), the largest batch that fits a
   memory budget (activations counted by the activation ledger, plus fp32 weights, gradients and
   Adam moments), and real tokens per second, with what Tempo's layers cost on this device by
   themselves (the padded Tempo run); then the table; then what a GPU changes.

Runs on the GPU when there is one (bf16), else on the CPU (fp32). ``--steps``, ``--batch_size`` and
``--seq_len`` change the runs; ``--quick`` makes every default small (a smoke run, not a result).
OpenMP's threads are left as the environment sets them: on 2 idle cores the default (spinning
threads) took the whole job 114 s against 173 s with ``OMP_WAIT_POLICY=PASSIVE``; on cores shared
with other jobs PASSIVE can be 10-20x faster for the CPU reference path's many small ops.
SIGTERM stops the running run (it writes no checkpoint: the demo keeps none) and the demo.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from tempo.bert.config import CONFIGS_DIR
from tempo.train.dllog import read_dllog

PROG = "python -m tempo"
DOCS_PER_ARTICLE = 4  # generated documents joined into one article: ~50 % padding at s = 512
DEFAULTS = dict(steps=150, seq_len=512, documents=1500)  # about 2 minutes on 2 idle CPU cores
QUICK = dict(steps=10, seq_len=128, documents=300)  # a smoke run


@dataclass(frozen=True)
class Variant:
    key: str  # run directory, results key
    name: str  # table row
    title: str  # "run k of n: <title>"
    flags: tuple[str, ...]


VARIANTS = (
    Variant("original", "original (padded)", "the original layers on the padded batch (DLE's way)",
            ("--no-tempo", "--attention", "eager", "--no-unpad")),
    Variant("tempo", "Tempo (real tokens only)",
            "every Tempo layer on the real tokens only (--tempo: the trainers' default)", ("--tempo", "--unpad")),
    Variant("tempo_padded", "Tempo (padded)",
            "every Tempo layer on the padded batch (what the layers alone cost here)", ("--tempo", "--no-unpad")),
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


# -- runs -------------------------------------------------------------------------------------
def run_command(variant: Variant, work: Path, shard_dir: Path, config: Path, vocab: Path,
                args: argparse.Namespace, on_gpu: bool, progress_bar: bool) -> tuple[list[str], Path]:
    out_dir = work / f"run_{variant.key}"
    log = out_dir / "dllogger.json"
    cmd = [sys.executable, "-m", "tempo.tasks.pretrain",
           "--input_dir", str(shard_dir), "--config_file", str(config), "--vocab_file", str(vocab),
           "--output_dir", str(out_dir), "--json-summary", str(log),
           "--max_seq_length", str(args.seq_len), "--max_predictions_per_seq", str(max(2, args.seq_len * 15 // 100)),
           "--train_batch_size", str(args.batch_size), "--learning_rate", str(args.lr),
           "--max_steps", str(args.steps), "--warmup_proportion", "0.1", "--seed", str(args.seed),
           "--log_freq", "1", "--num_steps_per_checkpoint", str(args.steps),
           "--num_workers", "0", "--skip_checkpoint", *variant.flags]
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


def run_variant(k: int, n: int, variant: Variant, work: Path, shard_dir: Path, config: Path, vocab: Path,
                args: argparse.Namespace, on_gpu: bool, stop: _SigtermForwarder) -> dict[str, Any]:
    """Run one variant in its own process; its summary, plus the mean loss of its last steps."""
    # The trainer's progress bar (stderr) on a terminal; its step lines only with --verbose.
    progress_bar = sys.stderr.isatty() and not args.verbose
    cmd, log = run_command(variant, work, shard_dir, config, vocab, args, on_gpu, progress_bar)
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
    losses = [r["data"]["loss"] for r in records if isinstance(r["step"], int) and "loss" in r["data"]]
    summary["tail_loss"], summary["tail_steps"] = tail_loss(losses)
    print(f"  {_steps(summary['steps'])} in {time.perf_counter() - started:.0f} s: loss {summary['tail_loss']:.3f}, "
          f"{_rate(summary.get('training_real_tokens_per_second'))} real tokens/s", flush=True)
    return summary


# -- what it prints ---------------------------------------------------------------------------
def training_state_bytes(config_path: Path) -> int:
    """Weights + gradients + the optimizer's two moments, fp32: what a step keeps besides activations."""
    import torch

    from tempo.bert.config import BertConfig
    from tempo.bert.model import BertForPreTraining

    with torch.device("meta"):  # sizes only, nothing allocated
        model = BertForPreTraining(BertConfig.from_json_file(config_path))
    params = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    return params * 4 * 4


def largest_batch(kept: int, batch: int, state_bytes: int, budget: int) -> int:
    """The largest batch whose activations (the ledger's bytes, linear in the batch) plus the
    training state fit ``budget``."""
    return max(0, int((budget - state_bytes) // (kept / batch)))


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


def _steps(n: int) -> str:
    return f"{n} step" if n == 1 else f"{n} steps"


def format_results(results: dict[str, dict[str, Any]], batch: int, state_bytes: int, budget: int) -> str:
    """The table: one row per run, then each Tempo run against the original."""
    def fits(s: dict[str, Any]) -> Optional[int]:
        kept = s.get("activation_bytes_per_micro_batch")
        return largest_batch(kept, batch, state_bytes, budget) if kept else None

    names = {v.key: v.name for v in VARIANTS}
    rows = [("", "loss (last steps)", f"largest batch in {_mib(budget)}", "bytes kept for backward",
             "real tokens/s", "sequences/s", "peak memory")]
    for key, s in results.items():
        peak = s.get("peak_allocated_bytes")
        peak_text = f"{_mib(peak)} (GPU)" if peak is not None else f"{_mib(s.get('peak_rss_bytes'))} (CPU RSS)"
        rows.append((names.get(key, key), f"{s['tail_loss']:.3f}", str(fits(s) if fits(s) is not None else "n/a"),
                     _mib(s.get("activation_bytes_per_micro_batch")),
                     _rate(s.get("training_real_tokens_per_second")), _rate(s.get("training_sequences_per_second")),
                     peak_text))
    o = results.get("original")
    for key, t in results.items():
        if o is None or key == "original":
            continue
        rows.append((f"{names.get(key, key)} vs original", "",
                     _times(fits(t), fits(o)),
                     _times(t.get("activation_bytes_per_micro_batch"), o.get("activation_bytes_per_micro_batch"), 2),
                     _times(t.get("training_real_tokens_per_second"), o.get("training_real_tokens_per_second"), 2),
                     _times(t.get("training_sequences_per_second"), o.get("training_sequences_per_second"), 2),
                     ""))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |" for r in rows]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)


def _padded_cost(results: dict[str, dict[str, Any]]) -> str:
    """Tempo's layers on the padded batch against the original's, real tokens/s: what they cost by themselves."""
    p, o = results.get("tempo_padded"), results["original"]
    return _times(p["training_real_tokens_per_second"], o["training_real_tokens_per_second"], 2) if p else "n/a"


def headline(results: dict[str, dict[str, Any]], batch: int, state_bytes: int, budget: int, on_gpu: bool) -> str:
    """What to take away: loss, largest batch, real tokens/s (with what Tempo's layers cost on this device),
    Tempo (real tokens only) against the original."""
    o, t = results["original"], results["tempo"]
    fit_o = largest_batch(o["activation_bytes_per_micro_batch"], batch, state_bytes, budget)
    fit_t = largest_batch(t["activation_bytes_per_micro_batch"], batch, state_bytes, budget)
    tok_o, tok_t = o["training_real_tokens_per_second"], t["training_real_tokens_per_second"]
    gap = abs(t["tail_loss"] - o["tail_loss"]) / max(abs(o["tail_loss"]), 1e-12)
    same = "the same loss" if gap < 0.02 else f"a loss {gap:.0%} apart"
    window = "the last step" if t["tail_steps"] == 1 else f"mean of the last {t['tail_steps']} steps"
    path = ("Tempo's layers run their Triton kernels here" if on_gpu else
            "Tempo's layers run their PyTorch reference path here, recomputing what they do not keep")
    return "\n".join([
        "Tempo (every layer, real tokens only) against the original layers (padded):",
        f"  {same}: {t['tail_loss']:.3f} against {o['tail_loss']:.3f} ({window})",
        f"  {_times(fit_t, fit_o)} the batch: {fit_t} sequences fit in {_mib(budget)} against {fit_o} "
        "(activations, weights, gradients, Adam moments)",
        f"  {_times(tok_t, tok_o)} the real tokens/s on this {'GPU' if on_gpu else 'CPU'}: {_rate(tok_t)} against "
        f"{_rate(tok_o)}; {path}\n    (on the padded batch: {_padded_cost(results)} the original's real tokens/s)",
    ])


def device_note(on_gpu: bool) -> str:
    """One line on what a GPU changes."""
    if on_gpu:
        return "On this GPU: bf16, Triton kernels for Tempo's layers, PyTorch's fused attention kernels."
    return ("On a GPU, Triton kernels and fused attention do the reference path's work, and the larger batch is "
            "the gain.")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog=PROG, description=__doc__.split("\n\n")[0],
        epilog="--quick: a smoke run (300 documents, s = 128, 10 steps per run unless given), for CI and a first "
               "check of an install; its figures are not a result.")
    parser.add_argument("--quick", action="store_true",
                        help="a smoke run: 300 documents, s = 128, 10 steps per run (each unless given)")
    parser.add_argument("--work_dir", default="out/demo", help="where corpus, shards and runs go")
    parser.add_argument("--steps", type=int, default=None, help="optimizer steps per run (default 150; --quick 10)")
    parser.add_argument("--batch_size", type=int, default=8, help="sequences per step")
    parser.add_argument("--seq_len", type=int, default=None, help="sequence length (default 512; --quick 128)")
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--documents", type=int, default=None,
                        help=f"generated documents ({DOCS_PER_ARTICLE} to an article; default 1500, --quick 300)")
    parser.add_argument("--vocab_size", type=int, default=2048)
    parser.add_argument("--config", default=str(CONFIGS_DIR / "bert_tiny.json"))
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--memory_budget", default="1GiB",
                        help="budget for the largest-batch figure (weights, gradients, optimizer, activations)")
    parser.add_argument("--verbose", action="store_true", help="print each run's command line and the trainer's output")
    args = parser.parse_args(argv)
    from tempo.utils import parse_bytes

    try:
        budget = parse_bytes(args.memory_budget)
    except ValueError as exc:
        parser.error(f"--memory_budget: {exc}")
    defaults = QUICK if args.quick else DEFAULTS
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    for name in ("steps", "batch_size", "seq_len", "documents", "vocab_size"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1, got {getattr(args, name)}")

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
            results = {}
            for k, variant in enumerate(VARIANTS, 1):
                results[variant.key] = run_variant(k, len(VARIANTS), variant, work, shard_dir, config, vocab, args,
                                                   on_gpu, stop)
        except Stopped:
            print(f"{PROG}: stopped by SIGTERM; no checkpoint was written (the demo's runs keep none)",
                  file=sys.stderr)
            return 128 + signal.SIGTERM

    state = training_state_bytes(config)
    table = format_results(results, args.batch_size, state, budget)
    print()
    print(headline(results, args.batch_size, state, budget, on_gpu))
    print()
    print(table)
    print()
    print(device_note(on_gpu))
    print(f"{_steps(args.steps)} of {args.batch_size} sequences per run ({padding:.0%} padding); 'largest batch': "
          "activations (the ledger's bytes, linear in the batch) plus fp32 weights, gradients and Adam moments.\n"
          f"Per-layer bytes for BERT-large and transformers' models: python -m tempo.memory. "
          f"This table: {work / 'demo_results.md'}")
    (work / "demo_results.md").write_text(table + "\n")
    return 0



if __name__ == "__main__":
    raise SystemExit(main())
