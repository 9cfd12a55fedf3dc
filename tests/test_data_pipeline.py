"""Text -> HDF5 shards -> batches: shard content, determinism, DLE compatibility, errors, resume, DDP."""

from __future__ import annotations

import subprocess
import sys
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
from tempo.bert.data.tokenization import DataError, load_vocab, train_wordpiece_vocab

SEQ, PRED = 48, 7


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("corpus")
    files = write_sample_corpus(root / "text", num_documents=80, seed=5)
    vocab = root / "vocab.txt"
    train_wordpiece_vocab(files, 700, vocab)
    shards = create_shards(root / "text", root / "shards", vocab, max_seq_length=SEQ, max_predictions_per_seq=PRED,
                           dupe_factor=2, num_shards=3, random_seed=11)
    return {"root": root, "text": root / "text", "vocab": vocab, "shards": root / "shards", "paths": shards}


def _arrays(path: Path) -> dict[str, np.ndarray]:
    with h5py.File(path, "r") as f:
        return {k: f[k][...] for k in SHARD_KEYS}


def test_shard_content_follows_the_dle_layout(corpus):
    vocab = load_vocab(corpus["vocab"])
    cls, sep, mask = vocab.index("[CLS]"), vocab.index("[SEP]"), vocab.index("[MASK]")
    masked_as_mask = masked_total = kept = 0
    labels = set()
    for path in corpus["paths"]:
        a = _arrays(path)
        n = len(a["input_ids"])
        assert a["input_ids"].shape == a["input_mask"].shape == a["segment_ids"].shape == (n, SEQ)
        assert a["masked_lm_positions"].shape == a["masked_lm_ids"].shape == (n, PRED)
        assert a["next_sentence_labels"].shape == (n,)
        labels |= set(a["next_sentence_labels"].tolist())
        for row in range(n):
            length = int(a["input_mask"][row].sum())
            ids, seg = a["input_ids"][row], a["segment_ids"][row]
            assert (a["input_mask"][row][:length] == 1).all() and (a["input_mask"][row][length:] == 0).all()
            assert ids[0] == cls and ids[length - 1] == sep
            seps = np.flatnonzero(ids[:length] == sep)
            assert len(seps) == 2  # after segment A and at the end
            assert (seg[: seps[0] + 1] == 0).all() and (seg[seps[0] + 1: length] == 1).all() and (seg[length:] == 0).all()
            positions = a["masked_lm_positions"][row]
            real = positions[positions != 0]
            assert 1 <= len(real) <= PRED and len(set(real.tolist())) == len(real)
            assert (real < length).all() and not np.isin(real, seps).any()
            masked_total += len(real)
            masked_as_mask += int((ids[real] == mask).sum())
            kept += int((ids[real] == a["masked_lm_ids"][row][: len(real)]).sum())
            assert (a["masked_lm_ids"][row][len(real):] == 0).all()
    assert labels == {0, 1}  # both NSP labels present
    # 80% of the masked positions show [MASK]; with ~1000 predictions, 3 sigma is about +-0.04.
    assert abs(masked_as_mask / masked_total - 0.8) < 0.05, masked_as_mask / masked_total
    # 10% keep their token (a random replacement can also hit it, rarely).
    assert abs(kept / masked_total - 0.1) < 0.04, kept / masked_total


def test_masking_labels_are_the_original_tokens_and_whole_words_stay_together():
    from tempo.bert.data.create_pretraining_data import InstanceConfig, _mask_instance, _Vocab

    continuation = np.zeros(100, dtype=bool)
    continuation[50:] = True  # ids >= 50 play "##piece" tokens
    vocab = _Vocab(cls_id=2, sep_id=3, mask_id=4, replacement_ids=list(range(5, 100)), is_continuation=continuation)
    rng = __import__("random").Random(0)
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
            if whole_word:  # a masked piece implies its whole word is masked
                chosen = set(positions)
                for p in chosen:
                    if continuation[tokens[p]]:
                        assert p - 1 in chosen
                    if p + 1 < len(tokens) and continuation[tokens[p + 1]] and p + 1 not in structural:
                        assert p + 1 in chosen


def test_labels_are_the_original_tokens(corpus):
    dataset = PretrainingShardDataset(corpus["paths"][0])
    a = _arrays(corpus["paths"][0])
    sample = dataset[0]
    real = int((a["masked_lm_positions"][0] != 0).sum())
    assert sample["masked_lm_labels"][:real].tolist() == a["masked_lm_ids"][0][:real].tolist()
    assert (sample["masked_lm_labels"][real:] == -1).all()
    assert all(v.dtype == torch.int64 for v in sample.values())


def test_shards_are_deterministic_and_independent_of_workers(corpus, tmp_path):
    again = create_shards(corpus["text"], tmp_path / "one", corpus["vocab"], max_seq_length=SEQ,
                          max_predictions_per_seq=PRED, dupe_factor=2, num_shards=3, random_seed=11, num_workers=1)
    parallel = create_shards(corpus["text"], tmp_path / "two", corpus["vocab"], max_seq_length=SEQ,
                             max_predictions_per_seq=PRED, dupe_factor=2, num_shards=3, random_seed=11, num_workers=2)
    for reference, a, b in zip(corpus["paths"], again, parallel):
        ref = _arrays(reference)
        for key in SHARD_KEYS:
            assert np.array_equal(ref[key], _arrays(a)[key]) and np.array_equal(ref[key], _arrays(b)[key]), key


def test_existing_dle_shard_with_int16_arrays_loads(tmp_path):
    path = tmp_path / "dle_shard.hdf5"
    with h5py.File(path, "w") as f:
        f["input_ids"] = np.array([[101, 7, 102, 8, 102, 0]], dtype=np.int16)
        f["input_mask"] = np.array([[1, 1, 1, 1, 1, 0]], dtype=np.int16)
        f["segment_ids"] = np.array([[0, 0, 0, 1, 1, 0]], dtype=np.int16)
        f["masked_lm_positions"] = np.array([[3, 0, 4]], dtype=np.int16)  # the first 0 ends the list
        f["masked_lm_ids"] = np.array([[9, 0, 5]], dtype=np.int16)
        f["next_sentence_labels"] = np.array([1], dtype=np.uint8)
    sample = PretrainingShardDataset(path)[0]
    assert sample["masked_lm_labels"].tolist() == [9, -1, -1]
    assert sample["masked_lm_positions"].tolist() == [3, 0, 0]
    assert sample["next_sentence_labels"].tolist() == 1
    assert all(v.dtype == torch.int64 for v in sample.values())


def test_bad_shards_are_named(corpus, tmp_path):
    good = corpus["paths"][0]
    truncated = tmp_path / "truncated.hdf5"
    truncated.write_bytes(good.read_bytes()[:2000])
    with pytest.raises(ShardError, match="truncated.hdf5"):
        PretrainingShardDataset(truncated)
    missing_key = tmp_path / "missing_key.hdf5"
    with h5py.File(missing_key, "w") as f:
        for key in SHARD_KEYS:
            if key != "masked_lm_ids":
                f[key] = _arrays(good)[key]
    with pytest.raises(ShardError, match="missing_key.hdf5.*masked_lm_ids"):
        PretrainingShardDataset(missing_key)
    flat = tmp_path / "flat.hdf5"
    with h5py.File(flat, "w") as f:
        for key in SHARD_KEYS:
            f[key] = _arrays(good)[key].reshape(-1)
    with pytest.raises(ShardError, match="flat.hdf5"):
        PretrainingShardDataset(flat)
    with pytest.raises(ShardError, match="nowhere"):
        list_shards(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ShardError, match="empty"):
        list_shards(tmp_path / "empty")
    with pytest.raises(ShardError, match="--max_seq_length"):
        PretrainingBatches(corpus["shards"], 2, max_seq_length=SEQ * 2)
    with pytest.raises(ShardError, match="not one batch"):
        PretrainingBatches(corpus["shards"], 100_000)


def _take(stream, count):
    iterator = iter(stream)
    return [next(iterator) for _ in range(count)]


def _same(a, b):
    return all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_resume_continues_with_the_same_batches(corpus, num_workers):
    stream = PretrainingBatches(corpus["shards"], 16, seed=3, num_workers=num_workers)
    per_epoch = sum(stream._batches_in(n) for n in stream.sizes)
    stop, total = per_epoch // 2 + 1, per_epoch + 5  # stop mid-shard; compare past the epoch's end
    full = _take(stream, total)
    first = PretrainingBatches(corpus["shards"], 16, seed=3, num_workers=num_workers)
    _take(first, stop)
    resumed = PretrainingBatches(corpus["shards"], 16, seed=3, num_workers=num_workers)
    resumed.load_state_dict(first.state_dict())
    rest = _take(resumed, total - stop)
    assert all(_same(a, b) for a, b in zip(full[stop:], rest))
    assert resumed.state_dict()["epoch"] >= 1  # the comparison went past an epoch boundary
    assert set(first.state_dict()) == {"epoch", "shard_index", "sample_offset"}


def test_resume_accepts_the_older_state_keys(corpus):
    first = PretrainingBatches(corpus["shards"], 16, seed=3)
    _take(first, 3)
    state = first.state_dict()
    old = PretrainingBatches(corpus["shards"], 16, seed=3)
    old.load_state_dict({"epoch": state["epoch"], "shard_position": state["shard_index"],
                         "batch_in_shard": state["sample_offset"]})
    assert old.state_dict() == state


def test_ddp_ranks_split_the_single_process_batch(corpus):
    single = _take(PretrainingBatches(corpus["shards"], 8, seed=4), 10)
    ranks = [_take(PretrainingBatches(corpus["shards"], 4, seed=4, rank=r, world_size=2), 10) for r in (0, 1)]
    for step in range(10):
        rows = lambda batch: {tuple(x) for x in batch["input_ids"].tolist()}  # noqa: E731
        r0, r1 = rows(ranks[0][step]), rows(ranks[1][step])
        assert r0 | r1 == rows(single[step]) and not (r0 & r1)


def test_ddp_rank_slices_are_disjoint_and_cover_each_shard(corpus):
    world = 3
    ranks = [PretrainingBatches(corpus["shards"], 1, seed=4, rank=r, world_size=world) for r in range(world)]
    for shard_index, n in enumerate(ranks[0].sizes):
        slices = [{i for batch in stream._rank_batches(shard_index) for i in batch} for stream in ranks]
        assert all(len(s) == n // world for s in slices)
        assert not (slices[0] & slices[1] or slices[0] & slices[2] or slices[1] & slices[2])
        assert len(set.union(*slices)) == n - n % world  # at most world_size - 1 samples rest this epoch


def test_synthetic_batches():
    stream = SyntheticPretrainingBatches(batch_size=3, seq_len=16, max_predictions=4, vocab_size=100, seed=2)
    first = _take(stream, 3)
    batch = first[0]
    assert batch["input_ids"].shape == (3, 16) and batch["masked_lm_positions"].shape == (3, 4)
    assert all(v.dtype == torch.int64 for v in batch.values())
    positions = batch["masked_lm_positions"]
    assert (positions >= 1).all() and all(len(set(row.tolist())) == 4 for row in positions)
    again = SyntheticPretrainingBatches(batch_size=3, seq_len=16, max_predictions=4, vocab_size=100, seed=2)
    again.load_state_dict({"epoch": 0, "shard_index": 0, "sample_offset": 2})
    assert _same(next(iter(again)), first[2])
    assert stream.state_dict() == {"epoch": 0, "shard_index": 0, "sample_offset": 3}
    assert torch.equal(batch["masked_lm_labels"], batch["input_ids"].gather(1, positions))


def test_synthetic_batches_with_padding():
    stream = SyntheticPretrainingBatches(batch_size=64, seq_len=12, max_predictions=5, vocab_size=50, seed=1,
                                         min_seq_len=3)
    batch = next(iter(stream))
    lengths = batch["input_mask"].sum(1)
    assert lengths.min() >= 3 and lengths.max() <= 12 and (lengths < 12).any()
    assert torch.equal(batch["input_mask"], (torch.arange(12) < lengths[:, None]).long())
    assert (batch["input_ids"][batch["input_mask"] == 0] == 0).all()
    valid = batch["masked_lm_labels"] != -1
    positions = batch["masked_lm_positions"]
    assert (positions[valid] >= 1).all() and (positions[~valid] == 0).all()
    assert ((positions < lengths[:, None]) | ~valid).all()
    assert (valid.sum(1) == torch.clamp(lengths - 1, max=5)).all()  # short rows fill fewer slots


def test_cli_reports_an_empty_input_dir(tmp_path):
    (tmp_path / "in").mkdir()
    result = subprocess.run([sys.executable, "-m", "tempo.bert.data.create_pretraining_data", "--input_dir",
                             str(tmp_path / "in"), "--output_dir", str(tmp_path / "out")],
                            capture_output=True, text=True)
    assert result.returncode != 0 and "Traceback" not in result.stderr
    assert str(tmp_path / "in") in result.stderr


def test_cli_trains_a_vocab_when_none_is_given(corpus, tmp_path):
    result = subprocess.run([sys.executable, "-m", "tempo.bert.data.create_pretraining_data", "--input_dir",
                             str(corpus["text"]), "--output_dir", str(tmp_path / "out"), "--vocab_size", "500",
                             "--max_seq_length", "32", "--max_predictions_per_seq", "5", "--dupe_factor", "1",
                             "--no_progress"], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert len(load_vocab(tmp_path / "out" / "vocab.txt")) <= 500
    assert list_shards(tmp_path / "out")


def test_vocab_errors_name_the_file(tmp_path):
    with pytest.raises(DataError, match="no_such_vocab.txt"):
        load_vocab(tmp_path / "no_such_vocab.txt")
