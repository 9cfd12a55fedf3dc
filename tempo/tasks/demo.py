"""The main job on an embedded default: text -> shards -> pretraining, original vs Tempo.

    python -m tempo                      # everything under out/demo, a few minutes on 2 CPU cores
    python -m tempo --steps 50 --quick   # a smoke run

1. writes the project's own generated corpus (no download) in DLE's text layout;
2. trains a WordPiece vocabulary on it and builds DLE-format HDF5 shards;
3. pretrains the same small BERT four times with run_pretraining.py: the original layers on the
   padded batch (DLE's way), the original layers on the real tokens only (``--unpad``), the
   paper's Tempo layers (padded, as published), and every Tempo layer unpadded (the trainers'
   default: efficient attention, fused dropout-add-LayerNorm), each in its own process so that
   peak memory is per run;
4. prints a side-by-side table: bytes autograd kept for backward (activation ledger), the largest
   batch that fits a stated memory budget, peak memory, sequences and real tokens per second,
   final loss.
Runs on the GPU when there is one (bf16), else on the CPU (fp32).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from tempo.bert.config import CONFIGS_DIR
from tempo.train.dllog import read_dllog

VARIANTS = {
    "original": ["--no-tempo", "--attention", "eager", "--no-unpad"],
    "original + unpad": ["--no-tempo", "--attention", "eager", "--unpad"],
    "tempo (paper)": ["--tempo", "--tempo_layers", "gelu,layernorm,attention", "--attention", "tempo", "--no-unpad"],
    "tempo (all) + unpad": ["--tempo", "--unpad"],  # the trainers' defaults with --tempo
}


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def build_dataset(work: Path, num_documents: int, vocab_size: int, seq_len: int, seed: int) -> tuple[Path, Path]:
    from tempo.bert.data.create_pretraining_data import create_shards
    from tempo.bert.data.sample_corpus import write_sample_corpus
    from tempo.bert.data.tokenization import train_wordpiece_vocab

    text_dir, shard_dir, vocab_file = work / "text", work / f"shards_s{seq_len}", work / "vocab.txt"
    text_files = write_sample_corpus(text_dir, num_documents=num_documents, seed=seed)
    if not vocab_file.exists():
        train_wordpiece_vocab(text_files, vocab_size, vocab_file)
    if not any(shard_dir.glob("*.hdf5")):
        create_shards(text_dir, shard_dir, vocab_file, max_seq_length=seq_len,
                      max_predictions_per_seq=max(2, seq_len * 15 // 100), dupe_factor=2,
                      num_shards=4, random_seed=seed)
    return shard_dir, vocab_file


def write_demo_config(work: Path, vocab_file: Path, base_config: Path) -> Path:
    """The tiny BERT config with the vocabulary we just trained."""
    config = json.loads(base_config.read_text())
    with open(vocab_file, encoding="utf-8") as fh:
        config["vocab_size"] = sum(1 for line in fh if line.strip())
    path = work / "bert_demo_config.json"
    path.write_text(json.dumps(config, indent=2) + "\n")
    return path


def run_variant(name: str, work: Path, shard_dir: Path, config: Path, vocab: Path, args: argparse.Namespace,
                on_gpu: bool) -> dict[str, Any]:
    out_dir = work / f"run_{name.replace(' + ', '_').replace(' ', '_').replace('(', '').replace(')', '')}"
    log = out_dir / "dllogger.json"
    if log.exists():
        log.unlink()  # a fresh log per demo run; checkpoints of earlier runs are ignored below
    cmd = [sys.executable, "-m", "tempo.tasks.pretrain",
           "--input_dir", str(shard_dir), "--config_file", str(config), "--vocab_file", str(vocab),
           "--output_dir", str(out_dir), "--json-summary", str(log),
           "--max_seq_length", str(args.seq_len), "--max_predictions_per_seq", str(max(2, args.seq_len * 15 // 100)),
           "--train_batch_size", str(args.batch_size), "--learning_rate", str(args.lr),
           "--max_steps", str(args.steps), "--warmup_proportion", "0.1", "--seed", str(args.seed),
           "--log_freq", str(max(1, args.steps // 10)), "--num_steps_per_checkpoint", str(args.steps),
           "--num_workers", "0", "--disable_progress_bar", "--skip_checkpoint", *VARIANTS[name]]
    if on_gpu:
        cmd.append("--bf16")
    print(f"\n=== {name}: {' '.join(cmd[1:])}", flush=True)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    result = subprocess.run(cmd, env=env)
    if result.returncode != 0:
        raise SystemExit(f"demo: the {name} run failed (exit {result.returncode}); see the output above")
    summary = [r for r in read_dllog(str(log)) if r["step"] == []]
    if not summary:
        raise SystemExit(f"demo: the {name} run wrote no summary to {log}")
    return summary[-1]["data"]


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


def format_results(results: dict[str, dict[str, Any]], layers: int, hidden: int, tokens: int, batch: int,
                   state_bytes: int, budget: int) -> str:
    def mib(value: Any) -> str:
        return f"{value / 2**20:.1f} MiB" if isinstance(value, (int, float)) else "n/a"

    from tempo.train.runtime import format_rate

    rows = [("", "bytes kept for backward", "÷ (tokens × layers)", f"largest batch in {mib(budget)}",
             "peak memory", "sequences/s", "real tokens/s", "final loss")]
    for name, s in results.items():
        kept = s.get("activation_bytes_per_micro_batch")
        per_token = f"{kept / (tokens * layers * hidden):.1f} h" if kept else "n/a"
        fits = str(largest_batch(kept, batch, state_bytes, budget)) if kept else "n/a"
        peak = s.get("peak_allocated_bytes")
        peak_text = f"{mib(peak)} (GPU)" if peak is not None else f"{mib(s.get('peak_rss_bytes'))} (CPU RSS)"
        rows.append((name, mib(kept), per_token, fits, peak_text,
                     format_rate(s["training_sequences_per_second"]).replace(" seq/s", ""),
                     f"{s.get('training_real_tokens_per_second', float('nan')):.0f}", f"{s['final_loss']:.4f}"))
    o = results.get("original")
    for name, t in results.items():
        if o is None or name == "original":
            continue
        saved = 1 - t["activation_bytes_per_micro_batch"] / o["activation_bytes_per_micro_batch"]
        more = (largest_batch(t["activation_bytes_per_micro_batch"], batch, state_bytes, budget)
                / max(1, largest_batch(o["activation_bytes_per_micro_batch"], batch, state_bytes, budget)))
        speed = t["training_sequences_per_second"] / o["training_sequences_per_second"] - 1
        tokens_speed = t["training_real_tokens_per_second"] / o["training_real_tokens_per_second"]
        rows.append((f"{name} vs original", f"{-saved:+.0%}", "", f"{more:.1f}x", "", f"{speed:+.0%}",
                     f"{tokens_speed:.2f}x", ""))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |" for r in rows]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tempo", description=__doc__.split("\n\n")[0])
    parser.add_argument("--work_dir", default="out/demo", help="where corpus, shards and runs go")
    parser.add_argument("--steps", type=int, default=300, help="optimizer steps per run")
    parser.add_argument("--batch_size", type=int, default=32)
    parser.add_argument("--seq_len", type=int, default=64)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--documents", type=int, default=1500, help="documents in the generated corpus")
    parser.add_argument("--vocab_size", type=int, default=2048)
    parser.add_argument("--config", default=str(CONFIGS_DIR / "bert_tiny.json"))
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--quick", action="store_true", help="a smaller corpus for a smoke run")
    parser.add_argument("--memory_budget", default="256MiB",
                        help="budget for the largest-batch column (weights, gradients, optimizer, activations)")
    args = parser.parse_args(argv)
    from tempo.utils import parse_bytes

    try:
        budget = parse_bytes(args.memory_budget)
    except ValueError as exc:
        parser.error(f"--memory_budget: {exc}")
    if args.quick:
        args.documents = min(args.documents, 300)

    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    on_gpu = _cuda_available()
    print(f"Tempo demo in {work.resolve()} on {'the GPU (bf16)' if on_gpu else 'the CPU (fp32)'}")
    shard_dir, vocab = build_dataset(work, args.documents, args.vocab_size, args.seq_len, args.seed)
    config = write_demo_config(work, vocab, Path(args.config))
    results = {name: run_variant(name, work, shard_dir, config, vocab, args, on_gpu) for name in VARIANTS}

    model_config = json.loads(config.read_text())
    o = results["original"]
    padding = 1 - o["training_real_tokens_per_second"] / (o["training_sequences_per_second"] * args.seq_len)
    table = format_results(results, model_config["num_hidden_layers"], model_config["hidden_size"],
                           args.batch_size * args.seq_len, args.batch_size, training_state_bytes(config), budget)
    print(f"\nPretraining {model_config['num_hidden_layers']}-layer BERT (h={model_config['hidden_size']}), "
          f"{args.steps} steps of {args.batch_size} x {args.seq_len} tokens, original layers vs Tempo:\n")
    print(table)
    print("\n'bytes kept for backward' is the activation ledger over one batch (whole model, embeddings and heads\n"
          "included; unpadded runs keep bytes for their real tokens only, so '÷ tokens' divides by every position\n"
          "of the padded batch). 'largest batch' is what fits the budget: fp32 weights, gradients and two optimizer\n"
          "moments plus that many sequences' activations (the ledger's bytes scale with the batch) - what Tempo and\n"
          f"unpadding buy. Real tokens/s counts the non-padding tokens trained on: these shards are {padding:.0%} padding.\n"
          "At this toy size on the CPU unpadding saves bytes but little time (the embeddings and the MLM head dominate,\n"
          "and the reference attention loops over sequences); on long, half-padded batches it is most of the speed-up:\n"
          "python -m tempo.bench compare --variants original,all,all+unpad --seq-len 512 --padding 0.5\n"
          "On the CPU, Tempo runs its PyTorch reference path, which recomputes what it does not keep and so costs\n"
          "time there; the Triton kernels and PyTorch's fused attention on a GPU are what speed is about.\n"
          "Per-layer figures for BERT-large: python -m tempo.memory")
    (work / "demo_results.md").write_text(table + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
