"""WordPiece tokenization for pretraining data, backed by HF ``tokenizers``.

``WordPieceTokenizer(vocab_file, lower_case=True)`` reproduces BERT's basic +
WordPiece tokenization (BertNormalizer, BertPreTokenizer, WordPiece with the
``##`` continuation prefix) using the Rust implementation, so a whole corpus can
be encoded with ``encode_batch``. Special tokens are *not* added here: the
instance builder places [CLS]/[SEP] itself.

``train_wordpiece_vocab(files, vocab_size, out_path)`` learns a vocab.txt from
raw text when no vocabulary is supplied. [PAD] is always id 0 because the DLE
shard format pads ``input_ids`` and ``masked_lm_ids`` with 0.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterable, Sequence

from tempo.utils import atomic_write_text

SPECIAL_TOKENS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")


class DataError(ValueError):
    """Base class for user-facing data pipeline errors (bad paths, bad files)."""


class VocabError(DataError):
    """A vocabulary file is missing, unreadable, empty or lacks special tokens."""


VOCAB_RULE = ("a BERT vocab.txt holds one distinct token per line, no blank lines, and the special "
              "tokens " + " ".join(SPECIAL_TOKENS))


def check_vocab(tokens: Sequence[str], path: str | os.PathLike) -> None:
    """The one vocabulary rule both trainers and the shard builder apply; VocabError names the
    file, the line and the token, and ends with ``VOCAB_RULE``.

    No blank line (it would make "" a token and shift every id after it), no token twice (the
    second line's id would be unreachable: ids and tokens no longer map one to one), and all of
    [PAD] [UNK] [CLS] [SEP] [MASK] present (the shard format pads with [PAD], the tokenizer maps
    unknown words to [UNK], sequences are framed by [CLS]/[SEP], MLM masks with [MASK]).
    """

    def fail(problem: str) -> None:
        raise VocabError(f"vocab file {path}: {problem}; {VOCAB_RULE}")

    first_line: dict[str, int] = {}
    for line, token in enumerate(tokens, start=1):
        if not token.strip():
            fail(f"line {line} is blank")
        if token in first_line:
            fail(f"line {line} repeats token {token!r} of line {first_line[token]}")
        first_line[token] = line
    missing = [t for t in SPECIAL_TOKENS if t not in first_line]
    if missing:
        fail(f"lacks special tokens {missing}")


def load_vocab(path: str | os.PathLike, check: bool = True) -> list[str]:
    """Read a BERT vocab.txt (one token per line, line number = id), checked by ``check_vocab``
    unless ``check=False``. Trailing blank lines (a final newline or two) are dropped."""
    path = Path(path)
    try:
        with open(path, encoding="utf-8") as f:
            # Strip only the newline: a token may legitimately be whitespace-free
            # punctuation, and blank lines would shift ids.
            tokens = [line.rstrip("\r\n") for line in f]
    except FileNotFoundError:
        raise VocabError(f"vocab file not found: {path}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise VocabError(f"cannot read vocab file {path}: {exc}") from None
    while tokens and tokens[-1] == "":
        tokens.pop()
    if not tokens:
        raise VocabError(f"vocab file is empty: {path}")
    if check:
        check_vocab(tokens, path)
    return tokens


def _bert_pipeline(tokenizer, lower_case: bool):
    from tokenizers import normalizers, pre_tokenizers

    # strip_accents=None follows lowercase, exactly like the original BERT.
    tokenizer.normalizer = normalizers.BertNormalizer(
        clean_text=True, handle_chinese_chars=True, strip_accents=None, lowercase=lower_case
    )
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    return tokenizer


class WordPieceTokenizer:
    """Fast BERT WordPiece tokenizer over a fixed vocab.txt."""

    def __init__(self, vocab_file: str | os.PathLike, lower_case: bool = True):
        from tokenizers import Tokenizer, models

        self.vocab_file = Path(vocab_file)
        self.vocab = load_vocab(self.vocab_file)
        self.token_to_id = {tok: i for i, tok in enumerate(self.vocab)}  # load_vocab checked it one to one
        self.lower_case = lower_case
        model = models.WordPiece(
            vocab=self.token_to_id, unk_token="[UNK]", max_input_chars_per_word=100
        )
        self._tok = _bert_pipeline(Tokenizer(model), lower_case)
        self.pad_id = self.token_to_id["[PAD]"]
        self.unk_id = self.token_to_id["[UNK]"]
        self.cls_id = self.token_to_id["[CLS]"]
        self.sep_id = self.token_to_id["[SEP]"]
        self.mask_id = self.token_to_id["[MASK]"]

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(list(texts), add_special_tokens=False)]

    def tokenize(self, text: str) -> list[str]:
        return self._tok.encode(text, add_special_tokens=False).tokens

    def convert_ids_to_tokens(self, ids: Iterable[int]) -> list[str]:
        return [self.vocab[i] for i in ids]

    def special_ids(self) -> set[int]:
        """Ids never used as MLM random replacements: the five specials plus
        bracketed placeholders such as [unused7]."""
        return {i for i, t in enumerate(self.vocab) if t.startswith("[") and t.endswith("]")}


def train_wordpiece_vocab(
    files: Sequence[str | os.PathLike],
    vocab_size: int,
    out_path: str | os.PathLike,
    lower_case: bool = True,
    min_frequency: int = 2,
) -> Path:
    """Learn a WordPiece vocab from text files and write it as vocab.txt.

    The special tokens come first in a fixed order ([PAD]=0, [UNK]=1, [CLS]=2,
    [SEP]=3, [MASK]=4). The file is written atomically. Returns ``out_path``.

    HF ``tokenizers`` trains the vocabulary; its trainer breaks ties between equally frequent
    pieces in hash order, so two trainings on the same text can differ in their rarest pieces
    (seen even with TOKENIZERS_PARALLELISM=false). Shards are reproducible given a vocab file:
    train once, keep the vocab.txt, and pass it as --vocab_file.
    """
    from tokenizers import Tokenizer, models, trainers

    files = [str(f) for f in files]
    if not files:
        raise VocabError(f"no text files to train a vocab for {out_path}")
    if vocab_size <= len(SPECIAL_TOKENS):
        raise VocabError(f"vocab_size must exceed {len(SPECIAL_TOKENS)}, got {vocab_size}")
    tokenizer = _bert_pipeline(Tokenizer(models.WordPiece(unk_token="[UNK]")), lower_case)
    trainer = trainers.WordPieceTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=list(SPECIAL_TOKENS),
        continuing_subword_prefix="##",
        show_progress=False,
    )
    tokenizer.train(files, trainer)
    vocab = tokenizer.get_vocab()
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    if tokens[: len(SPECIAL_TOKENS)] != list(SPECIAL_TOKENS):
        raise VocabError("tokenizers did not place the special tokens first")  # defensive
    out_path = Path(out_path)
    atomic_write_text(out_path, "".join(t + "\n" for t in tokens))
    return out_path
