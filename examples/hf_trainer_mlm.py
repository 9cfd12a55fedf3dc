"""Masked-LM training of a small BERT with the HF Trainer, with and without Tempo.

The run_mlm flow (tokenize, concatenate, cut into blocks, DataCollatorForLanguageModeling,
Trainer) on local data: the project's generated sample corpus, the MiniLM WordPiece vocab, and a
BERT built from a config (nothing is downloaded). Tempo is one line, before the Trainer:

    model = apply_tempo(BertForMaskedLM(config))

which applies Tempo's default (the trainers' ``--tempo`` too): In-place GELU, In-place LayerNorm,
the residual blocks fused into DropoutAddLayerNorm and the efficient attention.

    python examples/hf_trainer_mlm.py --max_steps 50 --per_device_train_batch_size 16
    python examples/hf_trainer_mlm.py --no-tempo ...        # the baseline
    python examples/hf_trainer_mlm.py --compare ...         # both, one after the other

Prints train_samples_per_second and peak memory: CUDA max allocated on a GPU; on the CPU the
bytes autograd keeps for one training forward (tempo.memory.ActivationLedger), the part Tempo
reduces. The HF Trainer needs `accelerate`; without it the script says so and exits with 2.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any, Callable

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

NEEDS_ACCELERATE = ("The HF Trainer needs the `accelerate` package, which is not installed here. "
                    "Install it (pip install 'accelerate>=1.1') to run this example; apply_tempo itself "
                    "does not need it.")


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def accelerate_available() -> bool:
    from transformers.utils import is_accelerate_available

    return is_accelerate_available()


def common_parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--tempo", action=argparse.BooleanOptionalAction, default=True,
                   help="apply Tempo's layers (default) or not (--no-tempo)")
    p.add_argument("--compare", action="store_true", help="train without and then with Tempo; print both")
    p.add_argument("--max_steps", type=int, default=30)
    p.add_argument("--per_device_train_batch_size", type=int, default=8)
    p.add_argument("--bf16", action="store_true", help="bf16 autocast (GPU, or a CPU that supports it)")
    p.add_argument("--output_dir", type=Path, default=Path("output/hf_trainer"))
    p.add_argument("--max_seq_length", type=int, default=128)
    p.add_argument("--num_documents", type=int, default=400, help="documents of generated sample corpus")
    p.add_argument("--hidden_size", type=int, default=128)
    p.add_argument("--num_hidden_layers", type=int, default=2)
    p.add_argument("--num_attention_heads", type=int, default=2)
    p.add_argument("--learning_rate", type=float, default=5e-4)
    p.add_argument("--seed", type=int, default=0)
    return p


def tokenizer_from_minilm():
    """BertTokenizerFast over the MiniLM WordPiece vocab.txt, in transformers 4.x and 5.x.

    4.x takes ``vocab_file=``; 5.x takes ``vocab=`` (a dict) and silently ignores ``vocab_file``,
    leaving a 5-token vocabulary that maps every word to [UNK]: hence the check at the end.
    """
    import inspect

    from transformers import BertTokenizerFast

    from tempo.bert.hf_interop import minilm_dir

    vocab_file = minilm_dir() / "vocab.txt"
    if "vocab_file" in inspect.signature(BertTokenizerFast.__init__).parameters:
        tokenizer = BertTokenizerFast(vocab_file=str(vocab_file))
    else:
        tokens = vocab_file.read_text(encoding="utf-8").splitlines()
        tokenizer = BertTokenizerFast(vocab={token: i for i, token in enumerate(tokens)})
    if tokenizer.vocab_size < 1000:
        raise RuntimeError(f"the tokenizer did not load {vocab_file} ({tokenizer.vocab_size} tokens)")
    return tokenizer


def corpus_documents(out_dir: Path, num_documents: int, seed: int) -> list[str]:
    """The generated corpus as one string per document (DLE layout: blank line between documents)."""
    from tempo.bert.data.sample_corpus import write_sample_corpus

    documents = []
    for path in write_sample_corpus(out_dir, num_documents=num_documents, seed=seed):
        text = path.read_text(encoding="utf-8")
        documents += [" ".join(block.split("\n")) for block in text.split("\n\n") if block.strip()]
    return documents


def grouped_blocks(tokenizer, documents: list[str], block_size: int, special_tokens: bool) -> list[dict[str, list[int]]]:
    """run_mlm / run_clm's group_texts: tokenize, concatenate, cut into equal blocks (rest dropped)."""
    ids: list[int] = []
    for encoded in tokenizer(documents, add_special_tokens=special_tokens)["input_ids"]:
        ids += encoded
    return [{"input_ids": ids[i:i + block_size]} for i in range(0, len(ids) - block_size + 1, block_size)]


class BlockDataset(torch.utils.data.Dataset):
    def __init__(self, blocks: list[dict[str, list[int]]]):
        self.blocks = blocks

    def __len__(self) -> int:
        return len(self.blocks)

    def __getitem__(self, i: int) -> dict[str, list[int]]:
        return self.blocks[i]


def ledger_bytes(model: torch.nn.Module, batch: dict[str, torch.Tensor], bf16: bool) -> int:
    """Bytes autograd keeps for backward over one training forward of ``batch``."""
    from tempo.memory import ActivationLedger

    device = next(model.parameters()).device
    batch = {k: v.to(device) for k, v in batch.items()}
    model.train()
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16), ActivationLedger(model) as ledger:
        model(**batch).loss
    return ledger.activation_bytes


def train_once(args: argparse.Namespace, use_tempo: bool, build_model: Callable[[], torch.nn.Module],
               dataset: torch.utils.data.Dataset, collator: Any) -> dict[str, Any]:
    from transformers import Trainer, TrainingArguments, set_seed

    from tempo.integrations.patch import apply_tempo

    set_seed(args.seed)
    model = build_model()
    if use_tempo:
        model = apply_tempo(model)  # before the Trainer: it builds the optimizer from these modules
    cuda = torch.cuda.is_available()
    sample = collator([dataset[i] for i in range(min(args.per_device_train_batch_size, len(dataset)))])
    activation_bytes = None if cuda else ledger_bytes(model, sample, args.bf16)
    training_args = TrainingArguments(
        output_dir=str(args.output_dir / ("tempo" if use_tempo else "baseline")),
        max_steps=args.max_steps, per_device_train_batch_size=args.per_device_train_batch_size,
        learning_rate=args.learning_rate, bf16=args.bf16, logging_steps=max(1, args.max_steps // 5),
        save_strategy="no", report_to="none", seed=args.seed, use_cpu=not cuda,
        dataloader_num_workers=0, remove_unused_columns=False, disable_tqdm=True)
    trainer = Trainer(model=model, args=training_args, train_dataset=dataset, data_collator=collator)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    metrics = trainer.train().metrics
    return {
        "tempo": use_tempo,
        "train_samples_per_second": metrics.get("train_samples_per_second"),
        "train_loss": metrics.get("train_loss"),
        "peak_memory": torch.cuda.max_memory_allocated() if cuda else activation_bytes,
        "memory_kind": "CUDA max allocated" if cuda else "ledger activation bytes (one forward)",
    }


def run(args: argparse.Namespace, build_model: Callable[[], torch.nn.Module], dataset, collator) -> int:
    modes = [False, True] if args.compare else [args.tempo]
    rows = [train_once(args, mode, build_model, dataset, collator) for mode in modes]
    for row in rows:
        print(f"{'tempo' if row['tempo'] else 'baseline':<9} train_samples_per_second="
              f"{row['train_samples_per_second']:.2f} train_loss={row['train_loss']:.4f} "
              f"peak_memory={row['peak_memory'] / 2**20:.2f} MiB ({row['memory_kind']})")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = common_parser(__doc__.splitlines()[0]).parse_args(argv)
    if not accelerate_available():  # say so before spending time on data
        print(NEEDS_ACCELERATE, file=sys.stderr)
        return 2
    from transformers import BertConfig, BertForMaskedLM, DataCollatorForLanguageModeling

    tokenizer = tokenizer_from_minilm()
    documents = corpus_documents(args.output_dir / "corpus", args.num_documents, args.seed)
    dataset = BlockDataset(grouped_blocks(tokenizer, documents, args.max_seq_length, special_tokens=True))
    collator = DataCollatorForLanguageModeling(tokenizer, mlm=True, mlm_probability=0.15)
    config = BertConfig(vocab_size=tokenizer.vocab_size, hidden_size=args.hidden_size,
                        num_hidden_layers=args.num_hidden_layers, num_attention_heads=args.num_attention_heads,
                        intermediate_size=4 * args.hidden_size, max_position_embeddings=max(512, args.max_seq_length),
                        hidden_act="gelu", pad_token_id=tokenizer.pad_token_id)
    print(f"{len(dataset)} blocks of {args.max_seq_length} tokens; BERT {args.num_hidden_layers}x{args.hidden_size}")
    return run(args, lambda: BertForMaskedLM(config), dataset, collator)


if __name__ == "__main__":
    raise SystemExit(main())
