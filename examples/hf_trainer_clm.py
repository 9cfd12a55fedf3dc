"""Causal-LM training of a tiny GPT-2 with the HF Trainer, with and without Tempo.

The run_clm flow on local data: the project's generated sample corpus, tokenized with the
MiniLM WordPiece vocab (a BERT tokenizer is fine for a model trained from scratch), blocks of
``--max_seq_length`` tokens, DataCollatorForLanguageModeling(mlm=False), a GPT2LMHeadModel built
from a config. Tempo, before the Trainer:

    model = apply_tempo(GPT2LMHeadModel(config))

GPT-2's activation is "gelu_new", the tanh approximation: apply_tempo replaces it with
InplaceGelu(approximate="tanh") (``--activation_function gelu`` builds the model with the exact
GELU, which becomes InplaceGelu()), the LayerNorms with InplaceLayerNorm and the attention with
Tempo's default, the efficient attention (causal). GPT-2 has no BERT-style residual blocks, so
nothing is fused.

    python examples/hf_trainer_clm.py --compare --max_steps 50

Same flags and output as hf_trainer_mlm.py; needs `accelerate` for the Trainer.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the shared helpers in hf_trainer_mlm.py
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from hf_trainer_mlm import (NEEDS_ACCELERATE, BlockDataset, accelerate_available, common_parser,  # noqa: E402
                            corpus_documents, grouped_blocks, run, tokenizer_from_minilm)


def main(argv: list[str] | None = None) -> int:
    parser = common_parser(__doc__.splitlines()[0])
    parser.add_argument("--activation_function", default="gelu_new", choices=["gelu_new", "gelu"],
                        help="GPT-2's default gelu_new (tanh, left alone by Tempo) or exact gelu")
    args = parser.parse_args(argv)
    if not accelerate_available():
        print(NEEDS_ACCELERATE, file=sys.stderr)
        return 2
    from transformers import DataCollatorForLanguageModeling, GPT2Config, GPT2LMHeadModel

    tokenizer = tokenizer_from_minilm()
    documents = corpus_documents(args.output_dir / "corpus", args.num_documents, args.seed)
    # [CLS] ... [SEP] around each document act as GPT-2's document separators.
    dataset = BlockDataset(grouped_blocks(tokenizer, documents, args.max_seq_length, special_tokens=True))
    collator = DataCollatorForLanguageModeling(tokenizer, mlm=False)
    config = GPT2Config(vocab_size=tokenizer.vocab_size, n_positions=max(1024, args.max_seq_length),
                        n_embd=args.hidden_size, n_layer=args.num_hidden_layers, n_head=args.num_attention_heads,
                        activation_function=args.activation_function, bos_token_id=tokenizer.cls_token_id,
                        eos_token_id=tokenizer.sep_token_id, pad_token_id=tokenizer.pad_token_id)
    print(f"{len(dataset)} blocks of {args.max_seq_length} tokens; GPT-2 {args.num_hidden_layers}x{args.hidden_size}")
    return run(args, lambda: GPT2LMHeadModel(config), dataset, collator)


if __name__ == "__main__":
    raise SystemExit(main())
