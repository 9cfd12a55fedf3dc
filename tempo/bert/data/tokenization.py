"""WordPiece tokenization for pretraining data, backed by HF ``tokenizers``.

``WordPieceTokenizer(vocab_file, lower_case=True)`` reproduces BERT's basic +
WordPiece tokenization (BertNormalizer, BertPreTokenizer, WordPiece with the
``##`` continuation prefix) using the Rust implementation, so a whole corpus can
be encoded with ``encode_batch``. Special tokens are *not* added here: the
instance builder places [CLS]/[SEP] itself.

``train_wordpiece_vocab(files, vocab_size, out_path)`` learns a vocab.txt from
raw text when no vocabulary is supplied (BPE-style merges like HF's WordPiece
trainer, with deterministic tie-breaking). [PAD] is always id 0 because the DLE
shard format pads ``input_ids`` and ``masked_lm_ids`` with 0.
"""

from __future__ import annotations

import heapq
import os
import tempfile
from collections import Counter
from pathlib import Path
from typing import Iterable, Sequence

SPECIAL_TOKENS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")


class DataError(ValueError):
    """Base class for user-facing data pipeline errors (bad paths, bad files)."""


class VocabError(DataError):
    """A vocabulary file is missing, unreadable, empty or lacks special tokens."""


def load_vocab(path: str | os.PathLike) -> list[str]:
    """Read a BERT vocab.txt (one token per line, line number = id)."""
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
    return tokens


def _atomic_write_text(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


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
        self.token_to_id = {tok: i for i, tok in enumerate(self.vocab)}
        missing = [t for t in SPECIAL_TOKENS if t not in self.token_to_id]
        if missing:
            raise VocabError(f"vocab file {self.vocab_file} lacks special tokens {missing}")
        if len(self.token_to_id) != len(self.vocab):
            raise VocabError(f"vocab file {self.vocab_file} has duplicate tokens")
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


def _count_words(files: Sequence[str | os.PathLike], lower_case: bool) -> Counter:
    from tokenizers import Tokenizer, models

    # The same normalizer and pre-tokenizer as encoding, so the learned pieces fit the words
    # the tokenizer will actually see.
    pipeline = _bert_pipeline(Tokenizer(models.WordPiece(vocab={"[UNK]": 0}, unk_token="[UNK]")), lower_case)
    normalize, split = pipeline.normalizer.normalize_str, pipeline.pre_tokenizer.pre_tokenize_str
    counts: Counter = Counter()
    for path in files:
        try:
            with open(path, encoding="utf-8", errors="replace") as f:
                for line in f:
                    if line.strip():
                        counts.update(word for word, _ in split(normalize(line)))
        except OSError as exc:
            raise VocabError(f"cannot read {path} to train a vocab: {exc}") from None
    return counts


def _learn_pieces(counts: Counter, budget: int, min_frequency: int) -> list[str]:
    """Alphabet plus pieces from greedy pair merges, most frequent pair first.

    Like the BPE-style WordPiece trainer of HF ``tokenizers``, but ties are broken by the
    pair's text, so the result is the same on every run (the Rust trainer's hash-map order
    is not).
    """
    words = [[w[0]] + ["##" + c for c in w[1:]] for w in counts]
    freqs = list(counts.values())
    alphabet = sorted({sym for word in words for sym in word})
    pieces = list(alphabet)
    known = set(pieces)

    pair_counts: Counter = Counter()
    where: dict[tuple[str, str], set[int]] = {}
    for i, word in enumerate(words):
        for pair in zip(word, word[1:]):
            pair_counts[pair] += freqs[i]
            where.setdefault(pair, set()).add(i)
    heap = [(-c, pair) for pair, c in pair_counts.items()]
    heapq.heapify(heap)

    def merged(a: str, b: str) -> str:
        return a + b[2:]

    while len(pieces) < budget and heap:
        negative, pair = heapq.heappop(heap)
        if pair_counts.get(pair, 0) != -negative:
            continue  # stale heap entry
        if -negative < min_frequency:
            break
        new = merged(*pair)
        if new not in known:
            known.add(new)
            pieces.append(new)
        changed: set[tuple[str, str]] = set()
        for i in sorted(where.pop(pair, ())):
            word, freq = words[i], freqs[i]
            for old in zip(word, word[1:]):
                pair_counts[old] -= freq
                changed.add(old)
            out, j = [], 0
            while j < len(word):
                if j + 1 < len(word) and (word[j], word[j + 1]) == pair:
                    out.append(new)
                    j += 2
                else:
                    out.append(word[j])
                    j += 1
            words[i] = out
            for fresh in zip(out, out[1:]):
                pair_counts[fresh] += freq
                where.setdefault(fresh, set()).add(i)
                changed.add(fresh)
        pair_counts.pop(pair, None)
        for other in changed:
            count = pair_counts.get(other, 0)
            if count > 0:
                heapq.heappush(heap, (-count, other))
            else:
                pair_counts.pop(other, None)
    return pieces[:budget]


def train_wordpiece_vocab(
    files: Sequence[str | os.PathLike],
    vocab_size: int,
    out_path: str | os.PathLike,
    lower_case: bool = True,
    min_frequency: int = 2,
) -> Path:
    """Learn a WordPiece vocab from text files and write it as vocab.txt.

    The special tokens come first in a fixed order ([PAD]=0, [UNK]=1, [CLS]=2,
    [SEP]=3, [MASK]=4), then the characters seen (as word starts and ``##``
    continuations), then merged pieces; fewer than ``vocab_size`` tokens when
    the corpus has no more pairs seen ``min_frequency`` times. Deterministic.
    Meant for small and medium corpora (pure Python); for Wikipedia-scale text
    pass BERT's own vocab.txt instead. Written atomically; returns ``out_path``.
    """
    files = list(files)
    if not files:
        raise VocabError(f"no text files to train a vocab for {out_path}")
    if vocab_size <= len(SPECIAL_TOKENS):
        raise VocabError(f"vocab_size must exceed {len(SPECIAL_TOKENS)}, got {vocab_size}")
    counts = _count_words(files, lower_case)
    if not counts:
        raise VocabError(f"no words in {files[0]}{' and the other files' if len(files) > 1 else ''} to train a vocab")
    pieces = [p for p in _learn_pieces(counts, vocab_size, min_frequency) if p not in SPECIAL_TOKENS]
    tokens = list(SPECIAL_TOKENS) + pieces[: vocab_size - len(SPECIAL_TOKENS)]
    out_path = Path(out_path)
    _atomic_write_text(out_path, "".join(t + "\n" for t in tokens))
    return out_path
