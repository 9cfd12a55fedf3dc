"""SQuAD JSON -> checked examples -> fixed-length windows ("features") -> cached arrays.

Reading (``read_squad``) checks the file and fails with ``SquadFormatError`` naming the file and
the question id (or article/paragraph index) of the first problem. Decisions on bad input:
  * not JSON, a missing/ill-typed key, a duplicate question id, an empty context or question:
    error.
  * v2.0 data (``is_impossible`` or an empty answer list) without ``--version_2_with_negative``:
    error that says to pass the flag.
  * a training answer whose ``answer_start`` does not point at its text: moved to the nearest
    occurrence of the text in the context, with one warning that counts them and names the
    first; if the text does not occur in the context at all: error. Prediction files are not
    checked for this: evaluation uses only the answer texts, as the official scripts do.
  * a prediction file without any answers: fine, ``SquadData.has_gold`` is False (predict only).
  * ``is_impossible`` that is not true/false: error. One that contradicts the answers (true with
    answers, false with an empty answer list): error naming the question, or with
    ``skip_inconsistent`` (``--skip_inconsistent_questions``) left out of training and scoring,
    counted in ``SquadData.skipped`` with one warning.
  * text the tokenizer cannot encode (a lone surrogate from a ``\\ud800`` escape) in a context,
    question, answer or id: error naming the question and the character.

Features (``build_features``), as Google's/DLE's run_squad: [CLS] question [SEP] context-window
[SEP], the question cut to ``max_query_length`` tokens, the context cut into windows that start
``doc_stride`` tokens apart. Character answer spans map to WordPiece tokens through the
tokenizer's offsets (the first token ending after the answer starts, the last token starting
before it ends), which also snaps answers that begin or end inside a word to whole tokens. A
window that does not contain the whole answer gets start = end = 0 ([CLS]). Each context token
is "max context" in the one window where min(left, right) context is largest (+0.01 * window
length to break ties); only there may an answer start at it.

Cache (``load_or_build_features``): an ``.npz`` file (numpy arrays only, loaded with
allow_pickle=False) named by a hash of the input file's bytes, the vocabulary's bytes and every
feature setting, so any change rebuilds it; written atomically. An entry that cannot be read (a
damaged zip or member: ``zipfile.BadZipFile``, ``zlib.error``, EOFError, ...) or whose arrays do not
fit (missing/extra arrays, shapes, ids outside the examples) is rebuilt with a warning.
"""

from __future__ import annotations

import hashlib
import json
import os
import warnings
import zipfile
import zlib
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Sequence

import numpy as np
from tqdm import tqdm

from tempo.utils import atomic_write
from tempo.bert.data.tokenization import DataError, WordPieceTokenizer

FEATURES_FORMAT_VERSION = 1


class SquadFormatError(DataError):
    """A SQuAD JSON file is malformed or does not fit the requested mode."""


@dataclass
class SquadExample:
    qas_id: str
    question: str
    context: str
    answer_text: str = ""        # training target ("" for no answer / unknown)
    answer_start: int = -1       # character offset in context, -1 when none
    is_impossible: bool = False


@dataclass
class SquadData:
    path: str
    examples: list[SquadExample]
    dataset: list[dict[str, Any]]  # the file's "data" list, as the official evaluators read it
    has_gold: bool                 # answers present: predictions can be scored
    skipped: list[str] = field(default_factory=list)  # ids left out by skip_inconsistent


# ---------------------------------------------------------------------------------------------
# Reading and checking
# ---------------------------------------------------------------------------------------------
def _require(obj: Any, key: str, kind: type, path: str, where: str) -> Any:
    if not isinstance(obj, dict) or key not in obj:
        raise SquadFormatError(f"{path}: {where}: missing key {key!r}")
    value = obj[key]
    if not isinstance(value, kind):
        raise SquadFormatError(f"{path}: {where}: {key!r} should be a {kind.__name__}, "
                               f"found {type(value).__name__}")
    return value


def _nearest_occurrence(context: str, text: str, near: int) -> int:
    best = -1
    pos = context.find(text)
    while pos >= 0:
        if best < 0 or abs(pos - near) < abs(best - near):
            best = pos
        pos = context.find(text, pos + 1)
    return best


def _check_text(text: str, path: str, where: str, what: str) -> None:
    """Text the tokenizer can encode: JSON's \\ud800-style escapes can decode to lone surrogates,
    which are not Unicode text (the tokenizer raises a bare TypeError on them)."""
    if text.isascii():
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise SquadFormatError(f"{path}: {where}: the {what} holds {text[exc.start]!r} at character {exc.start}, "
                               "a lone surrogate (from a \\uD800-\\uDFFF escape), which is not text the "
                               "tokenizer can encode") from None


def read_squad(path: str | os.PathLike, version_2_with_negative: bool = False,
               for_training: bool = False, skip_inconsistent: bool = False) -> SquadData:
    """Read and check a SQuAD v1.1/v2.0 JSON file (see the module docstring for the rules).

    ``skip_inconsistent``: a question whose ``is_impossible`` disagrees with its answers is left
    out (of the examples and of the data scored), counted in ``SquadData.skipped`` and warned
    about once, instead of being an error."""
    path = str(path)
    try:
        with open(path, encoding="utf-8") as fh:
            raw = json.load(fh)
    except FileNotFoundError:
        raise SquadFormatError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise SquadFormatError(f"{path}: is a directory, expected a SQuAD JSON file") from None
    except UnicodeDecodeError as exc:
        raise SquadFormatError(f"{path}: not UTF-8 text ({exc.reason})") from None
    except json.JSONDecodeError as exc:
        raise SquadFormatError(f"{path}: not valid JSON: {exc.msg} at line {exc.lineno} "
                               f"column {exc.colno}") from None
    data = _require(raw, "data", list, path, "top level")

    # First pass: structure, and whether the file carries answers at all.
    questions: list[tuple[dict, dict]] = []  # (paragraph, qa)
    seen_ids: set[str] = set()
    for a, article in enumerate(data):
        paragraphs = _require(article, "paragraphs", list, path, f"article {a}")
        for p, paragraph in enumerate(paragraphs):
            where = f"article {a} paragraph {p}"
            context = _require(paragraph, "context", str, path, where)
            qas = _require(paragraph, "qas", list, path, where)
            for q, qa in enumerate(qas):
                if not isinstance(qa, dict) or not isinstance(qa.get("id"), (str, int)):
                    raise SquadFormatError(f"{path}: {where} question {q}: missing key 'id'")
                qid = str(qa["id"])
                _check_text(qid, path, f"{where} question {q}", "id")
                if q == 0:  # once per paragraph, named by its first question
                    _check_text(context, path, f"question {qid!r} ({where})", "context")
                qa["id"] = qid  # predictions are keyed by string ids, as the evaluators expect
                if qid in seen_ids:
                    raise SquadFormatError(f"{path}: question id {qid!r} appears twice")
                seen_ids.add(qid)
                question = _require(qa, "question", str, path, f"question {qid!r}")
                _check_text(question, path, f"question {qid!r}", "question")
                if not question.strip():
                    raise SquadFormatError(f"{path}: question {qid!r}: the question is empty")
                if not context.strip():
                    raise SquadFormatError(f"{path}: question {qid!r}: its context is empty")
                if "answers" in qa and not isinstance(qa["answers"], list):
                    raise SquadFormatError(f"{path}: question {qid!r}: 'answers' should be a list")
                for answer in qa.get("answers", []):
                    _check_text(_require(answer, "text", str, path, f"question {qid!r} answer"), path,
                                f"question {qid!r}", "answer text")
                if "is_impossible" in qa and not isinstance(qa["is_impossible"], bool):
                    raise SquadFormatError(f"{path}: question {qid!r}: 'is_impossible' should be true or "
                                           f"false, found {qa['is_impossible']!r}")
                questions.append((paragraph, qa))
    has_gold = any(qa.get("answers") or qa.get("is_impossible") for _, qa in questions)

    examples: list[SquadExample] = []
    moved: list[str] = []
    skipped: list[str] = []
    for paragraph, qa in questions:
        qid, context = qa["id"], paragraph["context"]
        answers = qa.get("answers", [])
        if has_gold and "answers" not in qa:
            raise SquadFormatError(f"{path}: question {qid!r}: missing key 'answers' "
                                   "(other questions in this file have answers)")
        conflict = _impossible_conflict(qa, has_gold)
        if conflict:
            if not skip_inconsistent:
                raise SquadFormatError(f"{path}: question {qid!r}: {conflict} (pass --skip_inconsistent_questions "
                                       "to leave such questions out)")
            skipped.append(qid)
            continue
        unanswerable = bool(qa.get("is_impossible")) or (has_gold and not answers)
        if unanswerable and not version_2_with_negative:
            raise SquadFormatError(
                f"{path}: question {qid!r} has no answer (is_impossible or an empty answer list): "
                "this is SQuAD v2.0 data; pass --version_2_with_negative")
        if for_training and not has_gold:
            raise SquadFormatError(f"{path}: no question has answers; a training file needs them "
                                   f"(first question: {qid!r})")
        example = SquadExample(qid, qa["question"], context, is_impossible=unanswerable)
        if for_training and not unanswerable:
            answer = answers[0]  # DLE trains on exactly one answer; extra ones are ignored
            text = answer["text"]
            start = answer.get("answer_start")
            if not isinstance(start, int) or isinstance(start, bool):
                raise SquadFormatError(f"{path}: question {qid!r}: answer_start should be an "
                                       f"integer, found {start!r}")
            if not text.strip():
                raise SquadFormatError(f"{path}: question {qid!r}: the answer text is empty")
            if context[start:start + len(text)] != text:
                found = _nearest_occurrence(context, text, start)
                if found < 0:
                    raise SquadFormatError(f"{path}: question {qid!r}: answer {text!r} does not "
                                           "occur in its context")
                moved.append(f"{qid!r} ({start} -> {found})")
                start = found
            example.answer_text, example.answer_start = text, start
        examples.append(example)
    if skipped:
        _drop_questions(data, set(skipped))
        warnings.warn(f"{path}: skipped {len(skipped)} question(s) whose is_impossible disagrees with their "
                      f"answers, e.g. {skipped[0]!r}", stacklevel=2)
    if moved:
        warnings.warn(f"{path}: {len(moved)} answer(s) had an answer_start that does not point at "
                      f"the answer text; moved to the nearest occurrence, e.g. question {moved[0]}",
                      stacklevel=2)
    if not examples:
        raise SquadFormatError(f"{path}: no questions found")
    return SquadData(path, examples, data, has_gold, skipped)


def _impossible_conflict(qa: dict, has_gold: bool) -> str | None:
    """Why a question's is_impossible (a bool, checked before) contradicts its answers, or None.

    v2.0's rule: an impossible question has an empty answer list (its guesses go under
    "plausible_answers"), a possible one at least one answer. Files without answers (predict
    only) and questions without the key are not judged."""
    if "is_impossible" not in qa or not has_gold:
        return None
    answers = qa.get("answers", [])
    if qa["is_impossible"] and answers:
        return f"is_impossible is true but it has {len(answers)} answer(s)"
    if not qa["is_impossible"] and not answers:
        return "is_impossible is false but its answer list is empty"
    return None


def _drop_questions(data: list, ids: set[str]) -> None:
    """Remove questions from the file's data (as the official evaluators read it)."""
    for article in data:
        for paragraph in article["paragraphs"]:
            paragraph["qas"] = [qa for qa in paragraph["qas"] if qa["id"] not in ids]


# ---------------------------------------------------------------------------------------------
# Features
# ---------------------------------------------------------------------------------------------
@dataclass
class SquadFeatures:
    """One row per window. Training rows carry positions; prediction rows carry what maps tokens
    back to the context (offsets, max_context) and which example they belong to."""

    input_ids: np.ndarray                       # [N, L] int32
    segment_ids: np.ndarray                     # [N, L] int8
    input_mask: np.ndarray                      # [N, L] int8
    example_index: np.ndarray                   # [N] int32: index into SquadData.examples
    start_positions: np.ndarray | None = None   # [N] int32 (training)
    end_positions: np.ndarray | None = None     # [N] int32 (training)
    offsets: np.ndarray | None = None           # [N, L, 2] int32, -1 outside the context (prediction)
    max_context: np.ndarray | None = None       # [N, L] bool (prediction)

    def __len__(self) -> int:
        return len(self.input_ids)

    def arrays(self) -> dict[str, np.ndarray]:
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}


def _encode_with_offsets(tokenizer: WordPieceTokenizer, texts: Sequence[str], names: Sequence[str] = ()):
    # The project tokenizer's Rust pipeline; its public API returns ids only, and answers need
    # character offsets. read_squad refuses text it cannot encode; examples built in code are
    # named here (``names``: what each text is, e.g. "question 'q7' context").
    try:
        return tokenizer._tok.encode_batch(list(texts), add_special_tokens=False)
    except (TypeError, ValueError) as exc:  # tokenizers raises TypeError on lone surrogates
        for text, name in zip(texts, names or [f"text {i}" for i in range(len(texts))]):
            try:
                tokenizer._tok.encode(text, add_special_tokens=False)
            except (TypeError, ValueError):
                raise SquadFormatError(f"{name}: the tokenizer cannot encode {text[:60]!r}... ({exc})") from None
        raise


def _window_starts(num_tokens: int, window: int, stride: int) -> list[int]:
    starts = [0]
    while starts[-1] + window < num_tokens:
        starts.append(starts[-1] + min(window, stride))
    return starts


def _max_context_window(starts: list[int], window: int, num_tokens: int) -> np.ndarray:
    """For each context token, the index of the window in which it has the most context."""
    best = np.zeros(num_tokens, dtype=np.int64)
    best_score = np.full(num_tokens, -np.inf)
    for w, start in enumerate(starts):
        length = min(window, num_tokens - start)
        pos = np.arange(start, start + length)
        score = np.minimum(pos - start, start + length - 1 - pos) + 0.01 * length
        better = score > best_score[pos]  # strict: the earlier window keeps ties, as DLE
        best[pos[better]] = w
        best_score[pos[better]] = score[better]
    return best


def _answer_token_span(offsets: Sequence[tuple[int, int]], char_start: int, char_end: int) -> tuple[int, int] | None:
    """Token span covering [char_start, char_end): first token ending after the start, last token
    starting before the end. None when no token overlaps (e.g. the answer is only whitespace)."""
    first = next((i for i, (s, e) in enumerate(offsets) if e > char_start), None)
    last = next((i for i in range(len(offsets) - 1, -1, -1) if offsets[i][0] < char_end), None)
    if first is None or last is None or last < first:
        return None
    return first, last


def build_features(examples: Sequence[SquadExample], tokenizer: WordPieceTokenizer,
                   max_seq_length: int = 384, doc_stride: int = 128, max_query_length: int = 64,
                   for_training: bool = False, progress: bool = True) -> SquadFeatures:
    """Windows of every example; see the module docstring for the layout and the rules."""
    if max_seq_length - min(max_query_length, max_seq_length) - 3 <= 0:
        raise ValueError("max_seq_length must exceed max_query_length + 3")
    first_asker = {}
    for ex in examples:
        first_asker.setdefault(ex.context, ex.qas_id)
    contexts = sorted(first_asker)
    context_enc = dict(zip(contexts, _encode_with_offsets(
        tokenizer, contexts, [f"question {first_asker[c]!r}: context" for c in contexts])))
    question_ids = [e.ids[:max_query_length] for e in _encode_with_offsets(
        tokenizer, [ex.question for ex in examples], [f"question {ex.qas_id!r}: question" for ex in examples])]

    rows: dict[str, list] = {k: [] for k in ("input_ids", "segment_ids", "example_index", "start", "end",
                                             "offsets", "max_context")}
    unmappable = 0
    for index, example in enumerate(tqdm(examples, desc="SQuAD features", unit="question",
                                         disable=not progress, dynamic_ncols=True)):
        enc = context_enc[example.context]
        doc_ids, doc_offsets = enc.ids, enc.offsets
        query = question_ids[index]
        window = max_seq_length - len(query) - 3
        starts = _window_starts(len(doc_ids), window, doc_stride)
        best_window = _max_context_window(starts, window, len(doc_ids))

        answer_span = None
        if for_training and not example.is_impossible:
            answer_span = _answer_token_span(doc_offsets, example.answer_start,
                                             example.answer_start + len(example.answer_text))
            if answer_span is None:
                unmappable += 1

        prefix = [tokenizer.cls_id, *query, tokenizer.sep_id]
        for w, start in enumerate(starts):
            end = min(start + window, len(doc_ids))  # exclusive
            ids = prefix + doc_ids[start:end] + [tokenizer.sep_id]
            rows["input_ids"].append(ids)
            rows["segment_ids"].append(len(prefix))  # where segment 1 begins
            rows["example_index"].append(index)
            if for_training:
                s = e = 0
                if answer_span is not None and start <= answer_span[0] and answer_span[1] < end:
                    s = answer_span[0] - start + len(prefix)
                    e = answer_span[1] - start + len(prefix)
                rows["start"].append(s)
                rows["end"].append(e)
            else:
                rows["offsets"].append((len(prefix), doc_offsets[start:end]))
                rows["max_context"].append((len(prefix), best_window[start:end] == w))
    if unmappable:
        warnings.warn(f"{unmappable} training answer(s) cover no token (whitespace only?); "
                      "they are trained as 'no answer in this window'", stacklevel=2)

    n, length = len(rows["input_ids"]), max_seq_length
    input_ids = np.full((n, length), tokenizer.pad_id, dtype=np.int32)
    input_mask = np.zeros((n, length), dtype=np.int8)
    segment_ids = np.zeros((n, length), dtype=np.int8)
    for i, (ids, seg_start) in enumerate(zip(rows["input_ids"], rows["segment_ids"])):
        input_ids[i, :len(ids)] = ids
        input_mask[i, :len(ids)] = 1
        segment_ids[i, seg_start:len(ids)] = 1
    features = SquadFeatures(input_ids, segment_ids, input_mask,
                             np.asarray(rows["example_index"], dtype=np.int32))
    if for_training:
        features.start_positions = np.asarray(rows["start"], dtype=np.int32)
        features.end_positions = np.asarray(rows["end"], dtype=np.int32)
    else:
        offsets = np.full((n, length, 2), -1, dtype=np.int32)
        max_context = np.zeros((n, length), dtype=bool)
        for i, ((first, spans), (_, is_max)) in enumerate(zip(rows["offsets"], rows["max_context"])):
            if spans:
                offsets[i, first:first + len(spans)] = spans
                max_context[i, first:first + len(spans)] = is_max
        features.offsets, features.max_context = offsets, max_context
    return features


# ---------------------------------------------------------------------------------------------
# Cache
# ---------------------------------------------------------------------------------------------
def _file_digest(path: str | os.PathLike) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def feature_cache_path(input_file: str | os.PathLike, vocab_file: str | os.PathLike, cache_dir: str | os.PathLike | None,
                       **settings: Any) -> Path:
    """Where the features of ``input_file`` under ``settings`` are cached (default: next to it)."""
    key = json.dumps({"format": FEATURES_FORMAT_VERSION, "input": _file_digest(input_file),
                      "vocab": _file_digest(vocab_file), **settings}, sort_keys=True)
    name = f"{Path(input_file).name}.{hashlib.sha256(key.encode()).hexdigest()[:16]}.features.npz"
    return Path(cache_dir if cache_dir else Path(input_file).parent) / name


def save_features(features: SquadFeatures, path: str | os.PathLike) -> None:
    with atomic_write(path, "wb") as fh:
        np.savez(fh, **features.arrays())


# What a damaged .npz raises: np.load -> zipfile.BadZipFile / ValueError (not a zip, or pickled
# data refused) / OSError / EOFError; reading a member -> BadZipFile (CRC, bad header), zlib.error
# (bad deflate stream), EOFError / ValueError (truncated array header); SquadFeatures(**arrays)
# -> TypeError (missing or unknown arrays).
CACHE_ERRORS = (OSError, EOFError, ValueError, KeyError, TypeError, zipfile.BadZipFile, zlib.error)


def load_features(path: str | os.PathLike) -> SquadFeatures:
    with np.load(path, allow_pickle=False) as npz:
        return SquadFeatures(**{name: npz[name] for name in npz.files})


def _check_cached(features: SquadFeatures, num_examples: int, max_seq_length: int, for_training: bool) -> None:
    """ValueError naming what does not fit, for a cache entry that loaded but is not ours."""
    n = len(features.input_ids)
    want = ["input_ids", "segment_ids", "input_mask", "example_index"]
    want += ["start_positions", "end_positions"] if for_training else ["offsets", "max_context"]
    for name in want:
        array = getattr(features, name)
        if array is None or len(array) != n:
            raise ValueError(f"array {name} is missing or has {0 if array is None else len(array)} rows, not {n}")
    for name in ("input_ids", "segment_ids", "input_mask"):
        if getattr(features, name).shape != (n, max_seq_length):
            raise ValueError(f"array {name} has shape {getattr(features, name).shape}, not ({n}, {max_seq_length})")
    if n == 0 or int(features.example_index.min()) < 0 or int(features.example_index.max()) >= num_examples:
        raise ValueError(f"example_index does not fit the {num_examples} examples")


def load_or_build_features(data: SquadData, tokenizer: WordPieceTokenizer, *, max_seq_length: int,
                           doc_stride: int, max_query_length: int, for_training: bool,
                           cache_dir: str | None = None, use_cache: bool = True,
                           progress: bool = True) -> tuple[SquadFeatures, Path | None]:
    """Features from the cache when a valid entry exists, else built (and cached). Returns the
    features and the cache file used or written (None when caching is off or failed)."""
    settings = dict(max_seq_length=max_seq_length, doc_stride=doc_stride, max_query_length=max_query_length,
                    for_training=for_training, lower_case=tokenizer.lower_case)
    cache = feature_cache_path(data.path, tokenizer.vocab_file, cache_dir, **settings) if use_cache else None
    if cache is not None and cache.is_file():
        try:
            features = load_features(cache)
            _check_cached(features, len(data.examples), max_seq_length, for_training)
            return features, cache
        except CACHE_ERRORS as exc:  # truncated/corrupt/foreign: rebuild
            warnings.warn(f"feature cache {cache} is unreadable ({type(exc).__name__}: {exc}); rebuilding it",
                          stacklevel=2)
    features = build_features(data.examples, tokenizer, for_training=for_training, progress=progress,
                              **{k: settings[k] for k in ("max_seq_length", "doc_stride", "max_query_length")})
    if cache is not None:
        try:
            save_features(features, cache)
        except OSError as exc:  # a read-only data folder must not stop the run
            warnings.warn(f"cannot write feature cache {cache} ({exc.strerror or exc}); "
                          "pass --cache_dir to cache elsewhere", stacklevel=2)
            cache = None
    return features, cache
