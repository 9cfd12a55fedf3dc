"""Padding-free masked-LM training of a small BERT with the HF Trainer and Tempo.

Each sentence of the project's generated corpus is one sequence (lengths vary, as real data's
do). Padded, a batch is [B, longest] with the rest padding; padding-free, transformers'
``DataCollatorWithFlattening`` packs the batch into one row of real tokens with ``position_ids``
restarting per sentence. transformers' own eager/sdpa attention of BERT reads neither and lets
every token attend across the sentence boundaries; after ``apply_tempo(model)`` Tempo's
attention reads the boundaries (variable-length attention: each sentence attends itself only,
exactly as in its own padded row), so padding-free training is both correct and cheaper.

    python examples/hf_trainer_padding_free.py --max_steps 50          # padded, then padding-free
    python examples/hf_trainer_padding_free.py --only padding-free ...

Prints, per run, train_samples_per_second, real (non-padding) tokens per second and the loss.
The HF Trainer needs `accelerate`; without it the script says so and exits with 2.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from hf_trainer_mlm import NEEDS_ACCELERATE, accelerate_available, corpus_documents, tokenizer_from_minilm  # noqa: E402

MODES = ("padded", "padding-free")


class MaskedFlattening:
    """DataCollatorWithFlattening (one packed row, restarting position_ids), then BERT's MLM
    masking of the packed tokens (special tokens never masked)."""

    def __init__(self, tokenizer, mlm_probability: float = 0.15):
        from transformers import DataCollatorForLanguageModeling, DataCollatorWithFlattening

        self.flatten = DataCollatorWithFlattening(return_tensors="pt")
        self.mlm = DataCollatorForLanguageModeling(tokenizer, mlm=True, mlm_probability=mlm_probability)
        self.special = torch.tensor(sorted(tokenizer.all_special_ids))

    def __call__(self, features: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        batch = self.flatten([{"input_ids": f["input_ids"]} for f in features])
        batch.pop("labels", None)
        special = torch.isin(batch["input_ids"], self.special)
        batch["input_ids"], batch["labels"] = self.mlm.torch_mask_tokens(batch["input_ids"].clone(),
                                                                          special_tokens_mask=special)
        return batch


def sentence_dataset(tokenizer, documents: list[str], max_length: int) -> list[dict[str, list[int]]]:
    sentences = [s.strip() + "." for d in documents for s in d.split(".") if len(s.split()) >= 3]
    encoded = tokenizer(sentences, truncation=True, max_length=max_length)["input_ids"]
    return [{"input_ids": ids} for ids in encoded]


def real_tokens(collator, dataset, batch_size: int, steps: int) -> int:
    """Non-padding tokens the Trainer will see (its sampler order aside: the same total on average)."""
    per_example = sum(len(x["input_ids"]) for x in dataset) / len(dataset)
    return int(per_example * batch_size * steps)


def train_once(args: argparse.Namespace, mode: str, config, tokenizer, dataset) -> dict[str, Any]:
    from transformers import BertForMaskedLM, DataCollatorForLanguageModeling, Trainer, TrainingArguments, set_seed

    from tempo.integrations.patch import apply_tempo

    set_seed(args.seed)
    model = apply_tempo(BertForMaskedLM(config))  # before the Trainer
    collator = (MaskedFlattening(tokenizer) if mode == "padding-free"
                else DataCollatorForLanguageModeling(tokenizer, mlm=True, mlm_probability=0.15))
    training_args = TrainingArguments(
        output_dir=str(args.output_dir / mode), max_steps=args.max_steps,
        per_device_train_batch_size=args.per_device_train_batch_size, learning_rate=args.learning_rate,
        logging_steps=max(1, args.max_steps // 5), save_strategy="no", report_to="none", seed=args.seed,
        use_cpu=not torch.cuda.is_available(), dataloader_num_workers=0, remove_unused_columns=False,
        disable_tqdm=True)
    trainer = Trainer(model=model, args=training_args, train_dataset=dataset, data_collator=collator)
    start = time.perf_counter()
    metrics = trainer.train().metrics
    elapsed = time.perf_counter() - start
    tokens = real_tokens(collator, dataset, args.per_device_train_batch_size, args.max_steps)
    return {"mode": mode, "train_samples_per_second": metrics.get("train_samples_per_second"),
            "real_tokens_per_second": tokens / elapsed, "train_loss": metrics.get("train_loss")}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", choices=MODES, default=None, help="run one mode (default: both)")
    p.add_argument("--max_steps", type=int, default=30)
    p.add_argument("--per_device_train_batch_size", type=int, default=16)
    p.add_argument("--output_dir", type=Path, default=Path("output/hf_padding_free"))
    p.add_argument("--max_seq_length", type=int, default=128)
    p.add_argument("--num_documents", type=int, default=200)
    p.add_argument("--hidden_size", type=int, default=128)
    p.add_argument("--num_hidden_layers", type=int, default=2)
    p.add_argument("--learning_rate", type=float, default=5e-4)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if not accelerate_available():
        print(NEEDS_ACCELERATE, file=sys.stderr)
        return 2
    from transformers import BertConfig

    tokenizer = tokenizer_from_minilm()
    documents = corpus_documents(args.output_dir / "corpus", args.num_documents, args.seed)
    dataset = sentence_dataset(tokenizer, documents, args.max_seq_length)
    config = BertConfig(vocab_size=tokenizer.vocab_size, hidden_size=args.hidden_size,
                        num_hidden_layers=args.num_hidden_layers, num_attention_heads=2,
                        intermediate_size=4 * args.hidden_size, max_position_embeddings=max(512, args.max_seq_length),
                        pad_token_id=tokenizer.pad_token_id)
    lengths = [len(x["input_ids"]) for x in dataset]
    print(f"{len(dataset)} sentences, {min(lengths)}..{max(lengths)} tokens (mean {sum(lengths) / len(lengths):.1f}); "
          f"BERT {args.num_hidden_layers}x{args.hidden_size} with Tempo")
    for mode in ([args.only] if args.only else MODES):
        r = train_once(args, mode, config, tokenizer, dataset)
        print(f"{mode:<13} train_samples_per_second={r['train_samples_per_second']:.2f} "
              f"real_tokens_per_second={r['real_tokens_per_second']:.0f} train_loss={r['train_loss']:.4f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
