"""Build DLE-format BERT pretraining shards (HDF5) from formatted text.

Input layout (DLE's formatted Wikipedia/books): plain ``*.txt`` files, one
sentence per line, documents separated by blank lines.

The instance builder follows Google's ``create_pretraining_data`` algorithm:
per document, segments are packed up to a target length (shorter with
probability ``short_seq_prob``), split into A/B at a random segment boundary,
B is replaced by text from another document half of the time (NSP, with the
unused segments put back), the pair is truncated from random ends, wrapped as
``[CLS] A [SEP] B [SEP]`` and masked (80% [MASK] / 10% random / 10% kept,
optionally whole-word). ``dupe_factor`` passes give each document several
different maskings.

Documents are shuffled with the seed and split into ``num_shards`` groups of
roughly equal text size; each group becomes one shard, built in a worker
process with its own RNG derived from (seed, shard index), so the output is
byte-for-byte independent of ``num_workers``.

Each shard holds exactly the datasets ``input_ids``, ``input_mask``,
``segment_ids`` ([N, L]), ``masked_lm_positions``, ``masked_lm_ids`` ([N, P],
zero padded) and ``next_sentence_labels`` ([N], 1 = B is a random segment).
Shards are written to a temp file and renamed into place.

Python: ``create_shards(input_files_or_dir, output_dir, vocab_file=None, ...)``.
CLI: ``python -m tempo.bert.data.create_pretraining_data --input_dir D --output_dir O``.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import random
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

from .tokenization import DataError, WordPieceTokenizer, train_wordpiece_vocab

SHARD_KEYS = (
    "input_ids",
    "input_mask",
    "segment_ids",
    "masked_lm_positions",
    "masked_lm_ids",
    "next_sentence_labels",
)
DEFAULT_VOCAB_SIZE = 30522


class CorpusError(DataError):
    """Input text is missing/empty, or the settings cannot produce instances."""


@dataclass(frozen=True)
class InstanceConfig:
    max_seq_length: int = 128
    max_predictions_per_seq: int = 20
    masked_lm_prob: float = 0.15
    dupe_factor: int = 5
    short_seq_prob: float = 0.1
    whole_word_mask: bool = False

    def validate(self) -> None:
        if self.max_seq_length < 5:
            raise CorpusError(f"max_seq_length must be >= 5 ([CLS] A [SEP] B [SEP]), got {self.max_seq_length}")
        if not 1 <= self.max_predictions_per_seq <= self.max_seq_length:
            raise CorpusError(
                f"max_predictions_per_seq must be in [1, max_seq_length={self.max_seq_length}], "
                f"got {self.max_predictions_per_seq}"
            )
        if not 0.0 < self.masked_lm_prob < 1.0:
            raise CorpusError(f"masked_lm_prob must be in (0, 1), got {self.masked_lm_prob}")
        if not 0.0 <= self.short_seq_prob <= 1.0:
            raise CorpusError(f"short_seq_prob must be in [0, 1], got {self.short_seq_prob}")
        if self.dupe_factor < 1:
            raise CorpusError(f"dupe_factor must be >= 1, got {self.dupe_factor}")


# ----------------------------------------------------------------------------- input


def list_text_files(input_files_or_dir: str | os.PathLike | Iterable[str | os.PathLike]) -> list[Path]:
    """A directory -> its ``*.txt`` files (recursive, sorted); a list -> those files."""
    if isinstance(input_files_or_dir, (str, os.PathLike)):
        root = Path(input_files_or_dir)
        if not root.exists():
            raise CorpusError(f"input path does not exist: {root}")
        if root.is_file():
            return [root]
        files = sorted(p for p in root.rglob("*.txt") if p.is_file())
        if not files:
            raise CorpusError(f"no .txt files in input directory {root}")
        return files
    files = [Path(p) for p in input_files_or_dir]
    if not files:
        raise CorpusError("empty list of input files")
    for p in files:
        if not p.is_file():
            raise CorpusError(f"input file does not exist: {p}")
    return files


def read_documents(files: Sequence[Path]) -> list[list[str]]:
    """Documents as lists of sentence strings; blank lines end a document."""
    documents: list[list[str]] = []
    for path in files:
        try:
            with open(path, encoding="utf-8", errors="replace") as f:
                current: list[str] = []
                for line in f:
                    line = line.strip()
                    if line:
                        current.append(line)
                    elif current:
                        documents.append(current)
                        current = []
                if current:  # a file end also ends a document
                    documents.append(current)
        except OSError as exc:
            raise CorpusError(f"cannot read input file {path}: {exc}") from None
    return documents


def split_into_shards(documents: Sequence[Sequence[str]], num_shards: int, seed: int) -> list[list[int]]:
    """Shuffle document indices and cut them into ``num_shards`` contiguous
    groups of roughly equal character count, each with >= 2 documents (NSP
    needs another document to draw random segments from)."""
    n = len(documents)
    if n < 2 * num_shards:
        raise CorpusError(
            f"{n} documents are too few for {num_shards} shard(s): each shard needs at least 2 documents"
        )
    order = list(range(n))
    random.Random(f"tempo-split:{seed}").shuffle(order)
    cumulative = np.cumsum([sum(len(s) for s in documents[i]) for i in order])
    total = float(cumulative[-1])
    bounds = [0]
    for k in range(1, num_shards):
        cut = int(np.searchsorted(cumulative, total * k / num_shards, side="left")) + 1
        cut = max(cut, bounds[-1] + 2)
        cut = min(cut, n - 2 * (num_shards - k))
        bounds.append(cut)
    bounds.append(n)
    return [order[a:b] for a, b in zip(bounds[:-1], bounds[1:])]


# ----------------------------------------------------------------------------- instances


@dataclass
class _Vocab:
    cls_id: int
    sep_id: int
    mask_id: int
    replacement_ids: list[int]  # ids a "random token" may be drawn from
    is_continuation: np.ndarray  # bool per id: token starts with "##"


def _vocab_info(tokenizer: WordPieceTokenizer) -> _Vocab:
    specials = tokenizer.special_ids()
    return _Vocab(
        cls_id=tokenizer.cls_id,
        sep_id=tokenizer.sep_id,
        mask_id=tokenizer.mask_id,
        replacement_ids=[i for i in range(tokenizer.vocab_size) if i not in specials],
        is_continuation=np.array([t.startswith("##") for t in tokenizer.vocab], dtype=bool),
    )


def truncate_seq_pair(tokens_a: list[int], tokens_b: list[int], max_num_tokens: int, rng: random.Random) -> None:
    """Trim the longer side, one token at a time from a random end, in place."""
    while len(tokens_a) + len(tokens_b) > max_num_tokens:
        longer = tokens_a if len(tokens_a) > len(tokens_b) else tokens_b
        if rng.random() < 0.5:
            del longer[0]
        else:
            longer.pop()


def _mask_instance(tokens: list[int], structural: tuple[int, ...], cfg: InstanceConfig, vocab: _Vocab, rng: random.Random):
    """Return (masked tokens, sorted positions, original ids at those positions)."""
    # Candidate units: single positions, or whole words (a piece plus its ## continuations).
    units: list[list[int]] = []
    for pos, tok in enumerate(tokens):
        if pos in structural:
            continue
        if cfg.whole_word_mask and units and vocab.is_continuation[tok] and units[-1][-1] == pos - 1:
            units[-1].append(pos)
        else:
            units.append([pos])
    rng.shuffle(units)
    budget = min(cfg.max_predictions_per_seq, max(1, int(round(len(tokens) * cfg.masked_lm_prob))))
    output = list(tokens)
    chosen: list[int] = []
    for unit in units:
        if len(chosen) >= budget:
            break
        if len(chosen) + len(unit) > budget:
            continue  # a whole word that does not fit; a shorter one may
        for pos in unit:
            r = rng.random()
            if r < 0.8:
                output[pos] = vocab.mask_id
            elif r < 0.9:
                output[pos] = vocab.replacement_ids[rng.randrange(len(vocab.replacement_ids))]
            # else: keep the original token (the model must still predict it)
            chosen.append(pos)
    chosen.sort()
    return output, chosen, [tokens[p] for p in chosen]


def create_instances_from_document(
    documents: Sequence[Sequence[list[int]]],
    doc_index: int,
    cfg: InstanceConfig,
    vocab: _Vocab,
    rng: random.Random,
) -> list[tuple]:
    """Instances (tokens, segment_ids, positions, labels, is_random_next) for one document."""
    document = documents[doc_index]
    max_num_tokens = cfg.max_seq_length - 3
    # Mostly fill the sequence; sometimes aim shorter so the model also sees
    # short inputs as at fine-tuning time.
    target_length = max_num_tokens
    if rng.random() < cfg.short_seq_prob:
        target_length = rng.randint(2, max_num_tokens)

    instances = []
    chunk: list[list[int]] = []
    chunk_length = 0
    i = 0
    while i < len(document):
        chunk.append(document[i])
        chunk_length += len(document[i])
        if i == len(document) - 1 or chunk_length >= target_length:
            a_end = rng.randint(1, len(chunk) - 1) if len(chunk) >= 2 else 1
            tokens_a = [t for seg in chunk[:a_end] for t in seg]
            tokens_b: list[int] = []
            is_random_next = len(chunk) == 1 or rng.random() < 0.5
            if is_random_next:
                b_target = target_length - len(tokens_a)
                other = doc_index
                for _ in range(10):  # documents >= 2 per shard, so this nearly always succeeds
                    other = rng.randrange(len(documents))
                    if other != doc_index:
                        break
                other_doc = documents[other]
                for seg in other_doc[rng.randrange(len(other_doc)):]:
                    tokens_b.extend(seg)
                    if len(tokens_b) >= b_target:
                        break
                # The segments after A were not used: revisit them for the next instance.
                i -= len(chunk) - a_end
            else:
                tokens_b = [t for seg in chunk[a_end:] for t in seg]
            truncate_seq_pair(tokens_a, tokens_b, max_num_tokens, rng)
            if tokens_a and tokens_b:
                tokens = [vocab.cls_id, *tokens_a, vocab.sep_id, *tokens_b, vocab.sep_id]
                segment_ids = [0] * (len(tokens_a) + 2) + [1] * (len(tokens_b) + 1)
                structural = (0, len(tokens_a) + 1, len(tokens) - 1)
                masked, positions, labels = _mask_instance(tokens, structural, cfg, vocab, rng)
                instances.append((masked, segment_ids, positions, labels, int(is_random_next)))
            chunk = []
            chunk_length = 0
        i += 1
    return instances


def instances_to_arrays(instances: Sequence[tuple], cfg: InstanceConfig) -> dict[str, np.ndarray]:
    n, L, P = len(instances), cfg.max_seq_length, cfg.max_predictions_per_seq
    arrays = {
        "input_ids": np.zeros((n, L), dtype=np.int32),
        "input_mask": np.zeros((n, L), dtype=np.int16),
        "segment_ids": np.zeros((n, L), dtype=np.int16),
        "masked_lm_positions": np.zeros((n, P), dtype=np.int16 if L < 2**15 else np.int32),
        "masked_lm_ids": np.zeros((n, P), dtype=np.int32),
        "next_sentence_labels": np.zeros((n,), dtype=np.int16),
    }
    for row, (tokens, segment_ids, positions, labels, is_random_next) in enumerate(instances):
        arrays["input_ids"][row, : len(tokens)] = tokens
        arrays["input_mask"][row, : len(tokens)] = 1
        arrays["segment_ids"][row, : len(tokens)] = segment_ids
        arrays["masked_lm_positions"][row, : len(positions)] = positions
        arrays["masked_lm_ids"][row, : len(labels)] = labels
        arrays["next_sentence_labels"][row] = is_random_next
    return arrays


def write_shard(path: Path, arrays: dict[str, np.ndarray], attrs: dict | None = None) -> None:
    """Write one shard atomically: a temp file in the same directory, then rename."""
    import h5py

    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with h5py.File(tmp, "w") as f:
            for key in SHARD_KEYS:
                f.create_dataset(key, data=arrays[key], compression="gzip", compression_opts=4)
            for k, v in (attrs or {}).items():
                f.attrs[k] = v
        os.replace(tmp, path)
    except BaseException:
        if tmp.exists():
            tmp.unlink()
        raise


def _build_shard(job: dict) -> dict:
    """Worker: tokenize one group of documents, build instances, write the shard."""
    cfg = InstanceConfig(**job["cfg"])
    tokenizer = WordPieceTokenizer(job["vocab_file"], lower_case=job["lower_case"])
    vocab = _vocab_info(tokenizer)

    flat = [s for doc in job["documents"] for s in doc]
    encoded = tokenizer.encode_batch(flat)
    documents, k = [], 0
    for doc in job["documents"]:
        segments = [ids for ids in encoded[k : k + len(doc)] if ids]
        k += len(doc)
        if segments:
            documents.append(segments)

    rng = random.Random(f"tempo-shard:{job['seed']}:{job['shard_index']}")
    instances = []
    if len(documents) >= 1:
        for _ in range(cfg.dupe_factor):
            for doc_index in range(len(documents)):
                instances.extend(create_instances_from_document(documents, doc_index, cfg, vocab, rng))
    rng.shuffle(instances)
    if not instances:
        raise CorpusError(f"shard {job['path']} would be empty: its documents produced no instances")
    arrays = instances_to_arrays(instances, cfg)
    attrs = {"max_seq_length": cfg.max_seq_length, "max_predictions_per_seq": cfg.max_predictions_per_seq,
             "vocab_size": tokenizer.vocab_size, "random_seed": job["seed"]}
    write_shard(Path(job["path"]), arrays, attrs)
    return {
        "path": job["path"],
        "instances": len(instances),
        "tokens": int(arrays["input_mask"].sum(dtype=np.int64)),
        "unk": int(sum(ids.count(tokenizer.unk_id) for ids in encoded)),
        "pieces": int(sum(len(ids) for ids in encoded)),
    }


# ----------------------------------------------------------------------------- driver


def _run_pool(jobs: list[dict], num_workers: int):
    """Yield shard results from worker processes, in completion order."""
    from concurrent.futures import ProcessPoolExecutor, as_completed
    from concurrent.futures.process import BrokenProcessPool

    # fork where available: spawn re-runs the caller's __main__, which fails for
    # stdin/REPL drivers. Workers never touch torch; HF tokenizers is told, via
    # the environment the children inherit, not to use its thread pool (this
    # also silences its after-fork warning). An executor rather than a Pool: a
    # worker killed by the OOM killer raises here instead of hanging forever.
    method = "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"
    previous = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        with ProcessPoolExecutor(min(num_workers, len(jobs)), mp_context=multiprocessing.get_context(method)) as pool:
            futures = [pool.submit(_build_shard, job) for job in jobs]
            try:
                for future in as_completed(futures):
                    yield future.result()
            except BaseException:
                for future in futures:
                    future.cancel()
                raise
    except BrokenProcessPool as exc:
        raise CorpusError(f"a shard worker process died (out of memory?): {exc}") from None
    finally:
        if previous is None:
            os.environ.pop("TOKENIZERS_PARALLELISM", None)
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = previous


def _create_shards(
    input_files_or_dir,
    output_dir,
    vocab_file=None,
    *,
    max_seq_length: int = 128,
    max_predictions_per_seq: int = 20,
    masked_lm_prob: float = 0.15,
    dupe_factor: int = 5,
    short_seq_prob: float = 0.1,
    whole_word_mask: bool = False,
    random_seed: int = 12345,
    num_shards: int = 1,
    num_workers: int = 1,
    do_lower_case: bool = True,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    shard_prefix: str = "pretrain",
    progress: bool = False,
) -> tuple[list[Path], dict]:
    start = time.perf_counter()
    cfg = InstanceConfig(max_seq_length, max_predictions_per_seq, masked_lm_prob, dupe_factor, short_seq_prob,
                         whole_word_mask)
    cfg.validate()
    if num_shards < 1:
        raise CorpusError(f"num_shards must be >= 1, got {num_shards}")
    files = list_text_files(input_files_or_dir)
    documents = read_documents(files)
    if not documents:
        where = input_files_or_dir if isinstance(input_files_or_dir, (str, os.PathLike)) else files[0].parent
        raise CorpusError(f"no documents (non-blank lines) in the text files under {where}")
    groups = split_into_shards(documents, num_shards, random_seed)

    output_dir = Path(output_dir)
    try:
        output_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise CorpusError(f"cannot create output directory {output_dir}: {exc}") from None
    if vocab_file is None:
        vocab_file = train_wordpiece_vocab(files, vocab_size, output_dir / "vocab.txt", lower_case=do_lower_case)
    WordPieceTokenizer(vocab_file, lower_case=do_lower_case)  # fail here, not in a worker

    paths = [output_dir / f"{shard_prefix}_{k:05d}.hdf5" for k in range(num_shards)]
    stale = sorted((set(output_dir.glob("*.hdf5")) | set(output_dir.glob("*.h5"))) - set(paths))
    if stale:
        print(f"warning: {output_dir} also holds {len(stale)} other shard file(s), e.g. {stale[0].name}; "
              "a loader reading this directory will include them", file=sys.stderr)
    jobs = [
        {"documents": [documents[i] for i in group], "path": str(path), "shard_index": k, "seed": random_seed,
         "vocab_file": str(vocab_file), "lower_case": do_lower_case, "cfg": asdict(cfg)}
        for k, (group, path) in enumerate(zip(groups, paths))
    ]
    from tqdm.auto import tqdm

    bar = tqdm(total=len(jobs), unit="shard", desc="create shards", disable=not progress)
    results = []
    try:
        if num_workers <= 1 or len(jobs) == 1:
            for job in jobs:
                results.append(_build_shard(job))
                bar.update()
        else:
            for result in _run_pool(jobs, num_workers):
                results.append(result)
                bar.update()
    finally:
        bar.close()
    stats = {
        "shards": len(paths),
        "documents": len(documents),
        "instances": sum(r["instances"] for r in results),
        "tokens": sum(r["tokens"] for r in results),
        "unk_fraction": sum(r["unk"] for r in results) / max(1, sum(r["pieces"] for r in results)),
        "seconds": time.perf_counter() - start,
        "output_dir": str(output_dir),
        "vocab_file": str(vocab_file),
    }
    return paths, stats


def create_shards(input_files_or_dir, output_dir, vocab_file=None, **kwargs) -> list[Path]:
    """Build shards from a text directory (or list of files); returns the shard paths.

    ``vocab_file=None`` trains a WordPiece vocab (``vocab_size``, default 30522)
    into ``output_dir/vocab.txt``. Keyword arguments: ``max_seq_length=128,
    max_predictions_per_seq=20, masked_lm_prob=0.15, dupe_factor=5,
    short_seq_prob=0.1, whole_word_mask=False, random_seed=12345, num_shards=1,
    num_workers=1, do_lower_case=True, vocab_size=30522, shard_prefix="pretrain",
    progress=False``. Raises ``DataError`` (a ``ValueError``) on bad input.
    """
    return _create_shards(input_files_or_dir, output_dir, vocab_file, **kwargs)[0]


def _parse_args(argv):
    p = argparse.ArgumentParser(
        prog="python -m tempo.bert.data.create_pretraining_data",
        description="Create DLE-format HDF5 BERT pretraining shards from one-sentence-per-line text.",
    )
    p.add_argument("--input_dir", required=True, help="directory of .txt files (documents separated by blank lines)")
    p.add_argument("--output_dir", required=True)
    p.add_argument("--vocab_file", default=None, help="vocab.txt; when omitted one is trained into OUTPUT_DIR/vocab.txt")
    p.add_argument("--vocab_size", type=int, default=DEFAULT_VOCAB_SIZE, help="size of a trained vocab")
    p.add_argument("--max_seq_length", type=int, default=128)
    p.add_argument("--max_predictions_per_seq", type=int, default=20)
    p.add_argument("--masked_lm_prob", type=float, default=0.15)
    p.add_argument("--dupe_factor", type=int, default=5)
    p.add_argument("--short_seq_prob", type=float, default=0.1)
    p.add_argument("--random_seed", type=int, default=12345)
    p.add_argument("--num_shards", type=int, default=1)
    p.add_argument("--num_workers", type=int, default=1)
    p.add_argument("--whole_word_mask", action="store_true")
    case = p.add_mutually_exclusive_group()
    case.add_argument("--do_lower_case", dest="do_lower_case", action="store_true", default=True)
    case.add_argument("--no_lower_case", dest="do_lower_case", action="store_false")
    p.add_argument("--no_progress", action="store_true", help="hide the progress bar")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse_args(argv)
    try:
        _, stats = _create_shards(
            args.input_dir,
            args.output_dir,
            args.vocab_file,
            max_seq_length=args.max_seq_length,
            max_predictions_per_seq=args.max_predictions_per_seq,
            masked_lm_prob=args.masked_lm_prob,
            dupe_factor=args.dupe_factor,
            short_seq_prob=args.short_seq_prob,
            whole_word_mask=args.whole_word_mask,
            random_seed=args.random_seed,
            num_shards=args.num_shards,
            num_workers=args.num_workers,
            do_lower_case=args.do_lower_case,
            vocab_size=args.vocab_size,
            progress=not args.no_progress,
        )
    except (DataError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    print(
        f"wrote {stats['shards']} shard(s) to {stats['output_dir']}: {stats['instances']} instances, "
        f"{stats['tokens']} tokens from {stats['documents']} documents "
        f"([UNK] {100 * stats['unk_fraction']:.2f}% of word pieces, vocab {stats['vocab_file']}) "
        f"in {stats['seconds']:.1f}s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
